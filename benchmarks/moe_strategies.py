"""All on the GPU: prompt u-batches through each MoE strategy of CudaBackend (the Triton grouped GEMM on quantized
experts, every expert expanded to bf16 + torch's grouped GEMM, expert GEMVs), to place the switch between them.
  python benchmarks/moe_strategies.py -m model.gguf [-ub 128,512,2048,4096] [--strategies grouped,dense]
"""

import argparse
import statistics
import time

import torch

from ferry.gguf.file import GGUFFile
from ferry.models import load_model
from ferry.backends.cuda import CudaBackend
from ferry.runtime.engine import Engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-ub", default="128,512,2048,4096")
    ap.add_argument("--strategies", default="grouped,dense")
    ap.add_argument("-r", type=int, default=3)
    a = ap.parse_args()
    model = load_model(GGUFFile(a.model))
    print("| strategy | u-batch | ms per u-batch | t/s |")
    print("| --- | ---: | ---: | ---: |")
    for strategy in a.strategies.split(","):
        backend = CudaBackend(moe=strategy)
        for w in model.weights():
            backend.upload(w)
        for ub in [int(u) for u in a.ub.split(",")]:
            e = Engine(model, backend, n_ctx=ub + 1, n_batch=ub, n_ubatch=ub)
            tokens = torch.randint(0, model.args.n_vocab, (ub,)).tolist()
            times = []
            for i in range(a.r + 1):
                e.reset()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                e.decode(tokens)
                torch.cuda.synchronize()
                if i:
                    times.append(time.perf_counter() - t0)
            t = statistics.median(times)
            print(f"| {strategy} | {ub} | {1e3 * t:.2f} | {ub / t:.0f} |", flush=True)
        del backend
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
