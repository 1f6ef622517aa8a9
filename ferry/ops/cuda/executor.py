"""The GPU forward: TorchOps whose positions, cache cells and rope angles live on the GPU, so that a decode step
needs nothing from the host and is captured once per shape as a CUDA graph and replayed (llama.cpp does the
same); prompt u-batches are replayed as graphs cut at their attention over the cache, whose length changes."""

from __future__ import annotations

import ctypes
import gc
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right
from gguf.constants import GGMLQuantizationType as Q

from ferry.layers.rope import Rope
from ferry.ops.torch_ops import TorchOps
from ferry.policy import Explorer
from ferry.runtime.context import PROMPT_GRAPH_MAX, Batch
from ferry.runtime.kv_cache import TORCH_TYPES

DECODE_MAX = 8  # tokens up to which attention runs as the decode kernel over the cache (and graphs are used)
PROMPT_GRAPHS_KEPT = 8  # prompt shapes recorded at once
PROMPT_RECORDED_AT = 2  # the run of a prompt shape that records it as CUDA graphs (the first runs eagerly)


class LatentForms:
    """-mla 3 on a GPU: the form (absorbed or expanded) a prompt u-batch's latent attention takes, measured on this
    machine and model, as auto measures where experts run (policy.Explorer; classes by the u-batch's and the
    cache's sizes, powers of two): the first u-batches of a class run `warmup` + `samples` layers in each form,
    one layer each in turn, timed by CUDA events, and the faster form is kept for the class. The crossover moves
    with the GPU, the head count, the cache type and -amb: on one H100 at V2-Lite's shapes, absorbing won over
    short caches at every u-batch and expanding over 4096 cells and more (docs/performance.md, sessions 13-15).
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
    """One forward's ops on the GPU: `pos` / `cells` (n,) int64 on the GPU; tables: Rope -> (cos, sin) of every
    cache position."""

    def __init__(self, backend, batch: Batch, tokens: torch.Tensor, pos: torch.Tensor, cells: torch.Tensor,
                 tables: dict, latent_forms: LatentForms):
        super().__init__(backend, batch, tokens)
        self.pos, self.cells, self.tables = pos, cells, tables
        self.latent_forms = latent_forms
        self._base: torch.Tensor | None = None

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
        from ferry.ops.cuda import kernels

        return kernels.rms_norm(x, self.backend.vector(weight), eps)

    def add_rms_norm(self, x: torch.Tensor, dx: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        from ferry.ops.cuda import kernels

        return kernels.add_rms_norm(x, dx, self.backend.vector(weight), eps)

    def fused_attention(self, attn, x: torch.Tensor, norm: torch.Tensor | None, eps: float) -> torch.Tensor | None:
        """A decode step's attention layer in three launches: one GEMV for q, k and v (their rows uploaded as one
        matrix; the pre-norm taken inside it), one kernel for the q/k norms, rope and both cache stores, and
        attention over the cache."""
        from ferry.ops.cuda import kernels

        kv, n = self.batch.kv, x.shape[0]
        w = self.backend.fused((attn.wq, attn.wk, attn.wv))
        if (w is None or n > DECODE_MAX or self.batch.seq is not None or kv.v_in_k
                or any(b is not None for b in (attn.bq, attn.bk, attn.bv))
                or any(t not in (Q.F16, Q.Q8_0) or (t == Q.Q8_0 and d % 32)
                       for t, d in ((kv.type_k, attn.head_dim_k), (kv.type_v, attn.head_dim_v)))):
            return None
        k_q8, v_q8 = kv.type_k == Q.Q8_0, kv.type_v == Q.Q8_0
        cos, sin = self.tables[attn.rope]
        norms = (None, None) if attn.q_norm is None else (self.backend.vector(attn.q_norm),
                                                           self.backend.vector(attn.k_norm))
        y = kernels.gemv(w, x, norm=None if norm is None else (self.backend.vector(norm), eps))
        q = kernels.qkv_rope_store(y, *norms, attn.norm_eps, cos, sin, self.pos, self.cells,
                                   kv.k[attn.layer], kv.v[attn.layer], k_q8, v_q8, attn.n_head, attn.n_head_kv,
                                   attn.head_dim_k, attn.head_dim_v, attn.rope.n_rot, attn.rope.neox)
        return self._decode_attention(attn.layer, q, attn.scale, attn.window)

    def _decode_attention(self, layer: int, q: torch.Tensor, scale: float, window: int) -> torch.Tensor:
        """q (n, heads, dk) of a decode-sized batch against the cache up to each token's position (the decode
        kernel, which reads f16 or q8_0 rows in place)."""
        from ferry.ops.cuda import kernels

        kv = self.batch.kv
        v_rows = kv.k[layer] if kv.v_in_k else kv.v[layer]  # MLA: the values are the first of each key row
        return kernels.attention_decode(q, _typed(kv.k[layer], kv.type_k), _typed(v_rows, kv.type_v),
                                        kv.type_k == Q.Q8_0, kv.type_v == Q.Q8_0, self.pos, self._cell_base(),
                                        kv.n_head_kv, kv.head_dim_v, scale, window, n_cells=kv.n_ctx)

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

    def rope(self, x: torch.Tensor, rope: Rope) -> torch.Tensor:
        from ferry.ops.cuda import kernels

        cos, sin = self.tables[rope]
        return kernels.norm_rope(x, None, 0.0, cos, sin, self.pos, rope.n_rot, rope.neox)

    def _store(self, layer: int, k: torch.Tensor, v: torch.Tensor | None) -> None:
        """This batch's keys and values into their cache cells (v None: a cache whose values are in the keys)."""
        from ferry.ops.cuda import kernels

        kv, n = self.batch.kv, k.shape[0]
        pairs = [(kv.k[layer], kv.type_k, k)] + ([] if v is None else [(kv.v[layer], kv.type_v, v)])
        for cache, qtype, x in pairs:
            if qtype == Q.Q8_0:
                kernels.store_q8_0(x, cache, self.cells)
            else:
                cache.view(TORCH_TYPES[qtype]).view(kv.n_ctx, -1).index_copy_(
                    0, self.cells, x.reshape(n, -1).to(TORCH_TYPES[qtype]))

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, scale: float,
                  window: int) -> torch.Tensor:
        kv, n = self.batch.kv, q.shape[0]
        self._store(layer, k, v)
        if n <= DECODE_MAX:
            return self._decode_attention(layer, q, scale, window)

        def over_cache(q):  # a prompt: flash / memory-efficient attention over the cache as f16
            n_kv = self.batch.n_kv
            keys = _floats(kv.k[layer][:n_kv], kv.type_k).view(n_kv, kv.n_head_kv, kv.head_dim_k)
            if kv.v_in_k:  # MLA: the values are the first of each key row
                values = keys[..., :kv.head_dim_v]
            else:
                values = _floats(kv.v[layer][:n_kv], kv.type_v).view(n_kv, kv.n_head_kv, kv.head_dim_v)
            return self._sdpa_f16(q, keys, values, scale, window)

        return self.cache_sized(over_cache, (q,), (n, q.shape[1] * kv.head_dim_v))

    def cache_sized(self, fn, inputs: tuple[torch.Tensor, ...], shape: tuple[int, ...]) -> torch.Tensor:
        """fn(*inputs), whose shapes depend on the cache length: while a prompt step is recorded as CUDA graphs,
        it runs between two graphs at each replay, with the batch of that replay."""
        recorder = self.backend.recorder
        if recorder is None:
            return fn(*inputs)
        return recorder.defer(fn, shape, self.tokens.device, inputs=inputs, shared="cache_sized")

    def _sdpa_f16(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                  window: int) -> torch.Tensor:
        """q (n, heads, d) to keys and values (n_kv, heads_kv, d) of every attended cell, in f16: (n, heads * d_v)."""
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
        if self.batch.seq is None and not window and self.batch.start == 0:  # causal from cell 0: flash
            out = F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=scale)
        elif self.batch.seq is None and not window:  # one sequence's next positions: causal to the cache's end, flash
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=causal_lower_right(n, keys.shape[2]),
                                                 scale=scale)
        else:  # a mask (windows, server slots): the memory-efficient kernel
            out = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=self._on(("mask", window), self.batch.mask(window), q.device), scale=scale)
        return out[0].transpose(0, 1).reshape(n, -1).float()

    def cached_rows(self, layer: int, k: torch.Tensor) -> torch.Tensor:
        kv = self.batch.kv
        self._store(layer, k, None)
        return _floats(kv.k[layer][:self.batch.n_kv], kv.type_k).float()

    def head_linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Through the float16 copy of w on the GPU (CudaBackend.half): a GEMV per head and token for few tokens,
        float32 throughout; f16 cuBLAS with float32 accumulation for many, as CudaBackend.linear multiplies."""
        from ferry.ops.cuda import kernels
        from ferry.ops.cuda.backend import GEMV_MAX, _mm

        w16 = self.backend.half(w)
        if x.shape[0] <= GEMV_MAX:
            return kernels.head_gemv(x, w16)
        return _mm(x.transpose(0, 1).to(torch.float16), w16.transpose(1, 2)).transpose(0, 1)

    def expand_latents(self, latents: torch.Tensor, attn, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Through the float16 copies of k_b / v_b (CudaBackend.half), as head_linear: per-head GEMVs of each latent
        for few rows, one f16 cuBLAS product per projection for many."""
        from ferry.ops.cuda import kernels
        from ferry.ops.cuda.backend import GEMV_MAX, _mm

        k_b, v_b = (self.backend.half(t)[first:first + count] for t in (attn.k_b, attn.v_b))
        rows, lora = latents.shape
        if rows <= GEMV_MAX:
            x = latents.float()[:, None, :].expand(rows, count, lora)
            return kernels.head_gemv(x, k_b.transpose(1, 2)), kernels.head_gemv(x, v_b)
        x = latents.to(torch.float16)
        k = _mm(x, k_b.permute(1, 0, 2).reshape(lora, -1))  # (lora, count * nope)
        v = _mm(x, v_b.permute(2, 0, 1).reshape(lora, -1))  # (lora, count * v)
        return k.view(rows, count, -1), v.view(rows, count, -1)

    def mla3(self, attn, q_nope, q_pe, row) -> torch.Tensor:
        """-mla 3: decode steps absorbed (the decode kernel); a prompt u-batch in the form measured faster for its
        size and the cache length (LatentForms), decided at each run: a recorded prompt graph serves every cache
        length, so the whole latent attention runs between graphs."""
        n = self.n_tokens
        if n <= DECODE_MAX:
            return attn.absorbed(self, q_nope, q_pe, row)

        def faster(q_nope, q_pe, row):
            forms = {"absorbed": lambda: attn.absorbed(self, q_nope, q_pe, row),
                     "expanded": lambda: attn.expanded(self, q_nope, q_pe, row)}
            return self.latent_forms.run(n, self.batch.n_kv, forms)

        return self.cache_sized(faster, (q_nope, q_pe, row), (n, attn.n_head * attn.head_dim_v))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        return self._sdpa_f16(q, k, v, scale, 0)


def _is_prompt(key: tuple) -> bool:
    """Whether a recorded step's key is a prompt's (a u-batch of more than DECODE_MAX tokens, or a logical batch
    taken layer first, key[4] its u-batches' sizes): those count against PROMPT_GRAPHS_KEPT."""
    return key[2] > DECODE_MAX or key[4] is not None


def _typed(rows: torch.Tensor, qtype: Q) -> torch.Tensor:
    """Cache rows as the kernels read them: q8_0 bytes, or the float type."""
    return rows if qtype == Q.Q8_0 else rows.view(TORCH_TYPES[qtype])


def _floats(rows: torch.Tensor, qtype: Q) -> torch.Tensor:
    """Cache rows (n, bytes) as (n, width) floats: a view of a float cache, q8_0 expanded to f16."""
    if qtype in TORCH_TYPES:
        return rows.view(TORCH_TYPES[qtype])
    from ferry.ops.cuda.dequant import dequantize

    width = rows.shape[1] // 34 * 32
    return dequantize(rows.reshape(-1), qtype, (width, rows.shape[0]), torch.float16)


class Handshakes:
    """Words of page-locked memory through which a replayed CUDA graph and the host take turns with no CUDA call
    between them (the driver's stream memory operations): at host step k the graph writes ready[k] = 1, waits until
    done[k] = 1, sets it back to 0 and copies the step's result in; the host, which launched the graph, reads
    ready[k] until it is set, runs the step and writes done[k]. Right after ggml's threads have run, each CUDA call
    of the host costs 30-40 us against 10 on an idle host (docs/decisions.md, session 20): a hybrid decode step
    cut into a graph per layer paid a launch, a copy and a synchronize per MoE layer; this way it pays one launch."""

    CAPACITY = 1024  # host steps of one recording
    TIMEOUT_S = 120.0  # a host step the graph never reaches: an error, not a hang

    def __init__(self, lib, device):
        self.lib = lib
        self.device = device
        self.words = torch.zeros(2 * self.CAPACITY, dtype=torch.int32).pin_memory()
        self.host = self.words.numpy()  # ready[k] at 2k, done[k] at 2k + 1
        ptr = ctypes.c_uint64()
        if lib.cuMemHostGetDevicePointer_v2(ctypes.byref(ptr), ctypes.c_void_p(self.words.data_ptr()), 0):
            raise RuntimeError("cuMemHostGetDevicePointer failed on a page-locked buffer")
        self.base = ptr.value

    @classmethod
    def of(cls, device) -> Handshakes | None:
        """Handshakes for recordings on `device`, or None where the driver lacks stream memory operations (or
        FERRY_HANDSHAKES=0 turns them off): steps are then cut into graphs at every host step."""
        from ferry.runtime.streamer import cuda_driver, cudart_library

        lib = cuda_driver()
        if lib is None or cudart_library() is None or os.environ.get("FERRY_HANDSHAKES", "1") == "0":
            return None
        return cls(lib, device)

    def record(self, k: int, out: torch.Tensor, result: torch.Tensor) -> None:
        """Capture host step k into the current graph: signal, wait, then copy `result` (page-locked, which the
        host step fills) into `out`."""
        from ferry.runtime.streamer import cudart_library

        assert out.shape == result.shape and out.dtype == result.dtype and result.is_contiguous()
        stream = ctypes.c_void_p(torch.cuda.current_stream(self.device).cuda_stream)
        ready, done = self.base + 8 * k, self.base + 8 * k + 4
        for rc in (self.lib.cuStreamWriteValue32_v2(stream, ready, 1, 0),
                   self.lib.cuStreamWaitValue32_v2(stream, done, 1, _WAIT_EQ),
                   self.lib.cuStreamWriteValue32_v2(stream, done, 0, 0),
                   cudart_library().cudaMemcpyAsync(out.data_ptr(), result.data_ptr(),
                                                    result.numel() * result.element_size(), _H2D, stream)):
            if rc != 0:
                raise RuntimeError(f"recording a host step's handshake failed with CUDA error {rc}")

    def serve(self, k: int, step: Callable[[], None]) -> None:
        """At replay: wait until the graph reaches host step k, run it, and let the graph go on."""
        words, i = self.host, 2 * k
        spins = 0
        while words[i] != 1:
            spins += 1
            if not spins & 0xFFFFF:
                if spins == 0x100000:
                    start = time.monotonic()
                elif time.monotonic() - start > self.TIMEOUT_S:
                    raise RuntimeError(f"the GPU did not reach host step {k} in {self.TIMEOUT_S:.0f} s")
        words[i] = 0
        step()
        words[i + 1] = 1

    def release(self, ks: list[int]) -> None:
        """After a host step failed: let the graph past the steps ks it would wait at, wait for it to end, and
        clear what it signalled, so that the next replay starts from clean words."""
        for k in ks:
            self.host[2 * k + 1] = 1
        torch.cuda.synchronize(self.device)
        for k in ks:
            self.host[2 * k] = 0


_WAIT_EQ = 1  # CU_STREAM_WAIT_VALUE_EQ
_H2D = 1  # cudaMemcpyHostToDevice


class _Recorder:
    """Records a step as CUDA graphs cut wherever the backend must run host code (ops on weights in RAM, in the
    hybrid runtime): the backend calls defer(fn, shape) and gets a tensor into which fn's result is copied at
    replay, between the graph before and the graph after. With `handshakes`, a host step that reads only host
    memory (the backend passes it as `host`) does not cut the graph: the graph waits at it (Handshakes)."""

    def __init__(self, pool, handshakes: Handshakes | None = None):
        self.pool = pool
        self.steps: list = []  # graph launches and host steps, in order
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.host_tokens: dict[int, torch.Tensor] = {}  # a host-side embedding's tokens, by its GPU input's address
        self.handshakes = handshakes
        self.n_handshakes = 0
        self._waiting: list[tuple[int, Callable]] = []  # the current graph's handshakes: (k, host step)
        self._graph: torch.cuda.CUDAGraph | None = None
        self._buffers: dict[tuple, torch.Tensor] = {}  # staged inputs and results of shared defers

    def begin(self) -> None:
        self._graph = torch.cuda.CUDAGraph()
        # thread-local: what other threads do (ggml's pool, torch's host allocator) cannot break this capture
        self._graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")

    def end(self) -> None:
        with warnings.catch_warnings():  # a cut right at the start leaves an empty graph: harmless
            warnings.simplefilter("ignore", UserWarning)
            self._graph.capture_end()
        self.graphs.append(self._graph)
        self.steps.append(_launcher(self._graph))
        if self._waiting:
            self.steps.append(self._server(self._waiting))
            self._waiting = []
        self._graph = None

    def _server(self, waiting: list[tuple[int, Callable]]) -> Callable[[], None]:
        """The host's side of one launched graph's handshakes, in order; if one fails, the graph is let past the
        rest before the error goes on."""
        hs = self.handshakes

        def serve() -> None:
            for i, (k, step) in enumerate(waiting):
                try:
                    hs.serve(k, step)
                except BaseException:
                    hs.release([j for j, _ in waiting[i:]])
                    raise
        return serve

    def defer(self, fn, shape: tuple[int, ...], device, inputs: tuple[torch.Tensor, ...] = (),
              shared: str | None = None, host: tuple[Callable[[], torch.Tensor], torch.Tensor] | None = None
              ) -> torch.Tensor:
        """A tensor of `shape` that holds fn(*inputs) at replay. The inputs are copied at the end of the graph
        before the cut into buffers of this recording (so that the capture may reuse the originals' memory).
        Defers of one `shared` name use the same buffers: each one's result must be consumed before the next
        such step runs, as a layer's attention is before the next layer's. `host`: the same step as a function
        of host memory only that writes its result into the page-locked tensor given with it (of `shape`, float32):
        with handshakes it runs while the graph waits, without a cut."""
        if host is not None and self.handshakes is not None and self.n_handshakes < Handshakes.CAPACITY:
            step, result = host
            out = torch.empty(shape, dtype=torch.float32, device=device)  # the graph's pool: a fixed address
            self.handshakes.record(self.n_handshakes, out, result)
            self._waiting.append((self.n_handshakes, step))
            self.n_handshakes += 1
            return out
        staged = []
        for i, t in enumerate(inputs):
            key = (shared, i, tuple(t.shape), t.dtype)
            buf = self._buffers.get(key) if shared else None
            if buf is None:
                buf = torch.empty(t.shape, dtype=t.dtype, device=t.device)  # pool memory this recording keeps
                if shared:
                    self._buffers[key] = buf
            buf.copy_(t)
            staged.append(buf)
        self.end()
        out = self._buffers.get((shared, "out", shape)) if shared else None
        if out is None:
            out = torch.empty(shape, dtype=torch.float32, device=device)  # outside any capture: a fixed address
            if shared:
                self._buffers[shared, "out", shape] = out
        self.steps.append(lambda: out.copy_(fn(*staged), non_blocking=True))
        self.begin()
        return out

    def tokens_on_host(self, tokens: torch.Tensor) -> torch.Tensor:
        """The replayed step's tokens whose GPU copy is the recording's input `tokens`, as the host holds them."""
        return self.host_tokens[tokens.data_ptr()]

    def replay(self) -> None:
        for step in self.steps:
            step()


def _launcher(graph: torch.cuda.CUDAGraph):
    """graph.replay() without torch's prologue, which launches two fill kernels per replay to reseed its random
    number generator (these graphs draw no random numbers; a hybrid decode step replays one graph per layer): one
    cudaGraphLaunch through ctypes. torch's replay where the runtime or the instantiated graph is not at hand."""
    import ctypes

    from ferry.runtime.streamer import cudart_library

    lib = cudart_library()
    try:
        handle = ctypes.c_void_p(graph.raw_cuda_graph_exec())
    except (RuntimeError, AttributeError):
        handle = None
    if lib is None or handle is None or not handle.value:
        return graph.replay

    def launch() -> None:
        rc = lib.cudaGraphLaunch(handle, ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
        if rc != 0:
            raise RuntimeError(f"cudaGraphLaunch failed with error {rc}")
    return launch


@dataclass
class _Input:
    """One recorded forward's static inputs (its tokens, positions and cache cells on the GPU) and the op set that
    reads them; a replay copies the next batch's into them."""

    tokens: torch.Tensor
    pos: torch.Tensor
    cells: torch.Tensor
    ops: CudaOps | None = None  # made once the inputs are on the GPU

    def load(self, tokens: torch.Tensor, batch: Batch, graph) -> None:
        self.tokens.copy_(tokens)  # straight from the host into the graph's inputs
        self.pos.copy_(batch.positions)
        self.cells.copy_(batch.cells)
        self.ops.rebind(batch)
        if isinstance(graph, _Recorder):
            graph.host_tokens[self.tokens.data_ptr()] = tokens.cpu()


@dataclass
class _Captured:
    """A step of one shape as a CUDA graph (or, with host steps, graphs and host steps in turn): its forwards'
    static inputs, filled before each replay (one forward; or a logical batch's u-batches, then their joined rows,
    taken layer first); the logits of each u-batch; the routing the replay writes."""

    inputs: list[_Input]
    logits: list[torch.Tensor]
    expert_ids: list[torch.Tensor]
    graph: torch.cuda.CUDAGraph | _Recorder
    decided: str | None = None  # the backend's decided way for this step's size when it was recorded


class CudaExecutor:
    """Runs a model's forward on the GPU backend as CUDA graphs, captured per shape and replayed (set
    FERRY_CUDA_GRAPHS=0 or graphs=False to run eagerly): a decode step of up to DECODE_MAX tokens from its first
    run, a prompt u-batch of up to PROMPT_GRAPH_MAX tokens from the second run of its shape on (prompt tails of
    every length are run once and not kept; at most PROMPT_GRAPHS_KEPT shapes at once), with attention over the
    cache between graphs; likewise a logical batch taken layer first, whose shape is its u-batches' sizes. A step
    recorded with cuts is recorded again once the backend's auto has decided its size's way (its host steps may then
    become handshakes)."""

    def __init__(self, backend, graphs: bool | None = None):
        self.backend = backend
        self.device = backend.device
        self.latent_forms = LatentForms()  # -mla 3's measured prompt forms, kept for this executor's runs
        self.graphs = graphs if graphs is not None else os.environ.get("FERRY_CUDA_GRAPHS", "1") != "0"
        self._tables: dict[tuple[int, int], dict[Rope, tuple[torch.Tensor, torch.Tensor]]] = {}
        self._captured: dict[tuple, _Captured] = {}
        self._prompt_runs: dict[tuple, int] = {}
        self._pool = None
        self._handshakes: Handshakes | None | bool = False  # made at the first recording with host steps

    def _rope_tables(self, model, n_ctx: int) -> dict:
        """cos/sin of every cache position for each rope the model uses (the CPU path's angles), once per model
        and cache length."""
        key = (id(model), n_ctx)
        if key not in self._tables:
            ropes = {getattr(b.attn, "rope", None) for b in model.blocks} - {None}
            self._tables[key] = {r: tuple(t.to(self.device) for t in r.angles(torch.arange(n_ctx))) for r in ropes}
        return self._tables[key]

    def _ops(self, model, batch: Batch, tokens, pos, cells) -> CudaOps:
        return CudaOps(self.backend, batch, tokens, pos, cells, self._rope_tables(model, batch.kv.n_ctx),
                       self.latent_forms)

    def placed_ops(self, model, batch: Batch, tokens: torch.Tensor) -> CudaOps:
        """The op set of an eager step: its tokens, positions and cache cells moved to this GPU."""
        return self._ops(model, batch, *(t.to(self.device) for t in (tokens, batch.positions, batch.cells)))

    def _decided(self, n_tokens: int) -> str | None:
        decided = getattr(self.backend, "decided", None)
        return decided(n_tokens) if decided else None

    def will_record(self) -> bool:
        """Whether a prompt shape has run but is not recorded yet, and will record its CUDA graphs when it runs
        again: a one-time cost a benchmark's warm-up should take (as llama-bench's takes llama.cpp's)."""
        return any(runs < PROMPT_RECORDED_AT and key not in self._captured for key, runs in self._prompt_runs.items())

    def _recorded(self, key: tuple, n_tokens: int, prompt: bool = False) -> bool:
        """Whether this step runs as graphs: decode steps always, prompt u-batches (and logical batches of
        u-batches of up to `n_tokens`, `prompt`) from their shape's second run. At most PROMPT_GRAPHS_KEPT prompt
        shapes stay recorded (a server meets many prompt tails): recording another drops the least recently
        replayed one, which must then run twice again to come back."""
        recordable = self.backend.graph_safe or getattr(self.backend, "host_steps", False)
        if not self.graphs or not recordable or n_tokens > PROMPT_GRAPH_MAX:
            return False
        if n_tokens <= DECODE_MAX and not prompt:
            return True
        if key in self._captured:
            self._captured[key] = self._captured.pop(key)  # the most recently replayed last
            return True
        self._prompt_runs[key] = self._prompt_runs.get(key, 0) + 1
        if self._prompt_runs[key] < PROMPT_RECORDED_AT:
            return False
        prompts = [k for k in self._captured if _is_prompt(k)]
        if len(prompts) >= PROMPT_GRAPHS_KEPT:
            del self._captured[prompts[0]]
            self._prompt_runs.pop(prompts[0], None)
        return True

    def forward(self, model, tokens: torch.Tensor, batch: Batch) -> torch.Tensor:
        key = (id(model), id(batch.kv), batch.n_tokens, batch.all_logits, None)  # key[2]: the u-batch size
        if not self._recorded(key, batch.n_tokens):
            return model.forward(self.placed_ops(model, batch, tokens))
        c = self._captured.get(key)
        if c is not None and c.decided != self._decided(batch.n_tokens) and len(getattr(c.graph, "graphs", ())) > 1:
            c = None  # cut before auto decided its way: recorded again, the old step dropped only after the capture
        if c is None:
            c = self._captured[key] = self._capture(model, [(tokens, batch)], batch,
                                                    lambda opss: [model.forward(opss[0])])
        else:
            c.inputs[0].load(tokens, batch, c.graph)
            c.graph.replay()
        batch.expert_ids = list(c.expert_ids)
        return c.logits[0].clone()

    def forward_layer_first(self, model, tokens: list[torch.Tensor], batches: list[Batch],
                            joined: Batch) -> list[torch.Tensor]:
        """The u-batches of one logical batch, layer by layer (Model.forward_layer_first): each one's logits.
        `joined`: Batch.join(batches). Recorded as a prompt u-batch is, its shape being the u-batches' sizes: each
        u-batch's attention over the cache and the joined rows' experts in RAM run between graphs. Eagerly, the
        u-batches' launches bound the run at small u-batches (docs/performance.md, sessions 10 and 19)."""
        sizes = tuple(b.n_tokens for b in batches)
        key = (id(model), id(joined.kv), joined.n_tokens, joined.all_logits, sizes)
        if not self._recorded(key, max(sizes), prompt=True):
            return model.forward_layer_first([self.placed_ops(model, b, t) for t, b in zip(tokens, batches)],
                                             self.placed_ops(model, joined, torch.cat(tokens)))
        forwards = [*zip(tokens, batches), (torch.cat(tokens), joined)]  # the u-batches, then their rows joined
        c = self._captured.get(key)
        if c is None:
            c = self._captured[key] = self._capture(
                model, forwards, joined, lambda opss: model.forward_layer_first(opss[:-1], opss[-1]))
        else:
            for i, (t, b) in zip(c.inputs, forwards):
                i.load(t, b, c.graph)
            c.graph.replay()
        joined.expert_ids = list(c.expert_ids)
        return [x.clone() for x in c.logits]

    def _capture(self, model, forwards: list[tuple[torch.Tensor, Batch]], routed: Batch, run) -> _Captured:
        """Run the step once eagerly on a side stream (compiles kernels, sizes scratch buffers), then record it: as
        one graph, or as graphs cut at host steps (a prompt's attention over the cache, the hybrid runtime's ops on
        weights in RAM), and replay it for this step's result. `forwards`: each op set's tokens and batch;
        `run(op sets)`: the step's logits, one tensor per u-batch; `routed`: the batch whose MoE layers record their
        routing."""
        inputs = [_Input(*(t.to(self.device) for t in (tokens, b.positions, b.cells))) for tokens, b in forwards]

        def op_sets() -> list[CudaOps]:
            return [self._ops(model, b, i.tokens, i.pos, i.cells) for i, (_, b) in zip(inputs, forwards)]

        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            run(op_sets())
        torch.cuda.current_stream(self.device).wait_stream(stream)
        routed.expert_ids = []
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        opss = op_sets()
        for i, ops in zip(inputs, opss):
            i.ops = ops
        n_tokens = max(b.n_tokens for _, b in forwards)
        decided = self._decided(n_tokens)
        if self.backend.graph_safe and n_tokens <= DECODE_MAX and len(forwards) == 1:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                logits = run(opss)
        else:
            if self._handshakes is False:
                self._handshakes = Handshakes.of(self.device)
            graph = _Recorder(self._pool, self._handshakes)
            for i, (tokens, _) in zip(inputs, forwards):
                graph.host_tokens[i.tokens.data_ptr()] = tokens.cpu()
            torch.cuda.synchronize(self.device)
            gc.collect()  # as torch.cuda.graph does: no collection (freeing events, pinned buffers) mid-capture
            gc.disable()
            with torch.cuda.stream(stream):
                self.backend.recorder = graph
                graph.begin()
                try:
                    logits = run(opss)
                    graph.end()
                finally:
                    self.backend.recorder = None
                    gc.enable()
            torch.cuda.current_stream(self.device).wait_stream(stream)
        graph.replay()
        if n_tokens > DECODE_MAX:  # the warm-up's cached blocks belong to its stream: give them back
            torch.cuda.empty_cache()
        return _Captured(inputs, logits, list(routed.expert_ids), graph, decided)
