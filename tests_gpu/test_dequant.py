"""GPU dequantization kernels against the reference dequantizer (gguf-py, checked against float64 elsewhere),
on random tensors of many shapes, odd row counts too. Run on a GPU machine: scripts/gpu_check.sh."""

import numpy as np
import pytest
import torch
from gguf import quants as gguf_quants

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as Q

from ferry.kernels.cuda.dequant import SUPPORTED, dequantize
from ferry.quant import IK_TYPES, IkQuant, dequantize as reference, ik_type_bytes

# where each type keeps its scale: (byte offset, f16 or the E8M0 byte); random bytes elsewhere are valid
_SCALE = {Q.Q4_K: [(0, "f16"), (2, "f16")], Q.Q5_K: [(0, "f16"), (2, "f16")], Q.Q2_K: [(80, "f16"), (82, "f16")],
          Q.Q3_K: [(108, "f16")], Q.Q6_K: [(208, "f16")], Q.IQ4_XS: [(0, "f16")], Q.IQ4_NL: [(0, "f16")],
          Q.MXFP4: [(0, "e8m0")]}


def _random_blocks(rng, qtype, n_values):
    """Valid random blocks of the types gguf-py cannot quantize: random bytes with a sane scale."""
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n_values // block, size), dtype=np.uint8)
    for offset, kind in _SCALE[qtype]:
        if kind == "f16":
            raw[:, offset:offset + 2] = np.frombuffer(
                rng.uniform(0.001, 0.1, len(raw)).astype(np.float16).tobytes(), np.uint8).reshape(-1, 2)
        else:
            raw[:, offset] = rng.integers(115, 135, len(raw))
    return raw.reshape(-1)

SHAPES = [(1, 256), (7, 512), (33, 256), (129, 2048), (1000, 768)]


@pytest.mark.parametrize("qtype", SUPPORTED, ids=lambda q: q.name)  # IkQuant's among them
@pytest.mark.parametrize("rows,cols", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_gpu_dequantize_matches_the_reference(qtype, rows, cols, dtype):
    rng = np.random.default_rng(rows * 31 + cols)
    if isinstance(qtype, IkQuant):  # ik_llama.cpp's types: every byte random but the scales (each row's float32 /
        # fp16 before it, or each block's fp16 d opening it)
        _, _, size, meta = IK_TYPES[qtype]
        raw = rng.integers(0, 256, size=(rows, ik_type_bytes(qtype, (cols, 1))), dtype=np.uint8)
        raw = raw if meta else raw.reshape(-1, size)
        raw[:, :meta or 2] = rng.uniform(1e-4, 1e-3, (len(raw), 1)).astype(
            np.float32 if meta == 4 else np.float16).view(np.uint8)
        raw = raw.reshape(-1)
    elif qtype in _SCALE:
        raw = _random_blocks(rng, qtype, rows * cols)
    else:
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
