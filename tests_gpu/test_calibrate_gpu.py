"""The GPU parts of `ferry calibrate` that `ferry plan`'s forecast is made of (calibrate.measure_steps), measured
through ferry's own kernels on this GPU: each a finite, physical quantity, and the stored file loads them."""

import json

import pytest
import torch

from ferry.offload import calibrate


def test_the_step_parts_are_measured_and_physical(tmp_path):
    got = calibrate.measure_gpu(quick=True)
    assert got is not None
    # a small kernel inside a replayed graph: above 0.3 us, below a launch from Python
    assert 0.3e-6 < got["graph_kernel_s"] < 50e-6
    # a Q4_0 GEMV beyond the L2 reads at least 200 GB/s and no faster than HBM can (~5 TB/s on an H200)
    assert 200e9 < got["gpu_gemv_bytes_per_s"] < 6e12
    # a handshake: a round trip through page-locked memory, a microsecond to a millisecond
    assert 1e-6 < got["handshake_s"] < 1e-3
    # the grouped Q4_0 expert GEMM at 32 tokens per expert: more than a TFLOP/s, less than the bf16 peak
    assert 1e12 < got["gpu_moe_flops"] < got["gpu_flops"] * 1.5
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"cpu": {"cpu_bytes_per_s": 5e10, "cpu_flops": 5e11}, "gpu": got}))
    c = calibrate.load(path)
    assert c.forecasts and c.handshake_s == pytest.approx(got["handshake_s"])
    torch.cuda.synchronize()
