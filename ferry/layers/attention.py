"""Self-attention with a KV cache: GQA, optional q/k/v biases (qwen2), q/k norms per head (qwen3, gemma3) or across
all heads (minimax-m2), a sliding window (gemma3's local layers), an output gate (Qwen3.5); and DeepSeek's multi-head
latent attention."""

from __future__ import annotations

from dataclasses import InitVar, dataclass, field

import numpy as np
import torch

from ferry.layers.indexer import Indexer
from ferry.layers.rope import Rope
from ferry.weight import Weight
from ferry.quant import Q, row_bytes


@dataclass
class Attention:
    layer: int
    wq: Weight
    wk: Weight
    wv: Weight
    wo: Weight
    n_head: int
    n_head_kv: int
    head_dim_k: int
    head_dim_v: int
    rope: Rope
    scale: float
    norm_eps: float
    bq: torch.Tensor | None = None
    bk: torch.Tensor | None = None
    bv: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    window: int = 0
    bo: torch.Tensor | None = None  # the output projection's bias (gpt-oss)
    norm_whole: bool = False  # q_norm / k_norm span all heads' values at once (minimax-m2), not each head's
    sinks: torch.Tensor | None = None  # (n_head,) each head's sink logit: in the softmax's denominator only (gpt-oss)
    gated: bool = False  # wq gives each head's query and then its output gate: out * sigmoid(gate) (Qwen3.5, Qwen3-Next)

    def __call__(self, ops, x, norm: torch.Tensor | None = None, eps: float = 0.0):
        """The layer's output for x, or for RMSNorm(x) * norm when norm is given (the block's pre-norm, which a
        fused form takes inside its projection)."""
        out = ops.fused_attention(self, x, norm, eps)
        if out is None:
            out = self.unfused(ops, x if norm is None else ops.rms_norm(x, norm, eps))
        return ops.linear(out, self.wo, self.bo)

    def unfused(self, ops, x):
        """The layer op by op, up to its output projection: (n, n_head * head_dim_v)."""
        q, k = ops.linear(x, self.wq, self.bq), ops.linear(x, self.wk, self.bk)
        gate = None
        if self.gated:
            q, gate = ops.split(ops.heads(q, self.n_head, 2 * self.head_dim_k), [self.head_dim_k, self.head_dim_k])
        if self.q_norm is not None and self.norm_whole:
            q = ops.rms_norm(q, self.q_norm, self.norm_eps)
            k = ops.rms_norm(k, self.k_norm, self.norm_eps)
        q, k = ops.heads(q, self.n_head, self.head_dim_k), ops.heads(k, self.n_head_kv, self.head_dim_k)
        v = ops.heads(ops.linear(x, self.wv, self.bv), self.n_head_kv, self.head_dim_v)
        if self.q_norm is not None and not self.norm_whole:
            q = ops.rms_norm(q, self.q_norm, self.norm_eps)
            k = ops.rms_norm(k, self.k_norm, self.norm_eps)
        q, k = ops.rope(q, self.rope), ops.rope(k, self.rope)
        out = ops.attention(self.layer, q, k, v, self.scale, self.window, sinks=self.sinks)
        return out if gate is None else ops.mul(out, ops.sigmoid(ops.merge_heads(gate)))


def with_sinks(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, sinks: torch.Tensor,
               scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention with each head's sink logit in the softmax's denominator, as a plain attention over one more key:
    q gets a column of ones, every key a zero there, and the extra key (first, never masked, its value zero) only
    sinks / scale there, so that its score is the sink. q, keys, values (heads, n or n_kv, d), one key head per
    query head; mask (n, n_kv) bool or additive -> the same four for scaled_dot_product_attention, the head size
    padded to a multiple of 8 (its fast kernels' need)."""
    heads, n, d = q.shape
    pad = 8 - d % 8
    q = torch.cat([q, q.new_ones(heads, n, 1), q.new_zeros(heads, n, pad - 1)], -1)
    sink_key = keys.new_zeros(heads, 1, d + pad)
    sink_key[:, 0, d] = sinks.to(keys.device, keys.dtype) / scale
    keys = torch.cat([sink_key, torch.cat([keys, keys.new_zeros(heads, keys.shape[1], pad)], -1)], 1)
    values = torch.cat([values.new_zeros(heads, 1, values.shape[2]), values], 1)
    seen = mask.new_ones(mask.shape[0], 1) if mask.dtype == torch.bool else mask.new_zeros(mask.shape[0], 1)
    mask = torch.cat([seen, mask], 1)
    return q, keys, values, mask


def attend_with_sinks(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                      sinks: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention with each head's sink logit in the softmax's denominator, the query heads taken in groups against
    their key head (head h reads key head h // group), no key copied per head: q (heads, n, d), keys / values
    (kv_heads, n_kv, d / d_v), mask (n, n_kv) bool or additive, sinks (heads,) -> (heads, n, d_v). with_sinks' result
    for a CPU, where scaled_dot_product_attention would need every key head repeated for every query head of it (64
    copies of DeepSeek-V4's one head: half its CPU decode step)."""
    heads, n, d = q.shape
    kv_heads, n_kv = keys.shape[:2]
    group = heads // kv_heads
    keys, values = keys.to(q.dtype), values.to(q.dtype)
    s = torch.bmm(q.reshape(kv_heads, group * n, d), keys.transpose(1, 2)).view(kv_heads, group, n, n_kv) * scale
    s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask
    sink = sinks.to(q.device, q.dtype).view(kv_heads, group, 1, 1)
    top = torch.maximum(s.amax(-1, keepdim=True), sink)
    p = torch.exp(s - top)
    den = p.sum(-1, keepdim=True) + torch.exp(sink - top)
    out = torch.bmm(p.view(kv_heads, group * n, n_kv), values).view(kv_heads, group, n, -1) / den
    return out.view(heads, n, -1)


def expand_from(lora: int, nope: int, v: int) -> int:
    """Tokens per u-batch from which expanding the cache costs fewer multiply-adds than absorbing (mode 3 on the
    CPU): per head, absorbing costs n * lora * (nope + v) for the query and output projections and n * n_kv *
    (2 lora + rope) in attention; expanding costs n_kv * lora * (nope + v) and n * n_kv * (nope + rope + v). For a
    long cache (n_kv >> n) expanding wins once n * (2 lora - nope - v) > lora * (nope + v): from 171 tokens on for
    DeepSeek's shapes."""
    saved = 2 * lora - nope - v
    return 1 if saved <= 0 else -(-lora * (nope + v) // saved)


@dataclass
class LatentAttention:
    """DeepSeek's multi-head latent attention (MLA): queries (through a low-rank q_a / norm / q_b when q_lora_rank
    is set); one latent per token (kv_a: kv_lora_rank values, normed, and a shared rope key), which kv_b expands
    into every head's key (no-rope part, beside the shared rope key) and value.

    `mla` (ik_llama.cpp's -mla): 0 caches the expanded keys and values; 1, 2 and 3 cache only the latent and the
    rope key (kv_lora_rank + rope values per token and layer; the values are the latent itself). With that cache,
    attention runs absorbed: each head's query is taken into latent space through its slice of kv_b (k_b), every
    head attends to the one shared latent row, and its output leaves latent space through v_b. 1 and 2 always do
    so (ferry keeps one copy of the latent, so the two are the same); 3 instead expands the cached latents through
    kv_b for prompt u-batches where that is faster, and runs absorbed otherwise (generation): ops.mla3 picks the
    form, on the CPU from the multiply-add count (`expand_from`), on the GPU per run from the u-batch size and the
    cache length (CudaOps.mla3)."""

    layer: int
    wq: Weight | None
    wq_a: Weight | None
    q_a_norm: torch.Tensor | None
    wq_b: Weight | None
    wkv_a: Weight
    kv_a_norm: torch.Tensor
    # kv_b as the file holds it (files converted before 2025), else None: joined from k_b / v_b when first needed.
    # No model weight (Model.weights): only ggml's graphs read kv_b; torch's ops (the eager CPU path, the GPU)
    # expand through k_b / v_b, so a GPU holds one copy of the latent projections (float16: CudaBackend.half)
    file_kv_b: InitVar[Weight | None]
    k_b: torch.Tensor  # (n_head, kv_lora_rank, nope) float32: latent <- each head's no-rope query
    v_b: torch.Tensor  # (n_head, head_dim_v, kv_lora_rank) float32: each head's value <- latent
    wo: Weight
    n_head: int
    kv_lora_rank: int
    head_dim_nope: int
    head_dim_rope: int
    head_dim_v: int
    rope: Rope
    scale: float
    norm_eps: float
    mla: int = 0
    max_batch_mib: int = 0  # -amb: bound on one head group's expanded keys and values in mode 3 (0: all heads at once)
    # DeepSeek sparse attention: the layer's lightning indexer, which picks the positions each query attends to; or,
    # without one, shares_selection: the last indexer's choice of this forward holds here too (GLM-5.2's shared layers)
    indexer: Indexer | None = None
    shares_selection: bool = False
    _kv_b_rows: dict = field(default_factory=dict, repr=False)  # (first head, heads) -> those heads' rows of kv_b

    def __post_init__(self, file_kv_b: Weight | None) -> None:
        self._kv_b = file_kv_b

    @property
    def expand_from(self) -> int:
        return expand_from(self.kv_lora_rank, self.head_dim_nope, self.head_dim_v)

    def __call__(self, ops, x, norm: torch.Tensor | None = None, eps: float = 0.0):
        """As Attention's: the output for x, or for RMSNorm(x) * norm when norm is given."""
        if norm is not None:
            x = ops.rms_norm(x, norm, eps)
        h, nope, rot, lora = self.n_head, self.head_dim_nope, self.head_dim_rope, self.kv_lora_rank
        if self.wq is not None:
            q = ops.linear(x, self.wq)
        else:
            qr = ops.rms_norm(ops.linear(x, self.wq_a), self.q_a_norm, self.norm_eps)
            q = ops.linear(qr, self.wq_b)
        select = self.indexer.select(ops, x, qr) if self.indexer is not None else (
            ops.selection if self.shares_selection else None)
        q_nope, q_pe = ops.split(ops.heads(q, h, nope + rot), [nope, rot])
        q_pe = ops.rope(q_pe, self.rope)
        latent, k_pe = ops.split(ops.linear(x, self.wkv_a), [lora, rot])
        latent = ops.rms_norm(latent, self.kv_a_norm, self.norm_eps)
        k_pe = ops.rope(ops.heads(k_pe, 1, rot), self.rope)
        if self.mla == 0:  # the expanded keys and values are cached
            k_nope, v = self._expand(ops, latent)
            q, k = ops.concat(q_nope, q_pe), ops.concat(k_nope, ops.expand_heads(k_pe, h))
            return ops.linear(ops.attention(self.layer, q, k, v, self.scale, 0, select=select), self.wo)
        row = ops.concat(ops.heads(latent, 1, lora), k_pe)  # what is cached: (n, 1, lora + rope)
        if self.mla == 3:  # the op set picks the form (TorchOps.mla3: by u-batch size; CudaOps.mla3: by measurement)
            return ops.linear(ops.mla3(self, q_nope, q_pe, row, select), self.wo)
        return ops.linear(self.absorbed(ops, q_nope, q_pe, row, select), self.wo)

    def by_size(self, ops, q_nope, q_pe, row, select=None):
        """Mode 3 by the multiply-add count: expanded for u-batches of at least expand_from tokens, else absorbed."""
        form = self.expanded if ops.n_tokens >= self.expand_from else self.absorbed
        return form(ops, q_nope, q_pe, row, select)

    def absorbed(self, ops, q_nope, q_pe, row, select=None):
        """Attention in latent space: each head's query taken in through k_b, this batch's rows into the cache, every
        head against the one cached latent row (or the positions `select` gives each query: Indexer), each head's
        output out through v_b: (n, heads * v)."""
        q = ops.concat(ops.head_linear(q_nope, self.k_b), q_pe)  # (n, h, lora + rope)
        out = ops.heads(ops.attention(self.layer, q, row, None, self.scale, 0, select=select), self.n_head,
                        self.kv_lora_rank)
        return ops.merge_heads(ops.head_linear(out, self.v_b))

    def expanded(self, ops, q_nope, q_pe, row, select=None):
        """Mode 3's prompt form: this batch's rows into the cache, every cached latent expanded through kv_b (a
        group of heads at a time under -amb), attention as usual: (n, heads * v). Its work grows with the cache
        length: on the GPU it runs between recorded graphs (ops.cache_sized)."""
        inputs = (q_nope, q_pe, row) + (() if select is None else (select,))  # a replay's own selection
        return ops.cache_sized(lambda *a: self._expanded(ops, *a), inputs, (ops.n_tokens, self.n_head * self.head_dim_v))

    def _expanded(self, ops, q_nope, q_pe, row, select=None):
        lora, rot, h = self.kv_lora_rank, self.head_dim_rope, self.n_head
        q = ops.concat(q_nope, q_pe)
        latents, k_pe = ops.split(ops.cached_rows(self.layer, row), [lora, rot])  # every cached position
        k_pe = ops.heads(k_pe, 1, rot)
        group = self.heads_at_once(ops.n_kv)
        out = None
        for first in range(0, h, group):
            count = min(group, h - first)
            k_nope, v = self._expand(ops, latents, first, count)
            k = ops.concat(k_nope, ops.expand_heads(k_pe, count))
            part = ops.attend(q if count == h else ops.head_slice(q, first, count), k, v, self.scale, select)
            out = part if out is None else ops.concat(out, part)
        return out

    def heads_at_once(self, n_kv: int) -> int:
        """Heads whose keys and values over n_kv positions fit -amb (at least one)."""
        if not self.max_batch_mib:
            return self.n_head
        per_head = 6 * n_kv * (self.head_dim_nope + self.head_dim_rope + self.head_dim_v)
        return max(1, min(self.n_head, self.max_batch_mib * 2**20 // per_head))

    def _expand(self, ops, latents, first: int = 0, count: int | None = None):
        """Heads [first, first + count)'s no-rope keys and values from latents (rows, lora): (rows, count, nope),
        (rows, count, v) (ops.expand_latents: through kv_b's rows in ggml, through k_b / v_b in torch)."""
        return ops.expand_latents(latents, self, first, self.n_head if count is None else count)

    def kv_b(self) -> Weight:
        """kv_b: each head's no-rope key rows, then its value rows, over the latent (lora columns); the file's, or
        joined in float32 from k_b / v_b (once)."""
        if self._kv_b is None:
            rows = self.n_head * (self.head_dim_nope + self.head_dim_v)
            joined = torch.cat([self.k_b.transpose(1, 2), self.v_b], dim=1).reshape(rows, self.kv_lora_rank)
            self._kv_b = Weight(f"blk.{self.layer}.attn_kv_b.weight", Q.F32, (self.kv_lora_rank, rows),
                                np.ascontiguousarray(joined.numpy()).view(np.uint8).reshape(-1))
        return self._kv_b

    def kv_b_heads(self, first: int, count: int) -> Weight:
        """kv_b's rows of heads [first, first + count): a view of its bytes, as a weight of its own."""
        if count == self.n_head:
            return self.kv_b()
        if (first, count) not in self._kv_b_rows:
            w, per_head = self.kv_b(), self.head_dim_nope + self.head_dim_v
            row = row_bytes(w.qtype, w.ne[0])
            data = w.data[first * per_head * row:(first + count) * per_head * row]
            self._kv_b_rows[first, count] = Weight(w.name, w.qtype, (w.ne[0], count * per_head), data)
        return self._kv_b_rows[first, count]
