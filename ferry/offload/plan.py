"""`ferry plan`'s op view: for one layer whose weights stay in RAM, where each op on them runs at each u-batch size
and why: the policy's predicted CPU and GPU times from this machine's calibration. A run's `auto` also measures the
plausible ways on its first u-batches of each size (`--verbose` prints what it measured and chose)."""

from __future__ import annotations

from dataclasses import replace

from ferry.gguf.file import GGUFFile
from ferry.kernels.cpu import native
from ferry.placement import EXPERTS_RE, layer_devices, place
from ferry.offload.cost import Calibration, experts_hit, type_shares
from ferry.offload.policy import Policy, decide, split_experts
from ferry.quant import bytes_per_weight


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
            d = decide("mul_mat", n, t.ne[1], t.ne[0], bytes_per_weight(t.qtype), calib, policy)
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
    n_expert, k = args.n_expert, args.n_expert_used
    hit = max(1, round(experts_hit(n, n_expert, k)))
    per = n * k // hit  # expected tokens per expert hit, routing spread evenly
    counts = [per] * hit + [0] * (n_expert - hit)
    expert_bytes = sum(t.nbytes for t in experts) / n_expert
    flops = 2.0 * sum(t.ne[0] * t.ne[1] for t in experts)
    by_role = {EXPERTS_RE.match(t.name).group(2): t.nbytes for t in experts}
    share = 1.0 - by_role["down"] / sum(by_role.values())  # gate and up's part
    types = type_shares([(t.qtype.name, t.nbytes) for t in experts])
    token_kernel = all(native.runs_experts(q) for q in types)  # at one token, where it covers the experts' types
    from ferry.kernels.cuda.dequant import SUPPORTED  # what the GPU reads or expands once streamed (needs no GPU)

    kept = sorted({t.qtype.name for t in experts if t.qtype not in SUPPORTED})
    if kept:  # as the run keeps them (HybridBackend._streams), whatever the policy
        s = split_experts(counts, expert_bytes, flops, calib, Policy(overrides={"all": "off"}), k, share, types,
                          token_kernel)
        return replace(s, why=f"experts of {', '.join(kept)}, which no GPU kernel of ferry's reads or expands: on the "
                              "CPU under every policy"), hit
    return split_experts(counts, expert_bytes, flops, calib, policy, k, share, types, token_kernel), hit


_HALF = {"gate": "up_gate", "up": "up_gate", "down": "down"}


def generation_floor(f: GGUFFile, args, n_gpu_layers: int, overrides, calib: Calibration,
                     policy: Policy) -> dict | None:
    """What the weights left in RAM cost each generated token, as the policy places one token's ops (a dense weight
    read whole, n_expert_used of each MoE layer's experts): the predicted seconds and the bytes the CPU reads per token.
    Each layer waits for its RAM-side work, so no GPU work hides it: a floor under a token's time. None when every
    weight is on the GPU."""
    by_layer = _in_ram_by_layer(f, args, n_gpu_layers, overrides)
    if not by_layer:
        return None
    seconds = cpu_bytes = 0.0
    expert_types = []  # each MoE layer's
    for mine in by_layer.values():
        experts = [t for t in mine if EXPERTS_RE.match(t.name)]
        if experts:
            expert_types.append({t.qtype.name for t in experts})
        for t in (t for t in mine if not EXPERTS_RE.match(t.name)):  # the dense weights
            d = decide("mul_mat", 1, t.ne[1], t.ne[0], bytes_per_weight(t.qtype), calib, policy)
            seconds += d.cpu_s if d.device == "CPU" else d.gpu_s
            cpu_bytes += t.nbytes if d.device == "CPU" else 0
        if len(experts) == 3:
            s, _ = _experts_split(experts, args, calib, policy, 1)
            seconds += s.predicted_s
            # the CPU's experts whole, or (halves apart) its half of every expert hit
            read = [t for t in experts if not s.halves or _HALF[EXPERTS_RE.match(t.name).group(2)] == s.cpu_half]
            cpu_bytes += len(s.cpu) * sum(t.nbytes for t in read) / args.n_expert
    return {"seconds_per_token": seconds, "cpu_bytes_per_token": cpu_bytes, "layers": len(by_layer),
            "max_tokens_per_s": 1.0 / seconds if seconds else float("inf"),
            "experts_kernel": native.experts_kernel(expert_types) if expert_types else None,
            "expert_types": sorted(set().union(*expert_types))}


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
