"""Would generation with experts in RAM gain from computing part of a token's experts on the GPU while ggml computes
the rest? At one token, for k experts on the GPU and the others on the CPU, four GPU ways beside ggml:
- staged: the hybrid runtime's way (the streamer's copies and unpack, then the expert GEMVs);
- copies: only the streamer's PCIe copies (cudaMemcpyAsync per expert), no GPU work;
- mapped: the GPU's own loads read the experts from the registered mmap (zero-copy: a gather kernel that a CUDA
  graph could hold, as no host code picks the addresses), then the unpack and the expert GEMVs;
- gather: that gather alone.
Each way also runs alone (no ggml), and ggml alone on the other experts. Random experts each repetition, rotating
over the model's MoE layers so that no expert sits in the CPU's cache. Prints a table (ms per layer, medians),
writes JSON.
  python benchmarks/decode_split.py -m model.gguf [-t 16] [-r 40] [--json decode_split.json]
"""

import argparse
import json
import random
import statistics
import time

import torch
import triton
import triton.language as tl

from ferry.runtime.loader import RunConfig, load
from ferry.kernels.cuda.layout import Split
from ferry.kernels.cuda.moe import moe_down_gemv, moe_gate_up_gemv, unpack_experts


@triton.jit
def _gather(src, ids, dst, per, BLOCK: tl.constexpr):
    """dst[j] <- expert ids[j]'s `per` words of the stacked tensor at src (host memory the GPU reads itself)."""
    j = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    e = tl.load(ids + j).to(tl.int64)
    live = b < per
    tl.store(dst + j * per + b, tl.load(src + e * per + b, mask=live), mask=live)


class HostWords:
    """A registered host address as a Triton pointer argument (int32 words): Triton asks the driver for its
    device address, which is the same one where host and device share one address space."""

    dtype = torch.int32

    def __init__(self, ptr: int):
        self.ptr = ptr

    def data_ptr(self) -> int:
        return self.ptr


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-t", "--threads", type=int, default=16)
    ap.add_argument("-r", "--reps", type=int, default=40)
    ap.add_argument("--json", default="decode_split.json")
    a = ap.parse_args()
    loaded = load(RunConfig(a.model, n_threads=a.threads, quiet=True, n_gpu_layers=999, override_tensor=["exps=CPU"],
                            offload_policy="all=off", n_ctx=512, n_ubatch=64))
    backend, model = loaded.backend, loaded.model
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

    buffers: dict = {}

    def gathered(layer, experts, rep: int, compute: bool = True) -> None:  # the GPU reads the mmap itself
        ids = torch.tensor(experts, dtype=torch.int32).to(dev, non_blocking=True)
        local = torch.arange(len(experts), dtype=torch.int32, device=dev)
        splits = []
        for role, w in enumerate((layer.gate_exps, layer.up_exps, layer.down_exps)):
            per = w.data.nbytes // n_expert
            raw = buffers.get((role, len(experts)))
            if raw is None:
                raw = buffers[role, len(experts)] = torch.empty(per * len(experts), dtype=torch.uint8, device=dev)
                buffers["split", role, len(experts)] = Split.of(torch.empty_like(raw), w.qtype,
                                                                (w.ne[0], w.ne[1], len(experts)))
            _gather[(len(experts), triton.cdiv(per // 4, 4096))](HostWords(streamer.host(w).data_ptr()), ids,
                                                                 raw.view(torch.int32), per // 4, BLOCK=4096)
            if compute:
                unpack_experts(raw, local, buffers["split", role, len(experts)])
                splits.append(buffers["split", role, len(experts)])
        if compute:
            h = moe_gate_up_gemv(x_gpu, local[None], splits[0], splits[1], "silu")
            moe_down_gemv(h, local[None], torch.full((1, len(experts)), 1.0 / k, device=dev), splits[2])

    def check_gathered() -> float:
        """The gathered bytes are the mmap's, and the mapped way's result ggml's: its relative difference."""
        layer, experts = layers[0], sorted(random.sample(range(n_expert), 3))
        gathered(layer, experts, 0, compute=False)
        torch.cuda.synchronize()
        for role, w in enumerate((layer.gate_exps, layer.up_exps, layer.down_exps)):
            per, host = w.data.nbytes // n_expert, streamer.host(w).view(-1)
            assert torch.equal(buffers[role, 3].cpu(), torch.cat([host[e * per:(e + 1) * per] for e in experts]))
        ids = torch.tensor([experts], dtype=torch.int32)
        local = torch.arange(3, dtype=torch.int32, device=dev)[None]
        for role in range(3):
            unpack_experts(buffers[role, 3], local[0], buffers["split", role, 3])
        h = moe_gate_up_gemv(x_gpu, local, buffers["split", 0, 3], buffers["split", 1, 3], "silu")
        y = moe_down_gemv(h, local, torch.full((1, 3), 1.0 / k, device=dev), buffers["split", 2, 3]).cpu()
        ref = cpu.moe_experts(x, ids, torch.full((1, 3), 1.0 / k), layer.up_exps, layer.gate_exps, layer.down_exps,
                              "silu")
        return float((y - ref).norm() / ref.norm())

    def copies(layer, experts, rep: int) -> None:  # only the PCIe copies, into the staging buffers
        handle = streamer.copy_stream.cuda_stream
        for role, w in enumerate((layer.gate_exps, layer.up_exps, layer.down_exps)):
            raw, host, per = streamer._expert_rows(w, role)
            for j, e in enumerate(experts):
                streamer._lib.cudaMemcpyAsync(raw.data_ptr() + j * per, host.data_ptr() + e * per, per, 1, handle)

    def timed(gpu_way, n_gpu: int, with_cpu: bool = True) -> float:
        out = []
        for rep in range(a.reps + 3):  # the first three warm up
            layer = layers[rep % len(layers)]
            chosen = random.sample(range(n_expert), k)
            hot, cold = sorted(chosen[:n_gpu]), sorted(chosen[n_gpu:])
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            if hot and gpu_way is not None:
                gpu_way(layer, hot, rep)
            if cold and with_cpu:
                on_cpu(layer, cold)
            torch.cuda.synchronize()
            if rep >= 3:
                out.append(time.perf_counter() - t0)
        return 1e3 * statistics.median(out)

    rel = check_gathered()
    ways = {"staged": staged, "copies": copies, "mapped": gathered,
            "gather": lambda layer, e, rep: gathered(layer, e, rep, compute=False)}
    rows = []
    for n in range(k + 1):
        row = {"experts_gpu": n, "experts_cpu": k - n, "ggml_alone_ms": timed(None, n)}
        for name, way in ways.items():
            row[f"{name}_ms"] = timed(way, n)
            if n:
                row[f"{name}_alone_ms"] = timed(way, n, with_cpu=False)
        rows.append(row)
    cols = ["ggml_alone"] + [f"{name}{alone}" for name in ways for alone in ("", "_alone")]
    print(f"mapped way against ggml on 3 experts: relative difference {rel:.2e}")
    print("| experts on the GPU / CPU | " + " | ".join(c.replace("_", " ") for c in cols) + " |")
    print("| --- |" + " ---: |" * len(cols))
    for r in rows:
        print(f"| {r['experts_gpu']} / {r['experts_cpu']} | "
              + " | ".join(f"{r[c + '_ms']:.3f}" if c + "_ms" in r else "" for c in cols) + " |")
    with open(a.json, "w") as fh:
        json.dump({"model": a.model, "threads": a.threads, "reps": a.reps, "mapped_vs_ggml": rel, "rows": rows}, fh,
                  indent=1)
    backend.close()


if __name__ == "__main__":
    main()
