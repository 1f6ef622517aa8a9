"""CPU backend: ggml kernels through ggml-python, reading weights straight from the mmap (no copy).

Each op shape is built once as a small ggml graph (leaves point at the mmap'd weight and at the
torch tensors of the call) and replayed; one ggml thread pool serves every graph.
"""

from __future__ import annotations

import ctypes
import os
from typing import Callable

import ggml
import numpy as np
import torch

from ferry.errors import FerryError
from ferry.ops import Weight

_GRAPHS_PER_WEIGHT = 64  # distinct (op, batch size) shapes kept built per weight, oldest dropped first
_MAX_NODES = 16
_GLU = {"silu": ggml.ggml_swiglu_split, "gelu": ggml.ggml_geglu_split}  # act(gate) * up in one op


def physical_cores() -> int:
    """Physical core count (llama.cpp's default thread count); falls back to logical CPUs."""
    try:
        cores = set()
        with open("/proc/cpuinfo") as fh:
            phys = core = None
            for line in fh:
                if line.startswith("physical id"):
                    phys = line.split(":")[1].strip()
                elif line.startswith("core id"):
                    core = line.split(":")[1].strip()
                elif not line.strip() and core is not None:
                    cores.add((phys, core))
                    phys = core = None
        if cores:
            return len(cores)
    except OSError:
        pass
    return os.cpu_count() or 1


class _Graph:
    """One built ggml graph: leaves bound to external memory, intermediates in its own arena."""

    def __init__(self, backend: "CpuBackend", arena_bytes: int):
        overhead = ggml.ggml_tensor_overhead()
        meta_params = ggml.ggml_init_params(
            mem_size=_MAX_NODES * overhead + ggml.ggml_graph_overhead_custom(_MAX_NODES, False), mem_buffer=None, no_alloc=True)
        self.meta = ggml.ggml_init(meta_params)
        arena_params = ggml.ggml_init_params(mem_size=arena_bytes + _MAX_NODES * (overhead + 64), mem_buffer=None, no_alloc=False)
        self.arena = ggml.ggml_init(arena_params) if arena_bytes else None
        self.backend = backend
        self.graph = None
        self.cplan = None
        self.work: np.ndarray | None = None
        self.inputs: list = []
        self.output = None

    def leaf(self, qtype: int, ne: tuple[int, ...], data_ptr: int | None = None):
        ne = tuple(int(n) for n in ne)
        fn = {1: ggml.ggml_new_tensor_1d, 2: ggml.ggml_new_tensor_2d, 3: ggml.ggml_new_tensor_3d}[len(ne)]
        t = fn(self.meta, qtype, *ne)
        if data_ptr is not None:
            t.contents.data = data_ptr
        return t

    def finish(self, output) -> None:
        self.output = output
        self.graph = ggml.ggml_new_graph_custom(self.meta, _MAX_NODES, False)
        ggml.ggml_build_forward_expand(self.graph, output)
        self.cplan = ggml.ggml_graph_plan(self.graph, self.backend.n_threads, self.backend.threadpool)
        if self.cplan.work_size:
            self.work = np.empty(self.cplan.work_size, dtype=np.uint8)
            self.cplan.work_data = ctypes.cast(self.work.ctypes.data, ctypes.POINTER(ctypes.c_uint8))

    def run(self, inputs: list[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        for t, x in zip(self.inputs, inputs):
            t.contents.data = x.data_ptr()
        self.output.contents.data = out.data_ptr()
        status = ggml.ggml_graph_compute(self.graph, ctypes.byref(self.cplan))
        if status != 0:
            raise RuntimeError(f"ggml graph compute failed with status {status}")
        return out

    def __del__(self) -> None:
        for ctx in (getattr(self, "meta", None), getattr(self, "arena", None)):
            if ctx:
                ggml.ggml_free(ctx)


class CpuBackend:
    """Runs weight-bound ops with ggml on `n_threads` threads from one reused thread pool."""

    name = "CPU"

    def __init__(self, n_threads: int | None = None):
        self.n_threads = n_threads or physical_cores()
        ggml.ggml_cpu_init()
        params = ggml.ggml_threadpool_params_default(self.n_threads)
        self.threadpool = ggml.ggml_threadpool_new(ctypes.byref(params))
        # torch's OpenMP workers spin after each parallel region and steal the cores this pool needs:
        # a Q4_0 GEMV ran at 0.9 GB/s beside them, 22 GB/s with torch on one thread (docs/decisions.md)
        torch.set_num_threads(1)

    def _graph(self, owner: Weight, key: tuple, build: Callable[[], _Graph]) -> _Graph:
        """The graph for `key`, kept on the weight it reads so that it dies with the weight's mmap."""
        g = owner.graphs.get(key)
        if g is None or g.backend is not self:
            if len(owner.graphs) >= _GRAPHS_PER_WEIGHT:
                owner.graphs.pop(next(iter(owner.graphs)))
            g = owner.graphs[key] = build()
        return g

    def _weight_leaf(self, g: _Graph, w: Weight):
        """A leaf over the weight's mmap bytes; types without a ggml CPU matmul get a float32 copy, made once."""
        if ggml.ggml_get_type_traits_cpu(w.qtype.value).contents.vec_dot:
            return g.leaf(w.qtype.value, w.ne, w.data.ctypes.data)
        if w.f32_copy is None:
            try:
                w.f32_copy = np.ascontiguousarray(w.dequantize())
            except NotImplementedError:
                raise FerryError(f"tensor '{w.name}' is {w.qtype.name}, which neither ggml's CPU kernels nor the "
                                 "reference dequantizer handle; re-quantize the model to a common type") from None
        return g.leaf(ggml.GGML_TYPE_F32, w.ne, w.f32_copy.ctypes.data)

    def linear(self, x: torch.Tensor, w: Weight) -> torch.Tensor:
        """y = x @ W.T for x (n, k) float32 and W (m, k) in any ggml type."""
        x = x.contiguous().float()
        n, k = x.shape
        m = w.ne[1]

        def build() -> _Graph:
            g = _Graph(self, 0)
            wt = self._weight_leaf(g, w)
            xt = g.leaf(ggml.GGML_TYPE_F32, (k, n))
            g.inputs = [xt]
            g.finish(ggml.ggml_mul_mat(g.meta, wt, xt))
            return g

        out = torch.empty(n, m, dtype=torch.float32)
        return self._graph(w, ("linear", n), build).run([x], out)

    def ffn(self, x: torch.Tensor, gate: Weight, up: Weight, down: Weight, act: str) -> torch.Tensor:
        """The dense gated FFN down(act(gate x) * up x) as one graph: x (n, n_embd) float32."""
        x = x.contiguous().float()
        n, n_embd = x.shape
        n_ff = up.ne[1]

        def build() -> _Graph:
            g = _Graph(self, 3 * n_ff * n * 4 + 1024)
            xt = g.leaf(ggml.GGML_TYPE_F32, (n_embd, n))
            g.inputs = [xt]
            u = ggml.ggml_mul_mat(g.arena, self._weight_leaf(g, up), xt)
            gt = ggml.ggml_mul_mat(g.arena, self._weight_leaf(g, gate), xt)
            h = _GLU[act](g.arena, gt, u)
            g.finish(ggml.ggml_mul_mat(g.meta, self._weight_leaf(g, down), h))
            return g

        out = torch.empty(n, down.ne[1], dtype=torch.float32)
        return self._graph(up, ("ffn", id(gate), id(down), n, act), build).run([x], out)

    def get_rows(self, w: Weight, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of W (the embedding lookup), dequantized to float32: (n, k)."""
        ids = ids.to(torch.int32).contiguous()
        n, k = ids.numel(), w.ne[0]

        def build() -> _Graph:
            g = _Graph(self, 0)
            wt = self._weight_leaf(g, w)
            it = g.leaf(ggml.GGML_TYPE_I32, (n,))
            g.inputs = [it]
            g.finish(ggml.ggml_get_rows(g.meta, wt, it))
            return g

        out = torch.empty(n, k, dtype=torch.float32)
        return self._graph(w, ("get_rows", n), build).run([ids], out)

    def moe_ffn(self, x: torch.Tensor, up: Weight, gate: Weight, down: Weight, ids: torch.Tensor,
                act: str) -> torch.Tensor:
        """Routed experts over only the selected ones (mul_mat_id), fused up/gate + activation.

        x (n, n_embd) float32, ids (n, n_used) int; returns (n, n_used, n_embd), unweighted.
        """
        x = x.contiguous().float()
        ids = ids.to(torch.int32).contiguous()
        n, n_embd = x.shape
        n_used = ids.shape[1]
        n_ff = up.ne[1]

        def build() -> _Graph:
            g = _Graph(self, 3 * n_ff * n_used * n * 4 + 1024)
            up_t = self._weight_leaf(g, up)
            gate_t = self._weight_leaf(g, gate)
            down_t = self._weight_leaf(g, down)
            xt = g.leaf(ggml.GGML_TYPE_F32, (n_embd, 1, n))
            it = g.leaf(ggml.GGML_TYPE_I32, (n_used, n))
            g.inputs = [xt, it]
            u = ggml.ggml_mul_mat_id(g.arena, up_t, xt, it)
            gt = ggml.ggml_mul_mat_id(g.arena, gate_t, xt, it)
            h = _GLU[act](g.arena, gt, u)
            g.finish(ggml.ggml_mul_mat_id(g.meta, down_t, h, it))
            return g

        out = torch.empty(n, n_used, n_embd, dtype=torch.float32)
        return self._graph(up, ("moe", id(gate), id(down), n, n_used, act), build).run([x, ids], out)

    def close(self) -> None:
        if self.threadpool:
            ggml.ggml_threadpool_free(self.threadpool)
            self.threadpool = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
