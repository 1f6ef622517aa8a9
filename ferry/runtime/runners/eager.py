"""The eager op set: float work (norms, rope, attention) in torch, weight-bound ops on a backend, run
op by op. It is what a forward runs through when its ops must go to different devices; a CPU-only
forward runs as one ggml graph instead (runners/ggml_graph.py), through the same op names."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ferry.backends.cuda import top_k_route
from ferry.layers.attention import attend_with_sinks
from ferry.layers.hyper_connection import sinkhorn
from ferry.layers.delta_net import delta_rule, short_conv
from ferry.layers.indexer import scores, top_k_mask
from ferry.layers.norm import rms_norm
from ferry.layers.rope import Rope
from ferry.weight import Weight
from ferry.runtime.batch import Batch


class TorchOps:
    """One forward's ops: tensors are torch (n_tokens, ...) float32."""

    def __init__(self, backend, batch: Batch, tokens: torch.Tensor):
        self.backend, self.batch, self.tokens = backend, batch, tokens
        self._moved: dict[tuple, torch.Tensor] = {}  # per-batch masks and rope angles, moved once per forward
        self.selection = None  # the last lightning indexer's choice in this forward (dsa_select)

    def _on(self, key: tuple, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        """t on `device`: every layer of this forward shares one copy."""
        if t.device == device:
            return t
        if key not in self._moved:
            self._moved[key] = t.to(device)
        return self._moved[key]

    @property
    def n_tokens(self) -> int:
        return self.batch.n_tokens

    @property
    def n_kv(self) -> int:
        """Cache positions this batch attends to."""
        return self.batch.n_kv

    def embed(self, w: Weight) -> torch.Tensor:
        return self.backend.get_rows(w, self.tokens)

    def scale(self, x: torch.Tensor, s: float) -> torch.Tensor:
        return x * s

    def add(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a + b

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, self.backend.vector(weight), eps)

    def layer_norm(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
        return F.layer_norm(x.float(), x.shape[-1:], self.backend.vector(weight), self.backend.vector(bias), eps)

    def add_rms_norm(self, x: torch.Tensor, dx: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + dx, its RMSNorm): a residual add and the next sub-layer's norm."""
        s = self.add(x, dx)
        return s, self.rms_norm(s, weight, eps)

    def fused_attention(self, attn, x: torch.Tensor, norm: torch.Tensor | None, eps: float) -> torch.Tensor | None:
        """A whole attention layer before its output projection (the pre-norm with `norm` when given, projections,
        q/k norms, rope, cache store, attention) as fused kernels, or None where this op set has none for it: the
        layer then runs op by op."""
        return None

    def linear(self, x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
        y = self.backend.linear(x, w)
        return y if bias is None else y + self.backend.vector(bias)

    def heads(self, x: torch.Tensor, n_head: int, head_dim: int) -> torch.Tensor:
        return x.reshape(x.shape[0], n_head, head_dim)

    def split(self, x: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
        """Pieces of the last dimension, in order (views)."""
        return list(torch.split(x, sizes, dim=-1))

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """x on this op set's device (where its tokens are)."""
        return x.to(self.tokens.device)

    def join_rows(self, xs: list[torch.Tensor]) -> torch.Tensor:
        """The rows of each tensor in turn: one tensor."""
        return torch.cat(xs)

    def split_rows(self, x: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
        """x's rows cut into consecutive pieces of `sizes` rows (views)."""
        return list(torch.split(x, sizes))

    def concat(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """a and b side by side in the last dimension."""
        return torch.cat([a, b], dim=-1)

    def merge_heads(self, x: torch.Tensor) -> torch.Tensor:
        """(n, heads, d) -> (n, heads * d)."""
        return x.reshape(x.shape[0], -1)

    def head_slice(self, x: torch.Tensor, first: int, count: int) -> torch.Tensor:
        """Heads [first, first + count) of x (n, heads, d)."""
        return x[:, first:first + count]

    def head_linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Each head through its own matrix: x (n, heads, k), w (heads, m, k) float -> (n, heads, m)."""
        return torch.einsum("nhk,hmk->nhm", x, self.backend.vector(w))

    def expand_latents(self, latents: torch.Tensor, attn, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """MLA's latents (rows, lora) expanded into heads [first, first + count)'s no-rope keys (rows, count, nope)
        and values (rows, count, v) through attn's float32 k_b and v_b (the latent projections the absorbed form
        uses too: no second copy as kv_b)."""
        k_b, v_b = (self.backend.vector(t)[first:first + count] for t in (attn.k_b, attn.v_b))
        return torch.einsum("rl,hln->rhn", latents, k_b), torch.einsum("rl,hvl->rhv", latents, v_b)

    def expand_heads(self, x: torch.Tensor, n_head: int) -> torch.Tensor:
        """(n, 1, d) -> (n, n_head, d): one head shared by all."""
        return x.expand(x.shape[0], n_head, x.shape[2])

    def rope(self, x: torch.Tensor, rope: Rope) -> torch.Tensor:
        cos, sin = self.batch.rope_angles(rope)
        return rope(x, self._on(("cos", rope), cos, x.device), self._on(("sin", rope), sin, x.device))

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, scale: float,
                  window: int, sinks: torch.Tensor | None = None, select: torch.Tensor | None = None) -> torch.Tensor:
        """Store k, v in the cache (v None: a cache whose values are the first of each key row, MLA's latent),
        attend q (n, n_head, d) to every cached position (or to those `select` gives each query: dsa_select):
        (n, n_head * d_v). sinks: Attention.sinks."""
        if self.batch.seq is not None:
            raise NotImplementedError("batches of several sequences run through the ggml graph runner only")
        kv = self.batch.kv
        if layer in kv.ring_layers:  # its ring's rows, in row order, under the ring's mask
            keys, values = kv.store_ring(layer, self.batch.ring_cells, k, v, self.batch.ring_kv)
            mask = self._on(("ring", window), self.batch.ring_mask(window), q.device)
            return self._sdpa(q, keys, values, scale, window, sinks, mask)
        keys, values = kv.store(layer, self.batch.start, k, v)
        return self._sdpa(q, keys, values, scale, window, sinks, select)

    def _sdpa(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, window: int,
              sinks: torch.Tensor | None = None, select: torch.Tensor | None = None):
        """select: a (n, n_kv) bool mask in place of the batch's causal one within `window` (dsa_select's, a ring's)."""
        n, n_head = q.shape[:2]
        mask = self._on(("mask", window), self.batch.mask(window), q.device) if select is None else select
        q, keys, values = q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1)
        if sinks is not None:
            out = attend_with_sinks(q, keys, values, mask, self.backend.vector(sinks), scale)
            return out.transpose(0, 1).reshape(n, -1)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale,
                                             enable_gqa=n_head != keys.shape[0])
        return out.transpose(0, 1).reshape(n, -1)

    def cached_rows(self, layer: int, k: torch.Tensor) -> torch.Tensor:
        """Store k (n, 1, d) in a values-in-keys cache; every cached row up to this batch's last: (n_kv, d)."""
        if self.batch.seq is not None:
            raise NotImplementedError("batches of several sequences run through the ggml graph runner only")
        keys, _ = self.batch.kv.store(layer, self.batch.start, k, None)
        return keys.reshape(keys.shape[0], -1)

    def cache_sized(self, fn, inputs: tuple, shape: tuple[int, ...]):
        """fn(*inputs): work whose shapes depend on the cache length (a recorded GPU step runs it between graphs)."""
        return fn(*inputs)

    def mla3(self, attn, q_nope, q_pe, row, select=None):
        """-mla 3's attention for this u-batch, by its size (LatentAttention.by_size): not measured on the CPU."""
        return attn.by_size(self, q_nope, q_pe, row, select)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               select: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of q (n, heads, d) to keys and values of every cached position given here (n_kv, heads, d),
        under this batch's causal mask (or `select`): (n, heads * d_v)."""
        return self._sdpa(q, k, v, scale, 0, select=select)

    def dsa_select(self, layer: int, q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, top_k: int):
        """DeepSeek sparse attention's choice (layers/indexer.py): this batch's indexer keys k (n, 1, d) into the
        cache, then each query's top_k cached positions by the indexer's score of q (n, heads, d) with head weights
        w (n, heads), as a (n, n_kv) bool mask within the causal one; None where no query sees more than top_k
        positions (dense attention). Kept as `selection` for the layers that share it."""
        if self.batch.seq is not None:
            raise NotImplementedError("batches of several sequences run through the ggml graph runner only")
        keys = self.batch.kv.store_index(layer, self.batch.start, k)
        self.selection = None
        if self.n_kv > top_k:
            keys = keys.to(q.device)
            allowed = self._on(("mask", 0), self.batch.mask(0), q.device)
            self.selection = top_k_mask(scores(q.float(), keys, w.float()), allowed, top_k)
        return self.selection

    def sigmoid(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(x)

    def mul(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a * b

    def l2_norm(self, x: torch.Tensor, eps: float) -> torch.Tensor:
        """x / sqrt(sum x^2 + eps) over the last dimension (the delta-net's q and k; eps inside, as llama.cpp and
        transformers take it)."""
        return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)

    def linears(self, x: torch.Tensor, ws: tuple[Weight, ...], norm: torch.Tensor | None = None,
                eps: float = 0.0) -> list[torch.Tensor]:
        """x (or RMSNorm(x) * norm) through each of ws: weights one input feeds."""
        if norm is not None:
            x = self.rms_norm(x, norm, eps)
        return [self.linear(x, w) for w in ws]

    def gated_rms_norm(self, x: torch.Tensor, weight: torch.Tensor, z: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm(x) * weight * silu(z), per head: x, z (n, heads, d)."""
        return self.rms_norm(x, weight, eps) * F.silu(z)

    def _state(self, kind: str, layer: int) -> torch.Tensor:
        """The batch's sequence's recurrent state of a layer, as torch (a view of the cache's)."""
        t = getattr(self.batch.kv, kind)[layer]
        seq = 0 if self.batch.seq is None else int(self.batch.seq[0])  # a recurrent model's batch holds one sequence
        return (torch.from_numpy(t) if not isinstance(t, torch.Tensor) else t)[seq]

    def short_conv(self, layer: int, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """silu(causal depthwise convolution) of x (n, channels) after the layer's last inputs, which it then keeps."""
        state = self._state("conv", layer)  # (channels, kernel - 1), ggml's layout
        out, last = short_conv(x, state.t(), self.backend.vector(weight))
        state.copy_(last.t())
        return out

    def delta_net(self, net, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, b: torch.Tensor,
                  alpha: torch.Tensor) -> torch.Tensor:
        """A GatedDeltaNet's delta rule from its layer's state, which it then keeps: q, k (n, key heads, d) L2-normed
        here, v (n, value heads, d), the write strength sigmoid(b) and the log decay softplus(alpha + dt_bias) * a
        from b, alpha (n, value heads): (n, value heads, d)."""
        state = self._state("delta", net.layer)  # (heads, d_v, d_k), ggml's layout
        q, k = self.l2_norm(q, net.norm_eps), self.l2_norm(k, net.norm_eps)
        g = F.softplus(alpha + self.backend.vector(net.dt_bias)) * self.backend.vector(net.a)
        repeat = v.shape[1] // q.shape[1]
        if repeat > 1:
            q, k = ((q.repeat(1, repeat, 1), k.repeat(1, repeat, 1)) if net.tiled else
                    (q.repeat_interleave(repeat, 1), k.repeat_interleave(repeat, 1)))
        out, last = delta_rule(q, k, v, g, torch.sigmoid(b), state.transpose(1, 2), scan=self.delta_scan(q.shape[-1]))
        state.copy_(last.transpose(1, 2))
        return out

    def delta_scan(self, d_k: int):
        """The prompt form's passage of the state through the chunks: None, torch's (delta_net.scan_chunks)."""
        return None

    def ffn(self, x: torch.Tensor, gate: Weight, up: Weight, down: Weight, act: str) -> torch.Tensor:
        return self.backend.ffn(x, gate, up, down, act)

    def moe(self, x: torch.Tensor, router: Weight, up: Weight, gate: Weight, down: Weight, n_used: int,
            norm_topk: bool, act: str, routing=None, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The routed experts' weighted sum (+ residual when given: the stream the block adds it to)."""
        out, ids = self.backend.moe(x, router, up, gate, down, n_used, norm_topk, act, routing)
        self.batch.expert_ids.append(ids)
        return out if residual is None else self.add(residual, out)

    def route(self, logits: torch.Tensor, n_used: int, routing, hash_ids: torch.Tensor | None = None):
        """(weights, ids) of each token's experts from its router logits (layers.ffn.Routing); hash_ids: a table of
        each token id's experts (DeepSeek-V4's hash layers), which then only get their weights."""
        chosen = None
        if hash_ids is not None:  # the table where the backend keeps small tensors (float32: exact ids)
            chosen = self.backend.vector(hash_ids)[self.tokens.to(logits.device).long()].long()
        return top_k_route(logits.float(), n_used, True, routing, self.backend.vector, chosen)

    def moe_routed(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, up: Weight, gate: Weight,
                   down: Weight, act: str) -> torch.Tensor:
        """The weighted sum of the experts chosen by `route`."""
        self.batch.expert_ids.append(ids)
        return self.backend.moe_experts(x, ids, weights, up, gate, down, act)

    def hyper_pre(self, streams: torch.Tensor, mix: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n_hc: int,
                  n_iters: int, eps: float):
        """A hyper-connection's mixing (layers/hyper_connection.py) from its logits mix (n, (2 + n_hc) * n_hc): the
        sub-layer's input sum_j pre[j] X[j] (n, n_embd), post (n, n_hc) and comb (n, src, dst)."""
        n = streams.shape[0]
        base, scale = self.backend.vector(base), self.backend.vector(scale)
        pre = torch.sigmoid(mix[:, :n_hc] * scale[0] + base[:n_hc]) + eps
        post = 2 * torch.sigmoid(mix[:, n_hc:2 * n_hc] * scale[1] + base[n_hc:2 * n_hc])
        comb = (mix[:, 2 * n_hc:] * scale[2] + base[2 * n_hc:]).view(n, n_hc, n_hc)
        comb = sinkhorn(torch.softmax(comb, -1) + eps, n_iters, eps)
        return torch.einsum("nj,njd->nd", pre, streams.view(n, n_hc, -1)), post, comb

    def hyper_post(self, streams: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor):
        """X'[k] = post[k] y + sum_j comb[j, k] X[j]: the sub-layer's output y (n, n_embd) into the streams."""
        n, n_hc = post.shape
        out = post[..., None] * y[:, None] + torch.einsum("njd,njk->nkd", streams.view(n, n_hc, -1), comb)
        return out.reshape(n, -1)

    def hyper_collapse(self, streams: torch.Tensor, mix: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                       n_hc: int, eps: float):
        """The head's sum_j pre[j] X[j], pre = sigmoid(mix * scale + base) + eps."""
        pre = torch.sigmoid(mix * self.backend.vector(scale) + self.backend.vector(base)) + eps
        return torch.einsum("nj,njd->nd", pre, streams.view(streams.shape[0], n_hc, -1))

    def compress(self, comp, kv: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
        """A compressor's entries (layers/compressed_attention.py) up to this batch's last complete window: the
        windows this batch completes pooled from its kv and score projections (n, width) and the raw rows its
        cache kept of earlier positions, then kept; this batch's last raw rows kept for the windows to come."""
        seq, _, start = self._one_sequence()
        cache, key, r = self.batch.kv, (comp.layer, comp.name), comp.ratio
        ring_kv, ring_score = (t[seq] for t in cache.rings[key])
        entries, ring = cache.entries[key][seq], ring_kv.shape[0]
        end = start + self.n_tokens
        score = score + self.backend.vector(comp.ape)[self._positions(kv.device) % r]
        first, last = start // r, end // r  # the windows this batch completes
        if last > first:
            earlier = torch.arange(first * r - (ring - r), start, device=kv.device)  # their rows from before the batch
            old_kv, old_score = ring_kv[earlier % ring].clone(), ring_score[earlier % ring].clone()
            old_kv[earlier < 0], old_score[earlier < 0] = 0.0, float("-inf")  # window 0 has no window before it
            rows_kv, rows_score = torch.cat([old_kv, kv]), torch.cat([old_score, score])
            n, d = last - first, comp.dim
            if comp.overlap:  # the previous window's first half, this one's second half
                def slots(t):
                    before, this = t[:n * r].view(n, r, 2 * d), t[r:(n + 1) * r].view(n, r, 2 * d)
                    return torch.cat([before[..., :d], this[..., d:]], 1)
            else:
                def slots(t):
                    return t[:n * r].view(n, r, d)
            pooled = (slots(rows_kv) * torch.softmax(slots(rows_score), 1)).sum(1)
            pooled = rms_norm(pooled, self.backend.vector(comp.norm), comp.norm_eps)
            rot = comp.rope.n_rot
            cos, sin = comp.rope.angles(torch.arange(first, last) * r)
            tail = comp.rope(pooled[:, None, d - rot:], cos.to(kv.device), sin.to(kv.device))[:, 0]
            entries[first:last] = torch.cat([pooled[:, :d - rot], tail], -1)
        kept = torch.arange(max(start, end - ring), end, device=kv.device)
        ring_kv[kept % ring], ring_score[kept % ring] = kv[kept - start], score[kept - start]
        return entries[:last]

    def compressed_attention(self, attn, q: torch.Tensor, kv: torch.Tensor, pooled: tuple, indexed: tuple):
        """DeepSeek-V4's attention past its projections (layers/compressed_attention.py): its compressor's rows
        `pooled` (kv, score) pooled into entries (compress), the indexer's `indexed` (its compressor's rows, queries,
        head weights) into each query's choice of them (compressed_select), then q (n, heads, d) attending to the
        window and those entries (attend_compressed): (n, heads * d)."""
        entries = self.compress(attn.compressor, *pooled) if pooled else None
        select = None
        if indexed:
            index = attn.indexer
            keys = self.compress(index.compressor, *indexed[:2])
            select = self.compressed_select(indexed[2], keys, indexed[3], index.compressor.ratio, index.top_k)
        return self.attend_compressed(attn.layer, q, kv, entries, attn.ratio, attn.window, attn.head_dim ** -0.5,
                                      attn.sinks, select)

    def compressed_select(self, q: torch.Tensor, keys: torch.Tensor, w: torch.Tensor, ratio: int, top_k: int):
        """A lightning indexer's choice over compressed entries keys (entries, d): (n, top_k) int64, each query's top_k
        entries by score, those it sees first (w < (t + 1) // ratio; a query that sees fewer also gets some it does
        not, which compressed_attention leaves out); None where none sees more than top_k."""
        if keys.shape[0] <= top_k:
            return None
        score = scores(q.float(), keys.float(), w.float())
        return score.masked_fill(~self._visible(keys.shape[0], ratio, q.device), float("-inf")).topk(top_k, -1).indices

    def _one_sequence(self) -> tuple[int, int, int]:
        """(its sequence, that sequence's first cache cell, its first position) of a batch of one sequence's
        consecutive tokens (DeepSeek-V4's batches: a recurrent model's run sequence by sequence)."""
        b = self.batch
        if b.seq is None:
            return 0, 0, b.start
        seq = int(b.seq[0])
        return seq, seq * b.seq_len, int(b.pos[0])

    def _positions(self, device) -> torch.Tensor:
        return self._on(("positions",), self.batch.positions, device)

    def _visible(self, n_entries: int, ratio: int, device) -> torch.Tensor:
        """(n, entries) bool: entry w is seen by the query at position t if its window is complete,
        w < (t + 1) // ratio."""
        return torch.arange(n_entries, device=device)[None, :] < ((self._positions(device) + 1) // ratio)[:, None]

    def attend_compressed(self, layer: int, q: torch.Tensor, kv: torch.Tensor, entries: torch.Tensor | None,
                          ratio: int, window: int, scale: float, sinks: torch.Tensor,
                          select: torch.Tensor | None) -> torch.Tensor:
        """DeepSeek-V4's attention: kv (n, 1, d) into the cache; q (n, heads, d) attends, with sinks, to the last
        `window` cached positions and to the compressed entries (entries, d) it sees (of them, those `select` gives
        it: compressed_select's): (n, heads * d)."""
        seq, cell, start = self._one_sequence()
        first = max(0, start - window + 1)  # the first position a query of this batch sees
        cache = self.batch.kv
        if layer in cache.ring_layers:  # the ring's rows of positions first .. the batch's last, in order
            ring = cache.ring
            rows = seq * ring + torch.arange(first, start + self.n_tokens) % ring
            keys, _ = cache.store_ring(layer, self.batch.ring_cells, kv, None, rows)
        else:
            keys, _ = cache.store(layer, cell + start, kv, None, cell + first)
        if ("window", window) not in self._moved:
            seen = torch.arange(first, start + self.n_tokens)[None, :]
            pos = self.batch.positions[:, None]
            self._moved["window", window] = ((seen <= pos) & (pos - seen < window)).to(q.device)
        mask = self._moved["window", window]
        if entries is not None and entries.shape[0]:
            if select is not None and q.shape[0] == 1:  # one query sees every entry: only its chosen ones are read
                entries, seen = entries[select[0]], mask.new_ones(1, select.shape[1])
            else:
                seen = self._visible(entries.shape[0], ratio, q.device)
                if select is not None:
                    seen = seen & torch.zeros_like(seen).scatter_(1, select, True)
            keys = torch.cat([keys, entries[:, None].to(keys.device, keys.dtype)])
            mask = torch.cat([mask, seen], 1)
        return self._sdpa(q, keys, keys, scale, window, sinks, select=mask)

    def output_rows(self, x: torch.Tensor) -> torch.Tensor:
        """The rows whose logits are wanted: the last Batch.logit_rows."""
        return x[-self.batch.logit_rows:]


class EagerRunner:
    """Runs a model's forward op by op through TorchOps."""

    def __init__(self, backend):
        self.backend = backend

    layer_first = True

    def forward(self, model, tokens: torch.Tensor, batch: Batch) -> torch.Tensor:
        return model.forward(TorchOps(self.backend, batch, tokens))

    def will_record(self) -> bool:
        return False

    def report(self) -> list[str]:
        return []

    def forward_layer_first(self, model, tokens: list[torch.Tensor], batches: list[Batch],
                            joined: Batch) -> list[torch.Tensor]:
        """The u-batches of one logical batch, layer by layer (Model.forward_layer_first): each one's logits.
        `joined`: Batch.join(batches)."""
        return model.forward_layer_first([TorchOps(self.backend, b, t) for t, b in zip(tokens, batches)],
                                         TorchOps(self.backend, joined, torch.cat(tokens)))
