"""The GPU forward's op set: TorchOps whose positions, cache cells and rope angles live on the GPU and whose ops are
fused Triton kernels where one exists (a decode step's attention in three launches), so that a step needs nothing from
the host and can be recorded as a CUDA graph (runners/cuda_graphs.py); -mla 3's prompt form timed per size."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right
from gguf.constants import GGMLQuantizationType as Q

from ferry.layers.attention import with_sinks
from ferry.layers.rope import Rope
from ferry.offload.policy import Explorer
from ferry.runtime.batch import Batch
from ferry.runtime.kv_cache import TORCH_TYPES
from ferry.runtime.runners.eager import TorchOps


DECODE_MAX = 8  # tokens up to which attention runs as the decode kernel over the cache (and graphs are used)


class LatentForms:
    """-mla 3 on a GPU: the form (absorbed or expanded) a prompt u-batch's latent attention takes, measured on this
    machine and model, as auto measures where experts run (policy.Explorer; classes by the u-batch's and the
    cache's sizes, powers of two): the first u-batches of a class run `warmup` + `samples` layers in each form,
    one layer each in turn, timed by CUDA events, and the faster form is kept for the class. The crossover moves
    with the GPU, the head count, the cache type and -amb: on one H100 at V2-Lite's shapes, absorbing won over
    short caches at every u-batch and expanding over 4096 cells and more (docs/performance.md, 2026-11-23).
    `fixed`: a rule (n_tokens, n_kv) -> form instead of measuring (tests, benchmarks)."""

    def __init__(self, fixed: Callable[[int, int], str] | None = None):
        self.explorer = Explorer(samples=3, alternate=True)
        self.fixed = fixed

    def run(self, n_tokens: int, n_kv: int, forms: dict[str, Callable[[], torch.Tensor]]) -> torch.Tensor:
        if self.fixed is not None:
            return forms[self.fixed(n_tokens, n_kv)]()
        form, trial = self.explorer.mode(n_tokens, dict.fromkeys(forms, 1.0), cells=n_kv)
        if not trial:
            return forms[form]()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = forms[form]()
        end.record()
        end.synchronize()  # a few layers per class wait for their own attention: the next decision needs its time
        self.explorer.record(n_tokens, form, start.elapsed_time(end) / 1e3, cells=n_kv)
        return out

    def report(self) -> list[str]:
        """One line per class timed so far: the form kept (or that it is still being timed) and the times behind it
        (`ferry run --verbose`)."""
        ex = self.explorer
        return [f"-mla 3 prompt form {ex.chosen[key]}: {ex.why(*key)}" if key in ex.chosen else
                f"-mla 3 prompt form for u-batches up to {key[0]} over up to {key[1]} cells: still being timed"
                for key in ex.trials]


class CudaOps(TorchOps):
    """One forward's ops on the GPU: `pos` / `cells` (n,) int64 on the GPU (`ring_cells`: the rows in a ring layer,
    Batch.ring_cells; the cells where the cache keeps no rings); tables: Rope -> (cos, sin) of every cache position."""

    def __init__(self, backend, batch: Batch, tokens: torch.Tensor, pos: torch.Tensor, cells: torch.Tensor,
                 tables: dict, latent_forms: LatentForms, ring_cells: torch.Tensor | None = None):
        super().__init__(backend, batch, tokens)
        self.pos, self.cells, self.tables = pos, cells, tables
        self.ring_cells = cells if ring_cells is None else ring_cells
        self.latent_forms = latent_forms
        self._base: torch.Tensor | None = None
        self._ring: torch.Tensor | None = None

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """x on this op set's GPU, made the current device: Triton launches on the current one."""
        torch.cuda.set_device(self.tokens.device)
        return x.to(self.tokens.device)

    def rebind(self, batch: Batch) -> None:
        """A recorded step replayed for `batch`: what its host steps between graphs read (the cache length, the
        mask), with nothing kept from the batch before."""
        self.batch = batch
        self._moved.clear()

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        from ferry.kernels.cuda.norm_rope import rms_norm

        return rms_norm(x, self.backend.vector(weight), eps)

    def add_rms_norm(self, x: torch.Tensor, dx: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        from ferry.kernels.cuda.norm_rope import add_rms_norm

        return add_rms_norm(x, dx, self.backend.vector(weight), eps)

    def fused_attention(self, attn, x: torch.Tensor, norm: torch.Tensor | None, eps: float) -> torch.Tensor | None:
        """A decode step's attention layer in three launches: one GEMV for q, k and v (their rows uploaded as one
        matrix; the pre-norm taken inside it; dense K-quants held as KRows: the norm, then a GEMV each into one
        output), one kernel for the q/k norms, rope and both cache stores, and attention over the cache. Biases
        (gpt-oss's) join the GEMV's output in one add, and norms across all heads (minimax-m2) run between the first
        two as two norm kernels over q's and k's columns."""
        from ferry.kernels.cuda.attention import qkv_rope_store
        from ferry.kernels.cuda.gemv import gemv

        kv, n = self.batch.kv, x.shape[0]
        w = self.backend.fused((attn.wq, attn.wk, attn.wv))
        rows = None if w is not None else held_krows(self.backend, (attn.wq, attn.wk, attn.wv))
        biases = (attn.bq, attn.bk, attn.bv)
        if ((w is None and rows is None) or n > DECODE_MAX or self.batch.seq is not None or kv.v_in_k
                or len({b is None for b in biases}) > 1
                or any(t not in (Q.F16, Q.Q8_0) or (t == Q.Q8_0 and d % 32)
                       for t, d in ((kv.type_k, attn.head_dim_k), (kv.type_v, attn.head_dim_v)))):
            return None
        k_q8, v_q8 = kv.type_k == Q.Q8_0, kv.type_v == Q.Q8_0
        cos, sin = self.tables[attn.rope]
        norms = (None, None) if attn.q_norm is None else (self.backend.vector(attn.q_norm),
                                                           self.backend.vector(attn.k_norm))
        if w is not None:
            y = gemv(w, x, norm=None if norm is None else (self.backend.vector(norm), eps))
        else:
            y = _krows_gemvs(rows, x if norm is None else self.rms_norm(x, norm, eps))
        if attn.bq is not None:
            y = y + self.backend.joined(biases)
        if attn.norm_whole and attn.q_norm is not None:
            q_dim, k_dim = attn.n_head * attn.head_dim_k, attn.n_head_kv * attn.head_dim_k
            y = torch.cat([self.rms_norm(y[:, :q_dim], attn.q_norm, attn.norm_eps),
                           self.rms_norm(y[:, q_dim:q_dim + k_dim], attn.k_norm, attn.norm_eps),
                           y[:, q_dim + k_dim:]], 1)
            norms = (None, None)
        q = qkv_rope_store(y, *norms, attn.norm_eps, cos, sin, self.pos, self._cells(attn.layer),
                           kv.k[attn.layer], kv.v[attn.layer], k_q8, v_q8, attn.n_head, attn.n_head_kv,
                           attn.head_dim_k, attn.head_dim_v, attn.rope.n_rot, attn.rope.neox)
        return self._decode_attention(attn.layer, q, attn.scale, attn.window, attn.sinks)

    def _decode_attention(self, layer: int, q: torch.Tensor, scale: float, window: int,
                          sinks: torch.Tensor | None = None, select: torch.Tensor | None = None) -> torch.Tensor:
        """q (n, heads, dk) of a decode-sized batch against the cache up to each token's position, or the cells
        `select` gives each (dsa_select; a q8_0 or expanded cache's): the decode kernel, which reads f16 or q8_0 rows
        in place."""
        from ferry.kernels.cuda.attention import attention_decode

        kv = self.batch.kv
        v_rows = kv.k[layer] if kv.v_in_k else kv.v[layer]  # MLA: the values are the first of each key row
        base, ring = self._row_base(layer)
        return attention_decode(q, _typed(kv.k[layer], kv.type_k), _typed(v_rows, kv.type_v),
                                kv.type_k == Q.Q8_0, kv.type_v == Q.Q8_0, self.pos, base, kv.n_head_kv,
                                kv.head_dim_v, scale, window, n_cells=kv.n_ctx, sinks=None if sinks is None else self.backend.vector(sinks),
                                select=select, ring=ring)

    def compressed_attention(self, attn, q: torch.Tensor, kv: torch.Tensor, pooled: tuple, indexed: tuple):
        """DeepSeek-V4's compressors, indexer and attention (TorchOps') over an f16 cache in kernels that read the
        positions on the GPU (kernels/cuda/compressed.py; the indexer's top-k over each token's complete windows,
        kernels/cuda/indexer.py), each token's attention reading only its window's cells and the entries it sees or
        was given. A decode-sized batch pools its windows in compress_step too: a recorded graph serves every length.
        A prompt's windows are pooled by TorchOps.compress, which indexes them on the host: its compressed attention
        runs between CUDA graphs when a step is recorded (cache_sized), as another cache type's runs whole through
        TorchOps."""
        def deferred(fn):
            def run(*t):
                return fn(self, attn, t[0], t[1], t[2:2 + len(pooled)], t[2 + len(pooled):])

            return self.cache_sized(run, (q, kv, *pooled, *indexed), (q.shape[0], q.shape[1] * q.shape[2]))

        if self.batch.kv.type_k != Q.F16:
            return deferred(TorchOps.compressed_attention)
        if q.shape[0] > DECODE_MAX:
            return deferred(CudaOps._compressed_kernels)
        return self._compressed_kernels(attn, q, kv, pooled, indexed)

    def _compressed_kernels(self, attn, q: torch.Tensor, kv: torch.Tensor, pooled: tuple, indexed: tuple):
        """compressed_attention's kernels; a prompt's windows pooled by TorchOps.compress."""
        from ferry.kernels.cuda.compressed import attention_compressed
        from ferry.kernels.cuda.indexer import indexer_top_k

        compress = self._compress_step if q.shape[0] <= DECODE_MAX else self.compress
        entries = compress(attn.compressor, *pooled) if pooled else None
        select = None
        if indexed:
            index = attn.indexer
            keys = compress(index.compressor, *indexed[:2])
        if entries is not None and not entries.shape[0]:  # a prompt's first windows not complete yet
            entries = None
        elif indexed and keys.shape[0]:
            last = (self.pos + 1) // index.compressor.ratio - 1  # the last entry each token sees
            select = indexer_top_k(indexed[2], indexed[3], keys, last, torch.zeros_like(last), index.top_k,
                                   keys.shape[0])
        self._store(attn.layer, kv, None)
        base, ring = self._row_base(attn.layer)
        return attention_compressed(q, self.batch.kv.k[attn.layer], entries, select, self.pos, base, attn.window,
                                    attn.ratio, attn.head_dim ** -0.5, self.backend.vector(attn.sinks), ring=ring)

    def _compress_step(self, comp, kv: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
        """A compressor's step (compress_step) over this batch's sequence's state: its entries (cap, dim)."""
        from ferry.kernels.cuda.compressed import compress_step

        seq = self._one_sequence()[0]  # a graph is recorded per sequence (CudaGraphRunner's key)
        cache, key, vec = self.batch.kv, (comp.layer, comp.name), self.backend.vector
        entries = cache.entries[key][seq]
        cos, sin = self.tables[comp.rope]
        compress_step(kv, score, vec(comp.ape), *(t[seq] for t in cache.rings[key]), entries, vec(comp.norm), cos, sin,
                      self.pos, comp.ratio, comp.rope.n_rot, comp.rope.neox, comp.norm_eps)
        return entries

    def hyper_pre(self, streams: torch.Tensor, mix: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n_hc: int,
                  n_iters: int, eps: float):
        from ferry.kernels.cuda.hyper import hyper_pre

        return hyper_pre(streams, mix, self.backend.vector(base), self.backend.vector(scale), n_hc, n_iters, eps)

    def hyper_post(self, streams: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor):
        from ferry.kernels.cuda.hyper import hyper_post

        return hyper_post(streams, y, post, comb)

    def l2_norm(self, x: torch.Tensor, eps: float) -> torch.Tensor:
        """x / sqrt(sum x^2 + eps): the RMSNorm kernel with eps / n and a weight of n^-1/2 (one launch)."""
        from ferry.kernels.cuda.norm_rope import rms_norm

        n = x.shape[-1]
        return rms_norm(x, self.backend.vector(_root_inverse(n)), eps / n)

    def short_conv(self, layer: int, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """A generation step's convolution in one kernel; a prompt's through torch (TorchOps)."""
        if x.shape[0] != 1:
            return super().short_conv(layer, x, weight)
        from ferry.kernels.cuda.delta_net import conv_step

        return conv_step(x, self._state("conv", layer), self.backend.vector(weight))

    def delta_net(self, net, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, b: torch.Tensor,
                  alpha: torch.Tensor) -> torch.Tensor:
        """A generation step's delta rule, its gates and q/k norms in one kernel (the key heads read in place, not
        repeated); a prompt's by chunks, the state's passage through them one kernel (delta_scan)."""
        if q.shape[0] != 1:
            return super().delta_net(net, q, k, v, b, alpha)
        from ferry.kernels.cuda.delta_net import step

        vec = self.backend.vector
        return step(q, k, v, b, alpha, vec(net.dt_bias), vec(net.a), self._state("delta", net.layer), net.tiled,
                    net.norm_eps)

    def linears(self, x: torch.Tensor, ws: tuple, norm: torch.Tensor | None = None,
                eps: float = 0.0) -> list[torch.Tensor]:
        """A decode step's projections of one input as one GEMV where the backend holds them as one matrix (the
        pre-norm taken inside it)."""
        fused = self.backend.fused(ws)
        if fused is None or x.shape[0] > DECODE_MAX:
            return super().linears(x, ws, norm, eps)
        from ferry.kernels.cuda.gemv import gemv

        y = gemv(fused, x, norm=None if norm is None else (self.backend.vector(norm), eps))
        return list(torch.split(y, [w.ne[1] for w in ws], dim=-1))

    def gated_rms_norm(self, x: torch.Tensor, weight: torch.Tensor, z: torch.Tensor, eps: float) -> torch.Tensor:
        from ferry.kernels.cuda.delta_net import gated_norm

        return gated_norm(x, self.backend.vector(weight), z, eps)

    def delta_scan(self, d_k: int):
        from ferry.kernels.cuda import delta_net
        from ferry.layers.delta_net import CHUNK

        return delta_net.scan if delta_net.scans(d_k, CHUNK) else None

    def moe(self, x: torch.Tensor, router, up, gate, down, n_used: int, norm_topk: bool, act: str, routing=None,
            residual: torch.Tensor | None = None) -> torch.Tensor:
        out, ids = self.backend.moe(x, router, up, gate, down, n_used, norm_topk, act, routing, residual)
        self.batch.expert_ids.append(ids)
        return out

    def _cell_base(self) -> torch.Tensor:
        """Each token's cache cell minus its position (where its sequence starts), once per forward."""
        if self._base is None:
            self._base = self.cells - self.pos
        return self._base

    def _ring_base(self) -> torch.Tensor:
        """Each token's row in a ring layer minus its position modulo the ring (where its sequence's ring starts)."""
        if self._ring is None:
            self._ring = self.ring_cells - self.pos % self.batch.kv.ring
        return self._ring

    def _row_base(self, layer: int) -> tuple[torch.Tensor, int]:
        """(each token's row minus its position's place in the layer, the layer's ring or 0): what the decode kernels
        add a position to (modulo the ring) to read its row."""
        kv = self.batch.kv
        return (self._ring_base(), kv.ring) if layer in kv.ring_layers else (self._cell_base(), 0)

    def _cells(self, layer: int) -> torch.Tensor:
        """The rows this batch's keys and values go to in a layer (a ring layer's, or the cells)."""
        return self.ring_cells if layer in self.batch.kv.ring_layers else self.cells

    def rope(self, x: torch.Tensor, rope: Rope) -> torch.Tensor:
        from ferry.kernels.cuda.norm_rope import norm_rope

        cos, sin = self.tables[rope]
        return norm_rope(x, None, 0.0, cos, sin, self.pos, rope.n_rot, rope.neox)

    def _store(self, layer: int, k: torch.Tensor, v: torch.Tensor | None) -> None:
        """This batch's keys and values into their cache cells (v None: a cache whose values are in the keys)."""
        from ferry.kernels.cuda.attention import store_q8_0

        kv, n, cells = self.batch.kv, k.shape[0], self._cells(layer)
        pairs = [(kv.k[layer], kv.type_k, k)] + ([] if v is None else [(kv.v[layer], kv.type_v, v)])
        for cache, qtype, x in pairs:
            if qtype == Q.Q8_0:
                store_q8_0(x, cache, cells)
            else:
                cache.view(TORCH_TYPES[qtype]).view(cache.shape[0], -1).index_copy_(
                    0, cells, x.reshape(n, -1).to(TORCH_TYPES[qtype]))

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, scale: float,
                  window: int, sinks: torch.Tensor | None = None, select: torch.Tensor | None = None) -> torch.Tensor:
        kv, n = self.batch.kv, q.shape[0]
        self._store(layer, k, v)
        if select is not None and kv.v_in_k and kv.type_k == Q.F16:  # sparse attention over a latent cache: the
            # selected rows only, heads in blocks (a prompt's or a decode step's; its shapes do not depend on the cache
            # length: no cut in a recorded graph)
            from ferry.kernels.cuda.attention import attention_selected

            return attention_selected(q, kv.k[layer], select, kv.head_dim_v, scale)
        if n <= DECODE_MAX:
            return self._decode_attention(layer, q, scale, window, sinks, select)

        ring = layer in kv.ring_layers

        def over_cache(q, *select):  # a prompt: flash / memory-efficient attention over the cache as f16
            n_kv = self.batch.ring_kv if ring else self.batch.n_kv  # a ring's rows under its mask
            keys = _floats(kv.k[layer][:n_kv], kv.type_k).view(n_kv, kv.n_head_kv, kv.head_dim_k)
            if kv.v_in_k:  # MLA: the values are the first of each key row
                values = keys[..., :kv.head_dim_v]
            else:
                values = _floats(kv.v[layer][:n_kv], kv.type_v).view(n_kv, kv.n_head_kv, kv.head_dim_v)
            mask = self._on(("ring", window), self.batch.ring_mask(window), q.device) if ring else None
            return self._sdpa_f16(q, keys, values, scale, window, sinks, *select, mask=mask)

        inputs = (q,) if select is None else (q, select)
        return self.cache_sized(over_cache, inputs, (n, q.shape[1] * kv.head_dim_v))

    def dsa_select(self, layer: int, q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, top_k: int) -> torch.Tensor:
        """DeepSeek sparse attention's choice (layers/indexer.py) on the GPU: this batch's indexer keys into cache
        rows `cells`, then each token's top_k cells (kernels/cuda/indexer.py) as (n, top_k) cell ids, -1 in the slots
        of a token that sees fewer. A decode step scores the whole cache's width, each token up to its position only
        (a recorded graph serves every length); a prompt u-batch the cells up to the batch's last, between graphs.
        Kept as `selection` for the layers that share it."""
        from ferry.kernels.cuda.indexer import indexer_top_k

        kv, n = self.batch.kv, q.shape[0]
        rows = kv.index[layer].view(TORCH_TYPES[kv.type_index]).view(kv.n_ctx, kv.index_dim)
        rows.index_copy_(0, self.cells, k.reshape(n, -1).to(rows.dtype))
        pos, base = self.pos, self._cell_base()
        if n <= DECODE_MAX:
            self.selection = indexer_top_k(q, w, rows, pos, base, top_k, kv.n_ctx)
        else:  # a deferred step's result comes back as float32: exact cell ids below 2^24
            self.selection = self.cache_sized(lambda q, w: indexer_top_k(q, w, rows, pos, base, top_k, self.batch.n_kv),
                                              (q, w), (n, top_k))
        return self.selection

    def cache_sized(self, fn, inputs: tuple[torch.Tensor, ...], shape: tuple[int, ...]) -> torch.Tensor:
        """fn(*inputs), whose shapes depend on the cache length: while a prompt step is recorded as CUDA graphs,
        it runs between two graphs at each replay, with the batch of that replay."""
        recorder = self.backend.recorder
        if recorder is None:
            return fn(*inputs)
        return recorder.defer(fn, shape, self.tokens.device, inputs=inputs, shared="cache_sized")

    def _sdpa_f16(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                  window: int, sinks: torch.Tensor | None = None, select: torch.Tensor | None = None,
                  mask: torch.Tensor | None = None) -> torch.Tensor:
        """q (n, heads, d) to keys and values (n_kv, heads_kv, d) of every attended cell, in f16: (n, heads * d_v).
        sinks: Attention.sinks (with_sinks' one more key, under the mask). select: dsa_select's cells, the mask.
        mask: a (n, n_kv) bool mask in place of the batch's within `window` (a ring's)."""
        n = q.shape[0]
        keys = keys.to(torch.float16)
        # (1, heads, tokens, dim): torch's flash and memory-efficient kernels take only 4-D inputs (3-D ones fall
        # back to the math kernel, which materialises every score in float32) and no GQA here
        q = q.to(keys.dtype).transpose(0, 1)[None]
        keys, values = keys.transpose(0, 1)[None], values.to(keys.dtype).transpose(0, 1)[None]
        group = q.shape[1] // keys.shape[1]
        if group > 1 and keys.shape[1] == 1:  # one head shared by all (MLA's latent): a broadcast view, no copies
            keys, values = keys.expand(-1, q.shape[1], -1, -1), values.expand(-1, q.shape[1], -1, -1)
        elif group > 1:
            keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        if mask is None and (sinks is not None or self.batch.seq is not None or window):
            mask = self._on(("mask", window), self.batch.mask(window), q.device)
        if sinks is not None:
            q, keys, values, mask = with_sinks(q[0], keys[0], values[0], mask, self.backend.vector(sinks), scale)
            out = F.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=mask, scale=scale)
            return out[0].transpose(0, 1).reshape(n, -1).float()
        if select is not None:  # sparse attention: the selected cells (within the causal mask) as the mask
            from ferry.kernels.cuda.indexer import selected_mask

            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=selected_mask(select, keys.shape[2]),
                                                 scale=scale)
        elif self.batch.seq is None and not window and self.batch.start == 0:  # causal from cell 0: flash
            out = F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=scale)
        elif self.batch.seq is None and not window:  # one sequence's next positions: causal to the cache's end, flash
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=causal_lower_right(n, keys.shape[2]),
                                                 scale=scale)
        else:  # a mask (windows, rings, server slots): the memory-efficient kernel
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
        return out[0].transpose(0, 1).reshape(n, -1).float()

    def cached_rows(self, layer: int, k: torch.Tensor) -> torch.Tensor:
        kv = self.batch.kv
        self._store(layer, k, None)
        return _floats(kv.k[layer][:self.batch.n_kv], kv.type_k).float()

    def head_linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Through the float16 copy of w on the GPU (CudaBackend.half): a GEMV per head and token for few tokens,
        float32 throughout; f16 cuBLAS with float32 accumulation for many, as CudaBackend.linear multiplies."""
        from ferry.kernels.cuda.gemv import head_gemv
        from ferry.backends.cuda import GEMV_MAX, _mm

        w16 = self.backend.half(w)
        if x.shape[0] <= GEMV_MAX:
            return head_gemv(x, w16)
        return _mm(x.transpose(0, 1).to(torch.float16), w16.transpose(1, 2)).transpose(0, 1)

    def expand_latents(self, latents: torch.Tensor, attn, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Through the float16 copies of k_b / v_b (CudaBackend.half), as head_linear: per-head GEMVs of each latent
        for few rows, one f16 cuBLAS product per projection for many."""
        from ferry.kernels.cuda.gemv import head_gemv
        from ferry.backends.cuda import GEMV_MAX, _mm

        k_b, v_b = (self.backend.half(t)[first:first + count] for t in (attn.k_b, attn.v_b))
        rows, lora = latents.shape
        if rows <= GEMV_MAX:
            x = latents.float()[:, None, :].expand(rows, count, lora)
            return head_gemv(x, k_b.transpose(1, 2)), head_gemv(x, v_b)
        x = latents.to(torch.float16)
        k = _mm(x, k_b.permute(1, 0, 2).reshape(lora, -1))  # (lora, count * nope)
        v = _mm(x, v_b.permute(2, 0, 1).reshape(lora, -1))  # (lora, count * v)
        return k.view(rows, count, -1), v.view(rows, count, -1)

    def mla3(self, attn, q_nope, q_pe, row, select=None) -> torch.Tensor:
        """-mla 3: decode steps absorbed (the decode kernel); a prompt u-batch in the form measured faster for its
        size and the cache length (LatentForms), decided at each run: a recorded prompt graph serves every cache
        length, so the whole latent attention runs between graphs."""
        n = self.n_tokens
        if n <= DECODE_MAX:
            return attn.absorbed(self, q_nope, q_pe, row, select)

        def faster(q_nope, q_pe, row, select=None):
            forms = {"absorbed": lambda: attn.absorbed(self, q_nope, q_pe, row, select),
                     "expanded": lambda: attn.expanded(self, q_nope, q_pe, row, select)}
            return self.latent_forms.run(n, self.batch.n_kv, forms)

        inputs = (q_nope, q_pe, row) + (() if select is None else (select,))
        return self.cache_sized(faster, inputs, (n, attn.n_head * attn.head_dim_v))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               select: torch.Tensor | None = None) -> torch.Tensor:
        return self._sdpa_f16(q, k, v, scale, 0, select=select)


def _typed(rows: torch.Tensor, qtype: Q) -> torch.Tensor:
    """Cache rows as the kernels read them: q8_0 bytes, or the float type."""
    return rows if qtype == Q.Q8_0 else rows.view(TORCH_TYPES[qtype])


def _floats(rows: torch.Tensor, qtype: Q) -> torch.Tensor:
    """Cache rows (n, bytes) as (n, width) floats: a view of a float cache, q8_0 expanded to f16."""
    if qtype in TORCH_TYPES:
        return rows.view(TORCH_TYPES[qtype])
    from ferry.kernels.cuda.dequant import dequantize

    width = rows.shape[1] // 34 * 32
    return dequantize(rows.reshape(-1), qtype, (width, rows.shape[0]), torch.float16)


@functools.lru_cache(maxsize=None)
def _root_inverse(n: int) -> torch.Tensor:
    """n values of n^-1/2 (CudaOps.l2_norm's weight; one tensor per size, uploaded once)."""
    return torch.full((n,), n ** -0.5)


def held_krows(backend, ws: tuple) -> list | None:
    """The weights' KRows on the backend's GPU (dense K-quant matrices in krows.py's rows), or None unless all are
    held so."""
    from ferry.kernels.cuda.krows import KRows

    held = [backend.upload(w) for w in ws]
    return held if all(isinstance(t, KRows) for t in held) else None


def _krows_gemvs(rows: list, x: torch.Tensor) -> torch.Tensor:
    """x (n, cols) through each of `rows` (KRows of one input: attention's q, k and v), their outputs side by side
    in one (n, sum of rows) float32 tensor as the fused GEMV's, each GEMV writing its own columns."""
    y = torch.empty(x.shape[0], sum(m.ne[1] for m in rows), dtype=torch.float32, device=x.device)
    at = 0
    for m in rows:
        m.gemv(x, out=y[:, at:at + m.ne[1]])
        at += m.ne[1]
    return y
