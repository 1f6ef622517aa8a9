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

    result = {}
    for i, prompt in enumerate(a.prompts):
        # a fresh context per prompt: llama-cpp-python 0.3.36's reset() leaves the KV cache unusable
        llm = Llama(a.model, n_ctx=a.ctx, n_threads=a.threads, logits_all=True, verbose=False)
        ids = llm.tokenize(prompt.encode(), add_bos=True, special=True)
        llm.eval(ids)
        result[f"tokens_{i}"] = np.array(ids)
        result[f"logits_{i}"] = np.array(llm.scores[: len(ids)], dtype=np.float32)
        greedy = []
        for _ in range(a.n_greedy):
            t = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            if llm.token_is_eog(t) if hasattr(llm, "token_is_eog") else t == llm.token_eos():
                break
            greedy.append(t)
            llm.eval([t])
        result[f"greedy_{i}"] = np.array(greedy)
        del llm
    np.savez(a.out, **result)


if __name__ == "__main__":
    main()
