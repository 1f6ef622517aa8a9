"""Gemma 3 270M: ferry against llama.cpp (llama-cpp-python) on the same file and prompts.

Prints a table (tokenization, per-position KL of next-token distributions, top-1 agreement, greedy
continuations) and writes JSON. llama.cpp runs in a subprocess (two libggml copies clash in one).
Needs llama-cpp-python; on this Xeon build it without AMX (its AMX matmul segfaults here):
  CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON \
    -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON" pip install llama-cpp-python==0.3.36
Usage: python benchmarks/gemma_agreement.py [--out results.json]
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small  village,",
           "The capital of Germany is Berlin. The capital of France is"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gemma_agreement.json")
    ap.add_argument("--n-greedy", type=int, default=20)
    a = ap.parse_args()
    from ferry.runtime.loader import RunConfig, default_model, load
    from ferry.runtime.engine import Engine
    from ferry.tokenizer import Tokenizer

    path = default_model()
    with tempfile.TemporaryDirectory() as tmp:
        ref_file = Path(tmp) / "ref.npz"
        subprocess.run([sys.executable, str(Path(__file__).with_name("llamacpp_oracle.py")), str(path), str(ref_file),
                        *PROMPTS, "--n-greedy", str(a.n_greedy)], check=True, stderr=subprocess.DEVNULL)
        ref = dict(np.load(ref_file))
    loaded = load(RunConfig(path, quiet=True, n_gpu_layers=0))
    f, backend, model = loaded.file, loaded.backend, loaded.model
    tok = Tokenizer(f)
    rows = []
    for i, prompt in enumerate(PROMPTS):
        ids = tok.encode(prompt)
        engine = Engine(model, backend, 512)
        logits = engine.decode(ids, all_logits=True)
        lp_ref = torch.log_softmax(torch.tensor(ref[f"logits_{i}"]).double(), -1)
        lp = torch.log_softmax(logits.double(), -1)
        kl = (lp_ref.exp() * (lp_ref - lp)).sum(-1)
        engine.reset()
        out, last = [], engine.decode(ids)
        for _ in range(len(ref[f"greedy_{i}"])):
            t = int(last[-1].argmax())
            out.append(t)
            last = engine.decode([t])
        greedy_ref = ref[f"greedy_{i}"].tolist()
        same = next((k for k, (x, y) in enumerate(zip(out, greedy_ref)) if x != y), len(greedy_ref))
        rows.append({"prompt": prompt, "tokens_equal": ids == ref[f"tokens_{i}"].tolist(), "n_tokens": len(ids),
                     "kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
                     "top1_agree": float((lp.argmax(-1) == lp_ref.argmax(-1)).double().mean()),
                     "greedy_equal_prefix": same, "greedy_len": len(greedy_ref),
                     "ferry": tok.decode(out), "llama.cpp": tok.decode(greedy_ref)})
    Path(a.out).write_text(json.dumps(rows, indent=1))
    print("| prompt | tokens equal | KL mean | KL max | top-1 agree | greedy tokens equal |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['prompt'][:40]!r} | {r['tokens_equal']} | {r['kl_mean']:.4f} | {r['kl_max']:.4f} | "
              f"{r['top1_agree']:.2f} | {r['greedy_equal_prefix']}/{r['greedy_len']} |")


if __name__ == "__main__":
    main()
