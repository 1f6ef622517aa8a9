"""`ferry sweep` beside llama.cpp at the same depths: llama-sweep-bench's table (S_PP and S_TG as the cache fills)
for both engines in one run, their ratios, and the two curves overlaid in one plot (`ferry sweep`'s).

llama-cpp-python 0.3.36's llama.cpp tree has no llama-sweep-bench (ik_llama.cpp's has, but its 8337e4c runs no
deepseek4), so llama.cpp's row at each depth comes from its llama-bench: `-d N_KV -p UB -n TG -ub UB`, the prompt
u-batch and the generated tokens timed after a cache of N_KV tokens, as llama-sweep-bench times them. llama-bench
refills the cache for each depth, so it runs every --every-th of the sweep's depths (all by default).
Placement: --placement cpu (`-ngl 0` for both), gpu (`-ngl 999`; llama.cpp `-ngl 99 -fa 1`) or hybrid (the experts in
RAM, `-ot exps=CPU`; llama.cpp's weights pinned with `-lm none`).
  python benchmarks/sweep_vs_llamacpp.py --llama-bench PATH -m M.gguf -c 4096 -ub 512 [-n 128] [-t 16]
      [--placement gpu] [--every 2] --out sweep.json --plot sweep.png
"""

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import llamacpp  # noqa: E402
from dsa_depth import llama_bench  # noqa: E402


def ferry_sweep(path: Path, n_ctx: int, ub: int, tg: int, threads: int, placement: str) -> list:
    from ferry.runtime.loader import RunConfig, load
    from ferry.tools import sweep

    flags = {"cpu": {"n_gpu_layers": 0}, "gpu": {"n_gpu_layers": 999},
             "hybrid": {"n_gpu_layers": 999, "override_tensor": ["exps=CPU"]}}[placement]
    cfg = RunConfig(path, n_threads=threads, n_ctx=n_ctx, n_batch=ub, n_ubatch=ub, quiet=True, **flags)
    return sweep.run(load(cfg), cfg, tg, quiet=True)


def llama_rows(exe: str, path: Path, ub: int, tg: int, depths: list[int], threads: int, placement: str) -> list:
    """llama-bench's pp and tg at each depth as sweep rows."""
    from ferry.tools.sweep import SweepRow

    got = llama_bench(exe, path, ub, tg, ub, depths, 1, placement == "hybrid", threads, gpu=placement != "cpu")
    rows = []
    for d in depths:
        s_pp, s_tg = got[(ub, 0, d)]["avg_ts"], got[(0, tg, d)]["avg_ts"]
        rows.append(SweepRow(ub, tg, d, ub / s_pp, s_pp, tg / s_tg, s_tg))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-bench", help="path of a llama-bench binary (CUDA for gpu / hybrid)")
    ap.add_argument("--llama-bench-from", help="a file that will hold that path once a build finishes")
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-c", type=int, default=4096, help="sweep until the cache holds this many tokens")
    ap.add_argument("-ub", type=int, default=512)
    ap.add_argument("-n", type=int, default=0, help="tokens generated at each depth (default: a quarter of -ub)")
    ap.add_argument("-t", type=int, default=16)
    ap.add_argument("--placement", choices=("cpu", "gpu", "hybrid"), default="gpu")
    ap.add_argument("--every", type=int, default=1, help="llama.cpp at every k-th of the sweep's depths")
    ap.add_argument("--out", default="sweep_vs_llamacpp.json")
    ap.add_argument("--plot", help="a PNG of both sweeps overlaid")
    a = ap.parse_args()
    path, tg = Path(a.model), a.n or max(1, a.ub // 4)
    fe = ferry_sweep(path, a.c, a.ub, tg, a.t, a.placement)
    if a.llama_bench_from:
        a.llama_bench = llamacpp.wait_for_build(a.llama_bench_from)
    lc = llama_rows(a.llama_bench, path, a.ub, tg, [r.n_kv for r in fe][::a.every], a.t, a.placement) \
        if a.llama_bench else []
    out = Path(a.out)
    out.write_text(json.dumps({"model": path.name, "placement": a.placement, "n_ctx": a.c, "n_ubatch": a.ub,
                               "threads": a.t, "ferry": [asdict(r) for r in fe],
                               "llama.cpp": [asdict(r) for r in lc]}, indent=1))
    for name, rows in (("ferry", fe), ("llama.cpp", lc)):  # each as `ferry sweep --json` writes it, for --overlay
        if rows:
            out.with_name(f"{out.stem}.{name}.json").write_text(json.dumps({"model": path.name,
                                                                            "rows": [asdict(r) for r in rows]}))
    by_depth = {r.n_kv: r for r in lc}
    print(f"{path.name}, {a.placement}, -ub {a.ub}, {tg} generated per depth, {a.t} threads")
    print("| N_KV | ferry S_PP | llama.cpp S_PP | ratio | ferry S_TG | llama.cpp S_TG | ratio |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in fe:
        o = by_depth.get(r.n_kv)
        other = (f"{o.s_pp:.1f} | {r.s_pp / o.s_pp:.2f} | {r.s_tg:.2f} | {o.s_tg:.2f} | {r.s_tg / o.s_tg:.2f}" if o
                 else f" | | {r.s_tg:.2f} | | ")
        print(f"| {r.n_kv} | {r.s_pp:.1f} | {other} |")
    if len(fe) > 1:
        print(f"ferry: S_TG at N_KV {fe[-1].n_kv} / at {fe[0].n_kv} = {fe[-1].s_tg / fe[0].s_tg:.3f}")
    if len(lc) > 1:
        print(f"llama.cpp: S_TG at N_KV {lc[-1].n_kv} / at {lc[0].n_kv} = {lc[-1].s_tg / lc[0].s_tg:.3f}")
    if a.plot:  # last: a machine without matplotlib still prints the table
        from ferry.errors import FerryError
        from ferry.tools.sweep import plot

        try:
            plot([("ferry", fe)] + ([("llama.cpp", lc)] if lc else []), Path(a.plot))
        except FerryError as e:
            print(f"no plot: {e}")


if __name__ == "__main__":
    main()
