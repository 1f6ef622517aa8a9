"""A GPU smaller than the model: at each cap a ballast process holds all of CUDA0's free memory but the cap (one
torch.empty), so that every engine sees the same smaller card; then, on each model, in the same call:
- ferry's default placement (no -ngl / -ot: the fit), the placement it chose printed as flags;
- ferry by hand: `-ngl 999 -ot exps=CPU`, and the fit's number of layers' experts on the GPU taken as the first
  layers (llama.cpp's habit) or the last ones instead of spread;
- llama.cpp's default fit (`llama-bench -ngl 999 -fitt 1024`); with --ik-bench (or --ik-bench-from), ik_llama.cpp's
  fit (`-ngl 999 --fit 1`) and its `--n-cpu-moe N` at N around the layers ferry's fit leaves in RAM (--ik-sweep: the
  offsets from that count), the best of which is ik_llama.cpp's best by hand; any other engine's llama-bench given
  with --anchor NAME=PATH[:EXTRA FLAGS].
The forecast of `ferry plan --json` (predicted tg and pp at the fit, from the calibration) is recorded beside what
ferry's default measured.
With --routing-text FILE, ferry's default runs a second time after `ferry calibrate --routing -f FILE` has counted
the model's routing ("ferry default, routing counted": the most used experts first, per expert), and the share of
routed pairs each fit predicts on the GPU is recorded (`ferry plan --json`); the count is removed again afterwards.
Every engine runs in its own process, one after another, on an otherwise idle GPU. Ratios: ferry's default against
the best anchor and against ferry's best placement by hand.

  python benchmarks/small_gpu.py -m qwen3-30b-a3b.gguf --caps 12 --llama-bench PATH -p 512 -n 128 -r 2 --out r.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import llamacpp  # noqa: E402

GIB = 1 << 30

_BALLAST = """
import sys, torch
cap = int(sys.argv[1])
free, _ = torch.cuda.mem_get_info()
held = torch.empty(max(free - cap, 0), dtype=torch.uint8, device="cuda")
print(torch.cuda.mem_get_info()[0], flush=True)
sys.stdin.read()
"""


class Ballast:
    """A process holding all of CUDA0's free memory but `cap` bytes, until closed."""

    def __init__(self, cap: int):
        self.proc = subprocess.Popen([sys.executable, "-c", _BALLAST, str(cap)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if not line.strip():
            raise RuntimeError("the ballast process could not hold the GPU's memory")
        self.free = int(line)  # what the GPU has free beside it

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def ferry_bench(path: Path, flags: list[str], threads: int, prompts: list[int], n_gen: int, reps: int) -> dict:
    """ferry bench in its own process: per test (pp512, tg128, ...), its mean, std, samples and the fit's flags."""
    cmd = [sys.executable, "-m", "ferry", "bench", "-m", str(path), "-t", str(threads), "-r", str(reps),
           "-p", ",".join(map(str, prompts)), "-n", str(n_gen), "-o", "json", *flags]
    r = subprocess.run(cmd, check=False, capture_output=True, text=True)
    print(f"$ ferry bench {' '.join(flags) or '(default)'}\n{r.stderr}", file=sys.stderr)  # what auto chose
    if r.returncode:
        print(f"ferry bench {' '.join(flags) or '(default)'} failed ({r.returncode}): "
              + "\n".join(r.stderr.splitlines()[-8:]), file=sys.stderr)
        return {}
    return {row["test"]: {k: row[k] for k in ("avg_ts", "stddev_ts", "samples_ts", "placement")}
            for row in json.loads(r.stdout)}


def ferry_share(path: Path) -> dict:
    """The fit's placement, the share of routed pairs it predicts on the GPU and its forecast tg and pp (`ferry plan
    --json`), here and now."""
    r = subprocess.run([sys.executable, "-m", "ferry", "plan", "-m", str(path), "--json"], capture_output=True,
                       text=True)
    plan = json.loads(r.stdout) if r.returncode == 0 else {}
    fit = plan.get("fit") or {}
    return {**{k: fit.get(k) for k in ("gpu_share", "gpu_share_basis", "experts_per_layer", "flags")},
            "forecast": plan.get("forecast")}


def count_routing(path: Path, text: Path, threads: int) -> Path | None:
    """`ferry calibrate --routing` for the model (stored where the fit finds it); the stored file, None on failure."""
    r = subprocess.run([sys.executable, "-m", "ferry", "calibrate", "--routing", "-m", str(path), "-f", str(text),
                        "-c", "512", "-t", str(threads), "-q"], capture_output=True, text=True)
    print(f"$ ferry calibrate --routing\n{r.stdout}{r.stderr}", file=sys.stderr)
    if r.returncode:
        return None
    from ferry.offload import routing

    return routing.default_path(path)


def anchor_bench(exe: str, extra: list[str], path: Path, threads: int, prompts: list[int], n_gen: int,
                 reps: int) -> dict:
    cmd = [exe, "-m", str(path), "-t", str(threads), "-r", str(reps), "-fa", "1", *extra]
    out = {}
    for test in [["-p", ",".join(map(str, prompts)), "-n", "0"], ["-p", "0", "-n", str(n_gen)]]:
        try:
            rows = llamacpp.llama_bench_rows([*cmd, *test])
        except RuntimeError as e:  # one failed configuration does not lose the others
            print(e, file=sys.stderr)
            continue
        out |= {(f"pp{p}" if p else f"tg{n}"): stats for (p, n, _), stats in rows.items()}
    return out


def fit_layers(placement: str) -> list[int]:
    """The layers whose experts the fit's flags put on the GPU."""
    import re

    m = re.search(r"blk\\\.\(([\d|]+)\)", placement)
    return [int(i) for i in m.group(1).split("|")] if m else []


def stretch(placement: str, n_layer: int, last: bool = False) -> list[str]:
    """The fit's flags with its layers' experts taken as the first (or last) ones of n_layer instead of spread ([]
    where it placed none or all)."""
    k = len(fit_layers(placement))
    if not 0 < k < n_layer:
        return []
    chosen = range(n_layer - k, n_layer) if last else range(k)
    return ["-ngl", "999", "-ot", rf"blk\.({'|'.join(map(str, chosen))})\.ffn_(gate|up|down)_exps=CUDA0",
            "-ot", "exps=CPU"]


def ik_runs(placement: str, n_layer: int, sweep: str) -> dict[str, list[str]]:
    """ik_llama.cpp's fit, and its --n-cpu-moe (the first N layers' experts in RAM) at the offsets `sweep` from the
    layers ferry's fit leaves in RAM."""
    runs = {"ik_llama.cpp fit": ["-ngl", "999", "--fit", "1"]}
    in_ram = n_layer - len(fit_layers(placement)) if "exps=CPU" in placement else 0
    for n in sorted({min(n_layer, max(0, in_ram + int(d))) for d in sweep.split(",")}):
        runs[f"ik_llama.cpp --n-cpu-moe {n}"] = ["-ngl", "999", "--n-cpu-moe", str(n)]
    return runs


def block_count(path: Path) -> int:
    import gguf

    r = gguf.GGUFReader(path)
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()
    return int(r.fields[f"{arch}.block_count"].parts[-1][0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", action="append", required=True, type=Path)
    ap.add_argument("--caps", default="8,12,24", help="GiB left to the engines on CUDA0, comma list")
    ap.add_argument("--llama-bench", help="a CUDA llama-bench (llama.cpp); its default fit is measured")
    ap.add_argument("--llama-bench-from", help="a file that will hold that path once a build finishes")
    ap.add_argument("--anchor", action="append", default=[], help="NAME=PATH[:FLAGS]: another llama-bench and flags")
    ap.add_argument("--ik-bench", help="ik_llama.cpp's CUDA llama-bench: its fit and an --n-cpu-moe sweep")
    ap.add_argument("--ik-bench-from", help="a file that will hold that path once a build finishes (waited for when "
                    "first needed, after ferry's and llama.cpp's runs)")
    ap.add_argument("--ik-sweep", default="-2,0,2",
                    help="--n-cpu-moe offsets from the layers ferry's fit leaves in RAM")
    ap.add_argument("-t", "--threads", type=int, default=16)
    ap.add_argument("-p", default="512", help="prompt sizes, comma list")
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-r", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("small_gpu.json"))
    ap.add_argument("--routing-text", type=Path, help="a text to count each model's routing on, for a second default")
    ap.add_argument("--no-hands", action="store_true", help="ferry's default placements alone, none by hand")
    a = ap.parse_args()
    prompts = [int(p) for p in a.p.split(",")]
    anchors: dict[str, tuple[str, list[str]]] = {}
    exe = a.llama_bench or (llamacpp.wait_for_build(a.llama_bench_from) if a.llama_bench_from else None)
    if exe:
        anchors["llama.cpp fit"] = (exe, ["-ngl", "999", "-fitt", "1024"])
    ik = a.ik_bench or a.ik_bench_from  # a path, or a file that will hold one (resolved when first needed)
    for spec in a.anchor:
        name, _, rest = spec.partition("=")
        path, _, flags = rest.partition(":")
        anchors[name] = (path, flags.split())
    results = []
    for cap in (float(c) for c in a.caps.split(",")):
        ballast = Ballast(int(cap * GIB))
        try:
            for model in a.model:
                res = {"cap_gib": cap, "free_gib": ballast.free / GIB, "model": model.name, "runs": {}}
                res["runs"]["ferry default"] = default = ferry_bench(model, [], a.threads, prompts, a.n, a.r)
                res["shares"] = {"ferry default": ferry_share(model)}
                placement = next(iter(default.values()), {}).get("placement", "")
                if a.routing_text:
                    counted = count_routing(model, a.routing_text, a.threads)
                    if counted is not None:
                        name = "ferry default, routing counted"
                        res["runs"][name] = ferry_bench(model, [], a.threads, prompts, a.n, a.r)
                        res["shares"][name] = ferry_share(model)
                        counted.unlink()
                hands = {"ferry -ot exps=CPU": ["-ngl", "999", "-ot", "exps=CPU"]}
                n_layer = block_count(model)
                for where, last in (("first", False), ("last", True)):
                    if stretch(placement, n_layer, last):
                        hands[f"ferry {where} layers"] = stretch(placement, n_layer, last)
                for name, flags in ({} if a.no_hands else hands).items():
                    res["runs"][name] = ferry_bench(model, flags, a.threads, prompts, a.n, a.r)
                for name, (path, flags) in anchors.items():
                    res["runs"][name] = anchor_bench(path, flags, model, a.threads, prompts, a.n, a.r)
                if ik and not a.ik_bench:
                    ik = a.ik_bench = llamacpp.wait_for_build(ik)
                if ik:
                    for name, flags in ik_runs(placement, n_layer, a.ik_sweep).items():
                        res["runs"][name] = anchor_bench(ik, flags, model, a.threads, prompts, a.n, a.r)
                res["placement"] = placement
                results.append(res)
                a.out.write_text(json.dumps(results, indent=1))  # what is done survives a later failure
        finally:
            ballast.close()
    table(results, prompts, a.n)


def table(results: list[dict], prompts: list[int], n_gen: int) -> None:
    tests = [f"pp{p}" for p in prompts] + [f"tg{n_gen}"]
    for res in results:
        runs = res["runs"]
        print(f"\n{res['model']}, a {res['cap_gib']:g} GiB GPU ({res['free_gib']:.2f} GiB free beside the ballast); "
              f"the fit: {res['placement'] or 'none'}")
        names = list(runs)
        print("| test | " + " | ".join(names) + " | default / best anchor | default / best ferry by hand |")
        print("| --- |" + " ---: |" * (len(names) + 2))
        for test in tests:
            got = {n: runs[n][test]["avg_ts"] for n in names if test in runs[n]}
            cells = [f"{got[n]:.1f}" if n in got else "-" for n in names]
            default = got.get("ferry default")
            anchor = max((v for n, v in got.items() if not n.startswith("ferry")), default=None)
            hand = max((v for n, v in got.items() if n.startswith("ferry") and not n.startswith("ferry default")),
                       default=None)
            ratio = [f"{default / r:.2f}" if default and r else "-" for r in (anchor, hand)]
            print(f"| {test} | " + " | ".join(cells + ratio) + " |")
        for name, share in res.get("shares", {}).items():
            if share.get("gpu_share") is not None:
                print(f"{name}: {100 * share['gpu_share']:.1f}% of the routed pairs on the GPU predicted "
                      f"({share['gpu_share_basis']})")
            fc, got = share.get("forecast"), runs.get(name, {})
            if fc:
                pp = got.get(f"pp{fc['n_ubatch']}", {}).get("avg_ts")
                tg = got.get(f"tg{n_gen}", {}).get("avg_ts")
                print(f"{name}: forecast tg {fc['tg_per_s']:.1f} t/s (measured {tg or 0:.1f}), "
                      f"pp{fc['n_ubatch']} {fc['pp_per_s']:.0f} t/s (measured {pp or 0:.0f})")


if __name__ == "__main__":
    main()
