"""Where -mla 3 should switch a prompt u-batch from absorbed to expanded attention, measured: one u-batch of n tokens
over a cache already holding d positions, timed in both forms on the same model (all on one GPU by default), against
the form ferry picks: on the GPU by timing both on the first u-batches of each size class (executor.LatentForms), on
the CPU by the multiply-add count (LatentAttention.expand_from: 171 tokens at DeepSeek's shapes).
  python benchmarks/mla_crossover.py -m deepseek-v2-lite.gguf [-ub 16,32,64,128,256,512] [-d 0,4096,16384] [-r 5]
Each (n, d, form) runs on its own engine (CUDA graphs are recorded per form), twice as a warm-up, then -r times after
the cache is cut back to d; the table gives the median in ms and absorbed / expanded (above 1: expanding is faster).
On the GPU a third engine picks as ferry does (its warm-up runs are where it times the forms): its median, the form
it kept, and its time over the faster form's.
"""

import argparse
import json
import statistics
import time

import torch

from ferry.runtime.loader import RunConfig, load
from ferry.layers.attention import LatentAttention
from ferry.offload.policy import Explorer
from ferry.runtime.engine import Engine

_RULE = LatentAttention.expand_from


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(model, backend, tokens: list[int], depth: int, n: int, form: str | None, reps: int) -> tuple[float, str]:
    """(median ms of one n-token u-batch at cache depth `depth`, the form it ran): `form` absorbed or expanded
    (the CPU's rule and the GPU's choice both forced), or None: as ferry picks on the GPU, by timing."""
    if form is not None:
        LatentAttention.expand_from = property(lambda self: 1 if form == "expanded" else 1 << 30)
    try:
        e = Engine(model, backend, n_ctx=depth + n, n_batch=max(n, 512), n_ubatch=max(n, 512))
        forms = getattr(e.runner, "latent_forms", None)
        if forms is not None and form is not None:
            forms.fixed = lambda n_tokens, n_kv: form
        if depth:
            e.decode(tokens[:depth])
        e.n_ubatch = e.n_batch = n
        times = []
        for i in range(reps + 2):
            e.truncate(depth)
            _sync()
            t0 = time.perf_counter()
            e.decode(tokens[depth:depth + n])
            _sync()
            if i >= 2:
                times.append(1e3 * (time.perf_counter() - t0))
        if form is None:  # the GPU's timed choice for this class
            form = forms.explorer.chosen.get(Explorer.key(n, depth + n), "undecided")
        return statistics.median(times), form
    finally:
        LatentAttention.expand_from = _RULE


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-ub", default="16,32,64,128,256,512")
    ap.add_argument("-d", default="0,4096,16384")
    ap.add_argument("-r", type=int, default=5)
    ap.add_argument("-ngl", type=int, default=999)
    ap.add_argument("--json", default="mla_crossover.json")
    a = ap.parse_args()
    ubs, depths = [int(v) for v in a.ub.split(",")], [int(v) for v in a.d.split(",")]
    loaded = load(RunConfig(a.model, n_threads=16, quiet=True, n_gpu_layers=a.ngl, mla=3,
                            n_ctx=max(depths) + max(ubs), n_ubatch=max(max(ubs), 512)))
    backend, model = loaded.backend, loaded.model
    attn = model.latent_layers()[0]
    tokens = torch.randint(0, model.args.n_vocab, (max(depths) + max(ubs),)).tolist()
    rows = []
    gpu = a.ngl > 0 and torch.cuda.is_available()
    print(f"ferry picks {'by timing both forms (GPU)' if gpu else 'by multiply-adds (CPU)'}; multiply-adds: expand "
          f"from {attn.expand_from} tokens (lora {attn.kv_lora_rank}, nope {attn.head_dim_nope}, v {attn.head_dim_v})")
    print("| depth | u-batch | absorbed ms | expanded ms | absorbed / expanded | ferry ms | ferry's form | "
          "ferry / best |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |")
    for d in depths:
        for n in ubs:
            absorbed, _ = _timed(model, backend, tokens, d, n, "absorbed", a.r)
            expanded, _ = _timed(model, backend, tokens, d, n, "expanded", a.r)
            if gpu:
                picked, form = _timed(model, backend, tokens, d, n, None, a.r)
            else:  # the CPU's rule (ggml fixes the form when it builds a graph): that form's time
                form = "expanded" if n >= attn.expand_from else "absorbed"
                picked = expanded if form == "expanded" else absorbed
            best = min(absorbed, expanded)
            rows.append({"depth": d, "ubatch": n, "absorbed_ms": absorbed, "expanded_ms": expanded, "ferry_ms": picked,
                         "form": form, "picked_over_best": picked / best})
            print(f"| {d} | {n} | {absorbed:.3f} | {expanded:.3f} | {absorbed / expanded:.2f} | {picked:.3f} | {form} | "
                  f"{picked / best:.2f} |", flush=True)
    with open(a.json, "w") as f:
        json.dump({"model": a.model, "expand_from": attn.expand_from, "gpu": gpu, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
