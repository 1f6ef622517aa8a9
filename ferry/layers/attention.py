"""Self-attention with a KV cache: GQA, optional q/k/v biases (qwen2), per-head q/k norms (qwen3, gemma3),
a sliding window (gemma3's local layers); and DeepSeek's multi-head latent attention."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ferry.layers.rope import Rope
from ferry.ops import Weight


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

    def __call__(self, ops, x):
        q = ops.heads(ops.linear(x, self.wq, self.bq), self.n_head, self.head_dim_k)
        k = ops.heads(ops.linear(x, self.wk, self.bk), self.n_head_kv, self.head_dim_k)
        v = ops.heads(ops.linear(x, self.wv, self.bv), self.n_head_kv, self.head_dim_v)
        if self.q_norm is not None:
            q = ops.rms_norm(q, self.q_norm, self.norm_eps)
            k = ops.rms_norm(k, self.k_norm, self.norm_eps)
        q, k = ops.rope(q, self.rope), ops.rope(k, self.rope)
        return ops.linear(ops.attention(self.layer, q, k, v, self.scale, self.window), self.wo)


@dataclass
class LatentAttention:
    """DeepSeek's multi-head latent attention (MLA), expanded form: queries (through a low-rank q_a / norm / q_b
    when q_lora_rank is set), one latent per token (kv_a: kv_lora_rank values, normed, and a shared rope key),
    expanded by kv_b into every head's key (no-rope part) and value; each head's key is that part beside the
    shared rope key. The cache holds the expanded keys and values."""

    layer: int
    wq: Weight | None
    wq_a: Weight | None
    q_a_norm: torch.Tensor | None
    wq_b: Weight | None
    wkv_a: Weight
    kv_a_norm: torch.Tensor
    wkv_b: Weight
    wo: Weight
    n_head: int
    kv_lora_rank: int
    head_dim_nope: int
    head_dim_rope: int
    head_dim_v: int
    rope: Rope
    scale: float
    norm_eps: float

    def __call__(self, ops, x):
        h, nope, rot = self.n_head, self.head_dim_nope, self.head_dim_rope
        if self.wq is not None:
            q = ops.linear(x, self.wq)
        else:
            q = ops.linear(ops.rms_norm(ops.linear(x, self.wq_a), self.q_a_norm, self.norm_eps), self.wq_b)
        q_nope, q_pe = ops.split(ops.heads(q, h, nope + rot), [nope, rot])
        latent, k_pe = ops.split(ops.linear(x, self.wkv_a), [self.kv_lora_rank, rot])
        kv = ops.linear(ops.rms_norm(latent, self.kv_a_norm, self.norm_eps), self.wkv_b)
        k_nope, v = ops.split(ops.heads(kv, h, nope + self.head_dim_v), [nope, self.head_dim_v])
        k_pe = ops.rope(ops.heads(k_pe, 1, rot), self.rope)
        q = ops.concat(q_nope, ops.rope(q_pe, self.rope))
        k = ops.concat(k_nope, ops.expand_heads(k_pe, h))
        return ops.linear(ops.attention(self.layer, q, k, v, self.scale, 0), self.wo)
