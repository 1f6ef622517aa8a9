"""Reference outputs from llama.cpp (llama-cpp-python) for prompts on a GGUF file, as a .npz.

Runs in its own process: llama-cpp-python's libggml and ggml-python's libggml clash in one process.
Usage: python benchmarks/llamacpp_oracle.py MODEL OUT.npz PROMPT [PROMPT ...] [--n-greedy 20] [--ctx 512]
"""

import argparse

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("prompts", nargs="+")
    ap.add_argument("--n-greedy", type=int, default=20)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    from llama_cpp import Llama

    llm = Llama(a.model, n_ctx=a.ctx, n_threads=a.threads, logits_all=True, verbose=False)
    result = {}
    for i, prompt in enumerate(a.prompts):
        ids = llm.tokenize(prompt.encode(), add_bos=True, special=True)
        llm.reset()
        llm.eval(ids)
        result[f"tokens_{i}"] = np.array(ids)
        result[f"logits_{i}"] = np.array(llm.scores[: len(ids)], dtype=np.float32)
        greedy = []
        for t in llm.generate(ids, temp=0.0, top_k=1, reset=True):
            if len(greedy) >= a.n_greedy or llm.token_is_eog(t) if hasattr(llm, "token_is_eog") else t == llm.token_eos():
                break
            greedy.append(t)
        result[f"greedy_{i}"] = np.array(greedy)
    np.savez(a.out, **result)


if __name__ == "__main__":
    main()
