"""All on one GPU: ferry (`-ngl 999`) against llama.cpp's CUDA llama-bench (`-ngl 99 -fa 1`) on the same GGUF file,
prompt sizes and u-batches, in the same run: issue 4's targets (pp4096 at u-batch 128 / 512 / 2048 / 4096, tg128).

Both engines measure llama-bench's way: a warm-up run, then -r repetitions; mean ± std; the prompt in u-batches
of -ub within one logical batch of -p tokens. Without --llama-bench, only ferry runs (the table says so).
Usage (on the GPU machine; scripts/gpu_check.sh with STAGES="big llama" builds llama-bench first):
  python benchmarks/gpu_vs_llamacpp.py --llama-bench PATH -m qwen3-30b-a3b.gguf [-p 4096] [-ub 128,512,2048,4096]
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import llamacpp  # noqa: E402


def ferry_bench(path: Path, n_prompt: int, n_gen: int, ubatches: list[int], reps: int) -> dict:
    from ferry.runtime.loader import RunConfig
    from ferry.tools.bench import run_bench

    out = {}
    # one load; tg does not depend on the u-batch: the first one is kept
    rows = run_bench([RunConfig(path, n_threads=1, repack=False, n_gpu_layers=999, quiet=True)], [n_prompt],
                     [n_gen] if n_gen else [], [n_prompt], ubatches, reps)
    for r in rows:
        name = f"{r.test} ub{r.n_ubatch}" if r.n_prompt else r.test
        out.setdefault(name, {"avg_ts": r.avg_ts, "stddev_ts": r.stddev_ts, "samples_ts": r.samples_ts,
                              "experts_hit": r.experts_hit})
    return out


def llama_bench(exe: str, path: Path, n_prompt: int, n_gen: int, ubatches: list[int], reps: int) -> dict:
    base = [exe, "-m", str(path), "-ngl", "99", "-fa", "1", "-r", str(reps)]
    rows = llamacpp.llama_bench_rows([*base, "-p", str(n_prompt), "-n", "0", "-b", str(n_prompt),
                                      "-ub", ",".join(map(str, ubatches))])
    if n_gen:
        rows |= llamacpp.llama_bench_rows([*base, "-p", "0", "-n", str(n_gen)])
    return {f"pp{p} ub{ub}" if p else f"tg{n}": stats for (p, n, ub), stats in rows.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-bench", help="path of a CUDA llama-bench binary")
    ap.add_argument("--llama-bench-from", help="a file that will hold that path once a build finishes: ferry runs "
                    "first, then this waits for the file")
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-p", type=int, default=4096)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-ub", default="128,512,2048,4096")
    ap.add_argument("-r", type=int, default=3)
    ap.add_argument("--out", default="gpu_vs_llamacpp.json")
    a = ap.parse_args()
    path, ubs = Path(a.model), [int(v) for v in a.ub.split(",")]
    fe = ferry_bench(path, a.p, a.n, ubs, a.r)
    if a.llama_bench_from:
        a.llama_bench = llamacpp.wait_for_build(a.llama_bench_from)
    lc = llama_bench(a.llama_bench, path, a.p, a.n, ubs, a.r) if a.llama_bench else {}
    results = [{"model": path.name, "test": t, "ferry": fe[t], "llama.cpp": lc.get(t),
                "ratio": fe[t]["avg_ts"] / lc[t]["avg_ts"] if t in lc else None} for t in fe]
    Path(a.out).write_text(json.dumps(results, indent=1))
    print("| model | test | ferry t/s | llama.cpp t/s | ratio | experts hit/layer |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in results:
        f, l = r["ferry"], r["llama.cpp"]
        hit = f"{min(f['experts_hit'])}-{max(f['experts_hit'])}" if f["experts_hit"] else ""
        lt = f"{l['avg_ts']:.2f} ± {l['stddev_ts']:.2f}" if l else "not run"
        ratio = f"{r['ratio']:.2f}" if r["ratio"] else ""
        print(f"| {r['model']} | {r['test']} | {f['avg_ts']:.2f} ± {f['stddev_ts']:.2f} | {lt} | {ratio} | {hit} |")


if __name__ == "__main__":
    main()
