"""Would generation with experts in RAM gain from streaming part of a token's experts to the GPU while ggml computes
the rest? At one token, for k experts on the GPU and the others on the CPU: the whole way (staged by the streamer,
computed by the expert GEMVs) and the bare PCIe copies alone beside ggml, random experts each repetition, rotating
over the model's MoE layers so that no expert sits in the CPU's cache. Prints a table, writes JSON.
  python benchmarks/decode_split.py -m model.gguf [-t 16] [-r 40] [--json decode_split.json]
"""

import argparse
import json
import random
import statistics
import time

import torch

from ferry.cli import GpuOptions, open_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-t", "--threads", type=int, default=16)
    ap.add_argument("-r", "--reps", type=int, default=40)
    ap.add_argument("--json", default="decode_split.json")
    a = ap.parse_args()
    _, backend, model, _ = open_model(a.model, a.threads, True, a.threads, True, True,
                                      GpuOptions(999, ["exps=CPU"], "all=off"), 512, 64)
    layers = [b.ffn for b in model.blocks if hasattr(b.ffn, "up_exps")]
    n_expert, k, dev = model.args.n_expert, model.args.n_expert_used, backend.device
    cpu, streamer = backend.cpu, backend.streamer
    x = torch.randn(1, model.args.n_embd)
    x_gpu = x.to(dev)

    def on_cpu(layer, experts) -> None:
        cpu.moe_experts(x, torch.tensor([experts], dtype=torch.int32), torch.full((1, len(experts)), 1.0 / k),
                        layer.up_exps, layer.gate_exps, layer.down_exps, "silu")

    def staged(layer, experts, rep: int) -> None:  # the hybrid runtime's way: staged, then the expert GEMVs
        slot = ("moe", rep & 1)
        (g, _), (u, up_done), (d, down_done) = streamer.stage_experts(
            [layer.gate_exps, layer.up_exps, layer.down_exps], experts, slot)
        torch.cuda.current_stream(dev).wait_event(up_done)
        ids = torch.tensor([experts], dtype=torch.int32).to(dev, non_blocking=True)
        backend.gpu.expert_pairs(x_gpu, ids, g, u, d, "silu", wait_down=down_done)
        streamer.release(slot)

    def copies(layer, experts, rep: int) -> None:  # only the PCIe copies, into the staging buffers
        handle = streamer.copy_stream.cuda_stream
        for role, w in enumerate((layer.gate_exps, layer.up_exps, layer.down_exps)):
            raw, host, per = streamer._expert_rows(w, role)
            for j, e in enumerate(experts):
                streamer._lib.cudaMemcpyAsync(raw.data_ptr() + j * per, host.data_ptr() + e * per, per, 1, handle)

    def timed(gpu_way, n_gpu: int) -> float:
        out = []
        for rep in range(a.reps + 3):  # the first three warm up
            layer = layers[rep % len(layers)]
            chosen = random.sample(range(n_expert), k)
            hot, cold = sorted(chosen[:n_gpu]), sorted(chosen[n_gpu:])
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            if hot:
                gpu_way(layer, hot, rep)
            if cold:
                on_cpu(layer, cold)
            torch.cuda.synchronize()
            if rep >= 3:
                out.append(time.perf_counter() - t0)
        return statistics.median(out)

    rows = [{"experts_gpu": n, "experts_cpu": k - n, "staged_ms": 1e3 * timed(staged, n),
             "copies_only_ms": 1e3 * timed(copies, n)} for n in sorted({0, 1, 2, k // 2, k - 2, k})]
    print("| experts on the GPU / CPU | staged and computed, ms | bare copies beside ggml, ms |")
    print("| --- | ---: | ---: |")
    for r in rows:
        print(f"| {r['experts_gpu']} / {r['experts_cpu']} | {r['staged_ms']:.3f} | {r['copies_only_ms']:.3f} |")
    with open(a.json, "w") as fh:
        json.dump({"model": a.model, "threads": a.threads, "reps": a.reps, "rows": rows}, fh, indent=1)
    backend.close()


if __name__ == "__main__":
    main()
