"""Two source trees of ferry side by side in one call: `ferry bench` of each, in separate processes taken in turn (A B B
A ...), every row's samples pooled per tree and compared with `ferry compare`'s Welch test. For checking that a change
(a refactor, a new default) leaves the speed where it was, on the same machine and file in the same call.

  python benchmarks/ab_trees.py --a OLD_TREE --b NEW_TREE [--rounds 2] [--json out.json] -- BENCH_ARGS...
A tree is a folder holding the `ferry` package (e.g. `git archive COMMIT ferry | tar -x -C old`)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ferry.tools.compare import welch  # noqa: E402


def bench(tree: Path, args: list[str]) -> list[dict]:
    """One `ferry bench -o json` process on `tree`'s ferry: its rows."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree.resolve()), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-m", "ferry", "bench", *args, "-o", "json"], capture_output=True, text=True,
                       env=env, cwd=tree)
    if r.returncode != 0:
        raise SystemExit(f"ferry bench on {tree} failed ({r.returncode}): {r.stderr[-2000:]}")
    return json.loads(r.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--a", required=True, type=Path, help="the baseline tree")
    ap.add_argument("--b", required=True, type=Path, help="the tree under test")
    ap.add_argument("--rounds", type=int, default=2, help="processes per tree, in turn")
    ap.add_argument("--json", help="write every sample and the comparison here")
    ap.add_argument("bench", nargs=argparse.REMAINDER, help="-- then ferry bench's arguments")
    a = ap.parse_args()
    args = a.bench[1:] if a.bench[:1] == ["--"] else a.bench
    samples: dict[str, dict[str, list[float]]] = {"a": {}, "b": {}}
    for i in range(a.rounds):
        for side in ("a", "b") if i % 2 == 0 else ("b", "a"):
            for row in bench(getattr(a, side), args):
                key = f"{row['test']} ub{row['n_ubatch']}" if row["n_prompt"] else row["test"]
                samples[side].setdefault(key, []).extend(row["samples_ts"])
                print(f"round {i + 1} {side}: {key} {row['avg_ts']:.2f} t/s", file=sys.stderr, flush=True)
    rows = []
    print("| test | A t/s | B t/s | B / A [95%] | verdict |")
    print("| --- | ---: | ---: | ---: | --- |")
    for key, base in samples["a"].items():
        new = samples["b"][key]
        c = welch(base, new, key)
        rows.append({"test": key, "a": base, "b": new, "ratio": c.ratio, "low": c.ci_low, "high": c.ci_high,
                     "verdict": c.verdict})
        print(f"| {key} | {sum(base) / len(base):.2f} | {sum(new) / len(new):.2f} | {c.ratio:.3f} "
              f"[{c.ci_low:.3f}, {c.ci_high:.3f}] | {c.verdict} |")
    if a.json:
        Path(a.json).write_text(json.dumps({"a": str(a.a), "b": str(a.b), "args": args, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
