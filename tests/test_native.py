"""ferry's own CPU expert kernel (ferry/kernels/cpu/moe_experts.c) against float64 references, many shapes, odd sizes too; and
where CpuBackend runs it instead of ggml. The kernel's own tests need a CPU with AVX512-VNNI, as the dev, CI and GPU
machines have (the first test says which machine this is)."""

import numpy as np
import pytest
import torch

from ferry.config import Settings
from ferry.weight import Weight
from ferry.kernels.cpu import native
from ferry.offload.plan import experts_kernel
from ferry.backends.cpu import CpuBackend
from ferry.quant import Q, dequantize, quantize


def _has_vnni() -> bool:
    with open("/proc/cpuinfo") as fh:
        return " avx512_vnni" in next((line for line in fh if line.startswith("flags")), "")


def _weight(rng, qtype, *shape):
    ne = tuple(reversed(shape))
    raw = quantize(rng.standard_normal(shape).astype(np.float32), qtype)
    return Weight("w", qtype, ne, raw), dequantize(raw, qtype, ne).astype(np.float64)


def _as_kernel_rounds(v: np.ndarray, block: int) -> np.ndarray:
    """v in float64 after the kernel's activation rounding: blocks (32 for Q4_0 weights, 256 for Q4_K) to int8 with
    scale max|v| / 127."""
    blocks = v.reshape(-1, block)
    d = np.abs(blocks).max(axis=1, keepdims=True) / 127
    return (np.rint(blocks / np.where(d > 0, d, 1)) * d).reshape(v.shape)


def _layer(rng, n_expert, n_embd, n_ff, qtype=Q.Q4_0, down_type=None):
    up, up64 = _weight(rng, qtype, n_expert, n_ff, n_embd)
    gate, gate64 = _weight(rng, qtype, n_expert, n_ff, n_embd)
    down, down64 = _weight(rng, down_type or qtype, n_expert, n_embd, n_ff)
    return (up, gate, down), (up64, gate64, down64)


def test_the_kernel_is_there_exactly_where_the_cpu_has_avx512_vnni():
    assert (native.library() is not None) == _has_vnni(), native.why_not()
    if not _has_vnni():
        assert "AVX512-VNNI" in native.why_not()


# (up and gate's type, down's type, n_embd, n_ff, n_expert, n_used): Qwen3-30B-A3B's layer; odd block counts (Q4_0:
# 96 = 3 blocks, 160 = 5; Q4_K and Q6_K: 768 = 3 super-blocks, 1280 = 5); one expert; the types mixed, either way
# (Q4_K with Q6_K down: a Q4_K_M file's layers)
Q40, Q4K, Q6K = Q.Q4_0, Q.Q4_K, Q.Q6_K
SHAPES = [(Q40, Q40, 2048, 768, 16, 8), (Q40, Q40, 96, 64, 3, 2), (Q40, Q40, 160, 96, 5, 1), (Q40, Q40, 64, 32, 1, 1),
          (Q40, Q40, 320, 224, 7, 5), (Q40, Q40, 256, 160, 9, 8),
          (Q4K, Q4K, 2048, 768, 16, 8), (Q4K, Q4K, 768, 256, 3, 2), (Q4K, Q4K, 1280, 768, 5, 1),
          (Q4K, Q4K, 256, 256, 1, 1), (Q4K, Q40, 768, 96, 7, 5), (Q40, Q4K, 96, 1280, 9, 8),
          (Q4K, Q6K, 2048, 768, 16, 8), (Q6K, Q6K, 768, 256, 3, 2), (Q6K, Q6K, 1280, 768, 5, 1),
          (Q6K, Q6K, 256, 256, 1, 1), (Q6K, Q40, 768, 96, 7, 5), (Q40, Q6K, 96, 1280, 9, 8)]


@pytest.mark.parametrize("up_type,down_type,n_embd,n_ff,n_expert,n_used", SHAPES)
def test_the_kernel_matches_float64_given_its_activation_rounding(up_type, down_type, n_embd, n_ff, n_expert, n_used):
    """With x and h rounded to 8 bits as the kernel rounds them, float64 agrees to float32's accumulation error;
    against the exact float64 result the kernel errs no more than ggml does on the same data (4-bit weights' usual
    1%)."""
    rng = np.random.default_rng(n_embd + n_ff + n_used)
    cpu = CpuBackend(3)
    (up, gate, down), (up64, gate64, down64) = _layer(rng, n_expert, n_embd, n_ff, up_type, down_type)
    round_x, round_h = ((lambda v, b=32 if t == Q40 else 256: _as_kernel_rounds(v, b)) for t in (up_type, down_type))
    x = rng.standard_normal((1, n_embd)).astype(np.float32)
    ids = rng.choice(n_expert, n_used, replace=False).astype(np.int32)[None]
    weights = rng.random((1, n_used)).astype(np.float32)
    rounded, exact = np.zeros(n_embd), np.zeros(n_embd)
    for j, e in enumerate(ids[0]):
        for ref, rx, rh in ((rounded, round_x, round_h), (exact, lambda v: v, lambda v: v)):
            xr = rx(x[0].astype(np.float64))
            g, u = gate64[e] @ xr, up64[e] @ xr
            ref += weights[0, j] * (down64[e] @ rh(g / (1 + np.exp(-g)) * u))
    kernel = cpu.native_experts(1, True, up, gate, down, "silu")
    assert kernel is not None
    got = cpu.moe_experts(torch.from_numpy(x), torch.from_numpy(ids), torch.from_numpy(weights), up, gate, down,
                          "silu").numpy()[0]
    # float32 accumulation: about 1e-7; one of h's roundings falling the other way would move it by about 3e-4
    assert np.abs(got - rounded).max() / np.abs(rounded).max() < 1e-3
    ggml = CpuBackend(3, repack=False)  # ggml's kernel on the same weights, read from their plain bytes
    for w in (up, gate, down):
        w.repacked = False
    theirs = ggml.moe_experts(torch.from_numpy(x), torch.from_numpy(ids), torch.from_numpy(weights), up, gate, down,
                              "silu").numpy()[0]
    err = np.linalg.norm(got - exact) / np.linalg.norm(exact)
    assert err < 2e-2 and err < 1.5 * np.linalg.norm(theirs - exact) / np.linalg.norm(exact) + 1e-3


def test_an_expert_id_out_of_range_is_an_error_and_writes_nothing():
    rng = np.random.default_rng(5)
    cpu = CpuBackend(2)
    layer, _ = _layer(rng, 4, 64, 32)
    kernel = cpu.native_experts(1, True, *layer, "silu")
    out = torch.full((1, 64), 7.0)
    with pytest.raises(ValueError, match="not all below 4"):
        kernel(torch.randn(1, 64), torch.tensor([[1, 4]], dtype=torch.int32), torch.ones(1, 2),
               *(w.repacked.tensor.contents.data for w in layer), 4, out)
    assert torch.equal(out, torch.full((1, 64), 7.0))


def test_ggml_keeps_what_the_kernel_does_not_cover():
    """More than one token, slots without their weighted sum, gelu, another type (or gate's apart from up's),
    Q4_0 / Q4_K weights not repacked, or a backend made without ferry's kernels."""
    rng = np.random.default_rng(6)
    cpu = CpuBackend(2)
    q4, _ = _layer(rng, 4, 64, 32)
    q8, _ = _layer(rng, 4, 64, 32, Q.Q8_0)
    assert (cpu.native_experts(1, True, *q4, "silu") is not None) == _has_vnni()
    assert cpu.native_experts(2, True, *q4, "silu") is None
    assert cpu.native_experts(1, False, *q4, "silu") is None
    assert cpu.native_experts(1, True, *q4, "gelu") is None
    assert cpu.native_experts(1, True, *q8, "silu") is None
    (up, gate, down), _ = _layer(rng, 4, 256, 256, Q.Q4_K)
    assert (cpu.native_experts(1, True, up, gate, down, "silu") is not None) == _has_vnni()
    assert cpu.native_experts(1, True, *q8[:2], down, "silu") is None  # a Q4_K down does not make Q8_0 experts run
    q4_0_gate, _ = _weight(rng, Q.Q4_0, 4, 256, 256)
    assert cpu.native_experts(1, True, up, q4_0_gate, down, "silu") is None
    plain, _ = _layer(rng, 4, 64, 32)
    assert CpuBackend(2, repack=False).native_experts(1, True, *plain, "silu") is None
    # Q6_K is read in its plain layout: --no-repack leaves it on the kernel, but not beside Q4_K that it left plain
    q6, _ = _layer(rng, 4, 256, 256, Q.Q6_K)
    assert (CpuBackend(2, repack=False).native_experts(1, True, *q6, "silu") is not None) == _has_vnni()
    q4k_m, _ = _layer(rng, 4, 256, 256, Q.Q4_K, Q.Q6_K)
    assert CpuBackend(2, repack=False).native_experts(1, True, *q4k_m, "silu") is None
    assert CpuBackend(2, native_kernels=False).native_experts(1, True, *q4, "silu") is None


def test_ferry_native_0_turns_the_kernel_off():
    off = Settings.from_env({"FERRY_NATIVE": "0"})
    assert not off.native_kernels
    assert native.library(off) is None and native.why_not(off) == "FERRY_NATIVE=0"
    rng = np.random.default_rng(8)
    layer, _ = _layer(rng, 4, 64, 32)
    assert CpuBackend(2, native_kernels=off.native_kernels).native_experts(1, True, *layer, "silu") is None


def test_plan_says_which_layers_run_on_ferrys_kernel_by_their_expert_types():
    """A Q4_K_M file (Q4_K layers, some with Q6_K down) all on ferry's kernel; a Q5_K_M file's Q5_K layers on ggml's
    beside its Q6_K ones on ferry's; Q8_0 experts all on ggml's."""
    mixed = experts_kernel([{"Q5_K"}, {"Q5_K", "Q6_K"}, {"Q6_K"}])
    if _has_vnni():
        assert mixed.startswith("ferry's own kernel") and "in 1 of 3 layers" in mixed and "theirs are Q5_K" in mixed
        assert experts_kernel([{"Q4_K"}, {"Q4_K", "Q6_K"}]).startswith("ferry's own kernel (")
        assert experts_kernel([{"Q4_0"}, {"Q4_K"}]).startswith("ferry's own kernel (")
    else:
        assert mixed.startswith("ggml's kernel")
    q8 = experts_kernel([{"Q8_0"}, {"Q8_0"}])
    assert q8.startswith("ggml's kernel") and "these are Q8_0" in q8
