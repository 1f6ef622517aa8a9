"""GGUF blocks dequantized on the GPU by Triton kernels, one program per group of blocks, the raw bytes read
as they sit in the file (weights stay in their quant format on the GPU; this expands them where a kernel
needs floats, e.g. into a reused bf16 scratch before cuBLAS)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as Q

_BLOCKS = 64  # quant blocks per program


@triton.jit
def _f16_at(src, base, mask):
    """The little-endian float16 at byte offsets `base`, as float32."""
    lo = tl.load(src + base, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(src + base + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _u32_at(src, base, mask):
    b0 = tl.load(src + base, mask=mask, other=0).to(tl.uint32)
    b1 = tl.load(src + base + 1, mask=mask, other=0).to(tl.uint32)
    b2 = tl.load(src + base + 2, mask=mask, other=0).to(tl.uint32)
    b3 = tl.load(src + base + 3, mask=mask, other=0).to(tl.uint32)
    return b0 | (b1 << 8) | (b2 << 16) | (b3 << 24)


@triton.jit
def _dequant_legacy(src, dst, n_blocks, KIND: tl.constexpr, BLOCK_BYTES: tl.constexpr, BLOCKS: tl.constexpr):
    """Q8_0, Q4_0, Q4_1, Q5_0, Q5_1: 32 values per block behind one or two f16 scales."""
    b = tl.program_id(0) * BLOCKS + tl.arange(0, BLOCKS)
    live = b < n_blocks
    base = b.to(tl.int64) * BLOCK_BYTES
    j = tl.arange(0, 32)
    m2 = live[:, None]
    d = _f16_at(src, base, live)[:, None]
    if KIND == 0:  # Q8_0: d, 32 x int8
        q = tl.load(src + base[:, None] + 2 + j[None, :], mask=m2, other=0).to(tl.int8, bitcast=True)
        out = d * q.to(tl.float32)
    else:
        if KIND == 1:  # Q4_0: d, 16 bytes of nibbles (value i in byte i % 16: low nibble first), minus 8
            qs = base + 2
        elif KIND == 2:  # Q4_1: d, m, nibbles
            qs = base + 4
        elif KIND == 3:  # Q5_0: d, 32 high bits, nibbles, minus 16
            qs = base + 6
        else:  # Q5_1: d, m, 32 high bits, nibbles
            qs = base + 8
        byte = tl.load(src + qs[:, None] + (j[None, :] % 16), mask=m2, other=0).to(tl.int32)
        q = tl.where(j[None, :] < 16, byte & 0xF, byte >> 4)
        if KIND == 3:
            qh = _u32_at(src, base + 2, live)
            q = q | (((qh[:, None] >> j[None, :].to(tl.uint32)) & 1) << 4).to(tl.int32)
        if KIND == 4:
            qh = _u32_at(src, base + 4, live)
            q = q | (((qh[:, None] >> j[None, :].to(tl.uint32)) & 1) << 4).to(tl.int32)
        if KIND == 1:
            out = d * (q - 8).to(tl.float32)
        elif KIND == 3:
            out = d * (q - 16).to(tl.float32)
        else:
            out = d * q.to(tl.float32) + _f16_at(src, base + 2, live)[:, None]
    tl.store(dst + b.to(tl.int64)[:, None] * 32 + j[None, :], out.to(dst.dtype.element_ty), mask=m2)


_LEGACY = {Q.Q8_0: 0, Q.Q4_0: 1, Q.Q4_1: 2, Q.Q5_0: 3, Q.Q5_1: 4}
SUPPORTED = tuple(_LEGACY)


def dequantize(raw: torch.Tensor, qtype: Q, ne: tuple[int, ...], dtype: torch.dtype = torch.float16,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """raw: the tensor's bytes (uint8, on the GPU); returns (reversed ne) floats of `dtype`, or fills `out`."""
    if qtype not in _LEGACY:
        raise NotImplementedError(f"no GPU dequantization kernel for {qtype.name} yet")
    block, size = GGML_QUANT_SIZES[qtype]
    n = 1
    for v in ne:
        n *= v
    n_blocks = n // block
    if raw.numel() != n_blocks * size:
        raise ValueError(f"{qtype.name} tensor of {n} values needs {n_blocks * size} bytes, got {raw.numel()}")
    if out is None:
        out = torch.empty(tuple(reversed(ne)), dtype=dtype, device=raw.device)
    grid = (triton.cdiv(n_blocks, _BLOCKS),)
    _dequant_legacy[grid](raw, out, n_blocks, KIND=_LEGACY[qtype], BLOCK_BYTES=size, BLOCKS=_BLOCKS)
    return out
