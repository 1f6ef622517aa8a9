"""Q8_0 / Q4_0 / MXFP4 tensors on the GPU in the split layout the generation and MoE kernels read: each block's quants
and its scale (Q8_0 / Q4_0: an f16; MXFP4: an E8M0 exponent byte) in two arrays (the same bytes as the GGUF blocks,
apart for aligned vector loads), and the dot product of such rows with floats that those kernels share."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as Q


GEMV_KINDS = {Q.Q8_0: 0, Q.Q4_0: 1, Q.MXFP4: 2}  # types the quantized GEMV kernels read; others are expanded for cuBLAS
SCALE_BYTES = {Q.Q8_0: 2, Q.Q4_0: 2, Q.MXFP4: 1}  # the bytes of a block's scale, which its quants follow


@triton.jit
def _fp4(q):
    """A 4-bit e2m1 code (q's low nibble: sign, 2 exponent bits, 1 mantissa bit) as float32 2^-14 times its value:
    its bits placed as an f16's (sign, the low exponent bits, the top mantissa bit; code 1, 0.5, an f16 subnormal),
    converted exactly. Half the integer work of a table's arithmetic (ggml's doubled values: the expert GEMVs were
    bound by it, not by memory)."""
    bits = ((q & 8) << 12) | ((q & 7) << 9)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _nibbles(byte, KIND: tl.constexpr):
    """A byte's two values as float32, (low nibble, high nibble), in the units _scale's scale multiplies: Q4_0's nibble
    - 8, or MXFP4's e2m1 value times 2^-14."""
    if KIND == 2:
        return _fp4(byte), _fp4(byte >> 4)
    else:
        return ((byte & 0xF) - 8).to(tl.float32), ((byte >> 4) - 8).to(tl.float32)


@triton.jit
def _scale(d, KIND: tl.constexpr):
    """A block's scale as float32: the f16 d, or for MXFP4 2^(e - 127) times the 2^14 _nibbles' values lack, built
    from its bits (exact; exponents past 240, scales of 2^113 and more, are held there)."""
    if KIND == 2:
        return (tl.minimum(d.to(tl.int32) + 14, 254) << 23).to(tl.float32, bitcast=True)
    else:
        return d.to(tl.float32)


@triton.jit
def _qdot(qs, d, row, rmask, x, k0, K, KIND: tl.constexpr, BK: tl.constexpr, g=None, NORM: tl.constexpr = False):
    """Per row: the dot product of columns k0 .. k0 + BK of rows `row` (BR,) of a split Q8_0 / Q4_0 / MXFP4 matrix
    with the matching floats of x. Split layout: the quants of each row contiguous (Q8_0: K int8; Q4_0, MXFP4: K / 2
    bytes, byte j of a block holding value j in its low nibble and value j + 16 in its high one), the scales of
    each row contiguous (K / 32): every load is a plain aligned vector load. NORM: x times the norm weight g."""
    NB: tl.constexpr = BK // 32
    rr = row.to(tl.int64)[:, None]
    if KIND == 0:
        c = k0 + tl.arange(0, BK)
        cm = c < K
        q = tl.load(qs + rr * K + c[None, :], mask=rmask[:, None] & cm[None, :], other=0).to(tl.float32)
        xv = tl.load(x + c, mask=cm, other=0.0)
        if NORM:
            xv = xv * tl.load(g + c, mask=cm, other=0.0)
        part = tl.sum(tl.reshape(q * xv[None, :], (q.shape[0], NB, 32)), axis=2)
    else:
        i = tl.arange(0, BK // 2)
        cb = k0 // 2 + i  # byte of the row
        cm = cb < K // 2
        byte = tl.load(qs + rr * (K // 2) + cb[None, :], mask=rmask[:, None] & cm[None, :], other=0).to(tl.int32)
        col = k0 + (i // 16) * 32 + i % 16
        xlo = tl.load(x + col, mask=cm, other=0.0)
        xhi = tl.load(x + col + 16, mask=cm, other=0.0)
        if NORM:
            xlo = xlo * tl.load(g + col, mask=cm, other=0.0)
            xhi = xhi * tl.load(g + col + 16, mask=cm, other=0.0)
        lo, hi = _nibbles(byte, KIND)
        prod = lo * xlo[None, :] + hi * xhi[None, :]
        part = tl.sum(tl.reshape(prod, (prod.shape[0], NB, 16)), axis=2)
    b = k0 // 32 + tl.arange(0, NB)
    dv = tl.load(d + rr * (K // 32) + b[None, :], mask=rmask[:, None] & (b < K // 32)[None, :], other=0)
    return tl.sum(part * _scale(dv, KIND), axis=1)


@triton.jit
def _split_floats(qs, d, out, n_blocks, KIND: tl.constexpr, BLOCKS: tl.constexpr):
    """out[b * 32 + j] = d[b] * q[b, j] for BLOCKS blocks per program: the exact product (an int8, nibble or e2m1
    value times an f16 or a power of two is exact in float32) rounded once to out's type."""
    b = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
    live = (b < n_blocks)[:, None]
    j = tl.arange(0, 32)[None, :]
    s = _scale(tl.load(d + b, mask=b < n_blocks, other=0), KIND)[:, None]
    if KIND == 0:
        q = tl.load(qs + b[:, None] * 32 + j, mask=live, other=0).to(tl.float32)
    else:  # a byte's low nibble is column j of the block, its high nibble column j + 16
        byte = tl.load(qs + b[:, None] * 16 + j % 16, mask=live, other=0).to(tl.int32)
        lo, hi = _nibbles(byte, KIND)
        q = tl.where(j < 16, lo, hi)
    tl.store(out + b[:, None] * 32 + j, q * s, mask=live)


@dataclass
class Split:
    """A Q8_0 / Q4_0 / MXFP4 tensor on the GPU as two arrays: each block's quants (32 int8, or 16 bytes of
    nibbles) and its scale (an f16, or MXFP4's exponent byte), in block order. The same bytes as the GGUF blocks,
    laid out for aligned vector loads."""

    qtype: Q
    ne: tuple[int, ...]
    qs: torch.Tensor  # (n_blocks, 32) int8 or (n_blocks, 16) uint8
    d: torch.Tensor  # (n_blocks,) float16, or uint8 exponents (MXFP4)

    @classmethod
    def of(cls, raw: torch.Tensor, qtype: Q, ne: tuple[int, ...]) -> "Split":
        head = SCALE_BYTES[qtype]
        blocks = raw.view(-1, GGML_QUANT_SIZES[qtype][1])
        qs = blocks[:, head:].contiguous()
        d = blocks[:, :head].contiguous()
        return cls(qtype, tuple(ne), qs.view(torch.int8) if qtype == Q.Q8_0 else qs,
                   (d.view(torch.float16) if head == 2 else d).view(-1))

    def rows(self, ids: torch.Tensor) -> "Split":
        """Rows `ids` of a 2-D tensor."""
        per_row = self.ne[0] // 32
        n = ids.numel()
        return Split(self.qtype, (self.ne[0], n), self.qs.view(-1, per_row, self.qs.shape[1])[ids].view(-1, self.qs.shape[1]),
                     self.d.view(-1, per_row)[ids].view(-1))

    def row_block(self, first: int, count: int) -> "Split":
        """Rows first .. first + count of a 2-D tensor (a view)."""
        per_row = self.ne[0] // 32
        a, b = first * per_row, (first + count) * per_row
        return Split(self.qtype, (self.ne[0], count), self.qs[a:b], self.d[a:b])

    def expert(self, e: int) -> "Split":
        per = self.d.numel() // self.ne[2]
        return Split(self.qtype, self.ne[:2], self.qs[e * per:(e + 1) * per], self.d[e * per:(e + 1) * per])

    def floats(self, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
        """(reversed ne) values of `dtype`, each d * q rounded once, in one pass over the bytes (bf16 through
        float32: a store's own conversion to bf16 need not round to nearest)."""
        shape = tuple(reversed(self.ne))
        if dtype not in (torch.float16, torch.float32):
            floats = self.floats(torch.float32)
            return floats.to(dtype) if out is None else out.copy_(floats.view(out.shape))
        if out is None:
            out = torch.empty(shape, dtype=dtype, device=self.qs.device)
        n_blocks = self.d.numel()
        _split_floats[(triton.cdiv(n_blocks, 64),)](self.qs.contiguous(), self.d.contiguous(), out, n_blocks,
                                                     KIND=GEMV_KINDS[self.qtype], BLOCKS=64)
        return out


@dataclass
class Blocks:
    """Some experts of a stacked tensor of a type the split kernels do not read (K-quants, IQ4_XS...) on the GPU as
    their GGUF blocks, in the order they were copied: raw (flat uint8), ne (cols, rows, experts held). The few-token
    kernels of kquant.py read them in place; prompts expand them a projection at a time (floats)."""

    qtype: Q
    ne: tuple[int, ...]
    raw: torch.Tensor

    @property
    def parts(self) -> tuple:
        """(raw, qtype, ne): a tensor as kquant.py's kernels take it."""
        return self.raw, self.qtype, self.ne

    def floats(self, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
        """(reversed ne) values of `dtype` (in `out` when given)."""
        from ferry.kernels.cuda.dequant import dequantize

        return dequantize(self.raw, self.qtype, self.ne, dtype, out=out)
