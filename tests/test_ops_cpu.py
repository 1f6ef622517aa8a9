"""ggml CPU kernels against float64 references on random data, many shapes, odd sizes too."""

import numpy as np
import pytest
import torch

from ferry.gguf.synth import random_tensor
from ferry.weight import Weight
from ferry.quant import NUMPY_TYPES, Q, dequantize, quantize

# every type ggml can quantize without an importance matrix; tolerance = its activation rounding:
# float weights keep f32/f16/bf16 activations, quantized ones meet activations rounded to 8 bits
TYPES = {Q.F32: 1e-6, Q.F16: 2e-3, Q.BF16: 1e-2, Q.Q8_0: 1.5e-2, Q.Q4_0: 1.5e-2, Q.Q4_1: 1.5e-2, Q.Q5_0: 1.5e-2,
         Q.Q5_1: 1.5e-2, Q.Q2_K: 2e-2, Q.Q3_K: 2e-2, Q.Q4_K: 2e-2, Q.Q5_K: 2e-2, Q.Q6_K: 2e-2,
         Q.IQ4_NL: 1.5e-2, Q.IQ4_XS: 2e-2, Q.MXFP4: 1.5e-2, Q.TQ2_0: 2e-2}
# types whose quantizer needs an importance matrix: random valid blocks (as ferry synth writes them);
RANDOM_BLOCK_TYPES = {t: 2e-2 for t in (Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S, Q.IQ1_S, Q.TQ1_0)}
# no ggml CPU matmul: the backend multiplies a float32 copy made by the reference dequantizer
FALLBACK_TYPES = {Q.F64: 1e-6, Q.I8: 1e-6, Q.I16: 1e-6, Q.I32: 1e-6}
# (rows m, cols k, tokens n); rows divisible by 8 take ggml's repacked kernels for Q4_0, Q4_K, Q2_K, IQ4_NL
SHAPES = [(1, 256, 1), (7, 256, 3), (33, 512, 17), (129, 768, 64), (64, 512, 1), (256, 256, 9)]


def _weight(rng, qtype, *shape):
    ne = tuple(reversed(shape))
    values = rng.standard_normal(shape)
    if qtype in RANDOM_BLOCK_TYPES:
        raw = random_tensor(qtype, ne, 1.0, rng)
    elif qtype in FALLBACK_TYPES:
        raw = (values if qtype == Q.F64 else values * 50).astype(NUMPY_TYPES[qtype]).view(np.uint8).reshape(-1)
    else:
        raw = quantize(values.astype(np.float32), qtype)
    return Weight("w", qtype, ne, raw), dequantize(raw, qtype, ne).astype(np.float64)


@pytest.mark.parametrize("qtype", list(TYPES | RANDOM_BLOCK_TYPES | FALLBACK_TYPES), ids=lambda q: q.name)
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_linear_matches_float64_reference(backend, qtype, m, k, n):
    rng = np.random.default_rng(m * 1000 + n)
    w, w64 = _weight(rng, qtype, m, k)
    x = rng.standard_normal((n, k)).astype(np.float32)
    out = torch.full((n, m), float("nan"))
    out = backend.linear(torch.from_numpy(x), w)
    ref = x.astype(np.float64) @ w64.T
    assert np.isfinite(out.numpy()).all()
    # relative to the expected output norm of random data (||x|| ||W|| / sqrt(k)), steady even for one dot product
    scale = np.linalg.norm(x) * np.linalg.norm(w64) / np.sqrt(k)
    assert np.linalg.norm(out.numpy() - ref) / scale < (TYPES | RANDOM_BLOCK_TYPES | FALLBACK_TYPES)[qtype]


@pytest.mark.parametrize("n_expert,n_used,n_tokens", [(4, 1, 1), (8, 2, 5), (16, 4, 33), (128, 8, 3)])
@pytest.mark.parametrize("act", ["silu", "gelu"])
@pytest.mark.parametrize("norm_topk", [True, False])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_moe_block_matches_float64_reference(backend, n_expert, n_used, n_tokens, act, norm_topk, fused):
    rng = np.random.default_rng(n_expert + n_tokens)
    d, ff = 64, 96
    router, router64 = _weight(rng, Q.F32, n_expert, d)  # f32: the reference picks the same experts
    up, up64 = _weight(rng, Q.Q8_0, n_expert, ff, d)
    gate, gate64 = _weight(rng, Q.Q8_0, n_expert, ff, d)
    down, down64 = _weight(rng, Q.Q8_0, n_expert, d, ff)
    x = rng.standard_normal((n_tokens, d)).astype(np.float32)
    from ferry.backends.cpu import CpuBackend

    ops = backend if fused else CpuBackend(2, fused_moe=False)  # -fmoe / --no-fused-moe
    out, ids = ops.moe(torch.from_numpy(x), router, up, gate, down, n_used, norm_topk, act)
    f = {"silu": lambda g: g / (1 + np.exp(-g)),
         "gelu": lambda g: 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3)))}[act]
    logits = x.astype(np.float64) @ router64.T
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    ref = np.zeros((n_tokens, d))
    for i in range(n_tokens):
        top = np.argsort(-probs[i])[:n_used]
        assert sorted(ids[i].tolist()) == sorted(top.tolist())
        w = probs[i, top] / (probs[i, top].sum() if norm_topk else 1.0)
        for e, we in zip(top, w):
            ref[i] += we * (down64[e] @ (f(gate64[e] @ x[i]) * (up64[e] @ x[i])))
    assert np.linalg.norm(out.numpy() - ref) / np.linalg.norm(ref) < 2e-2


@pytest.mark.parametrize("n_expert,n_used,n_tokens", [(4, 1, 1), (16, 4, 33), (128, 8, 3)])
@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_K], ids=lambda q: q.name)
def test_experts_chosen_elsewhere_match_float64_per_slot_and_summed(backend, n_expert, n_used, n_tokens, qtype):
    """moe_experts: the hybrid runtime's CPU half, given ids (and weights) routed on the GPU."""
    rng = np.random.default_rng(7 * n_expert + n_tokens)
    d, ff = 256, 96
    up, up64 = _weight(rng, qtype, n_expert, ff, d)
    gate, gate64 = _weight(rng, qtype, n_expert, ff, d)
    down, down64 = _weight(rng, Q.Q8_0, n_expert, d, ff)
    x = rng.standard_normal((n_tokens, d)).astype(np.float32)
    ids = np.stack([rng.choice(n_expert, n_used, replace=False) for _ in range(n_tokens)]).astype(np.int32)
    weights = rng.random((n_tokens, n_used)).astype(np.float32)
    ref = np.zeros((n_tokens, n_used, d))
    for i in range(n_tokens):
        for j, e in enumerate(ids[i]):
            g = gate64[e] @ x[i]
            ref[i, j] = down64[e] @ (g / (1 + np.exp(-g)) * (up64[e] @ x[i]))
    slots = backend.moe_experts(torch.from_numpy(x), torch.from_numpy(ids), None, up, gate, down, "silu")
    summed = backend.moe_experts(torch.from_numpy(x), torch.from_numpy(ids), torch.from_numpy(weights), up, gate,
                                 down, "silu")
    assert slots.shape == (n_tokens, n_used, d) and summed.shape == (n_tokens, d)
    assert np.linalg.norm(slots.numpy() - ref) / np.linalg.norm(ref) < 2e-2
    want = (ref * weights[..., None]).sum(1)
    assert np.linalg.norm(summed.numpy() - want) / np.linalg.norm(want) < 2e-2


@pytest.mark.parametrize("n_expert,n_used,n_tokens", [(4, 1, 1), (16, 4, 33), (128, 8, 5)])
@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0], ids=lambda q: q.name)
def test_the_experts_halves_match_float64_each_on_its_own(backend, n_expert, n_used, n_tokens, qtype):
    """moe_up_gate / moe_down: the CPU's half when the other half of every expert runs on the GPU
    (--offload-policy moe_up_gate=off,moe_down=on and the reverse)."""
    rng = np.random.default_rng(11 * n_expert + n_tokens)
    d, ff = 256, 160
    up, up64 = _weight(rng, qtype, n_expert, ff, d)
    gate, gate64 = _weight(rng, qtype, n_expert, ff, d)
    down, down64 = _weight(rng, qtype, n_expert, d, ff)
    x = rng.standard_normal((n_tokens, d)).astype(np.float32)
    ids = np.stack([rng.choice(n_expert, n_used, replace=False) for _ in range(n_tokens)]).astype(np.int32)
    weights = rng.random((n_tokens, n_used)).astype(np.float32)
    h = rng.standard_normal((n_tokens, n_used, ff)).astype(np.float32)  # the other side's rows, made up
    h_ref, y_ref = np.zeros((n_tokens, n_used, ff)), np.zeros((n_tokens, d))
    for i in range(n_tokens):
        for j, e in enumerate(ids[i]):
            g = gate64[e] @ x[i]
            h_ref[i, j] = g / (1 + np.exp(-g)) * (up64[e] @ x[i])
            y_ref[i] += weights[i, j] * (down64[e] @ h[i, j])
    got_h = backend.moe_up_gate(torch.from_numpy(x), torch.from_numpy(ids), up, gate, "silu")
    got_y = backend.moe_down(torch.from_numpy(h), torch.from_numpy(ids), torch.from_numpy(weights), down)
    assert got_h.shape == (n_tokens, n_used, ff) and got_y.shape == (n_tokens, d)
    assert np.linalg.norm(got_h.numpy() - h_ref) / np.linalg.norm(h_ref) < 2e-2
    assert np.linalg.norm(got_y.numpy() - y_ref) / np.linalg.norm(y_ref) < 2e-2


def test_graphs_of_different_layers_in_turn_are_placed_once_and_give_their_own_results(monkeypatch):
    """A hybrid decode step runs every MoE layer's ggml graph in turn: each is placed in the shared compute buffer
    once and then runs where it was placed, until a larger graph moves the buffer (then each is placed afresh)."""
    from ferry.backends import cpu as cpu_mod

    backend = cpu_mod.CpuBackend(2)
    rng = np.random.default_rng(3)
    layers = [tuple(_weight(rng, Q.Q8_0, 8, ff, d)[0] for ff, d in ((64, 128), (64, 128), (128, 64)))
              for _ in range(3)]
    x = torch.from_numpy(rng.standard_normal((2, 128)).astype(np.float32))
    ids = torch.tensor([[1, 5], [7, 0]], dtype=torch.int32)
    weights = torch.full((2, 2), 0.5)
    alone = [cpu_mod.CpuBackend(2).moe_experts(x, ids, weights, *layer, "silu") for layer in layers]
    placements = []
    reserve = cpu_mod.ggml.ggml_gallocr_reserve
    monkeypatch.setattr(cpu_mod.ggml, "ggml_gallocr_reserve", lambda *a: placements.append(1) or reserve(*a))
    for _ in range(3):
        for layer, want in zip(layers, alone):
            out = torch.empty(2, 128)
            assert backend.moe_experts(x, ids, weights, *layer, "silu", out=out) is out
            assert torch.equal(out, want)
    assert len(placements) == 3  # once per layer
    big = torch.from_numpy(rng.standard_normal((300, 128)).astype(np.float32))
    backend.moe_experts(big, torch.randint(0, 8, (300, 2), dtype=torch.int32), None, *layers[0], "silu")
    for layer, want in zip(layers, alone):  # the buffer moved: each placed afresh, still right
        assert torch.equal(backend.moe_experts(x, ids, weights, *layer, "silu"), want)
    assert len(placements) == 3 + 1 + 3


def test_get_rows_returns_dequantized_rows(backend):
    rng = np.random.default_rng(0)
    w, w64 = _weight(rng, Q.Q6_K, 50, 256)
    ids = torch.tensor([3, 49, 3, 0])
    assert np.allclose(backend.get_rows(w, ids).numpy(), w64[[3, 49, 3, 0]], atol=1e-6)


def test_type_without_kernel_or_dequantizer_is_a_user_error(backend):
    from ferry.errors import FerryError

    raw = np.zeros(4 * 292, dtype=np.uint8)  # four Q8_K blocks: ggml has no CPU matmul for them
    w = Weight("blk.0.attn_q.weight", Q.Q8_K, (256, 4), raw)
    with pytest.raises(FerryError, match="blk.0.attn_q.weight.*Q8_K.*re-quantize"):
        backend.linear(torch.zeros(1, 256), w)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_K, Q.IQ4_NL])
def test_repacked_weight_is_used_and_matches_the_mmap_path(qtype):
    from ferry.backends.cpu import CpuBackend

    rng = np.random.default_rng(7)
    w, _ = _weight(rng, qtype, 64, 512)
    plain, _ = _weight(np.random.default_rng(7), qtype, 64, 512)
    x = torch.from_numpy(rng.standard_normal((5, 512)).astype(np.float32))
    # ggml's kernels on both (ferry's own read the repacked copy too: tests/test_native.py checks them)
    repacked = CpuBackend(2, repack=True, native_kernels=False).linear(x, w)
    assert w.repacked, "ggml has an interleaved layout for this type and shape, so the weight must be repacked"
    direct = CpuBackend(2, repack=False, native_kernels=False).linear(x, plain)
    assert not plain.repacked
    # both quantize the activations the same way; only the summation order differs
    assert torch.allclose(repacked, direct, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("heads,kv_heads,n,n_kv,d,dv,additive", [
    (4, 1, 1, 37, 64, 64, False), (8, 2, 5, 9, 33, 17, False), (6, 6, 3, 20, 16, 16, True), (64, 1, 7, 130, 48, 48, False)])
def test_attention_with_sinks_in_groups_matches_float64(heads, kv_heads, n, n_kv, d, dv, additive):
    """The op-by-op path's attention with sinks (gpt-oss, DeepSeek-V4), query heads in groups over their key head:
    against float64 with every key head repeated for its queries and the sink as one more logit in the denominator;
    a masked row (additive: -inf entries) sees only its sink."""
    from ferry.layers.attention import attend_with_sinks

    rng = np.random.default_rng(heads + n + n_kv + d)
    q = torch.from_numpy(rng.standard_normal((heads, n, d)))
    k = torch.from_numpy(rng.standard_normal((kv_heads, n_kv, d)))
    v = torch.from_numpy(rng.standard_normal((kv_heads, n_kv, dv)))
    sinks = torch.from_numpy(rng.standard_normal(heads))
    seen = torch.from_numpy(rng.random((n, n_kv)) < 0.6)
    seen[0] = False  # a query that sees nothing but its sink
    scale = d ** -0.5
    group = heads // kv_heads
    s = q @ k.repeat_interleave(group, 0).transpose(1, 2) * scale
    s = torch.cat([s.masked_fill(~seen, float("-inf")), sinks[:, None, None].expand(heads, n, 1)], -1)
    want = torch.softmax(s, -1)[..., :-1] @ v.repeat_interleave(group, 0)
    mask = torch.zeros(n, n_kv).masked_fill(~seen, float("-inf")).float() if additive else seen
    got = attend_with_sinks(q.float(), k.float(), v.float(), mask, sinks.float(), scale)
    assert got.shape == (heads, n, dv)
    assert (got.double() - want).abs().max() < 1e-5
    assert got[:, 0].abs().max() == 0  # nothing seen: the sink takes all the weight, its value is zero
