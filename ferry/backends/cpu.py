"""CPU backend: ggml kernels through ggml-python (kernels/cpu/ggml.py), reading weights straight from the mmap (no
copy) or from ggml's repacked copies, and ferry's own kernel for one token's routed experts (kernels/cpu/native.py)
where it runs them. One ggml thread pool serves every graph."""

from __future__ import annotations

import math

import ctypes
import functools
import os
from typing import Callable

import ggml
import numpy as np
import torch

from ferry.config import settings
from ferry.errors import FerryError
from ferry.kernels.activations import SILU_CLAMP_LIMIT, SWIGLU_OAI
from ferry.kernels.capabilities import can, can_ggml, cpu_native_experts, cpu_native_linear, cpu_reads_plain
from ferry.kernels.cpu import native
from ferry.kernels.cpu.ggml import _Graph, _ggml_log, _RepackBuffer, _Repacked, _repack_buffer_type, has_repack_layout
from ferry.quant import AS_Q8_0, Q, as_q8_0
from ferry.weight import Weight


_GRAPHS_PER_WEIGHT = 64  # distinct (op, batch size) shapes kept built per weight, oldest dropped first


_ALIGN = 64




_GLU = {"silu": ggml.ggml_swiglu_split, "gelu": ggml.ggml_geglu_split,  # act(gate) * up in one op
        "swiglu_oai": lambda c, g, u: ggml.ggml_swiglu_oai(c, g, u, *SWIGLU_OAI),
        "silu_clamp": lambda c, g, u: ggml.ggml_mul(
            c, ggml.ggml_silu(c, ggml.ggml_clamp(c, g, -math.inf, SILU_CLAMP_LIMIT)),
            ggml.ggml_clamp(c, u, -SILU_CLAMP_LIMIT, SILU_CLAMP_LIMIT))}


_ACT = {"silu": ggml.ggml_silu, "gelu": ggml.ggml_gelu}


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


def _kernel_layout(w: Weight) -> int:
    """The address ferry's expert kernel reads a weight at: its plain bytes (capabilities' "plain" types), or ggml's
    repacked copy."""
    if can(w.qtype).cpu_native == "plain" or not w.repacked:
        return w.data.ctypes.data
    return w.repacked.tensor.contents.data


def _linear_type(w: Weight) -> int:
    """The type ferry's matrix kernel reads a dense weight as: its own (Q8_0) copy's, else the weight's."""
    return Q.Q8_0.value if can(w.qtype).cpu_linear == "own" else w.qtype.value


def _biases(up: Weight, gate: Weight, down: Weight) -> tuple[int, int, int]:
    """Where ferry's expert kernel reads each matrix's (n_expert, rows) float32 biases, 0 where it has none."""
    return tuple(0 if w.bias is None else w.bias.data_ptr() for w in (up, gate, down))


def advise_huge_pages(address: int, size: int) -> None:
    """Ask Linux to back [address, address + size) with 2 MiB pages as it is first written (madvise MADV_HUGEPAGE;
    transparent huge pages are often on only where asked, as on the GPU machine). A token's experts are read as a few
    hundred KiB of each of many places: with 4 KiB pages each place costs TLB misses every 4 KiB and the hardware
    prefetchers stop at each page's end. Nothing happens where the call does not exist or fails."""
    libc = _libc()
    if libc is None or not address or size < _HUGE:
        return
    start = (address + 4095) & ~4095
    libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t((address + size - start) & ~4095), _MADV_HUGEPAGE)


_HUGE, _MADV_HUGEPAGE = 2 << 20, 14


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return lib
    except (OSError, AttributeError):
        return None


class CpuBackend:
    """Runs weight-bound ops with ggml on `n_threads` threads (0 or None: the physical cores; RunConfig checks a user's
    -t) from one reused thread pool."""

    label = "CPU"
    device = torch.device("cpu")
    layer_first = False  # nothing crosses PCIe: u-batch by u-batch

    def __init__(self, n_threads: int | None = None, repack: bool = True, n_threads_batch: int | None = None,
                 fused_moe: bool = True, native_kernels: bool | None = None):
        self.n_threads = n_threads if n_threads and n_threads > 0 else physical_cores()
        self.n_threads_batch = n_threads_batch if n_threads_batch and n_threads_batch > 0 else self.n_threads
        self.repack_buft = _repack_buffer_type() if repack else None
        self.fused_moe = fused_moe  # -fmoe: act(gate) * up as one ggml op in the MoE block
        self.repacked_bytes = 0
        self.repack_seconds = 0.0
        ggml.ggml_log_set(_ggml_log, None)
        ggml.ggml_cpu_init()
        params = ggml.ggml_threadpool_params_default(max(self.n_threads, self.n_threads_batch))
        self.threadpool = ggml.ggml_threadpool_new(ctypes.byref(params))
        # torch's OpenMP workers spin after each parallel region and steal the cores this pool needs:
        # a Q4_0 GEMV ran at 0.9 GB/s beside them, 22 GB/s with torch on one thread (docs/decisions.md)
        torch.set_num_threads(1)
        # the CPU device's buffer type (ggml-python's ggml_backend_cpu_buffer_type binding truncates the pointer)
        cpu = ggml.ggml_backend_reg_dev_get(ggml.ggml_backend_cpu_reg(), 0)
        self.galloc = ggml.ggml_gallocr_new(ggml.ggml_backend_dev_buffer_type(cpu))
        self.generation, self.buffer_size = 0, 0  # the compute buffer's moves so far, and its size
        # ferry's own kernels where they run (kernels/cpu/native.py), else ggml's; by default Settings.native_kernels
        self.native_kernels = settings().native_kernels if native_kernels is None else native_kernels
        self._kernels: dict[tuple, native.MoeExperts] = {}  # ferry's expert kernel per shape and types
        self._dense_kernel: native.Dense | None = None  # ferry's matrix kernel, made at first use
        self._attention: native.Attention | None = None  # ferry's attention kernel, made at first use
        self._placeholder = np.zeros(_ALIGN, dtype=np.uint8)
        self.placeholder = self._placeholder.ctypes.data

    def _allocate(self, g: _Graph) -> None:
        """Place g's intermediates in the compute buffer, unless they are there from an earlier run: graphs share
        the buffer as scratch, so a graph placed since the buffer last moved runs where it was placed (a hybrid
        decode step alternates between every MoE layer's graph; placing each afresh cost a reserve and an
        allocation per layer). The allocator leaves tensors that have an address alone, and another graph may
        have grown (moved) the buffer since: so a graph placed before that is cleared first and placed afresh."""
        if g.placed is None or g.generation != self.generation:
            if g.placed is None:
                views = {ctypes.addressof(v.contents) for v, _, _ in g.input_views}
                nodes = (ggml.ggml_graph_node(g.graph, i) for i in range(ggml.ggml_graph_n_nodes(g.graph)))
                g.placed = [t for t in nodes if not t.contents.data and ctypes.addressof(t.contents) not in views]
            else:
                for t in g.placed:
                    t.contents.data = None
                    t.contents.buffer = None
            # reserve first: the allocator would reuse the previous graph's layout for any graph of equal size
            if not (ggml.ggml_gallocr_reserve(self.galloc, g.graph) and ggml.ggml_gallocr_alloc_graph(self.galloc, g.graph)):
                raise FerryError("out of memory for the CPU compute buffer; lower -ub/--ubatch-size")
            size = ggml.ggml_gallocr_get_buffer_size(self.galloc, 0)
            if size != self.buffer_size:  # reallocated: every graph placed before points into freed memory
                self.generation, self.buffer_size = self.generation + 1, size
            g.generation = self.generation

    def _graph(self, owner: Weight, key: tuple, build: Callable[[], _Graph]) -> _Graph:
        """The graph for `key`, kept on the weight it reads so that it dies with the weight's mmap."""
        g = owner.graphs.get(key)
        if g is None or g.backend is not self:
            if len(owner.graphs) >= _GRAPHS_PER_WEIGHT:
                owner.graphs.pop(next(iter(owner.graphs)))
            g = owner.graphs[key] = build()
        return g

    def repack(self, *weights: Weight, progress: Callable[[int, int], None] | None = None) -> bool:
        """Copy the weights into ggml's interleaved CPU layout where ggml has one for their type and shape and ferry's
        kernels do not read them in their plain layout (MXFP4: a second copy of gpt-oss's experts that nothing would
        read), all into one buffer (once per weight); True if the first one is repacked. `progress(done, total)`
        is called in bytes after each weight."""
        todo = [w for w in weights if w.repacked is None]
        for w in todo:
            w.repacked = False
        todo = [w for w in todo if self.repack_buft is not None and has_repack_layout(w.qtype, w.ne)
                and not (self.native_kernels and cpu_reads_plain(w.qtype, w.ne) and native.library() is not None)]
        if todo:
            ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=(len(todo) + 1) * ggml.ggml_tensor_overhead(),
                                                       mem_buffer=None, no_alloc=True))
            tensors = [{2: ggml.ggml_new_tensor_2d, 3: ggml.ggml_new_tensor_3d}[len(w.ne)](ctx, w.qtype.value, *w.ne)
                       for w in todo]
            buffer = ggml.ggml_backend_alloc_ctx_tensors_from_buft(ctx, self.repack_buft)
            if not buffer:
                ggml.ggml_free(ctx)
                raise FerryError(f"out of memory repacking {len(todo)} weights; run with --no-repack")
            advise_huge_pages(ggml.ggml_backend_buffer_get_base(buffer), ggml.ggml_backend_buffer_get_size(buffer))
            holder = _RepackBuffer(ctx, buffer)
            total, done = sum(w.data.nbytes for w in todo), 0
            for w, t in zip(todo, tensors):
                ggml.ggml_backend_tensor_set(t, w.data.ctypes.data, 0, w.data.nbytes)
                w.repacked = _Repacked(holder, t)
                self.repacked_bytes += w.data.nbytes
                done += w.data.nbytes
                if progress:
                    progress(done, total)
        return bool(weights and weights[0].repacked)

    def _weight_leaf(self, g: _Graph, w: Weight, rows: bool = False):
        """The weight as a matmul operand: its repacked copy, else a leaf over the mmap bytes; types without
        a ggml CPU matmul get a float32 copy, made once. `rows`: for get_rows, which cannot read a repacked copy."""
        if not can_ggml(w.qtype):  # a path that would hand ggml a type it lacks (ferry's kernels read it alone)
            raise FerryError(f"tensor '{w.name}' is ik_llama.cpp's {w.qtype.name}, which only ferry's CPU expert kernel "
                             "reads, and this path would run it on ggml; run with FERRY_NATIVE unset (the kernel on)")
        if not rows and self.repack(w):
            return w.repacked.tensor
        if ggml.ggml_get_type_traits_cpu(w.qtype.value).contents.vec_dot:
            return g.leaf(w.qtype.value, w.ne, w.data.ctypes.data)
        if w.f32_copy is None:
            try:
                w.f32_copy = np.ascontiguousarray(w.dequantize())
            except NotImplementedError:
                raise FerryError(f"tensor '{w.name}' is {w.qtype.name}, which neither ggml's CPU kernels nor the "
                                 "reference dequantizer handle; re-quantize the model to a common type") from None
        return g.leaf(ggml.GGML_TYPE_F32, w.ne, w.f32_copy.ctypes.data)

    def linear_node(self, g: _Graph, x, w: Weight):
        """W x for x (k, n) float32: ferry's matrix kernel where it runs W (native_linear), else ggml's mul_mat."""
        c = x.contents
        at = self.native_linear(w, c.ne[1])
        if at is None or c.type != ggml.GGML_TYPE_F32 or c.nb[0] != 4 or c.ne[2] != 1 or c.ne[3] != 1:
            return ggml.ggml_mul_mat(g.ctx, self._weight_leaf(g, w), x)
        return self._dense().node(g.ctx, x, at, _linear_type(w), w.ne[1], g.keep)

    def ffn_nodes(self, g: _Graph, x, gate: Weight, up: Weight, down: Weight, act: str):
        """down(act(gate x) * up x) for x (n_embd, n)."""
        u = self.linear_node(g, x, up)
        gt = self.linear_node(g, x, gate)
        return self.linear_node(g, _GLU[act](g.ctx, gt, u), down)

    def moe_nodes(self, g: _Graph, x, router: Weight, up: Weight, gate: Weight, down: Weight, n_used: int,
                  norm_topk: bool, act: str, routing=None):
        """The sparse MoE block for x (n_embd, n): route_nodes, then the selected experts and their weighted sum
        (ferry's kernel where it runs them, else mul_mat_id with up/gate + activation fused). Returns (out (n_embd, n), expert ids (n_used, n))."""
        ids, weights = self.route_nodes(g, x, router, n_used, norm_topk, routing)
        n_embd, n = x.contents.ne[0], x.contents.ne[1]
        kernel = self.native_experts(n, True, up, gate, down, act)
        if kernel is not None:  # ferry's kernel as a node (run by ggml's threads)
            w2 = ggml.ggml_reshape_2d(g.ctx, weights, n_used, n)
            return kernel.node(g.ctx, x, ids, w2, *map(_kernel_layout, (up, gate, down)), gate.ne[2], g.keep,
                               _biases(up, gate, down)), ids
        return self.expert_nodes(g, ggml.ggml_reshape_3d(g.ctx, x, n_embd, 1, n), ids, weights, up, gate, down,
                                 act), ids

    def route_nodes(self, g: _Graph, x, router: Weight, n_used: int, norm_topk: bool, routing=None):
        """The router of x (n_embd, n): softmax, or layers.ffn.Routing's sigmoid + choice bias + groups + scale, then
        top-k. Returns (expert ids (n_used, n), their weights (1, n_used, n))."""
        c = g.ctx
        n_embd, n = x.contents.ne[0], x.contents.ne[1]
        n_expert = router.ne[1]
        x = ggml.ggml_reshape_3d(c, x, n_embd, 1, n)
        logits = ggml.ggml_mul_mat(c, self._weight_leaf(g, router), x)  # (n_expert, 1, n)
        if routing is not None and routing.logit_bias is not None:
            logits = ggml.ggml_add(c, logits, g.leaf(ggml.GGML_TYPE_F32, (n_expert,), routing.logit_bias.data_ptr()))
        if routing is not None and routing.gating == "softmax_weight":  # the top logits, then a softmax over them
            ids = ggml.ggml_top_k(c, ggml.ggml_reshape_2d(c, logits, n_expert, n), n_used)
            chosen = ggml.ggml_get_rows(c, ggml.ggml_reshape_3d(c, logits, 1, n_expert, n), ids)  # (1, n_used, n)
            weights = ggml.ggml_soft_max(c, ggml.ggml_reshape_2d(c, chosen, n_used, n))
            return ids, ggml.ggml_reshape_3d(c, weights, 1, n_used, n)
        sigmoid = routing is not None and routing.gating == "sigmoid"
        probs = ggml.ggml_sigmoid(c, logits) if sigmoid else ggml.ggml_soft_max(c, logits)
        choice = probs
        if routing is not None and routing.bias is not None:
            choice = ggml.ggml_add(c, probs, g.leaf(ggml.GGML_TYPE_F32, (n_expert,), routing.bias.data_ptr()))
        if routing is not None and routing.grouped:
            choice = self._group_mask(g, choice, routing, n_expert, n)
        ids = ggml.ggml_top_k(c, ggml.ggml_reshape_2d(c, choice, n_expert, n), n_used)  # (n_used, n)
        weights = ggml.ggml_get_rows(c, ggml.ggml_reshape_3d(c, probs, 1, n_expert, n), ids)  # (1, n_used, n)
        if norm_topk:
            w2 = ggml.ggml_reshape_2d(c, weights, n_used, n)
            weights = ggml.ggml_reshape_3d(c, ggml.ggml_div(c, w2, ggml.ggml_sum_rows(c, w2)), 1, n_used, n)
        if routing is not None and routing.scale != 1.0:
            weights = ggml.ggml_scale(c, weights, routing.scale)
        return ids, weights

    @staticmethod
    def _group_mask(g: _Graph, choice, routing, n_expert: int, n: int):
        """The choice scores (n_expert, 1, n) with every expert outside the n_group_used best groups at -inf."""
        c = g.ctx
        per, groups = n_expert // routing.n_group, routing.n_group
        by_group = ggml.ggml_cont(c, ggml.ggml_reshape_3d(c, choice, per, groups, n))  # (per, groups, n)
        best = ggml.ggml_top_k(c, by_group, routing.group_top)  # (top, groups, n) indices within each group
        best = ggml.ggml_get_rows(c, ggml.ggml_reshape_4d(c, by_group, 1, per, groups, n), best)  # (1, top, groups, n)
        score = ggml.ggml_sum_rows(c, ggml.ggml_reshape_3d(c, best, routing.group_top, groups, n))  # (1, groups, n)
        kept = ggml.ggml_top_k(c, ggml.ggml_reshape_2d(c, score, groups, n), routing.n_group_used)  # (used, n)
        rows = ggml.ggml_get_rows(c, by_group, kept)  # (per, used, n)
        masked = ggml.ggml_set_rows(c, ggml.ggml_fill(c, by_group, float("-inf")), rows, kept)
        return ggml.ggml_reshape_3d(c, masked, n_expert, 1, n)

    def expert_nodes(self, g: _Graph, x, ids, weights, up: Weight, gate: Weight, down: Weight, act: str):
        """The selected experts of x (n_embd, 1, n) for ids (n_used, n) (mul_mat_id, fused up/gate + activation):
        with weights (1, n_used, n), their weighted sum (n_embd, n); without, each slot's output (n_embd, n_used, n)."""
        return self.down_nodes(g, self.up_gate_nodes(g, x, ids, up, gate, act), ids, weights, down)

    def up_gate_nodes(self, g: _Graph, x, ids, up: Weight, gate: Weight, act: str):
        """act(gate x) * up x of each selected expert, x (n_embd, 1 or n_used, n): (n_ff, n_used, n)."""
        c = g.ctx
        u = self._experts_node(g, up, x, ids)
        gt = self._experts_node(g, gate, x, ids)
        if self.fused_moe or act not in _ACT:
            return _GLU[act](c, gt, u)
        return ggml.ggml_mul(c, _ACT[act](c, gt), u)

    def _experts_node(self, g: _Graph, w: Weight, x, ids):
        """Each selected expert of w times x (mul_mat_id), plus that expert's bias where w has biases."""
        y = ggml.ggml_mul_mat_id(g.ctx, self._weight_leaf(g, w), x, ids)
        if w.bias is None:
            return y
        return ggml.ggml_add_id(g.ctx, y, g.leaf(ggml.GGML_TYPE_F32, (w.ne[1], w.ne[2]), w.bias.data_ptr()), ids)

    def down_nodes(self, g: _Graph, h, ids, weights, down: Weight):
        """down h of each selected expert, h (n_ff, n_used, n): with weights (1, n_used, n), their weighted sum
        (n_embd, n); without, each slot's output (n_embd, n_used, n)."""
        c = g.ctx
        n_used, n = ids.contents.ne[0], ids.contents.ne[1]
        experts = self._experts_node(g, down, h, ids)  # (n_embd, n_used, n)
        n_embd = experts.contents.ne[0]
        if weights is None:
            return experts
        experts = ggml.ggml_mul(c, experts, weights)
        nb1, nb2 = experts.contents.nb[1], experts.contents.nb[2]
        out = ggml.ggml_view_2d(c, experts, n_embd, n, nb2, 0)
        for j in range(1, n_used):
            out = ggml.ggml_add(c, out, ggml.ggml_view_2d(c, experts, n_embd, n, nb2, j * nb1))
        if n_used == 1:
            out = ggml.ggml_cont(c, out)
        return out

    def vector(self, t: torch.Tensor) -> torch.Tensor:
        """A small float model tensor where this backend computes: already there."""
        return t

    def kv_devices(self, n_layer: int) -> None:
        return None  # host memory: ggml's graphs read the cache by address

    def prepare(self, weights: list[Weight], fused: list[tuple[Weight, ...]] = (),
                progress: Callable[[int, int], None] | None = None) -> None:
        """Repack the weights into ggml's interleaved layouts where it has them (unless --no-repack)."""
        self.repack(*weights, progress=progress)

    def synchronize(self) -> None:
        pass  # ggml's calls return when done

    def describe(self) -> str:
        return f"{self.n_threads} threads ({self.n_threads_batch} for batches)"

    def notes(self) -> list[str]:
        return []

    def report(self) -> list[str]:
        return []

    def native_linear(self, w: Weight, n: int | None = None) -> int | None:
        """The address ferry's matrix kernel reads dense weight w at, where it runs it (capabilities.cpu_native_linear:
        Q4_0 / Q4_K repacked by ggml, Q5_K / Q6_K / IQ4_XS plain, Q8_0, Q5_0 and IQ4_NL in its own Q8_0 copy, made
        here once), on a CPU it was built for, for calls of n tokens (None: any; fewer than the type's
        cpu_linear_from: ggml's); None where ggml runs it. Decided once per weight."""
        if not self.native_kernels or len(w.ne) != 2 or (n is not None and n < can(w.qtype).cpu_linear_from):
            return None
        known = w.graphs.get("native linear")
        if known is None or known[0] is not self:
            lib, at = native.library(), None
            if lib is not None and can(w.qtype).cpu_linear == "repacked":
                self.repack(w)
            if lib is not None and not cpu_native_linear(w, repacked=lambda t: bool(t.repacked)):
                kind = can(w.qtype).cpu_linear
                if kind == "own":
                    if w.own_copy is None:
                        q8 = as_q8_0(w.data, w.qtype) if w.qtype in AS_Q8_0 else w.data
                        w.own_copy = native.repack_q8_0(lib, q8, w.ne[1], w.ne[0], self.n_threads_batch)
                    at = w.own_copy.ctypes.data
                else:
                    at = w.data.ctypes.data if kind == "plain" else w.repacked.tensor.contents.data
            known = w.graphs["native linear"] = (self, at)
        return known[1]

    def native_attention(self, q, keys, values) -> native.Attention | None:
        """ferry's attention kernel for a graph's attention of q (d, n_head, n) over these cache views (ggml tensors),
        where it reads them (native.Attention.reads: float16 or Q8_0, heads of up to 256 values) and pays
        (Attention.pays: rows enough per key head); None where ggml's flash attention runs it."""
        q, k, v = q.contents, keys.contents, values.contents
        if not self.native_kernels or not native.Attention.reads(k.ne[0], v.ne[0], k.type, v.type) or \
                not native.Attention.pays(q.ne[2], q.ne[1], k.ne[2]):
            return None
        lib = native.library()
        if lib is None:
            return None
        if self._attention is None:
            self._attention = native.Attention(lib, self.n_threads_batch)
        return self._attention

    def _dense(self) -> native.Dense:
        if self._dense_kernel is None:
            self._dense_kernel = native.Dense(native.library(), self.n_threads, self.n_threads_batch)
        return self._dense_kernel

    def linear(self, x: torch.Tensor, w: Weight) -> torch.Tensor:
        """y = x @ W.T for x (n, k) float32 and W (m, k) in any ggml type (ferry's matrix kernel where it runs W)."""
        x = x.contiguous().float()
        n, k = x.shape
        m = w.ne[1]
        at = self.native_linear(w, n)
        if at is not None:
            return self._dense()(x, at, _linear_type(w), m, torch.empty(n, m, dtype=torch.float32))

        def build() -> _Graph:
            g = _Graph(self, n)
            g.finish(ggml.ggml_mul_mat(g.ctx, self._weight_leaf(g, w), g.input(ggml.GGML_TYPE_F32, (k, n))))
            return g

        out = torch.empty(n, m, dtype=torch.float32)
        return self._graph(w, ("linear", n), build).run([x], out)

    def ffn(self, x: torch.Tensor, gate: Weight, up: Weight, down: Weight, act: str) -> torch.Tensor:
        """The dense gated FFN down(act(gate x) * up x) as one graph: x (n, n_embd) float32."""
        x = x.contiguous().float()
        n, n_embd = x.shape

        def build() -> _Graph:
            g = _Graph(self, n)
            g.finish(self.ffn_nodes(g, g.input(ggml.GGML_TYPE_F32, (n_embd, n)), gate, up, down, act))
            return g

        out = torch.empty(n, down.ne[1], dtype=torch.float32)
        return self._graph(up, ("ffn", id(gate), id(down), n, act), build).run([x], out)

    def get_rows(self, w: Weight, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of W (the embedding lookup), dequantized to float32: (n, k)."""
        ids = ids.to(torch.int32).contiguous()
        n, k = ids.numel(), w.ne[0]

        def build() -> _Graph:
            g = _Graph(self, n)
            g.finish(ggml.ggml_get_rows(g.ctx, self._weight_leaf(g, w, rows=True), g.input(ggml.GGML_TYPE_I32, (n,))))
            return g

        out = torch.empty(n, k, dtype=torch.float32)
        return self._graph(w, ("get_rows", n), build).run([ids], out)

    def moe(self, x: torch.Tensor, router: Weight, up: Weight, gate: Weight, down: Weight, n_used: int,
            norm_topk: bool, act: str, routing=None) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole sparse MoE block as one graph (moe_nodes): softmax router, top-k, the selected experts, weighted
        sum. x (n, n_embd) float32 -> ((n, n_embd), ids (n, n_used))."""
        x = x.contiguous().float()
        n, n_embd = x.shape

        def build() -> _Graph:
            g = _Graph(self, n)
            out, ids = self.moe_nodes(g, g.input(ggml.GGML_TYPE_F32, (n_embd, n)), router, up, gate, down, n_used,
                                      norm_topk, act, routing)
            g.finish(out, g.copy_out(ids, ggml.GGML_TYPE_I32, (n_used, n)))
            return g

        out = torch.empty(n, n_embd, dtype=torch.float32)
        ids = torch.empty(n, n_used, dtype=torch.int32)
        self._graph(up, ("moe block", id(router), id(gate), id(down), n, n_used, norm_topk, act, id(routing)),
                    build).run([x], out, ids)
        return out, ids

    def moe_experts(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor | None, up: Weight, gate: Weight,
                    down: Weight, act: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """Routed experts chosen elsewhere: x (n, n_embd) float32, ids (n, j) int32. With weights (n, j): their
        weighted sum (n, n_embd); without: each slot's output (n, j, n_embd). out: where ggml writes it (e.g.
        pinned memory, for an asynchronous upload), contiguous float32 of that shape."""
        x = x.contiguous().float()
        ids = ids.to(torch.int32).contiguous()
        n, n_embd = x.shape
        j = ids.shape[1]
        one = weights is None and j == 1  # each slot's output, one slot a token: its weighted sum at weight 1
        kernel = self.native_experts(n, weights is not None or one, up, gate, down, act)
        if kernel is not None:
            if one:
                weights = torch.ones(n, 1)
                out = None if out is None else out.view(n, n_embd)
            y = torch.empty(n, n_embd, dtype=torch.float32) if out is None else out
            y = kernel(x, ids, weights.contiguous().float(), *map(_kernel_layout, (up, gate, down)), gate.ne[2], y,
                       _biases(up, gate, down))
            return y.view(n, 1, n_embd) if one else y

        def build() -> _Graph:
            g = _Graph(self, n)
            w = None if weights is None else g.input(ggml.GGML_TYPE_F32, (1, j, n))
            xs = g.input(ggml.GGML_TYPE_F32, (n_embd, 1, n))
            g.finish(self.expert_nodes(g, xs, g.input(ggml.GGML_TYPE_I32, (j, n)), w, up, gate, down, act))
            return g

        inputs = [x, ids] if weights is None else [weights.contiguous().float(), x, ids]
        if out is None:
            out = torch.empty((n, n_embd) if weights is not None else (n, j, n_embd), dtype=torch.float32)
        return self._graph(up, ("experts", id(gate), id(down), n, j, weights is None, act), build).run(inputs, out)

    def native_experts(self, n: int, weighted: bool, up: Weight, gate: Weight, down: Weight,
                       act: str) -> native.MoeExperts | None:
        """ferry's own kernel for n tokens' routed experts, where it runs them: their weighted sum, experts it reads
        (capabilities.cpu_native_experts: silu, gpt-oss's or DeepSeek-V4's clamped SwiGLU, biases or none, Q4_0 /
        Q4_K repacked, Q5_K / Q6_K / IQ4_XS / MXFP4 plain), a CPU it was built for (kernels/cpu/native.py); None where
        ggml runs them. Decided once per layer."""
        if not self.native_kernels or not weighted:
            return None
        known = up.graphs.get(("native", act))  # kept on the weight, as its graphs are: it dies with the layer
        if known is None or known[:3] != (self, gate, down):
            self.repack(up, gate, down)
            lib = native.library()
            why = cpu_native_experts(up, gate, down, act, repacked=lambda w: bool(w.repacked))
            known = up.graphs[("native", act)] = (self, gate, down, None if why or lib is None else
                                                  self._kernel(lib, up, down, act))
        return known[3]

    def _kernel(self, lib, up: Weight, down: Weight, act: str) -> native.MoeExperts:
        """The kernel for experts of up's shape, these types and activation (one per shape, types, activation and
        thread count)."""
        key = (up.ne[0], up.ne[1], up.qtype, down.qtype, act, self.n_threads, self.n_threads_batch)
        if key not in self._kernels:
            self._kernels[key] = native.MoeExperts(lib, up.ne[0], up.ne[1], up.qtype.value, down.qtype.value,
                                                   self.n_threads, self.n_threads_batch, act)
        return self._kernels[key]

    def moe_up_gate(self, x: torch.Tensor, ids: torch.Tensor, up: Weight, gate: Weight, act: str) -> torch.Tensor:
        """The first half of routed experts chosen elsewhere, when the second runs on the GPU: x (n, n_embd) float32,
        ids (n, j) int32 -> act(gate x) * up x of each slot, (n, j, n_ff) float32."""
        x = x.contiguous().float()
        ids = ids.to(torch.int32).contiguous()
        (n, n_embd), j = x.shape, ids.shape[1]

        def build() -> _Graph:
            g = _Graph(self, n)
            xs = g.input(ggml.GGML_TYPE_F32, (n_embd, 1, n))
            g.finish(self.up_gate_nodes(g, xs, g.input(ggml.GGML_TYPE_I32, (j, n)), up, gate, act))
            return g

        out = torch.empty(n, j, up.ne[1], dtype=torch.float32)
        return self._graph(up, ("up_gate", id(gate), n, j, act), build).run([x, ids], out)

    def moe_down(self, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, down: Weight) -> torch.Tensor:
        """The second half of routed experts, when the first ran on the GPU: h (n, j, n_ff) float32, ids (n, j)
        int32, weights (n, j) -> the weighted sum of each token's slots, (n, n_embd) float32."""
        h = h.contiguous().float()
        ids = ids.to(torch.int32).contiguous()
        n, j, n_ff = h.shape

        def build() -> _Graph:
            g = _Graph(self, n)
            w = g.input(ggml.GGML_TYPE_F32, (1, j, n))
            hs = g.input(ggml.GGML_TYPE_F32, (n_ff, j, n))
            g.finish(self.down_nodes(g, hs, g.input(ggml.GGML_TYPE_I32, (j, n)), w, down))
            return g

        out = torch.empty(n, down.ne[1], dtype=torch.float32)
        return self._graph(down, ("down", n, j), build).run([weights.contiguous().float(), h, ids], out)

    def close(self) -> None:
        if getattr(self, "galloc", None):
            ggml.ggml_gallocr_free(self.galloc)
            self.galloc = None
        if self.threadpool:
            ggml.ggml_threadpool_free(self.threadpool)
            self.threadpool = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
