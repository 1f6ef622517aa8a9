"""The grouped MoE GEMM alone, on random Q4_0 experts with uniform random routing, at the expert shapes of the
benchmark models: one MoE layer's gate, up and down projections per u-batch (gate and up fused in one launch)
with the default tile configuration (kernels.MOE_MM_CONFIGS), and a sweep of the configurations per tile height
that chose those defaults. --kquant: the same on a Q4_K_M file's experts (gate and up Q4_K, down Q6_K) through
kquant.kmoe_mm (KMOE_MM_CONFIGS, its sweep), beside the way it replaced (each projection expanded to bfloat16, then
torch's grouped GEMM). Prints a table, writes JSON.
  python benchmarks/moe_kernels.py [-ub 32,128,512,2048] [--json out.json] [--no-sweep] [--kquant]
"""

import argparse
import itertools
import json

import numpy as np
import torch
from triton.testing import do_bench

from ferry.kernels.cuda import layout, moe
from ferry.quant import Q

SHAPES = {  # name: (n_expert, n_expert_used, n_embd, n_ff)
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "deepseek-v2-lite": (64, 6, 2048, 1408),
}
SWEEP = list(itertools.product((64, 128), (32, 64, 128), (4, 8), (3, 4)))  # BN, BK, warps, stages
KSWEEP = list(itertools.product((32, 64, 128), (4, 8), (1, 2, 3)))  # BN, warps, stages


def _experts(n_expert: int, rows: int, cols: int, dev) -> layout.Split:
    """Random Q4_0 blocks: nibbles uniform, scales around 0.01."""
    n_blocks = n_expert * rows * cols // 32
    rng = np.random.default_rng(rows * cols)
    qs = torch.from_numpy(rng.integers(0, 256, (n_blocks, 16), dtype=np.uint8)).to(dev)
    d = torch.from_numpy((rng.uniform(0.5, 1.5, n_blocks) * 0.01).astype(np.float16)).to(dev)
    return layout.Split(Q.Q4_0, (cols, rows, n_expert), qs, d)


def _batch(ub: int, n_expert: int, n_used: int, n_embd: int, n_ff: int, dev):
    """A u-batch's uniform random routing and rows: (ids, tile rows, moe_tiles' schedule, tokens (ub, n_embd) f16,
    h (pairs, n_ff) f16, the pairs' order by expert (int32), each sorted pair's token, router weights)."""
    ids = torch.stack([torch.randperm(n_expert, device=dev)[:n_used] for _ in range(ub)])
    block = moe.moe_tile_rows(ub * n_used, n_expert)
    sched = moe.moe_tiles(ids, n_expert, block)
    tokens = torch.randn(ub, n_embd, device=dev, dtype=torch.float16)
    h = torch.randn(ub * n_used, n_ff, device=dev, dtype=torch.float16)
    order = sched[0].to(torch.int32)
    return (ids, block, sched, tokens, h, order, torch.div(order, n_used, rounding_mode="floor"),
            torch.rand(ub * n_used, device=dev))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-ub", default="32,128,512,2048")
    ap.add_argument("--json", default="moe_kernels.json")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--kquant", action="store_true")
    a = ap.parse_args()
    dev = torch.device("cuda")
    if a.kquant:
        return kquant_main(a, dev)
    results = []
    print("| model | u-batch | tile rows | experts hit | default ms | best ms | best gate+up / down (BN, BK, warps, "
          "stages) | weights GB/s (default) | TFLOP/s (default) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: |")
    for name, (n_expert, n_used, n_embd, n_ff) in SHAPES.items():
        gate, up = _experts(n_expert, n_ff, n_embd, dev), _experts(n_expert, n_ff, n_embd, dev)
        down = _experts(n_expert, n_embd, n_ff, dev)
        for ub in [int(u) for u in a.ub.split(",")]:
            ids, block, sched, tokens, h, order, src, pair_weights = _batch(ub, n_expert, n_used, n_embd, n_ff, dev)
            experts_hit = int(ids.unique().numel())
            weight_bytes = experts_hit * 3 * n_embd * n_ff * 18 / 32
            flops = ub * n_used * 3 * 2 * n_embd * n_ff

            def gate_up(cfg=None):  # as CudaBackend.expert_pairs runs them
                return moe.moe_mm(tokens, gate, sched, torch.float16, block, up=up, rows_from=src, config=cfg)

            def down_proj(hh, cfg=None):
                return moe.moe_mm(hh, down, sched, torch.float32, block, rows_to=order, row_scale=pair_weights,
                                  config=cfg)

            def layer():
                return down_proj(gate_up())

            t_default = do_bench(layer)
            best_gu = best_down = (None, None)
            t_best = None
            if not a.no_sweep:
                gu = {cfg: do_bench(lambda: gate_up(cfg)) for cfg in SWEEP}
                dn = {cfg: do_bench(lambda: down_proj(h, cfg)) for cfg in SWEEP}
                best_gu, best_down = min(gu.items(), key=lambda kv: kv[1]), min(dn.items(), key=lambda kv: kv[1])
                t_best = best_gu[1] + best_down[1]
            row = {"model": name, "ubatch": ub, "tile_rows": block, "experts_hit": experts_hit,
                   "default_ms": t_default, "best_ms": t_best, "best_gate_up": best_gu[0], "best_down": best_down[0],
                   "weights_gbps": weight_bytes / t_default / 1e6, "tflops": flops / t_default / 1e9}
            results.append(row)
            best = "" if t_best is None else f"{t_best:.3f}"
            print(f"| {name} | {ub} | {block} | {experts_hit} | {t_default:.3f} | {best} | {best_gu[0]} / {best_down[0]} "
                  f"| {row['weights_gbps']:.0f} | {row['tflops']:.1f} |", flush=True)
    with open(a.json, "w") as fh:
        json.dump({"device": torch.cuda.get_device_name(), "results": results}, fh, indent=1)


def _kexperts(qtype, n_expert: int, rows: int, cols: int, dev):
    """Random K-quant blocks (every scale, min and quant random), as kquant.kmoe_mm takes them."""
    from ferry.gguf.synth import random_tensor

    ne = (cols, rows, n_expert)
    raw = np.ascontiguousarray(random_tensor(qtype, ne, 1.0, np.random.default_rng(rows * cols))).view(np.uint8)
    return torch.from_numpy(raw.reshape(-1).copy()).to(dev), qtype, ne


def _timed(run, configs) -> dict:
    """Each configuration's time, leaving out those that need more shared memory than the GPU has."""
    from triton.runtime.errors import OutOfResources

    times = {}
    for cfg in configs:
        try:
            times[cfg] = do_bench(lambda: run(cfg))
        except OutOfResources:
            pass
    return times


def kquant_main(a, dev) -> None:
    from ferry.backends.cuda import CudaBackend
    from ferry.kernels.cuda import kquant
    from ferry.kernels.cuda.dequant import dequantize

    backend = CudaBackend("cuda:0")
    results = []
    print("| model | u-batch | tile rows | expanded + torch grouped ms | kmoe_mm default ms | best ms | best gate+up / "
          "down (BN, warps, stages) | speedup (default) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: |")
    for name, (n_expert, n_used, n_embd, n_ff) in SHAPES.items():
        gate, up = (_kexperts(Q.Q4_K, n_expert, n_ff, n_embd, dev) for _ in range(2))
        down = _kexperts(Q.Q6_K, n_expert, n_embd, n_ff, dev)
        scratch = torch.empty(n_expert * n_ff * n_embd, dtype=torch.bfloat16, device=dev)
        for ub in [int(u) for u in a.ub.split(",")]:
            ids, block, sched, tokens, h, order, src, pair_weights = _batch(ub, n_expert, n_used, n_embd, n_ff, dev)

            def gate_up(cfg=None):
                return kquant.kmoe_mm(tokens, gate, sched, torch.float16, block, up=up, rows_from=src, config=cfg)

            def down_proj(hh, cfg=None):
                return kquant.kmoe_mm(hh, down, sched, torch.float32, block, rows_to=order, row_scale=pair_weights,
                                      config=cfg)

            def expanded():  # the way before: each projection expanded to bfloat16 in one scratch, torch's grouped GEMM
                order_e, _, ends = moe.sort_pairs(ids, n_expert)
                xs = tokens.to(torch.bfloat16)[torch.div(order_e, n_used, rounding_mode="floor")]
                offs = ends.to(torch.int32)
                outs = []
                for raw, q, ne in (gate, up):
                    w = dequantize(raw, q, ne, torch.bfloat16, out=scratch.view(n_expert, n_ff, n_embd))
                    outs.append(backend._group_mm(xs, w, offs))
                hh = (torch.nn.functional.silu(outs[0].float()) * outs[1].float()).to(torch.bfloat16)
                w = dequantize(down[0], Q.Q6_K, down[2], torch.bfloat16, out=scratch.view(n_expert, n_embd, n_ff))
                return backend._group_mm(hh, w, offs)

            t_old = do_bench(expanded)
            t_default = do_bench(lambda: down_proj(gate_up()))
            best_gu = best_down = (None, None)
            t_best = None
            if not a.no_sweep:
                gu = _timed(lambda cfg: gate_up(cfg), KSWEEP)
                dn = _timed(lambda cfg: down_proj(h, cfg), KSWEEP)
                best_gu, best_down = min(gu.items(), key=lambda kv: kv[1]), min(dn.items(), key=lambda kv: kv[1])
                t_best = best_gu[1] + best_down[1]
            row = {"model": name, "ubatch": ub, "tile_rows": block, "expanded_ms": t_old, "default_ms": t_default,
                   "best_ms": t_best, "best_gate_up": best_gu[0], "best_down": best_down[0]}
            results.append(row)
            best = "" if t_best is None else f"{t_best:.3f}"
            print(f"| {name} | {ub} | {block} | {t_old:.3f} | {t_default:.3f} | {best} | {best_gu[0]} / "
                  f"{best_down[0]} | {t_old / t_default:.2f} |", flush=True)
    with open(a.json, "w") as fh:
        json.dump({"device": torch.cuda.get_device_name(), "kquant": True, "results": results}, fh, indent=1)


if __name__ == "__main__":
    main()
