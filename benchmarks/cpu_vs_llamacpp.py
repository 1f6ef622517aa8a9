"""CPU only: ferry against llama.cpp's llama-bench on the same GGUF files, threads and test sizes.

Both engines measure llama-bench's way (ferry through `ferry bench`'s code): a warm-up run, then -r
repetitions of pp (random prompt tokens in one u-batch, from an empty KV cache) and tg (single-token
decodes from an empty cache); mean ± std.
llama-bench is built (once, cached) from the llama.cpp tree inside llama-cpp-python's sdist on PyPI
(benchmarks/llamacpp.py): --llama-cpp takes the sdist, a stripped copy of it or a folder; without it the
sdist is downloaded. For the same kernels in both engines, build ggml-python from that tree's ggml
(`python benchmarks/llamacpp.py ggml-python GGML_PYTHON_SDIST SRC`, README); both builds take this CPU's
vector extensions as explicit flags, no AMX (llamacpp.cpu_flags). Usage:
  python benchmarks/cpu_vs_llamacpp.py --llama-cpp llama_cpp_python-0.3.36.tar.gz -m A.gguf -m B.gguf -t 2 --out r.json
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import llamacpp  # noqa: E402


def ferry_bench(path: Path, threads: int, n_prompt: int, n_gen: int, reps: int, repack: bool) -> dict:
    from ferry.runtime.loader import RunConfig
    from ferry.tools.bench import run_bench

    cfg = RunConfig(path, n_threads=threads, n_gpu_layers=0, repack=repack, quiet=True)
    rows = run_bench([cfg], [n_prompt], [n_gen], [n_prompt], [n_prompt], reps)
    return {r.test: {"avg_ts": r.avg_ts, "stddev_ts": r.stddev_ts, "samples_ts": r.samples_ts,
                     "experts_hit": r.experts_hit} for r in rows}


def llama_bench(exe: str, path: Path, threads: int, n_prompt: int, n_gen: int, reps: int) -> dict:
    rows = llamacpp.llama_bench_rows([exe, "-m", str(path), "-t", str(threads), "-p", str(n_prompt), "-n", str(n_gen),
                                      "-r", str(reps), "-b", str(n_prompt), "-ub", str(n_prompt)])
    return {f"pp{p}" if p else f"tg{n}": stats for (p, n, _), stats in rows.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-bench", help="path of a llama-bench binary (instead of building one)")
    ap.add_argument("--llama-cpp", type=Path, help="llama.cpp source: an sdist, a stripped copy or a folder")
    ap.add_argument("--cmake-arg", action="append", help="llama.cpp build flags (default: this CPU's, llamacpp.cpu_flags)")
    ap.add_argument("-m", "--model", action="append", required=True)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-p", type=int, default=512)
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("-r", type=int, default=3)
    ap.add_argument("--no-repack", dest="repack", action="store_false")
    ap.add_argument("--out", default="cpu_vs_llamacpp.json")
    a = ap.parse_args()
    exe = a.llama_bench or str(llamacpp.build(a.llama_cpp or llamacpp.fetch(llamacpp.CACHE / "sdist"), cmake_args=a.cmake_arg))
    results = []
    for m in a.model:
        path = Path(m)
        lc = llama_bench(exe, path, a.threads, a.p, a.n, a.r)
        fe = ferry_bench(path, a.threads, a.p, a.n, a.r, a.repack)
        for test in lc:
            results.append({"model": path.name, "test": test, "threads": a.threads, "ferry": fe[test],
                            "llama.cpp": lc[test], "ratio": fe[test]["avg_ts"] / lc[test]["avg_ts"]})
    Path(a.out).write_text(json.dumps(results, indent=1))
    print("| model | test | threads | ferry t/s | llama.cpp t/s | ratio | experts hit/layer |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        f, l = r["ferry"], r["llama.cpp"]
        hit = f"{min(f['experts_hit'])}-{max(f['experts_hit'])}" if f["experts_hit"] else ""
        print(f"| {r['model']} | {r['test']} | {r['threads']} | {f['avg_ts']:.2f} ± {f['stddev_ts']:.2f} | "
              f"{l['avg_ts']:.2f} ± {l['stddev_ts']:.2f} | {r['ratio']:.2f} | {hit} |")


if __name__ == "__main__":
    main()
