"""GPU backend: weights live on the GPU in their GGUF encoding. Few tokens (generation): quantized GEMV kernels
read the bytes directly (kernels/cuda/gemv.py, moe.py; K-quants' GGUF blocks: kquant.py). Many tokens (prompts): the
weight is expanded by the Triton dequantizer into a reused f16 scratch and multiplied by cuBLAS (float32 accumulation,
as llama.cpp's cuBLAS path); a MoE layer sorts its (token, expert) pairs by expert and runs every expert in one grouped
GEMM launch per projection (a Triton kernel that expands Q8_0 / Q4_0 / MXFP4 weights in registers, kquant.py's for
K-quants; torch._grouped_mm on bf16 copies for other types), without the host learning which experts were hit."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from gguf.constants import GGML_QUANT_SIZES

from ferry.weight import Weight
from ferry.kernels.activations import GLU
from ferry.kernels.capabilities import can, gpu_reads
from ferry.quant import Q

_FLOAT = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}
GEMV_MAX = 8  # tokens up to which a matmul runs as quantized GEMV
MOE_GEMV_MAX = 64  # (token, expert) pairs up to which the MoE runs as expert GEMVs
MOE_STRATEGIES = ("auto", "gemv", "grouped", "dense", "loop")


class CudaBackend:
    """`moe`: how many-token MoE layers run: 'auto' (GEMV for few pairs, else grouped), or one strategy
    everywhere ('dense': every expert expanded to bf16 and torch's grouped GEMM; 'loop' is one matmul per expert
    hit, the reference the grouped GEMM is tested against)."""

    label = "CUDA"
    layer_first = False  # every weight on the GPU: nothing to read once per batch
    host_steps = False  # nothing runs on the host
    recorder = None  # set by the runner while it records a prompt step as CUDA graphs cut at ops.cache_sized

    def __init__(self, device: str = "cuda:0", moe: str = "auto", n_threads: int = 0):
        if moe not in MOE_STRATEGIES:
            raise ValueError(f"unknown MoE strategy {moe!r}; valid: {', '.join(MOE_STRATEGIES)}")
        self.device = torch.device(device)
        self.n_threads = n_threads  # the run's -t, reported (nothing computes on the CPU)
        self.moe_strategy = moe
        self._raw: dict = {}  # id(weight or tensor) -> its GPU copy; half()'s under (id, torch.float16)
        self._fused: dict[tuple[int, ...], object] = {}  # ids of weights uploaded as one Split -> that Split
        self._scratch: dict[tuple[torch.dtype, int], torch.Tensor] = {}
        self._retired: list[torch.Tensor] = []
        self._grouped = hasattr(torch, "_grouped_mm") and torch.cuda.is_available() and \
            torch.cuda.get_device_capability(self.device) >= (9, 0)
        # whether a forward needs nothing from the host (a CUDA graph can record it): not where the host must
        # learn which experts were hit
        self.graph_safe = moe != "loop" and (moe not in ("grouped", "dense") or self._grouped)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def kv_devices(self, n_layer: int) -> list[torch.device]:
        return [self.device] * n_layer

    def prepare(self, weights: list[Weight], fused: list[tuple[Weight, ...]] = (),
                progress: Callable[[int, int], None] | None = None) -> None:
        """Upload every weight (each fused group as one matrix where upload_fused can)."""
        if not self._grouped and any(w.bias is not None and len(w.ne) == 3 and not can(w.qtype).gpu_gemv
                                     for w in weights):
            self.graph_safe = False  # biased experts expanded: one matmul per expert hit, which the host must learn
        for group in fused:
            self.upload_fused(group)
        total, done = sum(w.nbytes for w in weights), 0
        for w in weights:
            self.upload(w)
            done += w.nbytes
            if progress:
                progress(done, total)

    def decided(self, n_tokens: int) -> None:
        return None  # nothing to decide

    def describe(self) -> str:
        return f"all layers on {self.device}"

    def notes(self) -> list[str]:
        return []

    def report(self) -> list[str]:
        return []

    def close(self) -> None:
        pass  # the GPU's memory goes with the backend

    def upload(self, w: Weight):
        """The weight on the GPU (once): Q8_0 / Q4_0 / MXFP4 split into quants and scales (Split), dense Q4_K / Q5_K /
        Q6_K matrices in krows.py's rows (KRows), other types as their GGUF bytes."""
        from ferry.kernels.cuda.krows import KRows
        from ferry.kernels.cuda.layout import Split

        t = self._raw.get(id(w))
        if t is None:
            t = w.host_tensor().to(self.device)
            if can(w.qtype).gpu_gemv:
                t = Split.of(t, w.qtype, w.ne)
            elif KRows.takes(w.qtype, w.ne):
                t = KRows.of(t, w.qtype, w.ne)
            self._raw[id(w)] = t
        return t

    def upload_fused(self, ws: tuple[Weight, ...]) -> None:
        """Weights that one input feeds (attention's q, k and v) uploaded as one Split holding their rows in order,
        so that a token's projections are one GEMV launch (fused()); each weight's upload is a view of its rows.
        Only Q8_0 / Q4_0 matrices of one type and width, none uploaded yet; others stay apart."""
        from ferry.kernels.cuda.layout import Split

        first = ws[0]
        if not can(first.qtype).gpu_gemv or any(len(w.ne) != 2 or w.qtype != first.qtype or w.ne[0] != first.ne[0]
                                                or id(w) in self._raw for w in ws):
            return
        rows = sum(w.ne[1] for w in ws)
        fused = Split.of(torch.cat([w.host_tensor() for w in ws]).to(self.device), first.qtype, (first.ne[0], rows))
        self._fused[tuple(map(id, ws))] = fused
        start = 0
        for w in ws:
            self._raw[id(w)] = fused.row_block(start, w.ne[1])
            start += w.ne[1]

    def fused(self, ws: tuple[Weight, ...]):
        """The Split that upload_fused made of ws, or None."""
        return self._fused.get(tuple(map(id, ws)))

    def vector(self, t: torch.Tensor) -> torch.Tensor:
        """A small float model tensor (norm weight, bias) on the GPU as float32 (once)."""
        v = self._raw.get(id(t))
        if v is None:
            v = self._raw[id(t)] = t.to(self.device, torch.float32).contiguous()
        return v

    def joined(self, ts: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Small float model tensors (q's, k's and v's biases) end to end on the GPU as one float32 vector (once)."""
        key = tuple(map(id, ts))
        v = self._raw.get(key)
        if v is None:
            v = self._raw[key] = torch.cat([self.vector(t) for t in ts])
        return v

    def half(self, t: torch.Tensor) -> torch.Tensor:
        """A float model tensor read by matmuls (deepseek2's k_b / v_b) on the GPU as float16 (once): half the memory
        of float32, the precision the prompt path's f16 cuBLAS gives every weight."""
        key = (id(t), torch.float16)  # apart from vector()'s float32 copy of the same tensor
        v = self._raw.get(key)
        if v is None:
            v = self._raw[key] = t.to(self.device, torch.float16).contiguous()
        return v

    def _expand(self, qtype, raw, ne: tuple[int, ...], dtype: torch.dtype, slot: int = 0) -> torch.Tensor:
        """Floats of `raw` (a whole tensor or a slice of whole rows: GGUF bytes or a Split) in scratch buffer
        `slot` of `dtype`."""
        n = 1
        for v in ne:
            n *= v
        key = (dtype, slot)
        buf = self._scratch.get(key)
        if buf is None or buf.numel() < n:
            if buf is not None:  # recorded graphs may still write the old one: never free it
                self._retired.append(buf)
            buf = self._scratch[key] = torch.empty(n, dtype=dtype, device=self.device)
        out = buf[:n].view(tuple(reversed(ne)))
        if not isinstance(raw, torch.Tensor):
            return raw.floats(dtype, out)
        if qtype in _FLOAT:
            return out.copy_(raw.view(_FLOAT[qtype]).view(out.shape))
        from ferry.kernels.cuda.dequant import dequantize  # Triton: only where a GPU is

        if not can(qtype).gpu_expand:
            raise NotImplementedError(f"no GPU kernel for {qtype.name} yet")
        return dequantize(raw, qtype, ne, out=out)

    def linear(self, x: torch.Tensor, w: Weight) -> torch.Tensor:
        """x (n, cols) @ W.T as float32: GEMV on the bytes for few tokens, f16 cuBLAS for many."""
        return self.matmul(x, w.qtype, self.upload(w), w.ne)

    def matmul(self, x: torch.Tensor, qtype, raw, ne: tuple[int, ...]) -> torch.Tensor:
        """linear() on a weight already on the GPU: its GGUF bytes, a Split or KRows (uploaded, or staged by the
        hybrid runtime)."""
        from ferry.kernels.cuda import kquant
        from ferry.kernels.cuda.gemv import gemv, gemv_float
        from ferry.kernels.cuda.krows import KRows

        if x.shape[0] <= GEMV_MAX:
            if isinstance(raw, KRows):
                return raw.gemv(x)
            if not isinstance(raw, torch.Tensor):
                return gemv(raw, x)
            if qtype in (Q.F32, Q.F16) and len(ne) == 2:  # a router: read in place
                return gemv_float(raw.view(_FLOAT[qtype]).view(ne[1], ne[0]), x)
            if len(ne) == 2 and kquant.reads(qtype, ne):  # a K-quant's blocks read in place
                return kquant.kgemv(raw, qtype, ne, x)
            return x.float() @ self._expand(qtype, raw, ne, torch.float32).T
        return _mm(x.to(torch.float16), self._expand(qtype, raw, ne, torch.float16).T)

    def ffn(self, x: torch.Tensor, gate: Weight, up: Weight, down: Weight, act: str) -> torch.Tensor:
        return self.linear(GLU[act](self.linear(x, gate), self.linear(x, up)), down)

    def get_rows(self, w: Weight, ids: torch.Tensor) -> torch.Tensor:
        t, ids = self.upload(w), ids.to(self.device).long()
        if not isinstance(t, torch.Tensor):
            return t.rows(ids).floats(torch.float32)
        block, size = GGML_QUANT_SIZES[w.qtype]
        rows = t.view(w.ne[1], w.ne[0] // block * size)[ids]
        return self._expand(w.qtype, rows.reshape(-1), (w.ne[0], len(ids)), torch.float32).clone()

    def route(self, x: torch.Tensor, router: Weight, n_used: int, norm_topk: bool, routing=None):
        """Router and top-k: (weights (n, k) float32, ids (n, k) int32), on the GPU."""
        return gpu_route(self.linear(x, router), n_used, norm_topk, routing, self.vector)

    def moe(self, x: torch.Tensor, router: Weight, up: Weight, gate: Weight, down: Weight, n_used: int,
            norm_topk: bool, act: str, routing=None,
            residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Router, top-k, each routed expert over its tokens, weighted sum (+ residual when given): ((n, n_embd)
        float32, ids (n, k))."""
        weights, ids = self.route(x, router, n_used, norm_topk, routing)
        return self.moe_experts(x, ids, weights, up, gate, down, act, residual), ids

    def moe_experts(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, up: Weight, gate: Weight,
                    down: Weight, act: str, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The routed experts chosen elsewhere (ids, weights (n, k)): their weighted sum (+ residual when given)."""
        from ferry.kernels.cuda import kquant
        from ferry.kernels.cuda.moe import moe_gemv

        n_used = ids.shape[1]
        strategy = self.moe_strategy
        if strategy == "auto":
            strategy = "gemv" if x.shape[0] * n_used <= MOE_GEMV_MAX else "grouped"
        parts = (gate, up, down)
        biases = self.expert_biases(*parts)
        # the quantized kernels add all three biases (gpt-oss's) or none; the bf16 grouped GEMM and the loop any
        whole = biases is not None or all(w.bias is None for w in parts)
        if strategy == "gemv" and whole:
            if gpu_reads(w.qtype for w in parts):
                return moe_gemv(x, ids, weights, *map(self.upload, parts), act, residual=residual, biases=biases)
            if all(kquant.reads(w.qtype, w.ne) for w in parts):
                return kquant.kmoe_gemv(x, ids, weights, *((self.upload(w), w.qtype, w.ne) for w in parts), act,
                                        residual=residual, biases=biases)
        if strategy == "loop":
            out = self._moe_loop(x, ids, weights, up, gate, down, act)
            return out if residual is None else residual + out
        # 'dense': every expert expanded to bf16, then torch's grouped GEMM, whatever the type
        return self._moe_grouped(x, ids, weights, up, gate, down, act, dense=strategy == "dense" or not whole,
                                 residual=residual, biases=biases)

    def expert_biases(self, gate: Weight, up: Weight, down: Weight):
        """gate's, up's and down's biases (n_expert, rows) float32 on the GPU where all three have them (gpt-oss),
        else None."""
        if any(w.bias is None for w in (gate, up, down)):
            return None
        return tuple(self.vector(w.bias) for w in (gate, up, down))

    def _experts(self, w: Weight, slot: int) -> torch.Tensor:
        """Every expert of a stacked tensor as bf16 (n_expert, rows, cols), in scratch `slot`."""
        return self._expand(w.qtype, self.upload(w), w.ne, torch.bfloat16, slot)

    def _moe_grouped(self, x, ids, weights, up: Weight, gate: Weight, down: Weight, act: str,
                     dense: bool = False, residual: torch.Tensor | None = None, biases=None) -> torch.Tensor:
        """Pairs sorted by expert, every expert's rows in one grouped GEMM launch per projection (the schedule
        computed on the GPU), each token's experts summed in a fixed order (+ residual when given). Q8_0 / Q4_0 /
        MXFP4 experts: the Triton kernel that expands weights in registers (adding `biases`, expert_biases'), the sum
        one pass with the residual; unbiased K-quants: kquant.py's, alike; other types: bf16 copies and torch's grouped
        GEMM (adding each weight's bias)."""
        from ferry.kernels.cuda.moe import sum_pairs

        from ferry.kernels.cuda import kquant

        n, k = ids.shape
        if not dense and gpu_reads(w.qtype for w in (gate, up, down)):
            y = self.expert_pairs(x, ids, self.upload(gate), self.upload(up), self.upload(down), act, weights=weights,
                                  biases=biases)
            return sum_pairs(y, k, residual)
        if not dense and biases is None and all(kquant.reads(w.qtype, w.ne) for w in (gate, up, down)):
            y = self._kquant_pairs(x, ids.to(torch.int32), gate.ne[2],
                                   *((self.upload(w), w.qtype, w.ne) for w in (gate, up, down)), act, weights)
            return sum_pairs(y, k, residual)
        order, y_sorted = self._moe_grouped_bf16(x, ids, up, gate, down, act)
        y = torch.empty_like(y_sorted)
        y[order] = y_sorted  # back to (token, slot) order
        out = (y.view(n, k, -1) * weights[..., None]).sum(1)
        return out if residual is None else residual + out

    def _gemv_pairs(self, pairs: int) -> bool:
        """Whether this many (token, expert) pairs run as expert GEMVs rather than the grouped GEMM."""
        return pairs <= MOE_GEMV_MAX and self.moe_strategy in ("auto", "gemv")

    @staticmethod
    def _schedule(ids: torch.Tensor, n_expert: int):
        """The grouped GEMM's tile height, its schedule (moe_tiles) and the pairs' order by expert (int32)."""
        from ferry.kernels.cuda.moe import moe_tile_rows, moe_tiles

        block = moe_tile_rows(ids.numel(), n_expert)
        sched = moe_tiles(ids, n_expert, block)
        return block, sched, sched[0].to(torch.int32)

    def expert_pairs(self, x: torch.Tensor, ids: torch.Tensor, gate, up, down, act: str,
                     wait_down: torch.cuda.Event | None = None, weights: torch.Tensor | None = None,
                     biases: tuple | None = None) -> torch.Tensor:
        """Each (token, slot) pair's expert output, times its router weight when `weights` (n, k) is given,
        (n * k, n_embd) float32 in pair order: x (n, n_embd), ids (n, k) on the GPU; gate / up / down stacked Splits
        (uploaded or staged; only the experts in ids are read), or staged Compact ones (their GGUF blocks, held_pairs);
        biases: expert_biases' (indexed by the ids), or None. Expert GEMVs for few pairs, else the grouped GEMM
        (reading each pair's token row in place and writing its output in pair order). wait_down: an event the down
        projection waits for (its weights still being copied by the hybrid runtime)."""
        from ferry.kernels.cuda.moe import moe_gemv, moe_mm
        from ferry.backends.streamer import Compact

        n, k = ids.shape
        gb, ub, db = biases if biases is not None else (None, None, None)
        pair_weights = None if weights is None else weights.float().reshape(-1).contiguous()
        if pair_weights is None and (self._gemv_pairs(n * k) or isinstance(gate, Compact)):
            pair_weights = torch.ones(n * k, dtype=torch.float32, device=x.device)
        if isinstance(gate, Compact):
            assert biases is None, "biased experts of a type the split kernels do not read are never streamed"
            return self.held_pairs(x, gate.slot_of[ids.long()], pair_weights.view(n, k), gate.w, up.w, down.w, act,
                                   wait_down)
        if self._gemv_pairs(n * k):
            xs = x.float()[torch.arange(n, device=x.device).repeat_interleave(k)] if k > 1 else x
            return moe_gemv(xs, ids.reshape(-1, 1), pair_weights.view(-1, 1), gate, up, down, act, wait_down,
                            biases=biases)
        block, sched, order = self._schedule(ids, gate.ne[2])
        h = moe_mm(x.to(torch.float16), gate, sched, torch.float16, block, up=up, act=act,
                   rows_from=torch.div(order, k, rounding_mode="floor"), bias=gb, up_bias=ub)
        if wait_down is not None:
            torch.cuda.current_stream(x.device).wait_event(wait_down)
        return moe_mm(h, down, sched, torch.float32, block, rows_to=order, row_scale=pair_weights, bias=db)

    def held_pairs(self, x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, gate, up, down, act: str,
                   wait_down: torch.cuda.Event | None = None) -> torch.Tensor:
        """Each (token, slot) pair's output times its router weight, (n * k, n_embd) float32 in pair order, on experts
        held as layout.Blocks (some of a layer's, in their GGUF blocks): slots (n, k) int32, each pair's place among
        the held experts (-1: elsewhere, zeros); weights (n, k). K-quants: kquant.py's expert GEMVs on the blocks for
        few pairs, its grouped GEMM for many; other types: each projection of the held experts expanded to bfloat16
        in one scratch (one projection at a time) and torch's grouped GEMM over the pairs sorted by place, those of
        -1 last and left out. wait_down: as expert_pairs'."""
        from ferry.kernels.cuda import kquant

        n, k = slots.shape
        held = gate.ne[2]
        if all(kquant.reads(w.qtype, w.ne) for w in (gate, up, down)):
            parts = (gate.parts, up.parts, down.parts)
            if self._gemv_pairs(n * k):
                return kquant.kmoe_gemv(x, slots, weights, *parts, act, wait_down=wait_down, pairs=True)
            return self._kquant_pairs(x, slots, held, *parts, act, weights, wait_down)
        keys = torch.where(slots < 0, held, slots)
        order, offs, h = self._expanded_up_gate(x, keys, held, gate, up, act)
        live = (keys.flatten()[order] < held)[:, None]  # rows past the last group: not computed, left out
        if wait_down is not None:
            torch.cuda.current_stream(x.device).wait_event(wait_down)
        y_sorted = self._group_mm(h, self._expand(down.qtype, down, down.ne, torch.bfloat16, 1), offs).float()
        y = torch.empty(n * k, down.ne[1], dtype=torch.float32, device=x.device)
        y[order] = torch.where(live, y_sorted * weights.float().reshape(-1)[order, None], 0.0)
        return y

    def _expanded_up_gate(self, x: torch.Tensor, keys: torch.Tensor, held: int, gate, up, act: str):
        """glu(gate x, up x) of each pair on Blocks of `held` experts, each projection expanded to bfloat16 in one
        scratch in turn: keys (n, k) each pair's place (`held`: none, sorted last and left out); (order, each place's
        end in it (int32), h in that order, bfloat16)."""
        from ferry.kernels.cuda.moe import sort_pairs

        order, _, ends = sort_pairs(keys, held + 1)
        offs = ends[:held].to(torch.int32)
        xs = x.to(torch.bfloat16)[torch.div(order, keys.shape[1], rounding_mode="floor")]
        g = self._group_mm(xs, self._expand(gate.qtype, gate, gate.ne, torch.bfloat16, 1), offs).float()
        u = self._group_mm(xs, self._expand(up.qtype, up, up.ne, torch.bfloat16, 1), offs).float()
        return order, offs, GLU[act](g, u).to(torch.bfloat16)

    @staticmethod
    def _held_schedule(slots: torch.Tensor, held: int):
        """_schedule's over the pairs' places among `held` experts, those of -1 (elsewhere) sorted last and their
        tiles left out (expert -1)."""
        from ferry.kernels.cuda.moe import moe_tile_rows, moe_tiles

        keys = torch.where(slots < 0, held, slots)
        block = moe_tile_rows(slots.numel(), held + 1)
        order, tile_expert, tile_row, tile_end = moe_tiles(keys, held + 1, block)
        return block, (order, torch.where(tile_expert == held, -1, tile_expert), tile_row, tile_end), order.to(
            torch.int32)

    @staticmethod
    def _kquant_pairs(x: torch.Tensor, slots: torch.Tensor, held: int, gate, up, down, act: str,
                      weights: torch.Tensor, wait_down: torch.cuda.Event | None = None) -> torch.Tensor:
        """The grouped GEMM on K-quant experts in their GGUF blocks (kquant.kmoe_mm; gate / up / down (bytes, type,
        ne) of `held` experts): each pair's output times its weight, (n * k, n_embd) float32 in pair order, the pairs
        of slot -1 sorted last, their tiles left out and their rows zeros."""
        from ferry.kernels.cuda.kquant import kmoe_mm

        n, k = slots.shape
        block, sched, order = CudaBackend._held_schedule(slots, held)
        h = kmoe_mm(x.to(torch.float16), gate, sched, torch.float16, block, up=up, act=act,
                    rows_from=torch.div(order, k, rounding_mode="floor"))
        if wait_down is not None:
            torch.cuda.current_stream(x.device).wait_event(wait_down)
        y = torch.zeros(n * k, down[2][1], dtype=torch.float32, device=x.device)
        kmoe_mm(h, down, sched, torch.float32, block, rows_to=order, row_scale=weights.float().reshape(-1).contiguous(),
                out=y)
        return y

    def resident_experts(self, x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, gate, up, down, act: str,
                         biases: tuple | None = None) -> torch.Tensor:
        """The pairs of a layer whose experts are kept on the GPU beside the rest in RAM (the hybrid runtime's resident
        experts): slots (n, k) int32 on the GPU, each pair's place among the resident experts, -1 where its expert is
        elsewhere; gate / up / down Splits holding only the resident experts (biases: theirs, in that order, or
        None), or Blocks (held_pairs; no biases). Each token's weighted sum over its resident pairs, (n, n_embd)
        float32, without the host learning which pairs those are (a recorded step's graph holds it). Expert GEMVs that
        skip the -1 pairs for few pairs; else the grouped GEMM with those pairs sorted last and their tiles left
        out."""
        from ferry.kernels.cuda.layout import Blocks
        from ferry.kernels.cuda.moe import moe_gemv, moe_mm, sum_pairs

        n, k = slots.shape
        if isinstance(gate, Blocks):
            return sum_pairs(self.held_pairs(x, slots, weights, gate, up, down, act), k)
        if self._gemv_pairs(n * k):
            return moe_gemv(x, slots, weights, gate, up, down, act, biases=biases)
        gb, ub, db = biases if biases is not None else (None, None, None)
        block, sched, order = self._held_schedule(slots, gate.ne[2])
        h = moe_mm(x.to(torch.float16), gate, sched, torch.float16, block, up=up, act=act,
                   rows_from=torch.div(order, k, rounding_mode="floor"), bias=gb, up_bias=ub)
        y = torch.zeros(n * k, down.ne[1], dtype=torch.float32, device=x.device)
        moe_mm(h, down, sched, torch.float32, block, rows_to=order,
               row_scale=weights.float().reshape(-1).contiguous(), out=y, bias=db)
        return sum_pairs(y, k)

    def pair_up_gate(self, x: torch.Tensor, ids: torch.Tensor, gate, up, act: str) -> torch.Tensor:
        """act(gate . x) * (up . x) of each (token, slot) pair, (n * k, n_ff) in pair order (float32 for few pairs,
        float16 or bfloat16 for many): the experts' first half when the second runs on the CPU (the hybrid runtime,
        moe_up_gate and moe_down set apart; never for biased experts). x (n, n_embd), ids (n, k) on the GPU; gate / up
        stacked Splits, or Compact (K-quants read in their blocks, others expanded a projection at a time). Expert
        GEMVs for few pairs (one launch), else the grouped GEMM, whose schedule is two dozen small torch ops."""
        from ferry.kernels.cuda import kquant
        from ferry.kernels.cuda.moe import moe_gate_up_gemv, moe_mm
        from ferry.backends.streamer import Compact

        n, k = ids.shape
        if isinstance(gate, Compact) and kquant.reads(gate.w.qtype, gate.w.ne) and kquant.reads(up.w.qtype, up.w.ne):
            block, sched, order = self._schedule(gate.slot_of[ids.long()], gate.w.ne[2])
            return kquant.kmoe_mm(x.to(torch.float16), gate.w.parts, sched, torch.float16, block, up=up.w.parts,
                                  act=act, rows_from=torch.div(order, k, rounding_mode="floor"), rows_to=order)
        if isinstance(gate, Compact):
            order, _, h_sorted = self._expanded_up_gate(x, gate.slot_of[ids.long()], gate.w.ne[2], gate.w, up.w, act)
            h = torch.empty_like(h_sorted)
            h[order] = h_sorted
            return h
        if self._gemv_pairs(n * k):
            return moe_gate_up_gemv(x, ids, gate, up, act)
        block, sched, order = self._schedule(ids, gate.ne[2])
        return moe_mm(x.to(torch.float16), gate, sched, torch.float16, block, up=up, act=act,
                      rows_from=torch.div(order, k, rounding_mode="floor"), rows_to=order)

    def pair_down(self, h: torch.Tensor, ids: torch.Tensor, down, weights: torch.Tensor) -> torch.Tensor:
        """The experts' second half when the first ran on the CPU (never for biased experts): h (n * k, n_ff) in
        pair order, ids / weights (n, k) on the GPU, down a stacked Split or Compact -> each token's weighted sum of
        its slots, (n, n_embd) float32."""
        from ferry.kernels.cuda import kquant
        from ferry.kernels.cuda.moe import moe_down_gemv, moe_mm, sort_pairs
        from ferry.backends.streamer import Compact

        n, k = ids.shape
        if isinstance(down, Compact) and kquant.reads(down.w.qtype, down.w.ne):
            block, sched, order = self._schedule(down.slot_of[ids.long()], down.w.ne[2])
            y = kquant.kmoe_mm(h.to(torch.float16), down.w.parts, sched, torch.float32, block, rows_from=order,
                               rows_to=order, row_scale=weights.float().reshape(-1).contiguous())
            return y.view(n, k, -1).sum(1)
        if isinstance(down, Compact):
            order, _, ends = sort_pairs(down.slot_of[ids.long()], down.w.ne[2])
            w = self._expand(down.w.qtype, down.w, down.w.ne, torch.bfloat16, 1)
            y = torch.empty(n * k, down.w.ne[1], dtype=torch.float32, device=h.device)
            y[order] = self._group_mm(h.to(torch.bfloat16)[order], w, ends.to(torch.int32)).float()
            return y.mul_(weights.float().reshape(-1, 1)).view(n, k, -1).sum(1)
        if self._gemv_pairs(n * k):
            return moe_down_gemv(h, ids, weights, down)
        block, sched, order = self._schedule(ids, down.ne[2])
        y = moe_mm(h.to(torch.float16), down, sched, torch.float32, block, rows_from=order, rows_to=order,
                   row_scale=weights.float().reshape(-1).contiguous())
        return y.view(n, k, -1).sum(1)

    def _moe_grouped_bf16(self, x, ids, up: Weight, gate: Weight, down: Weight, act: str):
        from ferry.kernels.cuda.moe import sort_pairs

        k = ids.shape[1]
        order, _, ends = sort_pairs(ids, gate.ne[2])
        offs = ends.to(torch.int32)
        xs = x.to(torch.bfloat16)[order // k]  # (pairs, n_embd), grouped by expert
        experts = ids.flatten()[order].long()  # each sorted pair's expert: the row of its bias (gpt-oss)
        g = self._biased(self._group_mm(xs, self._experts(gate, 1), offs).float(), gate, experts)
        u = self._biased(self._group_mm(xs, self._experts(up, 1), offs).float(), up, experts)
        h = GLU[act](g, u).to(torch.bfloat16)
        return order, self._biased(self._group_mm(h, self._experts(down, 1), offs).float(), down, experts)

    def _group_mm(self, a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """Rows of `a` grouped by expert (group e ends at offs[e]) times w[e].T: (rows, w.shape[1]) bf16."""
        if self._grouped:
            return torch._grouped_mm(a, w.transpose(1, 2), offs=offs)
        out = torch.empty(a.shape[0], w.shape[1], dtype=a.dtype, device=a.device)
        start = 0
        for e, end in enumerate(offs.tolist()):  # no grouped GEMM on this GPU: one matmul per expert hit
            if end > start:
                out[start:end] = a[start:end] @ w[e].T
            start = end
        return out

    def _moe_loop(self, x, ids, weights, up: Weight, gate: Weight, down: Weight, act: str) -> torch.Tensor:
        """One f16 cuBLAS matmul per expert hit (the host learns which): the reference for the grouped GEMM."""
        out = torch.zeros(x.shape[0], down.ne[1], dtype=torch.float32, device=self.device)
        xb = x.to(torch.float16)

        def expert(w: Weight, e: int) -> torch.Tensor:
            t = self.upload(w)
            t = t.view(w.ne[2], -1)[e] if isinstance(t, torch.Tensor) else t.expert(e)
            return self._expand(w.qtype, t, w.ne[:2], torch.float16).T

        for e in ids.unique().tolist():
            tok, slot = (ids == e).nonzero(as_tuple=True)
            xe = xb[tok]
            g, u = self._biased(_mm(xe, expert(gate, e)), gate, e), self._biased(_mm(xe, expert(up, e)), up, e)
            h = GLU[act](g, u).to(torch.float16)
            y = self._biased(_mm(h, expert(down, e)), down, e)
            out.index_add_(0, tok, y * weights[tok, slot, None])
        return out

    def _biased(self, y: torch.Tensor, w: Weight, e) -> torch.Tensor:
        """y plus expert e's bias (e: an expert, or each row's) where the stacked tensor w has biases (gpt-oss)."""
        return y if w.bias is None else y + self.vector(w.bias)[e]


def top_k_route(logits: torch.Tensor, n_used: int, norm_topk: bool, routing=None,
                on_device=lambda t: t, chosen: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's scores (softmax, or layers.ffn.Routing's sigmoid or sqrt of softplus), the top n_used by score
    (+ the choice bias), their unbiased scores renormalised if norm_topk and scaled: (weights float32, ids int32).
    on_device: the backend's way of putting the bias where the logits are. chosen: (n, n_used) int64, the experts
    already picked (hash routing): only their weights are computed."""
    if routing is not None and routing.logit_bias is not None:
        logits = logits + on_device(routing.logit_bias)
    if routing is not None and routing.gating == "softmax_weight":  # the top logits, then a softmax over them
        top, ids = logits.topk(n_used, -1)
        return torch.softmax(top, -1), ids.to(torch.int32)
    gating = "softmax" if routing is None else routing.gating
    probs = (torch.sigmoid(logits) if gating == "sigmoid" else F.softplus(logits).sqrt() if gating == "sqrtsoftplus"
             else torch.softmax(logits, -1))
    choice = probs if routing is None or routing.bias is None or chosen is not None else probs + on_device(routing.bias)
    if routing is not None and routing.grouped and chosen is None:  # experts only from the best groups
        n, n_expert = choice.shape
        by_group = choice.view(n, routing.n_group, n_expert // routing.n_group)
        score = by_group.topk(routing.group_top, -1).values.sum(-1)
        kept = torch.zeros_like(score, dtype=torch.bool).scatter_(1, score.topk(routing.n_group_used, -1).indices, True)
        choice = by_group.masked_fill(~kept[..., None], float("-inf")).view(n, n_expert)
    if chosen is not None:  # hash routing: the experts given, weighted by their scores
        ids = chosen
        weights = probs.gather(-1, ids)
    elif choice is not probs:
        ids = choice.topk(n_used, -1).indices
        weights = probs.gather(-1, ids)
    else:
        weights, ids = probs.topk(n_used, -1)
    if norm_topk:
        weights = weights / weights.sum(-1, keepdim=True)
    if routing is not None and routing.scale != 1.0:
        weights = weights * routing.scale
    return weights, ids.to(torch.int32)


def gpu_route(logits: torch.Tensor, n_used: int, norm_topk: bool, routing=None,
              on_device=lambda t: t) -> tuple[torch.Tensor, torch.Tensor]:
    """top_k_route as one kernel (route) where routing is not group-limited, else op by op."""
    from ferry.kernels.cuda.route import route

    if routing is not None and (routing.grouped or routing.gating == "sqrtsoftplus" or (routing.logit_bias is not None
                                                    and routing.gating != "softmax_weight")):
        return top_k_route(logits, n_used, norm_topk, routing, on_device)
    gating = "softmax" if routing is None else routing.gating
    bias = None if routing is None or routing.bias is None else on_device(routing.bias)
    logit_bias = None if routing is None or routing.logit_bias is None else on_device(routing.logit_bias)
    return route(logits, n_used, norm_topk, 1.0 if routing is None else routing.scale, gating, bias, logit_bias)


_OUT_DTYPE = {torch.mm: True, torch.bmm: True}  # whether each takes out_dtype (torch >= 2.8 on CUDA)


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """f16 / bf16 cuBLAS matmul with float32 accumulation and a float32 result (no rounding of the output to
    16 bits where torch allows it); 3-D operands: one product per batch entry."""
    mm = torch.bmm if a.dim() == 3 else torch.mm
    if _OUT_DTYPE[mm]:
        try:
            return mm(a, b, out_dtype=torch.float32)
        except (RuntimeError, TypeError):  # NotImplementedError (no such kernel on this device) is a RuntimeError
            _OUT_DTYPE[mm] = False
    return mm(a, b).float()
