"""The CPU-only forward as one ggml graph per u-batch size, as llama.cpp runs it: the model's own
forward, called with GraphOps instead of eager ops, builds the graph once; later u-batches of that
size only bind their tokens, positions and masks, set the attended cache length in the nodes that
depend on it (the cache views and the masks) and compute. The KV cache lives in ggml's types
(f16, q8_0, ...) and attention is ggml's flash attention. Python then costs nothing per op:
at 5-8 ms of torch between eager ops per Gemma token, this is what closes the gap to llama.cpp
(benchmarks/cpu_vs_llamacpp.py; docs/performance.md)."""

from __future__ import annotations

import math

import ggml
import torch

from gguf.constants import GGMLQuantizationType as Q

from ferry.layers.rope import Rope
from ferry.weight import Weight
from ferry.backends.cpu import CpuBackend
from ferry.kernels.cpu.ggml import _Graph
from ferry.runtime.batch import Batch
from ferry.runtime.kv_cache import KVCache

F32, F16, I32 = ggml.GGML_TYPE_F32, ggml.GGML_TYPE_F16, ggml.GGML_TYPE_I32
_MAX_GRAPHS = 16
SCORE_FLOATS = 1 << 25  # the sparse attention indexer's per-head scores held at once (128 MiB; a prompt's in pieces)


class GraphOps:
    """Builds one u-batch's forward: tensors are ggml nodes in ggml order ((n_embd, n_tokens), (d, heads, n))."""

    def __init__(self, backend: CpuBackend, g: _Graph, n_tokens: int, kv: KVCache, logit_rows: int, n_kv: int):
        self.backend, self.g, self.c = backend, g, g.ctx
        self.n, self.n_ctx, self.kv, self.logit_rows = n_tokens, kv.n_ctx, kv, logit_rows  # built for a full cache
        self.n_kv = n_kv  # the cache length of the batch it is built for
        self.per_length = False  # whether nodes past the cache views have that length (cached_rows): then the
        # graph serves that length only
        self.tokens = g.input(I32, (n_tokens,))
        self.positions = g.input(I32, (n_tokens,))
        self.cells = g.input(I32, (n_tokens,))  # the cache row of each token (its position, for one sequence)
        # the row of each token in a ring layer (Batch.ring_cells), where the cache keeps rings
        self.ring_cells = g.input(I32, (n_tokens,)) if kv.ring else None
        # (sliding window (0: none), whether over a ring's rows) -> its mask input, in creation order
        self.masks: dict[tuple[int, bool], object] = {}
        self.cache_views: list = []  # (d, n_kv, heads) views of the cache: ne[1] is set to the length at each run
        self.ring_views: list = []  # the same over a ring layer's rows: ne[1] set to the rows attended
        self.expert_ids: list = []  # per MoE layer: the node that copies its expert ids out
        self.n_used = 1  # experts per token, of the MoE layers
        self._vectors: dict[int, object] = {}
        # the recurrent layers' states of the batch's sequence, bound at each run (GgmlGraphRunner.forward), and
        # their new states written back (`writes`: nodes nothing else reads, as the indexer keys of a dense run)
        self.states: dict[tuple[str, int], object] = {}
        for i in kv.state.layers if kv.state else ():
            conv, delta = kv.conv[i], kv.delta[i]
            self.states["conv", i] = g.input(F32, (conv.shape[2], conv.shape[1], 1))
            self.states["delta", i] = g.input(F32, (delta.shape[3] * delta.shape[2], delta.shape[1], 1))
        self.writes: list = []
        self.selection = None  # the last lightning indexer's choice in this forward (dsa_select)

    def _vector(self, t: torch.Tensor):
        """A leaf over a float32 model tensor (norm weights, biases): the model keeps it alive."""
        if id(t) not in self._vectors:
            self._vectors[id(t)] = self.g.leaf(F32, tuple(reversed(t.shape)), t.data_ptr())
        return self._vectors[id(t)]

    @property
    def n_tokens(self) -> int:
        return self.n

    def embed(self, w: Weight):
        return ggml.ggml_get_rows(self.c, self.backend._weight_leaf(self.g, w, rows=True), self.tokens)

    def scale(self, x, s: float):
        return ggml.ggml_scale(self.c, x, s)

    def add(self, a, b):
        return ggml.ggml_add(self.c, a, b)

    def rms_norm(self, x, weight: torch.Tensor, eps: float):
        if not ggml.ggml_is_contiguous(x):  # a piece of a split
            x = ggml.ggml_cont(self.c, x)
        return ggml.ggml_mul(self.c, ggml.ggml_rms_norm(self.c, x, eps), self._vector(weight))

    def layer_norm(self, x, weight: torch.Tensor, bias: torch.Tensor, eps: float):
        if not ggml.ggml_is_contiguous(x):
            x = ggml.ggml_cont(self.c, x)
        return ggml.ggml_add(self.c, ggml.ggml_mul(self.c, ggml.ggml_norm(self.c, x, eps), self._vector(weight)),
                             self._vector(bias))

    def add_rms_norm(self, x, dx, weight: torch.Tensor, eps: float):
        s = self.add(x, dx)
        return s, self.rms_norm(s, weight, eps)

    def fused_attention(self, attn, x, norm, eps: float):
        return None  # ggml's graph fuses nothing: the layer's own ops

    def linear(self, x, w: Weight, bias: torch.Tensor | None = None):
        y = self.backend.linear_node(self.g, x, w)
        return y if bias is None else ggml.ggml_add(self.c, y, self._vector(bias))

    def heads(self, x, n_head: int, head_dim: int):
        if not ggml.ggml_is_contiguous(x):
            x = ggml.ggml_cont(self.c, x)
        return ggml.ggml_reshape_3d(self.c, x, head_dim, n_head, ggml.ggml_nelements(x) // (head_dim * n_head))

    def merge_heads(self, x):
        if not ggml.ggml_is_contiguous(x):
            x = ggml.ggml_cont(self.c, x)
        t = x.contents
        return ggml.ggml_reshape_2d(self.c, x, t.ne[0] * t.ne[1], t.ne[2])

    def head_slice(self, x, first: int, count: int):
        """Heads [first, first + count) of x (d, heads, n), a view."""
        t = x.contents
        return ggml.ggml_view_3d(self.c, x, t.ne[0], count, t.ne[2], t.nb[1], t.nb[2], first * t.nb[1])

    def head_linear(self, x, w: torch.Tensor):
        """Each head through its own matrix: x (k, heads, n), w (heads, m, k) -> (m, heads, n)."""
        c = self.c
        per_head = ggml.ggml_cont(c, ggml.ggml_permute(c, x, 0, 2, 1, 3))  # (k, n, heads)
        y = ggml.ggml_mul_mat(c, self._vector(w), per_head)  # (m, n, heads)
        return ggml.ggml_cont(c, ggml.ggml_permute(c, y, 0, 2, 1, 3))

    def expand_latents(self, latents, attn, first: int, count: int):
        """MLA's latents (lora, rows) through heads [first, first + count)'s rows of kv_b: no-rope keys (nope,
        count, rows) and values (v, count, rows)."""
        kv = self.linear(latents, attn.kv_b_heads(first, count))
        return self.split(self.heads(kv, count, attn.head_dim_nope + attn.head_dim_v),
                          [attn.head_dim_nope, attn.head_dim_v])

    def split(self, x, sizes: list[int]) -> list:
        """Pieces of ggml dimension 0 (torch's last), as views: (d, n) or (d, heads, n)."""
        t, out, offset = x.contents, [], 0
        for size in sizes:
            if ggml.ggml_n_dims(x) <= 2:
                out.append(ggml.ggml_view_2d(self.c, x, size, t.ne[1], t.nb[1], offset))
            else:
                out.append(ggml.ggml_view_3d(self.c, x, size, t.ne[1], t.ne[2], t.nb[1], t.nb[2], offset))
            offset += size * t.nb[0]
        return out

    def concat(self, a, b):
        return ggml.ggml_concat(self.c, a, b, 0)

    def expand_heads(self, x, n_head: int):
        t = x.contents
        return ggml.ggml_repeat_4d(self.c, x, t.ne[0], n_head, t.ne[2], 1)

    def rope(self, x, rope: Rope):
        mode = ggml.GGML_ROPE_TYPE_NEOX if rope.neox else 0
        y = rope.yarn
        if y is None:
            return ggml.ggml_rope_ext(self.c, x, self.positions, None, rope.n_rot, mode, 0, rope.base,
                                      1.0 / rope.scale, 0.0, 1.0, 32.0, 1.0)
        if not y.truncate:  # ggml floors and ceils the correction dimensions: the exact angles as frequency factors
            ff = rope.base ** (-torch.arange(0, rope.n_rot, 2, dtype=torch.float64) / rope.n_rot) / rope.inv_freq()
            self.g.keep.append(ff := ff.float().contiguous())
            return ggml.ggml_rope_ext(self.c, x, self.positions, self.g.leaf(F32, (ff.numel(),), ff.data_ptr()),
                                      rope.n_rot, mode, 0, rope.base, 1.0, 0.0, 1.0, 32.0, 1.0)
        # ggml scales cos/sin by 1 + 0.1 ln(factor) under YaRN; attn_factor cancels it (llama.cpp's deepseek2 does so)
        return ggml.ggml_rope_ext(self.c, x, self.positions, None, rope.n_rot, mode, y.n_ctx_orig, rope.base,
                                  1.0 / y.factor, 1.0, 1.0 / (1.0 + 0.1 * math.log(y.factor)), y.beta_fast, y.beta_slow)

    def _mask(self, window: int, ring: bool = False):
        if (window, ring) not in self.masks:
            self.masks[window, ring] = self.g.input(F16, (self.n_ctx, self.n))
        return self.masks[window, ring]

    def _write(self, cache, x, dim: int, qtype, ring: bool = False):
        """Write this u-batch's rows of x (dim, heads, n) into the cache (its rows `cells`, or a ring's ring_cells):
        the cache after the write."""
        c = self.c
        n_heads = x.contents.ne[1]
        if not ggml.ggml_is_contiguous(x):  # a piece of a split (MLA's values)
            x = ggml.ggml_cont(c, x)
        leaf = self.g.leaf(qtype.value, (dim * n_heads, cache.shape[0]), cache.ctypes.data)
        return ggml.ggml_set_rows(c, leaf, ggml.ggml_reshape_2d(c, x, dim * n_heads, self.n),
                                  self.ring_cells if ring else self.cells)

    def _store(self, cache, x, dim: int, qtype, ring: bool = False):
        """_write, then the cache's first n_kv positions (a ring's first rows attended) as (dim, n_kv, heads), a view
        whose length is set at each run."""
        stored = self._write(cache, x, dim, qtype, ring)
        view = ggml.ggml_view_3d(self.c, stored, dim, cache.shape[0], x.contents.ne[1], stored.contents.nb[1],
                                 ggml.ggml_row_size(qtype.value, dim), 0)
        (self.ring_views if ring else self.cache_views).append(view)
        return view

    def attention(self, layer: int, q, k, v, scale: float, window: int, sinks: torch.Tensor | None = None,
                  select=None):
        """Store k and v (v None: a cache whose values are the first of each key row, MLA's latent) and attend;
        `sinks` (n_head,): each head's sink logit, in the softmax's denominator only (gpt-oss); `select`: the mask of
        the positions each query attends to (dsa_select), in place of the causal one."""
        c, kv = self.c, self.kv
        if layer in kv.ring_layers:  # its ring's rows under the ring's mask
            keys = self._store(kv.k[layer], k, kv.head_dim_k, kv.type_k, ring=True)
            values = self._store(kv.v[layer], v, kv.head_dim_v, kv.type_v, ring=True)
            return self._flash(q, keys, values, scale, self._mask(window, ring=True), sinks)
        keys = self._store(kv.k[layer], k, kv.head_dim_k, kv.type_k)
        if v is None:
            t = keys.contents
            values = ggml.ggml_view_3d(c, keys, kv.head_dim_v, t.ne[1], t.ne[2], t.nb[1], t.nb[2], 0)
            self.cache_views.append(values)
        else:
            values = self._store(kv.v[layer], v, kv.head_dim_v, kv.type_v)
        return self._flash(q, keys, values, scale, self._mask(window) if select is None else select, sinks)

    def _flash(self, q, keys, values, scale: float, mask, sinks: torch.Tensor | None = None):
        """q (d, heads, n) against keys and values (d, n_kv, heads): (d_v * heads, n). ferry's attention kernel where
        it reads the cache (CpuBackend.native_attention), else ggml's flash attention."""
        c = self.c
        kernel = self.backend.native_attention(q, keys, values)
        if kernel is not None:
            out = kernel.node(c, q, keys, values, mask, None if sinks is None else self._vector(sinks), scale,
                              self.g.n_threads, self.g.keep)
        else:
            q = ggml.ggml_permute(c, q, 0, 2, 1, 3)  # (d, n, heads)
            out = ggml.ggml_flash_attn_ext(c, q, keys, values, mask, scale, 0.0, 0.0)  # (d_v, heads, n)
            ggml.ggml_flash_attn_ext_set_prec(out, ggml.GGML_PREC_F32)
            if sinks is not None:
                ggml.ggml_flash_attn_ext_add_sinks(out, self._vector(sinks))
        return ggml.ggml_reshape_2d(c, out, out.contents.ne[0] * out.contents.ne[1], self.n)

    def cached_rows(self, layer: int, k):
        """Write k (d, 1, n) into a values-in-keys cache; every cached row up to this batch's last as f32 (d, n_kv).
        What follows has that length: the graph then serves this cache length only."""
        kv = self.kv
        stored = self._write(kv.k[layer], k, kv.head_dim_k, kv.type_k)
        self.per_length = True
        rows = ggml.ggml_view_2d(self.c, stored, kv.head_dim_k, self.n_kv, stored.contents.nb[1], 0)
        return ggml.ggml_cast(self.c, rows, F32)

    def cache_sized(self, fn, inputs: tuple, shape: tuple[int, ...]):
        """fn(*inputs): a graph per cache length holds it (per_length)."""
        return fn(*inputs)

    def mla3(self, attn, q_nope, q_pe, row, select=None):
        """-mla 3 by u-batch size (LatentAttention.by_size): the form is fixed when the graph is built."""
        return attn.by_size(self, q_nope, q_pe, row, select)

    def attend(self, q, k, v, scale: float, select=None):
        """q (d, heads, n) to keys and values of every cached position (d, heads, n_kv) given here, under the
        causal mask (or `select`): (d_v * heads, n). Keys and values go in as f16, as a cache would hold them (f32
        under an f32 cache)."""
        c = self.c
        qtype = F32 if self.kv.type_k.value == F32 else F16
        keys, values = (ggml.ggml_cast(c, ggml.ggml_permute(c, t, 0, 2, 1, 3), qtype) for t in (k, v))
        return self._flash(q, keys, values, scale, self._mask(0) if select is None else select)

    def dsa_select(self, layer: int, q, k, w, top_k: int):
        """DeepSeek sparse attention's choice (layers/indexer.py): this batch's indexer keys k (d, 1, n) into the
        cache; where the graph's cache length passes top_k, each query's top_k positions by the indexer's score of q
        (d, heads, n) with head weights w (heads, n), as an f16 mask (n_kv, n) that also holds the causal one (0
        where attended, -inf elsewhere), else None (dense attention). The scores have the cache length: such a graph
        serves one length (GgmlGraphRunner runs it at powers of two, the positions past the cache masked)."""
        c, kv = self.c, self.kv
        d, heads, n = q.contents.ne[0], q.contents.ne[1], self.n
        stored = self._write(kv.index[layer], k, d, kv.type_index)
        self.selection = None
        if self.n_kv <= top_k:  # dense: nothing reads the keys yet, but later runs will
            self.writes.append(stored)
            return None
        keys = ggml.ggml_view_2d(c, stored, d, self.n_kv, stored.contents.nb[1], 0)
        if kv.type_index != Q.F32:  # f16 keys against f32 queries: ggml would round the queries to f16
            keys = ggml.ggml_cast(c, keys, F32)
        if not ggml.ggml_is_contiguous(q):
            q = ggml.ggml_cont(c, q)
        # the causal mask input as the runs fill it: (n_kv, n) contiguous (set_cache_length's strides)
        causal = ggml.ggml_cast(c, ggml.ggml_view_2d(c, self._mask(0), self.n_kv, n, 2 * self.n_kv, 0), F32)
        chunk = max(1, min(n, SCORE_FLOATS // (heads * self.n_kv)))  # tokens whose per-head scores are held at once
        chosen = None
        for t0 in range(0, n, chunk):
            part = self._select_rows(keys, q, w, causal, t0, min(chunk, n - t0), top_k)
            chosen = part if chosen is None else ggml.ggml_concat(c, chosen, part, 1)
        self.selection = ggml.ggml_cast(c, chosen, F16)
        return self.selection

    def _select_rows(self, keys, q, w, causal, t0: int, m: int, top_k: int):
        """dsa_select's mask for tokens t0 .. t0 + m - 1 (their (n_kv, heads, m) per-head scores held at once):
        (n_kv, m) float32, 0 where attended, -inf elsewhere."""
        c, n_kv = self.c, self.n_kv
        d, heads = q.contents.ne[0], q.contents.ne[1]
        qm = ggml.ggml_view_2d(c, q, d, heads * m, q.contents.nb[1], t0 * q.contents.nb[2])
        wm = ggml.ggml_view_3d(c, w, 1, heads, m, w.contents.nb[0], w.contents.nb[1], t0 * w.contents.nb[1])
        cm = ggml.ggml_view_2d(c, causal, n_kv, m, causal.contents.nb[1], t0 * causal.contents.nb[1])
        per_head = ggml.ggml_relu(c, ggml.ggml_mul_mat(c, keys, qm))  # (n_kv, heads * m)
        weighted = ggml.ggml_mul(c, ggml.ggml_reshape_3d(c, per_head, n_kv, heads, m), wm)  # (n_kv, heads, m)
        summed = ggml.ggml_sum_rows(c, ggml.ggml_cont(c, ggml.ggml_permute(c, weighted, 1, 0, 2, 3)))  # (1, n_kv, m)
        score = ggml.ggml_add(c, ggml.ggml_reshape_2d(c, summed, n_kv, m), cm)
        top = ggml.ggml_top_k(c, score, top_k)  # (top_k, m) int32
        unseen = ggml.ggml_reshape_3d(c, ggml.ggml_fill(c, score, -math.inf), 1, n_kv, m)
        zeros = ggml.ggml_fill(c, ggml.ggml_reshape_3d(c, ggml.ggml_cast(c, top, F32), 1, top_k, m), 0.0)
        chosen = ggml.ggml_reshape_2d(c, ggml.ggml_set_rows(c, unseen, zeros, top), n_kv, m)
        return ggml.ggml_add(c, chosen, cm)

    def sigmoid(self, x):
        return ggml.ggml_sigmoid(self.c, x)

    def mul(self, a, b):
        return ggml.ggml_mul(self.c, a, b)

    def l2_norm(self, x, eps: float):
        """x / sqrt(sum x^2 + eps) per row, as llama.cpp takes the delta-net's (RMSNorm with eps / n, then / sqrt(n);
        ggml_l2_norm floors the norm at eps instead)."""
        n = x.contents.ne[0]
        return ggml.ggml_scale(self.c, ggml.ggml_rms_norm(self.c, x, eps / n), n ** -0.5)

    def linears(self, x, ws: tuple[Weight, ...], norm: torch.Tensor | None = None, eps: float = 0.0) -> list:
        if norm is not None:
            x = self.rms_norm(x, norm, eps)
        return [self.linear(x, w) for w in ws]

    def gated_rms_norm(self, x, weight: torch.Tensor, z, eps: float):
        return ggml.ggml_mul(self.c, self.rms_norm(x, weight, eps), ggml.ggml_silu(self.c, z))

    def short_conv(self, layer: int, x, weight: torch.Tensor):
        """silu(causal depthwise convolution) of x (channels, n) after the sequence's last inputs of the layer; the
        last kernel - 1 inputs then go back to the state (a node the graph computes after the read)."""
        c, state, kept = self.c, self.kv.conv[layer], self.states["conv", layer]  # (n_seq, channels, kernel - 1)
        joined = ggml.ggml_concat(c, kept, ggml.ggml_transpose(c, x), 0)  # (kernel - 1 + n, channels, 1)
        t = joined.contents
        last = ggml.ggml_view_3d(c, joined, state.shape[2], state.shape[1], 1, t.nb[1], t.nb[2], self.n * t.nb[0])
        self.writes.append(ggml.ggml_cpy(c, last, kept))
        out = ggml.ggml_ssm_conv(c, joined, self._vector(weight))  # (channels, n, 1)
        return ggml.ggml_silu(c, ggml.ggml_reshape_2d(c, out, state.shape[1], self.n))

    def delta_net(self, net, q, k, v, b, alpha):
        """ggml's gated delta rule (q scaled inside, key head h % n_k_heads for value head h; not tiled: q and k
        repeated head by head first, h // ratio) from the sequence's state of the layer, the new state written back;
        q, k L2-normed, beta = sigmoid(b), g = softplus(alpha + dt_bias) * a here: (d, value heads, n)."""
        c, state, kept = self.c, self.kv.delta[net.layer], self.states["delta", net.layer]  # (n_seq, heads, d_v, d_k)
        d, heads, n = state.shape[3], state.shape[1], self.n
        q, k = self.l2_norm(q, net.norm_eps), self.l2_norm(k, net.norm_eps)
        g = ggml.ggml_mul(c, ggml.ggml_softplus(c, ggml.ggml_add(c, alpha, self._vector(net.dt_bias))),
                          self._vector(net.a))
        beta = ggml.ggml_sigmoid(c, b)
        ratio = heads // q.contents.ne[1]
        if not net.tiled and ratio > 1:  # (d, 1, k heads, n) -> (d, ratio, k heads, n): each key head ratio times
            q, k = (ggml.ggml_reshape_3d(c, ggml.ggml_repeat_4d(c, ggml.ggml_reshape_4d(c, t, d, 1, t.contents.ne[1], n),
                                                                d, ratio, t.contents.ne[1], n), d, heads, n)
                    for t in (q, k))
        whole = [t if ggml.ggml_is_contiguous(t) else ggml.ggml_cont(c, t) for t in (q, k, v, g, beta)]
        qkv = [ggml.ggml_reshape_4d(c, t, d, t.contents.ne[1], n, 1) for t in whole[:3]]
        g4, b4 = (ggml.ggml_reshape_4d(c, t, 1, heads, n, 1) for t in whole[3:])
        y = ggml.ggml_gated_delta_net(c, *qkv, g4, b4, ggml.ggml_reshape_4d(c, kept, d, d, heads, 1), 1)
        nb0 = y.contents.nb[0]
        new = ggml.ggml_view_1d(c, y, d * d * heads, d * heads * n * nb0)
        self.writes.append(ggml.ggml_cpy(c, new, ggml.ggml_reshape_1d(c, kept, d * d * heads)))
        return ggml.ggml_view_3d(c, y, d, heads, n, d * nb0, d * heads * nb0, 0)

    def ffn(self, x, gate: Weight, up: Weight, down: Weight, act: str):
        return self.backend.ffn_nodes(self.g, x, gate, up, down, act)

    def moe(self, x, router: Weight, up: Weight, gate: Weight, down: Weight, n_used: int, norm_topk: bool, act: str,
            routing=None, residual=None):
        out, ids = self.backend.moe_nodes(self.g, x, router, up, gate, down, n_used, norm_topk, act, routing)
        self.expert_ids.append(self.g.copy_out(ids, I32, (n_used, self.n)))
        self.n_used = n_used
        return out if residual is None else self.add(residual, out)

    def set_cache_length(self, n_kv: int, n_ring: int = 0) -> None:
        """Attend to the first n_kv cache positions (a ring layer: its first n_ring rows) at the next run: no
        operation's work buffer or intermediate depends on this length, so the built graph stays valid."""
        for view in self.cache_views:
            view.contents.ne[1] = n_kv
        for view in self.ring_views:
            view.contents.ne[1] = n_ring
        for (_, ring), mask in self.masks.items():
            t = mask.contents
            t.ne[0] = n_ring if ring else n_kv
            t.nb[1] = t.nb[0] * t.ne[0]
            t.nb[2] = t.nb[1] * t.ne[1]
            t.nb[3] = t.nb[2] * t.ne[2]

    def output_rows(self, x):
        if self.logit_rows == self.n:
            return x
        nb1 = x.contents.nb[1]
        return ggml.ggml_view_2d(self.c, x, x.contents.ne[0], self.logit_rows, nb1, (self.n - self.logit_rows) * nb1)


class GgmlGraphRunner:
    """Runs a model's forward on the CPU as one ggml graph, built once per u-batch size."""

    def __init__(self, backend: CpuBackend):
        self.backend = backend
        self.graphs: dict[tuple, tuple[_Graph, GraphOps]] = {}
        self.per_length: set[tuple] = set()  # keys of graphs built for one cache length

    def _build(self, model, n: int, kv: KVCache, logit_rows: int, n_kv: int) -> tuple[_Graph, GraphOps]:
        a = model.args
        n_nodes = (128 + 4 * max(a.n_expert_used, 1)) * a.n_layer + 256
        if a.indexer_top_k:  # the indexer's scores in pieces of tokens (GraphOps.dsa_select): 32 nodes a piece
            fewest = max(1, SCORE_FLOATS // (a.indexer_n_head * kv.n_ctx))  # tokens a piece at the longest cache
            n_nodes += 32 * -(-n // fewest) * len(a.indexer_layers)
        g = _Graph(self.backend, n, max_nodes=n_nodes)
        ops = GraphOps(self.backend, g, n, kv, logit_rows, n_kv)
        logits = model.forward(ops)
        g.finish(logits, *ops.expert_ids, *ops.writes)
        return g, ops

    layer_first = False  # a u-batch is one graph: nothing crosses PCIe to save

    def will_record(self) -> bool:
        return False  # a graph is built at its shape's first run, which a warm-up takes

    def report(self) -> list[str]:
        return []

    def forward(self, model, tokens: torch.Tensor, batch: Batch) -> torch.Tensor:
        n, kv, n_kv = batch.n_tokens, batch.kv, batch.n_kv
        key = (n, batch.logit_rows, id(kv))
        top_k = model.args.indexer_top_k
        if top_k and n_kv > top_k:  # sparse attention past its top-k: the indexer's scores have the cache length; a
            # graph per power of two serves the lengths up to it (the cells past n_kv masked)
            n_kv = min(kv.n_ctx, 1 << (n_kv - 1).bit_length())
            key += ("dsa", n_kv)
        if key in self.per_length:  # a graph whose nodes have the cache length (MLA's expanded latents)
            key += (n_kv,)
        if key not in self.graphs:
            if len(self.graphs) >= _MAX_GRAPHS:
                self.graphs.pop(next(iter(self.graphs)))
            built = self._build(model, n, kv, batch.logit_rows, n_kv)
            if built[1].per_length and len(key) == 3:
                self.per_length.add(key)
                key += (n_kv,)
            self.graphs[key] = built
        g, ops = self.graphs[key]
        n_ring = batch.ring_kv if kv.ring else 0
        ops.set_cache_length(n_kv, n_ring)
        positions = batch.positions.to(torch.int32).contiguous()
        masks = [torch.zeros(n, n_ring if ring else n_kv, dtype=torch.float16).masked_fill_(
                 ~(batch.ring_mask(window, n_ring) if ring else batch.mask(window, n_kv)), -math.inf)
                 for window, ring in ops.masks]
        logits = torch.empty(batch.logit_rows, model.args.n_vocab, dtype=torch.float32)
        ids = torch.empty(len(ops.expert_ids), n, ops.n_used, dtype=torch.int32)
        cells = [batch.cells.to(torch.int32).contiguous()]
        if kv.ring:
            cells.append(batch.ring_cells.to(torch.int32).contiguous())
        seq = 0 if batch.seq is None else int(batch.seq[0])  # a recurrent model's batch holds one sequence
        states = [torch.from_numpy(getattr(kv, kind)[layer][seq]) for kind, layer in ops.states]
        g.run([tokens.to(torch.int32).contiguous(), positions, *cells, *states, *masks], logits, *ids)
        batch.expert_ids = list(ids)
        return logits
