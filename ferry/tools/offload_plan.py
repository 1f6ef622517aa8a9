"""`ferry plan`'s op view: for one layer whose weights stay in RAM, where each op on them runs at each u-batch size
and why: the policy's predicted CPU and GPU times from this machine's calibration. A run's `auto` also measures the
plausible ways on its first u-batches of each size (`--verbose` prints what it measured and chose)."""

from __future__ import annotations

from ferry.gguf.file import GGUFFile
from ferry.placement import EXPERTS_RE, layer_devices, place
from ferry.policy import Calibration, Policy, decide, experts_hit, split_experts
from ferry.quant import bytes_per_weight


def op_plan(f: GGUFFile, args, n_gpu_layers: int, overrides, calib: Calibration, policy: Policy,
            ubatches: list[int]) -> list[dict]:
    """Rows (one per op of the first layer with weights in RAM, per u-batch size); [] when every weight of every
    layer is on the GPU."""
    layers = layer_devices(args.n_layer, n_gpu_layers, ["CUDA0"])
    in_ram = [t for t in f.tensors.values() if t.name.startswith("blk.") and len(t.ne) >= 2
              and place(t.name, args.n_layer, n_gpu_layers, overrides, layers) == "CPU"]
    if not in_ram:
        return []
    layer = min(int(t.name.split(".")[1]) for t in in_ram)
    mine = [t for t in in_ram if t.name.startswith(f"blk.{layer}.")]
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
            n_expert, k = args.n_expert, args.n_expert_used
            hit = max(1, round(experts_hit(n, n_expert, k)))
            per = n * k // hit  # expected tokens per expert hit, routing spread evenly
            counts = [per] * hit + [0] * (n_expert - hit)
            expert_bytes = sum(t.nbytes for t in experts) / n_expert
            flops = 2.0 * sum(t.ne[0] * t.ne[1] for t in experts)
            by_role = {EXPERTS_RE.match(t.name).group(2): t.nbytes for t in experts}
            share = 1.0 - by_role["down"] / sum(by_role.values())  # gate and up's part
            s = split_experts(counts, expert_bytes, flops, calib, policy, k, share)
            where = (f"{s.halves} on the GPU, {s.cpu_half} on the CPU, of {hit} hit"
                     if s.halves else f"GPU {len(s.gpu)} / CPU {len(s.cpu)} of {hit} hit")
            rows.append({"layer": layer, "op": "mul_mat_id", "tensor": f"blk.{layer}.ffn_*_exps",
                         "n_ubatch": n, "where": where,
                         "cpu_ms": 1e3 * s.cpu_s, "gpu_ms": 1e3 * s.gpu_s, "why": s.why})
    return rows


def render(rows: list[dict]) -> str:
    lines = ["| layer | op | weights | u-batch | where | predicted CPU ms | predicted GPU ms | why |",
             "| ---: | --- | --- | ---: | --- | ---: | ---: | --- |"]
    for r in rows:
        lines.append(f"| {r['layer']} | {r['op']} | {r['tensor']} | {r['n_ubatch']} | {r['where']} | {r['cpu_ms']:.3f} | "
                     f"{r['gpu_ms']:.3f} | {r['why']} |")
    return "\n".join(lines)
