"""ferry ppl against ik_llama.cpp's llama-perplexity on files ik_llama.cpp's own llama-quantize writes in its types
(issue 39's bar: within 0.2%). A model (default: the embedded Gemma 3 270M, Q4_K_M, requantized with
--allow-requantize) is quantized by ik to each type of --types; both engines then score the same text with the same
-c / --chunks / -t, each in its own process. Both also score that file's weights as F32 (ik's own dequantization,
its llama-quantize to F32): the figure without the engines' rounding of activations, which says which engine the
quantized file's difference comes from. The text: the first 40 LICENSE files of this Python's site-packages, in
sorted order, concatenated (as docs/performance.md's 2026-11-22 Gemma comparison). Prints a table, writes JSON.
  python benchmarks/ik_ppl.py --ik ~/.cache/ferry-anchors/ik/build/bin [--types IQ4_KS,IQ2_KS] [--out r.json]
"""

import argparse
import json
import re
import site
import subprocess
import sys
import tempfile
from pathlib import Path

TYPES = "IQ4_KS,IQ5_KS,IQ4_KSS,IQ3_KS,IQ2_KS,IQ2_KL,IQ2_K,IQ3_K,IQ4_K,IQ5_K,IQ6_K"


def text(path: Path) -> Path:
    root = Path(site.getsitepackages()[0])
    files = sorted(p for p in root.glob("*/LICENSE*") if p.is_file())[:40]
    path.write_text("\n\n".join(p.read_text(errors="replace") for p in files))
    return path


def final_ppl(out: str) -> float:
    m = re.findall(r"Final estimate: PPL(?: over \d+ chunks for n_ctx=\d+)? = ([0-9.]+)", out)
    if not m:
        raise SystemExit(f"no final estimate in:\n{out[-2000:]}")
    return float(m[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ik", required=True, help="ik_llama.cpp's build/bin (llama-quantize, llama-perplexity)")
    ap.add_argument("-m", "--model", default=None, help="the model ik requantizes (default: the embedded Gemma)")
    ap.add_argument("--types", default=TYPES)
    ap.add_argument("-c", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("-t", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    ik = Path(a.ik).expanduser()
    if a.model is None:
        from ferry.runtime.loader import default_model

        a.model = str(default_model())
    args = ["-c", str(a.c), "--chunks", str(a.chunks), "-t", str(a.t)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        corpus = text(Path(tmp) / "text.txt")
        for name in a.types.split(","):
            q = Path(tmp) / f"{name}.gguf"
            subprocess.run([str(ik / "llama-quantize"), "--allow-requantize", a.model, str(q), name, str(a.t)],
                           check=True, capture_output=True, cwd=tmp)
            f32 = Path(tmp) / f"{name}-f32.gguf"
            subprocess.run([str(ik / "llama-quantize"), "--allow-requantize", str(q), str(f32), "F32", str(a.t)],
                           check=True, capture_output=True, cwd=tmp)
            row = {"type": name, "bytes": q.stat().st_size}
            for key, model in (("", q), ("_f32", f32)):
                theirs = subprocess.run([str(ik / "llama-perplexity"), "-m", str(model), "-f", str(corpus), *args],
                                        capture_output=True, text=True, cwd=tmp)
                mine = subprocess.run([sys.executable, "-m", "ferry", "ppl", "-m", str(model), "-f", str(corpus),
                                       *args], capture_output=True, text=True)
                if mine.returncode:
                    raise SystemExit(f"ferry ppl failed on {model.name}: {mine.stderr.strip()[-500:]}")
                if not key:
                    row["ik_types_in_file"] = re.findall(r"tensors in ik_llama.cpp's (\w+)", mine.stderr)
                row["ik" + key], row["ferry" + key] = final_ppl(theirs.stdout + theirs.stderr), final_ppl(mine.stdout)
            f32.unlink()
            row["ratio"] = row["ferry"] / row["ik"]
            rows.append(row)
            print(f"{name}: ik {row['ik']:.4f}, ferry {row['ferry']:.4f} ({100 * (row['ratio'] - 1):+.3f}%); as F32 "
                  f"ik {row['ik_f32']:.4f}, ferry {row['ferry_f32']:.4f}", flush=True)
    print("\n| requantized to | ik's types in the file | ik_llama.cpp | ferry | ferry / ik | as F32: ik_llama.cpp | "
          "ferry |\n| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['type']} | {', '.join(r['ik_types_in_file'])} | {r['ik']:.4f} | {r['ferry']:.4f} | "
              f"{r['ratio']:.5f} | {r['ik_f32']:.4f} | {r['ferry_f32']:.4f} |")
    if a.out:
        Path(a.out).write_text(json.dumps({"model": a.model, "args": args, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
