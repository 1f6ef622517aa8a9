"""Where the GPU time of one prompt u-batch and of one decode step goes: the top CUDA kernels by total time
(torch.profiler), for a model all on the GPU. Both are profiled eagerly (the kernels a CUDA graph replays are the
same; the graph removes the launch gaps); prompts are timed as they run by default (replayed up to
PROMPT_GRAPH_MAX tokens), decode steps both ways.
  python benchmarks/profile_gpu.py -m model.gguf [-ub 128,2048] [-n 16] [--top 15] [--syncs] [--depth D]
--depth: the u-batch and the decode steps come after a cache of D tokens (filled untimed, u-batches of 512).
--syncs: also list every call of an eager prompt u-batch that makes the host wait for the GPU (torch's sync debug
mode), by the ferry line that made it: each one leaves the GPU idle while the host catches up.
"""

import argparse
import collections
import time
import traceback
import warnings

import torch
from torch.profiler import ProfilerActivity, profile

from ferry.runtime.loader import RunConfig, load
from ferry.config import settings
from ferry.runtime.runners.cuda_graphs import CudaGraphRunner
from ferry.runtime.engine import Engine

PROMPT_GRAPH_MAX = settings().prompt_graph_max  # FERRY_PROMPT_GRAPH_MAX


def table(prof, top: int, steps: int) -> str:
    rows = sorted(prof.key_averages(), key=lambda e: e.device_time_total, reverse=True)[:top]
    total = sum(e.device_time_total for e in prof.key_averages())
    lines = [f"  {'kernel':60s} {'calls':>7s} {'ms/step':>9s} {'share':>6s}"]
    for e in rows:
        lines.append(f"  {e.key[:60]:60s} {e.count // steps:7d} {e.device_time_total / 1e3 / steps:9.3f} "
                     f"{e.device_time_total / total:6.1%}")
    return "\n".join(lines) + f"\n  all kernels: {total / 1e3 / steps:.3f} ms per step"


def host_syncs(run) -> collections.Counter:
    """The calls that synchronize the host with the GPU while run() runs, counted by the innermost ferry frame
    that made them (torch's sync debug mode warns at each one)."""
    seen: collections.Counter = collections.Counter()

    def note(message, category, filename, lineno, file=None, line=None):
        ours = [f for f in traceback.extract_stack()[:-1] if "/ferry/" in f.filename]
        where = f"{ours[-1].filename.split('/ferry/')[-1]}:{ours[-1].lineno} {ours[-1].line}" if ours else \
            f"{filename}:{lineno}"
        seen[where + f"  ({str(message)[:60]})"] += 1

    with warnings.catch_warnings():  # restores the filters and showwarning after
        warnings.simplefilter("always")
        warnings.showwarning = note
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return seen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-ub", default="128,2048")
    ap.add_argument("-n", type=int, default=16, help="decode steps")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--syncs", action="store_true", help="list the host syncs of an eager prompt u-batch")
    ap.add_argument("--depth", type=int, default=0, help="tokens in the cache before the profiled work")
    a = ap.parse_args()
    loaded = load(RunConfig(a.model, n_threads=1, quiet=True, n_gpu_layers=999))
    backend, model = loaded.backend, loaded.model
    vocab = model.args.n_vocab
    fill = torch.randint(0, vocab, (a.depth,)).tolist()

    def deep(e):  # the cache filled to the depth, untimed
        e.reset()
        for i in range(0, a.depth, 512):
            e.decode(fill[i:i + 512])

    for ub in [int(v) for v in a.ub.split(",")]:
        tokens = torch.randint(0, vocab, (ub,)).tolist()
        e = Engine(model, backend, n_ctx=a.depth + ub + 1, n_batch=max(ub, 512), n_ubatch=max(ub, 512))
        for _ in range(2):  # an eager run, then (up to PROMPT_GRAPH_MAX tokens) the graphs' capture
            deep(e)
            e.decode(tokens)
        deep(e)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        e.decode(tokens)
        torch.cuda.synchronize()
        ms = 1e3 * (time.perf_counter() - t0)
        recorded = "graphs" if ub <= PROMPT_GRAPH_MAX else "eager"
        eager = Engine(model, backend, n_ctx=a.depth + ub + 1, n_batch=max(ub, 512), n_ubatch=max(ub, 512))
        eager.runner = CudaGraphRunner(backend, graphs=False)  # the kernels a replay runs, one launch each
        deep(eager)
        eager.decode(tokens)
        deep(eager)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            eager.decode(tokens)
            torch.cuda.synchronize()
        print(f"prompt u-batch of {ub} ({recorded}): {ms:.2f} ms wall, {ub / ms * 1e3:.0f} t/s")
        print(table(prof, a.top, 1))
        if a.syncs:
            eager.reset()
            syncs = host_syncs(lambda: eager.decode(tokens))
            print(f"  host syncs of one eager u-batch: {sum(syncs.values())}")
            for where, count in syncs.most_common():
                print(f"  {count:5d}  {where}")
    for graphs in (False, True):
        e = Engine(model, backend, n_ctx=a.depth + 2 * a.n + 70, n_batch=512, n_ubatch=512)
        e.runner = CudaGraphRunner(backend, graphs=graphs)
        deep(e)
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
