"""The hybrid backend: weights placed on the GPU run there (CudaBackend); weights left in CPU RAM (-ngl, -ot) are
computed where the offload policy predicts it is faster, per op and u-batch: by ggml on the CPU, or on the GPU after
the streamer copies them over PCIe. A MoE layer whose experts are in RAM splits them per u-batch: the hottest experts
are copied to the GPU while the CPU computes the cold ones, at the same time (policy.split_experts). Some of such a
layer's experts may be kept on the GPU for good (resident: --gpu-experts, the fit's per-expert placement): the GPU
computes their pairs while the rest go as above, the CPU's and the streamer's work never seeing them.

Activations, the KV cache, norms, rope and attention stay on the GPU; only the tensors an op needs cross PCIe."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from collections.abc import Callable

import torch

from ferry.weight import Weight
from ferry.backends.cuda import CudaBackend, gpu_route
from ferry.kernels.activations import GLU
from ferry.kernels.capabilities import can, can_ggml, gpu_holds, gpu_reads
from ferry.placement import EXPERTS_RE
from ferry.offload.cost import Calibration
from ferry.offload.policy import Explorer, Policy, experts_fixed_side
from ferry.offload.work import SIDES, ExpertsWork, dense_decision
from ferry.backends.streamer import Streamer


@dataclass
class OpRecord:
    """One decision of a forward, for --verbose and `ferry plan`: predicted and (when timed) measured seconds."""

    op: str
    weight: str
    n_tokens: int
    device: str  # CPU, GPU, or "GPU a / CPU b" for a split MoE
    predicted_s: float
    measured_s: float | None
    why: str
    parts: dict = field(default_factory=dict)  # timed runs: seconds of the route + host sync, the CPU's ggml work


@dataclass
class HybridStats:
    records: list[OpRecord] = field(default_factory=list)
    keep: bool = False  # record every decision (verbose); otherwise keep none

    def add(self, r: OpRecord) -> None:
        if self.keep:
            self.records.append(r)


@dataclass
class Resident:
    """A MoE layer's experts kept on the GPU beside the rest in RAM: slot_of (n_expert,) int32 on the GPU, each
    expert's place among them (-1: in RAM); gate / up / down Splits of those experts alone (layout.Blocks for the types
    the split kernels do not read); biases: theirs (gpt-oss), in that order, or None."""

    slot_of: torch.Tensor
    gate: object
    up: object
    down: object
    experts: tuple[int, ...]
    biases: tuple | None = None


SMALL_MOE = 64  # tokens up to which a MoE host step's inputs and output travel through pinned buffers


class HybridBackend:
    """`devices`: weight name -> its device ("CPU" or "CUDA0"); `timed`: synchronize around each decision to
    measure it (verbose runs only: it costs the overlap); `layer_first`: whether the engine should run a logical
    batch layer by layer when routed experts are in RAM (--batch-order)."""

    label = "CUDA+CPU"  # activations and the KV cache live on the GPU: the engine uses the GPU runner
    graph_safe = False  # ops on CPU weights go through the host

    def __init__(self, gpu: CudaBackend, cpu, devices: dict[str, str], policy: Policy, calib: Calibration,
                 timed: bool = False, layer_first: bool = True, resident: dict[int, tuple[int, ...]] | None = None):
        self.gpu, self.cpu, self.devices = gpu, cpu, devices
        self.device = gpu.device
        self.policy, self.calib = policy, calib
        self.stats = HybridStats(keep=timed)
        self.explorer = Explorer()  # auto's measured choice per u-batch size class
        self._seen: set[tuple[int, int]] = set()  # (layer's expert tensor, u-batch size) run at least once
        self._trial: tuple | None = None  # the last MoE layer run as a trial: (explorer, gate, tokens, way, start)
        self.timed = timed
        self._slot = 0  # the staging set ("moe", 0 or 1) the current MoE layer uses; layers alternate
        self._dense_slot = 0
        self._prefetched: tuple | None = None  # (the next layer's gate weight, its staged experts)
        self._next_experts: dict[int, tuple[Weight, Weight, Weight]] = {}
        self._works: dict[int, tuple[Weight, ExpertsWork]] = {}  # id(gate) -> (gate, its layer's ExpertsWork)
        self.streamer: Streamer | None = None
        self.recorder = None  # set by the runner while it records a step as CUDA graphs cut at host steps
        self._pinned_buffers: dict[str, torch.Tensor] = {}
        self._layer_first = layer_first
        self.layer_first = False  # set by prepare(): whether there are routed experts in RAM to take layer first
        self._resident_spec = dict(resident or {})  # layer -> its experts kept on the GPU (--gpu-experts)
        self._resident: dict[int, Resident] = {}  # id(layer's gate weight) -> its resident experts, by prepare()

    @property
    def host_steps(self) -> bool:
        """Whether a step may be recorded as CUDA graphs between host steps (not while timing each op)."""
        return not self.timed

    def prepare(self, weights: list[Weight], fused: list[tuple[Weight, ...]] = (),
                progress: Callable[[int, int], None] | None = None) -> None:
        """Upload the GPU's weights (each group of `fused` that is all on the GPU as one, CudaBackend.upload_fused),
        repack the CPU's (CpuBackend.prepare) and register them with the streamer."""
        for group in fused:
            if all(map(self.on_gpu, group)):
                self.gpu.upload_fused(group)
        cpu_weights = []
        for w in weights:
            if self.on_gpu(w):
                self.gpu.upload(w)
            else:
                cpu_weights.append(w)
        self.streamer = Streamer(self.device, cpu_weights)
        by_layer: dict[int, dict[str, Weight]] = {}
        for w in cpu_weights:
            m = EXPERTS_RE.match(w.name)
            if m:
                by_layer.setdefault(int(m.group(1)), {})[m.group(2)] = w
        layers = [(d["gate"], d["up"], d["down"]) for _, d in sorted(by_layer.items()) if len(d) == 3]
        for layer, experts in sorted(self._resident_spec.items()):
            d = by_layer.get(layer, {})
            # experts the GPU reads only expanded stay in RAM alone, and biased ones it would expand
            if experts and len(d) == 3 and gpu_holds((d[k].qtype for k in ("gate", "up", "down")),
                                                     d["gate"].bias is not None):
                self._resident[id(d["gate"])] = self._keep(d["gate"], d["up"], d["down"], experts)
        for a, b in zip(layers, layers[1:]):
            self._next_experts[id(a[0])] = b
        self.layer_first = self._layer_first and bool(layers)
        if layers:  # a small MoE u-batch's routing (int64 at most), activations and output
            n_embd, n_expert = max(d.ne[1] for _, _, d in layers), max(g.ne[2] for g, _, _ in layers)
            for key, nbytes in (("ids", 8 * n_expert), ("weights", 4 * n_expert), ("x", 4 * n_embd),
                                ("out", 4 * n_embd), ("rows", 4 * n_embd)):  # rows: the embedding's, from RAM
                self._pinned_buffers[key] = torch.empty(SMALL_MOE * nbytes, dtype=torch.uint8).pin_memory()
        # the CPU's repacked copies last, after the mmap is registered and the pinned buffers made (the order the
        # generation speeds of docs/performance.md were measured in)
        self.cpu.prepare(cpu_weights, progress=progress)

    def _keep(self, gate: Weight, up: Weight, down: Weight, experts: tuple[int, ...]) -> Resident:
        """Copies of some experts of a layer in RAM on the GPU: Splits of those experts alone, or for the types the
        split kernels do not read, their GGUF blocks (layout.Blocks)."""
        from ferry.kernels.cuda.layout import Blocks, Split

        idx = torch.tensor(experts, dtype=torch.long)
        held = Split.of if gpu_reads(w.qtype for w in (gate, up, down)) else lambda raw, q, ne: Blocks(q, ne, raw)
        splits = []
        for w in (gate, up, down):
            raw = w.host_tensor().view(w.ne[2], -1)[idx].to(self.device)
            splits.append(held(raw.view(-1), w.qtype, (w.ne[0], w.ne[1], len(experts))))
        slot_of = torch.full((gate.ne[2],), -1, dtype=torch.int32)
        slot_of[idx] = torch.arange(len(experts), dtype=torch.int32)
        biases = self.gpu.expert_biases(gate, up, down)
        if biases is not None:
            biases = tuple(b[idx.to(self.device)].contiguous() for b in biases)
        return Resident(slot_of.to(self.device), *splits, tuple(experts), biases)

    @property
    def n_threads(self) -> int:
        return self.cpu.n_threads

    def kv_devices(self, n_layer: int) -> list[torch.device]:
        return [self.device] * n_layer  # attention stays on the GPU, every layer

    def on_gpu(self, w: Weight) -> bool:
        return self.devices.get(w.name, "CPU") != "CPU"

    def upload(self, w: Weight):
        return self.gpu.upload(w) if self.on_gpu(w) else None

    def fused(self, ws: tuple[Weight, ...]):
        return self.gpu.fused(ws)

    def vector(self, t: torch.Tensor) -> torch.Tensor:
        return self.gpu.vector(t)

    def half(self, t: torch.Tensor) -> torch.Tensor:
        return self.gpu.half(t)

    def joined(self, ts: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return self.gpu.joined(ts)

    def synchronize(self) -> None:
        self.gpu.synchronize()

    def _timer(self):
        if self.timed:
            self.gpu.synchronize()
        return time.perf_counter()

    def _measured(self, t0: float) -> float | None:
        if not self.timed:
            return None
        self.gpu.synchronize()
        return time.perf_counter() - t0

    # ---- dense ops ---------------------------------------------------------------------------------------

    def linear(self, x: torch.Tensor, w: Weight) -> torch.Tensor:
        if self.on_gpu(w):
            return self.gpu.linear(x, w)
        if self.recorder is not None:  # inside a CUDA graph capture: run it as a host step at replay
            return self.recorder.defer(lambda: self._linear_in_ram(x, w), (x.shape[0], w.ne[1]), self.device)
        return self._linear_in_ram(x, w)

    def _linear_in_ram(self, x: torch.Tensor, w: Weight) -> torch.Tensor:
        t0 = self._timer()
        n = x.shape[0]
        d = dense_decision(w, n, self.calib, self.policy)
        if d.device == "GPU":
            self._dense_slot ^= 1
            slot = ("dense", self._dense_slot)
            raw, done = self.streamer.stage(w, slot)
            torch.cuda.current_stream(self.device).wait_event(done)
            if can(w.qtype).gpu_gemv:
                from ferry.kernels.cuda.layout import Split

                raw = Split.of(raw, w.qtype, w.ne)
            y = self.gpu.matmul(x, w.qtype, raw, w.ne)
            self.streamer.release(slot)
        else:
            y = self.cpu.linear(x.float().cpu(), w).to(self.device, non_blocking=True)
        self.stats.add(OpRecord("mul_mat", w.name, n, d.device, d.gpu_s if d.device == "GPU" else d.cpu_s,
                                self._measured(t0), d.why))
        return y

    def ffn(self, x: torch.Tensor, gate: Weight, up: Weight, down: Weight, act: str) -> torch.Tensor:
        if all(map(self.on_gpu, (gate, up, down))):
            return self.gpu.ffn(x, gate, up, down, act)
        return self.linear(GLU[act](self.linear(x, gate), self.linear(x, up)), down)

    def get_rows(self, w: Weight, ids: torch.Tensor) -> torch.Tensor:
        if self.on_gpu(w):
            return self.gpu.get_rows(w, ids)
        rec = self.recorder
        if rec is not None:  # the embedding of a captured step: its tokens come from the host at replay
            shape = (ids.shape[0], w.ne[0])

            def rows_of() -> torch.Tensor:
                return self.cpu.get_rows(w, rec.tokens_on_host(ids))

            rows = self._pinned("rows", torch.Size(shape), torch.float32)
            host = None if rows is None else (lambda: rows.copy_(rows_of()), rows)
            return rec.defer(rows_of, shape, self.device, host=host)
        return self.cpu.get_rows(w, ids.cpu()).to(self.device)

    # ---- routed experts ----------------------------------------------------------------------------------

    def route(self, x: torch.Tensor, router: Weight, n_used: int, norm_topk: bool, routing=None):
        return gpu_route(self.linear(x, router), n_used, norm_topk, routing, self.vector)

    def moe(self, x: torch.Tensor, router: Weight, up: Weight, gate: Weight, down: Weight, n_used: int,
            norm_topk: bool, act: str, routing=None,
            residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if all(map(self.on_gpu, (gate, up, down))):
            return self.gpu.moe(x, router, up, gate, down, n_used, norm_topk, act, routing, residual)
        t0 = self._timer()
        weights, routed = self.route(x, router, n_used, norm_topk, routing)
        return self.moe_experts(x, routed, weights, up, gate, down, act, residual, t0), routed

    def moe_experts(self, x: torch.Tensor, routed: torch.Tensor, weights: torch.Tensor, up: Weight, gate: Weight,
                    down: Weight, act: str, residual: torch.Tensor | None = None, t0=None) -> torch.Tensor:
        """The routed experts chosen elsewhere (ids `routed`, weights (n, k)), where each is kept: their weighted sum
        (+ residual when given). t0: the timer of the layer's start (its router), where the policy times it."""
        experts, n_used = (gate, up, down), routed.shape[1]
        if all(map(self.on_gpu, experts)):
            return self.gpu.moe_experts(x, routed, weights, up, gate, down, act, residual)
        t0 = self._timer() if t0 is None else t0
        ids, kept = routed, None
        res = self._resident.get(id(gate))
        if res is not None:  # the resident experts' pairs on the GPU, queued before the host step that runs the rest
            slots = res.slot_of[routed.long()]
            kept = self.gpu.resident_experts(x, slots, weights, res.gate, res.up, res.down, act, res.biases)
            ids = torch.where(slots >= 0, -1, routed.to(torch.int32))  # -1: a pair the rest leaves out
        host = self._to_host(x, ids, weights)  # inside the step's CUDA graph when one is recorded
        if self.recorder is not None:
            direct = None  # the step as a function of host memory alone: the CPU's experts on the pinned copies
            if host is not None and self._decided_side(x.shape[0], ids.shape[1], experts, act) == "cpu":
                result = self._pinned("out", x.shape, torch.float32)
                direct = (lambda: self._cpu_on_pinned(host, up, gate, down, act, result), result)
            out = self.recorder.defer(lambda x, ids, weights: self._experts(x, ids, weights, host, up, gate, down,
                                                                            n_used, act, t0),
                                      (x.shape[0], down.ne[1]), self.device, inputs=(x, ids, weights), shared="moe",
                                      host=direct)
        else:
            out = self._experts(x, ids, weights, host, up, gate, down, n_used, act, t0).to(self.device,
                                                                                           non_blocking=True)
        if kept is not None:
            out = out + kept
        return out if residual is None else residual + out

    def _cpu_on_pinned(self, host, up: Weight, gate: Weight, down: Weight, act: str,
                       out: torch.Tensor) -> torch.Tensor:
        """The CPU's experts (ferry's kernel at one token, else ggml: CpuBackend.moe_experts) on a small u-batch's
        routing and activations in their pinned buffers (`host`, as _to_host gives them), into the pinned `out`: the
        way of every MoE layer decided on the CPU, cut or handshake."""
        ids_host, weights_host, x_host = host
        return self._cpu_experts(x_host, ids_host, weights_host, up, gate, down, act, out)

    def _cpu_experts(self, x_host, ids_host, weights_host, up: Weight, gate: Weight, down: Weight, act: str,
                     out: torch.Tensor | None) -> torch.Tensor:
        """The CPU's routed experts of a u-batch (CpuBackend.moe_experts) whose pairs of id -1 (resident experts,
        computed on the GPU) are left out: by ferry's kernel itself over many tokens; else the live pairs of one token
        as its slots, of more as a list of pairs (padded to few sizes, as _split_moe's cold ones) summed per token;
        zeros where none is left."""
        live = ids_host >= 0 if id(gate) in self._resident else None  # only those layers have -1 pairs
        n, n_embd = x_host.shape
        if live is None or bool(live.all()) or (n > 1 and self.cpu.native_experts(n, True, up, gate, down, act)
                                                 is not None):
            # ferry's kernel over many tokens leaves -1 pairs out itself
            return self.cpu.moe_experts(x_host, ids_host, weights_host, up, gate, down, act, out=out)
        out = torch.empty(n, n_embd, dtype=torch.float32) if out is None else out
        m = int(live.sum())
        if m == 0:
            return out.zero_()
        if n == 1:
            return self.cpu.moe_experts(x_host, ids_host[live].view(1, m), weights_host[live].view(1, m), up, gate,
                                        down, act, out=out)
        tok, slot = live.nonzero(as_tuple=True)
        pad = _bucket(m) - m
        xs = torch.cat([x_host[tok], x_host[tok[-1:]].expand(pad, -1)])
        es = torch.cat([ids_host[tok, slot], ids_host[tok[-1:], slot[-1:]].expand(pad)]).view(-1, 1)
        ws = torch.cat([weights_host[tok, slot].float(), torch.zeros(pad)]).view(-1, 1)
        y = self.cpu.moe_experts(xs, es, ws, up, gate, down, act)
        return out.zero_().index_add_(0, tok, y[:m])

    def decided(self, n: int) -> str | None:
        """auto's measured way for u-batches of n tokens so far (None before it has one): a step recorded before
        it was decided cut its graphs at host steps that may now run as handshakes, and is recorded again."""
        return self.explorer.way(n)

    def _pinned(self, key: str, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor | None:
        """A view of `shape` at the start of the page-locked buffer for `key` (allocated by prepare(), outside any
        CUDA graph capture), or None where there is none that large: MoE layers take turns with it, as a layer's
        host step has consumed it before the next layer's GPU segment writes it."""
        n = shape.numel() * dtype.itemsize
        buf = self._pinned_buffers.get(key)
        return None if buf is None or n > buf.numel() else buf[:n].view(dtype).view(shape)

    def _to_host(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor):
        """For few tokens, what a MoE host step reads on the CPU (the routing and the activations), copied into
        pinned buffers on the compute stream: asynchronous, and capturable, so a recorded step copies them in its
        graph and its host step only waits. None for more tokens: the host step fetches the routing, then only
        the CPU's share of the activations."""
        if x.shape[0] > SMALL_MOE or not self._pinned_buffers:
            return None
        dst = (self._pinned("ids", ids.shape, ids.dtype), self._pinned("weights", weights.shape, torch.float32),
               self._pinned("x", x.shape, torch.float32))
        stream = torch.cuda.current_stream(self.device)
        for d, src in zip(dst, (ids, weights, x)):
            self.streamer.copy_async(d, src.to(d.dtype).contiguous(), stream)
        return dst

    def _work(self, experts: tuple[Weight, Weight, Weight], n_used: int, act: str) -> ExpertsWork:
        """The layer's routed experts as the policy sees them (offload/work.py), described at its first u-batch."""
        gate, up, down = experts
        known = self._works.get(id(gate))
        if known is None or known[0] is not gate:
            token_kernel = self.cpu.native_experts(1, True, up, gate, down, act) is not None
            known = self._works[id(gate)] = (gate, ExpertsWork.of(gate, up, down, n_used, token_kernel))
        return known[1]

    def _streams(self, experts: tuple[Weight, Weight, Weight], work: ExpertsWork) -> bool:
        """Whether the GPU can take these experts from RAM: all three in RAM, of types it reads or expands."""
        return work.gpu_takes and not any(map(self.on_gpu, experts))

    def _decided_side(self, n: int, n_used: int, experts: tuple[Weight, Weight, Weight], act: str) -> str | None:
        """"cpu" or "gpu" where every expert (gate, up, down) of this u-batch size goes one way without a prediction:
        the GPU cannot stream them (the CPU, whatever the policy), the policy says so (on / off, or llama.cpp's rule in
        threshold mode), or auto measured that way fastest for this size class and this layer has run it before. None
        in verbose runs, which record each decision's prediction."""
        if self.timed or self.stats.keep:
            return None
        if not self._streams(experts, self._work(experts, n_used, act)):
            return "cpu"  # decided, so that a decode step waits at these layers' host steps instead of cutting there
        gate = experts[0]
        fixed = experts_fixed_side(self.policy, n, gate.ne[2], n_used)
        if fixed is not None:
            return fixed
        # no fixed side: auto mode, or the halves set apart (which no measured way covers)
        if self.policy.setting("moe_up_gate") != self.policy.setting("moe_down") or (id(gate), n) not in self._seen:
            return None
        chosen = self.explorer.way(n)
        return chosen if chosen in SIDES else None

    def _experts(self, x, ids, weights, host, up: Weight, gate: Weight, down: Weight, n_used: int, act: str,
                 t0: float) -> torch.Tensor:
        """The routed experts of x, whose router chose ids / weights on the GPU (`host`: their pinned copies, on
        their way): the host learns the choice (one sync), the policy splits the experts hit, and the CPU, the GPU
        or both compute them. The result is on the GPU, or, where ggml alone computed it for few tokens, in a
        pinned host buffer that the caller uploads."""
        experts = (gate, up, down)
        n, k = ids.shape
        n_expert = gate.ne[2]
        if host is None:
            host = ids.to("cpu", non_blocking=True), weights.to("cpu", non_blocking=True), None
        ids_host, weights_host, x_host = host
        torch.cuda.current_stream(self.device).synchronize()  # the one wait: which experts, how many tokens
        t_decided = time.perf_counter()
        if self._trial is not None:
            self._end_trial(gate, n, t_decided)
        work = self._work(experts, n_used, act)
        side = self._decided_side(n, k, experts, act)
        if x_host is not None and side == "cpu":  # generation's usual case: straight to the CPU's experts
            # pinned: the caller's upload of it is asynchronous (the next layer's host step waits for it)
            return self._cpu_on_pinned(host, up, gate, down, act, self._pinned("out", x_host.shape, torch.float32))
        parts = {"route": time.perf_counter() - t0} if self.timed else {}
        flat = ids_host.flatten().long()
        counts = torch.bincount(flat[flat >= 0], minlength=n_expert).tolist()  # -1: resident, on the GPU already
        if not any(counts):  # every pair on resident experts: nothing for this side, nothing to measure
            return torch.zeros(n, down.ne[1], dtype=torch.float32, device=self.device)
        trial = None
        if self._streams(experts, work):
            if side is not None:  # decided: that way alone, without predicting the others (auto costs what on does)
                split = work.split(counts, self.calib, SIDES[side])
                split = replace(split, why=f"every expert hit on the {side.upper()}: decided without a prediction")
            else:
                split = work.split(counts, self.calib, self.policy)
            if split.why.startswith("auto"):  # measure between the plausible ways, then keep the fastest
                split, trial = self._measured_choice(gate, n, counts, split, work)
        else:
            split = work.split(counts, self.calib, SIDES["cpu"])
            split = replace(split, why=f"experts {work.gpu_refuses or 'placed partly on the GPU'}: on the CPU")
        if split.halves and id(gate) in self._resident:  # halves apart read every slot of a pair: not with resident
            split = replace(work.split(counts, self.calib, SIDES["cpu"]),
                            why="moe_up_gate and moe_down apart: not beside resident experts, the CPU's")
        if split.halves and gate.bias is not None:  # ggml's halves add no biases
            split = replace(work.split(counts, self.calib, SIDES["cpu"]),
                            why="moe_up_gate and moe_down apart: not for biased experts, the CPU's")
        if split.halves and not all(can_ggml(w.qtype) for w in (up, gate, down)):  # the CPU's half is ggml's
            split = replace(work.split(counts, self.calib, SIDES["cpu"]),
                            why="moe_up_gate and moe_down apart: not for ik_llama.cpp's types, which ggml lacks")
        if split.halves:
            out = self._halves_moe(x, x_host, ids, ids_host, weights, weights_host, split, up, gate, down, act,
                                   parts)
        elif not split.gpu:  # all on the CPU: ggml sums each token's experts
            if x_host is None:
                x_host = x.float().cpu()
            t1 = time.perf_counter()
            y = self._cpu_experts(x_host, ids_host, weights_host, up, gate, down, act,
                                  self._pinned("out", x_host.shape, torch.float32) if n <= SMALL_MOE else None)
            if self.timed:
                parts["cpu"] = time.perf_counter() - t1
            out = y.to(self.device, non_blocking=True)
        else:
            out = self._split_moe(x, x_host, ids, ids_host, weights, split, up, gate, down, act, parts)
        if trial is not None:
            self._trial = (self.explorer, gate, n, trial, t_decided)
        if self.stats.keep:
            where = (f"GPU {split.halves} / CPU {split.cpu_half}" if split.halves
                     else f"GPU {len(split.gpu)} / CPU {len(split.cpu)}")
            self.stats.add(OpRecord("mul_mat_id", gate.name, n, where, split.predicted_s, self._measured(t0),
                                    split.why, parts))
        return out

    def _end_trial(self, gate: Weight, n: int, now: float) -> None:
        """A trial layer's time is measured from its routing to the next layer's: its experts, whatever they left
        queued or blocked, and the attention after them (a split's ggml holds the thread that launches the GPU's
        next work; a streamed layer's copies of the next layer run beside it), which timing the experts alone,
        synchronized, left out."""
        explorer, last, n_last, way, start = self._trial
        self._trial = None
        nxt = self._next_experts.get(id(last))
        if explorer is self.explorer and n_last == n and nxt is not None and nxt[0] is gate:  # the next layer
            explorer.record(n, way, now - start)

    def _measured_choice(self, gate: Weight, n: int, counts: list[int], predicted, work: ExpertsWork):
        """auto: the way this u-batch's size class was measured fastest (policy.Explorer), or a timed trial of one."""
        first = (id(gate), n) not in self._seen  # a layer's first call of a size builds graphs, compiles kernels:
        self._seen.add((id(gate), n))              # no trial there, the prediction decides
        decided = self.explorer.way(n)
        if first and decided is None:
            return predicted, None
        if decided is not None:  # measured already: only that way is built, every MoE layer of every u-batch
            ways = {decided: predicted if decided == "split" else work.split(counts, self.calib, SIDES[decided])}
        else:
            ways = {k: work.split(counts, self.calib, p) for k, p in SIDES.items()}
            if predicted.gpu and predicted.cpu:
                ways["split"] = predicted
        cost = {k: max(v.gpu_s, v.cpu_s) + self.calib.overlap * min(v.gpu_s, v.cpu_s) for k, v in ways.items()}
        mode, trial = self.explorer.mode(n, cost)
        chosen = ways.get(mode, predicted)
        why = f"auto, {mode}: " + ("trial" if trial else self.explorer.why(n)) + f"; {predicted.why[6:]}"
        return replace(chosen, why=why), (mode if trial else None)

    def _split_moe(self, x, x_host, ids, ids_host, weights, split, up: Weight, gate: Weight, down: Weight, act: str,
                   parts: dict):
        """Hot experts copied and computed on the GPU while the CPU computes the cold ones; each token's expert
        outputs summed on the GPU in slot order."""
        n, k = ids.shape
        on_gpu = torch.zeros(gate.ne[2], dtype=torch.bool)
        on_gpu[list(split.gpu)] = True
        flat = ids_host.long().flatten()
        live = flat >= 0  # -1: a resident expert's pair, computed already
        pair_gpu = on_gpu[flat.clamp(min=0)] & live
        hot, cold = pair_gpu.nonzero().flatten(), (~pair_gpu & live).nonzero().flatten()
        gather = len(cold) or not bool(live.all())
        x_cold = None
        if len(cold):  # before the GPU work is queued
            x_cold = x_host[cold // k] if x_host is not None else x.float()[cold.to(self.device) // k].cpu()
        staged = self._staged_experts((gate, up, down), list(split.gpu))
        stream = torch.cuda.current_stream(self.device)
        (g, _), (u, up_done), (dn, down_done) = staged
        stream.wait_event(up_done)  # gate and up are there; down may still be on its way
        if gather:
            hot_d = hot.to(self.device, non_blocking=True)
            xs, es = x[hot_d // k], ids.flatten()[hot_d].view(-1, 1)
        else:
            xs, es = x, ids
        y_gpu = self.gpu.expert_pairs(xs, es, g, u, dn, act, wait_down=down_done,
                                      biases=self.gpu.expert_biases(gate, up, down))
        self.streamer.release(("moe", self._slot))
        if not gather:
            out = (y_gpu.view(n, k, -1) * weights[..., None]).sum(1)
        else:
            y = torch.zeros(n * k, x.shape[1], dtype=torch.float32, device=self.device)
            y.index_copy_(0, hot_d, y_gpu)
            t1 = time.perf_counter()
            if len(cold):
                padded = _bucket(len(cold))  # few distinct graph shapes: pad with copies of the last pair
                xc = torch.cat([x_cold, x_cold[-1:].expand(padded - len(cold), -1)])
                ec = ids_host.flatten()[cold]
                ec = torch.cat([ec, ec[-1:].expand(padded - len(cold))])
                y_cpu = self.cpu.moe_experts(xc, ec.view(-1, 1), None, up, gate, down, act)[:len(cold), 0]
                y.index_copy_(0, cold.to(self.device), y_cpu.to(self.device))
            if self.timed:
                parts["cpu"] = time.perf_counter() - t1
            out = (y.view(n, k, -1) * weights[..., None]).sum(1)
        if not split.cpu and len(split.gpu) >= 0.9 * gate.ne[2]:
            self._prefetch_after(gate)  # a u-batch this large will want (nearly) all of the next layer's experts
        return out

    def _halves_moe(self, x, x_host, ids, ids_host, weights, weights_host, split, up: Weight, gate: Weight,
                    down: Weight, act: str, parts: dict) -> torch.Tensor:
        """moe_up_gate and moe_down on different sides: one half of every expert hit on the GPU (its weights
        copied), the other by ggml, one after the other; each pair's intermediate row (n_ff wide) crosses PCIe
        between them. The result is on the GPU."""
        n, k = ids.shape
        stream = torch.cuda.current_stream(self.device)
        layer, hit = (gate, up, down), list(split.gpu)
        if split.halves == "up_gate":  # the GPU first; ggml's down projections sum each token's slots
            (g, _), (u, done) = self._staged_experts(layer, hit, slice(0, 2))
            stream.wait_event(done)
            h = self.gpu.pair_up_gate(x, ids, g, u, act)
            self.streamer.release(("moe", self._slot))
            t1 = time.perf_counter()
            y = self.cpu.moe_down(h.float().view(n, k, -1).cpu(), ids_host, weights_host, down)
            out = y.to(self.device, non_blocking=True)
        else:  # ggml first, while the down projections are copied; then the GPU's
            ((dn, done),) = self._staged_experts(layer, hit, slice(2, 3))
            t1 = time.perf_counter()
            h = self.cpu.moe_up_gate(x.float().cpu() if x_host is None else x_host, ids_host, up, gate, act)
            h = h.view(n * k, -1).to(self.device, non_blocking=True)
            stream.wait_event(done)
            out = self.gpu.pair_down(h, ids, dn, weights)
            self.streamer.release(("moe", self._slot))
        if self.timed:
            parts["cpu"] = time.perf_counter() - t1
        return out

    def _staged_experts(self, layer: tuple[Weight, Weight, Weight], experts: list[int], which: slice = slice(None)):
        """(gate, up, down)[which] of this layer's experts on the GPU: prefetched while the previous layer
        computed, or copied now."""
        self._slot ^= 1
        pre = self._prefetched
        self._prefetched = None
        if pre is not None and pre[0] is layer[0]:  # every expert of this layer was prefetched
            return pre[1][which]
        return self.streamer.stage_experts(list(layer[which]), experts, ("moe", self._slot), self._expands(layer))

    @staticmethod
    def _expands(layer: tuple[Weight, Weight, Weight]) -> bool:
        """Whether a layer's staged experts stay as copied (streamer.Compact: any of a type the split kernels do not
        read, a Q4_K_M file's K-quants), rather than spread to a Split's slots."""
        return not gpu_reads(w.qtype for w in layer)

    def _prefetch_after(self, gate: Weight) -> None:
        nxt = self._next_experts.get(id(gate))
        if nxt is not None:
            res = self._resident.get(id(nxt[0]))
            kept = set(res.experts) if res is not None else set()
            experts = [e for e in range(nxt[0].ne[2]) if e not in kept]  # resident ones are there already
            staged = self.streamer.stage_experts(list(nxt), experts, ("moe", self._slot ^ 1), self._expands(nxt))
            self._prefetched = (nxt[0], staged)

    def describe(self) -> str:
        """One line for the run's report: what stays in RAM, the policy, whether the pages are pinned."""
        in_ram = [n for n, d in self.devices.items() if d == "CPU"]
        pinned = self.streamer.why if self.streamer else "nothing registered yet"
        kept = (f" ({sum(len(r.experts) for r in self._resident.values())} experts of {len(self._resident)} of their "
                "layers kept on the GPU too)" if self._resident else "")
        return (f"hybrid: {len(in_ram)} tensors in RAM{kept}, the rest on {self.device}; offload policy "
                f"{self.policy.mode}"
                + "".join(f",{k}={v}" for k, v in self.policy.overrides.items()) + f"; {pinned}")

    def notes(self) -> list[str]:
        """What auto measured and chose per u-batch size, and where that was far from the calibration's prediction
        (policy.Explorer), for the run's report."""
        return self.explorer.choices() + self.explorer.notes

    def report(self) -> list[str]:
        """The recorded decisions (--verbose) as table lines: predicted against measured milliseconds."""
        lines = ["| op | weight | tokens | where | predicted ms | measured ms | why |", "| --- | --- | ---: | --- | ---: | ---: | --- |"]
        for r in self.stats.records:
            measured = "" if r.measured_s is None else f"{1e3 * r.measured_s:.3f}"
            lines.append(f"| {r.op} | {r.weight} | {r.n_tokens} | {r.device} | {1e3 * r.predicted_s:.3f} | {measured} | "
                         f"{r.why} |")
        return lines

    def close(self) -> None:
        if self.streamer is not None:
            self.streamer.close()
        self.cpu.close()


def _bucket(m: int) -> int:
    """Rows padded to 8, 16, 32, 64, then multiples of 64: each distinct count builds a ggml graph."""
    if m <= 64:
        return max(8, 1 << (m - 1).bit_length())
    return -(-m // 64) * 64
