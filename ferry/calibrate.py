"""`ferry calibrate`: measures this machine for the offload policy (policy.Calibration): how fast the CPU reads
quantized weights (GEMV) and multiplies batches through ggml, and, where a CUDA GPU is visible, pinned
host-to-device bandwidth and latency, GPU memory bandwidth and matmul throughput. Stored per machine."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import numpy as np
import torch

from ferry.errors import FerryError
from ferry.policy import Calibration

CACHE = Path(os.environ.get("FERRY_CACHE", Path.home() / ".cache" / "ferry"))


def default_path() -> Path:
    return CACHE / f"calibration-{platform.node() or 'machine'}.json"


def _best(fn, reps: int) -> float:
    """The fastest of `reps` timed runs after one warm-up (seconds)."""
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_cpu(threads: int, quick: bool = False) -> dict:
    """ggml on this CPU: Q4_0 GEMV bytes/s over a weight larger than the caches (smaller with quick), and
    Q4_0 x 512-token matmul FLOP/s."""
    from ferry.gguf.synth import random_tensor
    from ferry.ops import Weight
    from ferry.ops.cpu import CpuBackend
    from ferry.quant import Q

    backend = CpuBackend(threads)
    rng = np.random.default_rng(0)
    rows, cols = (4096, 4096) if quick else (65536, 16384)  # 9 MB / 604 MB of Q4_0
    w = Weight("calibration", Q.Q4_0, (cols, rows), random_tensor(Q.Q4_0, (cols, rows), 1.0, rng))
    backend.repack(w)
    x1 = torch.randn(1, cols)
    gemv_s = _best(lambda: backend.linear(x1, w), 3 if quick else 5)
    n, k, m = 512, 4096, 4096
    wb = Weight("calibration-batch", Q.Q4_0, (k, m), random_tensor(Q.Q4_0, (k, m), 1.0, rng))
    backend.repack(wb)
    xb = torch.randn(n, k)
    gemm_s = _best(lambda: backend.linear(xb, wb), 2 if quick else 3)
    backend.close()
    return {"cpu_bytes_per_s": w.data.nbytes / gemv_s, "cpu_flops": 2.0 * n * k * m / gemm_s, "threads": backend.n_threads}


def measure_gpu(quick: bool = False) -> dict | None:
    """Pinned H2D bandwidth (large copies) and latency (small ones), device copy bandwidth, bf16 matmul
    FLOP/s; None without a CUDA GPU."""
    if not torch.cuda.is_available():
        return None
    dev = torch.device("cuda:0")
    size = (64 if quick else 1024) << 20
    host = torch.empty(size, dtype=torch.uint8).pin_memory()
    gpu = torch.empty(size, dtype=torch.uint8, device=dev)

    def timed(fn) -> float:
        torch.cuda.synchronize()
        return _best(lambda: (fn(), torch.cuda.synchronize()), 5)

    h2d_s = timed(lambda: gpu.copy_(host, non_blocking=True))
    small = 4096
    lat_s = timed(lambda: [gpu[:small].copy_(host[:small], non_blocking=True) for _ in range(100)]) / 100
    d2d_s = timed(lambda: gpu[size // 2:].copy_(gpu[:size // 2]))
    n = 4096 if quick else 8192
    a = torch.randn(n, n, dtype=torch.bfloat16, device=dev)
    mm_s = timed(lambda: a @ a)
    return {"h2d_bytes_per_s": size / h2d_s, "h2d_latency_s": lat_s, "gpu_bytes_per_s": size / d2d_s,
            "gpu_flops": 2.0 * n ** 3 / mm_s, "gpu_name": torch.cuda.get_device_name(0)}


def calibrate(threads: int, quick: bool = False) -> dict:
    return {"machine": platform.node(), "cpu": measure_cpu(threads, quick), "gpu": measure_gpu(quick),
            "quick": quick, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


def save(result: dict, path: Path) -> None:
    from ferry.tools.files import atomic_file

    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path) as tmp:
        tmp.write_text(json.dumps(result, indent=1))


def load(path: Path) -> Calibration | None:
    """The policy's view of a stored calibration; None where it has no GPU part (nothing to offload to)."""
    try:
        data = json.loads(path.read_text())
        gpu, cpu = data["gpu"], data["cpu"]
        if gpu is None:
            return None
        fields = {**{k: cpu[k] for k in ("cpu_bytes_per_s", "cpu_flops")},
                  **{k: gpu[k] for k in ("h2d_bytes_per_s", "h2d_latency_s", "gpu_bytes_per_s", "gpu_flops")}}
    except FileNotFoundError:
        raise FerryError(f"{path}: no calibration; run `ferry calibrate`") from None
    except (ValueError, KeyError, TypeError) as e:
        raise FerryError(f"{path}: not a `ferry calibrate` result ({e}); run `ferry calibrate` again") from None
    return Calibration(**fields)


def table(result: dict) -> str:
    cpu, gpu = result["cpu"], result["gpu"]
    lines = ["| what | measured |", "| --- | --- |",
             f"| CPU Q4_0 GEMV ({cpu['threads']} threads) | {cpu['cpu_bytes_per_s'] / 1e9:.1f} GB/s of weights |",
             f"| CPU Q4_0 x 512 tokens | {cpu['cpu_flops'] / 1e12:.2f} TFLOP/s |"]
    if gpu:
        lines += [f"| H2D pinned ({gpu['gpu_name']}) | {gpu['h2d_bytes_per_s'] / 1e9:.1f} GB/s, "
                  f"{gpu['h2d_latency_s'] * 1e6:.1f} us per small copy |",
                  f"| GPU device copy | {gpu['gpu_bytes_per_s'] / 1e9:.0f} GB/s |",
                  f"| GPU bf16 matmul | {gpu['gpu_flops'] / 1e12:.0f} TFLOP/s |"]
    else:
        lines.append("| GPU | none visible: every op stays on the CPU |")
    return "\n".join(lines)
