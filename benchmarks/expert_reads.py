"""How fast ggml and ferry's own kernel read a generated token's routed experts, against how fast this CPU reads
memory at all; and what a CUDA call costs the host right after ggml's threads ran. Experts in RAM (-ngl 999 -ot
exps=CPU), one token:
- per thread count, a token's worth of MoE layers (8 random experts each, rotating over every layer so that none
  sits in the CPU's cache) through CpuBackend.moe_experts: ms per token and the GB/s of expert bytes it reads;
  with --plain also from the unrepacked bytes of the mmap; and by ferry's own kernel (ferry/kernels/cpu/moe_experts.c,
  the repacked copy), which CpuBackend runs at one token where this CPU has AVX512-VNNI;
- torch's sum over 1 GiB of float32 at the same thread counts: the rate the cores can read memory at;
- a 12-kernel CUDA graph's launch, an asynchronous 8 KiB copy and a synchronize, right after a ggml call, 20 ms after
  one, and with no ggml before.
- with --cflags, ferry's kernel built with each of several sets of compiler flags in turn (e.g. its -DBUNDLE_BYTES
  and -DPREFETCH_AHEAD), each a row, the sets taken round after round.
Prints tables, writes JSON.
  python benchmarks/expert_reads.py -m model.gguf [-t 16,8,12] [--plain] [--no-cuda] [--json FILE]
      [--cflags "FLAGS|FLAGS|..."]
"""

import argparse
import json
import os
import random
import statistics
import time

import torch

from ferry.config import settings
from ferry.runtime.loader import RunConfig, load
from ferry.kernels.cpu import native
from ferry.backends.cpu import CpuBackend
from ferry.runtime.runners.cuda_graphs import _launcher


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-t", "--threads", default="16,8,12,16", help="thread counts, in this order")
    ap.add_argument("--plain", action="store_true", help="also read the experts' plain bytes, unrepacked")
    ap.add_argument("--no-cuda", action="store_true", help="skip the CUDA calls' timings")
    ap.add_argument("-r", "--rounds", type=int, default=12)
    ap.add_argument("--cflags", help="sets of flags for ferry's kernel, | apart (an empty set: the defaults)")
    ap.add_argument("--json", default="expert_reads.json")
    a = ap.parse_args()
    threads = [int(t) for t in a.threads.split(",")]
    loaded = load(RunConfig(a.model, n_threads=max(threads), quiet=True, n_gpu_layers=999,
                            override_tensor=["exps=CPU"], offload_policy="all=off", n_ctx=4096, n_ubatch=512))
    backend, model = loaded.backend, loaded.model
    layers = [(b.ffn.up_exps, b.ffn.gate_exps, b.ffn.down_exps) for b in model.blocks if hasattr(b.ffn, "gate_exps")]
    n_expert, n_used = layers[0][1].ne[2], model.args.n_expert_used
    layer_bytes = sum(w.data.nbytes for w in layers[0]) / n_expert * n_used
    x = torch.randn(1, layers[0][0].ne[0])
    weights = torch.full((1, n_used), 1.0 / n_used)
    out = torch.empty(1, layers[0][2].ne[1])
    rng = random.Random(0)
    results: dict = {"layer_bytes": layer_bytes, "layers": len(layers), "experts": [], "torch_sum": [],
                     "cuda_calls": []}

    def one_layer(cpu: CpuBackend, layer) -> None:
        ids = torch.tensor([rng.sample(range(n_expert), n_used)], dtype=torch.int32)
        up, gate, down = layer
        cpu.moe_experts(x, ids, weights, up, gate, down, "silu", out=out)

    def token_rate(cpu: CpuBackend, label: str, t: int) -> None:
        times = []
        for i in range(a.rounds + 2):  # two to warm up
            t0 = time.perf_counter()
            for layer in layers:
                one_layer(cpu, layer)
            if i >= 2:
                times.append(time.perf_counter() - t0)
        med = statistics.median(times)
        results["experts"].append({"layout": label, "threads": t, "ms_per_token": 1e3 * med,
                                   "gb_per_s": layer_bytes * len(layers) / med / 1e9,
                                   "best_gb_per_s": layer_bytes * len(layers) / min(times) / 1e9})

    own = CpuBackend(1).native_experts(1, True, *layers[0], "silu") is not None
    if not own:
        print(f"no rows of ferry's kernel: {native.why_not() or 'it does not cover these experts'}")
    for t in threads:  # the two in turn, so that a drift of the machine's speed falls on both
        token_rate(CpuBackend(t, native_kernels=False), "ggml, repacked", t)
        if own:
            token_rate(CpuBackend(t), "ferry's kernel, repacked", t)
    if own and a.cflags is not None:
        for _ in range(2):
            for flags in a.cflags.split("|"):
                os.environ["FERRY_NATIVE_CFLAGS"] = flags
                settings.cache_clear()
                token_rate(CpuBackend(threads[0]), f"ferry's kernel, cflags '{flags}'", threads[0])
    if a.plain:
        kept = {id(w): w.repacked for layer in layers for w in layer}
        for layer in layers:
            for w in layer:
                w.repacked = False  # read from the mmap's bytes
        for t in threads:
            token_rate(CpuBackend(t, repack=False), "ggml, plain", t)
        for layer in layers:
            for w in layer:
                w.repacked = kept[id(w)]

    big = torch.ones(2**28)
    for t in sorted(set(threads)):
        torch.set_num_threads(t)
        big.sum()
        t0 = time.perf_counter()
        for _ in range(10):
            big.sum()
        results["torch_sum"].append({"threads": t, "gb_per_s": big.numel() * 4 * 10 / (time.perf_counter() - t0) / 1e9})
    torch.set_num_threads(1)  # as CpuBackend leaves it: torch's workers off ggml's cores

    def cuda_calls() -> None:
        cpu = CpuBackend(max(threads), native_kernels=False)
        acc = torch.zeros(4096, device=backend.device)
        side = torch.cuda.Stream(backend.device)
        side.wait_stream(torch.cuda.current_stream(backend.device))
        with torch.cuda.stream(side):
            acc.add_(1)
        torch.cuda.synchronize(backend.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(12):
                acc.add_(1)
        launch = _launcher(graph)
        pinned, dev = torch.empty(2048).pin_memory(), torch.empty(2048, device=backend.device)
        for label, pause in (("right after ggml", 0.0), ("20 ms after ggml", 0.02), ("no ggml before", None)):
            launches, copies, syncs = [], [], []
            for _ in range(200):
                if pause is not None:
                    one_layer(cpu, layers[rng.randrange(len(layers))])
                    time.sleep(pause)
                t0 = time.perf_counter()
                launch()
                t1 = time.perf_counter()
                torch.cuda.synchronize(backend.device)
                if pause is not None:
                    one_layer(cpu, layers[rng.randrange(len(layers))])
                    time.sleep(pause)
                t2 = time.perf_counter()
                dev.copy_(pinned, non_blocking=True)
                t3 = time.perf_counter()
                torch.cuda.synchronize(backend.device)
                t4 = time.perf_counter()
                launches.append(t1 - t0)
                copies.append(t3 - t2)
                syncs.append(t4 - t3)
            results["cuda_calls"].append({"when": label, **{k: 1e6 * statistics.median(v) for k, v in
                                                            (("launch_us", launches), ("copy_us", copies),
                                                             ("sync_us", syncs))}})

    if not a.no_cuda:
        cuda_calls()

    print(f"{len(layers)} MoE layers, {layer_bytes / 1e6:.1f} MB of experts a layer at one token")
    print("| experts | threads | ms per token | GB/s (median) | GB/s (best) |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for r in results["experts"]:
        print(f"| {r['layout']} | {r['threads']} | {r['ms_per_token']:.2f} | {r['gb_per_s']:.1f} | "
              f"{r['best_gb_per_s']:.1f} |")
    print("| torch sum of 1 GiB f32 | threads | | GB/s | |")
    for r in results["torch_sum"]:
        print(f"| | {r['threads']} | | {r['gb_per_s']:.1f} | |")
    print("| CUDA call (median us) | graph launch | 8 KiB copy issued | synchronize |")
    print("| --- | ---: | ---: | ---: |")
    for r in results["cuda_calls"]:
        print(f"| {r['when']} | {r['launch_us']:.1f} | {r['copy_us']:.1f} | {r['sync_us']:.1f} |")
    with open(a.json, "w") as fh:
        json.dump(results, fh, indent=1)
    backend.close()


if __name__ == "__main__":
    main()
