"""DeepSeek sparse attention with depth: ferry against llama.cpp's CUDA llama-bench on the same deepseek32 / glm-dsa
GGUF, all on the GPU (`-ngl 999`; llama.cpp `-ngl 99 -fa 1`) or with the experts in RAM (--hybrid: `-ot exps=CPU`
for both, llama.cpp's weights pinned with `-lm none`), in the same run: pp and tg after a cache of each depth
(llama-bench's -d), and per engine tg at the deepest depth over tg at the first (issue 38's target: tg at 32k at
least 85% of tg at 4k, once past the top-k).

Both engines measure llama-bench's way (a warm-up, then -r repetitions; mean ± std). Without --llama-bench, only
ferry runs.
  python benchmarks/dsa_depth.py --llama-bench PATH -m deepseek-v3.2-6l.gguf [-d 4096,32768] [-p 512] [-n 32]
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import llamacpp  # noqa: E402


def ferry_bench(path: Path, n_prompt: int, n_gen: int, ub: int, depths: list[int], reps: int, hybrid: bool,
                threads: int) -> dict:
    from ferry.runtime.loader import RunConfig
    from ferry.tools.bench import run_bench

    placement = {"override_tensor": ["exps=CPU"]} if hybrid else {}
    cfg = RunConfig(path, n_threads=threads, n_gpu_layers=999, quiet=True, **placement)
    rows = run_bench([cfg], [n_prompt] if n_prompt else [], [n_gen] if n_gen else [], [max(n_prompt, 1)], [ub], reps,
                     depths=depths)
    return {(r.n_prompt, r.n_gen, r.n_depth): {"avg_ts": r.avg_ts, "stddev_ts": r.stddev_ts,
                                                 "samples_ts": r.samples_ts} for r in rows}


def llama_bench(exe: str, path: Path, n_prompt: int, n_gen: int, ub: int, depths: list[int], reps: int,
                hybrid: bool, threads: int, gpu: bool = True) -> dict:
    """llama-bench's rows by (n_prompt, n_gen, depth); gpu False: every layer on the CPU (-ngl 0)."""
    cmd = [exe, "-m", str(path), "-ngl", "99" if gpu else "0", "-fa", "1", "-r", str(reps), "-t", str(threads),
           "-p", str(n_prompt),
           "-n", str(n_gen), "-b", str(max(n_prompt, 1)), "-ub", str(ub), "-d", ",".join(map(str, depths)), "-o", "json"]
    if hybrid:
        cmd += ["-ot", "exps=CPU", "-lm", "none"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"llama-bench failed ({r.returncode}): {' '.join(cmd)}\n" + "\n".join(r.stderr.splitlines()[-15:]))
    rows = json.loads(r.stdout)
    return {(r["n_prompt"], r["n_gen"], r["n_depth"]): {"avg_ts": r["avg_ts"], "stddev_ts": r["stddev_ts"],
                                                        "samples_ts": r["samples_ts"]} for r in rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-bench", help="path of a CUDA llama-bench binary")
    ap.add_argument("--llama-bench-from", help="a file that will hold that path once a build finishes")
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-d", default="4096,32768", help="cache depths (comma-separated)")
    ap.add_argument("-p", type=int, default=512)
    ap.add_argument("-n", type=int, default=32)
    ap.add_argument("-ub", type=int, default=512)
    ap.add_argument("-r", type=int, default=2)
    ap.add_argument("-t", type=int, default=16)
    ap.add_argument("--hybrid", action="store_true", help="the routed experts in RAM (-ot exps=CPU) for both engines")
    ap.add_argument("--out", default="dsa_depth.json")
    a = ap.parse_args()
    path, depths = Path(a.model), [int(d) for d in a.d.split(",")]
    fe = ferry_bench(path, a.p, a.n, a.ub, depths, a.r, a.hybrid, a.t)
    if a.llama_bench_from:
        a.llama_bench = llamacpp.wait_for_build(a.llama_bench_from)
    lc = llama_bench(a.llama_bench, path, a.p, a.n, a.ub, depths, a.r, a.hybrid, a.t) if a.llama_bench else {}
    results = [{"model": path.name, "test": f"pp{p}" if p else f"tg{n}", "depth": d, "placement":
                "experts in RAM" if a.hybrid else "all GPU", "ferry": fe[k], "llama.cpp": lc.get(k),
                "ratio": fe[k]["avg_ts"] / lc[k]["avg_ts"] if k in lc else None} for k in fe for p, n, d in [k]]
    flat = {}
    for engine, rows in (("ferry", fe), ("llama.cpp", lc)):
        tg = {d: v["avg_ts"] for (p, n, d), v in rows.items() if n and not p}
        if len(tg) > 1:
            flat[engine] = tg[max(tg)] / tg[min(tg)]
    Path(a.out).write_text(json.dumps({"rows": results, "tg_deepest_over_first": flat}, indent=1))
    print("| model | placement | test | depth | ferry t/s | llama.cpp t/s | ratio |")
    print("| --- | --- | --- | ---: | --- | --- | --- |")
    for r in results:
        f, l = r["ferry"], r["llama.cpp"]
        lt = f"{l['avg_ts']:.2f} ± {l['stddev_ts']:.2f}" if l else "not run"
        ratio = f"{r['ratio']:.2f}" if r["ratio"] else ""
        print(f"| {r['model']} | {r['placement']} | {r['test']} | {r['depth']} | {f['avg_ts']:.2f} ± "
              f"{f['stddev_ts']:.2f} | {lt} | {ratio} |")
    for engine, v in flat.items():
        print(f"{engine}: tg at depth {max(depths)} / tg at depth {min(depths)} = {v:.3f}")


if __name__ == "__main__":
    main()
