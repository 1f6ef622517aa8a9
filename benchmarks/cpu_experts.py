"""One MoE layer's routed experts on the CPU, per quant type: ferry's own kernels (ferry/kernels/cpu/moe_experts.c)
against ggml's mul_mat_id on the same weights and tokens, in one process.

The layer has Qwen3-30B-A3B's shape by default (2048 wide, experts of 768, 8 of 128 per token). Its weights are a
few experts quantized from random numbers, repeated to fill the layer (the bytes the kernels read are real, their
values repeat). Per type and token count: the median ms of the layer, ferry / ggml, and at one token the GB/s of
expert bytes read (8 experts' up, gate and down). Both through CpuBackend.moe_experts, ggml's with the weights
repacked where it has a layout for them (Q4_0, Q4_K, MXFP4), as it runs them.
  python benchmarks/cpu_experts.py [-t 2] [-n 1,512] [--types Q4_0,Q4_K,Q5_K,Q6_K,IQ4_XS,IQ4_KS,IQ4_K] [--json FILE]
A type given as UP/DOWN (Q4_K/Q6_K) gives the down matrices another type. gpt-oss-20b's layer:
  python benchmarks/cpu_experts.py --gpt-oss  (= --types MXFP4 --embd 2880 --ff 2880 --experts 32 --used 4
                                               --act swiglu_oai --biases)
"""

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from ferry.backends.cpu import CpuBackend
from ferry.kernels.cpu import native
from ferry.gguf.synth import random_tensor
from ferry.kernels.capabilities import CPU_AMX_TYPES, can_ggml
from ferry.quant import IkQuant, Q, parse_qtype, quantize
from ferry.weight import Weight




def stacked(rng, qtype, n_expert: int, rows: int, cols: int, distinct: int) -> Weight:
    """n_expert experts of rows x cols: `distinct` of them quantized from random numbers (ik_llama.cpp's IQ4_KS / IQ4_K:
    random bytes under their scales), repeated."""
    if isinstance(qtype, IkQuant):
        raw = random_tensor(qtype, (cols, rows, distinct), 1.0, rng).reshape(distinct, -1)
    else:
        raw = quantize(rng.standard_normal((distinct, rows, cols)).astype(np.float32), qtype).reshape(distinct, -1)
    data = np.ascontiguousarray(np.tile(raw, (n_expert // distinct + 1, 1))[:n_expert]).reshape(-1)
    return Weight("exps", qtype, (cols, rows, n_expert), data)


def _twin(w: Weight) -> Weight:
    twin = Weight(w.name, w.qtype, w.ne, w.data)
    twin.bias = w.bias
    return twin


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-n", "--tokens", default="1,512", help="token counts, comma list")
    ap.add_argument("--types", default="Q4_0,Q4_K,Q5_K,Q6_K,IQ4_XS,Q4_K/Q6_K,Q5_K/Q6_K")
    ap.add_argument("--embd", type=int, default=2048)
    ap.add_argument("--ff", type=int, default=768)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--used", type=int, default=8)
    ap.add_argument("--act", default="silu", choices=["silu", "swiglu_oai"])
    ap.add_argument("--biases", action="store_true", help="each expert's up, gate and down with biases (gpt-oss's)")
    ap.add_argument("--gpt-oss", action="store_true", help="gpt-oss-20b's layer (see above)")
    ap.add_argument("-r", "--reps", type=int, default=5)
    ap.add_argument("--json", default="out/cpu_experts.json")  # out/: git-ignored
    ap.add_argument("--phases", action="store_true",
                    help="over many tokens, where ferry's threads spend a call: each phase's mean and longest thread")
    a = ap.parse_args()
    if a.gpt_oss:
        a.types, a.embd, a.ff, a.experts, a.used, a.act, a.biases = "MXFP4", 2880, 2880, 32, 4, "swiglu_oai", True
    if native.library() is None:
        raise SystemExit(f"ferry's kernels do not run here: {native.why_not()}")
    tokens = [int(n) for n in a.tokens.split(",")]
    rng, pick = np.random.default_rng(0), random.Random(0)
    ours, ggml = CpuBackend(a.threads), CpuBackend(a.threads, native_kernels=False)
    rows, phase_lines = [], []
    amx_here = native.amx()
    print(f"one layer: {a.embd} wide, experts of {a.ff}, {a.used} of {a.experts} per token, {a.act}"
          f"{', biases' if a.biases else ''}, {a.threads} threads")
    extra = (" ferry on VNNI ms | VNNI / AMX |", " ---: | ---: |") if amx_here else ("", "")
    print(f"| experts (up/down) | tokens | ferry ms{' (AMX)' if amx_here else ''} | ggml ms | ggml / ferry | ferry GB/s |"
          f" ggml GB/s |{extra[0]}")
    print(f"| --- | ---: | ---: | ---: | ---: | ---: | ---: |{extra[1]}")
    for spec in a.types.split(","):
        up_name, _, down_name = spec.partition("/")
        up_t, down_t = (IkQuant[n] if n in IkQuant.__members__ else parse_qtype(n)
                        for n in (up_name, down_name or up_name))
        engines = [("ferry", ours)] + ([("ggml", ggml)] if can_ggml(up_t) and can_ggml(down_t) else [])
        if amx_here and (up_t in CPU_AMX_TYPES or down_t in CPU_AMX_TYPES):
            engines.append(("ferry vnni", ours))  # the same kernels with AMX off: the VNNI path's figure
        up = stacked(rng, up_t, a.experts, a.ff, a.embd, 4)
        gate = stacked(rng, up_t, a.experts, a.ff, a.embd, 4)
        down = stacked(rng, down_t, a.experts, a.embd, a.ff, 4)
        if a.biases:
            for w in (up, gate, down):
                w.bias = torch.randn(a.experts, w.ne[1])
        # ggml's own Weight objects over the same bytes: each backend repacks (or not) what it reads as it would
        layers = {"ferry": (up, gate, down), "ggml": tuple(_twin(w) for w in (up, gate, down))}
        layers["ferry vnni"] = layers["ferry"]
        read = sum(w.data.nbytes for w in (up, gate, down)) / a.experts * a.used  # one token's experts
        for n in tokens:
            x = torch.randn(n, a.embd)
            weights = torch.full((n, a.used), 1.0 / a.used)
            out = torch.empty(n, a.embd)
            ms = {}
            for name, cpu in engines:
                native.use_amx(amx_here and name == "ferry")
                up, gate, down = layers[name]
                if name == "ferry" and cpu.native_experts(n, True, up, gate, down, a.act) is None:
                    raise SystemExit(f"ferry's kernel does not take {spec} experts")
                times = []
                for rep in range(a.reps + 2):  # two to warm up
                    ids = torch.tensor([pick.sample(range(a.experts), a.used) for _ in range(n)], dtype=torch.int32)
                    t0 = time.perf_counter()
                    cpu.moe_experts(x, ids, weights, up, gate, down, a.act, out=out)
                    if rep >= 2:
                        times.append((time.perf_counter() - t0) * 1e3)
                ms[name] = statistics.median(times)
            rate = {k: read / v / 1e6 if n == 1 else None for k, v in ms.items()}
            rows.append({"experts": spec, "tokens": n, "threads": a.threads, "ms": ms, "gb_s": rate})
            if a.phases and n > 1:
                native.use_amx(amx_here)
                up, gate, down = layers["ferry"]
                native.phases(True)
                for _ in range(a.reps):
                    ids = torch.tensor([pick.sample(range(a.experts), a.used) for _ in range(n)], dtype=torch.int32)
                    ours.moe_experts(x, ids, weights, up, gate, down, a.act, out=out)
                per = native.phases(False) / a.reps / 1e6  # ms a call, threads x phases
                rows[-1]["phases_ms"] = {name: per[:, i].tolist() for i, name in enumerate(native.PHASES)}
                phase_lines.append(f"| {spec} | {n} | " + " | ".join(
                    f"{per[:, i].mean():.2f} / {per[:, i].max():.2f}" for i in range(len(native.PHASES))) + " |")
            gbs = [f"{rate[k]:.1f}" if rate.get(k) else "" for k in ("ferry", "ggml")]
            theirs = f"{ms['ggml']:.2f} | {ms['ggml'] / ms['ferry']:.2f}" if "ggml" in ms else "(no ggml kernel) |"
            vnni = f" {ms['ferry vnni']:.2f} | {ms['ferry vnni'] / ms['ferry']:.2f} |" if "ferry vnni" in ms else ""
            print(f"| {spec} | {n} | {ms['ferry']:.2f} | {theirs} | {gbs[0]} | {gbs[1]} |{vnni}", flush=True)
    if phase_lines:
        print(f"\nferry's threads, ms a call, mean / longest of {a.threads} threads (wait: at the barriers):")
        print("| experts | tokens | " + " | ".join(native.PHASES) + " |")
        print("| --- | ---: | " + " | ".join("---:" for _ in native.PHASES) + " |")
        print("\n".join(phase_lines))
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    with open(a.json, "w") as fh:
        json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
