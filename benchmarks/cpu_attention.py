"""Attention over a float16 (or Q8_0) cache on the CPU: ferry's kernel (moe_experts.c's ferry_attention) against
ggml's flash attention (the tree ggml-python was built on, llama.cpp's kernel) on the same queries, keys, values and
causal mask, in one process, both as one node of a ggml graph run by ggml's threads.

Cases are the models' shapes at the sizes a run meets: a prompt's u-batch over the cache before it (queries, cached
positions), and decode steps (one query). Per case: the median ms of each, GFLOP/s (4 d a score, the open ones only)
and ggml / ferry.
  python benchmarks/cpu_attention.py [-t 2] [--json FILE]
"""

import argparse
import ctypes
import json
import sys
from pathlib import Path

import ggml
import numpy as np

from ferry.kernels.cpu import native
from ferry.quant import Q, quantize

sys.path.insert(0, str(Path(__file__).parent))
from profile_hybrid import best  # noqa: E402  (the median of timed calls after a warm-up one)

# (name, queries, cached positions after them, heads, key heads, head size, cache type)
CASES = [
    ("gemma3-270m chat turn", 40, 672, 4, 1, 256, "f16"),
    ("gemma3-270m pp512", 512, 512, 4, 1, 256, "f16"),
    ("gemma3-270m decode at 672", 1, 672, 4, 1, 256, "f16"),
    ("qwen3-30b pp2048's last u-batch", 512, 2048, 32, 4, 128, "f16"),
    ("qwen3-30b pp2048's last u-batch, q8_0 cache", 512, 2048, 32, 4, 128, "q8_0"),
    ("qwen3-30b 64 queries at 2048", 64, 2048, 32, 4, 128, "f16"),
    ("qwen3-30b 8 queries at 2048", 8, 2048, 32, 4, 128, "f16"),
    ("qwen3-30b decode at 2048", 1, 2048, 32, 4, 128, "f16"),
    ("qwen3-30b decode at 2048, q8_0 cache", 1, 2048, 32, 4, 128, "q8_0"),
    ("gpt-oss pp512", 512, 512, 64, 8, 64, "f16"),
]


class Case:
    """One case's tensors, and a graph per engine computing the attention of all queries."""

    def __init__(self, n: int, n_kv: int, heads: int, kv_heads: int, d: int, cache: str, threads: int):
        rng = np.random.default_rng(0)
        kv = [rng.standard_normal((kv_heads, n_kv, d)).astype(np.float32) for _ in range(2)]  # (d, n_kv, kv_heads)
        kv_type = ggml.GGML_TYPE_Q8_0 if cache == "q8_0" else ggml.GGML_TYPE_F16
        self.arrays = [rng.standard_normal((n, heads, d)).astype(np.float32)]  # ggml (d, heads, n)
        self.arrays += [quantize(x.reshape(-1, d), Q.Q8_0) if cache == "q8_0" else x.astype(np.float16) for x in kv]
        pos = np.arange(n) + n_kv - n
        self.arrays.append(np.where(np.arange(n_kv)[None] <= pos[:, None], 0, -np.inf).astype(np.float16))
        self.flops = 4 * heads * d * int((pos + 1).sum())
        self.n, self.threads, self.scale = n, threads, d ** -0.5
        self.ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=16 << 20, mem_buffer=None, no_alloc=True))
        shapes = [(ggml.GGML_TYPE_F32, (d, heads, n)), (kv_type, (d, n_kv, kv_heads)), (kv_type, (d, n_kv, kv_heads)),
                  (ggml.GGML_TYPE_F16, (n_kv, n))]
        self.leaves = []
        for (t, ne), a in zip(shapes, self.arrays):
            leaf = ggml.ggml_new_tensor(self.ctx, t, len(ne), (ctypes.c_int64 * len(ne))(*ne))
            leaf.contents.data = ctypes.c_void_p(a.ctypes.data)
            self.leaves.append(leaf)
        self.keep: list = []

    def graph(self, ferry: bool):
        q, k, v, mask = self.leaves
        if ferry:
            out = native.Attention(native.library(), self.threads).node(self.ctx, q, k, v, mask, None, self.scale,
                                                                         self.threads, self.keep)
        else:
            out = ggml.ggml_flash_attn_ext(self.ctx, ggml.ggml_permute(self.ctx, q, 0, 2, 1, 3), k, v, mask,
                                           self.scale, 0.0, 0.0)
            ggml.ggml_flash_attn_ext_set_prec(out, ggml.GGML_PREC_F32)
        result = np.zeros(self.arrays[0].shape, np.float32)
        out.contents.data = ctypes.c_void_p(result.ctypes.data)
        gf = ggml.ggml_new_graph(self.ctx)
        ggml.ggml_build_forward_expand(gf, out)
        plan = ggml.ggml_graph_plan(gf, self.threads, None)
        work = np.zeros(max(plan.work_size, 1), np.uint8)
        plan.work_data = ctypes.cast(work.ctypes.data, ctypes.POINTER(ctypes.c_uint8))
        self.keep += [plan, work, gf]
        return (lambda: ggml.ggml_graph_compute(gf, ctypes.pointer(plan))), result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-r", "--reps", type=int, default=7)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    if native.library() is None:
        raise SystemExit(f"ferry's CPU kernels do not run here: {native.why_not()}")
    rows = []
    print("| case | queries | cached | ferry ms | ggml ms | ferry GFLOP/s | ggml GFLOP/s | ggml / ferry | rel. diff |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, n, n_kv, heads, kv_heads, d, cache in CASES:
        case = Case(n, n_kv, heads, kv_heads, d, cache, args.threads)
        (run_f, out_f), (run_g, out_g) = case.graph(True), case.graph(False)
        # the engines in turn, twice, each timing its median
        t_f = min(best(run_f, args.reps), best(run_f, args.reps))
        t_g = min(best(run_g, args.reps), best(run_g, args.reps))
        diff = float(np.linalg.norm(out_f - out_g) / np.linalg.norm(out_g))
        row = dict(case=name, queries=n, cached=n_kv, heads=heads, kv_heads=kv_heads, d=d, cache=cache,
                   threads=args.threads, ferry_ms=1e3 * t_f, ggml_ms=1e3 * t_g, ratio=t_g / t_f, rel_diff=diff)
        rows.append(row)
        print(f"| {name} | {n} | {n_kv} | {1e3 * t_f:.3f} | {1e3 * t_g:.3f} | {case.flops / t_f / 1e9:.1f} | "
              f"{case.flops / t_g / 1e9:.1f} | {t_g / t_f:.2f} | {diff:.1e} |", flush=True)
        ggml.ggml_free(case.ctx)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
