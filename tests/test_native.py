"""ferry's own CPU expert kernel (ferry/kernels/cpu/moe_experts.c) against float64 references, many shapes, odd sizes too; and
where CpuBackend runs it instead of ggml. The kernel's own tests need a CPU with AVX512-VNNI, as the dev, CI and GPU
machines have (the first test says which machine this is)."""

import os
import subprocess
import sys

import ggml
import numpy as np
import pytest
import torch

from ferry.config import Settings
from ferry.weight import Weight
from ferry.kernels.cpu import native
from ferry.kernels.capabilities import CPU_AMX_TYPES
from ferry.offload.plan import experts_kernel
from ferry.backends.cpu import CpuBackend
from ferry.gguf.synth import _IK_UNIT_RMS
from ferry.quant import AS_Q8_0, IK_TYPES, IkQuant, Q, dequantize, ik_type_bytes, quantize


def _has_vnni() -> bool:
    with open("/proc/cpuinfo") as fh:
        return " avx512_vnni" in next((line for line in fh if line.startswith("flags")), "")


def _has_amx() -> bool:
    with open("/proc/cpuinfo") as fh:
        flags = next((line for line in fh if line.startswith("flags")), "").split()
    return "amx_int8" in flags and "amx_tile" in flags


# the kernels' paths this CPU runs: many tokens' Q4_0 / Q8_0 weights on AMX-INT8 tiles where it has them, else VNNI
ISAS = ["vnni", "amx"] if _has_amx() else ["vnni"]


@pytest.fixture
def path():
    """path(isa) runs the kernels' calls from then on the path named ("vnni" or "amx"); the test's end restores it."""
    before = native.amx()

    def use(isa: str) -> None:
        assert native.use_amx(isa == "amx") == (isa == "amx")

    yield use
    native.use_amx(before)


def _weight(rng, qtype, *shape):
    ne = tuple(reversed(shape))
    if isinstance(qtype, IkQuant):  # ik_llama.cpp's types: any bytes are valid, the scales kept sane and apart
        # (each row's float32 / fp16 before it, or each block's fp16 d opening it), about 0.05 rms
        _, _, size, meta = IK_TYPES[qtype]
        rows = int(np.prod(shape[:-1]))
        raw = rng.integers(0, 256, (rows, ik_type_bytes(qtype, (shape[-1], 1))), dtype=np.uint8)
        raw = raw if meta else raw.reshape(-1, size)
        scale = rng.uniform(0.5, 2, (len(raw), 1)) * 0.05 / _IK_UNIT_RMS[qtype]
        raw[:, :meta or 2] = scale.astype(np.float32 if meta == 4 else np.float16).view(np.uint8)
        raw = raw.reshape(-1)
        return Weight("w", qtype, ne, raw), dequantize(raw, qtype, ne).astype(np.float64)
    raw = quantize(rng.standard_normal(shape).astype(np.float32), qtype)
    return Weight("w", qtype, ne, raw), dequantize(raw, qtype, ne).astype(np.float64)


def _as_kernel_rounds(v: np.ndarray, block: int) -> np.ndarray:
    """v in float64 after the kernel's activation rounding: blocks (32 for Q4_0 weights, 256 for Q4_K) to int8 with
    scale max|v| / 127."""
    # in float32 as the kernel computes it (scale max / 127, each value times 1 / scale, to nearest even), so that a
    # value near a half rounds the same way
    blocks = v.reshape(-1, block).astype(np.float32)
    d = np.abs(blocks).max(axis=1, keepdims=True) / np.float32(127)
    inv = np.float32(1) / np.where(d > 0, d, np.float32(1))
    return (np.rint(blocks * inv).astype(np.float64) * d).reshape(v.shape)


def _layer(rng, n_expert, n_embd, n_ff, qtype=Q.Q4_0, down_type=None):
    up, up64 = _weight(rng, qtype, n_expert, n_ff, n_embd)
    gate, gate64 = _weight(rng, qtype, n_expert, n_ff, n_embd)
    down, down64 = _weight(rng, down_type or qtype, n_expert, n_embd, n_ff)
    return (up, gate, down), (up64, gate64, down64)


def test_the_kernel_is_there_exactly_where_the_cpu_has_avx512_vnni():
    assert (native.library() is not None) == _has_vnni(), native.why_not()
    if not _has_vnni():
        assert "AVX512-VNNI" in native.why_not()


def test_amx_is_on_exactly_where_the_cpu_has_it_and_ferry_amx_0_turns_it_off():
    probe = "from ferry.kernels.cpu import native; print(native.amx(), native.kernel_id())"
    env = {k: v for k, v in os.environ.items() if k != "FERRY_AMX"}
    on = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True).stdout
    off = subprocess.run([sys.executable, "-c", probe], env={**env, "FERRY_AMX": "0"}, capture_output=True, text=True,
                         check=True).stdout
    assert on.split()[0] == str(_has_amx() and _has_vnni()) and off.split()[0] == "False"
    assert (on.split()[1] != off.split()[1]) == (_has_amx() and _has_vnni())  # a calibration of the other is stale


# (up and gate's type, down's type, n_embd, n_ff, n_expert, n_used): Qwen3-30B-A3B's layer; odd block counts (Q4_0:
# 96 = 3 blocks, 160 = 5; Q4_K and Q6_K: 768 = 3 super-blocks, 1280 = 5); one expert; the types mixed, either way
# (Q4_K with Q6_K down: a Q4_K_M file's layers, Q5_K with Q6_K a Q5_K_M file's)
Q40, Q4K, Q5K, Q6K, IQ4, IKS, IK4 = Q.Q4_0, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS, IkQuant.IQ4_KS, IkQuant.IQ4_K
I3S, I2S, I5S, I4SS, I2L = IkQuant.IQ3_KS, IkQuant.IQ2_KS, IkQuant.IQ5_KS, IkQuant.IQ4_KSS, IkQuant.IQ2_KL
I2K, I3K = IkQuant.IQ2_K, IkQuant.IQ3_K
SHAPES = [(Q40, Q40, 2048, 768, 16, 8), (Q40, Q40, 96, 64, 3, 2), (Q40, Q40, 160, 96, 5, 1), (Q40, Q40, 64, 32, 1, 1),
          (Q40, Q40, 320, 224, 7, 5), (Q40, Q40, 256, 160, 9, 8),
          (Q4K, Q4K, 2048, 768, 16, 8), (Q4K, Q4K, 768, 256, 3, 2), (Q4K, Q4K, 1280, 768, 5, 1),
          (Q4K, Q4K, 256, 256, 1, 1), (Q4K, Q40, 768, 96, 7, 5), (Q40, Q4K, 96, 1280, 9, 8),
          (Q4K, Q6K, 2048, 768, 16, 8), (Q6K, Q6K, 768, 256, 3, 2), (Q6K, Q6K, 1280, 768, 5, 1),
          (Q6K, Q6K, 256, 256, 1, 1), (Q6K, Q40, 768, 96, 7, 5), (Q40, Q6K, 96, 1280, 9, 8),
          (Q5K, Q5K, 2048, 768, 16, 8), (Q5K, Q6K, 768, 256, 3, 2), (Q5K, Q5K, 1280, 768, 5, 1), (Q5K, Q40, 256, 96, 1, 1),
          (IQ4, IQ4, 2048, 768, 16, 8), (IQ4, IQ4, 768, 1280, 3, 2), (IQ4, Q6K, 1280, 256, 5, 1), (Q4K, IQ4, 256, 256, 1, 1),
          (IKS, IKS, 2048, 768, 16, 8), (IKS, IKS, 768, 1280, 3, 2), (IKS, IKS, 256, 256, 1, 1), (IKS, Q6K, 1280, 256, 5, 1),
          (IK4, IK4, 2048, 768, 16, 8), (IK4, IK4, 768, 1280, 3, 2), (IK4, IK4, 256, 256, 1, 1), (IK4, Q6K, 1280, 256, 5, 1),
          (Q4K, IK4, 768, 256, 7, 5),
          (I3S, I3S, 2048, 768, 16, 8), (I3S, I3S, 768, 1280, 3, 2), (I3S, I3S, 256, 256, 1, 1), (I2S, I3S, 1280, 256, 5, 1),
          (I2S, I2S, 2048, 768, 16, 8), (I2S, I2S, 768, 1280, 3, 2), (I3S, IKS, 256, 768, 7, 5), (I2S, Q6K, 768, 256, 7, 5),
          (I5S, I5S, 2048, 768, 16, 8), (I5S, I5S, 768, 1280, 3, 2), (I5S, I5S, 256, 256, 1, 1), (IKS, I5S, 1280, 256, 5, 1),
          (I4SS, I4SS, 2048, 768, 16, 8), (I4SS, I4SS, 768, 1280, 3, 2), (I4SS, I4SS, 256, 256, 1, 1),
          (I2L, I2L, 2048, 768, 16, 8), (I2L, I2L, 768, 1280, 3, 2), (I2L, I2L, 256, 256, 1, 1), (I2L, I4SS, 1280, 256, 5, 1),
          (I2L, I3S, 768, 256, 7, 5),
          (I2K, I2K, 2048, 768, 16, 8), (I2K, I2K, 768, 1280, 3, 2), (I2K, I2K, 256, 256, 1, 1), (I2K, I3K, 1280, 256, 5, 1),
          (I3K, I3K, 2048, 768, 16, 8), (I3K, I3K, 768, 1280, 3, 2), (I3K, Q6K, 256, 256, 1, 1)]


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
    err = np.linalg.norm(got - exact) / np.linalg.norm(exact)
    if isinstance(up_type, IkQuant) or isinstance(down_type, IkQuant):  # ggml has no ik_llama.cpp types to compare
        assert err < 3e-2  # with: the rounding of x and h to 8 bits alone (2.0% measured for 3-bit weights)
        return
    ggml = CpuBackend(3, repack=False)  # ggml's kernel on the same weights, read from their plain bytes
    for w in (up, gate, down):
        w.repacked = False
    theirs = ggml.moe_experts(torch.from_numpy(x), torch.from_numpy(ids), torch.from_numpy(weights), up, gate, down,
                              "silu").numpy()[0]
    assert err < 2e-2 and err < 1.5 * np.linalg.norm(theirs - exact) / np.linalg.norm(exact) + 1e-3


@pytest.mark.parametrize("up_type,down_type,n_embd,n_ff,n_expert,n_used",
                         [(Q40, Q40, 2048, 768, 16, 8), (Q4K, Q6K, 1280, 768, 5, 3), (Q40, Q4K, 96, 1280, 9, 8),
                          (IQ4, Q40, 256, 96, 4, 1), (IKS, IKS, 1280, 768, 5, 3), (IK4, IK4, 1280, 768, 5, 3),
                          (I3S, I2S, 1280, 768, 5, 3), (I5S, I5S, 1280, 768, 5, 3), (I2L, I4SS, 1280, 768, 5, 3),
                          (I2K, I3K, 1280, 768, 5, 3)])
def test_one_token_gives_the_same_bits_at_any_thread_count_call_after_call(up_type, down_type, n_embd, n_ff, n_expert,
                                                                           n_used):
    """The threads take bundles of rows from one counter and hand h's chunks and out's rows on through counters: each
    value is computed the same way whichever thread takes it, so a thread that read h before it was whole, or a
    counter not reset between calls, shows as a difference."""
    rng = np.random.default_rng(n_embd + n_used)
    (up, gate, down), _ = _layer(rng, n_expert, n_embd, n_ff, up_type, down_type)
    results = []
    for threads in (1, 2, 5, 9):
        cpu = CpuBackend(threads)
        assert cpu.native_experts(1, True, up, gate, down, "silu") is not None
        for call in range(3):
            crng = np.random.default_rng(call)
            x = torch.from_numpy(crng.standard_normal((1, n_embd)).astype(np.float32))
            ids = torch.from_numpy(crng.choice(n_expert, n_used, replace=False).astype(np.int32)[None])
            weights = torch.from_numpy(crng.random((1, n_used)).astype(np.float32))
            results.append((threads, call, cpu.moe_experts(x, ids, weights, up, gate, down, "silu")))
    for threads, call, got in results:
        first = next(r for t, c, r in results if c == call)
        assert torch.equal(got, first), (threads, call)
    assert not torch.equal(results[0][2], results[1][2])  # the calls differ: their inputs do


# (up and gate's type, down's type, n_embd, n_ff, n_expert, n_used, tokens, threads): tokens past a tile of 8 and
# not a multiple of it, fewer tokens than threads, experts no token picks, one expert for all, the three types mixed
BATCHES = [(Q40, Q40, 2048, 768, 16, 8, 37, 3), (Q40, Q40, 96, 64, 3, 2, 2, 3), (Q40, Q40, 160, 96, 5, 1, 17, 2),
           (Q40, Q40, 64, 32, 1, 1, 9, 1), (Q40, Q40, 320, 224, 24, 5, 11, 2), (Q40, Q40, 256, 160, 9, 8, 64, 3),
           (Q4K, Q6K, 2048, 768, 16, 8, 19, 3), (Q4K, Q4K, 768, 256, 3, 2, 5, 2), (Q6K, Q40, 768, 96, 7, 5, 23, 3),
           (Q40, Q6K, 96, 1280, 9, 8, 8, 1), (Q6K, Q6K, 256, 256, 1, 1, 3, 2), (Q40, Q4K, 160, 256, 40, 3, 33, 3),
           (Q5K, Q5K, 2048, 768, 16, 8, 21, 3), (Q5K, Q6K, 768, 256, 5, 3, 7, 2), (IQ4, IQ4, 2048, 768, 16, 8, 13, 3),
           (IQ4, IQ4, 1280, 256, 1, 1, 6, 2), (Q5K, IQ4, 256, 768, 9, 4, 30, 3), (IKS, IKS, 2048, 768, 16, 8, 13, 3),
           (IKS, IKS, 1280, 256, 1, 1, 6, 2), (IKS, Q6K, 256, 768, 9, 4, 30, 3), (IK4, IK4, 2048, 768, 16, 8, 13, 3),
           (IK4, IK4, 1280, 256, 1, 1, 6, 2), (IK4, Q6K, 256, 768, 9, 4, 30, 3), (Q40, IK4, 96, 512, 5, 2, 11, 2),
           (I3S, I3S, 2048, 768, 16, 8, 13, 3), (I2S, I2S, 1280, 256, 1, 1, 6, 2), (I2S, I3S, 256, 768, 9, 4, 30, 3),
           (Q40, I3S, 96, 512, 5, 2, 11, 2), (I5S, I5S, 2048, 768, 16, 8, 13, 3), (I5S, Q6K, 256, 768, 9, 4, 30, 3),
           (I4SS, I4SS, 2048, 768, 16, 8, 13, 3), (I2L, I2L, 1280, 256, 1, 1, 6, 2), (I2L, I4SS, 256, 768, 9, 4, 30, 3),
           (I2K, I3K, 2048, 768, 16, 8, 13, 3), (I3K, I3K, 1280, 256, 1, 1, 6, 2), (I2K, Q6K, 256, 768, 9, 4, 30, 3),
           # AMX's tiles (16 rows, 16 tokens; experts of 12 tokens and more): odd block counts, a last tile of a few
           # tokens, an expert just at 12 and one just below, many tiles
           (Q40, Q40, 96, 160, 2, 2, 40, 3), (Q40, Q40, 160, 96, 3, 1, 50, 2), (Q40, Q40, 2048, 768, 4, 2, 23, 2),
           (Q40, Q40, 64, 64, 2, 1, 24, 1), (Q40, Q6K, 256, 512, 2, 2, 100, 3),
           (Q4K, Q4K, 768, 1280, 2, 2, 40, 3), (Q4K, Q4K, 1280, 256, 3, 1, 50, 2), (Q4K, Q6K, 2048, 768, 4, 2, 23, 2),
           (Q4K, Q40, 256, 96, 2, 1, 24, 1), (Q40, Q4K, 96, 512, 2, 2, 100, 3),
           (Q6K, Q6K, 768, 1280, 2, 2, 40, 3), (Q6K, Q6K, 1280, 256, 3, 1, 50, 2), (Q6K, Q4K, 256, 768, 2, 1, 24, 1),
           (Q5K, Q5K, 768, 1280, 2, 2, 40, 3), (Q5K, Q6K, 1280, 256, 3, 1, 50, 2), (IQ4, IQ4, 768, 1280, 2, 2, 40, 3),
           (IQ4, Q5K, 1280, 256, 3, 1, 50, 2), (Q40, IQ4, 96, 512, 2, 2, 100, 3)]


@pytest.mark.parametrize("up_type,down_type,n_embd,n_ff,n_expert,n_used,n,threads,isa",
                         [(*b, "vnni") for b in BATCHES] + [(*b, isa) for b in BATCHES for isa in ISAS[1:]
                                                            if set(b[:2]) & set(CPU_AMX_TYPES)])
def test_the_batch_kernel_matches_float64_given_its_activation_rounding(up_type, down_type, n_embd, n_ff, n_expert,
                                                                          n_used, n, threads, isa, path):
    """Many tokens at once (ferry_moe_batch: the pairs sorted by expert, tiles of tokens per weight group), some slots
    of id -1 (experts computed elsewhere: they add nothing), against float64 with the kernel's rounding of x and h;
    the tiled types (CPU_AMX_TYPES) on each of the CPU's paths (isa)."""
    path(isa)
    rng = np.random.default_rng(n_embd * n + n_used)
    cpu = CpuBackend(threads)
    (up, gate, down), (up64, gate64, down64) = _layer(rng, n_expert, n_embd, n_ff, up_type, down_type)
    round_x, round_h = ((lambda v, b=32 if t == Q40 else 256: _as_kernel_rounds(v, b)) for t in (up_type, down_type))
    x = rng.standard_normal((n, n_embd)).astype(np.float32)
    ids = np.stack([rng.choice(n_expert, n_used, replace=False) for _ in range(n)]).astype(np.int32)
    ids[rng.random(ids.shape) < 0.2] = -1
    weights = rng.random((n, n_used)).astype(np.float32)
    rounded = np.zeros((n, n_embd))
    for i in range(n):
        xr = round_x(x[i].astype(np.float64))
        for j, e in enumerate(ids[i]):
            if e >= 0:
                g, u = gate64[e] @ xr, up64[e] @ xr
                rounded[i] += weights[i, j] * (down64[e] @ round_h(g / (1 + np.exp(-g)) * u))
    assert cpu.native_experts(n, True, up, gate, down, "silu") is not None
    got = cpu.moe_experts(torch.from_numpy(x), torch.from_numpy(ids), torch.from_numpy(weights), up, gate, down,
                          "silu").numpy()
    # float32 accumulation and an h value rounded the other way here and there (about 3e-4 of a row's scale each)
    scale = np.abs(rounded).max(axis=1, keepdims=True)
    assert np.all(np.abs(got - rounded) <= 3e-3 * np.maximum(scale, 1e-30)), np.abs(got - rounded).max()
    assert np.linalg.norm(got - rounded) / np.linalg.norm(rounded) < 1e-3  # the exact result is 1e-2 away
    assert not np.any(got[(ids < 0).all(axis=1)])  # a token whose every slot is elsewhere: exact zeros
    # token by token through the one-token kernel (its live slots): the same sums in another order. On AMX a block's
    # sum is added whole, not as the VNNI kernels' two halves, so that an h value here and there rounds the other way
    tolerance = 3e-3 if isa == "amx" else 1e-5
    for i in range(n):
        live = ids[i] >= 0
        if live.any():
            one = cpu.moe_experts(torch.from_numpy(x[i:i + 1]), torch.from_numpy(ids[i:i + 1, live]),
                                  torch.from_numpy(weights[i:i + 1, live]), up, gate, down, "silu").numpy()[0]
            assert np.abs(got[i] - one).max() <= tolerance * np.abs(one).max()


MX = Q.MXFP4
# gpt-oss's experts (MXFP4, clamped SwiGLU, biases): gpt-oss-20b's width with few experts; odd counts of MXFP4's
# pairs of blocks (192 = 3, 320 = 5); one expert; MXFP4 beside Q4_0 either way (h's chunks of 64 beside blocks of 32)
OAI_SHAPES = [(MX, MX, 2880, 2880, 4, 4, 1), (MX, MX, 2880, 2880, 4, 4, 11), (MX, MX, 64, 64, 3, 2, 1),
              (MX, MX, 192, 320, 5, 3, 9), (MX, MX, 320, 192, 1, 1, 3), (MX, Q40, 192, 96, 7, 4, 1),
              (Q40, MX, 96, 192, 7, 4, 17), (MX, MX, 576, 128, 32, 4, 37)]


@pytest.mark.parametrize("up_type,down_type,n_embd,n_ff,n_expert,n_used,n", OAI_SHAPES)
@pytest.mark.parametrize("act,biased", [("swiglu_oai", True), ("silu", False), ("swiglu_oai", False),
                                       ("silu_clamp", False)])
def test_gpt_oss_experts_match_float64_given_the_kernels_rounding(up_type, down_type, n_embd, n_ff, n_expert, n_used,
                                                                  n, act, biased):
    """MXFP4 weights (the E8M0 scale and the FP4 table), gpt-oss's clamped SwiGLU and the experts' biases (each
    expert's own row of up's, gate's and down's), one token and many (some slots -1), against float64 given the
    kernel's 8-bit rounding of x and h per block of 32; the pre-activations span the clamp's limit (DeepSeek-V4's
    clamped SwiGLU too, at its limit of 10)."""
    rng = np.random.default_rng(n_embd + 7 * n_ff + n)
    cpu = CpuBackend(3)
    (up, gate, down), (up64, gate64, down64) = _layer(rng, n_expert, n_embd, n_ff, up_type, down_type)
    bias = {}
    if biased:
        for name, w, rows in (("up", up, n_ff), ("gate", gate, n_ff), ("down", down, n_embd)):
            w.bias = torch.from_numpy(rng.standard_normal((n_expert, rows)).astype(np.float32) * 2)
            bias[name] = w.bias.numpy().astype(np.float64)
    x = (rng.standard_normal((n, n_embd)) * (8 if act == "silu_clamp" else 4) / np.sqrt(n_embd)).astype(np.float32)
    ids = np.stack([rng.choice(n_expert, n_used, replace=False) for _ in range(n)]).astype(np.int32)
    if n > 1:
        ids[rng.random(ids.shape) < 0.2] = -1
    weights = rng.random((n, n_used)).astype(np.float32)
    alpha, limit = 1.702, 10.0 if act == "silu_clamp" else 7.0
    widest = 0.0
    rounded = np.zeros((n, n_embd))
    for i in range(n):
        xr = _as_kernel_rounds(x[i].astype(np.float64), 32)
        for j, e in enumerate(ids[i]):
            if e < 0:
                continue
            g, u = gate64[e] @ xr, up64[e] @ xr
            if biased:
                g, u = g + bias["gate"][e], u + bias["up"][e]
            widest = max(widest, np.abs(g).max(), np.abs(u).max())
            if act == "silu":
                h = g / (1 + np.exp(-g)) * u
            elif act == "silu_clamp":
                g, u = np.minimum(g, limit), np.clip(u, -limit, limit)
                h = g / (1 + np.exp(-g)) * u
            else:
                g, u = np.minimum(g, limit), np.clip(u, -limit, limit)
                h = g / (1 + np.exp(-alpha * g)) * (u + 1)
            y = down64[e] @ _as_kernel_rounds(h, 32 if down_type in (Q40, MX) else 256)
            rounded[i] += weights[i, j] * (y + (bias["down"][e] if biased else 0))
    assert act == "silu" or widest > limit  # the clamp bites
    assert cpu.native_experts(n, True, up, gate, down, act) is not None
    got = cpu.moe_experts(torch.from_numpy(x), torch.from_numpy(ids), torch.from_numpy(weights), up, gate, down,
                          act).numpy()
    scale = np.abs(rounded).max(axis=1, keepdims=True)
    assert np.all(np.abs(got - rounded) <= 3e-3 * np.maximum(scale, 1e-30)), np.abs(got - rounded).max()
    assert np.linalg.norm(got - rounded) / np.linalg.norm(rounded) < 1e-3
    if n == 1:  # ggml's mul_mat_id on the same weights (its own Q8_0 rounding of x and h): the same to that rounding
        theirs = CpuBackend(3, native_kernels=False).moe_experts(torch.from_numpy(x), torch.from_numpy(ids),
                                                                 torch.from_numpy(weights), up, gate, down, act).numpy()
        assert np.linalg.norm(got - theirs) / np.linalg.norm(theirs) < 2e-2


def test_the_batch_kernel_matches_ggml_on_the_same_tokens():
    """The batch kernel and ggml's mul_mat_id on one layer's 300 tokens: the same result to 8-bit activations'
    rounding, which both make (ggml's Q8_0 / Q8_K, the kernel's own)."""
    rng = np.random.default_rng(11)
    (up, gate, down), _ = _layer(rng, 32, 512, 256)
    x = torch.from_numpy(rng.standard_normal((300, 512)).astype(np.float32))
    ids = torch.from_numpy(np.stack([rng.choice(32, 4, replace=False) for _ in range(300)]).astype(np.int32))
    weights = torch.from_numpy(rng.random((300, 4)).astype(np.float32))
    ours = CpuBackend(2).moe_experts(x, ids, weights, up, gate, down, "silu")
    theirs = CpuBackend(2, native_kernels=False).moe_experts(x, ids, weights, up, gate, down, "silu")
    assert torch.linalg.norm(ours - theirs) / torch.linalg.norm(theirs) < 2e-2


def test_an_expert_id_out_of_range_in_a_batch_is_an_error_and_writes_nothing():
    rng = np.random.default_rng(12)
    cpu = CpuBackend(2)
    layer, _ = _layer(rng, 4, 64, 32)
    kernel = cpu.native_experts(3, True, *layer, "silu")
    if kernel is None:
        assert not _has_vnni()
        return
    out = torch.full((3, 64), 7.0)
    with pytest.raises(ValueError, match=r"\[-2, 4\] are not all below 4"):
        kernel(torch.randn(3, 64), torch.tensor([[1, 2], [4, -1], [0, -2]], dtype=torch.int32), torch.ones(3, 2),
               *(w.repacked.tensor.contents.data for w in layer), 4, out)
    assert torch.equal(out, torch.full((3, 64), 7.0))


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
    assert (cpu.native_experts(2, True, *q4, "silu") is not None) == _has_vnni()  # many tokens: the batch kernel
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


@pytest.mark.parametrize("experts", ["q4_0", "q4_k_m", "q5_k_m", "iq4_xs"])
def test_a_models_prompt_through_the_kernels_agrees_with_ggmls_on_every_path(experts, tmp_path, path):
    """A whole model's prompt of 64 tokens in one u-batch (qwen3-moe-tiny: 16 experts, 4 a token, so 16 tokens an
    expert on average: the tiles' share where the CPU has AMX) through ferry's CPU kernels, on each path this CPU runs,
    against ggml's kernels on the same file: the same roundings of the activations, the sums in another order. The
    experts as llama.cpp's Q4_K_M / Q5_K_M mixes give them (Q6_K down in half the layers), Q4_0 and IQ4_XS. Measured
    KL max 6.5e-6 to 8.7e-6, but 1.4e-4 for Q5_K_M on VNNI: there one expert's h value of one token lies at a rounding
    boundary of its 8 bits, and up and gate summed in another order round it the other way (the float64 reference of
    that token's expert agrees with ggml's to 1e-7 and the dense kernels' up, gate and down each to 2e-7)."""
    from ferry.cli import main
    from ferry.gguf.file import GGUFFile
    from ferry.models import load_model
    from ferry.runtime.engine import Engine

    model = tmp_path / "m.gguf"
    assert main(["synth", "qwen3-moe-tiny", "--expert-type", experts, "-o", str(model), "-q"]) == 0
    tokens = np.random.default_rng(7).integers(0, 2000, 64).tolist()

    def run(native: bool) -> torch.Tensor:
        engine = Engine(load_model(GGUFFile(model)), CpuBackend(2, native_kernels=native), n_ctx=128, n_ubatch=64)
        return engine.decode(tokens, all_logits=True).double()

    def kl(p, q):
        return (p.softmax(-1) * (p.log_softmax(-1) - q.log_softmax(-1))).sum(-1)

    theirs, paths = run(False), {}
    for isa in ISAS:
        path(isa)
        ours = paths[isa] = run(True)
        assert not torch.equal(ours, theirs)  # ferry's kernels ran
        print(experts, isa, f"KL against ggml's: max {kl(theirs, ours).max():.2e}")
        assert kl(theirs, ours).max() < 5e-4
        assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean() >= 0.95
    if "amx" in paths:  # the tiles ran: their sums' order is not VNNI's
        assert not torch.equal(paths["amx"], paths["vnni"])


def test_plan_says_which_layers_run_on_ferrys_kernel_by_their_expert_types():
    """A Q4_K_M or Q5_K_M file (Q4_K / Q5_K layers, some with Q6_K down) and an IQ4_XS one all on ferry's kernel; a
    file's Q8_0 layers on ggml's beside its Q6_K ones on ferry's; Q8_0 experts all on ggml's."""
    mixed = experts_kernel([{"Q8_0"}, {"Q8_0", "Q6_K"}, {"Q6_K"}])
    if _has_vnni():
        assert mixed.startswith("ferry's own kernel") and "in 1 of 3 layers" in mixed and "theirs are Q6_K, Q8_0" in mixed
        for layers in ([{"Q4_K"}, {"Q4_K", "Q6_K"}], [{"Q5_K"}, {"Q5_K", "Q6_K"}], [{"IQ4_XS"}], [{"MXFP4"}]):
            assert experts_kernel(layers).startswith("ferry's own kernel ("), layers
        q4 = experts_kernel([{"Q4_0"}, {"Q4_K", "Q6_K"}])
        assert q4.startswith("ferry's own kernel (") and ("Q4_0, Q4_K, Q6_K experts" in q4) == native.amx()
        assert "AMX" not in experts_kernel([{"MXFP4"}])  # MXFP4's experts stay on VNNI
        assert "Q8_0 experts" not in experts_kernel([{"Q8_0", "Q4_K"}])  # Q8_0's are ggml's
    else:
        assert mixed.startswith("ggml's kernel")
    q8 = experts_kernel([{"Q8_0"}, {"Q8_0"}])
    assert q8.startswith("ggml's kernel") and "these are Q8_0" in q8


def _rounded_rows(x: np.ndarray, qtype) -> np.ndarray:
    """x's rows after the kernel's activation rounding for weights of qtype (blocks of 32 for Q4_0 / Q8_0, else 256)."""
    return np.stack([_as_kernel_rounds(r.astype(np.float64), 32 if qtype in (Q40, Q.Q8_0, Q.Q5_0, Q.IQ4_NL) else 256)
                     for r in x])


# (type, rows, columns, tokens, threads): one block, odd block counts, one group of 8 rows, tokens past a tile of 8,
# fewer tokens than threads
LINEAR = [(Q.Q8_0, 8, 32, 1, 1), (Q.Q8_0, 24, 96, 3, 3), (Q.Q8_0, 72, 160, 17, 2), (Q.Q8_0, 2048, 512, 9, 3),
          (Q40, 40, 160, 20, 2), (Q40, 8, 32, 1, 3), (Q40, 1024, 96, 11, 2),
          (Q4K, 16, 768, 5, 2), (Q4K, 8, 256, 1, 1), (Q4K, 136, 1280, 19, 3),
          (Q6K, 8, 256, 2, 3), (Q6K, 56, 768, 13, 2), (Q6K, 24, 1280, 1, 1),
          (Q5K, 8, 256, 1, 1), (Q5K, 40, 768, 9, 3), (Q5K, 136, 1280, 5, 2),
          (IQ4, 8, 256, 3, 2), (IQ4, 72, 1280, 1, 3), (IQ4, 24, 768, 17, 2),
          # Q5_0 and IQ4_NL as their Q8_0 copies (Gemma 3's 640-wide matrices: no K-quant fits them)
          (Q.Q5_0, 8, 32, 2, 1), (Q.Q5_0, 24, 640, 5, 2), (Q.Q5_0, 136, 160, 17, 3), (Q.Q5_0, 2048, 640, 40, 2),
          (Q.IQ4_NL, 8, 32, 3, 1), (Q.IQ4_NL, 24, 640, 13, 2), (Q.IQ4_NL, 136, 160, 2, 3),
          # AMX's tiles (12 tokens and more): a last group of 8 rows alone, many tiles, one tile just full
          (Q.Q8_0, 2048, 512, 33, 3), (Q40, 24, 96, 12, 1), (Q.Q8_0, 8, 32, 16, 2), (Q40, 136, 2048, 70, 2),
          (Q4K, 24, 768, 12, 1), (Q4K, 8, 256, 16, 2), (Q4K, 136, 1280, 45, 3),
          (Q6K, 24, 768, 12, 1), (Q6K, 8, 256, 16, 2), (Q6K, 136, 1280, 45, 3),
          (Q5K, 24, 768, 12, 1), (Q5K, 8, 256, 16, 2), (Q5K, 136, 1280, 45, 3),
          (IQ4, 24, 768, 12, 1), (IQ4, 8, 256, 16, 2), (IQ4, 136, 1280, 45, 3)]


@pytest.mark.parametrize("qtype,m,k,n,threads,isa", [(*c, "vnni") for c in LINEAR] + [
    (*c, isa) for c in LINEAR for isa in ISAS[1:] if c[0] in (*CPU_AMX_TYPES, *AS_Q8_0)])
def test_the_matrix_kernel_matches_float64_given_its_activation_rounding(qtype, m, k, n, threads, isa, path):
    """Dense weights (ferry_linear: Q8_0, Q5_0 and IQ4_NL in ferry's own interleaved Q8_0 copy, Q4_0 / Q4_K in ggml's
    repacked one, Q5_K, Q6_K and IQ4_XS plain), one token and many; the tiled types on each of the CPU's paths
    (isa)."""
    path(isa)
    rng = np.random.default_rng(m * k + n)
    w, w64 = _weight(rng, qtype, m, k)
    x = rng.standard_normal((n, k)).astype(np.float32)
    cpu = CpuBackend(threads)
    assert cpu.native_linear(w) is not None
    got = cpu.linear(torch.from_numpy(x), w).numpy()
    rounded = _rounded_rows(x, qtype) @ w64.T
    assert np.abs(got - rounded).max() <= 1e-5 * np.abs(rounded).max()
    exact = x.astype(np.float64) @ w64.T
    assert np.linalg.norm(got - exact) / np.linalg.norm(exact) < 2e-2  # 8-bit activations: about 0.5%
    if qtype == Q.Q8_0:
        assert w.own_copy is not None and w.own_copy.nbytes == w.data.nbytes  # the same bytes, interleaved
    if qtype in AS_Q8_0:
        assert w.own_copy is not None and w.own_copy.nbytes == w.data.nbytes // (22 if qtype == Q.Q5_0 else 18) * 34


@pytest.mark.parametrize("qtype", AS_Q8_0, ids=lambda q: q.name)
def test_the_q8_0_copy_keeps_ggmls_kernel_for_one_token_and_takes_its_copy_for_more(qtype):
    """A Q5_0 (IQ4_NL) weight's Q8_0 copy reads 34 bytes where ggml's kernel reads 22 (18): one token (generation,
    bandwidth-bound on many cores) stays ggml's on the GGUF bytes, two tokens and more run ferry's kernel on the copy;
    both agree with float64 (ggml's kernels round the activations to 8 bits per 32 as the copy's does), in a graph's
    FFN and alone."""
    rng = np.random.default_rng(31)
    (up, up64), (gate, gate64), (down, down64) = (_weight(rng, qtype, 64, 96), _weight(rng, qtype, 64, 96),
                                                  _weight(rng, qtype, 96, 64))
    cpu = CpuBackend(2)
    assert cpu.native_linear(up, 1) is None and cpu.native_linear(up, 2) is not None
    for n in (1, 2, 13):
        x = rng.standard_normal((n, 96)).astype(np.float32)
        ours = cpu.ffn(torch.from_numpy(x), gate, up, down, "silu").numpy()
        theirs = CpuBackend(2, native_kernels=False).ffn(torch.from_numpy(x), gate, up, down, "silu").numpy()
        xr = _rounded_rows(x, qtype)
        g, u = xr @ gate64.T, xr @ up64.T
        ref = _rounded_rows(g / (1 + np.exp(-g)) * u, qtype) @ down64.T
        assert np.abs(ours - ref).max() <= 3e-3 * np.abs(ref).max(), n
        assert np.linalg.norm(ours - theirs) / np.linalg.norm(theirs) < 1e-2, n  # h rounded apart here and there
        alone, want = cpu.linear(torch.from_numpy(x), up).numpy(), xr @ up64.T
        # ferry's kernel: the activations' rounding modelled exactly; ggml's (one token) rounds them its own way
        assert np.abs(alone - want).max() <= (1e-5 if n > 1 else 1e-3) * np.abs(want).max(), n


def test_a_dense_ffn_graph_runs_the_matrix_kernel_as_ggml_runs_its_own():
    """CpuBackend.ffn (one graph: up, gate, down as ferry's nodes) against ggml's mul_mat on the same weights, and
    against float64 with both roundings of the kernel's activations."""
    rng = np.random.default_rng(21)
    (up, up64), (gate, gate64) = _weight(rng, Q.Q8_0, 96, 64), _weight(rng, Q.Q8_0, 96, 64)
    down, down64 = _weight(rng, Q40, 64, 96)
    x = rng.standard_normal((13, 64)).astype(np.float32)
    ours = CpuBackend(2).ffn(torch.from_numpy(x), gate, up, down, "silu").numpy()
    theirs = CpuBackend(2, native_kernels=False).ffn(torch.from_numpy(x), gate, up, down, "silu").numpy()
    xr = _rounded_rows(x, Q.Q8_0)
    g, u = xr @ gate64.T, xr @ up64.T
    ref = _rounded_rows(g / (1 + np.exp(-g)) * u, Q40) @ down64.T
    scale = np.abs(ref).max()
    assert np.abs(ours - ref).max() <= 3e-3 * scale  # an h value rounded the other way here and there
    assert np.linalg.norm(ours - theirs) / np.linalg.norm(theirs) < 2e-2


def test_ggml_keeps_the_dense_weights_the_matrix_kernel_does_not_cover():
    """Rows not a multiple of 8, a type it does not read, Q4_0 without ggml's repacked copy (--no-repack), FERRY_NATIVE
    off: ggml's mul_mat, with the same result as before."""
    rng = np.random.default_rng(22)
    cpu = CpuBackend(2)
    odd, _ = _weight(rng, Q.Q8_0, 12, 64)
    q5, _ = _weight(rng, Q.Q5_1, 16, 64)
    q4, _ = _weight(rng, Q40, 16, 64)
    assert cpu.native_linear(odd) is None and cpu.native_linear(q5) is None
    assert CpuBackend(2, repack=False).native_linear(q4) is None
    assert CpuBackend(2, native_kernels=False).native_linear(q4) is None
    x = torch.randn(3, 64)
    ref = x.double() @ torch.from_numpy(odd.dequantize()).double().T
    assert torch.linalg.norm(cpu.linear(x, odd).double() - ref) / torch.linalg.norm(ref) < 2e-2


def test_graphs_built_for_more_tokens_grow_the_scratch_that_earlier_graphs_then_read():
    """A layer's graph nodes share one scratch per kernel (graphs run one at a time): a graph of 3 tokens, then one of
    40 (the scratch grows, the first graph's pointer must follow), then the first again, each as ggml's own graph
    computes them (the MoE block and a dense FFN, ferry's nodes in both)."""
    rng = np.random.default_rng(23)
    (up, gate, down), _ = _layer(rng, 8, 256, 96)
    router = Weight("router", Q.F32, (256, 8), rng.standard_normal((8, 256)).astype(np.float32).view(np.uint8).ravel())
    (fu, _), (fg, _), (fd, _) = _weight(rng, Q.Q8_0, 96, 256), _weight(rng, Q.Q8_0, 96, 256), _weight(rng, Q40, 256, 96)
    ours, theirs = CpuBackend(2), CpuBackend(2, native_kernels=False)
    for n in (3, 40, 3):
        x = torch.from_numpy(rng.standard_normal((n, 256)).astype(np.float32))
        (a, ia), (b, ib) = (be.moe(x, router, up, gate, down, 2, True, "silu") for be in (ours, theirs))
        assert torch.equal(ia, ib) and torch.linalg.norm(a - b) / torch.linalg.norm(b) < 2e-2
        a, b = (be.ffn(x, fg, fu, fd, "silu") for be in (ours, theirs))
        assert torch.linalg.norm(a - b) / torch.linalg.norm(b) < 2e-2


# attention: (queries, cached positions, heads, key heads, key size, value size); odd counts, GQA, values unlike keys
ATTENTION = [(1, 1, 1, 1, 16, 16), (5, 17, 4, 1, 256, 256), (37, 300, 8, 2, 128, 128), (3, 130, 64, 8, 64, 64),
             (70, 70, 2, 2, 192, 128), (100, 513, 6, 3, 80, 48), (65, 129, 1, 1, 16, 32)]


def _attention_reference(q, k, v, mask, sinks, scale) -> np.ndarray:
    """softmax(scale q k^T + mask) v per head in float64, sinks in the denominator; a row with every key closed: 0."""
    n, heads, _ = q.shape
    kv_heads = k.shape[1]
    out = np.zeros((n, heads, v.shape[2]))
    for h in range(heads):
        g = h // (heads // kv_heads)
        s = scale * q[:, h].astype(np.float64) @ k[:, g].astype(np.float64).T
        if mask is not None:
            s = s + mask.astype(np.float64)
        top = s.max(1, keepdims=True) if sinks is None else np.maximum(s.max(1, keepdims=True), sinks[h])
        top = np.where(np.isfinite(top), top, 0)
        e = np.exp(s - top)
        den = e.sum(1, keepdims=True) + (0 if sinks is None else np.exp(sinks[h] - top))
        out[:, h] = (e @ v[:, g].astype(np.float64)) / np.where(den > 0, den, 1)
    return out


def _mask(n: int, n_kv: int, kind: str | None) -> np.ndarray | None:
    """The cache's last n positions as queries: causal, within a window of 7, or causal with query 0 closed to all."""
    if kind is None:
        return None
    pos, j = np.arange(n) + n_kv - n, np.arange(n_kv)
    open_ = j[None, :] <= pos[:, None]
    if kind == "window":
        open_ &= j[None, :] > pos[:, None] - 7
    if kind == "closed row":
        open_[0] = False
    return np.where(open_, 0, -np.inf).astype(np.float16)


def _cache(rng, n_kv: int, kv_heads: int, d: int, qtype) -> tuple[np.ndarray, np.ndarray]:
    """Random cache rows (n_kv, kv_heads, d) as the kernel reads them (float16 values, or each row's Q8_0 bytes) and
    their values."""
    x = rng.standard_normal((n_kv, kv_heads, d)).astype(np.float32)
    if qtype == Q.F16:
        return x.astype(np.float16), x.astype(np.float16)
    raw = quantize(x.reshape(-1, d), Q.Q8_0).reshape(n_kv, kv_heads, -1)
    return raw, dequantize(raw.reshape(-1), Q.Q8_0, (d, n_kv * kv_heads)).reshape(n_kv, kv_heads, d)


@pytest.mark.parametrize("cache", [Q.F16, Q.Q8_0], ids=["f16", "q8_0"])
@pytest.mark.parametrize("sinks", [False, True], ids=["", "sinks"])
@pytest.mark.parametrize("kind", ["causal", "window", "closed row", None])
@pytest.mark.parametrize("n,n_kv,heads,kv_heads,d,d_v", ATTENTION)
def test_the_attention_kernel_matches_float64(n, n_kv, heads, kv_heads, d, d_v, kind, sinks, cache):
    """float16 keys and values (or Q8_0 blocks) read exactly, float32 arithmetic: within 2e-6 relative of float64 on
    the cache's values (measured up to 5e-7 at 513 keys); a query with every key closed gets zeros, as ggml's flash
    attention gives. Q8_0 rows of sizes not a multiple of 32 are refused."""
    rng = np.random.default_rng(n * 1000 + n_kv)
    q = rng.standard_normal((n, heads, d)).astype(np.float32)
    kernel = native.Attention(native.library(), 2)
    if cache == Q.Q8_0 and (d % 32 or d_v % 32):
        assert not native.Attention.reads(d, d_v, cache.value, cache.value)
        return
    (k, k_values), (v, v_values) = _cache(rng, n_kv, kv_heads, d, cache), _cache(rng, n_kv, kv_heads, d_v, cache)
    mask = _mask(n, n_kv, kind)
    sink = (2 * rng.standard_normal(heads)).astype(np.float32) if sinks else None
    got = kernel(*map(torch.from_numpy, (q, k, v)), None if mask is None else torch.from_numpy(mask),
                 None if sink is None else torch.from_numpy(sink), d ** -0.5, d_v, cache.value, cache.value).numpy()
    ref = _attention_reference(q, k_values, v_values, mask, sink, d ** -0.5)
    assert np.isfinite(got).all()
    assert np.linalg.norm(got - ref) <= 2e-6 * np.linalg.norm(ref)
    if kind == "closed row":
        assert not got[0].any()


def test_the_attention_kernel_takes_float16_and_q8_0_heads_of_up_to_256_values_alone():
    f16, q8, q4 = ggml.GGML_TYPE_F16, ggml.GGML_TYPE_Q8_0, ggml.GGML_TYPE_Q4_0
    assert native.Attention.reads(128, 128, f16, f16) and native.Attention.reads(256, 16, f16, f16)
    assert native.Attention.reads(128, 128, q8, f16) and not native.Attention.reads(48, 64, q8, q8)
    assert not native.Attention.reads(128, 128, q4, q4) and not native.Attention.reads(20, 16, f16, f16)
    assert not native.Attention.reads(576, 512, f16, f16)  # MLA's latent: ggml's
    q, kv = torch.zeros(2, 1, 20), torch.zeros(3, 1, 20, dtype=torch.float16)
    with pytest.raises(ValueError, match="heads of 20"):
        native.Attention(native.library(), 2)(q, kv, kv, None, None, 1.0)


def test_graphs_attend_with_the_kernel_where_a_key_head_has_rows_enough():
    """A decode step of Gemma 3 (4 heads on one key head: 4 rows) stays ggml's, faster there; Qwen3's (8 rows), a
    2-token step of Gemma 3, prompts take the kernel."""
    assert not native.Attention.pays(1, 4, 1) and native.Attention.pays(2, 4, 1)
    assert native.Attention.pays(1, 32, 4) and native.Attention.pays(512, 64, 8)


@pytest.mark.parametrize("threads", [2, 3, 16])
@pytest.mark.parametrize("n,n_kv,heads,kv_heads,d", [(1, 700, 4, 1, 256), (1, 2048, 32, 4, 128), (2, 300, 8, 8, 64),
                                                     (1, 129, 4, 1, 64)])
def test_decode_steps_split_their_keys_between_threads_and_match_float64(n, n_kv, heads, kv_heads, d, threads):
    """Fewer units of work than threads (one query, few key heads): each unit's keys split in parts of whole blocks, one
    a thread, the parts' maxima, sums and values combined; sinks and a sliding window too (a part may hold no open
    key)."""
    rng = np.random.default_rng(threads * 100 + n_kv)
    q = rng.standard_normal((n, heads, d)).astype(np.float32)
    k = rng.standard_normal((n_kv, kv_heads, d)).astype(np.float16)
    v = rng.standard_normal((n_kv, kv_heads, d)).astype(np.float16)
    sink = (2 * rng.standard_normal(heads)).astype(np.float32)
    kernel = native.Attention(native.library(), threads)
    for mask in (_mask(n, n_kv, "causal"), _mask(n, n_kv, "window")):
        for s in (None, sink):
            got = kernel(*map(torch.from_numpy, (q, k, v, mask)), None if s is None else torch.from_numpy(s),
                         d ** -0.5).numpy()
            ref = _attention_reference(q, k, v, mask, s, d ** -0.5)
            assert np.linalg.norm(got - ref) <= 2e-6 * np.linalg.norm(ref)


@pytest.mark.parametrize("cache", ["f16", "q8_0"])
@pytest.mark.parametrize("preset", ["qwen3-moe-tiny", "gpt-oss-tiny"])
def test_a_graph_attends_through_the_kernel_as_through_ggmls_flash_attention(preset, cache, tmp_path, monkeypatch):
    """A model's CPU graphs (a prompt in u-batches over the cache, then decode steps; gpt-oss: sinks and sliding
    windows) with ferry's attention kernel against ggml's flash attention and against the eager forward, whose
    attention is torch's in float32: ggml rounds each query to float16, so the kernel's logits are nearer the eager
    ones than ggml's are (measured KL max 4.9e-6 against 8.0e-6 on qwen3-moe-tiny, 5.8e-6 against 1.6e-5 on
    gpt-oss-tiny), and within 5e-5 of ggml's (measured 8.0e-6 / 1.6e-5; with Q8_0 caches, which ggml's kernel reads
    with each query rounded to Q8_0 and the eager forward not at all, 1.1e-5 / 1.9e-5)."""
    from ferry.cli import main
    from ferry.gguf.file import GGUFFile
    from ferry.models import load_model
    from ferry.runtime.engine import Engine

    path = tmp_path / "m.gguf"
    assert main(["synth", preset, "-o", str(path), "-q"]) == 0
    tokens = np.random.default_rng(5).integers(0, 200, 52).tolist()

    def run(kernel: bool, graph: bool = True):
        backend = CpuBackend(2)
        if not kernel:
            monkeypatch.setattr(backend, "native_attention", lambda *a: None)
        engine = Engine(load_model(GGUFFile(path)), backend, n_ctx=128, n_ubatch=16, graph=graph, type_k=cache,
                        type_v=cache)
        out = [engine.decode(tokens[:48], all_logits=True)] + [engine.decode([t], all_logits=True) for t in tokens[48:]]
        return torch.cat(out).double()

    def kl(p, q):
        return (p.softmax(-1) * (p.log_softmax(-1) - q.log_softmax(-1))).sum(-1)

    ours, theirs = run(True), run(False)
    assert not torch.equal(ours, theirs)  # the kernel ran: its rounding is not ggml's
    if cache == "f16":  # the eager forward reads float16 caches alone
        eager = run(True, graph=False)
        assert kl(eager, ours).max() <= kl(eager, theirs).max()
    print(preset, cache, f"KL against ggml's: max {kl(theirs, ours).max():.2e}")
    assert kl(theirs, ours).max() < 5e-5
    # top-1 the same, or where not, a near tie in ggml's logits (a tiny random model's are flat)
    differ = ours.argmax(-1) != theirs.argmax(-1)
    top = theirs.gather(-1, theirs.argmax(-1, keepdim=True))[:, 0]
    margin = top - theirs.gather(-1, ours.argmax(-1, keepdim=True))[:, 0]
    print("top-1 differs at", differ.sum().item(), "of", len(differ), "margins", margin[differ].tolist())
    assert differ.float().mean() <= 0.05 and (margin[differ] < 0.02).all()
