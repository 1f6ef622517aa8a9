"""`ferry plan`: the memory per device before anything is loaded (placement.memory_plan), and, for one layer whose
weights stay in RAM, where each op on them runs at each u-batch size and why: the policy's predicted CPU and GPU times
from this machine's calibration, through the same descriptions of the work the run decides with (offload/work.py). A
run's `auto` also measures the plausible ways on its first u-batches of each size (`--verbose` prints them)."""

from __future__ import annotations

import json
from pathlib import Path

from ferry.errors import FerryError
from ferry.gguf.file import GGUFFile
from ferry.kernels.capabilities import cpu_native_types
from ferry.kernels.cpu import native
from ferry.offload.cost import Calibration
from ferry.offload.policy import Policy
from ferry.offload.work import ExpertsWork, dense_decision
from ferry.placement import EXPERTS_RE, layer_devices, place


def op_plan(f: GGUFFile, args, n_gpu_layers: int, overrides, calib: Calibration, policy: Policy,
            ubatches: list[int]) -> list[dict]:
    """Rows (one per op of the first layer with weights in RAM, per u-batch size); [] when every weight of every
    layer is on the GPU."""
    in_ram = _in_ram_by_layer(f, args, n_gpu_layers, overrides)
    if not in_ram:
        return []
    layer = min(in_ram)
    mine = in_ram[layer]
    experts = [t for t in mine if EXPERTS_RE.match(t.name)]
    rows = []
    for n in ubatches:
        for t in mine:
            if t in experts:
                continue
            d = dense_decision(t, n, calib, policy)
            rows.append({"layer": layer, "op": "mul_mat", "tensor": t.name, "n_ubatch": n, "where": d.device,
                         "cpu_ms": 1e3 * d.cpu_s, "gpu_ms": 1e3 * d.gpu_s, "why": d.why})
        if len(experts) == 3:
            s, hit = _experts_split(experts, args, calib, policy, n)
            where = (f"{s.halves} on the GPU, {s.cpu_half} on the CPU, of {hit} hit"
                     if s.halves else f"GPU {len(s.gpu)} / CPU {len(s.cpu)} of {hit} hit")
            rows.append({"layer": layer, "op": "mul_mat_id", "tensor": f"blk.{layer}.ffn_*_exps",
                         "n_ubatch": n, "where": where,
                         "cpu_ms": 1e3 * s.cpu_s, "gpu_ms": 1e3 * s.gpu_s, "why": s.why})
    return rows


def _in_ram_by_layer(f: GGUFFile, args, n_gpu_layers: int, overrides) -> dict[int, list]:
    """The matmul weights -ngl / -ot leave in RAM, by layer."""
    layers = layer_devices(args.n_layer, n_gpu_layers, ["CUDA0"])
    by_layer: dict[int, list] = {}
    for t in f.tensors.values():
        if (t.name.startswith("blk.") and len(t.ne) >= 2
                and place(t.name, args.n_layer, n_gpu_layers, overrides, layers) == "CPU"):
            by_layer.setdefault(int(t.name.split(".")[1]), []).append(t)
    return by_layer


def _experts_split(experts: list, args, calib: Calibration, policy: Policy, n: int):
    """(the policy's split of one MoE layer's experts for a u-batch of n tokens routed evenly, the experts hit)."""
    roles = {EXPERTS_RE.match(t.name).group(2): t for t in experts}
    work = ExpertsWork.of(roles["gate"], roles["up"], roles["down"], args.n_expert_used)
    counts, hit = work.even_counts(n)
    return work.split(counts, calib, policy), hit


_HALF = {"gate": "up_gate", "up": "up_gate", "down": "down"}


def generation_floor(f: GGUFFile, args, n_gpu_layers: int, overrides, calib: Calibration,
                     policy: Policy, resident_share: dict[int, float] | None = None) -> dict | None:
    """What the weights left in RAM cost each generated token, as the policy places one token's ops (a dense weight
    read whole, n_expert_used of each MoE layer's experts): the predicted seconds and the bytes the CPU reads per token.
    Each layer waits for its RAM-side work, so no GPU work hides it: a floor under a token's time. resident_share: per
    layer, the share of its routed pairs whose experts are kept on the GPU (--gpu-experts), taken off its experts'
    cost. None when every weight is on the GPU."""
    by_layer = _in_ram_by_layer(f, args, n_gpu_layers, overrides)
    if not by_layer:
        return None
    seconds = cpu_bytes = 0.0
    expert_types = []  # each MoE layer's
    for layer, mine in by_layer.items():
        experts = [t for t in mine if EXPERTS_RE.match(t.name)]
        kept = 1.0 - (resident_share or {}).get(layer, 0.0)
        if experts:
            expert_types.append({t.qtype.name for t in experts})
        for t in (t for t in mine if not EXPERTS_RE.match(t.name)):  # the dense weights
            d = dense_decision(t, 1, calib, policy)
            seconds += d.cpu_s if d.device == "CPU" else d.gpu_s
            cpu_bytes += t.nbytes if d.device == "CPU" else 0
        if len(experts) == 3:
            s, _ = _experts_split(experts, args, calib, policy, 1)
            seconds += s.predicted_s * kept
            # the CPU's experts whole, or (halves apart) its half of every expert hit
            read = [t for t in experts if not s.halves or _HALF[EXPERTS_RE.match(t.name).group(2)] == s.cpu_half]
            cpu_bytes += kept * len(s.cpu) * sum(t.nbytes for t in read) / args.n_expert
    return {"seconds_per_token": seconds, "cpu_bytes_per_token": cpu_bytes, "layers": len(by_layer),
            "max_tokens_per_s": 1.0 / seconds if seconds else float("inf"),
            "experts_kernel": experts_kernel(expert_types) if expert_types else None,
            "expert_types": sorted(set().union(*expert_types))}


def experts_kernel(layers: list[set[str]]) -> str:
    """Which kernel the CPU runs one token's routed experts with, given each MoE layer's expert quant types, and why
    (`ferry plan`): a file with Q8_0 experts in some layers runs those on ggml's beside its others on ferry's."""
    types = {q.name for q in cpu_native_types()}
    other = [t for t in layers if not t <= types]
    covers = f"ferry's own covers {', '.join(sorted(types))} experts"
    if len(other) == len(layers):
        return f"ggml's kernel ({covers}; these are {', '.join(sorted(set().union(*other)))})"
    if native.library() is None:
        return f"ggml's kernel ({native.why_not()})"
    own = "ferry's own kernel (ferry/kernels/cpu/moe_experts.c; ggml's with FERRY_NATIVE=0, or --no-repack but for Q5_K, Q6_K and IQ4_XS)"
    if not other:
        return own
    return (f"{own} in {len(layers) - len(other)} of {len(layers)} layers, ggml's in the others ({covers}; theirs "
            f"are {', '.join(sorted(set().union(*other)))})")


def unmeasured(g: dict, calib: Calibration) -> str:
    """What plan says where the calibration has not measured the routed experts' types in RAM ("" where it has)."""
    missing = [q for q in g["expert_types"] if q not in calib.cpu_moe]
    if not missing:
        return ""
    rate = "Q4_0's rate per byte" if "Q4_0" in calib.cpu_moe else "its GEMV and matmul rates"
    return (f"the calibration has not measured routed experts of {', '.join(missing)}: their CPU times here are at "
            f"{rate} (a run measures them once; `ferry calibrate` measures the common types)")


def describe_floor(g: dict) -> str:
    return (f"generation: the weights left in RAM in {g['layers']} layers cost each token "
            f"{1e3 * g['seconds_per_token']:.2f} ms as placed at one token (the CPU reads "
            f"{g['cpu_bytes_per_token'] / 1e9:.3f} GB of them per token): at most {g['max_tokens_per_s']:.1f} t/s, "
            "whatever the GPU does, as each layer waits for them"
            + (f"; one token's routed experts run on the CPU with {g['experts_kernel']}"
               if g["experts_kernel"] else ""))


def render(rows: list[dict]) -> str:
    lines = ["| layer | op | weights | u-batch | where | predicted CPU ms | predicted GPU ms | why |",
             "| ---: | --- | --- | ---: | --- | ---: | ---: | --- |"]
    for r in rows:
        lines.append(f"| {r['layer']} | {r['op']} | {r['tensor']} | {r['n_ubatch']} | {r['where']} | {r['cpu_ms']:.3f} | "
                     f"{r['gpu_ms']:.3f} | {r['why']} |")
    return "\n".join(lines)


def show(cfg, ubatches: list[int] | None, calibration: str | None, as_json: bool) -> int:
    """`ferry plan` (cfg: a RunConfig): the placement (as given, or the fit's where no -ngl / -ot is given and a GPU
    is visible or sized by --gpu-memory), the memory per device before loading anything, then where the ops on
    weights left in RAM run per u-batch and what they cost each generated token; a FerryError saying what to change
    where it does not fit."""
    from ferry.layers.cache import cache_layout, describe_cache, mla_mode
    from ferry.models.base import ModelArgs
    from ferry.offload.fit import gpu_room, placed
    from ferry.placement import GIB, format_gpu_experts, host_memory, kv_bytes, memory_plan, tensor_split

    f = GGUFFile(cfg.model_path)
    margs = ModelArgs.from_gguf(f)
    mla = mla_mode(margs, cfg.mla)
    cache = cache_layout(margs, mla)
    available = gpu_room(cfg.gpu_caps, planning=True)
    gpus = sorted(available) or ["CUDA0"]
    cfg, fitted = placed(cfg, f, margs, cache, available)
    ram = host_memory()
    if ram is not None:
        available["CPU"] = ram
    split = tensor_split(cfg.tensor_split, gpus)
    # one GPU: the runtime keeps every layer's KV cache and the expert staging there (several GPUs: planned only)
    kv_on_gpu = len(gpus) == 1 and cfg.wants_gpu
    per_token, cache_note = describe_cache(margs, mla, cfg.type_k, cfg.type_v)
    n_ctx = cfg.n_ctx if cfg.n_ctx > 0 else margs.n_ctx_train
    plan = memory_plan({t.name: t.nbytes for t in f.tensors.values()}, margs, cfg.n_gpu_layers, cfg.overrides, gpus,
                       available, n_ctx, cfg.n_ubatch, kv_bytes(cfg.type_k, cfg.type_v), split, kv_on_gpu=kv_on_gpu,
                       cache=cache, n_batch=cfg.n_batch if cfg.layer_first else 0, resident=cfg.resident)
    ops, ops_note, floor = _op_view(f, margs, cfg, ubatches, calibration, fitted) if kv_on_gpu else ([], "", None)
    fit_view = None if fitted is None else {
        "flags": fitted.flags(), "n_gpu_layers": fitted.n_gpu_layers, "override_tensor": list(fitted.override_tensor),
        "n_ctx": fitted.n_ctx, "expert_layers": list(fitted.expert_layers), "moe_layers": fitted.moe_layers,
        "gpu_experts": format_gpu_experts(fitted.resident), "experts_per_layer": fitted.experts_per_layer(),
        "n_expert": fitted.n_expert, "gpu_share": fitted.gpu_share, "gpu_share_basis": fitted.share_basis,
        "notes": fitted.notes}
    if as_json:
        print(json.dumps({"fits": plan.fits, "advice": plan.advice, "fit": fit_view,
                          "devices": [{**vars(d), "total": d.total, "over": d.over} for d in plan.devices],
                          "kv_bytes_per_token": per_token, "mla": mla, "ops": ops, "ops_note": ops_note,
                          "generation": floor}, indent=1))
    else:
        if fitted is not None:
            print("\n".join([fitted.describe(), *fitted.notes]))
            per_layer = fitted.experts_per_layer()
            if per_layer and fitted.n_expert:
                print("routed experts on the GPU per MoE layer (layer:count of " + f"{fitted.n_expert}): "
                      + " ".join(f"{layer}:{n}" for layer, n in per_layer.items()))
            print()
        print("| device | weights GiB | KV cache GiB | compute GiB | total GiB | available GiB |")
        print("| --- | ---: | ---: | ---: | ---: | ---: |")
        for d in plan.devices:
            avail = "?" if d.available is None else f"{d.available / GIB:.2f}"
            print(f"| {d.device} | {d.weights / GIB:.2f} | {d.kv_cache / GIB:.2f} | {d.compute / GIB:.2f} | "
                  f"{d.total / GIB:.2f} | {avail} |")
        print(cache_note)
        if ops:
            print()
            print(render(ops))
        if ops_note:
            print(ops_note)
    if not plan.fits:
        raise FerryError(plan.error())
    return 0


def _op_view(f: GGUFFile, margs, cfg, ubatches: list[int] | None, calibration: str | None,
             fitted=None) -> tuple[list[dict], str, dict | None]:
    """Where the ops on weights left in RAM run per u-batch (plan's second table), from a calibration with a GPU, and
    what those weights cost each generated token (generation_floor)."""
    from ferry.offload import calibrate

    path = Path(calibration) if calibration else calibrate.default_path()
    if not path.exists():
        return [], (f"no calibration at {path}: run `ferry calibrate` on the GPU machine (or pass --calibration FILE) "
                    "to see where each op runs"), None
    calib = calibrate.load(path)
    if calib is None:
        return [], f"{path} was measured without a GPU: nothing to offload to", None
    policy = cfg.policy
    rows = op_plan(f, margs, cfg.n_gpu_layers, cfg.overrides, calib, policy, ubatches or [1, cfg.n_ubatch])
    shares = fitted.layer_share if fitted is not None else {
        layer: len(ids) / max(margs.n_expert, 1) for layer, ids in cfg.resident.items()}
    floor = generation_floor(f, margs, cfg.n_gpu_layers, cfg.overrides, calib, policy, shares)
    note = ("auto predicts here; a run also times the plausible ways on its first u-batches of each size and keeps "
            "the fastest (--verbose prints them)") if rows and policy.mode == "auto" else ""
    if rows and cfg.layer_first and margs.n_expert:
        note += ("; " if note else "") + (f"layer first, a MoE layer's routed experts run once per logical batch: "
                                          f"up to -b {cfg.n_batch} tokens, not -ub")
    if floor is not None:
        for line in (describe_floor(floor), unmeasured(floor, calib)):
            note += ("\n" if note and line else "") + line
    return rows, note or ("" if rows else "every matmul weight is on the GPU: nothing to decide"), floor
