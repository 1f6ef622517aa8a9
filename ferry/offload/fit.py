"""The default placement where a GPU is visible and no -ngl / -ot is given (--fit, llama.cpp's name): fill the GPU,
in order, with everything but the routed experts, the KV cache for -c (shrunk to what fits, down to --fit-ctx), the
compute and staging buffers the run needs at its -b / -ub, then routed experts, the unit being the expert. With no
routing statistics, whole layers' experts spread evenly over the layers, then as many experts of one more layer as the
room left holds; with the counts of `ferry calibrate --routing`, the most used (layer, expert) pairs first, a layer
whose every expert is chosen placed whole, where that puts PER_EXPERT_GAIN more of the counted pairs on the GPU than
whole layers do. Experts of a layer are split between the GPU and RAM only where the GPU's
kernels read their type in place (Q8_0, Q4_0: HybridBackend's resident experts); others go by whole layers. The rest
stays in RAM. A model without routed experts gets the most layers that fit (-ngl), as
llama.cpp's fit gives. Each step asks the memory plan (placement.memory_plan), the one estimate the run checks too."""

from __future__ import annotations

from dataclasses import dataclass, field

from ferry.errors import FerryError
import numpy as np

from ferry.placement import (EXPERTS_RE, GIB, MemoryPlan, expanded_layers, expanding_layers, format_gpu_experts,
                             kv_bytes, memory_plan, parse_overrides)

FIT_TARGET_MIB = 1024  # the margin left free on each GPU (llama.cpp's -fitt default)
FIT_CTX = 4096  # the context the fit may shrink -c to, and no lower (llama.cpp's --fit-ctx default)
# the share of routed pairs by which the most used experts must beat whole layers on the GPU for the fit to place
# expert by expert: a layer split between the GPU and RAM keeps its step on the host, which a whole layer on the GPU
# has not (prompts lost a fifth at 12 GiB on the skewed 30B where generation gained 29%: docs/performance.md)
PER_EXPERT_GAIN = 0.15


@dataclass
class Fit:
    """A placement, as the flags a user would have written for it, and why."""

    n_gpu_layers: int
    override_tensor: tuple[str, ...]
    n_ctx: int
    expert_layers: tuple[int, ...]  # the MoE layers whose routed experts are on the GPU
    moe_layers: int  # MoE layers in the model
    plan: MemoryPlan  # on the GPU's room less the margin
    margin: int = FIT_TARGET_MIB << 20  # bytes left free on the GPU (--fit-target)
    notes: list[str] = field(default_factory=list)
    resident: dict[int, tuple[int, ...]] = field(default_factory=dict)  # --gpu-experts: layer -> its experts on the GPU
    n_expert: int = 0
    counted_share: float | None = None  # the share of the counted routed pairs on the GPU (routing statistics)
    held_out_share: float | None = None  # the same on the text held out from the counting, where it was stored
    layer_share: dict[int, float] = field(default_factory=dict)  # per layer with resident experts: its pairs' share

    @property
    def gpu_share(self) -> float:
        """The share of routed (token, expert) pairs that meet their expert on the GPU: on the held-out text where
        the routing was counted, else routing spread evenly."""
        if self.held_out_share is not None:
            return self.held_out_share
        if self.counted_share is not None:
            return self.counted_share
        if not self.moe_layers:
            return 1.0
        partial = sum(len(ids) for ids in self.resident.values()) / max(self.n_expert, 1)
        return (len(self.expert_layers) + partial) / self.moe_layers

    @property
    def share_basis(self) -> str:
        return ("on the text held out from `ferry calibrate --routing`" if self.held_out_share is not None else
                "on the text `ferry calibrate --routing` counted" if self.counted_share is not None else
                "routing spread evenly")

    def experts_per_layer(self) -> dict[int, int]:
        """Routed experts on the GPU per MoE layer that has any."""
        out = {layer: self.n_expert for layer in self.expert_layers}
        out.update({layer: len(ids) for layer, ids in self.resident.items()})
        return dict(sorted(out.items()))

    def flags(self) -> str:
        """The placement as -ngl / -ot / --gpu-experts flags (what `--fit off` with these flags would run)."""
        resident = f" --gpu-experts '{format_gpu_experts(self.resident)}'" if self.resident else ""
        return f"-ngl {self.n_gpu_layers}" + "".join(f" -ot '{r}'" for r in self.override_tensor) + resident

    def describe(self) -> str:
        """One line for the run's report and `ferry plan`."""
        d = next((d for d in self.plan.devices if d.device != "CPU"), None)
        on_gpu = (f"{d.total / GIB:.2f} GiB on {d.device}, of {d.available / GIB:.2f} GiB its room less the "
                  f"--fit-target margin of {self.margin >> 20} MiB") if d and d.available is not None else ""
        if not self.moe_layers:
            return f"fit: {self.n_gpu_layers} layers on the GPU ({on_gpu}), -c {self.n_ctx}"
        partial = (f" and {sum(map(len, self.resident.values()))} experts of {len(self.resident)} more"
                   if self.resident else "")
        flags = self.flags()
        if len(flags) > 400:
            flags = flags[:400] + "... (in full: `ferry plan --json`)"
        return (f"fit: every weight but the routed experts on the GPU, and the routed experts of "
                f"{len(self.expert_layers)} of {self.moe_layers} layers{partial} ({100 * self.gpu_share:.0f}% of the "
                f"routed pairs, {self.share_basis}); {on_gpu}, -c {self.n_ctx} ({flags})")


def spread(layers: list[int], k: int) -> list[int]:
    """k of `layers` spread evenly over them (the middle of each of k equal stretches)."""
    n = len(layers)
    return [layers[int((i + 0.5) * n / k)] for i in range(k)] if k else []


def _expert_rules(chosen: list[int], gpu: str) -> tuple[str, ...]:
    rules = (rf"blk\.({'|'.join(map(str, chosen))})\.ffn_(gate|up|down)_exps={gpu}",) if chosen else ()
    return rules + ("exps=CPU",)


def fit(tensors: dict[str, int], args, cache, kv: tuple[float, float], gpu: str, available: int, n_ctx: int,
        n_ubatch: int, n_batch: int = 0, margin: int = FIT_TARGET_MIB << 20, ctx_floor: int = FIT_CTX,
        per_expert: bool = False, routing: dict | None = None, expands: frozenset[int] = frozenset(),
        n_logits: int | None = None, expanded: frozenset[int] | None = None, n_seq: int = 1) -> Fit:
    """The placement for one GPU of `available` bytes, `margin` of them left free. tensors: name -> bytes (the
    file's); args: ModelArgs; cache: its layout; kv: bytes per cached key and value value; n_batch: the logical batch
    taken layer first (0: u-batch by u-batch); per_expert: whether a layer's experts may be split between the GPU and
    RAM (types the GPU reads for a token in place: capabilities.gpu_holds); routing: the counts of `ferry calibrate
    --routing` for this file (routing.load); expands, expanded: the layers whose experts stream as copied, and those
    of them that prompts expand to bfloat16 (placement.expanding_layers, expanded_layers); n_logits: the rows of
    logits a u-batch computes (RunConfig.logit_rows; None: every row); n_seq: the sequences a state is kept for.
    A FerryError where not even the non-expert weights, the KV cache for --fit-ctx and the buffers fit."""
    room = {gpu: available - margin}
    if room[gpu] <= 0:
        raise FerryError(f"--fit: {gpu} has {available / GIB:.2f} GiB free, no more than the --fit-target margin "
                         f"of {margin >> 20} MiB; lower --fit-target or place by hand (-ngl N, --fit off)")
    moe = sorted({int(m.group(1)) for name in tensors if (m := EXPERTS_RE.match(name))})

    def plan(ngl: int, rules: tuple[str, ...], ctx: int, resident=None) -> MemoryPlan:
        return memory_plan(tensors, args, ngl, parse_overrides(list(rules)), [gpu], room, ctx, n_ubatch, kv,
                           advise=False, kv_on_gpu=ngl > 0, cache=cache, n_batch=n_batch if moe else 0,
                           resident=resident, expands=expands, n_logits=n_logits, expanded=expanded, n_seq=n_seq)

    def fits(ngl: int, rules: tuple[str, ...], ctx: int, resident=None) -> bool:
        return all(d.over == 0 for d in plan(ngl, rules, ctx, resident).devices if d.device != "CPU")

    base = (999, _expert_rules([], gpu)) if moe else (args.n_layer + 1, ())
    ctx = _largest(lambda c: fits(*base, c), ctx_floor, n_ctx) if n_ctx > ctx_floor else \
        (n_ctx if fits(*base, n_ctx) else None)
    notes = []
    if moe:
        if ctx is None:
            d = next(d for d in plan(*base, min(n_ctx, ctx_floor)).devices if d.device != "CPU")
            raise FerryError(f"--fit: {gpu}'s {room[gpu] / GIB:.2f} GiB (less the --fit-target margin) hold no run "
                             f"with the routed experts in RAM: the other weights take {d.weights / GIB:.2f} GiB, the KV "
                             f"cache for -c {min(n_ctx, ctx_floor)} {d.kv_cache / GIB:.2f}, the buffers "
                             f"{d.compute / GIB:.2f}; lower -ub / -b or --fit-ctx, use -ctk/-ctv q8_0, or place by hand "
                             "(--fit off, -ngl N)")
        n_expert = args.n_expert
        counts = _counts(routing, len(moe), n_expert)
        if fits(999, _expert_rules(moe, gpu), ctx):
            chosen, resident = moe, {}
        else:
            k = _largest(lambda k: fits(999, _expert_rules(spread(moe, k), gpu), ctx), 0, len(moe))
            chosen, resident = spread(moe, k), {}
            rest = [layer for layer in moe if layer not in chosen]
            if per_expert and rest:  # the room left: as many experts of one more layer as it holds
                one = rest[len(rest) // 2]
                m = _largest(lambda m: fits(999, _expert_rules(chosen, gpu), ctx, {one: tuple(range(m))}), 0,
                             n_expert - 1)
                resident = {one: tuple(range(m))} if m else {}
            if per_expert and counts is not None:
                most = _most_used(counts, moe, n_expert, lambda c, r: fits(999, _expert_rules(c, gpu), ctx, r))
                gain = _share(counts, moe, *most) - _share(counts, moe, chosen, resident)
                if gain >= PER_EXPERT_GAIN:
                    chosen, resident = most
                else:
                    notes.append(f"the routing counted puts {100 * gain:.0f} points more of the routed pairs on the "
                                 f"GPU expert by expert than layer by layer, under {100 * PER_EXPERT_GAIN:.0f}: whole "
                                 "layers, which need no step on the host")
        result = Fit(999, _expert_rules(chosen, gpu), ctx, tuple(chosen), len(moe),
                     plan(999, _expert_rules(chosen, gpu), ctx, resident), margin, notes, resident, n_expert)
        result.layer_share = {layer: len(ids) / n_expert for layer, ids in resident.items()}
        if counts is not None:
            result.counted_share = _share(counts, moe, chosen, resident)
            for layer, ids in resident.items():
                row = counts[moe.index(layer)]
                result.layer_share[layer] = float(row[list(ids)].sum() / max(row.sum(), 1))
            held = _counts(routing, len(moe), n_expert, "held_counts")
            if held is not None:
                result.held_out_share = _share(held, moe, chosen, resident)
    else:
        ngl = args.n_layer + 1
        if ctx is None:  # not every layer: the most that fit with -c at least the floor
            ctx = min(n_ctx, ctx_floor)
            ngl = _largest(lambda n: fits(n, (), ctx), 0, args.n_layer + 1)
        result = Fit(ngl, (), ctx, (), 0, plan(ngl, (), ctx), margin, notes)
    if ctx < n_ctx:
        notes.append(f"-c {n_ctx} does not fit on {gpu} beside the weights: -c {ctx} (the most that fits; --fit-ctx "
                     f"{ctx_floor} is the floor, --fit off keeps -c as given)")
    return result


def _counts(routing: dict | None, n_layers: int, n_expert: int, key: str = "counts") -> np.ndarray | None:
    """The routing statistics' (MoE layer, expert) counts where they match this model's shape."""
    if not routing or key not in routing:
        return None
    counts = np.asarray(routing[key], dtype=np.float64)
    return counts if counts.shape == (n_layers, n_expert) and counts.sum() > 0 else None


def _most_used(counts: np.ndarray, moe: list[int], n_expert: int, fits) -> tuple[list[int], dict]:
    """The most counted (layer, expert) pairs that fit: (layers placed whole, {layer: its experts on the GPU})."""
    flat = np.argsort(-counts, axis=None, kind="stable")

    def layout(m: int) -> tuple[list[int], dict]:
        per: dict[int, list[int]] = {}
        for i in flat[:m].tolist():
            per.setdefault(moe[i // n_expert], []).append(i % n_expert)
        whole = sorted(layer for layer, ids in per.items() if len(ids) == n_expert)
        return whole, {layer: tuple(sorted(ids)) for layer, ids in sorted(per.items()) if len(ids) < n_expert}

    m = _largest(lambda m: fits(*layout(m)), 0, flat.size) or 0
    return layout(m)


def _share(counts: np.ndarray, moe: list[int], whole: list[int], resident: dict) -> float:
    """The share of the counted pairs whose expert is on the GPU."""
    on = np.zeros(counts.shape, dtype=bool)
    for i, layer in enumerate(moe):
        if layer in whole:
            on[i] = True
        for e in resident.get(layer, ()):
            on[i, e] = True
    return float(counts[on].sum() / counts.sum())


def _largest(ok, low: int, high: int) -> int | None:
    """The largest n in [low, high] with ok(n), for ok true up to some n and false above it; None where ok(low) is
    false."""
    if not ok(low):
        return None
    while low < high:
        mid = (low + high + 1) // 2
        if ok(mid):
            low = mid
        else:
            high = mid - 1
    return low


def gpu_room(caps: dict[str, int], planning: bool = False) -> dict[str, int]:
    """Free bytes per GPU (CUDA0, ...) as torch sees them, each at most its --gpu-memory size (`caps`); planning: a
    --gpu-memory size counts where no such GPU is visible too (`ferry plan` for another machine)."""
    import torch

    room = {}
    try:
        for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
            room[f"CUDA{i}"] = torch.cuda.mem_get_info(i)[0]
    except RuntimeError:  # a CUDA that cannot answer: no GPU to place on
        room = {}
    for device, cap in caps.items():
        if device in room or planning:
            room[device] = min(room.get(device, cap), cap)
    return room


def placed(cfg, f, args, cache, room: dict[str, int]):
    """(cfg with its placement decided, the Fit or None): cfg (a RunConfig) as given where it has -ngl / -ot; the fit's
    -ngl / -ot / --gpu-experts / -c where it has none, --fit is on and `room` holds a GPU; else on the CPU. f: the GGUF
    file; args: its ModelArgs; cache: the model's cache layout. The routing counted for this file (`ferry calibrate
    --routing`), where there is some, orders the experts."""
    from ferry.kernels.capabilities import gpu_holds, gpu_nbytes
    from ferry.offload import routing

    if cfg.placed_by_hand or not cfg.fit or "CUDA0" not in room:
        return cfg.with_(n_gpu_layers=cfg.n_gpu_layers or 0), None
    n_ctx = cfg.n_ctx if cfg.n_ctx > 0 else args.n_ctx_train
    expert_types = {t.qtype for t in f.tensors.values() if EXPERTS_RE.match(t.name)}
    biased = any(t.name.endswith("_exps.bias") for t in f.tensors.values())
    per_expert = bool(expert_types) and gpu_holds(expert_types, biased)
    result = fit({t.name: gpu_nbytes(t) for t in f.tensors.values()}, args, cache, kv_bytes(cfg.type_k, cfg.type_v),
                 "CUDA0", room["CUDA0"], n_ctx, cfg.n_ubatch, cfg.n_batch if cfg.layer_first else 0,
                 cfg.fit_target[0] << 20, cfg.fit_ctx, per_expert=per_expert,
                 routing=routing.load(f.path) if expert_types else None, expands=expanding_layers(f.tensors.values()),
                 n_logits=cfg.logit_rows, expanded=expanded_layers(f.tensors.values()), n_seq=cfg.n_seq)
    return cfg.with_(n_gpu_layers=result.n_gpu_layers, override_tensor=result.override_tensor,
                     gpu_experts=format_gpu_experts(result.resident) or None, n_ctx=result.n_ctx), result
