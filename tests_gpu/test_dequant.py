"""GPU dequantization kernels against the reference dequantizer (gguf-py, checked against float64 elsewhere),
on random tensors of many shapes, odd row counts too. Run on a GPU machine: scripts/gpu_check.sh."""

import numpy as np
import pytest
import torch
from gguf import quants as gguf_quants

from ferry.ops.cuda.dequant import SUPPORTED, dequantize
from ferry.quant import dequantize as reference

SHAPES = [(1, 32), (7, 64), (33, 256), (129, 2048), (1000, 96)]


@pytest.mark.parametrize("qtype", SUPPORTED, ids=lambda q: q.name)
@pytest.mark.parametrize("rows,cols", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_gpu_dequantize_matches_the_reference(qtype, rows, cols, dtype):
    rng = np.random.default_rng(rows * 31 + cols)
    values = (rng.standard_normal((rows, cols)) * rng.uniform(0.01, 10)).astype(np.float32)
    raw = np.ascontiguousarray(gguf_quants.quantize(values, qtype)).view(np.uint8).reshape(-1)
    ne = (cols, rows)
    want = torch.from_numpy(reference(raw, qtype, ne))
    got = dequantize(torch.from_numpy(raw).cuda(), qtype, ne, dtype).float().cpu()
    # float32: the reference's own arithmetic (d * q [+ m] in float32; an FMA may round the last bit);
    # f16/bf16 outputs: one rounding of each value
    tol = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    assert torch.allclose(got, want.to(dtype).float() if dtype != torch.float32 else want, rtol=tol,
                          atol=tol * want.abs().max().item())
