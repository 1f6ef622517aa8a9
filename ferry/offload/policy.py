"""Offload decisions for ops whose weights live in CPU RAM: compute there, or ferry the weights over PCIe and
compute on the GPU. Ops have names, never integer ids. Three ways to decide:
- `auto` (default): predict both times from this machine's calibration (cost.py) and take the faster, then measure
  the plausible ways on the first u-batches of each size (Explorer) and keep the fastest;
- `threshold`: llama.cpp's rule, offload when the batch has at least `min_batch` tokens (for MoE experts,
  min_batch * n_expert / n_expert_used);
- per-op overrides, `mul_mat_id=on,moe_down=off` or `all=off`, on top of either.
A decision is a pure function of the calibration and the op's shape, so it is tested with made-up machines.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import numpy as np

from ferry.errors import FerryError
from ferry.offload.cost import GPU_SIDE_LAUNCHES, Calibration, experts_hit


# a dense matmul on a CPU weight; the routed experts (both halves, unless one is named); their two halves
OPS = ("mul_mat", "mul_mat_id", "moe_up_gate", "moe_down")


MODES = ("auto", "threshold")


SETTINGS = ("on", "off", "auto")


DEFAULT_MIN_BATCH = 32  # llama.cpp's GGML_OP_OFFLOAD_MIN_BATCH


GENERATION_TOKENS = 8  # u-batches up to this size are generation's (one token per sequence)


@dataclass
class Policy:
    mode: str = "auto"
    overrides: dict[str, str] = field(default_factory=dict)
    min_batch: int = DEFAULT_MIN_BATCH

    def setting(self, op: str) -> str:
        """on / off / auto for an op: its own override, then its family's (mul_mat_id for the MoE halves), then all."""
        for name in (op, "mul_mat_id" if op.startswith("moe_") else None, "all"):
            if name and name in self.overrides:
                return self.overrides[name]
        return "auto"


def parse_policy(text: str, min_batch: int = DEFAULT_MIN_BATCH) -> Policy:
    """--offload-policy: 'auto', 'threshold', or comma-separated NAME=on|off|auto items (optionally after a mode)."""
    if min_batch < 1:
        raise FerryError(f"--offload-min-batch must be at least 1, got {min_batch}")
    policy = Policy(min_batch=min_batch)
    for item in filter(None, (p.strip() for p in text.split(","))):
        if item in MODES:
            policy.mode = item
            continue
        name, sep, value = item.partition("=")
        if not sep:
            raise FerryError(f"--offload-policy: '{item}' is neither a mode ({', '.join(MODES)}) nor NAME=on|off|auto")
        if name not in OPS and name != "all":
            raise FerryError(f"--offload-policy: unknown op '{name}'; valid names: all, {', '.join(OPS)}")
        if value not in SETTINGS:
            raise FerryError(f"--offload-policy: '{item}' must set on, off or auto")
        policy.overrides[name] = value
    return policy


@dataclass(frozen=True)
class Decision:
    op: str
    device: str  # "CPU" or "GPU"
    cpu_s: float  # predicted time on the CPU
    gpu_s: float  # predicted time on the GPU, copy included
    why: str


def decide(op: str, n_tokens: int, rows: int, cols: int, bytes_per_weight: float, calib: Calibration,
           policy: Policy, n_expert: int = 0, n_expert_used: int = 0) -> Decision:
    """Where one op on a CPU-resident weight runs for a batch of n_tokens. For experts (n_expert > 0) the
    matrix is one expert's (rows x cols); the copy moves the experts the batch is expected to hit."""
    if op not in OPS:
        raise ValueError(f"unknown op {op}")
    moe = n_expert > 0
    n_matrices = experts_hit(n_tokens, n_expert, n_expert_used) if moe else 1.0
    weight_bytes = rows * cols * bytes_per_weight * n_matrices
    flops = 2.0 * rows * cols * n_tokens * (n_expert_used if moe else 1)
    cpu_s = max(weight_bytes / calib.cpu_bytes_per_s, flops / calib.cpu_flops)
    copy_s = calib.h2d_latency_s * n_matrices + weight_bytes / calib.h2d_bytes_per_s
    gpu_s = copy_s + max(weight_bytes / calib.gpu_bytes_per_s, flops / calib.gpu_flops)
    setting = policy.setting(op)
    if setting != "auto":
        return Decision(op, "GPU" if setting == "on" else "CPU", cpu_s, gpu_s, f"{op}={setting} (override)")
    if policy.mode == "threshold":
        need = policy.min_batch * (n_expert / n_expert_used if moe else 1)
        device = "GPU" if n_tokens >= need else "CPU"
        return Decision(op, device, cpu_s, gpu_s, f"threshold: batch {n_tokens} {'>=' if device == 'GPU' else '<'} {need:g}")
    device = "GPU" if gpu_s < cpu_s else "CPU"
    return Decision(op, device, cpu_s, gpu_s, f"auto: predicted CPU {1e3 * cpu_s:.3f} ms, GPU {1e3 * gpu_s:.3f} ms "
                                              f"(copy {1e3 * copy_s:.3f} ms)")


@dataclass(frozen=True)
class ExpertSplit:
    """Where one MoE layer's routed experts run for one u-batch: the hot ones copied to the GPU, the cold ones on
    the CPU, both sides at once; the predicted seconds of each side."""

    gpu: tuple[int, ...]
    cpu: tuple[int, ...]
    gpu_s: float
    cpu_s: float
    why: str
    # "up_gate" or "down": that half of every expert hit runs on the GPU and the other half on the CPU, one after
    # the other (moe_up_gate and moe_down set apart); "" when the experts move whole
    halves: str = ""

    @property
    def cpu_half(self) -> str:
        """The half the CPU runs when the halves are apart."""
        return {"up_gate": "down", "down": "up_gate"}.get(self.halves, "")

    @property
    def predicted_s(self) -> float:
        """Both sides at once for a split (their overlap's cost aside); one after the other for halves."""
        return self.gpu_s + self.cpu_s if self.halves else max(self.gpu_s, self.cpu_s)


def split_experts(counts: list[int], expert_bytes: float, flops_per_token: float, calib: Calibration,
                  policy: Policy, n_expert_used: int, up_gate_share: float = 2 / 3, types: dict[str, float] | None = None,
                  token_kernel: bool = False) -> ExpertSplit:
    """counts[e]: tokens of the u-batch routed to expert e; expert_bytes: its gate+up+down weights;
    flops_per_token: its work per token; up_gate_share: the gate and up projections' part of both (2/3 when the
    three share a quant type); types, token_kernel: what the CPU's rate depends on (Calibration.cpu_expert_s).
    `on` / `off` / threshold move every expert hit one way; auto predicts each side's time (a GPU expert costs its
    copy and its compute, a CPU expert its measured rate) and takes the split by token count (hottest first to the
    GPU) predicted fastest: the slower side, plus what overlapping does not hide of the faster one. moe_up_gate and
    moe_down set apart run each expert's halves on different sides (_halves)."""
    tokens = np.asarray(counts, dtype=np.int64)
    order = np.lexsort((np.arange(len(tokens)), -tokens))  # hottest first, ties by id
    hit = order[tokens[order] > 0]
    n_tokens = int(tokens.sum()) // max(n_expert_used, 1)
    hot = tokens[hit]
    # each expert's cost, hottest first (numpy: a layer of 128 experts decides in tens of microseconds, per layer)
    on_cpu = calib.cpu_expert_s(expert_bytes, hot, flops_per_token, types, token_kernel and n_tokens == 1)
    on_gpu = calib.gpu_expert_s(expert_bytes, hot, flops_per_token)
    gpu_fixed = GPU_SIDE_LAUNCHES * calib.launch_s

    def split(n_gpu: int, why: str) -> ExpertSplit:
        return ExpertSplit(tuple(sorted(hit[:n_gpu].tolist())), tuple(sorted(hit[n_gpu:].tolist())),
                           float(on_gpu[:n_gpu].sum()) + (gpu_fixed if n_gpu else 0.0), float(on_cpu[n_gpu:].sum()),
                           why)

    threshold = _threshold(policy, n_tokens, len(counts), n_expert_used)
    ug, down = policy.setting("moe_up_gate"), policy.setting("moe_down")
    if ug != down:
        return _halves({"up_gate": ug, "down": down}, split(len(hit), ""), split(0, ""), hot, expert_bytes,
                       flops_per_token, up_gate_share, calib, threshold, types)
    if ug != "auto":
        return split(len(hit) if ug == "on" else 0, f"mul_mat_id={ug} (override)")
    if threshold:
        return split(len(hit) if threshold[0] else 0, threshold[1])
    # the hottest i experts on the GPU, for each i: the slower side, plus what overlapping does not hide of the other
    gpu_total = gpu_fixed + np.cumsum(on_gpu)
    cpu_total = on_cpu.sum() - np.cumsum(on_cpu)
    both = np.maximum(gpu_total, cpu_total) + calib.overlap * np.minimum(gpu_total, cpu_total)
    best = int(np.argmin(np.concatenate([[on_cpu.sum()], both])))  # the first of equals: fewest experts moved
    s = split(best, "")
    return ExpertSplit(s.gpu, s.cpu, s.gpu_s, s.cpu_s, f"auto: {len(s.gpu)} of {len(hit)} experts hit to the GPU, "
                                                       f"predicted GPU {1e3 * s.gpu_s:.3f} ms, CPU {1e3 * s.cpu_s:.3f} ms")


def _threshold(policy: Policy, n_tokens: int, n_expert: int, n_expert_used: int) -> tuple[bool, str] | None:
    """(whether the experts go to the GPU, why) under llama.cpp's rule in threshold mode; None in auto mode."""
    if policy.mode != "threshold":
        return None
    need = policy.min_batch * n_expert / max(n_expert_used, 1)
    return n_tokens >= need, f"threshold: batch {n_tokens} {'>=' if n_tokens >= need else '<'} {need:g}"


def experts_fixed_side(policy: Policy, n_tokens: int, n_expert: int, n_expert_used: int) -> str | None:
    """"gpu" or "cpu" where the policy alone puts every routed expert of a u-batch of n_tokens on one side (both
    halves set alike, or llama.cpp's rule where they are left at auto in threshold mode), so that no prediction need
    run; None where auto decides or the halves go apart."""
    ug, down = policy.setting("moe_up_gate"), policy.setting("moe_down")
    if ug != down:
        return None
    if ug != "auto":
        return "gpu" if ug == "on" else "cpu"
    rule = _threshold(policy, n_tokens, n_expert, n_expert_used)
    return None if rule is None else ("gpu" if rule[0] else "cpu")


def _halves(settings: dict[str, str], all_gpu: ExpertSplit, all_cpu: ExpertSplit, hot: np.ndarray,
            expert_bytes: float, flops_per_token: float, share: float, calib: Calibration,
            threshold: tuple[bool, str] | None, types: dict[str, float] | None = None) -> ExpertSplit:
    """moe_up_gate and moe_down set differently (`settings`: half -> on / off / auto): every expert hit's two halves
    where the settings say, one after the other, the rows between them crossing PCIe. A half left at auto goes where
    the threshold rule (when `threshold` is (on, why)) or the prediction puts it: beside its other half (the experts
    move whole: all_gpu or all_cpu) or apart."""
    def cpu_s(part: float) -> float:
        return float(calib.cpu_expert_s(expert_bytes * part, hot, flops_per_token * part, types).sum())

    def gpu_s(part: float) -> float:
        per = calib.gpu_expert_s(expert_bytes * part, hot, flops_per_token * part)
        return float(per.sum()) + GPU_SIDE_LAUNCHES * calib.launch_s

    parts = {"up_gate": share, "down": 1.0 - share}
    on = {half: s == "on" for half, s in settings.items()}
    why = f"moe_up_gate={settings['up_gate']}, moe_down={settings['down']} (override)"
    other = next((half for half, s in settings.items() if s == "auto"), None)  # at most one: the two differ
    if other is not None:
        fixed = "down" if other == "up_gate" else "up_gate"
        if threshold:
            on[other], rule = threshold
        else:
            apart = (gpu_s(parts[fixed]) + cpu_s(parts[other]) if on[fixed] else
                     cpu_s(parts[fixed]) + gpu_s(parts[other]))
            whole = all_gpu.gpu_s if on[fixed] else all_cpu.cpu_s
            on[other] = on[fixed] == (whole <= apart)
            rule = f"auto: predicted {1e3 * whole:.3f} ms beside it, {1e3 * apart:.3f} ms apart"
        why += f"; {other}: {rule}"
    if on["up_gate"] == on["down"]:
        return replace(all_gpu if on["up_gate"] else all_cpu, why=why)
    apart = ExpertSplit(all_gpu.gpu, all_gpu.gpu, 0.0, 0.0, why, halves="up_gate" if on["up_gate"] else "down")
    return replace(apart, gpu_s=gpu_s(parts[apart.halves]), cpu_s=cpu_s(parts[apart.cpu_half]))


def size_class(n_tokens: int) -> int:
    """u-batches of similar size share one measured choice: 1, 2, 4, ... (the next power of two)."""
    return 1 << max(n_tokens - 1, 0).bit_length()


@dataclass
class Explorer:
    """auto's measurement, on top of the prediction: the first u-batches of each size class run their MoE layers
    each plausible way in turn (every expert hit streamed to the GPU, all on the CPU, the predicted split), timed,
    `warmup` + `samples` layers per way in a row (so that streamed layers prefetch as they will), and the fastest
    way is kept for that size. A way's first `warmup` layers are run but not counted: the first CPU layers after a
    stretch on the GPU were measured 10x slower than the next ones (9.8 against 1.0 ms), which made auto stream
    generation that the CPU computes faster. Generation's layers (up to 8 tokens) are short and noisy: they take
    `samples` x 2. The prediction rules out ways it expects to be over `margin` times the best, but not in
    generation, where a way's trial costs a few layers of a few ms: a calibration taken on a busy machine (every
    expert type read at 4-8 GB/s beside `ferry synth`) had ruled the CPU out there, and auto streamed what the CPU
    reads faster. Where a way measures fastest that the prediction put over `margin` times the best, `notes` says so,
    and the choice is provisional: measured again `recheck_s` seconds later (each in turn), since one of the two was
    taken on a busy machine and the few layers of a trial may be the one. On the H100 machine the first process after
    writing an 18 GB file measured the CPU's generation layers at 4.9 ms against 0.9 a minute later and streamed
    its whole run at 28 instead of 88 t/s (docs/performance.md, 2026-11-25). Generation's choice is measured again at
    recheck_s whether or not the prediction agrees: gpt-oss-120b's first run after its 63 GB file was written measured
    the CPU's layers at 8.9 ms against streaming's 1.8 and streamed every token (16.5 t/s) with no calibration to
    disagree. Work that also grows with the cache
    (-mla 3's forms) passes `cells`: its classes are then (tokens, cells) size pairs."""

    samples: int = 2
    margin: float = 3.0
    warmup: int = 1
    # the ways one layer each in turn instead of in a row: for work that leaves nothing to the next layer (-mla 3's
    # forms), so that a slow start (a process's first u-batch) falls on every way alike
    alternate: bool = False
    trials: dict[int | tuple[int, int], dict[str, list[float]]] = field(default_factory=dict)
    chosen: dict[int | tuple[int, int], str] = field(default_factory=dict)
    predicted: dict[int | tuple[int, int], dict[str, float]] = field(default_factory=dict)  # at each class's first
    recheck_s: tuple[float, ...] = (2.0, 10.0, 30.0)
    _against: dict[int | tuple[int, int], str] = field(default_factory=dict)  # choices the prediction disagrees with
    _due: dict[int | tuple[int, int], float] = field(default_factory=dict)  # when a provisional one is measured again
    _rechecks: dict[int | tuple[int, int], int] = field(default_factory=dict)

    @property
    def notes(self) -> list[str]:
        """Measurements the calibration is far off from, for the run's report."""
        return list(self._against.values())

    def way(self, n_tokens: int, cells: int | None = None) -> str | None:
        """The way measured fastest for this size class; None before it is measured, and when a provisional choice
        is due to be measured again (its trials start over)."""
        size = self.key(n_tokens, cells)
        due = self._due.get(size)
        if due is not None and time.monotonic() >= due:
            del self._due[size]
            self.chosen.pop(size, None)
            self.trials.pop(size, None)
            self._rechecks[size] = self._rechecks.get(size, 0) + 1
        return self.chosen.get(size)

    @staticmethod
    def key(n_tokens: int, cells: int | None = None) -> int | tuple[int, int]:
        return size_class(n_tokens) if cells is None else (size_class(n_tokens), size_class(cells))

    def _needed(self, n_tokens: int) -> int:
        return self.warmup + self.samples * (2 if n_tokens <= GENERATION_TOKENS else 1)

    def mode(self, n_tokens: int, predicted: dict[str, float], cells: int | None = None) -> tuple[str, bool]:
        """(the way to run this layer, whether it is a trial to be timed and recorded)."""
        size = self.key(n_tokens, cells)
        decided = self.way(n_tokens, cells)
        if decided is not None:
            return decided, False
        if size not in self.trials:
            best, self.predicted[size] = min(predicted.values()), dict(predicted)
            margin = self.margin if n_tokens > GENERATION_TOKENS else float("inf")
            # (generation: every way, also where the prediction is 0 for all, which inf * 0 would leave out)
            self.trials[size] = {k: [] for k, v in predicted.items() if margin == float("inf") or v <= margin * best}
        trials = self.trials[size]
        if len(trials) == 1:
            self.chosen[size] = next(iter(trials))
            return self.chosen[size], False
        pending = [k for k, v in trials.items() if len(v) < self._needed(n_tokens)]
        return (min(pending, key=lambda k: len(trials[k])) if self.alternate else pending[0]), True

    def record(self, n_tokens: int, mode: str, seconds: float, cells: int | None = None) -> None:
        size = self.key(n_tokens, cells)
        trials = self.trials.get(size)
        if trials is None or mode not in trials:  # a trial that ended after its class was due to be measured again
            return
        trials[mode].append(seconds)
        if all(len(v) >= self._needed(n_tokens) for v in trials.values()):
            self.chosen[size] = way = min(trials, key=lambda k: min(trials[k][self.warmup:]))
            guess = self.predicted.get(size, {})
            if way in guess and guess[way] > self.margin * min(guess.values()):
                best = min(guess, key=guess.get)
                done = self._rechecks.get(size, 0)
                again = f" (measured {done + 1} times)" if done else ""
                self._against[size] = (f"{self.why(n_tokens, cells)}, the fastest {way}{again}, which the calibration "
                                       f"predicted {guess[way] / guess[best]:.0f}x slower than {best}: a calibration "
                                       "measured on a busy machine is this far off; run `ferry calibrate` again on an "
                                       "idle one")
                if done < len(self.recheck_s):
                    self._due[size] = time.monotonic() + self.recheck_s[done]
            else:
                self._against.pop(size, None)
                done = self._rechecks.get(size, 0)
                if n_tokens <= GENERATION_TOKENS and done < len(self.recheck_s):
                    # generation's trials cost a few layers: measured again all the same, since a disturbance the
                    # prediction shared (no calibration, or one as busy) would otherwise hold for the whole run
                    self._due[size] = time.monotonic() + self.recheck_s[done]

    def choices(self) -> list[str]:
        """Each size class's measured way and why, for the run's report."""
        out = []
        for size, way in self.chosen.items():
            span, measured = self._measured(*((size, None) if isinstance(size, int) else size))
            out.append(f"{way} for {span}: {measured or 'the only plausible way'}")
        return out

    def _measured(self, n_tokens: int, cells: int | None = None) -> tuple[str, str]:
        size = self.key(n_tokens, cells)
        t = self.trials.get(size, {})
        measured = ", ".join(f"{k} {1e3 * min(v[self.warmup:]):.3f} ms" for k, v in t.items() if v[self.warmup:])
        span = f"u-batches up to {size}" if cells is None else f"u-batches up to {size[0]} over up to {size[1]} cells"
        return span, measured

    def why(self, n_tokens: int, cells: int | None = None) -> str:
        span, measured = self._measured(n_tokens, cells)
        return f"measured for {span}: {measured}" if measured else "the only plausible way"
