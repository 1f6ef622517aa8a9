"""The GPU kernels (ferry/kernels/cuda/) against float64 references on random inputs of many shapes,
odd sizes too. On a GPU machine they run on the GPU; elsewhere under TRITON_INTERPRET=1 on the CPU."""

import os

import numpy as np
import pytest
import torch
from gguf import quants as gguf_quants
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as Q

from ferry.gguf.synth import random_tensor
from ferry.kernels.activations import GLU, SILU_CLAMP_LIMIT
from ferry.kernels.cuda import attention, gemv, indexer, kquant, krows, layout, moe, norm_rope, route
from ferry.quant import IkQuant, dequantize as reference

DEV = "cuda" if torch.cuda.is_available() else "cpu"
if DEV == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU: run with TRITON_INTERPRET=1", allow_module_level=True)


def _quantized(rng, qtype, *shape):
    """Random floats quantized by gguf-py: (raw bytes on DEV, float64 values they stand for)."""
    values = (rng.standard_normal(shape) * rng.uniform(0.05, 3)).astype(np.float32)
    raw = np.ascontiguousarray(gguf_quants.quantize(values, qtype)).view(np.uint8).reshape(-1)
    ne = tuple(reversed(shape))
    return torch.from_numpy(raw.copy()).to(DEV), torch.from_numpy(reference(raw, qtype, ne)).double()


def _close(got, want, tol=2e-5):
    got = got.double().cpu()
    assert got.shape == want.shape
    err = (got - want).abs().max().item()
    assert err <= tol * max(want.abs().max().item(), 1.0), err


@pytest.mark.parametrize("qtype", list(layout.GEMV_KINDS), ids=lambda q: q.name)
@pytest.mark.parametrize("n,rows,cols", [(1, 1, 32), (1, 17, 96), (3, 33, 288), (1, 200, 2048), (5, 1000, 640)])
@pytest.mark.parametrize("config", [None, (2, 2048, 4), (8, 512, 8)], ids=str)
def test_gemv_matches_float64(qtype, n, rows, cols, config):
    rng = np.random.default_rng(rows + cols + n)
    raw, w = _quantized(rng, qtype, rows, cols)
    x = torch.from_numpy(rng.standard_normal((n, cols))).float()
    _close(gemv.gemv(layout.Split.of(raw, qtype, (cols, rows)), x.to(DEV), config), x.double() @ w.T)


@pytest.mark.parametrize("qtype", list(layout.GEMV_KINDS), ids=lambda q: q.name)
@pytest.mark.parametrize("n,rows,cols,config", [(1, 17, 96, None), (3, 33, 288, (8, 512, 8)),
                                                (2, 200, 2048, (2, 2048, 4)), (1, 640, 4096, None)])
def test_gemv_of_the_rms_norm_matches_float64(qtype, n, rows, cols, config):
    rng = np.random.default_rng(rows + cols + n + 1)
    raw, w = _quantized(rng, qtype, rows, cols)
    x, g = torch.from_numpy(rng.standard_normal((n, cols))), torch.from_numpy(rng.standard_normal(cols))
    xn = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * g
    got = gemv.gemv(layout.Split.of(raw, qtype, (cols, rows)), x.float().to(DEV), config, norm=(g.float().to(DEV), 1e-6))
    _close(got, xn @ w.T)


@pytest.mark.parametrize("qtype", list(layout.GEMV_KINDS), ids=lambda q: q.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_split_layout_expands_to_the_reference(qtype, dtype):
    rng = np.random.default_rng(5)
    raw, w = _quantized(rng, qtype, 3, 7, 96)
    s = layout.Split.of(raw, qtype, (96, 7, 3))
    assert s.qs.numel() + s.d.element_size() * s.d.numel() == raw.numel()  # the same bytes, rearranged
    assert torch.equal(s.floats(dtype).cpu(), w.to(dtype))
    assert torch.equal(s.expert(2).floats(dtype).cpu(), w[2].to(dtype))
    flat = layout.Split.of(raw, qtype, (96, 21))
    ids = torch.tensor([20, 0, 5, 5]).to(DEV)
    assert torch.equal(flat.rows(ids).floats(dtype).cpu(), w.view(21, 96)[ids.cpu()].to(dtype))


def _experts_reference(x, ids, weights, g, u, d, act, residual, biases=None):
    """Each token's routed experts in float64: glu(gate . x, up . x) (each + its expert's bias where biases =
    (gate's, up's, down's) are given) through down, weighted, summed over its slots (an id of -1 skipped), plus the
    residual when given."""
    glu = GLU[act]
    gb, ub, db = biases if biases is not None else (torch.zeros(g.shape[:2]), torch.zeros(u.shape[:2]),
                                                    torch.zeros(d.shape[:2]))
    n, n_used = ids.shape
    want = torch.zeros(n, d.shape[1], dtype=torch.float64) if residual is None else residual.double()
    for t in range(n):
        for s in range(n_used):
            e = int(ids[t, s])
            if e >= 0:
                xt = x[t].double()
                h = glu(g[e] @ xt + gb[e].double(), u[e] @ xt + ub[e].double())
                want[t] += weights[t, s].double() * (d[e] @ h + db[e].double())
    return want


def _biases(rng, n_expert, n_embd, n_ff):
    """Random expert biases as gpt-oss has them: gate's, up's (n_expert, n_ff) and down's (n_expert, n_embd)."""
    return tuple(torch.from_numpy(rng.standard_normal((n_expert, rows)) * 2).float() for rows in (n_ff, n_ff, n_embd))


def _on(t):
    return None if t is None else tuple(v.to(DEV) for v in t) if isinstance(t, tuple) else t.to(DEV)


@pytest.mark.parametrize("qtype", list(layout.GEMV_KINDS), ids=lambda q: q.name)
@pytest.mark.parametrize("act", ["silu", "gelu", "swiglu_oai", "silu_clamp"])
@pytest.mark.parametrize("n,n_expert,n_used,n_embd,n_ff", [(1, 4, 2, 64, 96), (3, 8, 3, 96, 160), (2, 16, 8, 256, 64)])
def test_moe_gemv_matches_float64(qtype, act, n, n_expert, n_used, n_embd, n_ff):
    """The expert GEMVs; gpt-oss's clamped SwiGLU with each expert's biases (an id of -1 adds nothing); DeepSeek-V4's
    clamped SwiGLU on inputs large enough that its clamp bites."""
    rng = np.random.default_rng(n_expert * n_embd + n)
    (graw, g), (uraw, u), (draw, d) = (_quantized(rng, qtype, n_expert, a, b) for a, b in
                                       ((n_ff, n_embd), (n_ff, n_embd), (n_embd, n_ff)))
    x = torch.from_numpy(rng.standard_normal((n, n_embd))).float()
    if act == "silu_clamp":
        x = x * 40
        assert (g.double() @ x[0].double()).abs().max() > 2 * SILU_CLAMP_LIMIT
    ids = torch.stack([torch.from_numpy(rng.permutation(n_expert)[:n_used]) for _ in range(n)])
    biases = _biases(rng, n_expert, n_embd, n_ff) if act == "swiglu_oai" else None
    if biases is not None:
        ids[0, 0] = -1  # a pair whose expert is elsewhere: no bias either
    weights = torch.from_numpy(rng.uniform(0, 1, (n, n_used))).float()
    residual = torch.from_numpy(rng.standard_normal((n, n_embd))).float() if act == "gelu" else None
    got = moe.moe_gemv(x.to(DEV), ids.to(DEV), weights.to(DEV), layout.Split.of(graw, qtype, (n_embd, n_ff, n_expert)),
                       layout.Split.of(uraw, qtype, (n_embd, n_ff, n_expert)), layout.Split.of(draw, qtype, (n_ff, n_embd, n_expert)),
                       act, residual=_on(residual), biases=_on(biases))
    _close(got, _experts_reference(x, ids, weights, g, u, d, act, residual, biases), 5e-5)


@pytest.mark.parametrize("qtype", list(layout.GEMV_KINDS), ids=lambda q: q.name)
@pytest.mark.parametrize("n,n_expert,n_used,n_embd,n_ff", [(1, 4, 2, 64, 96), (5, 8, 4, 96, 160), (37, 8, 3, 160, 64),
                                                           (70, 6, 2, 96, 288)])
def test_expert_pairs_add_gpt_oss_biases(qtype, n, n_expert, n_used, n_embd, n_ff):
    """CudaBackend.expert_pairs with gpt-oss's biases and clamped SwiGLU, as the hybrid runtime's streamed experts
    and a GPU layer's prompts take them: the expert GEMVs for few pairs, the grouped GEMM (bias added in the
    kernel, before the activation) for more; each pair's weighted output in pair order."""
    from ferry.backends.cuda import CudaBackend

    rng = np.random.default_rng(n * n_ff + n_used + 7)
    (raw_g, g), (raw_u, u) = (_quantized(rng, qtype, n_expert, n_ff, n_embd) for _ in range(2))
    raw_d, d = _quantized(rng, qtype, n_expert, n_embd, n_ff)
    biases = _biases(rng, n_expert, n_embd, n_ff)
    ids = torch.stack([torch.from_numpy(rng.permutation(n_expert)[:n_used]) for _ in range(n)])
    x = torch.from_numpy(rng.standard_normal((n, n_embd)) * 0.5).float()
    weights = torch.from_numpy(rng.uniform(0.1, 1.0, (n, n_used))).float()
    split = lambda raw, ne: layout.Split.of(raw, qtype, ne)  # noqa: E731
    got = CudaBackend(DEV).expert_pairs(x.to(DEV), ids.to(DEV), split(raw_g, (n_embd, n_ff, n_expert)),
                                        split(raw_u, (n_embd, n_ff, n_expert)), split(raw_d, (n_ff, n_embd, n_expert)),
                                        "swiglu_oai", weights=weights.to(DEV), biases=_on(biases))
    want = torch.stack([_experts_reference(x[p // n_used:p // n_used + 1], ids.flatten()[p].view(1, 1),
                                           weights.flatten()[p].view(1, 1), g, u, d, "swiglu_oai", None, biases)[0]
                        for p in range(n * n_used)])
    _close(got, want, 5e-5 if n * n_used <= 64 else 3e-3)  # the grouped GEMM: f16 activations and weights


def _kquant(rng, qtype, *shape):
    """Random K-quant blocks (gguf-py quantizes no K-quant; every scale, min and quant random): (raw bytes on DEV,
    float64 values they stand for)."""
    ne = tuple(reversed(shape))
    raw = np.ascontiguousarray(random_tensor(qtype, ne, 1.0, rng)).view(np.uint8).reshape(-1)
    return torch.from_numpy(raw.copy()).to(DEV), torch.from_numpy(reference(raw, qtype, ne)).double()


@pytest.mark.parametrize("qtype", list(kquant.KINDS), ids=lambda q: q.name)
@pytest.mark.parametrize("n,rows,cols,config", [(1, 1, 256, (4, 4)), (1, 17, 768, (4, 4)), (3, 33, 512, (8, 2)),
                                                (1, 40, 2048, (16, 8)), (5, 7, 1280, (1, 1)), (2, 19, 512, (8, 1)),
                                                (1, 9, 768, (0, 1))])
def test_kquant_gemv_matches_float64(qtype, n, rows, cols, config):
    rng = np.random.default_rng(rows + cols + n)
    raw, w = _kquant(rng, qtype, rows, cols)
    x = torch.from_numpy(rng.standard_normal((n, cols))).float()
    _close(kquant.kgemv(raw, qtype, (cols, rows), x.to(DEV), *config), x.double() @ w.T)


Q4_K_M, Q5_K_M = (Q.Q4_K, Q.Q4_K, Q.Q6_K), (Q.Q5_K, Q.Q5_K, Q.Q6_K)
# few programs under the interpreter (minutes of one core each otherwise); Qwen3-30B-A3B's expert shape on a GPU
IK = IkQuant
KQUANT_MOE = [(Q4_K_M, "silu", (1, 4, 2, 256, 512)), (Q5_K_M, "gelu", (3, 8, 3, 512, 256)),
              ((Q.Q6_K, Q.Q6_K, Q.Q4_K), "silu", (2, 6, 4, 256, 256)), (Q4_K_M, "swiglu_oai", (2, 4, 2, 256, 256)),
              # ik_llama.cpp's experts as its files mix them (IQ4_KS gate and up with IQ5_KS down, IQ3_KS / IQ2_KS)
              ((IK.IQ4_KS, IK.IQ4_KS, IK.IQ5_KS), "silu", (2, 6, 3, 256, 512)), ((IK.IQ4_K,) * 3, "gelu", (1, 4, 2, 512, 256)),
              ((IK.IQ2_KS, IK.IQ2_KS, IK.IQ3_KS), "silu", (3, 4, 2, 256, 256)),
              ((IK.IQ2_KL, IK.IQ2_KL, IK.IQ4_KSS), "silu", (2, 4, 2, 256, 512)),
              ((IK.IQ2_K, IK.IQ2_K, IK.IQ3_K), "gelu", (3, 4, 2, 512, 256))]
if DEV == "cuda":
    KQUANT_MOE += [(t, act, (2, 128, 8, 2048, 768)) for t in (Q4_K_M, Q5_K_M) for act in ("silu", "gelu")]


@pytest.mark.parametrize("types,act,shape", KQUANT_MOE, ids=lambda v: "-".join(q.name for q in v)
                         if isinstance(v, tuple) and isinstance(v[0], (Q, IkQuant)) else str(v))
def test_kquant_moe_gemv_matches_float64(types, act, shape):
    """A Q4_K_M file's experts (gate and up Q4_K, down Q6_K), a Q5_K_M file's, and others: each pair's expert read
    in place; an id of -1 (an expert kept elsewhere) adds nothing; with gpt-oss's clamped SwiGLU, each expert's
    biases."""
    n, n_expert, n_used, n_embd, n_ff = shape
    rng = np.random.default_rng(n_expert * n_embd + n)
    (graw, g), (uraw, u), (draw, d) = (_kquant(rng, q, n_expert, a, b) for q, (a, b) in
                                       zip(types, ((n_ff, n_embd), (n_ff, n_embd), (n_embd, n_ff))))
    x = torch.from_numpy(rng.standard_normal((n, n_embd))).float()
    ids = torch.stack([torch.from_numpy(rng.permutation(n_expert)[:n_used]) for _ in range(n)])
    if n_used > 1:
        ids[0, 1] = -1
    weights = torch.from_numpy(rng.uniform(0, 1, (n, n_used))).float()
    residual = torch.from_numpy(rng.standard_normal((n, n_embd))).float() if act == "gelu" else None
    biases = _biases(rng, n_expert, n_embd, n_ff) if act == "swiglu_oai" else None
    got = kquant.kmoe_gemv(x.to(DEV), ids.to(DEV), weights.to(DEV), (graw, types[0], (n_embd, n_ff, n_expert)),
                           (uraw, types[1], (n_embd, n_ff, n_expert)), (draw, types[2], (n_ff, n_embd, n_expert)),
                           act, residual=_on(residual), biases=_on(biases))
    _close(got, _experts_reference(x, ids, weights, g, u, d, act, residual, biases), 5e-5)


@pytest.mark.parametrize("qtype", list(krows.KINDS), ids=lambda q: q.name)
@pytest.mark.parametrize("n,rows,cols,config", [(1, 1, 256, (4, 1, 4)), (1, 17, 768, (4, 2, 4)), (3, 33, 512, (8, 2, 2)),
                                                (1, 40, 2048, (16, 4, 8)), (5, 7, 1280, (1, 1, 1)), (2, 19, 1024, (2, 4, 1))])
def test_krows_gemv_matches_float64(qtype, n, rows, cols, config):
    """K-quant matrices rewritten into krows.py's rows (scales unpacked): the GEMV against float64, blocks a step
    that do and do not divide a row's blocks."""
    rng = np.random.default_rng(rows + cols + n + 1)
    raw, w = _kquant(rng, qtype, rows, cols)
    x = torch.from_numpy(rng.standard_normal((n, cols))).float()
    packed = krows.from_blocks(raw, qtype, cols)
    assert packed.shape == (rows, krows.row_bytes(qtype, cols)) and packed.shape[1] % 16 == 0
    _close(krows.rgemv(packed, qtype, (cols, rows), x.to(DEV), *config), x.double() @ w.T)


@pytest.mark.parametrize("qtype", list(krows.KINDS), ids=lambda q: q.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_krows_expand_to_the_reference_and_gather_rows(qtype, dtype):
    """KRows (a dense K-quant matrix in krows.py's rows) expanded for cuBLAS, and some of its rows (a token
    embedding's), against float64: each value rounded once to the type."""
    rng = np.random.default_rng(7)
    raw, w = _kquant(rng, qtype, 5, 768)
    m = krows.KRows.of(raw, qtype, (768, 5))
    _close(m.floats(dtype), w.to(dtype).double(), 0)
    ids = torch.tensor([4, 0, 4], device=DEV)
    _close(m.rows(ids).floats(torch.float32), w[[4, 0, 4]], 0)
    assert krows.KRows.takes(qtype, (768, 5)) and not krows.KRows.takes(qtype, (768, 5, 2))
    assert not krows.KRows.takes(qtype, (640, 5)) and not krows.KRows.takes(Q.Q4_0, (768, 5))


MXFP4_MOE = [((1, 4, 2, 96, 160), None), ((3, 6, 4, 160, 64), (2, 1024, 2))]
if DEV == "cuda":
    MXFP4_MOE += [((2, 32, 4, 2880, 2880), c) for c in (None, (2, 1024, 2), (8, 256, 4))]  # gpt-oss-20b's


@pytest.mark.parametrize("biased", [True, False])
@pytest.mark.parametrize("shape,config", MXFP4_MOE, ids=str)
def test_mxfp4_moe_gemv_with_biases_matches_float64(shape, config, biased):
    """gpt-oss's experts: MXFP4 split (gpt-oss's width of 2880 on a GPU: no power of two of blocks), each expert's
    biases added, the clamped SwiGLU; an id of -1 adds nothing."""
    n, n_expert, n_used, n_embd, n_ff = shape
    rng = np.random.default_rng(n_expert * n_embd + n)
    (graw, g), (uraw, u), (draw, d) = (_quantized(rng, Q.MXFP4, n_expert, a, b) for a, b in
                                       ((n_ff, n_embd), (n_ff, n_embd), (n_embd, n_ff)))
    biases = _biases(rng, n_expert, n_embd, n_ff) if biased else None
    x = torch.from_numpy(rng.standard_normal((n, n_embd))).float()
    ids = torch.stack([torch.from_numpy(rng.permutation(n_expert)[:n_used]) for _ in range(n)])
    ids[0, 1] = -1
    weights = torch.from_numpy(rng.uniform(0, 1, (n, n_used))).float()
    split = lambda raw, ne: layout.Split.of(raw, Q.MXFP4, ne)  # noqa: E731
    got = moe.moe_gemv(x.to(DEV), ids.to(DEV), weights.to(DEV), split(graw, (n_embd, n_ff, n_expert)),
                       split(uraw, (n_embd, n_ff, n_expert)), split(draw, (n_ff, n_embd, n_expert)), "swiglu_oai",
                       config=config, biases=_on(biases))
    want = _experts_reference(x, ids, weights, g, u, d, "swiglu_oai", None, biases)
    _close(got, want, 5e-5)
    live = ids[ids >= 0]
    pre = torch.stack([g[live] @ x[0].double(), u[live] @ x[0].double()])  # the first token's, before biases
    if biased:
        pre = pre + torch.stack([biases[0][live], biases[1][live]]).double()
    assert (pre.abs() > 7).any() and (pre.abs() < 7).any()  # the clamps bite, and not everywhere


@pytest.mark.parametrize("qtype", list(IkQuant), ids=lambda q: q.name)
@pytest.mark.parametrize("rows,cols", [(1, 256), (5, 768)])
def test_the_dequantizer_expands_ik_types_to_the_reference(qtype, rows, cols):
    """dequant.py's kinds for ik_llama.cpp's types (the expansion the GPU's prompts fall back to): random blocks (the
    scales kept sane) against the reference, to float32's rounding. tests_gpu/test_dequant.py covers every type and
    output dtype on a GPU; this runs under the interpreter too."""
    from ferry.kernels.cuda.dequant import dequantize

    rng = np.random.default_rng(rows + cols + int(qtype))
    raw, want = _kquant(rng, qtype, rows, cols)
    _close(dequantize(raw, qtype, (cols, rows), torch.float32), want, 1e-6)


def test_kquant_reads_whole_blocks_of_its_types_only():
    assert kquant.reads(Q.Q4_K, (2048, 8)) and kquant.reads(Q.Q6_K, (768, 8, 128))
    assert not kquant.reads(Q.MXFP4, (2880, 8, 32))  # read in layout.Split instead
    assert not kquant.reads(Q.Q4_K, (2000, 8)) and not kquant.reads(Q.Q4_0, (2048, 8))
    assert all(kquant.reads(q, (768, 8, 128)) for q in IkQuant)  # ik_llama.cpp's experts read in place


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("n,n_used,width", [(1, 8, 2048), (3, 1, 100), (2, 6, 1500)])
def test_sum_pairs_adds_each_tokens_rows(residual, n, n_used, width):
    rng = np.random.default_rng(width + n_used)
    y = torch.from_numpy(rng.standard_normal((n * n_used, width)))
    r = torch.from_numpy(rng.standard_normal((n, width)))
    want = y.view(n, n_used, width).sum(1) + (r if residual else 0)
    _close(moe.sum_pairs(y.float().to(DEV), n_used, r.float().to(DEV) if residual else None), want, 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("n,rows,cols", [(1, 128, 2048), (3, 7, 33), (2, 61, 300)])
def test_gemv_float_matches_float64(dtype, n, rows, cols):
    rng = np.random.default_rng(rows + cols)
    w = torch.from_numpy(rng.standard_normal((rows, cols))).to(dtype)
    x = torch.from_numpy(rng.standard_normal((n, cols)))
    _close(gemv.gemv_float(w.to(DEV), x.float().to(DEV)), x @ w.double().T)


@pytest.mark.parametrize("rows,n", [(1, 7), (5, 64), (3, 640), (2, 2048), (4, 33)])
def test_rms_norm_matches_float64(rows, n):
    rng = np.random.default_rng(n)
    x, w = torch.from_numpy(rng.standard_normal((rows, n))), torch.from_numpy(rng.standard_normal(n))
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    _close(norm_rope.rms_norm(x.float().to(DEV), w.float().to(DEV), 1e-6), want)


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("n,heads,dim,n_rot", [(1, 1, 64, 64), (3, 5, 128, 128), (2, 4, 96, 64), (7, 2, 80, 32)])
def test_norm_rope_matches_float64(neox, norm, n, heads, dim, n_rot):
    from ferry.layers.rope import Rope

    rng = np.random.default_rng(dim + n)
    x, w = torch.from_numpy(rng.standard_normal((n, heads, dim))), torch.from_numpy(rng.standard_normal(dim))
    pos = torch.from_numpy(rng.integers(0, 300, n))
    rope = Rope(n_rot, 10000.0, neox)
    cos, sin = rope.angles(torch.arange(300))
    xn = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w if norm else x
    want = rope(xn, cos[pos].double(), sin[pos].double())
    got = norm_rope.norm_rope(x.float().to(DEV), w.float().to(DEV) if norm else None, 1e-6, cos.to(DEV), sin.to(DEV),
                              pos.to(DEV), n_rot, neox)
    _close(got, want)


@pytest.mark.parametrize("rows,n", [(1, 7), (3, 640), (2, 2048), (4, 33)])
def test_add_rms_norm_returns_the_sum_and_its_norm(rows, n):
    rng = np.random.default_rng(n + 1)
    x, dx, w = (torch.from_numpy(rng.standard_normal(shape)) for shape in ((rows, n), (rows, n), (n,)))
    s = x + dx
    got_s, got_y = norm_rope.add_rms_norm(x.float().to(DEV), dx.float().to(DEV), w.float().to(DEV), 1e-6)
    _close(got_s, s, 1e-6)
    _close(got_y, s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * w)


@pytest.mark.parametrize("gating,bias,norm,scale", [("softmax", False, True, 1.0), ("softmax", False, False, 1.0),
                                                    ("sigmoid", True, True, 2.5), ("sigmoid", False, False, 1.0),
                                                    ("softmax_weight", True, False, 1.0),
                                                    ("softmax_weight", False, False, 1.0)])
@pytest.mark.parametrize("n,n_expert,n_used", [(1, 8, 2), (3, 60, 6), (2, 128, 8), (5, 256, 8), (1, 7, 7)])
def test_route_picks_the_reference_experts(gating, bias, norm, scale, n, n_expert, n_used):
    """softmax_weight: gpt-oss's router, the top logits (+ the router's own bias) and a softmax over them."""
    from ferry.layers.ffn import Routing
    from ferry.backends.cuda import gpu_route, top_k_route

    rng = np.random.default_rng(n_expert + n_used + n)
    logits = torch.from_numpy(rng.standard_normal((n, n_expert)) * 2)
    b = torch.from_numpy(rng.standard_normal(n_expert) * (1.0 if gating == "softmax_weight" else 0.1)) if bias else None
    routing = Routing(gating, logit_bias=b) if gating == "softmax_weight" else Routing(gating, b, scale)
    want_w, want_ids = top_k_route(logits, n_used, norm, routing)  # float64: the exact choice
    if gating == "softmax_weight":  # through the backend's choice of kernel: this one, not the op-by-op form
        got_w, got_ids = gpu_route(logits.float().to(DEV), n_used, norm, routing,
                                   lambda t: t.float().to(DEV))
    else:
        got_w, got_ids = route.route(logits.float().to(DEV), n_used, norm, scale, gating,
                                     None if b is None else b.float().to(DEV))
    assert got_ids.dtype == torch.int32
    assert torch.equal(got_ids.cpu(), want_ids)
    _close(got_w, want_w, 1e-6)


@pytest.mark.parametrize("ktype,vtype", [(Q.F16, Q.F16), (Q.Q8_0, Q.Q8_0), (Q.F16, Q.Q8_0)], ids=str)
@pytest.mark.parametrize("norm,neox", [(True, True), (False, False)])
@pytest.mark.parametrize("n,heads,heads_kv,dk,dv,n_rot", [(1, 4, 2, 64, 64, 64), (3, 6, 3, 128, 96, 128),
                                                          (2, 2, 1, 96, 32, 32), (1, 16, 4, 128, 128, 64)])
def test_qkv_rope_store_matches_the_separate_kernels(ktype, vtype, norm, neox, n, heads, heads_kv, dk, dv, n_rot):
    """The fused form against float64 for the queries, and bit for bit against norm_rope + the cache stores for
    the cache rows (the same arithmetic)."""
    from ferry.layers.rope import Rope

    rng = np.random.default_rng(heads * dk + n + dv)
    cells_n = 20
    qw, kw = heads * dk, heads_kv * dk
    y = torch.from_numpy(rng.standard_normal((n, qw + kw + heads_kv * dv))).float()
    qn, kn = (torch.from_numpy(rng.standard_normal(dk)).float() for _ in range(2))
    pos = torch.from_numpy(rng.integers(0, 300, n))
    cells = torch.from_numpy(rng.permutation(cells_n)[:n])
    rope = Rope(n_rot, 10000.0, neox)
    cos, sin = (t.to(DEV) for t in rope.angles(torch.arange(300)))

    def row_bytes(qtype, width):
        return width // 32 * 34 if qtype == Q.Q8_0 else 2 * width

    def empty(qtype, width):
        return torch.zeros(cells_n, row_bytes(qtype, width), dtype=torch.uint8, device=DEV)

    kc, vc = empty(ktype, kw), empty(vtype, heads_kv * dv)
    args = (qn.to(DEV), kn.to(DEV)) if norm else (None, None)
    q = attention.qkv_rope_store(y.to(DEV), *args, 1e-6, cos, sin, pos.to(DEV), cells.to(DEV), kc, vc, ktype == Q.Q8_0,
                                 vtype == Q.Q8_0, heads, heads_kv, dk, dv, n_rot, neox)
    yd = y.double()
    qh = yd[:, :qw].view(n, heads, dk)
    qh = qh * torch.rsqrt(qh.pow(2).mean(-1, keepdim=True) + 1e-6) * qn.double() if norm else qh
    _close(q, rope(qh, cos.cpu()[pos].double(), sin.cpu()[pos].double()))

    want_k, want_v = empty(ktype, kw), empty(vtype, heads_kv * dv)
    k = norm_rope.norm_rope(y[:, qw:qw + kw].reshape(n, heads_kv, dk).to(DEV), args[1], 1e-6, cos, sin, pos.to(DEV), n_rot,
                            neox)
    v = y[:, qw + kw:].to(DEV)
    for cache, qtype, x in ((want_k, ktype, k.reshape(n, -1)), (want_v, vtype, v)):
        if qtype == Q.Q8_0:
            attention.store_q8_0(x, cache, cells.to(DEV))
        else:
            cache.view(torch.float16)[cells.to(DEV)] = x.to(torch.float16)
    assert torch.equal(kc.cpu(), want_k.cpu())
    assert torch.equal(vc.cpu(), want_v.cpu())


def _cache(rng, qtype, cells, width):
    values = rng.standard_normal((cells, width)).astype(np.float32)
    if qtype == Q.F16:
        return torch.from_numpy(values.astype(np.float16).view(np.uint8).copy()).to(DEV), \
            torch.from_numpy(values.astype(np.float16).astype(np.float64))
    raw = np.ascontiguousarray(gguf_quants.quantize(values, Q.Q8_0)).view(np.uint8)
    return torch.from_numpy(raw.copy()).to(DEV), torch.from_numpy(reference(raw.reshape(-1), Q.Q8_0, (width, cells))).double()


def _attention_reference(q, k, v, pos, base, heads_kv, window, sinks=None, ring=0):
    """Each token's attention in float64 over its cells base + (pos - window + 1 or 0) .. base + pos of the float
    caches k (cells, heads_kv * dk) and v (ring: position j at cell base + j % ring); sinks: each head's logit added to
    the softmax's denominator, no value. (n, heads * dv)."""
    n, heads, dk = q.shape
    dv = v.shape[1] // heads_kv
    want = torch.empty(n, heads, dv, dtype=torch.float64)
    for t in range(n):
        lo = max(0, int(pos[t]) - window + 1) if window else 0
        positions = torch.arange(lo, int(pos[t]) + 1)
        cell = (positions % ring if ring else positions) + int(base[t])
        for h in range(heads):
            kvh = h // (heads // heads_kv)
            scores = k[cell].view(-1, heads_kv, dk)[:, kvh] @ q[t, h] * dk ** -0.5
            if sinks is not None:
                scores = torch.cat([scores, sinks[h:h + 1]])
            weights = torch.softmax(scores, 0)[:len(cell)]
            want[t, h] = weights @ v[cell].view(-1, heads_kv, dv)[:, kvh]
    return want.view(n, -1)


@pytest.mark.parametrize("config,splits", [(None, None), ((32, 4), None), ((128, 8), None), ((32, 4), 4),
                                           (None, 2)], ids=str)
@pytest.mark.parametrize("ktype,vtype", [(Q.F16, Q.F16), (Q.Q8_0, Q.Q8_0), (Q.Q8_0, Q.F16)], ids=str)
@pytest.mark.parametrize("n,heads,heads_kv,dk,dv,window", [(1, 4, 4, 64, 64, 0), (3, 8, 2, 128, 128, 0),
                                                             (2, 6, 3, 64, 32, 5), (4, 2, 1, 96, 96, 40),
                                                             (1, 4, 1, 576, 512, 0)])
def test_attention_decode_matches_float64(config, splits, ktype, vtype, n, heads, heads_kv, dk, dv, window):
    """splits: flash-decoding's parts of the cache, merged after (4 parts of 25 positions for 32-cell steps: the
    last ones see no cell for most tokens); None: as many as attention_splits picks for these 100 cells (one)."""
    rng = np.random.default_rng(heads * dk + n + window)
    cells = 100
    kraw, k = _cache(rng, ktype, cells, heads_kv * dk)
    vraw, v = _cache(rng, vtype, cells, heads_kv * dv)
    q = torch.from_numpy(rng.standard_normal((n, heads, dk)))
    pos = torch.from_numpy(rng.integers(0, 60, n))
    base = torch.from_numpy(rng.integers(0, 40, n))
    got = attention.attention_decode(q.float().to(DEV), kraw, vraw, ktype == Q.Q8_0, vtype == Q.Q8_0, pos.to(DEV),
                                     base.to(DEV), heads_kv, dv, dk ** -0.5, window, config, n_cells=cells, splits=splits)
    _close(got, _attention_reference(q, k, v, pos, base, heads_kv, window), 1e-5)


@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("n,heads,heads_kv,dk,window", [(1, 4, 2, 64, 0), (3, 8, 2, 64, 7), (2, 6, 6, 48, 0)])
def test_attention_decode_adds_each_heads_sink(splits, n, heads, heads_kv, dk, window):
    """gpt-oss's sinks: each head's logit in the softmax's denominator, no value; one part or four merged (the last
    ones seeing no cell for most tokens)."""
    rng = np.random.default_rng(heads * dk + n + window + splits)
    cells = 100
    kraw, k = _cache(rng, Q.F16, cells, heads_kv * dk)
    vraw, v = _cache(rng, Q.F16, cells, heads_kv * dk)
    q = torch.from_numpy(rng.standard_normal((n, heads, dk)))
    sinks = torch.from_numpy(rng.standard_normal(heads) * 2)
    pos = torch.from_numpy(rng.integers(0, 60, n))
    base = torch.from_numpy(rng.integers(0, 40, n))
    got = attention.attention_decode(q.float().to(DEV), kraw, vraw, False, False, pos.to(DEV), base.to(DEV), heads_kv,
                                     dk, dk ** -0.5, window, (32, 4), n_cells=cells, splits=splits,
                                     sinks=sinks.float().to(DEV))
    _close(got, _attention_reference(q, k, v, pos, base, heads_kv, window, sinks), 1e-5)


@pytest.mark.parametrize("splits", [1, 4, None])
@pytest.mark.parametrize("ktype,sinks", [(Q.F16, False), (Q.Q8_0, False), (Q.F16, True)], ids=str)
@pytest.mark.parametrize("n,heads,heads_kv,dk,window,ring", [(1, 4, 2, 64, 8, 32), (3, 8, 2, 64, 20, 24),
                                                              (5, 6, 3, 96, 1, 7), (2, 4, 4, 64, 64, 64)])
def test_attention_decode_reads_a_ring(splits, ktype, sinks, n, heads, heads_kv, dk, window, ring):
    """A sliding-window layer's ring (KVCache.ring): position j of a sequence at cell base + j % ring, positions far
    past the ring's size (up to 300, three sequences' rings); flash-decoding's parts over those positions (4, or
    attention_splits' pick for 300), with and without sinks, f16 and q8_0 rows."""
    rng = np.random.default_rng(heads * dk + n + window + ring)
    kraw, k = _cache(rng, ktype, 3 * ring, heads_kv * dk)
    vraw, v = _cache(rng, ktype, 3 * ring, heads_kv * dk)
    q = torch.from_numpy(rng.standard_normal((n, heads, dk)))
    sink = torch.from_numpy(rng.standard_normal(heads) * 2) if sinks else None
    pos = torch.from_numpy(rng.integers(0, 300, n))
    base = torch.from_numpy(rng.integers(0, 3, n) * ring)
    got = attention.attention_decode(q.float().to(DEV), kraw, vraw, ktype == Q.Q8_0, ktype == Q.Q8_0, pos.to(DEV),
                                     base.to(DEV), heads_kv, dk, dk ** -0.5, window, (32, 4), n_cells=300,
                                     splits=splits, sinks=None if sink is None else sink.float().to(DEV), ring=ring)
    _close(got, _attention_reference(q, k, v, pos, base, heads_kv, window, sink, ring), 1e-5)


@pytest.mark.parametrize("qtype", list(layout.GEMV_KINDS), ids=lambda q: q.name)
@pytest.mark.parametrize("chosen", [[0], [1, 2, 5], [0, 1, 2, 3, 4, 5, 6]], ids=str)
def test_unpack_experts_fills_the_slots_split_of_makes(qtype, chosen):
    """The streamer copies chosen experts' GGUF bytes one after another, then unpack_experts spreads them to their
    slots: the same bytes as Split.of on the whole tensor, and nothing else written."""
    n_expert, rows, cols = 7, 5, 96
    block = GGML_QUANT_SIZES[qtype][1]
    per = rows * cols // 32 * block
    raw = torch.from_numpy(np.random.default_rng(len(chosen)).integers(0, 256, n_expert * per, dtype=np.uint8))
    full = layout.Split.of(raw.to(DEV), qtype, (cols, rows, n_expert))
    staged = torch.cat([raw[e * per:(e + 1) * per] for e in chosen]).to(DEV)
    got = layout.Split.of(torch.zeros_like(raw, device=DEV), qtype, (cols, rows, n_expert))
    moe.unpack_experts(staged, torch.tensor(chosen, device=DEV), got)
    for e in range(n_expert):
        g, f = got.expert(e), full.expert(e)
        if e in chosen:
            assert torch.equal(g.qs, f.qs) and torch.equal(g.d.view(torch.uint8), f.d.view(torch.uint8))
        else:
            assert not g.qs.any() and not g.d.view(torch.uint8).any()


@pytest.mark.parametrize("key_type", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("n,heads,d,cells", [(1, 8, 32, 100), (3, 5, 17, 70), (2, 64, 128, 300), (4, 20, 64, 1),
                                             (1, 100, 64, 130), (9, 7, 48, 90), (37, 8, 128, 200)])
def test_indexer_scores_and_top_k_match_float64(key_type, n, heads, d, cells):
    """Each token's scores of the cells base .. base + pos (sum over heads of w * relu(q . k)), -inf elsewhere; its
    top-k cells by them, -1 in the slots of a token that sees fewer. f16 keys: products of f16 queries (a decode
    step's heads as rows, from 9 tokens tiled over tokens), compared with the reference of those."""
    rng = np.random.default_rng(n * heads + d + cells)
    q = torch.from_numpy(rng.standard_normal((n, heads, d)))
    w = torch.from_numpy(rng.standard_normal((n, heads)))
    keys = torch.from_numpy(rng.standard_normal((cells, d))).to(key_type)
    pos = torch.from_numpy(rng.integers(0, max(cells // 2, 1), n))
    base = torch.from_numpy(rng.integers(0, max(cells // 2, 1), n)) if cells > 1 else torch.zeros(n, dtype=torch.int64)
    want = torch.full((n, cells), float("-inf"), dtype=torch.float64)
    qr = q.half().double() if key_type == torch.float16 else q
    for t in range(n):
        seen = torch.arange(int(base[t]), int(base[t] + pos[t]) + 1)
        relu = (keys.double()[seen] @ qr[t].T).clamp(min=0)  # (cells seen, heads)
        want[t, seen] = relu @ w[t]
    dev = lambda x: x.to(DEV)  # noqa: E731
    got = indexer.indexer_scores(dev(q.float()), dev(w.float()), dev(keys), dev(pos), dev(base), cells).double().cpu()
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    live = ~torch.isinf(want)
    assert (got[live] - want[live]).abs().max() <= 1e-5 * max(want[live].abs().max().item(), 1.0)
    top_k = max(1, cells // 4)
    ids = indexer.indexer_top_k(dev(q.float()), dev(w.float()), dev(keys), dev(pos), dev(base), top_k, cells).cpu()
    assert ids.shape == (n, top_k) and ids.dtype == torch.int32
    for t in range(n):
        picked = ids[t][ids[t] >= 0].long()
        seen = int(pos[t]) + 1
        assert len(picked) == min(top_k, seen) and len(set(picked.tolist())) == len(picked)
        assert live[t, picked].all()
        left = live[t].clone()
        left[picked] = False
        assert not left.any() or want[t, picked].min() >= want[t][left].max() - 1e-6


@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("ktype", [Q.F16, Q.Q8_0], ids=str)
@pytest.mark.parametrize("n,heads,dk,dv,top_k", [(1, 16, 96, 64, 24), (3, 4, 64, 64, 7), (2, 8, 576, 512, 40)])
def test_attention_decode_over_selected_cells_matches_float64(splits, ktype, n, heads, dk, dv, top_k):
    """DeepSeek sparse attention's decode: each token over the cells it was given (some slots empty, -1) of one
    shared key head whose values are the first dv of each key row (MLA's latent), only those rows read."""
    rng = np.random.default_rng(heads + dk + n + top_k)
    cells = 100
    kraw, k = _cache(rng, ktype, cells, dk)
    q = torch.from_numpy(rng.standard_normal((n, heads, dk)))
    ids = torch.from_numpy(np.stack([rng.permutation(cells)[:top_k] for _ in range(n)])).int()
    ids[:, top_k // 2 + 1:][torch.from_numpy(rng.random((n, top_k - top_k // 2 - 1)) < 0.5)] = -1
    want = torch.empty(n, heads, dv, dtype=torch.float64)
    for t in range(n):
        cell = ids[t][ids[t] >= 0].long()
        weights = torch.softmax(k[cell] @ q[t].T * dk ** -0.5, 0)  # (cells, heads)
        want[t] = weights.T @ k[cell][:, :dv]
    zeros = torch.zeros(n, dtype=torch.int64, device=DEV)
    got = attention.attention_decode(q.float().to(DEV), kraw, kraw, ktype == Q.Q8_0, ktype == Q.Q8_0, zeros, zeros, 1,
                                     dv, dk ** -0.5, 0, (32, 4), splits=splits, select=ids.to(DEV))
    _close(got, want.view(n, -1), 1e-5)


@pytest.mark.parametrize("splits", [None, 1, 3])
@pytest.mark.parametrize("n,heads,dk,dv,top_k", [(1, 16, 96, 64, 24), (5, 20, 64, 32, 7), (3, 128, 576, 512, 40),
                                                 (2, 3, 100, 60, 70)])
def test_attention_over_selected_cells_matches_float64(splits, n, heads, dk, dv, top_k):
    """Sparse attention's kernel over a latent cache: each token's heads over the cells it was given (some slots
    empty, one token given but one) of one shared f16 key head, values the first dv of each row; in one part or cut
    into parts merged after (a part may see no cell)."""
    rng = np.random.default_rng(heads + dk + n + top_k)
    cells = 100
    kraw, k = _cache(rng, Q.F16, cells, dk)
    q = torch.from_numpy(rng.standard_normal((n, heads, dk)))
    ids = torch.from_numpy(np.stack([rng.permutation(cells)[:top_k] for _ in range(n)])).int()
    ids[:, top_k // 2 + 1:][torch.from_numpy(rng.random((n, top_k - top_k // 2 - 1)) < 0.5)] = -1
    ids[0, 1:] = -1
    want = torch.empty(n, heads, dv, dtype=torch.float64)
    for t in range(n):
        cell = ids[t][ids[t] >= 0].long()
        qt = q[t].half().double()  # the kernel's products take f16 queries
        weights = torch.softmax(k[cell] @ qt.T * dk ** -0.5, 0)
        want[t] = weights.T @ k[cell][:, :dv]
    got = attention.attention_selected(q.float().to(DEV), kraw, ids.to(DEV), dv, dk ** -0.5, splits)
    _close(got, want.view(n, -1), 2e-3)  # the softmax weights go into the value product as f16


def test_attention_splits_fill_the_gpu_only_for_long_caches():
    assert attention.attention_splits(128, 32, 128) == 1  # tg128's cache: one pass
    assert attention.attention_splits(4096, 32, 128) == 8  # Qwen3's 32 heads over 4096 cells
    assert attention.attention_splits(4096, 16, 32) == 16  # MLA: 16 heads, 32 cells per step
    assert attention.attention_splits(1 << 17, 32, 128) == 8  # bounded by the GPU, not the cache
    assert attention.attention_splits(4096, 600, 128) == 1  # enough programs already


@pytest.mark.parametrize("n,width", [(1, 32), (3, 512), (2, 96 * 3), (5, 1024)])
def test_store_q8_0_matches_ggml_rounding(n, width):
    rng = np.random.default_rng(width + n)
    x = (rng.standard_normal((n, width)) * rng.uniform(0.1, 10)).astype(np.float32)
    x[0, :8] = 0.0  # an all-zero start of a block, and exact halves
    x[-1, 8:10] = [2.5, -2.5]
    cache = torch.zeros(10, width // 32 * 34, dtype=torch.uint8, device=DEV)
    cells = torch.from_numpy(rng.permutation(10)[:n]).to(DEV)
    attention.store_q8_0(torch.from_numpy(x).to(DEV), cache, cells)
    want = np.ascontiguousarray(gguf_quants.quantize(x, Q.Q8_0)).view(np.uint8).reshape(n, -1)
    got = cache[cells].cpu().numpy()
    assert (got != want).mean() < 1e-3  # a quotient within an ulp of .5 may round either way
    assert np.abs(got.view(np.int8).astype(int) - want.view(np.int8).astype(int)).max() <= 1 or (got == want).all()


@pytest.mark.parametrize("qtype", list(layout.GEMV_KINDS), ids=lambda q: q.name)
@pytest.mark.parametrize("n,n_expert,n_used,rows,cols,block", [(1, 4, 2, 64, 64, 16), (37, 8, 3, 96, 160, 16),
                                                               (50, 16, 4, 130, 96, 32), (129, 6, 2, 64, 256, 64),
                                                               (300, 4, 2, 64, 384, 128)])
def test_grouped_moe_mm_matches_float64(qtype, n, n_expert, n_used, rows, cols, block):
    """Every pair's row times its expert's matrix, through the GPU-built tile schedule: odd token counts, experts
    with no tokens, tiles that straddle nothing; the gated form act(x . gate) * (x . up) in one launch; rows read
    and written through indices."""
    act = ("silu", "gelu", "silu_clamp")[n % 3]
    rng = np.random.default_rng(n * rows + cols)
    raw, w = _quantized(rng, qtype, n_expert, rows, cols)
    ids = torch.stack([torch.from_numpy(rng.permutation(n_expert - 1)[:n_used]) for _ in range(n)])  # one idle expert
    sched = moe.moe_tiles(ids.to(DEV), n_expert, block)
    order = sched[0].cpu()
    x = torch.from_numpy(rng.standard_normal((n * n_used, cols))).half()
    got = moe.moe_mm(x[order].to(DEV), layout.Split.of(raw, qtype, (cols, rows, n_expert)), sched, torch.float32, block)
    flat = ids.flatten()[order]
    want = torch.stack([w[int(e)] @ x[order][i].double() for i, e in enumerate(flat)])
    _close(got, want, 2e-3)  # f16 weights (one rounding each), float32 accumulation
    raw_up, w_up = _quantized(rng, qtype, n_expert, rows, cols)
    gated = moe.moe_mm(x[order].to(DEV), layout.Split.of(raw, qtype, (cols, rows, n_expert)), sched, torch.float32, block,
                       up=layout.Split.of(raw_up, qtype, (cols, rows, n_expert)), act=act)
    up_rows = torch.stack([w_up[int(e)] @ x[order][i].double() for i, e in enumerate(flat)])
    _close(gated, GLU[act](want, up_rows), 2e-3)
    # rows read in place through an index (pair p reads its token's row p // n_used) and written back in pair order
    # times the pair's router weight
    tokens = torch.from_numpy(rng.standard_normal((n, cols))).half()
    scale = torch.from_numpy(rng.uniform(0.1, 1.0, n * n_used)).float()
    placed = moe.moe_mm(tokens.to(DEV), layout.Split.of(raw, qtype, (cols, rows, n_expert)), sched, torch.float32, block,
                        rows_from=(order // n_used).to(torch.int32).to(DEV), rows_to=order.to(torch.int32).to(DEV),
                        row_scale=scale.to(DEV))
    by_pair = torch.stack([w[int(ids.flatten()[p])] @ tokens[p // n_used].double() * scale[p].double()
                           for p in range(n * n_used)])
    _close(placed, by_pair, 2e-3)
    covered = torch.zeros(n * n_used, dtype=torch.int64)
    for e, r0, r1 in zip(*(t.cpu().tolist() for t in sched[1:])):
        if e >= 0:
            assert (flat[r0:r1] == e).all()
            covered[r0:r1] += 1
    assert (covered == 1).all()  # each sorted row in exactly one tile


KMM = [(Q.Q4_K, Q.Q4_K, (1, 4, 2, 64, 256, 16)), (Q.Q6_K, Q.Q4_K, (37, 8, 3, 96, 512, 16)),
       (Q.Q5_K, Q.Q5_K, (50, 16, 4, 130, 256, 32)), (Q.Q4_K, Q.Q6_K, (129, 6, 2, 64, 768, 64)),
       (Q.Q6_K, Q.Q6_K, (300, 4, 2, 64, 256, 128)), (IK.IQ4_KS, IK.IQ5_KS, (37, 8, 3, 96, 512, 16)),
       (IK.IQ4_K, IK.IQ4_K, (50, 16, 4, 130, 256, 32)), (IK.IQ3_KS, IK.IQ2_KS, (2, 4, 2, 64, 256, 16)),
       (IK.IQ2_KS, IK.IQ4_KS, (129, 6, 2, 64, 256, 64)), (IK.IQ4_KSS, IK.IQ2_KL, (37, 8, 3, 96, 512, 16)),
       (IK.IQ3_K, IK.IQ2_K, (2, 4, 2, 64, 256, 16))]


@pytest.mark.parametrize("qtype,utype,shape", KMM, ids=lambda v: v.name if isinstance(v, (Q, IkQuant)) else str(v))
def test_kquant_grouped_moe_mm_matches_float64(qtype, utype, shape):
    """kquant.kmoe_mm, the grouped GEMM on K-quant experts in their GGUF blocks: every pair's row times its expert's
    matrix through the GPU-built tile schedule (odd token counts, an idle expert); gated with an up projection of
    another K-quant type; rows read and written through indices, times the router's weight."""
    n, n_expert, n_used, rows, cols, block = shape
    act = "silu" if n % 2 else "gelu"
    rng = np.random.default_rng(n * rows + cols)
    raw, w = _kquant(rng, qtype, n_expert, rows, cols)
    raw_up, w_up = _kquant(rng, utype, n_expert, rows, cols)
    ids = torch.stack([torch.from_numpy(rng.permutation(n_expert - 1)[:n_used]) for _ in range(n)])  # one idle expert
    sched = moe.moe_tiles(ids.to(DEV), n_expert, block)
    order = sched[0].cpu()
    flat = ids.flatten()[order]
    x = torch.from_numpy(rng.standard_normal((n * n_used, cols))).half()
    ne = (cols, rows, n_expert)
    got = kquant.kmoe_mm(x[order].to(DEV), (raw, qtype, ne), sched, torch.float32, block)
    want = torch.stack([w[int(e)] @ x[order][i].double() for i, e in enumerate(flat)])
    _close(got, want, 2e-3)  # f16 weights (one rounding each), float32 accumulation
    gated = kquant.kmoe_mm(x[order].to(DEV), (raw, qtype, ne), sched, torch.float32, block, up=(raw_up, utype, ne),
                           act=act)
    up_rows = torch.stack([w_up[int(e)] @ x[order][i].double() for i, e in enumerate(flat)])
    _close(gated, GLU[act](want, up_rows), 2e-3)
    tokens = torch.from_numpy(rng.standard_normal((n, cols))).half()
    scale = torch.from_numpy(rng.uniform(0.1, 1.0, n * n_used)).float()
    placed = kquant.kmoe_mm(tokens.to(DEV), (raw, qtype, ne), sched, torch.float32, block,
                            rows_from=(order // n_used).to(torch.int32).to(DEV),
                            rows_to=order.to(torch.int32).to(DEV), row_scale=scale.to(DEV))
    by_pair = torch.stack([w[int(ids.flatten()[p])] @ tokens[p // n_used].double() * scale[p].double()
                           for p in range(n * n_used)])
    _close(placed, by_pair, 2e-3)


@pytest.mark.parametrize("qtype", list(layout.GEMV_KINDS), ids=lambda q: q.name)
@pytest.mark.parametrize("n,n_expert,n_used,n_embd,n_ff", [(1, 4, 2, 64, 96), (37, 8, 3, 160, 64)])
def test_the_gpu_halves_of_the_experts_match_float64(qtype, n, n_expert, n_used, n_embd, n_ff):
    """CudaBackend.pair_up_gate / pair_down, the GPU's half when the CPU runs the other (moe_up_gate / moe_down set
    apart): each pair's act(gate x) * (up x) in pair order; each token's router-weighted sum of down h."""
    from ferry.backends.cuda import CudaBackend

    rng = np.random.default_rng(n * n_ff + n_used)
    (raw_g, g), (raw_u, u) = (_quantized(rng, qtype, n_expert, n_ff, n_embd) for _ in range(2))
    raw_d, d = _quantized(rng, qtype, n_expert, n_embd, n_ff)
    split = lambda raw, ne: layout.Split.of(raw, qtype, ne)  # noqa: E731
    ids = torch.stack([torch.from_numpy(rng.permutation(n_expert)[:n_used]) for _ in range(n)])
    x = torch.from_numpy(rng.standard_normal((n, n_embd))).half()
    h = torch.from_numpy(rng.standard_normal((n * n_used, n_ff))).half()  # the CPU's rows, made up
    weights = torch.from_numpy(rng.uniform(0.1, 1.0, (n, n_used))).float()
    backend = CudaBackend(DEV)
    got_h = backend.pair_up_gate(x.to(DEV), ids.to(DEV), split(raw_g, (n_embd, n_ff, n_expert)),
                                 split(raw_u, (n_embd, n_ff, n_expert)), "silu")
    got_y = backend.pair_down(h.to(DEV), ids.to(DEV), split(raw_d, (n_ff, n_embd, n_expert)), weights.to(DEV))
    pairs = [(p // n_used, int(ids.flatten()[p])) for p in range(n * n_used)]
    want_h = torch.stack([torch.nn.functional.silu(g[e] @ x[t].double()) * (u[e] @ x[t].double()) for t, e in pairs])
    want_y = torch.zeros(n, n_embd, dtype=torch.float64)
    for p, (t, e) in enumerate(pairs):
        want_y[t] += weights.flatten()[p].double() * (d[e] @ h[p].double())
    _close(got_h, want_h, 3e-3)  # f16 weights and output, float32 accumulation
    _close(got_y, want_y, 2e-3)


@pytest.mark.parametrize("qtype", list(layout.GEMV_KINDS), ids=lambda q: q.name)
@pytest.mark.parametrize("n,n_expert,n_used,n_embd,n_ff,kept", [(1, 8, 4, 64, 96, (1, 6)), (3, 16, 6, 96, 64, (0, 3, 9, 15)),
                                                                (29, 8, 3, 64, 32, (2, 5, 6)), (1, 4, 2, 32, 32, ())])
def test_resident_experts_give_only_their_pairs(qtype, n, n_expert, n_used, n_embd, n_ff, kept):
    """CudaBackend.resident_experts: Splits of some experts alone, each pair's place among them (-1: elsewhere);
    each token's weighted sum over its pairs on those experts, the others skipped (expert GEMVs for few pairs, the
    grouped GEMM above 64: 29 tokens of 3)."""
    from ferry.backends.cuda import CudaBackend

    rng = np.random.default_rng(n * n_expert + len(kept))
    (raw_g, g), (raw_u, u) = (_quantized(rng, qtype, n_expert, n_ff, n_embd) for _ in range(2))
    raw_d, d = _quantized(rng, qtype, n_expert, n_embd, n_ff)
    idx = torch.tensor(kept, dtype=torch.long)

    def resident(raw, ne):
        return layout.Split.of(raw.view(n_expert, -1)[idx.to(DEV)].reshape(-1), qtype, (*ne, len(kept)))
    slot_of = torch.full((n_expert,), -1, dtype=torch.int32)
    slot_of[idx] = torch.arange(len(kept), dtype=torch.int32)
    ids = torch.stack([torch.from_numpy(rng.permutation(n_expert)[:n_used]) for _ in range(n)])
    x = torch.from_numpy(rng.standard_normal((n, n_embd))).float()
    weights = torch.from_numpy(rng.uniform(0.1, 1.0, (n, n_used))).float()
    act = "swiglu_oai" if qtype == Q.MXFP4 else "silu"  # gpt-oss's: its biases too, only the kept experts' rows
    biases = _biases(rng, n_expert, n_embd, n_ff) if act == "swiglu_oai" else None
    got = CudaBackend(DEV).resident_experts(x.to(DEV), slot_of[ids].to(DEV), weights.to(DEV),
                                            resident(raw_g, (n_embd, n_ff)), resident(raw_u, (n_embd, n_ff)),
                                            resident(raw_d, (n_ff, n_embd)), act,
                                            None if biases is None else tuple(b[idx].to(DEV) for b in biases))
    gone = torch.where(slot_of[ids] >= 0, ids, -1)
    _close(got, _experts_reference(x, gone, weights, g, u, d, act, None, biases),
           5e-5 if n * n_used <= 64 else 3e-3)  # the grouped GEMM: f16 activations


HELD = [(Q4_K_M, (1, 8, 4, 256, 512, (1, 6))), (Q4_K_M, (29, 8, 3, 256, 256, (2, 5, 6))),
        ((Q.IQ4_XS,) * 3, (2, 6, 2, 256, 256, (0, 4))), (Q4_K_M, (1, 4, 2, 256, 256, ())),
        ((IK.IQ4_KS, IK.IQ4_KS, IK.IQ5_KS), (1, 8, 4, 256, 512, (1, 6))), ((IK.IQ4_K,) * 3, (29, 8, 3, 256, 256, (2, 5, 6)))]


@pytest.mark.parametrize("types,shape", HELD, ids=str)
def test_held_blocks_give_only_their_pairs(types, shape):
    """CudaBackend.resident_experts on layout.Blocks (some experts of a type the split kernels do not read, in their
    GGUF blocks): each token's weighted sum over its pairs on those experts, the others skipped: kquant.py's expert
    GEMVs on the blocks for few pairs of K-quants, else each projection expanded to bfloat16 and the grouped GEMM
    over the pairs sorted by place (29 tokens of 3; IQ4_XS, which the GEMVs do not read, at 4 pairs too)."""
    from ferry.backends.cuda import CudaBackend

    n, n_expert, n_used, n_embd, n_ff, kept = shape
    rng = np.random.default_rng(n * n_expert + len(kept))
    (raw_g, g), (raw_u, u), (raw_d, d) = (_kquant(rng, q, n_expert, a, b) for q, (a, b) in
                                          zip(types, ((n_ff, n_embd), (n_ff, n_embd), (n_embd, n_ff))))
    idx = torch.tensor(kept, dtype=torch.long)

    def held(raw, q, ne):
        return layout.Blocks(q, (*ne, len(kept)), raw.view(n_expert, -1)[idx.to(DEV)].reshape(-1))
    slot_of = torch.full((n_expert,), -1, dtype=torch.int32)
    slot_of[idx] = torch.arange(len(kept), dtype=torch.int32)
    ids = torch.stack([torch.from_numpy(rng.permutation(n_expert)[:n_used]) for _ in range(n)])
    x = torch.from_numpy(rng.standard_normal((n, n_embd))).float()
    weights = torch.from_numpy(rng.uniform(0.1, 1.0, (n, n_used))).float()
    got = CudaBackend(DEV).resident_experts(x.to(DEV), slot_of[ids].to(DEV), weights.to(DEV),
                                            held(raw_g, types[0], (n_embd, n_ff)),
                                            held(raw_u, types[1], (n_embd, n_ff)),
                                            held(raw_d, types[2], (n_ff, n_embd)), "silu")
    gone = torch.where(slot_of[ids] >= 0, ids, -1)
    gemv = n * n_used <= 64 and types != (Q.IQ4_XS,) * 3
    _close(got, _experts_reference(x, gone, weights, g, u, d, "silu", None), 5e-5 if gemv else 2e-2)


@pytest.mark.parametrize("n,n_used", [(2, 2), (37, 3)])
def test_staged_compact_experts_match_float64(n, n_used):
    """Experts staged as copied (streamer.Compact: the copied experts' blocks in order, each expert's place): the
    streamed pairs of CudaBackend.expert_pairs (expert GEMVs on the blocks for few pairs, the grouped GEMM on bfloat16
    expansions for many) and the halves pair_up_gate / pair_down."""
    from ferry.backends.cuda import CudaBackend
    from ferry.backends.streamer import Compact

    n_expert, n_embd, n_ff = 9, 256, 512
    rng = np.random.default_rng(n + n_used)
    (raw_g, g), (raw_u, u), (raw_d, d) = (_kquant(rng, q, n_expert, a, b) for q, (a, b) in
                                          zip(Q4_K_M, ((n_ff, n_embd), (n_ff, n_embd), (n_embd, n_ff))))
    ids = torch.stack([torch.from_numpy(rng.permutation([0, 2, 3, 7, 8])[:n_used]) for _ in range(n)])
    copied = torch.tensor([0, 2, 3, 7, 8])  # the experts hit, in the order copied
    slot_of = torch.full((n_expert,), -1, dtype=torch.int32)
    slot_of[copied] = torch.arange(len(copied), dtype=torch.int32)

    def staged(raw, q, ne):
        return Compact(layout.Blocks(q, (*ne, len(copied)), raw.view(n_expert, -1)[copied.to(DEV)].reshape(-1)),
                       slot_of.to(DEV))
    cg, cu, cd = (staged(r, q, ne) for r, q, ne in zip((raw_g, raw_u, raw_d), Q4_K_M,
                                                       ((n_embd, n_ff), (n_embd, n_ff), (n_ff, n_embd))))
    x = torch.from_numpy(rng.standard_normal((n, n_embd))).float()
    weights = torch.from_numpy(rng.uniform(0.1, 1.0, (n, n_used))).float()
    backend = CudaBackend(DEV)
    y = backend.expert_pairs(x.to(DEV), ids.to(DEV), cg, cu, cd, "silu", weights=weights.to(DEV))
    tol = 5e-5 if n * n_used <= 64 else 2e-2  # bfloat16 weights and activations for many pairs
    for p in range(n * n_used):
        one = torch.tensor([[int(ids.flatten()[p])]])
        want = _experts_reference(x[p // n_used:p // n_used + 1], one, weights.flatten()[p:p + 1].view(1, 1), g, u, d,
                                  "silu", None)
        _close(y[p:p + 1], want, tol)
    h = backend.pair_up_gate(x.to(DEV), ids.to(DEV), cg, cu, "silu")
    pairs = [(p // n_used, int(ids.flatten()[p])) for p in range(n * n_used)]
    want_h = torch.stack([torch.nn.functional.silu(g[e] @ x[t].double()) * (u[e] @ x[t].double()) for t, e in pairs])
    _close(h, want_h, 2e-2)
    out = backend.pair_down(want_h.float().to(DEV), ids.to(DEV), cd, weights.to(DEV))
    want_y = torch.zeros(n, n_embd, dtype=torch.float64)
    for p, (t, e) in enumerate(pairs):
        want_y[t] += weights.flatten()[p].double() * (d[e] @ want_h[p])
    _close(out, want_y, 2e-2)


@pytest.mark.parametrize("n_expert", [1, 7, 128, 256, 300, 40000])  # keys of uint8, int16 and int32
def test_sort_pairs_orders_by_expert_and_counts_each(n_expert):
    rng = np.random.default_rng(n_expert)
    ids = torch.from_numpy(rng.integers(0, n_expert, (37, 6))).int()
    ids[0, 0] = n_expert - 1  # the widest id the key type must hold
    order, counts, ends = moe.sort_pairs(ids.to(DEV), n_expert)
    flat = ids.flatten().long()
    want = torch.bincount(flat, minlength=n_expert)
    assert torch.equal(counts.cpu(), want) and torch.equal(ends.cpu(), want.cumsum(0))
    assert torch.equal(order.cpu(), torch.argsort(flat, stable=True))  # stable: a pair's slot order kept


@pytest.mark.parametrize("n,heads,m,k", [(1, 1, 1, 1), (3, 4, 37, 96), (8, 3, 512, 128), (2, 5, 130, 513)])
def test_head_gemv_matches_float64(n, heads, m, k):
    """Each head through its own float16 matrix (deepseek2's k_b / v_b): contiguous, transposed and broadcast views."""
    rng = np.random.default_rng(n + heads + m + k)
    x = torch.from_numpy(rng.standard_normal((n, heads, k)))
    w = torch.from_numpy(rng.standard_normal((heads, m, k))).half()
    _close(gemv.head_gemv(x.float().to(DEV), w.to(DEV)), torch.einsum("nhk,hmk->nhm", x, w.double()))
    wt = torch.from_numpy(rng.standard_normal((heads, k, m))).half()  # read as (heads, m, k) through its strides
    _close(gemv.head_gemv(x.float().to(DEV), wt.to(DEV).transpose(1, 2)), torch.einsum("nhk,hkm->nhm", x, wt.double()))
    row = x[:, :1].float().to(DEV).expand(n, heads, k)  # one row per token shared by every head (a latent)
    assert heads == 1 or row.stride(1) == 0
    _close(gemv.head_gemv(row, w.to(DEV)), torch.einsum("nhk,hmk->nhm", x[:, :1].expand(n, heads, k), w.double()))


@pytest.mark.parametrize("tiled", [True, False])
@pytest.mark.parametrize("heads,k_heads,d_k,d_v", [(4, 2, 16, 16), (6, 3, 32, 48), (32, 16, 128, 128)])
def test_delta_step_matches_float64(tiled, heads, k_heads, d_k, d_v):
    """One token of the gated delta rule with its gates (beta = sigmoid(b), decay exp(softplus(alpha + dt_bias) * a))
    and q/k L2 norms, the state updated in place (ggml's transposed layout), against float64; value head h reads key
    head h % key heads, or h // ratio."""
    from ferry.kernels.cuda.delta_net import step

    gen = torch.Generator().manual_seed(heads + d_v)
    q, k = torch.randn(1, k_heads, d_k, generator=gen), torch.randn(1, k_heads, d_k, generator=gen)
    v = torch.randn(1, heads, d_v, generator=gen)
    b, alpha = torch.randn(1, heads, generator=gen), torch.randn(1, heads, generator=gen) * 3
    dt, a = torch.randn(heads, generator=gen), -torch.rand(heads, generator=gen) * 2
    s = torch.randn(heads, d_v, d_k, generator=gen)
    eps = 1e-6
    kh = torch.arange(heads) % k_heads if tiled else torch.arange(heads) // (heads // k_heads)
    q64, k64 = (t[0, kh].double() / (t[0, kh].double().pow(2).sum(-1, keepdim=True) + eps).sqrt() for t in (q, k))
    g = torch.nn.functional.softplus(alpha[0].double() + dt.double()) * a.double()
    s64 = s.double().transpose(1, 2) * g.exp()[:, None, None]
    u = torch.sigmoid(b[0].double())[:, None] * (v[0].double() - torch.einsum("hkv,hk->hv", s64, k64))
    s64 = s64 + k64[:, :, None] * u[:, None, :]
    want = torch.einsum("hkv,hk->hv", s64, q64) * d_k ** -0.5
    state = s.to(DEV)
    got = step(*(t.to(DEV) for t in (q, k, v, b, alpha, dt, a)), state, tiled, eps)
    _close(got[0], want)
    _close(state.transpose(1, 2), s64)


@pytest.mark.parametrize("rows,d", [(1, 16), (7, 128), (40, 96)])
def test_gated_norm_matches_float64(rows, d):
    from ferry.kernels.cuda.delta_net import gated_norm

    gen = torch.Generator().manual_seed(rows * d)
    x, z, w = torch.randn(rows, d, generator=gen), torch.randn(rows, d, generator=gen), torch.randn(d, generator=gen)
    x64 = x.double()
    want = x64 / (x64.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt() * w.double() * torch.nn.functional.silu(z.double())
    _close(gated_norm(x.to(DEV), w.to(DEV), z.to(DEV), 1e-6), want)


@pytest.mark.parametrize("heads,n,d_k,d_v", [(2, 64, 16, 16), (3, 150, 32, 48), (4, 130, 128, 128)])
def test_delta_scan_matches_the_float64_recurrence(heads, n, d_k, d_v):
    """The prompt form with the state's passage through the chunks in one kernel (ieee float32 products) against the
    float64 recurrence taken token by token: whole chunks and a remainder."""
    from ferry.kernels.cuda.delta_net import scan
    from ferry.layers.delta_net import delta_rule

    gen = torch.Generator().manual_seed(n)
    q, k = (torch.nn.functional.normalize(torch.randn(n, heads, d_k, generator=gen), dim=-1) for _ in range(2))
    v = torch.randn(n, heads, d_v, generator=gen)
    g, beta = -torch.rand(n, heads, generator=gen) * 2, torch.rand(n, heads, generator=gen)
    s0 = torch.randn(heads, d_k, d_v, generator=gen) * 0.5
    s64, outs = s0.double(), []
    for t in range(n):
        s64 = s64 * g[t].double().exp()[:, None, None]
        u = beta[t].double()[:, None] * (v[t].double() - torch.einsum("hkv,hk->hv", s64, k[t].double()))
        s64 = s64 + k[t].double()[:, :, None] * u[:, None, :]
        outs.append(torch.einsum("hkv,hk->hv", s64, q[t].double()) * d_k ** -0.5)
    out, last = delta_rule(*(t.to(DEV) for t in (q, k, v, g, beta, s0)), scan=scan)
    _close(out, torch.stack(outs), 1e-4)
    _close(last, s64, 1e-4)


@pytest.mark.parametrize("channels,kernel", [(8, 4), (300, 4), (1000, 2), (96, 5)])
def test_conv_step_matches_float64(channels, kernel):
    """One token of the causal convolution and SiLU, the kept inputs moved down one place with the new one last."""
    from ferry.kernels.cuda.delta_net import conv_step

    gen = torch.Generator().manual_seed(channels)
    x, kept = torch.randn(1, channels, generator=gen), torch.randn(channels, kernel - 1, generator=gen)
    w = torch.randn(channels, kernel, generator=gen)
    full = torch.cat([kept, x.t()], 1).double()
    want = torch.nn.functional.silu((full * w.double()).sum(1))[None]
    state = kept.to(DEV)
    _close(conv_step(x.to(DEV), state, w.to(DEV)), want)
    _close(state, full[:, 1:])


@pytest.mark.parametrize("n,d,n_hc", [(1, 64, 4), (5, 300, 4), (33, 1000, 2), (3, 4096, 4)])
def test_hyper_connection_kernels_match_float64(n, d, n_hc):
    """DeepSeek-V4's hyper-connections: pre (sigmoid + eps), post (2 sigmoid), comb (softmax over destinations, then 20
    Sinkhorn rounds) from a sub-layer's mixing logits, the streams collapsed into its input; then its output written
    back, X'[k] = post[k] y + sum_j comb[j, k] X[j]. Odd widths, one and many tokens."""
    from ferry.kernels.cuda import hyper
    from ferry.layers.hyper_connection import sinkhorn

    rng = np.random.default_rng(n * d + n_hc)
    m = (2 + n_hc) * n_hc
    streams, mix, y = (torch.from_numpy(rng.standard_normal(s)) for s in ((n, n_hc * d), (n, m), (n, d)))
    base, scale = torch.from_numpy(rng.standard_normal(m)), torch.from_numpy(rng.uniform(0.5, 2, 3))
    eps = 1e-6
    pre = torch.sigmoid(mix[:, :n_hc] * scale[0] + base[:n_hc]) + eps
    post = 2 * torch.sigmoid(mix[:, n_hc:2 * n_hc] * scale[1] + base[n_hc:2 * n_hc])
    comb = sinkhorn(torch.softmax((mix[:, 2 * n_hc:] * scale[2] + base[2 * n_hc:]).view(n, n_hc, n_hc), -1) + eps, 20,
                    eps)
    x = torch.einsum("nj,njd->nd", pre, streams.view(n, n_hc, d))
    got = hyper.hyper_pre(streams.float().to(DEV), mix.float().to(DEV), base.float().to(DEV), scale.float().to(DEV),
                          n_hc, 20, eps)
    for g, want in zip(got, (x, post, comb)):
        _close(g, want, 2e-5)
    out = hyper.hyper_post(streams.float().to(DEV), y.float().to(DEV), post.float().to(DEV), comb.float().to(DEV))
    want = (post[..., None] * y[:, None] + torch.einsum("njd,njk->nkd", streams.view(n, n_hc, d), comb)).reshape(n, -1)
    _close(out, want, 2e-5)


def _pooled_entries(kv, score, ape, ratio, d, norm, rope, eps):
    """float64 reference of a compressor's entries from every position's rows kv, score (positions, width): window w
    pooled over its positions (and, width 2 d, the previous window's first d channels), softmax per channel of
    score + ape by place, RMSNorm, rope at the window's first position."""
    n_pos, width = kv.shape
    score = score + ape[torch.arange(n_pos) % ratio]
    out = []
    for w in range((n_pos) // ratio):
        this = slice(w * ratio, (w + 1) * ratio)
        if width == 2 * d:
            prev = slice((w - 1) * ratio, w * ratio)
            old_kv = kv[prev, :d] if w else torch.zeros(ratio, d, dtype=kv.dtype)
            old_s = score[prev, :d] if w else torch.full((ratio, d), float("-inf"), dtype=kv.dtype)
            rows, s = torch.cat([old_kv, kv[this, d:]]), torch.cat([old_s, score[this, d:]])
        else:
            rows, s = kv[this], score[this]
        x = (rows * torch.softmax(s, 0)).sum(0)
        x = x * torch.rsqrt(x.pow(2).mean() + eps) * norm
        cos, sin = rope.angles(torch.tensor([w * ratio]))
        tail = rope(x[None, None, d - rope.n_rot:], cos.double(), sin.double())[0, 0]
        out.append(torch.cat([x[:d - rope.n_rot], tail]))
    return torch.stack(out) if out else torch.zeros(0, d, dtype=torch.float64)


@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize("ratio,d,n_rot,overlap,step", [(4, 64, 16, True, 1), (4, 96, 32, True, 3), (16, 64, 16, False, 1),
                                                        (5, 40, 8, False, 2), (128, 128, 64, False, 8)])
def test_compress_step_matches_float64(neox, ratio, d, n_rot, overlap, step):
    """A compressor's decode steps (one token, or a few at once) from position 0: the rows into its ring, each
    completed window pooled into its entry; against the entries pooled from every position's rows at once. Odd sizes:
    ratio 5, width 40, three tokens a step that complete windows mid-step."""
    from ferry.kernels.cuda.compressed import compress_step
    from ferry.layers.rope import Rope

    rng = np.random.default_rng(ratio * d + n_rot + step)
    width, n_pos = (2 if overlap else 1) * d, 3 * ratio + step + 1
    kv, score = (torch.from_numpy(rng.standard_normal((n_pos, width))) for _ in range(2))
    ape, norm = torch.from_numpy(rng.standard_normal((ratio, width))), torch.from_numpy(rng.uniform(0.5, 2, d))
    rope = Rope(n_rot, 10000.0, neox)
    cos, sin = (t.to(DEV) for t in rope.angles(torch.arange(n_pos)))
    ring = 2 * ratio if overlap else ratio
    state = [torch.zeros(ring, width, device=DEV), torch.zeros(ring, width, device=DEV),
             torch.zeros(n_pos // ratio + 1, d, device=DEV)]
    f = lambda x: x.float().to(DEV)  # noqa: E731
    for p0 in range(0, n_pos, step):
        p = torch.arange(p0, min(p0 + step, n_pos))
        compress_step(f(kv[p]), f(score[p]), f(ape), *state, f(norm), cos, sin, p.to(DEV), ratio, n_rot, neox, 1e-6)
    want = _pooled_entries(kv, score, ape, ratio, d, norm, rope, 1e-6)
    _close(state[2][:want.shape[0]], want, 1e-5)
    assert not state[2][want.shape[0]:].any()  # no entry for the window still open


@pytest.mark.parametrize("ringed", [False, True], ids=["cells", "ring"])
@pytest.mark.parametrize("splits", [None, 1, 3])
@pytest.mark.parametrize("n,heads,d,window,ratio,cap,select", [
    (1, 16, 64, 8, 4, 20, True), (1, 16, 64, 8, 4, 20, False), (3, 20, 96, 8, 16, 9, True),
    (3, 20, 96, 8, 16, 9, False), (1, 64, 512, 128, 4, 70, True), (1, 64, 512, 128, 128, 70, False),
    (2, 5, 64, 5, 0, 0, False)])
def test_attention_compressed_matches_float64(select, splits, n, heads, d, window, ratio, cap, ringed):
    """DeepSeek-V4's decode attention: each token's heads over the last `window` cells of its sequence (fewer near
    its start) and the entries it sees (a complete window each), all of them or those chosen (some slots empty,
    some chosen ones not yet complete), keys the values, each head's sink in the denominator; f16 queries, cache
    rows and entries in the products. Cut into parts merged after (a part may see nothing). ringed: the window's
    rows a ring of window + 3 (KVCache.ring), position a at base + a % ring."""
    from ferry.kernels.cuda.compressed import attention_compressed

    rng = np.random.default_rng(heads + d + n + window + ratio)
    pos = torch.from_numpy(rng.integers(0, (cap - 1) * ratio if ratio else 100, n)) if n > 1 else \
        torch.tensor([max(cap - 1, 1) * max(ratio, 1) - 1])
    pos[0] = min(int(pos[0]), 3) if n > 1 else pos[0]  # one token near the start: fewer than `window` cells
    base = 40
    ring = window + 3 if ringed else 0
    cache = torch.from_numpy(rng.standard_normal((base + (ring or int(pos.max()) + 1), d))).half()
    entries = torch.from_numpy(rng.standard_normal((max(cap, 1), d))).float()
    q = torch.from_numpy(rng.standard_normal((n, heads, d)))
    sinks = torch.from_numpy(rng.standard_normal(heads))
    top_k = 6
    ids = torch.from_numpy(np.stack([rng.permutation(max(cap, 1))[:top_k] for _ in range(n)])).int()
    ids[:, 4:] = -1
    want = torch.empty(n, heads, d, dtype=torch.float64)
    for t in range(n):
        p = int(pos[t])
        at = torch.arange(max(0, p - window + 1), p + 1)
        keys = cache[base + (at % ring if ring else at)].double()
        if ratio:
            seen = torch.arange((p + 1) // ratio) if not select else ids[t][(ids[t] >= 0) & (ids[t] < (p + 1) // ratio)]
            keys = torch.cat([keys, entries[seen.long()].half().double()])
        s = keys @ q[t].half().double().T * d ** -0.5  # (keys, heads)
        s = torch.cat([s, sinks[None]])
        want[t] = torch.softmax(s, 0)[:-1].T @ keys
    got = attention_compressed(q.float().to(DEV), cache.to(DEV), entries.to(DEV) if ratio else None,
                               ids.to(DEV) if select else None, pos.to(DEV),
                               torch.full((n,), base, device=DEV), window, ratio, d ** -0.5, sinks.float().to(DEV),
                               splits, ring=ring)
    _close(got, want.view(n, -1), 2e-3)  # the softmax weights go into the value product as f16
