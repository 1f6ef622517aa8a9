"""Where a hybrid decode step's time goes between its host steps (experts in RAM, CUDA graphs between them, as a
real run decodes): per MoE layer, the wait for the GPU segment before it (attention, router, the previous layer's
result upload), the host step itself (ggml on the routed experts and the bookkeeping around it), and the time
outside host steps (graph launches, the step's start and end). Only perf_counter around the host steps, whose
one synchronize is moved ahead of them to time the wait.
  python benchmarks/decode_steps.py -m model.gguf [-t 16] [--policy all=off] [-n 32]
"""

import argparse
import time

import torch

from ferry.cli import GpuOptions, open_model
from ferry.runtime.engine import Engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-t", "--threads", type=int, default=16)
    ap.add_argument("--policy", default="all=off")
    ap.add_argument("-n", type=int, default=32)
    a = ap.parse_args()
    _, backend, model, _ = open_model(a.model, a.threads, True, a.threads, True, True,
                                      GpuOptions(999, ["exps=CPU"], a.policy), 4096, 512)
    times = {"wait": 0.0, "host": 0.0, "ggml": 0.0, "calls": 0}
    original = backend._experts

    def timed_experts(*args, **kw):
        t0 = time.perf_counter()
        torch.cuda.current_stream(backend.device).synchronize()
        t1 = time.perf_counter()
        out = original(*args, **kw)
        t2 = time.perf_counter()
        times["wait"] += t1 - t0
        times["host"] += t2 - t1
        times["calls"] += 1
        return out

    def timed_ggml(fn):
        def timed(*args, **kw):
            t0 = time.perf_counter()
            out = fn(*args, **kw)
            times["ggml"] += time.perf_counter() - t0
            return out
        return timed

    backend._experts = timed_experts
    for name in ("moe_experts", "moe_up_gate", "moe_down"):  # the whole experts, or a half of each (halves set apart)
        setattr(backend.cpu, name, timed_ggml(getattr(backend.cpu, name)))
    e = Engine(model, backend, n_ctx=4096, n_batch=512, n_ubatch=512)
    e.decode(torch.randint(0, model.args.n_vocab, (64,)).tolist())
    for _ in range(3):
        e.decode([1])
    for k in times:
        times[k] = 0
    t0 = time.perf_counter()
    for i in range(a.n):
        e.decode([int(i) % model.args.n_vocab])
    torch.cuda.synchronize(backend.device)
    total = time.perf_counter() - t0
    per_tok = total / a.n
    calls = times["calls"] / a.n
    print(f"{a.policy}: {a.n / total:.2f} t/s, {1e3 * per_tok:.3f} ms per token, {calls:.0f} MoE host steps per token")
    print("| part | ms per token | ms per MoE layer |")
    print("| --- | ---: | ---: |")
    outside = per_tok - (times["wait"] + times["host"]) / a.n
    for name, v in (("wait for the GPU segment", times["wait"] / a.n), ("host step", times["host"] / a.n),
                    ("  of which ggml", times["ggml"] / a.n), ("outside host steps", outside)):
        print(f"| {name} | {1e3 * v:.3f} | {1e3 * v / max(calls, 1):.3f} |")
    for size, way in sorted(backend.explorer.chosen.items()):  # auto: what its trials measured and kept
        print(f"auto, u-batches up to {size}: {way} ({backend.explorer.why(size)})")
    backend.close()


if __name__ == "__main__":
    main()
