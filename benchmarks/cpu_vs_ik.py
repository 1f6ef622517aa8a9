"""CPU only: ferry against ik_llama.cpp (`-rtr 1 -mmp 0`, its best CPU setting) and, given one, llama.cpp's
llama-bench, on the same GGUF files, threads and tests, each engine in its own process, in turn for --rounds rounds.

Reports pp (prompt sizes of -p, one u-batch each) and tg (-n) at each thread count of -t ("all": the physical
cores), ferry's ratio to each anchor (the geometric mean over rounds of the per-round ratios), and for tg the GB/s
of weights a token reads (every tensor but the routed experts, plus n_used / n_expert of those) against this machine's
read bandwidth at that thread count (torch's sum of 1 GiB of float32, best of 5). With a GPU, hide it
(CUDA_VISIBLE_DEVICES=); ferry runs with -ngl 0 either way. Build ik_llama.cpp once into a cache folder
(../shared/anchors/README.md: the CPU build, about 15 minutes on 2 cores). Usage:
  python benchmarks/cpu_vs_ik.py --ik ~/.cache/ferry-anchors/ik/build/bin/llama-bench -m q12.gguf -t 1,2 --out r.json
--ferry-env FERRY_AMX=0 runs ferry a second time with that variable (here: the VNNI kernels where AMX would run).
"""

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import llamacpp  # noqa: E402


def _cores() -> int:
    from ferry.backends.cpu import physical_cores

    return physical_cores()


def read_bandwidth(threads: int) -> float:
    """GB/s of one pass over 1 GiB of float32 (torch.sum), best of 5, at this thread count."""
    import torch

    torch.set_num_threads(threads)
    x = torch.ones(1 << 28)
    best = math.inf
    for _ in range(5):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best / 1e9


def token_bytes(path: Path) -> int:
    """Bytes of weights one generated token reads, as the file stores them (ik_llama.cpp's types too): every tensor
    but the routed experts, and of those n_used of n_expert (even routing)."""
    from ferry.gguf.file import GGUFFile
    from ferry.kernels.cpu import native

    f = GGUFFile(path, ik_in_place=native.ik_in_place())
    arch = f.architecture
    n_used, n_expert = f.get(f"{arch}.expert_used_count", 1), f.get(f"{arch}.expert_count", 1)
    total = 0
    for t in f.tensors.values():
        if t.name == "token_embd.weight" and "output.weight" in f.tensors:
            continue  # a lookup: one row a token
        total += t.stored_bytes * n_used // n_expert if "_exps" in t.name else t.stored_bytes
    return total


def ferry_rows(path: Path, threads: int, prompts: list[int], n_gen: int, reps: int, env: dict | None = None) -> dict:
    out = {}
    for p in prompts + [0]:
        n = 0 if p else n_gen
        cmd = [sys.executable, "-m", "ferry", "bench", "-m", str(path), "-t", str(threads), "-ngl", "0",
               "-p", str(p), "-n", str(n), "-r", str(reps), "-b", str(max(p, 512)), "-ub", str(max(p, 512)),
               "-o", "json"]
        r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})})
        if r.returncode:
            raise RuntimeError(f"ferry bench failed: {' '.join(cmd)}\n{r.stderr[-2000:]}")
        for row in json.loads(r.stdout):
            out[f"pp{p}" if p else f"tg{n}"] = {"avg_ts": row["avg_ts"], "stddev_ts": row["stddev_ts"]}
    return out


def anchor_rows(exe: str, extra: list[str], path: Path, threads: int, prompts: list[int], n_gen: int,
                reps: int) -> dict:
    out = {}
    for p in prompts + [0]:
        n = 0 if p else n_gen
        rows = llamacpp.llama_bench_rows([exe, "-m", str(path), "-t", str(threads), "-p", str(p), "-n", str(n),
                                          "-r", str(reps), "-b", str(max(p, 512)), "-ub", str(max(p, 512)), *extra])
        for (rp, rn, _), stats in rows.items():
            out[f"pp{rp}" if rp else f"tg{rn}"] = stats
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ik", required=True, help="ik_llama.cpp's llama-bench")
    ap.add_argument("--llama-bench", help="llama.cpp's llama-bench (optional)")
    ap.add_argument("-m", "--model", action="append", required=True, type=Path)
    ap.add_argument("-t", "--threads", default="1,2,all", help="comma list; 'all': the physical cores")
    ap.add_argument("-p", default="512,2048", help="prompt sizes, comma list")
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("-r", type=int, default=2, help="repetitions within a run")
    ap.add_argument("--rounds", type=int, default=1, help="engines in turn, this many times")
    ap.add_argument("--out", type=Path, default=Path("cpu_vs_ik.json"))
    ap.add_argument("--ferry-env", action="append", default=[], metavar="VAR=VALUE",
                    help="ferry again with this variable set (e.g. FERRY_AMX=0), reported as one more engine")
    a = ap.parse_args()
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    cores = _cores()
    threads = sorted({cores if t == "all" else int(t) for t in a.threads.split(",")})
    prompts = [int(p) for p in a.p.split(",") if int(p) > 0]
    engines = [("ik_llama.cpp", a.ik, ["-rtr", "1", "-mmp", "0"])]
    if a.llama_bench:
        engines.append(("llama.cpp", a.llama_bench, []))
    engines += [(f"ferry {v}", None, [v]) for v in a.ferry_env]  # ferry itself under another setting
    results = []
    for path in a.model:
        per_token = token_bytes(path)
        for t in threads:
            bandwidth = read_bandwidth(t)
            rounds: list[dict] = []
            for _ in range(a.rounds):
                got = {name: anchor_rows(exe, extra, path, t, prompts, a.n, a.r) for name, exe, extra in engines
                       if exe is not None}
                got["ferry"] = ferry_rows(path, t, prompts, a.n, a.r)
                for name, _, extra in engines:
                    if name.startswith("ferry "):
                        got[name] = ferry_rows(path, t, prompts, a.n, a.r, dict([extra[0].split("=", 1)]))
                rounds.append(got)
            for test in rounds[0]["ferry"]:
                row = {"model": path.name, "threads": t, "test": test, "read_GBps": bandwidth,
                       "token_bytes": per_token}
                for name in ["ferry"] + [e[0] for e in engines]:
                    row[name] = [r[name][test]["avg_ts"] for r in rounds]
                for name, _, _ in engines:
                    ratios = [f / x for f, x in zip(row["ferry"], row[name])]
                    row[f"ferry / {name}"] = math.exp(sum(map(math.log, ratios)) / len(ratios))
                if test.startswith("tg"):
                    for name in ["ferry"] + [e[0] for e in engines]:
                        mean = sum(row[name]) / len(row[name])
                        row[f"{name} GBps"] = mean * per_token / 1e9
                results.append(row)
            a.out.write_text(json.dumps(results, indent=1))
    names = ["ferry"] + [e[0] for e in engines]
    print("| model | threads | test | " + " | ".join(f"{n} t/s" for n in names) + " | "
          + " | ".join(f"ferry / {e[0]}" for e in engines) + " | tg GB/s (ferry, " + ", ".join(e[0] for e in engines)
          + ") of read bandwidth |")
    print("| --- | ---: | --- | " + " | ".join("---:" for _ in names) + " | " + " | ".join("---:" for _ in engines)
          + " | --- |")
    for r in results:
        ts = " | ".join(", ".join(f"{v:.1f}" for v in r[n]) for n in names)
        ratios = " | ".join(f"{r[f'ferry / {e[0]}']:.2f}" for e in engines)
        gb = ""
        if r["test"].startswith("tg"):
            gb = ", ".join(f"{r[f'{n} GBps']:.1f}" for n in names) + f" of {r['read_GBps']:.1f}"
        print(f"| {r['model']} | {r['threads']} | {r['test']} | {ts} | {ratios} | {gb} |")


if __name__ == "__main__":
    main()
