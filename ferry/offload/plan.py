"""`ferry plan`: the memory per device before anything is loaded (placement.memory_plan), and, for one layer whose
weights stay in RAM, where each op on them runs at each u-batch size and why: the policy's predicted CPU and GPU times
from this machine's calibration, through the same descriptions of the work the run decides with (offload/work.py). A
run's `auto` also measures the plausible ways on its first u-batches of each size (`--verbose` prints them)."""

from __future__ import annotations

import json
from pathlib import Path

from ferry.errors import FerryError
from ferry.gguf.file import GGUFFile
from ferry.kernels.capabilities import CPU_AMX_TYPES, cpu_native_types, gpu_nbytes
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
            s, hit, _ = _experts_split(experts, args, calib, policy, n)
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
    """(the policy's split of one MoE layer's experts for a u-batch of n tokens routed evenly, the experts hit, the
    layer's ExpertsWork)."""
    roles = {EXPERTS_RE.match(t.name).group(2): t for t in experts}
    work = ExpertsWork.of(roles["gate"], roles["up"], roles["down"], args.n_expert_used)
    counts, hit = work.even_counts(n)
    return work.split(counts, calib, policy), hit, work


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
            s, _, _ = _experts_split(experts, args, calib, policy, 1)
            seconds += s.predicted_s * kept
            # the CPU's experts whole, or (halves apart) its half of every expert hit
            read = [t for t in experts if not s.halves or _HALF[EXPERTS_RE.match(t.name).group(2)] == s.cpu_half]
            cpu_bytes += kept * len(s.cpu) * sum(t.nbytes for t in read) / args.n_expert
    return {"seconds_per_token": seconds, "cpu_bytes_per_token": cpu_bytes, "layers": len(by_layer),
            "max_tokens_per_s": 1.0 / seconds if seconds else float("inf"),
            "experts_kernel": experts_kernel(expert_types) if expert_types else None,
            "expert_types": sorted(set().union(*expert_types))}


# kernels a decode step runs per layer on the GPU (norms, the attention's projections, rope and cache store, the
# attention and its combine, the router and its top-k, the experts' two GEMVs and their sum): a decode step at these
# sizes is that many small kernels' latency more than its bytes (the 30B all on an H100: 2.8 ms a token for 1.7 GB)
DECODE_KERNELS_PER_LAYER = 13


def forecast(f: GGUFFile, args, n_gpu_layers: int, overrides, calib: Calibration, policy: Policy,
             layer_share: dict[int, float], n_ubatch: int, floor: dict | None) -> dict | None:
    """The predicted tg (one token, at a short context) and pp (u-batches of n_ubatch tokens) of a placement on one
    GPU, from the calibration's measured parts (measure_steps), each part kept: a decode step is the GPU's kernels
    (DECODE_KERNELS_PER_LAYER small ones a layer, plus the bytes of the weights it reads), then, serialized with them,
    the RAM side's work (generation_floor) and a handshake per layer with work in RAM; a u-batch is the GPU's
    quantized matmuls at the grouped GEMM's rate and the attention at the bf16 rate, plus the RAM side's ops as the
    policy places them (on the CPU, or copied and run on the GPU), or its copies over PCIe where they take longer (they
    overlap the compute: the hybrid copies a layer's experts while the GPU works before it). layer_share: per layer, the share of its routed pairs whose experts
    are kept on the GPU beyond whole layers (--gpu-experts). None where the calibration lacks the parts."""
    if not calib.forecasts:
        return None
    layers = layer_devices(args.n_layer, n_gpu_layers, ["CUDA0"])
    k_over_e = args.n_expert_used / args.n_expert if args.n_expert else 0.0
    gpu_bytes = gpu_qflops = 0.0  # per token
    in_ram_embd = False
    for t in f.tensors.values():
        if len(t.ne) < 2:
            continue
        on_gpu = place(t.name, args.n_layer, n_gpu_layers, overrides, layers) != "CPU"
        if t.name.startswith("token_embd"):
            in_ram_embd = in_ram_embd or not on_gpu  # a row looked up, not multiplied
            continue
        m = EXPERTS_RE.match(t.name)
        share = 1.0 if on_gpu else layer_share.get(int(t.name.split(".")[1]), 0.0) if m else 0.0
        per_token = k_over_e if m else 1.0
        gpu_bytes += share * per_token * t.nbytes
        gpu_qflops += share * per_token * 2.0 * t.ne[0] * t.ne[1] * (t.ne[2] if m and len(t.ne) > 2 else 1)
    host_steps = (floor["layers"] if floor else 0) + in_ram_embd
    gpu_tg = args.n_layer * DECODE_KERNELS_PER_LAYER * calib.graph_kernel_s + gpu_bytes / calib.gpu_gemv_bytes_per_s
    ram_tg = floor["seconds_per_token"] if floor else 0.0
    tg_s = gpu_tg + ram_tg + host_steps * calib.handshake_s
    n = n_ubatch
    attn_flops = args.n_layer * 2.0 * n * n * args.n_head * (args.head_dim_k + args.head_dim_v) / 2  # causal
    gpu_pp = n * gpu_qflops / calib.gpu_moe_flops + attn_flops / calib.gpu_flops
    ram_pp = copies = 0.0  # the RAM side's compute (either side's), and its copies over PCIe
    for layer, mine in _in_ram_by_layer(f, args, n_gpu_layers, overrides).items():
        experts = [t for t in mine if EXPERTS_RE.match(t.name)]
        for t in (t for t in mine if t not in experts):
            d = dense_decision(t, n, calib, policy)
            ram_pp += d.cpu_s if d.device == "CPU" else d.gpu_s
        if len(experts) == 3:
            s, _, work = _experts_split(experts, args, calib, policy, n)
            kept = 1.0 - layer_share.get(layer, 0.0)
            # the policy's GPU side pays a copy's latency per expert; the streamer copies runs of them, one per tensor
            on_gpu = max(s.gpu_s - len(s.gpu) * (calib.h2d_latency_s + work.expert_bytes / calib.h2d_bytes_per_s), 0.0)
            copy = (3 * calib.h2d_latency_s + len(s.gpu) * work.expert_bytes / calib.h2d_bytes_per_s) if s.gpu else 0.0
            ram_pp += kept * (on_gpu + s.cpu_s if s.halves else max(on_gpu, s.cpu_s))
            copies += kept * copy
    # the copies run on their own stream, each layer's while the GPU works on the layers before it (the hybrid
    # prefetches the next layer in RAM): a u-batch takes the longer of all its copies and all the compute
    pp_s = max(copies, gpu_pp + ram_pp)
    return {"tg_per_s": 1.0 / tg_s, "pp_per_s": n / pp_s, "n_ubatch": n,
            "tg_ms": {"gpu": 1e3 * gpu_tg, "ram": 1e3 * ram_tg, "handshakes": 1e3 * host_steps * calib.handshake_s},
            "pp_ms": {"gpu": 1e3 * gpu_pp, "ram": 1e3 * ram_pp, "copies": 1e3 * copies}, "host_steps": host_steps}


def describe_forecast(fc: dict) -> str:
    t, p = fc["tg_ms"], fc["pp_ms"]
    return (f"forecast: tg {fc['tg_per_s']:.1f} t/s (a token: GPU {t['gpu']:.2f} ms, weights in RAM {t['ram']:.2f} ms, "
            f"{fc['host_steps']} handshakes {t['handshakes']:.2f} ms), pp {fc['pp_per_s']:.0f} t/s at u-batches of "
            f"{fc['n_ubatch']} (a u-batch: the longer of its compute, GPU {p['gpu']:.1f} ms and the weights in RAM "
            f"{p['ram']:.1f} ms, and its copies {p['copies']:.1f} ms); from this machine's calibration, at a short "
            "context")


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
    own = ("ferry's own kernel (ferry/kernels/cpu/moe_experts.c; ggml's with FERRY_NATIVE=0, or --no-repack but for Q5_K, "
           "Q6_K, IQ4_XS and MXFP4)")
    tiled = sorted({q.name for q in CPU_AMX_TYPES} & types & set().union(*layers))
    if native.amx() and tiled:
        own += (f"; {', '.join(tiled)} experts with 12 tokens of a u-batch or more on AMX-INT8 tiles (FERRY_AMX=0: "
                "AVX512-VNNI)")
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
    from ferry.placement import (GIB, expanded_layers, expanding_layers, format_gpu_experts, host_memory, kv_bytes,
                                 memory_plan, tensor_split)

    f = GGUFFile(cfg.model_path, ik_in_place=native.ik_in_place())
    margs = ModelArgs.from_gguf(f)
    mla = mla_mode(margs, cfg.mla)
    cache = cache_layout(margs, mla, cfg.swa_full)
    available = gpu_room(cfg.gpu_caps, planning=True)
    gpus = sorted(available) or ["CUDA0"]
    cfg, fitted = placed(cfg, f, margs, cache, available)
    ram = host_memory()
    if ram is not None:
        available["CPU"] = ram
    split = tensor_split(cfg.tensor_split, gpus)
    # one GPU: the runtime keeps every layer's KV cache and the expert staging there (several GPUs: planned only)
    kv_on_gpu = len(gpus) == 1 and cfg.wants_gpu
    per_token, cache_note = describe_cache(margs, mla, cfg.type_k, cfg.type_v, cfg.swa_full)
    n_ctx = cfg.n_ctx if cfg.n_ctx > 0 else margs.n_ctx_train
    plan = memory_plan({t.name: gpu_nbytes(t) for t in f.tensors.values()}, margs, cfg.n_gpu_layers, cfg.overrides,
                       gpus, available, n_ctx, cfg.n_ubatch, kv_bytes(cfg.type_k, cfg.type_v), split,
                       kv_on_gpu=kv_on_gpu,
                       cache=cache, n_batch=cfg.n_batch if cfg.layer_first else 0, resident=cfg.resident,
                       expands=expanding_layers(f.tensors.values()), n_logits=cfg.logit_rows,
                       expanded=expanded_layers(f.tensors.values()), n_seq=cfg.n_seq)
    ops, ops_note, floor, fc = (_op_view(f, margs, cfg, ubatches, calibration, fitted) if kv_on_gpu
                                else ([], "", None, None))
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
                          "generation": floor, "forecast": fc}, indent=1))
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
             fitted=None) -> tuple[list[dict], str, dict | None, dict | None]:
    """Where the ops on weights left in RAM run per u-batch (plan's second table), from a calibration with a GPU,
    what those weights cost each generated token (generation_floor), and the placement's forecast tg and pp."""
    from ferry.offload import calibrate

    path = Path(calibration) if calibration else calibrate.default_path()
    if not path.exists():
        return [], (f"no calibration at {path}: run `ferry calibrate` on the GPU machine (or pass --calibration FILE) "
                    "to see where each op runs"), None, None
    calib = calibrate.load(path)
    if calib is None:
        return [], f"{path} was measured without a GPU: nothing to offload to", None, None
    policy = cfg.policy
    rows = op_plan(f, margs, cfg.n_gpu_layers, cfg.overrides, calib, policy, ubatches or [1, cfg.n_ubatch])
    shares = fitted.layer_share if fitted is not None else {
        layer: len(ids) / max(margs.n_expert, 1) for layer, ids in cfg.resident.items()}
    floor = generation_floor(f, margs, cfg.n_gpu_layers, cfg.overrides, calib, policy, shares)
    fc = forecast(f, margs, cfg.n_gpu_layers, cfg.overrides, calib, policy, shares, cfg.n_ubatch, floor)
    note = ("auto predicts here; a run also times the plausible ways on its first u-batches of each size and keeps "
            "the fastest (--verbose prints them)") if rows and policy.mode == "auto" else ""
    if rows and cfg.layer_first and margs.n_expert:
        note += ("; " if note else "") + (f"layer first, a MoE layer's routed experts run once per logical batch: "
                                          f"up to -b {cfg.n_batch} tokens, not -ub")
    lines = [describe_floor(floor), unmeasured(floor, calib)] if floor is not None else []
    if not rows:
        lines.insert(0, "every matmul weight is on the GPU: nothing to decide")
    lines.append(describe_forecast(fc) if fc else "no forecast of tg and pp: the calibration predates the parts it "
                 "is made of; run `ferry calibrate` again on this machine")
    for line in lines:
        note += ("\n" if note and line else "") + line
    return rows, note, floor, fc
