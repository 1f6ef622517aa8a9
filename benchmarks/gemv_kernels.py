"""The token-generation kernels alone, for one token: the quantized GEMV at the dense shapes of the benchmark
models (Q8_0) and the expert GEMVs (Q4_0, the router's n_expert_used experts; gpt-oss's also MXFP4 with its biases),
with their default configuration and a sweep of (rows per program, columns per step, warps) that chose it; the same
over K-quant blocks (`kquant`: Q4_K_M's dense types and experts, a sweep of rows per program and warps) beside what a
token cost before those kernels (the weight expanded to floats, then a matmul); the dense ones rewritten into
krows.py's rows (`krows`); the float32 router GEMV, attention over the cache (a sweep of cells per step and warps) and
the router's top-k. Prints a table, writes JSON. With --graphs the expert and K-quant kernels are
timed replayed in CUDA graphs, as a decode step runs them (do_bench's figures carry each call's launches).
  python benchmarks/gemv_kernels.py [--json out.json] [--only experts,kquant] [--graphs]
"""

import argparse
import itertools
import json

import numpy as np
import torch
from triton.testing import do_bench, do_bench_cudagraph

from ferry.gguf.synth import random_tensor
from ferry.kernels.cuda import attention, dequant, gemv, kquant, krows, layout, moe, route
from ferry.quant import Q

DENSE = {  # name: (cols, rows), Q8_0
    "qwen3 attn_q": (2048, 4096), "qwen3 attn_k": (2048, 512), "qwen3 attn_q|k|v": (2048, 5120), "qwen3 attn_output": (4096, 2048),
    "qwen3 output": (2048, 151936), "v2-lite attn_q": (2048, 3072), "v2-lite attn_kv_a": (2048, 576),
    "v2-lite shexp gate": (2048, 2816), "v2-lite shexp down": (2816, 2048),
}
EXPERTS = {"qwen3": (128, 8, 2048, 768), "v2-lite": (64, 6, 2048, 1408),  # n_expert, used, n_embd, n_ff
           "gpt-oss": (32, 4, 2880, 2880), "minimax-m2": (256, 8, 3072, 1536)}
SWEEP = list(itertools.product((1, 2, 4, 8, 16), (256, 512, 1024, 2048), (2, 4, 8)))
ATTENTION = {"qwen3": (32, 4, 128, 128), "v2-lite latent": (16, 1, 576, 512)}  # heads, kv heads, key and value size
ATTENTION_SWEEP = list(itertools.product((16, 32, 64, 128), (1, 2, 4, 8)))
KQUANT_SWEEP = list(itertools.product((1, 2, 4, 8, 16), (1, 2, 4, 8)))  # rows per program, warps
KROWS_SWEEP = list(itertools.product((1, 2, 4, 8), (1, 2), (1, 2)))  # rows, blocks a step, warps
K_DENSE = {"qwen3 attn_q": (Q.Q4_K, 2048, 4096), "qwen3 attn_output": (Q.Q4_K, 4096, 2048),
           "qwen3 attn_v": (Q.Q6_K, 2048, 512), "qwen3 output": (Q.Q6_K, 2048, 151936)}  # Q4_K_M's dense types


def _split(qtype: Q, n_blocks_shape: tuple[int, ...], ne: tuple[int, ...], dev) -> layout.Split:
    """Random blocks of qtype: quants uniform, scales around 0.01 (MXFP4: exponents 2^-8 .. 2^-6)."""
    rng = np.random.default_rng(sum(ne))
    n_blocks = int(np.prod(n_blocks_shape))
    width = 32 if qtype == Q.Q8_0 else 16
    qs = torch.from_numpy(rng.integers(0, 256, (n_blocks, width), dtype=np.uint8)).to(dev)
    if qtype == Q.MXFP4:
        d = torch.from_numpy(rng.integers(119, 122, n_blocks, dtype=np.uint8)).to(dev)
    else:
        d = torch.from_numpy((rng.uniform(0.5, 1.5, n_blocks) * 0.01).astype(np.float16)).to(dev)
    return layout.Split(qtype, ne, qs.view(torch.int8) if qtype == Q.Q8_0 else qs, d)


def _best(fn, timer=do_bench) -> tuple[tuple, float]:
    times = {}
    for cfg in SWEEP:
        try:
            times[cfg] = timer(lambda: fn(cfg))
        except Exception:  # a configuration the compiler refuses (registers, shared memory)
            continue
    return min(times.items(), key=lambda kv: kv[1])


def _kquant_bytes(qtype: Q, ne: tuple[int, ...], dev) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(random_tensor(qtype, ne, 1.0, np.random.default_rng(sum(ne))))
                            .view(np.uint8).reshape(-1).copy()).to(dev)


def _kquants(dev, report, timer=do_bench) -> None:
    """Q4_K_M's dense weights (Q4_K, Q6_K) and experts (gate and up Q4_K, down Q6_K) read in place, each against the
    weight expanded then multiplied (a token's cost before kernels/cuda/kquant.py; for experts, the whole layer expanded), and
    a Q5_K_M file's experts. timer: do_bench, or do_bench_cudagraph (--graphs: each call replayed in a CUDA graph, as
    a decode step runs it, without its launches' host time)."""
    def best(fn, sweep=KQUANT_SWEEP):
        times = {cfg: timer(lambda: fn(*cfg)) for cfg in sweep}
        return min(times.items(), key=lambda kv: kv[1])

    for name, (qtype, cols, rows) in K_DENSE.items():
        raw = _kquant_bytes(qtype, (cols, rows), dev)
        x = torch.randn(1, cols, device=dev)
        expanded = timer(lambda: x @ dequant.dequantize(raw, qtype, (cols, rows), torch.float32).T)
        print(f"  {name} {qtype.name} expanded then matmul: {1e3 * expanded:.1f} us", flush=True)
        report(f"{name} {qtype.name}", f"{rows}x{cols}", raw.numel(),
               timer(lambda: kquant.kgemv(raw, qtype, (cols, rows), x)), best(lambda br, w: kquant.kgemv(raw, qtype, (cols, rows), x, br, w)))
    n_expert, n_used, n_embd, n_ff = EXPERTS["qwen3"]
    x = torch.randn(1, n_embd, device=dev)
    ids = torch.randperm(n_expert, device=dev)[:n_used].view(1, -1).to(torch.int32)
    weights = torch.rand(1, n_used, device=dev)
    for mix, types in {"Q4_K_M": (Q.Q4_K, Q.Q4_K, Q.Q6_K), "Q5_K_M": (Q.Q5_K, Q.Q5_K, Q.Q6_K),
                       "Q4_K": (Q.Q4_K,) * 3}.items():
        tensors = tuple((_kquant_bytes(q, ne, dev), q, ne) for q, ne in zip(types, ((n_embd, n_ff, n_expert),
                                                                                    (n_embd, n_ff, n_expert),
                                                                                    (n_ff, n_embd, n_expert))))
        nbytes = sum(t.numel() for t, _, _ in tensors) * n_used / n_expert
        if mix == "Q4_K_M":
            layer = timer(lambda: [dequant.dequantize(t, q, ne, torch.bfloat16) for t, q, ne in tensors])
            print(f"  qwen3 Q4_K_M experts: expanding the layer alone {1e3 * layer:.1f} us", flush=True)
        report(f"qwen3 experts {mix}", f"{n_used} x 3 x {n_ff}x{n_embd}", nbytes,
               timer(lambda: kquant.kmoe_gemv(x, ids, weights, *tensors, "silu")),
               best(lambda br, w: kquant.kmoe_gemv(x, ids, weights, *tensors, "silu", rows_per_program=br, warps=w)))


def _krows(dev, report, timer=do_bench) -> None:
    """The same dense K-quant weights rewritten into krows.py's rows (KRows: scales unpacked, every load aligned), as
    the GPU backend holds them, beside _kquants' figures of their blocks read in place."""
    def best(fn):
        times = {}
        for cfg in KROWS_SWEEP:
            try:
                times[cfg] = timer(lambda: fn(*cfg))
            except Exception:  # a configuration the compiler refuses (registers, shared memory)
                continue
        return min(times.items(), key=lambda kv: kv[1])

    for name, (qtype, cols, rows) in K_DENSE.items():
        m = krows.KRows.of(_kquant_bytes(qtype, (cols, rows), dev), qtype, (cols, rows))
        x = torch.randn(1, cols, device=dev)
        report(f"{name} {qtype.name} rows", f"{rows}x{cols}", m.packed.numel(), timer(lambda: m.gemv(x)),
               best(lambda br, nb, wp: krows.rgemv(m.packed, qtype, (cols, rows), x, br, nb, wp)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default="gemv_kernels.json")
    ap.add_argument("--only", default="gemv,experts,kquant,krows,router,attention,route",
                    help="which kernels, comma-separated")
    ap.add_argument("--graphs", action="store_true",
                    help="time the expert and K-quant kernels replayed in CUDA graphs, as a decode step runs them")
    a = ap.parse_args()
    only = set(a.only.split(","))
    timer = do_bench_cudagraph if a.graphs else do_bench
    dev = torch.device("cuda")
    results = []
    print("| kernel | shape | default us | best us | best (rows, cols/step, warps) | GB/s default | GB/s best |")
    print("| --- | --- | ---: | ---: | --- | ---: | ---: |")

    def report(name, shape, nbytes, t_default, best):
        row = {"kernel": name, "shape": shape, "default_us": 1e3 * t_default, "best_us": 1e3 * best[1],
               "best": best[0], "gbps_default": nbytes / t_default / 1e6, "gbps_best": nbytes / best[1] / 1e6}
        results.append(row)
        print(f"| {name} | {shape} | {row['default_us']:.1f} | {row['best_us']:.1f} | {best[0]} | "
              f"{row['gbps_default']:.0f} | {row['gbps_best']:.0f} |", flush=True)

    torch.randn(8192, 8192, device=dev).matmul(torch.randn(8192, 8192, device=dev))  # clocks up before timing
    for name, (cols, rows) in DENSE.items() if "gemv" in only else ():
        w = _split(Q.Q8_0, (rows, cols // 32), (cols, rows), dev)
        x = torch.randn(1, cols, device=dev)
        report(name, f"{rows}x{cols}", rows * cols * 34 / 32, do_bench(lambda: gemv.gemv(w, x)),
               _best(lambda cfg: gemv.gemv(w, x, cfg)))
    for name, (n_expert, n_used, n_embd, n_ff) in EXPERTS.items() if "experts" in only else ():
        # Q4_0; gpt-oss's MXFP4 too (its exponent bytes split from its nibbles), with its biases and clamped SwiGLU
        for qtype in (Q.Q4_0, Q.MXFP4) if name == "gpt-oss" else (Q.Q4_0,):
            gate = _split(qtype, (n_expert, n_ff, n_embd // 32), (n_embd, n_ff, n_expert), dev)
            up = _split(qtype, (n_expert, n_ff, n_embd // 32), (n_embd, n_ff, n_expert), dev)
            down = _split(qtype, (n_expert, n_embd, n_ff // 32), (n_ff, n_embd, n_expert), dev)
            act, biases = "silu", None
            if qtype == Q.MXFP4:
                act, biases = "swiglu_oai", tuple(torch.randn(n_expert, r, device=dev) for r in (n_ff, n_ff, n_embd))
            x = torch.randn(1, n_embd, device=dev)
            ids = torch.randperm(n_expert, device=dev)[:n_used].view(1, -1).to(torch.int32)
            weights = torch.rand(1, n_used, device=dev)
            nbytes = n_used * 3 * n_embd * n_ff * (18 if qtype == Q.Q4_0 else 17) / 32
            report(f"{name} experts {qtype.name}", f"{n_used} x 3 x {n_ff}x{n_embd}", nbytes,
                   timer(lambda: moe.moe_gemv(x, ids, weights, gate, up, down, act, biases=biases)),
                   _best(lambda cfg: moe.moe_gemv(x, ids, weights, gate, up, down, act, config=cfg, biases=biases),
                         timer))
    if "kquant" in only:
        _kquants(dev, report, timer)
    if "krows" in only:
        _krows(dev, report, timer)
    for name, (n_expert, n_used, n_embd, _) in EXPERTS.items() if "router" in only else ():  # the f32 router
        w = torch.randn(n_expert, n_embd, device=dev)
        x = torch.randn(1, n_embd, device=dev)
        report(f"{name} router", f"{n_expert}x{n_embd} f32", n_expert * n_embd * 4, do_bench(lambda: gemv.gemv_float(w, x)),
               _best(lambda cfg: gemv.gemv_float(w, x, cfg)))
    for name, (heads, heads_kv, dk, dv) in ATTENTION.items() if "attention" in only else ():  # attention over a cache of `cells` f16 rows
        for cells in (64, 512, 4096):
            kc = torch.randn(cells, heads_kv * dk, device=dev).half().view(torch.uint8)
            q = torch.randn(1, heads, dk, device=dev)
            pos = torch.tensor([cells - 1], device=dev)
            base = torch.zeros(1, dtype=torch.int64, device=dev)

            def attend(cfg, splits=None):  # a cache of `cells` cells: flash-decoding's parts where it cuts it
                return attention.attention_decode(q, kc, kc, False, False, pos, base, heads_kv, dv, dk ** -0.5, 0, cfg,
                                                  n_cells=cells, splits=splits)

            # replayed as CUDA graphs: a split run is two launches of a few microseconds, which do_bench would time
            # as Python's launch cost
            times = {cfg: do_bench_cudagraph(lambda: attend(cfg)) for cfg in ATTENTION_SWEEP}
            one_pass = do_bench_cudagraph(lambda: attend(None, 1))
            print("  sweep:", {k: round(1e3 * v, 1) for k, v in times.items()}, f"one pass: {1e3 * one_pass:.1f}",
                  flush=True)
            best = min(times, key=times.get)
            results.append({"kernel": f"{name} attention", "shape": f"{cells} cells", "default_us": 1e3 * times[attention.ATTENTION_DECODE_CONFIG],
                            "best_us": 1e3 * times[best], "best": best, "one_pass_us": 1e3 * one_pass})
            print(f"| {name} attention | {cells} cells | {1e3 * times[attention.ATTENTION_DECODE_CONFIG]:.1f} | {1e3 * times[best]:.1f} | "
                  f"{best} (cells/step, warps); one pass {1e3 * one_pass:.1f} | | |", flush=True)
    for name, (n_expert, n_used, _, _) in EXPERTS.items() if "route" in only else ():  # the router's top-k
        logits = torch.randn(1, n_expert, device=dev)
        t = do_bench(lambda: route.route(logits, n_used, True, 1.0, "softmax", None))
        results.append({"kernel": f"{name} route", "shape": f"{n_expert} -> {n_used}", "default_us": 1e3 * t})
        print(f"| {name} route | {n_expert} -> {n_used} | {1e3 * t:.1f} | | | | |", flush=True)
    with open(a.json, "w") as fh:
        json.dump({"device": torch.cuda.get_device_name(), "results": results}, fh, indent=1)


if __name__ == "__main__":
    main()
