"""Where -mla 3 should switch a prompt u-batch from absorbed to expanded attention, measured: one u-batch of n tokens
over a cache already holding d positions, timed in both forms on the same model (all on one GPU by default), against
the forms ferry picks: on the GPU by the fitted crossover (ferry/ops/cuda/executor.py, MLA_EXPAND_CELLS), on the CPU
by the multiply-add count (LatentAttention.expand_from: 171 tokens at DeepSeek's shapes).
  python benchmarks/mla_crossover.py -m deepseek-v2-lite.gguf [-ub 16,32,64,128,256,512] [-d 0,4096,16384] [-r 5]
Each (n, d, form) runs on its own engine (CUDA graphs are recorded per form), twice as a warm-up, then -r times after
the cache is cut back to d; the table gives the median in ms and absorbed / expanded (above 1: expanding is faster).
"""

import argparse
import json
import statistics
import time

import torch

from ferry.cli import GpuOptions, open_model
from ferry.layers.attention import LatentAttention
from ferry.ops.cuda import executor
from ferry.runtime.engine import Engine

_RULE, _CELLS = LatentAttention.expand_from, executor.MLA_EXPAND_CELLS


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(model, backend, tokens: list[int], depth: int, n: int, expand: bool, reps: int) -> float:
    """Median ms of one n-token u-batch at cache depth `depth`, expanded or absorbed (both rules forced)."""
    LatentAttention.expand_from = property(lambda self: 1 if expand else 1 << 30)
    executor.MLA_EXPAND_CELLS = 0 if expand else 1 << 40
    try:
        e = Engine(model, backend, n_ctx=depth + n, n_batch=max(n, 512), n_ubatch=max(n, 512))
        if depth:
            e.decode(tokens[:depth])
        e.n_ubatch = e.n_batch = n
        times = []
        for i in range(reps + 2):
            e.truncate(depth)
            _sync()
            t0 = time.perf_counter()
            e.decode(tokens[depth:depth + n])
            _sync()
            if i >= 2:
                times.append(1e3 * (time.perf_counter() - t0))
        return statistics.median(times)
    finally:
        LatentAttention.expand_from, executor.MLA_EXPAND_CELLS = _RULE, _CELLS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-ub", default="16,32,64,128,256,512")
    ap.add_argument("-d", default="0,4096,16384")
    ap.add_argument("-r", type=int, default=5)
    ap.add_argument("-ngl", type=int, default=999)
    ap.add_argument("--json", default="mla_crossover.json")
    a = ap.parse_args()
    ubs, depths = [int(v) for v in a.ub.split(",")], [int(v) for v in a.d.split(",")]
    _, backend, model, _ = open_model(a.model, 16, quiet=True, gpu=GpuOptions(a.ngl) if a.ngl else None, mla=3,
                                      n_ctx=max(depths) + max(ubs), n_ubatch=max(max(ubs), 512))
    attn = model.latent_layers()[0]
    tokens = torch.randint(0, model.args.n_vocab, (max(depths) + max(ubs),)).tolist()
    rows = []
    gpu = a.ngl > 0 and torch.cuda.is_available()
    print(f"rule: {'GPU: expand when n_kv + %d n >= %d' % (executor.MLA_TOKEN_WEIGHT, _CELLS) if gpu else 'CPU'}; "
          f"multiply-adds: expand from {attn.expand_from} tokens (lora {attn.kv_lora_rank}, nope {attn.head_dim_nope}, "
          f"v {attn.head_dim_v})")
    print("| depth | u-batch | absorbed ms | expanded ms | absorbed / expanded | ferry picks | picked / best |")
    print("| ---: | ---: | ---: | ---: | ---: | --- | ---: |")
    for d in depths:
        for n in ubs:
            absorbed = _timed(model, backend, tokens, d, n, False, a.r)
            expanded = _timed(model, backend, tokens, d, n, True, a.r)
            if gpu:
                expands = executor.mla_expands(n, d + n)
            else:
                expands = n >= attn.expand_from
            picked = expanded if expands else absorbed
            rule = "expand" if expands else "absorb"
            rows.append({"depth": d, "ubatch": n, "absorbed_ms": absorbed, "expanded_ms": expanded, "rule": rule,
                         "picked_over_best": picked / min(absorbed, expanded)})
            print(f"| {d} | {n} | {absorbed:.3f} | {expanded:.3f} | {absorbed / expanded:.2f} | {rule} | "
                  f"{picked / min(absorbed, expanded):.2f} |", flush=True)
    with open(a.json, "w") as f:
        json.dump({"model": a.model, "expand_from": attn.expand_from, "gpu": gpu, "expand_cells": _CELLS,
                   "token_weight": executor.MLA_TOKEN_WEIGHT, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
