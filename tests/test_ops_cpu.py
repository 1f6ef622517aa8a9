"""ggml CPU kernels against float64 references on random data, many shapes, odd sizes too."""

import numpy as np
import pytest
import torch

from ferry.ops import Weight
from ferry.quant import Q, dequantize, quantize

# every type ggml can quantize without an importance matrix; tolerance = its activation rounding:
# float weights keep f32/f16/bf16 activations, quantized ones meet activations rounded to 8 bits
TYPES = {Q.F32: 1e-6, Q.F16: 2e-3, Q.BF16: 1e-2, Q.Q8_0: 1.5e-2, Q.Q4_0: 1.5e-2, Q.Q4_1: 1.5e-2, Q.Q5_0: 1.5e-2,
         Q.Q5_1: 1.5e-2, Q.Q2_K: 2e-2, Q.Q3_K: 2e-2, Q.Q4_K: 2e-2, Q.Q5_K: 2e-2, Q.Q6_K: 2e-2,
         Q.IQ4_NL: 1.5e-2, Q.IQ4_XS: 2e-2, Q.MXFP4: 1.5e-2}
SHAPES = [(1, 256, 1), (7, 256, 3), (33, 512, 17), (129, 768, 64)]  # (rows m, cols k, tokens n)


def _weight(rng, qtype, *shape):
    values = rng.standard_normal(shape).astype(np.float32)
    raw = quantize(values, qtype)
    ne = tuple(reversed(shape))
    return Weight("w", qtype, ne, raw), dequantize(raw, qtype, ne).astype(np.float64)


@pytest.mark.parametrize("qtype", list(TYPES), ids=lambda q: q.name)
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_linear_matches_float64_reference(backend, qtype, m, k, n):
    rng = np.random.default_rng(m * 1000 + n)
    w, w64 = _weight(rng, qtype, m, k)
    x = rng.standard_normal((n, k)).astype(np.float32)
    out = torch.full((n, m), float("nan"))
    out = backend.linear(torch.from_numpy(x), w)
    ref = x.astype(np.float64) @ w64.T
    assert np.isfinite(out.numpy()).all()
    assert np.linalg.norm(out.numpy() - ref) / np.linalg.norm(ref) < TYPES[qtype]


@pytest.mark.parametrize("n_expert,n_used,n_tokens", [(4, 1, 1), (8, 2, 5), (16, 4, 33)])
@pytest.mark.parametrize("act", ["silu", "gelu"])
def test_moe_ffn_matches_per_expert_reference(backend, n_expert, n_used, n_tokens, act):
    rng = np.random.default_rng(n_expert + n_tokens)
    d, ff = 64, 96
    up, up64 = _weight(rng, Q.Q8_0, n_expert, ff, d)
    gate, gate64 = _weight(rng, Q.Q8_0, n_expert, ff, d)
    down, down64 = _weight(rng, Q.Q8_0, n_expert, d, ff)
    x = rng.standard_normal((n_tokens, d)).astype(np.float32)
    ids = np.stack([rng.choice(n_expert, n_used, replace=False) for _ in range(n_tokens)])
    out = backend.moe_ffn(torch.from_numpy(x), up, gate, down, torch.from_numpy(ids), act).numpy()
    f = {"silu": lambda g: g / (1 + np.exp(-g)),
         "gelu": lambda g: 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3)))}[act]
    ref = np.zeros((n_tokens, n_used, d))
    for i in range(n_tokens):
        for j, e in enumerate(ids[i]):
            ref[i, j] = down64[e] @ (f(gate64[e] @ x[i]) * (up64[e] @ x[i]))
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 2e-2


def test_get_rows_returns_dequantized_rows(backend):
    rng = np.random.default_rng(0)
    w, w64 = _weight(rng, Q.Q6_K, 50, 256)
    ids = torch.tensor([3, 49, 3, 0])
    assert np.allclose(backend.get_rows(w, ids).numpy(), w64[[3, 49, 3, 0]], atol=1e-6)
