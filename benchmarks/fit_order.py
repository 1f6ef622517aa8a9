"""Which of the fit's layers to put on the GPU, on a ballasted GPU: the fit's spread (its default), the first k
layers, or blocks of b consecutive layers spread over the depth, each run `--rounds` times in turn in one call, with
auto's choices. Generation favoured the first layers and prompts the spread (docs/performance.md, 2026-11-25, "A GPU
smaller than the model").

  python benchmarks/fit_order.py MODEL.gguf --cap 12 --layouts spread,first,blocks2,blocks3 --rounds 2 --out r.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import small_gpu


def blocks(k: int, n_layer: int, b: int) -> list[int]:
    """k layers as blocks of b consecutive ones (the last may be shorter), the blocks spread evenly over n_layer."""
    m = -(-k // b)
    starts = [int((i + 0.5) * n_layer / m) - b // 2 for i in range(m)]
    chosen: list[int] = []
    for s in starts:
        chosen += [i for i in range(max(s, 0), n_layer) if i not in chosen][: min(b, k - len(chosen))]
    return sorted(chosen)


def flags(chosen: list[int]) -> list[str]:
    return ["-ngl", "999", "-ot", rf"blk\.({'|'.join(map(str, chosen))})\.ffn_(gate|up|down)_exps=CUDA0",
            "-ot", "exps=CPU"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path)
    ap.add_argument("--cap", type=float, default=12)
    ap.add_argument("--layouts", default="spread,first,blocks2,blocks3")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--env", action="append", default=[], help="NAME=VALUE for every ferry process")
    ap.add_argument("--out", type=Path, default=Path("fit_order.json"))
    a = ap.parse_args()
    env = {**os.environ, **dict(e.split("=", 1) for e in a.env)}
    ballast = small_gpu.Ballast(int(a.cap * small_gpu.GIB))
    results: list[dict] = []

    def run(name: str, extra: list[str]) -> list[dict]:
        cmd = [sys.executable, "-m", "ferry", "bench", "-m", str(a.model), "-t", "16", "-r", "3", "-p", "512",
               "-n", "128", "-o", "json", *extra]
        r = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env)
        rows = json.loads(r.stdout) if r.returncode == 0 else []
        notes = [line for line in r.stderr.splitlines() if "auto" in line]
        results.append({"name": name, "flags": extra, "notes": notes,
                        "ts": {row["test"]: row["avg_ts"] for row in rows},
                        "samples": {row["test"]: row["samples_ts"] for row in rows},
                        "placement": rows[0]["placement"] if rows else r.stderr[-800:]})
        print(name, {k: round(v, 1) for k, v in results[-1]["ts"].items()}, *notes, sep="\n  ", flush=True)
        a.out.write_text(json.dumps(results, indent=1))
        return rows

    try:
        rows = run("spread", [])
        placement = rows[0]["placement"] if rows else ""
        n_layer = small_gpu.block_count(a.model)
        k = len(small_gpu.fit_layers(placement))
        layouts = {"spread": [], "first": flags(list(range(k)))}
        for name in a.layouts.split(","):
            if name.startswith("blocks"):
                layouts[name] = flags(blocks(k, n_layer, int(name[6:])))
        for r in range(a.rounds):
            for name in a.layouts.split(","):
                if r or name != "spread":
                    run(name, layouts[name])
    finally:
        ballast.close()
    names = a.layouts.split(",")
    print("| layout | pp512 | tg128 |\n| --- | ---: | ---: |")
    for name in names:
        got = [x["ts"] for x in results if x["name"] == name]
        cells = [" / ".join(f"{g[t]:.1f}" for g in got if t in g) for t in ("pp512", "tg128")]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
