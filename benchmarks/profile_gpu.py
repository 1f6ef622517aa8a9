"""Where the GPU time of one prompt u-batch and of one decode step goes: the top CUDA kernels by total time
(torch.profiler), for a model all on the GPU. Both are profiled eagerly (the kernels a CUDA graph replays are the
same; the graph removes the launch gaps); prompts are timed as they run by default (replayed up to
PROMPT_GRAPH_MAX tokens), decode steps both ways.
  python benchmarks/profile_gpu.py -m model.gguf [-ub 128,2048] [-n 16] [--top 15]
"""

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from ferry.cli import GpuOptions, open_model
from ferry.ops.cuda.executor import PROMPT_GRAPH_MAX, CudaExecutor
from ferry.runtime.engine import Engine


def table(prof, top: int, steps: int) -> str:
    rows = sorted(prof.key_averages(), key=lambda e: e.device_time_total, reverse=True)[:top]
    total = sum(e.device_time_total for e in prof.key_averages())
    lines = [f"  {'kernel':60s} {'calls':>7s} {'ms/step':>9s} {'share':>6s}"]
    for e in rows:
        lines.append(f"  {e.key[:60]:60s} {e.count // steps:7d} {e.device_time_total / 1e3 / steps:9.3f} "
                     f"{e.device_time_total / total:6.1%}")
    return "\n".join(lines) + f"\n  all kernels: {total / 1e3 / steps:.3f} ms per step"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-ub", default="128,2048")
    ap.add_argument("-n", type=int, default=16, help="decode steps")
    ap.add_argument("--top", type=int, default=15)
    a = ap.parse_args()
    _, backend, model, _ = open_model(a.model, 1, quiet=True, gpu=GpuOptions(999))
    vocab = model.args.n_vocab
    for ub in [int(v) for v in a.ub.split(",")]:
        tokens = torch.randint(0, vocab, (ub,)).tolist()
        e = Engine(model, backend, n_ctx=ub + 1, n_batch=ub, n_ubatch=ub)
        for _ in range(2):  # an eager run, then (up to PROMPT_GRAPH_MAX tokens) the graphs' capture
            e.decode(tokens)
            e.reset()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        e.decode(tokens)
        torch.cuda.synchronize()
        ms = 1e3 * (time.perf_counter() - t0)
        recorded = "graphs" if ub <= PROMPT_GRAPH_MAX else "eager"
        eager = Engine(model, backend, n_ctx=ub + 1, n_batch=ub, n_ubatch=ub)
        eager.executor = CudaExecutor(backend, graphs=False)  # the kernels a replay runs, one launch each
        eager.decode(tokens)
        eager.reset()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            eager.decode(tokens)
            torch.cuda.synchronize()
        print(f"prompt u-batch of {ub} ({recorded}): {ms:.2f} ms wall, {ub / ms * 1e3:.0f} t/s")
        print(table(prof, a.top, 1))
    for graphs in (False, True):
        e = Engine(model, backend, n_ctx=2 * a.n + 70, n_batch=64, n_ubatch=64)
        e.executor = CudaExecutor(backend, graphs=graphs)
        e.decode(torch.randint(0, vocab, (64,)).tolist())
        for _ in range(3):
            e.decode([1])
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(a.n):
            e.decode([1])
        torch.cuda.synchronize()
        ms = 1e3 * (time.perf_counter() - t0) / a.n
        print(f"decode step, {'CUDA graph' if graphs else 'eager'}: {ms:.3f} ms wall ({1e3 / ms:.1f} t/s)")
        if not graphs:
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(a.n):
                    e.decode([1])
                torch.cuda.synchronize()
            print(table(prof, a.top, a.n))


if __name__ == "__main__":
    main()
