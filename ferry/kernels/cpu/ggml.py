"""ggml's CPU kernels through ggml-python: a small graph built once per op shape (leaves bound to the mmap'd weights
and to the caller's tensors at each run, intermediates placed in one shared compute buffer) and replayed, and ggml's
interleaved (repacked) CPU layouts of weights."""

from __future__ import annotations

import ctypes
import functools
import sys

import ggml
import numpy as np
import torch


_MAX_NODES = 64


class _Graph:
    """One built ggml graph: weights and inputs bound to external memory, outputs bound to the caller's
    tensors at each run, intermediates placed by ggml's graph allocator in the backend's one compute
    buffer (graphs run one at a time, so they share it; liveness analysis reuses memory within a graph).
    `backend`: the CpuBackend that runs it (its thread counts and pool, its compute buffer)."""

    def __init__(self, backend, n_tokens: int, max_nodes: int = _MAX_NODES):
        overhead = ggml.ggml_tensor_overhead()
        params = ggml.ggml_init_params(
            mem_size=2 * max_nodes * overhead + ggml.ggml_graph_overhead_custom(max_nodes, False), mem_buffer=None,
            no_alloc=True)
        self.ctx = ggml.ggml_init(params)  # where every tensor of the graph is created (metadata only)
        self.max_nodes = max_nodes
        self.backend = backend
        self.n_threads = backend.n_threads if n_tokens == 1 else backend.n_threads_batch  # llama.cpp's -t / -tb
        self.graph = None
        self.cplan = None
        self.work: np.ndarray | None = None
        self.inputs: list = []
        self.outputs: list = []  # (tensor, the node that writes it: itself or a ggml_cpy view of it)
        self.input_views: list = []
        self.placed: list | None = None  # the nodes the graph allocator places (set at the first allocation)
        self.generation = -1  # the compute buffer's generation when they were placed
        self.keep: list = []  # what nodes of ferry's own kernels read (their operands, scratch): alive with the graph

    def leaf(self, qtype: int, ne: tuple[int, ...], data_ptr: int | None = None):
        ne = tuple(int(n) for n in ne)
        fn = {1: ggml.ggml_new_tensor_1d, 2: ggml.ggml_new_tensor_2d, 3: ggml.ggml_new_tensor_3d}[len(ne)]
        t = fn(self.ctx, qtype, *ne)
        if data_ptr is not None:
            t.contents.data = data_ptr
        return t

    def input(self, qtype: int, ne: tuple[int, ...]):
        """A leaf bound to the next entry of run()'s `inputs`."""
        t = self.leaf(qtype, ne)
        self.inputs.append(t)
        return t

    def copy_out(self, t, qtype: int, ne: tuple[int, ...]):
        """A second output: `t` copied into a tensor bound to the caller's memory at each run."""
        dst = self.leaf(qtype, ne)
        node = ggml.ggml_cpy(self.ctx, t, dst)
        self.outputs.append((dst, node))
        return node

    def finish(self, output, *extra_nodes) -> None:
        self.outputs.insert(0, (output, output))
        self.graph = ggml.ggml_new_graph_custom(self.ctx, self.max_nodes, False)
        for node in (output, *extra_nodes):
            ggml.ggml_build_forward_expand(self.graph, node)
        # bound tensors must look allocated to the allocator; run() binds them before every compute
        for t in self.inputs + [t for t, _ in self.outputs]:
            t.contents.data = self.backend.placeholder
        inputs = {ctypes.addressof(t.contents): t for t in self.inputs}
        self.input_views = []  # (view, its input, offset): rebound with the input
        for i in range(ggml.ggml_graph_n_nodes(self.graph)):
            node = ggml.ggml_graph_node(self.graph, i)
            src = node.contents.view_src
            if src and ctypes.addressof(src.contents) in inputs:
                self.input_views.append((node, inputs[ctypes.addressof(src.contents)], node.contents.view_offs))
        self.cplan = ggml.ggml_graph_plan(self.graph, self.n_threads, self.backend.threadpool)
        if self.cplan.work_size:
            self.work = np.empty(self.cplan.work_size, dtype=np.uint8)
            self.cplan.work_data = ctypes.cast(self.work.ctypes.data, ctypes.POINTER(ctypes.c_uint8))

    def run(self, inputs: list[torch.Tensor], *outs: torch.Tensor) -> torch.Tensor:
        self.backend._allocate(self)  # first: it must see the bound tensors as placed
        for t, x in zip(self.inputs, inputs, strict=True):
            t.contents.data = x.data_ptr()
        for view, t, offset in self.input_views:
            view.contents.data = t.contents.data + offset
        for (t, node), y in zip(self.outputs, outs, strict=True):
            t.contents.data = node.contents.data = y.data_ptr()
        status = ggml.ggml_graph_compute(self.graph, ctypes.byref(self.cplan))
        if status != 0:
            raise RuntimeError(f"ggml graph compute failed with status {status}")
        return outs[0]

    def __del__(self) -> None:
        if getattr(self, "ctx", None):
            ggml.ggml_free(self.ctx)


class _RepackBuffer:
    """One CPU_REPACK buffer holding the interleaved copies of many weights (as llama.cpp allocates them)."""

    def __init__(self, ctx, buffer):
        self.ctx, self.buffer = ctx, buffer

    def __del__(self) -> None:
        ggml.ggml_backend_buffer_free(self.buffer)
        ggml.ggml_free(self.ctx)


class _Repacked:
    """A weight's tensor in a _RepackBuffer (interleaved rows for the AVX2/AVX512 GEMM kernels)."""

    def __init__(self, holder: _RepackBuffer, tensor):
        self.holder, self.tensor = holder, tensor


@ggml.ggml_log_callback
def _ggml_log(level: int, text: bytes, user_data) -> None:
    """ggml's log, warnings and errors only (its debug level prints a line per repacked tensor)."""
    if level in (ggml.GGML_LOG_LEVEL_WARN, ggml.GGML_LOG_LEVEL_ERROR) and text:
        sys.stderr.write(text.decode(errors="replace"))


def _repack_buffer_type():
    """ggml's CPU_REPACK buffer type, from the CPU device's extra buffer types (None where absent)."""
    reg = ggml.ggml_backend_cpu_reg()
    fn = ggml.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_dev_get_extra_bufts")
    if not fn:
        return None
    bufts = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)(fn)(ggml.ggml_backend_reg_dev_get(reg, 0))
    i = 0
    while bufts[i]:
        if ggml.ggml_backend_buft_name(bufts[i]) == b"CPU_REPACK":
            return bufts[i]
        i += 1
    return None


@functools.lru_cache(maxsize=None)
def has_repack_layout(qtype, ne: tuple[int, ...]) -> bool:
    """Whether ggml has an interleaved CPU layout for this type and shape (matrices only): its CPU_REPACK
    buffer's init gives the tensor repack traits. Probed once per (type, shape) on an untouched allocation."""
    if len(ne) not in (2, 3) or qtype.value >= ggml.GGML_TYPE_COUNT:  # ik_llama.cpp's types: ggml has none
        return False
    ggml.ggml_cpu_init()
    buft = _repack_buffer_type()
    if buft is None:
        return False
    ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=2 * ggml.ggml_tensor_overhead(), mem_buffer=None, no_alloc=True))
    t = {2: ggml.ggml_new_tensor_2d, 3: ggml.ggml_new_tensor_3d}[len(ne)](ctx, qtype.value, *ne)
    buffer = ggml.ggml_backend_alloc_ctx_tensors_from_buft(ctx, buft)
    found = bool(buffer and t.contents.extra)
    if buffer:
        ggml.ggml_backend_buffer_free(buffer)
    ggml.ggml_free(ctx)
    return found
