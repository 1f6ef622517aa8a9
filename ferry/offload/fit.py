"""The default placement where a GPU is visible and no -ngl / -ot is given (--fit, llama.cpp's name): fill the GPU,
in order, with everything but the routed experts, the KV cache for -c (shrunk to what fits, down to --fit-ctx), the
compute and staging buffers the run needs at its -b / -ub, then as many layers' routed experts as fit, spread evenly
over the layers; the rest stays in RAM. A model without routed experts gets the most layers that fit (-ngl), as
llama.cpp's fit gives. Each step asks the memory plan (placement.memory_plan), the one estimate the run checks too."""

from __future__ import annotations

from dataclasses import dataclass, field

from ferry.errors import FerryError
from ferry.placement import EXPERTS_RE, GIB, MemoryPlan, kv_bytes, memory_plan, parse_overrides

FIT_TARGET_MIB = 1024  # the margin left free on each GPU (llama.cpp's -fitt default)
FIT_CTX = 4096  # the context the fit may shrink -c to, and no lower (llama.cpp's --fit-ctx default)


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

    @property
    def gpu_share(self) -> float:
        """The share of routed (token, expert) pairs that meet their expert on the GPU, routing spread evenly."""
        return len(self.expert_layers) / self.moe_layers if self.moe_layers else 1.0

    def flags(self) -> str:
        """The placement as -ngl / -ot flags (what `--fit off` with these flags would run)."""
        return f"-ngl {self.n_gpu_layers}" + "".join(f" -ot '{r}'" for r in self.override_tensor)

    def describe(self) -> str:
        """One line for the run's report and `ferry plan`."""
        d = next((d for d in self.plan.devices if d.device != "CPU"), None)
        on_gpu = (f"{d.total / GIB:.2f} GiB on {d.device}, of {d.available / GIB:.2f} GiB its room less the "
                  f"--fit-target margin of {self.margin >> 20} MiB") if d and d.available is not None else ""
        if not self.moe_layers:
            return f"fit: {self.n_gpu_layers} layers on the GPU ({on_gpu}), -c {self.n_ctx}"
        return (f"fit: every weight but the routed experts on the GPU, and the routed experts of "
                f"{len(self.expert_layers)} of {self.moe_layers} layers ({100 * self.gpu_share:.0f}% of the routed "
                f"pairs, routing spread evenly); {on_gpu}, -c {self.n_ctx} ({self.flags()})")


def spread(layers: list[int], k: int) -> list[int]:
    """k of `layers` spread evenly over them (the middle of each of k equal stretches)."""
    n = len(layers)
    return [layers[int((i + 0.5) * n / k)] for i in range(k)] if k else []


def _expert_rules(chosen: list[int], gpu: str) -> tuple[str, ...]:
    rules = (rf"blk\.({'|'.join(map(str, chosen))})\.ffn_(gate|up|down)_exps={gpu}",) if chosen else ()
    return rules + ("exps=CPU",)


def fit(tensors: dict[str, int], args, cache, kv: tuple[float, float], gpu: str, available: int, n_ctx: int,
        n_ubatch: int, n_batch: int = 0, margin: int = FIT_TARGET_MIB << 20, ctx_floor: int = FIT_CTX) -> Fit:
    """The placement for one GPU of `available` bytes, `margin` of them left free. tensors: name -> bytes (the
    file's); args: ModelArgs; cache: its layout; kv: bytes per cached key and value value; n_batch: the logical batch
    taken layer first (0: u-batch by u-batch). A FerryError where not even the non-expert weights, the KV cache for
    --fit-ctx and the buffers fit."""
    room = {gpu: available - margin}
    if room[gpu] <= 0:
        raise FerryError(f"--fit: {gpu} has {available / GIB:.2f} GiB free, no more than the --fit-target margin "
                         f"of {margin >> 20} MiB; lower --fit-target or place by hand (-ngl N, --fit off)")
    moe = sorted({int(m.group(1)) for name in tensors if (m := EXPERTS_RE.match(name))})

    def plan(ngl: int, rules: tuple[str, ...], ctx: int) -> MemoryPlan:
        return memory_plan(tensors, args, ngl, parse_overrides(list(rules)), [gpu], room, ctx, n_ubatch, kv,
                           advise=False, kv_on_gpu=ngl > 0, cache=cache, n_batch=n_batch if moe else 0)

    def fits(ngl: int, rules: tuple[str, ...], ctx: int) -> bool:
        return all(d.over == 0 for d in plan(ngl, rules, ctx).devices if d.device != "CPU")

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
        k = len(moe) if fits(999, _expert_rules(moe, gpu), ctx) else \
            _largest(lambda k: fits(999, _expert_rules(spread(moe, k), gpu), ctx), 0, len(moe))
        chosen = spread(moe, k)
        result = Fit(999, _expert_rules(chosen, gpu), ctx, tuple(chosen), len(moe),
                     plan(999, _expert_rules(chosen, gpu), ctx), margin, notes)
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
    -ngl / -ot / -c where it has none, --fit is on and `room` holds a GPU; else on the CPU. f: the GGUF file; args:
    its ModelArgs; cache: the model's cache layout."""
    if cfg.placed_by_hand or not cfg.fit or "CUDA0" not in room:
        return cfg.with_(n_gpu_layers=cfg.n_gpu_layers or 0), None
    n_ctx = cfg.n_ctx if cfg.n_ctx > 0 else args.n_ctx_train
    result = fit({t.name: t.nbytes for t in f.tensors.values()}, args, cache, kv_bytes(cfg.type_k, cfg.type_v),
                 "CUDA0", room["CUDA0"], n_ctx, cfg.n_ubatch, cfg.n_batch if cfg.layer_first else 0,
                 cfg.fit_target[0] << 20, cfg.fit_ctx)
    return cfg.with_(n_gpu_layers=result.n_gpu_layers, override_tensor=result.override_tensor,
                     n_ctx=result.n_ctx), result
