"""Where a hybrid decode step's time goes (experts in RAM, as a real run decodes): per token and per MoE layer, the
graph launches, the host steps and the time outside them. A host step that cuts the graphs (FERRY_HANDSHAKES=0, or a
step that needs the GPU's data) is split into the wait for the GPU segment before it and the step itself; a host step
the graph waits at (a handshake) into the wait for the graph to reach it and the step. Then the last token's ggml
calls again, back to back and with a spin of --gap us after each (as long as a GPU segment): what ggml alone takes
of a token, and what an idle gap between two layers' ggml costs it; and the expert bytes the CPU read per token
(its live pairs' up, gate and down) over the time in its expert calls. Only perf_counter around the steps.
Experts in RAM by default; with --gpu-memory the fit places them as a plain run does on a GPU of that size.
  python benchmarks/decode_steps.py -m model.gguf [-t 16] [--policy all=off] [-n 32] [--gap 100]
      [--gpu-memory CUDA0=12GiB]
"""

import argparse
import time

import torch

from ferry.runtime.loader import RunConfig, load
from ferry.runtime.engine import Engine
from ferry.weight import Weight


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-t", "--threads", type=int, default=16)
    ap.add_argument("--policy", default="all=off")
    ap.add_argument("-n", type=int, default=32)
    ap.add_argument("--gap", type=float, default=100.0, help="us spun after each ggml call when replayed alone")
    ap.add_argument("--gpu-memory", help="fit the experts to a GPU of this size (CUDA0=12GiB) instead of -ot exps=CPU")
    a = ap.parse_args()
    placement = (dict(gpu_memory=(a.gpu_memory,)) if a.gpu_memory
                 else dict(n_gpu_layers=999, override_tensor=["exps=CPU"]))
    loaded = load(RunConfig(a.model, n_threads=a.threads, quiet=True, offload_policy=a.policy, n_ctx=4096,
                            n_ubatch=512, **placement))
    backend, model = loaded.backend, loaded.model
    parts = ("launch", "cut wait", "cut step", "handshakes", "ggml")
    times = dict.fromkeys(parts, 0.0)
    steps = {"cut": 0, "handshake": 0}
    last: list = []  # the last token's ggml calls: (function, args, keywords)
    read = [0]  # expert bytes the CPU's calls read: their live pairs'

    def add(part: str, fn):
        def timed(*args, **kw):
            t0 = time.perf_counter()
            out = fn(*args, **kw)
            times[part] += time.perf_counter() - t0
            return out
        return timed

    def cut_step(fn):  # its one synchronize moved ahead of it, to time the wait apart
        def timed():
            t0 = time.perf_counter()
            torch.cuda.current_stream(backend.device).synchronize()
            times["cut wait"] += time.perf_counter() - t0
            add("cut step", fn)()
        return timed

    def ggml(fn):
        def called(*args, **kw):
            last.append((fn, args, kw))
            out = add("ggml", fn)(*args, **kw)
            ids, mats = args[1], [w for w in args if isinstance(w, Weight)]
            read[0] += int((ids >= 0).sum()) * sum(w.data.nbytes for w in mats) // mats[0].ne[2]
            return out
        return called

    for name in ("moe_experts", "moe_up_gate", "moe_down"):  # the whole experts, or a half of each (halves set apart)
        setattr(backend.cpu, name, ggml(getattr(backend.cpu, name)))
    e = Engine(model, backend, n_ctx=4096, n_batch=512, n_ubatch=512)
    e.decode(torch.randint(0, model.args.n_vocab, (64,)).tolist())
    for _ in range(3):
        e.decode([1])
    for c in e.runner._captured.values():  # the recorded decode step: time each of its steps
        recorded = getattr(c.graph, "steps", [])
        for i, step in enumerate(recorded):
            name = getattr(step, "__name__", "")
            if name in ("launch", "replay"):
                recorded[i] = add("launch", step)
            elif name == "serve":
                recorded[i] = add("handshakes", step)
            else:
                recorded[i] = cut_step(step)
                steps["cut"] += 1
        steps["handshake"] += getattr(c.graph, "n_handshakes", 0)
    for k in times:
        times[k] = 0.0
    read[0] = 0
    t0 = time.perf_counter()
    for i in range(a.n):
        last.clear()
        e.decode([int(i) % model.args.n_vocab])
    torch.cuda.synchronize(backend.device)
    total = time.perf_counter() - t0
    per_tok = total / a.n
    n_moe = sum(1 for b in model.blocks if hasattr(b.ffn, "gate_exps"))
    print(f"{a.policy}: {a.n / total:.2f} t/s, {1e3 * per_tok:.3f} ms per token, {n_moe} MoE layers, "
          f"{steps['cut']} cut host steps and {steps['handshake']} handshakes per step")
    print("| part | ms per token | ms per MoE layer |")
    print("| --- | ---: | ---: |")
    served = times["launch"] + times["cut wait"] + times["cut step"] + times["handshakes"]
    rows = (("graph launches", times["launch"]), ("cut host steps: wait for the GPU segment", times["cut wait"]),
            ("cut host steps: the step", times["cut step"]),
            ("handshakes: waits and steps", times["handshakes"]), ("the CPU's expert calls (in either)", times["ggml"]),
            ("outside the steps", total - served))
    for name, v in rows:
        print(f"| {name} | {1e3 * v / a.n:.3f} | {1e3 * v / a.n / n_moe:.3f} |")
    if times["ggml"]:
        print(f"the CPU's expert calls read {read[0] / a.n / 1e6:.1f} MB per token at "
              f"{read[0] / times['ggml'] / 1e9:.1f} GB/s")
    if last:
        calls_of_token = [(fn, [t.clone() if isinstance(t, torch.Tensor) else t for t in args], kw)
                          for fn, args, kw in last]
        for gap in (0.0, a.gap):
            rounds, t0 = 8, time.perf_counter()
            for _ in range(rounds):
                for fn, args, kw in calls_of_token:
                    fn(*args, **kw)
                    end = time.perf_counter() + gap * 1e-6
                    while time.perf_counter() < end:
                        pass
            alone = (time.perf_counter() - t0) / rounds - len(calls_of_token) * gap * 1e-6
            print(f"ggml alone, {gap:.0f} us spun after each call: {1e3 * alone:.3f} ms per token, "
                  f"{1e3 * alone / len(calls_of_token):.3f} ms per call")
    for size, way in sorted(backend.explorer.chosen.items()):  # auto: what its trials measured and kept
        print(f"auto, u-batches up to {size}: {way} ({backend.explorer.why(size)})")
    backend.close()


if __name__ == "__main__":
    main()
