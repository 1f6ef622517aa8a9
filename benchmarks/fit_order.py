"""The fit's spread of layers against the first layers on a ballasted GPU, each placement run more than once in one
call, with auto's choices and libgomp's OMP_WAIT_POLICY=active (ferry's one-token CPU kernel is OpenMP): is the spread
slower in generation, and why did one default run generate at 18 t/s (docs/performance.md, 2026-11-25, "A GPU smaller
than the model")?

  python benchmarks/fit_order.py MODEL.gguf CAP_GIB OUT.json
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import small_gpu


def main() -> None:
    model, cap, out = Path(sys.argv[1]), float(sys.argv[2]), Path(sys.argv[3])
    ballast = small_gpu.Ballast(int(cap * small_gpu.GIB))
    results: list[dict] = []

    def run(name: str, flags: list[str], env: dict | None = None) -> list[dict]:
        cmd = [sys.executable, "-m", "ferry", "bench", "-m", str(model), "-t", "16", "-r", "3", "-p", "512",
               "-n", "128", "-o", "json", *flags]
        r = subprocess.run(cmd, check=False, capture_output=True, text=True, env={**os.environ, **(env or {})})
        rows = json.loads(r.stdout) if r.returncode == 0 else []
        notes = [line for line in r.stderr.splitlines() if "auto" in line]
        results.append({"name": name, "flags": flags, "env": env or {}, "notes": notes,
                        "ts": {row["test"]: row["avg_ts"] for row in rows},
                        "samples": {row["test"]: row["samples_ts"] for row in rows},
                        "placement": rows[0]["placement"] if rows else r.stderr[-800:]})
        print(name, {k: round(v, 1) for k, v in results[-1]["ts"].items()}, *notes, sep="\n  ", flush=True)
        out.write_text(json.dumps(results, indent=1))
        return rows

    try:
        rows = run("default (first after synth)", [])
        first = small_gpu.stretch(rows[0]["placement"] if rows else "", small_gpu.block_count(model))
        run("first layers", first)
        run("default again", [])
        run("default OMP active", [], {"OMP_WAIT_POLICY": "active"})
        run("first OMP active", first, {"OMP_WAIT_POLICY": "active"})
        run("default again 2", [])
    finally:
        ballast.close()


if __name__ == "__main__":
    main()
