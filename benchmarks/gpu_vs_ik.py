"""With a GPU: ferry against ik_llama.cpp's CUDA llama-bench on the same GGUF files (files in ik's own types, e.g. the
30B synthetic written with `ferry synth qwen3-30b-a3b --expert-type iq4_ks`), each engine in its own process, in turn
for --rounds rounds. Two placements:
- hybrid: the routed experts in RAM, the rest on the GPU (ferry `-ngl 999 -ot exps=CPU`, its default offload policy;
  ik `-ngl 99 -ot exps=CPU -fa 1 -fmoe 1 -mmp 0`: fused MoE, weights loaded, not mapped);
- gpu: everything on the GPU (ferry `-ngl 999`; ik `-ngl 99 -fa 1 -fmoe 1 -mmp 0`).
Tests: each prompt size of -p at each u-batch of -ub (one prompt, batch = the prompt), and tg -n. Reports each
engine's t/s per round and ferry's ratio to ik (the geometric mean of the per-round ratios); writes JSON. Usage:
  python benchmarks/gpu_vs_ik.py --ik .build/ik/build/bin/llama-bench -m q30-iq4ks.gguf -p 512,4096 -ub 512 -n 128
"""

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import llamacpp  # noqa: E402

PLACEMENTS = {"hybrid": (["-ngl", "999", "-ot", "exps=CPU"], ["-ngl", "99", "-ot", "exps=CPU"]),
              "gpu": (["-ngl", "999"], ["-ngl", "99"])}
IK_ALWAYS = ["-fa", "1", "-fmoe", "1", "-mmp", "0"]


def cases(prompts: list[int], ubatches: list[int], n_gen: int) -> list[tuple[int, int, int]]:
    """(prompt, generated, u-batch) of each test."""
    return [(p, 0, ub) for p in prompts for ub in ubatches if ub <= p] + ([(0, n_gen, 512)] if n_gen else [])


def test_name(p: int, n: int, ub: int) -> str:
    return f"pp{p} -ub {ub}" if p else f"tg{n}"


def ferry_rows(path: Path, placement: list[str], threads: int, tests, reps: int) -> dict:
    out = {}
    for p, n, ub in tests:
        cmd = [sys.executable, "-m", "ferry", "bench", "-m", str(path), *placement, "-t", str(threads), "-p", str(p),
               "-n", str(n), "-ub", str(ub), "-b", str(max(p, ub)), "-r", str(reps), "-o", "json"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"ferry bench failed: {' '.join(cmd)}\n{r.stderr[-2000:]}")
        out[test_name(p, n, ub)] = json.loads(r.stdout)[0]["avg_ts"]
    return out


def ik_rows(exe: str, path: Path, placement: list[str], threads: int, tests, reps: int) -> dict:
    out = {}
    for p, n, ub in tests:
        rows = llamacpp.llama_bench_rows([exe, "-m", str(path), *placement, *IK_ALWAYS, "-t", str(threads),
                                          "-p", str(p), "-n", str(n), "-ub", str(ub), "-b", str(max(p, ub)),
                                          "-r", str(reps)])
        out[test_name(p, n, ub)] = next(iter(rows.values()))["avg_ts"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ik", required=True, help="ik_llama.cpp's CUDA llama-bench")
    ap.add_argument("-m", "--model", action="append", required=True, type=Path)
    ap.add_argument("--placements", default="hybrid,gpu", help="comma list of hybrid, gpu")
    ap.add_argument("-t", "--threads", type=int, default=16)
    ap.add_argument("-p", default="512,4096", help="prompt sizes, comma list")
    ap.add_argument("-ub", default="512", help="u-batch sizes, comma list")
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-r", type=int, default=2, help="repetitions within a run")
    ap.add_argument("--rounds", type=int, default=1, help="engines in turn, this many times")
    ap.add_argument("--out", type=Path, default=Path("gpu_vs_ik.json"))
    a = ap.parse_args()
    tests = cases([int(p) for p in a.p.split(",") if p], [int(u) for u in a.ub.split(",") if u], a.n)
    results = []
    for path in a.model:
        for placement in a.placements.split(","):
            mine, theirs = PLACEMENTS[placement]
            rounds = [{"ik_llama.cpp": ik_rows(a.ik, path, theirs, a.threads, tests, a.r),
                       "ferry": ferry_rows(path, mine, a.threads, tests, a.r)} for _ in range(a.rounds)]
            for test in rounds[0]["ferry"]:
                row = {"model": path.name, "placement": placement, "test": test,
                       "ferry": [r["ferry"][test] for r in rounds], "ik_llama.cpp": [r["ik_llama.cpp"][test] for r in rounds]}
                ratios = [f / i for f, i in zip(row["ferry"], row["ik_llama.cpp"])]
                row["ferry / ik_llama.cpp"] = math.exp(sum(map(math.log, ratios)) / len(ratios))
                results.append(row)
            a.out.write_text(json.dumps(results, indent=1))
    print("| model | placement | test | ferry t/s | ik_llama.cpp t/s | ferry / ik_llama.cpp |")
    print("| --- | --- | --- | ---: | ---: | ---: |")
    for r in results:
        f, i = (", ".join(f"{v:.1f}" for v in r[k]) for k in ("ferry", "ik_llama.cpp"))
        print(f"| {r['model']} | {r['placement']} | {r['test']} | {f} | {i} | {r['ferry / ik_llama.cpp']:.2f} |")


if __name__ == "__main__":
    main()
