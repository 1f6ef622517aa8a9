"""K-quant matrices (Q4_K, Q5_K, Q6_K: llama.cpp's Q4_K_M and Q5_K_M files) read in place: for few tokens the GEMV
and the routed experts' GEMVs (expert biases and every gated activation of moe.GLUS too) over their GGUF blocks as
they sit on the GPU, no expansion. A block's (256 columns') quants are dotted with x per sub-block and scaled once
per sub-block; Q4_K / Q5_K's minimum is the sub-block's sum of x times its scaled min. Without these a token
expanded every such weight it read to floats first (a whole layer's experts for the few it routes to). For many
tokens the routed experts' grouped GEMM (kmoe_mm, moe.moe_mm's on these blocks): each block expanded to f16 in
registers, no bfloat16 copy of a layer's experts. (MXFP4 is read in layout.Split, as Q4_0.)
ik_llama.cpp's IQ4_KS, IQ4_K, IQ5_KS, IQ3_KS, IQ2_KS, IQ4_KSS, IQ2_KL, IQ2_K and IQ3_K (routed experts kept in place)
go through the same kernels:
a block's two halves decoded through the type's value table (`lut`, dequant._table's), each value its sub-block's
integer scale times its table entry, the row's (or block's) d applied once; their rows may open with that d."""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from gguf.constants import GGMLQuantizationType as Q

from ferry.kernels.capabilities import can
from ferry.kernels.cuda.dequant import _f16_at, _k4_scale_min, _sizes, _table, _u16_at, _u32_at
from ferry.kernels.cuda.moe import _glu, _pair_rows, _store_tile, _tile, GLUS, sum_pairs
from ferry.quant import IkQuant, block_size

# the types these kernels read; 3 and up are ik_llama.cpp's (_ikhalf)
KINDS = {Q.Q4_K: 0, Q.Q5_K: 1, Q.Q6_K: 2, IkQuant.IQ4_KS: 3, IkQuant.IQ4_K: 4, IkQuant.IQ5_KS: 5,
         IkQuant.IQ3_KS: 6, IkQuant.IQ2_KS: 7, IkQuant.IQ4_KSS: 8, IkQuant.IQ2_KL: 9, IkQuant.IQ2_K: 10,
         IkQuant.IQ3_K: 11}


@triton.jit
def _kbase(row, b, K, KIND: tl.constexpr, BLOCK_BYTES: tl.constexpr):
    """The byte offset of block b (256 columns) of rows `row` (int64): IQ4_KS / IQ5_KS / IQ4_KSS rows open with a
    float32 d, IQ3_KS / IQ2_KS / IQ2_KL rows with an fp16 one, the others have no row metadata."""
    if KIND == 3 or KIND == 5 or KIND == 8:
        return row * (4 + (K // 256) * BLOCK_BYTES) + 4 + b * BLOCK_BYTES
    elif KIND == 6 or KIND == 7 or KIND == 9:
        return row * (2 + (K // 256) * BLOCK_BYTES) + 2 + b * BLOCK_BYTES
    else:
        return (row * (K // 256) + b) * BLOCK_BYTES


@triton.jit
def _ikd(w, row, base, K, m, KIND: tl.constexpr, BLOCK_BYTES: tl.constexpr):
    """An ik type's d for rows `row` (R, 1) int64 at their block's offsets `base`: the row's (IQ4_KS / IQ5_KS / IQ4_KSS
    float32, IQ3_KS / IQ2_KS / IQ2_KL fp16) or the block's (IQ4_K's, IQ2_K's, IQ3_K's fp16), float32 (R, 1)."""
    if KIND == 3 or KIND == 5 or KIND == 8:
        return _u32_at(w, row * (4 + (K // 256) * BLOCK_BYTES), m).to(tl.float32, bitcast=True)
    elif KIND == 6 or KIND == 7 or KIND == 9:
        return _f16_at(w, row * (2 + (K // 256) * BLOCK_BYTES), m)
    else:
        return _f16_at(w, base, m)


@triton.jit
def _spread(v, G: tl.constexpr):
    """(R, n) values of groups as (R, n G): each repeated over its group's G consecutive places."""
    return tl.reshape(tl.broadcast_to(v[:, :, None], (v.shape[0], v.shape[1], G)), (v.shape[0], v.shape[1] * G))


@triton.jit
def _ikhalf(w, base, m, lut, KIND: tl.constexpr, HIGH: tl.constexpr):
    """Half HIGH (0 or 1) of an ik_llama.cpp block's 256 values (its bytes at base (R, 1), rows masked by m), at
    _kcols' columns: (R, 128) float32, each value its sub-block's integer scale times its table entry (d apart).
    - IQ4_KS: 8 scale bytes S (s = (S & 254) - 127, table half S & 1), 128 bytes of nibbles: byte i holds values
      32 (i // 16) + i % 16 (low) and 16 further (high), sub-block i // 16.
    - IQ4_K: d, 16 bits of table halves (one a 16), 4 bytes of scale high pairs, 8 of scale low nibbles (s = ls - 32,
      a scale per 16: the low nibbles' 16 is 2 (i // 16), the high's one further), IQ4_KS's nibbles.
    - IQ5_KS: IQ4_KS's scale bytes; byte i of the nibbles holds values 64 (i // 32) + i % 32 (sub-block 2 (i // 32))
      and 32 further (the next), their fifth bits bit (sub-block) of byte 136 + i % 32; a 64-value table.
    - IQ3_KS / IQ2_KS: 16 bits of `extra` (fifth scale bits, table halves), 4 bytes of scale nibbles (s = ls - 16),
      64 of 2-bit indices (bits 2 (ib % 4) of byte 32 (ib // 4) + j for value j of sub-block ib), IQ3_KS's 32 of
      third bits (bit ib of byte j); half HIGH is sub-blocks 4 HIGH .. 4 HIGH + 3 (values 128 HIGH + i).
    - IQ4_KSS: IQ4_KS's scale bytes and nibbles folded into 16-bit words (sub-block ib's 8 words: bit 0 of word k its
      scale byte's bit k, the nibble bytes x ^ (x >> 1) of the words less that bit).
    - IQ2_KL: 16 bits of scale high pairs, 4 bytes of scale nibbles (s = ls - 32), 64 of index nibbles (byte j of group
      ib / 2: sub-block ib's index j, nibble ib % 2), 16 of fifth bits (bit ib of byte j); index j of a sub-block picks
      its values 2j and 2j + 1 from the 32 pairs (`lut` flat); halves as IQ3_KS's.
    - IQ2_K / IQ3_K: d, 16 bits of table halves (one a 16), IQ3_K's 16 scale signs, 8 scale bytes (a nibble a 16:
      IQ2_K's less 8, IQ3_K's n to 2n + 1 under its sign), then IQ2_KS's / IQ3_KS's indices and third bits; halves as
      IQ3_KS's."""
    i = tl.arange(0, 128)[None, :]
    if KIND == 10 or KIND == 11:
        at = 4 + 2 * (KIND - 10)  # the scale bytes
        c = i % 32
        q = (tl.load(w + base + at + 8 + 32 * HIGH + c, mask=m, other=0).to(tl.int32) >> (2 * (i // 32))) & 3
        extra = tl.load(w + base + 2, mask=m, other=0).to(tl.int32) | (
            tl.load(w + base + 3, mask=m, other=0).to(tl.int32) << 8)
        g = 8 * HIGH + tl.arange(0, 8)[None, :]  # (1, 8): this half's 16s
        nib = (tl.load(w + base + at + g // 2, mask=m, other=0).to(tl.int32) >> (4 * (g % 2))) & 0xF
        if KIND == 11:
            q = q | (((tl.load(w + base + 78 + c, mask=m, other=0).to(tl.int32) >> (4 * HIGH + i // 32)) & 1) << 2)
            sign = (_u16_at(w, base + 4, m) >> g) & 1
            s = (2 * nib + 1) * (1 - 2 * sign)
            idx = q + 8 * _spread((extra >> g) & 1, 16)
        else:
            s = nib - 8
            idx = q + 4 * _spread((extra >> g) & 1, 16)
        return _spread(s.to(tl.float32), 16) * tl.load(lut + idx)
    if KIND == 8:
        x = _u16_at(w, base + 2 * (i // 2), m) & 0xFFFE
        q = ((((x ^ (x >> 1)) >> (8 * (i % 2))) & 0xFF) >> (4 * HIGH)) & 0xF
        j = tl.arange(0, 8)[None, :]
        sb = tl.zeros_like(j) + tl.zeros_like(base)  # (R, 8)
        for k in tl.static_range(8):
            sb += (_u16_at(w, base + 16 * j + 2 * k, m) & 1) << k
        return _spread(((sb & 254) - 127).to(tl.float32), 16) * tl.load(lut + q + 16 * _spread(sb & 1, 16))
    elif KIND == 9:
        ib = 4 * HIGH + i // 32  # (1, 128)
        c = (i % 32) // 2
        q = (tl.load(w + base + 6 + 16 * (ib // 2) + c, mask=m, other=0).to(tl.int32) >> (4 * (ib % 2))) & 0xF
        q = q | (((tl.load(w + base + 70 + c, mask=m, other=0).to(tl.int32) >> ib) & 1) << 4)
        s4 = 4 * HIGH + tl.arange(0, 4)[None, :]  # (1, 4): this half's sub-blocks
        nib = (tl.load(w + base + 2 + s4 % 4, mask=m, other=0).to(tl.int32) >> (4 * (s4 // 4))) & 0xF
        ls = nib | (((_u16_at(w, base, m) >> (2 * s4)) & 3) << 4)
        return _spread((ls - 32).to(tl.float32), 32) * tl.load(lut + 2 * q + i % 2)
    elif KIND == 3 or KIND == 4:
        j = tl.arange(0, 8)[None, :]
        if KIND == 3:
            q = (tl.load(w + base + 8 + i, mask=m, other=0).to(tl.int32) >> (4 * HIGH)) & 0xF
            sb = tl.load(w + base + j, mask=m, other=0).to(tl.int32)  # (R, 8)
            s = (sb & 254) - 127
            half = sb & 1
        else:
            q = (tl.load(w + base + 16 + i, mask=m, other=0).to(tl.int32) >> (4 * HIGH)) & 0xF
            extra = tl.load(w + base + 2, mask=m, other=0).to(tl.int32) | (
                tl.load(w + base + 3, mask=m, other=0).to(tl.int32) << 8)
            low = (tl.load(w + base + 8 + j, mask=m, other=0).to(tl.int32) >> (4 * HIGH)) & 0xF
            high = (tl.load(w + base + 4 + j // 2, mask=m, other=0).to(tl.int32) >> (4 * (j % 2) + 2 * HIGH)) & 3
            s = (low | (high << 4)) - 32
            half = (extra >> (2 * j + HIGH)) & 1
        return _spread(s.to(tl.float32), 16) * tl.load(lut + q + 16 * _spread(half, 16))
    elif KIND == 5:
        byte = tl.load(w + base + 8 + i, mask=m, other=0).to(tl.int32)
        qh = tl.load(w + base + 136 + i % 32, mask=m, other=0).to(tl.int32)
        q = ((byte >> (4 * HIGH)) & 0xF) | (((qh >> (2 * (i // 32) + HIGH)) & 1) << 4)
        sb = tl.load(w + base + 2 * tl.arange(0, 4)[None, :] + HIGH, mask=m, other=0).to(tl.int32)  # (R, 4)
        return _spread(((sb & 254) - 127).to(tl.float32), 32) * tl.load(lut + q + 32 * _spread(sb & 1, 32))
    else:
        c = i % 32
        q = (tl.load(w + base + 6 + 32 * HIGH + c, mask=m, other=0).to(tl.int32) >> (2 * (i // 32))) & 3
        extra = tl.load(w + base, mask=m, other=0).to(tl.int32) | (
            tl.load(w + base + 1, mask=m, other=0).to(tl.int32) << 8)
        ib = 4 * HIGH + tl.arange(0, 4)[None, :]  # (1, 4): this half's sub-blocks
        if KIND == 6:
            q = q | (((tl.load(w + base + 70 + c, mask=m, other=0).to(tl.int32) >> (4 * HIGH + i // 32)) & 1) << 2)
            nib = (tl.load(w + base + 2 + ib % 4, mask=m, other=0).to(tl.int32) >> (4 * (ib // 4))) & 0xF
            s = (nib | (((extra >> ib) & 1) << 4)) - 16
            idx = q + 8 * _spread((extra >> (8 + ib)) & 1, 32)
        else:
            nib = (tl.load(w + base + 2 + ib // 2, mask=m, other=0).to(tl.int32) >> (4 * (ib % 2))) & 0xF
            s = (nib | (((extra >> (8 + ib)) & 1) << 4)) - 16
            idx = q + 4 * _spread((extra >> ib) & 1, 32)
        return _spread(s.to(tl.float32), 32) * tl.load(lut + idx)


@triton.jit
def _kquants(w, base, m, KIND: tl.constexpr):
    """A block's 256 quants (its GGUF bytes at base (R, 1), rows masked by m) as two (R, 128) int32 halves, the values
    at _kcols' columns (Q6_K's less 32). Q4_K: d, dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles;
    Q5_K: 32 bytes of high bits before the nibbles, value l of chunk c (64 values) taking bit 2c (low nibble's) or
    2c + 1 (high's) of qh[l]. Q6_K: ql (128 bytes), qh (64), 16 int8 scales, d; ql byte i's nibbles are values
    128 (i // 64) + i % 64 and 64 further, their top two bits in qh[32 (i // 64) + i % 32] at shift 0 / 2 (i % 64 < 32
    / >= 32) and 4 / 6."""
    i = tl.arange(0, 128)[None, :]
    if KIND < 2:
        byte = tl.load(w + base + 16 + 32 * KIND + i, mask=m, other=0).to(tl.int32)
        lo = byte & 0xF
        hi = byte >> 4
        if KIND == 1:
            qh = tl.load(w + base + 16 + i % 32, mask=m, other=0).to(tl.int32)
            lo += ((qh >> (2 * (i // 32))) & 1) << 4
            hi += ((qh >> (2 * (i // 32) + 1)) & 1) << 4
        return lo, hi
    else:
        byte = tl.load(w + base + i, mask=m, other=0).to(tl.int32)
        p = i % 64
        qh = tl.load(w + base + 128 + 32 * (i // 64) + p % 32, mask=m, other=0).to(tl.int32)
        shift = 2 * (p // 32)
        return (((byte & 0xF) | (((qh >> shift) & 3) << 4)) - 32,
                ((byte >> 4) | (((qh >> (shift + 4)) & 3) << 4)) - 32)


@triton.jit
def _k45_scales(w, base, m):
    """Q4_K / Q5_K: the 6-bit scales and mins (R, 4) of the sub-blocks of _kquants' low halves (0, 2, 4, 6) and high
    halves (1, 3, 5, 7), and d, dmin (R, 1) float32."""
    j = 2 * tl.arange(0, 4)[None, :]
    sc_e, mn_e = _k4_scale_min(w, base, j, m)
    sc_o, mn_o = _k4_scale_min(w, base, j + 1, m)
    return sc_e, mn_e, sc_o, mn_o, _f16_at(w, base, m), _f16_at(w, base + 2, m)


@triton.jit
def _q6k_scales(w, base, m):
    """Q6_K: the int8 scales (R, 8) of each group of 16 of _kquants' low and high halves (group g: half g // 4, scales
    8 (g // 4) + g % 4 and 4 further), and d (R, 1) float32."""
    g = tl.arange(0, 8)[None, :]
    s_lo = tl.load(w + base + 192 + g + 4 * (g // 4), mask=m, other=0).to(tl.int8, bitcast=True)
    s_hi = tl.load(w + base + 196 + g + 4 * (g // 4), mask=m, other=0).to(tl.int8, bitcast=True)
    return s_lo, s_hi, _f16_at(w, base + 208, m)


@triton.jit
def _kcols(KIND: tl.constexpr):
    """The columns within a block (256) of _kquants' (or _ikhalf's) two halves' values: Q4_K / Q5_K's (and IQ5_KS's)
    byte i holds in its nibbles values 64 (i // 32) + i % 32 and 32 further; Q6_K's ql byte i values
    128 (i // 64) + i % 64 and 64 further; IQ4_KS / IQ4_K / IQ4_KSS's 32 (i // 16) + i % 16 and 16 further;
    IQ3_KS / IQ2_KS / IQ2_KL's halves are the block's first and last 128."""
    i = tl.arange(0, 128)
    if KIND == 0 or KIND == 1 or KIND == 5:
        lo = 64 * (i // 32) + i % 32
        return lo, lo + 32
    elif KIND == 2:
        lo = 128 * (i // 64) + i % 64
        return lo, lo + 64
    elif KIND == 3 or KIND == 4 or KIND == 8:
        lo = 32 * (i // 16) + i % 16
        return lo, lo + 16
    else:
        return i, i + 128


@triton.jit
def _kdot(w, row, rmask, x, b, K, lut, KIND: tl.constexpr, BLOCK_BYTES: tl.constexpr):
    """Per row of `row` (BR,): block b (256 columns) of a K-quant matrix's rows (GGUF bytes, K columns a row) dotted
    with x there. It decodes the block inline, not through _kquants / _k45_scales / _q6k_scales as _kblock does: that
    form, compiled on the H100, failed one GEMV test (by its place in the run, Q6_K at 8 rows a program) and ran the
    attention's GEMVs at 39 against 13.5 us (2026-11-26; not understood)."""
    row2 = row.to(tl.int64)[:, None]
    base = _kbase(row2, b, K, KIND, BLOCK_BYTES)  # (BR, 1)
    m = rmask[:, None]
    i = tl.arange(0, 128)[None, :]  # a byte of the block's low quants
    c0 = b * 256
    if KIND >= 3:  # ik_llama.cpp's: each half's values scaled per sub-block, d once
        c_lo, c_hi = _kcols(KIND)
        dot = tl.sum(_ikhalf(w, base, m, lut, KIND, 0) * tl.load(x + c0 + c_lo)[None, :]
                     + _ikhalf(w, base, m, lut, KIND, 1) * tl.load(x + c0 + c_hi)[None, :], axis=1)
        return tl.reshape(_ikd(w, row2, base, K, m, KIND, BLOCK_BYTES), (row.shape[0],)) * dot
    elif KIND < 2:
        # Q4_K: d, dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles; Q5_K: 32 bytes of high bits
        # before the nibbles. Byte i: chunk i // 32 of 64 values, its low nibble value (i // 32) * 64 + i % 32 (sub-block
        # 2 * (i // 32)), its high nibble 32 further (sub-block 2 * (i // 32) + 1)
        byte = tl.load(w + base + 16 + 32 * KIND + i, mask=m, other=0).to(tl.int32)
        lo = byte & 0xF
        hi = byte >> 4
        chunk = i // 32
        if KIND == 1:  # value l of chunk c: bit 2c (low) or 2c + 1 (high) of qh[l]
            qh = tl.load(w + base + 16 + i % 32, mask=m, other=0).to(tl.int32)
            lo += ((qh >> (2 * chunk)) & 1) << 4
            hi += ((qh >> (2 * chunk + 1)) & 1) << 4
        col = c0 + chunk * 64 + i % 32
        xlo = tl.load(x + col)
        xhi = tl.load(x + col + 32)
        plo = tl.sum(tl.reshape(lo.to(tl.float32) * xlo, (lo.shape[0], 4, 32)), axis=2)  # (BR, 4): sub-blocks 0, 2, 4, 6
        phi = tl.sum(tl.reshape(hi.to(tl.float32) * xhi, (lo.shape[0], 4, 32)), axis=2)  # sub-blocks 1, 3, 5, 7
        slo = tl.sum(tl.reshape(xlo, (4, 32)), axis=1)[None, :]  # each sub-block's sum of x
        shi = tl.sum(tl.reshape(xhi, (4, 32)), axis=1)[None, :]
        j = 2 * tl.arange(0, 4)[None, :]
        sc_e, mn_e = _k4_scale_min(w, base, j, m)
        sc_o, mn_o = _k4_scale_min(w, base, j + 1, m)
        d = _f16_at(w, base, m)
        dmin = _f16_at(w, base + 2, m)
        dot = tl.sum(sc_e.to(tl.float32) * plo + sc_o.to(tl.float32) * phi, axis=1)
        mins = tl.sum(mn_e.to(tl.float32) * slo + mn_o.to(tl.float32) * shi, axis=1)
        return tl.reshape(d, (lo.shape[0],)) * dot - tl.reshape(dmin, (lo.shape[0],)) * mins
    else:
        # Q6_K: ql (128 bytes), qh (64), 16 int8 scales, d. Byte i of ql: half n = i // 64 of 128 values, p = i % 64;
        # its low nibble value 128n + p, its high one 128n + p + 64; their top two bits in qh[32n + p % 32] at
        # shift 0 / 2 (p < 32 / p >= 32) and 4 / 6; a value's scale is scales[its column in the block // 16]
        byte = tl.load(w + base + i, mask=m, other=0).to(tl.int32)
        half = i // 64
        p = i % 64
        qh = tl.load(w + base + 128 + 32 * half + p % 32, mask=m, other=0).to(tl.int32)
        shift = 2 * (p // 32)
        lo = ((byte & 0xF) | (((qh >> shift) & 3) << 4)) - 32
        hi = ((byte >> 4) | (((qh >> (shift + 4)) & 3) << 4)) - 32
        col = c0 + 128 * half + p
        plo = tl.sum(tl.reshape(lo.to(tl.float32) * tl.load(x + col), (lo.shape[0], 8, 16)), axis=2)  # (BR, 8)
        phi = tl.sum(tl.reshape(hi.to(tl.float32) * tl.load(x + col + 64), (lo.shape[0], 8, 16)), axis=2)
        g = tl.arange(0, 8)[None, :]  # group of 16 bytes: half g // 4, its scales 8 (g // 4) + g % 4 and + 4
        s_lo = tl.load(w + base + 192 + g + 4 * (g // 4), mask=m, other=0).to(tl.int8, bitcast=True)
        s_hi = tl.load(w + base + 196 + g + 4 * (g // 4), mask=m, other=0).to(tl.int8, bitcast=True)
        d = _f16_at(w, base + 208, m)
        dot = tl.sum(s_lo.to(tl.float32) * plo + s_hi.to(tl.float32) * phi, axis=1)
        return tl.reshape(d, (lo.shape[0],)) * dot


@triton.jit
def _kgemv(w, x, y, lut, rows, K, KIND: tl.constexpr, BLOCK_BYTES: tl.constexpr, BR: tl.constexpr):
    """y[t, r] = W[r, :] . x[t, :] for this program's rows; grid (row blocks, tokens)."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    t = tl.program_id(1).to(tl.int64)
    rmask = r < rows
    acc = tl.zeros((BR,), dtype=tl.float32)
    for b in range(0, K // 256):
        acc += _kdot(w, r, rmask, x + t * K, b, K, lut, KIND, BLOCK_BYTES)
    tl.store(y + t * rows + r, acc, mask=rmask)


@triton.jit
def _kmoe_gate_up(gw, uw, glut, ulut, gbias, ubias, x, ids, h, rows, K, n_used, GKIND: tl.constexpr, GBYTES: tl.constexpr,
                  UKIND: tl.constexpr, UBYTES: tl.constexpr, ACT: tl.constexpr, BIAS: tl.constexpr,
                  BR: tl.constexpr):
    """Pair p = (token p // n_used, expert ids[p]): h[p, r] = glu(gate_e[r] . x (+ its bias), up_e[r] . x (+ its
    bias)); an id of -1 (the expert elsewhere) reads nothing and gives zeros."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    p = tl.program_id(1).to(tl.int64)
    rmask = r < rows
    row, live = _pair_rows(ids, p, r, rmask, rows)
    xt = x + (p // n_used) * K
    g = tl.zeros((BR,), dtype=tl.float32)
    u = tl.zeros((BR,), dtype=tl.float32)
    for b in range(0, K // 256):
        g += _kdot(gw, row, live, xt, b, K, glut, GKIND, GBYTES)
        u += _kdot(uw, row, live, xt, b, K, ulut, UKIND, UBYTES)
    if BIAS:
        g += tl.load(gbias + row, mask=live, other=0.0)
        u += tl.load(ubias + row, mask=live, other=0.0)
    tl.store(h + p * rows + r, _glu(g, u, ACT), mask=rmask)


@triton.jit
def _kmoe_down(dw, dlut, dbias, h, ids, weights, y, rows, K, KIND: tl.constexpr, BLOCK_BYTES: tl.constexpr,
               BIAS: tl.constexpr, BR: tl.constexpr):
    """Pair p: y[p, r] = weights[p] * (down_e[r] . h[p] (+ its bias)); an id of -1 gives zeros."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    p = tl.program_id(1).to(tl.int64)
    rmask = r < rows
    row, live = _pair_rows(ids, p, r, rmask, rows)
    acc = tl.zeros((BR,), dtype=tl.float32)
    for b in range(0, K // 256):
        acc += _kdot(dw, row, live, h + p * K, b, K, dlut, KIND, BLOCK_BYTES)
    if BIAS:
        acc += tl.load(dbias + row, mask=live, other=0.0)
    tl.store(y + p * rows + r, tl.load(weights + p) * acc, mask=rmask)


@triton.jit
def _kblock(w, wrow, nmask, b, K, lut, KIND: tl.constexpr, BLOCK_BYTES: tl.constexpr, BN: tl.constexpr):
    """Block b (256 columns) of the rows wrow (BN, 1) of a K-quant matrix (GGUF bytes, K columns a row) as two (BN, 128)
    f16 halves, the values at _kcols' columns: each its sub-block's scale times its quant (less the scaled min for
    Q4_K / Q5_K), in float32, rounded once. Every byte of the block's quants read once, its scales once."""
    row = wrow.to(tl.int64)
    base = _kbase(row, b, K, KIND, BLOCK_BYTES)  # (BN, 1)
    m = nmask[:, None]
    if KIND >= 3:
        d = _ikd(w, row, base, K, m, KIND, BLOCK_BYTES)
        return ((d * _ikhalf(w, base, m, lut, KIND, 0)).to(tl.float16),
                (d * _ikhalf(w, base, m, lut, KIND, 1)).to(tl.float16))
    lo, hi = _kquants(w, base, m, KIND)
    if KIND < 2:
        sc_e, mn_e, sc_o, mn_o, d, dmin = _k45_scales(w, base, m)
        s_lo = tl.reshape(tl.broadcast_to((d * sc_e.to(tl.float32))[:, :, None], (BN, 4, 32)), (BN, 128))
        s_hi = tl.reshape(tl.broadcast_to((d * sc_o.to(tl.float32))[:, :, None], (BN, 4, 32)), (BN, 128))
        m_lo = tl.reshape(tl.broadcast_to((dmin * mn_e.to(tl.float32))[:, :, None], (BN, 4, 32)), (BN, 128))
        m_hi = tl.reshape(tl.broadcast_to((dmin * mn_o.to(tl.float32))[:, :, None], (BN, 4, 32)), (BN, 128))
        return ((s_lo * lo.to(tl.float32) - m_lo).to(tl.float16), (s_hi * hi.to(tl.float32) - m_hi).to(tl.float16))
    else:
        sl, sh, d = _q6k_scales(w, base, m)
        s_lo = tl.reshape(tl.broadcast_to((d * sl.to(tl.float32))[:, :, None], (BN, 8, 16)), (BN, 128))
        s_hi = tl.reshape(tl.broadcast_to((d * sh.to(tl.float32))[:, :, None], (BN, 8, 16)), (BN, 128))
        return (s_lo * lo.to(tl.float32)).to(tl.float16), (s_hi * hi.to(tl.float32)).to(tl.float16)


@triton.jit
def _kmoe_mm(x, w, uw, lut, ulut, y, tile_expert, tile_row, tile_end, src, dst, scale, N, K, KIND: tl.constexpr,
             BLOCK_BYTES: tl.constexpr, UKIND: tl.constexpr, UBYTES: tl.constexpr, GATED: tl.constexpr,
             ACT: tl.constexpr, GATHER: tl.constexpr, SCATTER: tl.constexpr, SCALE: tl.constexpr, BM: tl.constexpr,
             BN: tl.constexpr):
    """moe._moe_mm's grouped GEMM over rows sorted by expert, on K-quant experts read in their GGUF blocks: tile i
    covers sorted rows tile_row[i] .. tile_end[i] of expert tile_expert[i] (-1: no work); each block (256 columns) of
    W_e expanded to f16 in registers as two halves (_kblock) that meet the matching columns of x, f32 accumulation on
    tensor cores. GATED: W the gate, uw the up projection (of its own K-quant type), the output act(x . gate) *
    (x . up). GATHER / SCATTER / SCALE as _moe_mm's."""
    tile = tl.program_id(0)
    e = tl.load(tile_expert + tile)
    if e >= 0:
        rows, rmask, n, nmask, wrow, x_rows = _tile(tile_row, tile_end, tile, e, src, N, GATHER, BM, BN)
        xr = x + x_rows.to(tl.int64)[:, None] * K
        c_lo, c_hi = _kcols(KIND)
        u_lo, u_hi = _kcols(UKIND)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        acc_up = tl.zeros((BM, BN), dtype=tl.float32)
        for b in range(0, K // 256):
            a_lo = tl.load(xr + b * 256 + c_lo[None, :], mask=rmask[:, None], other=0.0)
            a_hi = tl.load(xr + b * 256 + c_hi[None, :], mask=rmask[:, None], other=0.0)
            w_lo, w_hi = _kblock(w, wrow, nmask, b, K, lut, KIND, BLOCK_BYTES, BN)
            acc = tl.dot(a_lo, tl.trans(w_lo), acc)
            acc = tl.dot(a_hi, tl.trans(w_hi), acc)
            if GATED:
                if UKIND != KIND:  # another layout of the block's values: their own columns of x
                    a_lo = tl.load(xr + b * 256 + u_lo[None, :], mask=rmask[:, None], other=0.0)
                    a_hi = tl.load(xr + b * 256 + u_hi[None, :], mask=rmask[:, None], other=0.0)
                v_lo, v_hi = _kblock(uw, wrow, nmask, b, K, ulut, UKIND, UBYTES, BN)
                acc_up = tl.dot(a_lo, tl.trans(v_lo), acc_up)
                acc_up = tl.dot(a_hi, tl.trans(v_hi), acc_up)
        if GATED:
            acc = _glu(acc, acc_up, ACT)
        _store_tile(y, dst, scale, acc, rows, rmask, n, nmask, N, SCATTER, SCALE)


def reads(qtype: Q, ne: tuple[int, ...]) -> bool:
    """Whether these kernels read a tensor of this type and shape (capabilities' gpu_token types, whole blocks)."""
    return can(qtype).gpu_token and ne[0] % block_size(qtype) == 0


def _args(qtype: Q, device) -> tuple[int, int, torch.Tensor | None]:
    """(kind, bytes a block, the value table of an ik type or None)."""
    return KINDS[qtype], _sizes(qtype)[1], _table(qtype, device) if isinstance(qtype, IkQuant) else None


def _or(table: torch.Tensor | None, other: torch.Tensor) -> torch.Tensor:
    """The value table, or any tensor where the type has none (the kernels do not read it then)."""
    return table if table is not None else other


# One warp a program reads fastest on the H100 (benchmarks/gemv_kernels.py --only kquant; docs/performance.md, "K-quant
# GEMVs tuned"): a row a program for the attention's matrices (13.5 against 31.7 us with 4 rows and 4 warps at
# 4096x2048), 8 for an output matrix's 151936 rows (141 against 839 us). The experts: 8 rows, replayed in CUDA graphs
# on an H200 as decode runs them (Qwen3-30B-A3B's Q4_K_M experts 31.1 against 34.6 us with 4, all-Q4_K 25.8 against
# 34.3; --graphs, 2026-11-29). The defaults below are read at each call (the GPU tests under the interpreter widen
# them: fewer programs to step through)
ROWS, BIG_ROWS, ROWS_BIG, MOE_ROWS = 1, 65536, 8, 8


def kgemv(raw: torch.Tensor, qtype: Q, ne: tuple[int, ...], x: torch.Tensor, rows_per_program: int = 0,
          warps: int = 1) -> torch.Tensor:
    """x (n, cols) times the (rows, cols) K-quant matrix (its GGUF bytes on the GPU) transposed: (n, rows)
    float32. rows_per_program 0: ROWS_BIG for matrices of BIG_ROWS rows or more, else ROWS."""
    cols, rows = ne[0], ne[1]
    rows_per_program = rows_per_program or (ROWS_BIG if rows >= BIG_ROWS else ROWS)
    x = x.float().contiguous()
    y = torch.empty(x.shape[0], rows, dtype=torch.float32, device=x.device)
    kind, size, lut = _args(qtype, raw.device)
    _kgemv[(triton.cdiv(rows, rows_per_program), x.shape[0])](raw, x, y, _or(lut, x), rows, cols,
                                                              KIND=kind, BLOCK_BYTES=size, BR=rows_per_program,
                                                              num_warps=warps)
    return y


def kmoe_gemv(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate, up, down, act: str,
              residual: torch.Tensor | None = None, rows_per_program: int = 0, warps: int = 1,
              biases: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
              wait_down: torch.cuda.Event | None = None, pairs: bool = False) -> torch.Tensor:
    """The routed experts of few tokens, their stacked tensors read in place: x (n, n_embd), ids / weights
    (n, n_used) on the GPU (an id of -1: a pair left out, zeros); gate / up / down (GGUF bytes on the GPU, quant
    type, ne); act a name of moe.GLUS; biases: gate's, up's and down's (n_expert, rows) float32 on the GPU, or None.
    Returns (n, n_embd) float32, plus `residual` when given, each token's pairs summed in a fixed order; or with
    `pairs` each pair's weighted output, (n * n_used, n_embd) in pair order. wait_down: an event the down projection
    waits for (its weights still being copied). rows_per_program 0: MOE_ROWS."""
    rows_per_program = rows_per_program or MOE_ROWS
    (gw, gq, gne), (uw, uq, _), (dw, dq, dne) = gate, up, down
    n, n_used = ids.shape
    n_embd, n_ff = gne[0], gne[1]
    x = x.float().contiguous()
    ids = ids.to(torch.int32).contiguous()
    h = torch.empty(n * n_used, n_ff, dtype=torch.float32, device=x.device)
    gk, gb, glut = _args(gq, x.device)
    uk, ub, ulut = _args(uq, x.device)
    gbias, ubias, dbias = (b.float().contiguous() for b in biases) if biases is not None else (x, x, x)
    _kmoe_gate_up[(triton.cdiv(n_ff, rows_per_program), n * n_used)](
        gw, uw, _or(glut, x), _or(ulut, x), gbias, ubias, x, ids, h, n_ff, n_embd, n_used, GKIND=gk, GBYTES=gb,
        UKIND=uk, UBYTES=ub,
        ACT=GLUS[act], BIAS=biases is not None, BR=rows_per_program, num_warps=warps)
    y = torch.empty(n * n_used, dne[1], dtype=torch.float32, device=x.device)
    if wait_down is not None:
        torch.cuda.current_stream(x.device).wait_event(wait_down)
    dk, db, dlut = _args(dq, x.device)
    _kmoe_down[(triton.cdiv(dne[1], rows_per_program), n * n_used)](
        dw, _or(dlut, x), dbias, h, ids, weights.float().contiguous(), y, dne[1], dne[0], KIND=dk, BLOCK_BYTES=db,
        BIAS=biases is not None, BR=rows_per_program, num_warps=warps)
    if pairs or (n_used == 1 and residual is None):
        return y
    return sum_pairs(y, n_used, residual)


# (BN, warps, stages) of the K-quant grouped GEMM per (tile height (moe.moe_tile_rows), gated): the fastest of a sweep
# on an H100 at Qwen3-30B-A3B's and DeepSeek-V2-Lite's expert shapes, Q4_K gate and up, Q6_K down (benchmarks/
# moe_kernels.py --kquant; docs/performance.md, 2026-11-26). Three stages of a gated Q4_K / Q6_K pair at 64 rows
# need more shared memory than the H100 has
KMOE_MM_CONFIGS = {(16, True): (64, 4, 2), (16, False): (32, 4, 1), (32, True): (64, 4, 1), (32, False): (64, 4, 1),
                   (64, True): (64, 4, 2), (64, False): (64, 4, 2), (128, True): (128, 8, 2), (128, False): (128, 8, 1)}


def kmoe_mm(xs: torch.Tensor, w, sched, out_dtype, block: int, up=None, act: str = "silu",
            rows_from: torch.Tensor | None = None, rows_to: torch.Tensor | None = None,
            row_scale: torch.Tensor | None = None, out: torch.Tensor | None = None,
            config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """moe.moe_mm on K-quant experts in their GGUF blocks: w (and `up`) (bytes on the GPU, quant type, ne); xs
    (pairs, cols) f16; sched moe.moe_tiles'; the rest as moe_mm's (no biases). config: (BN, warps, stages), else
    KMOE_MM_CONFIGS'."""
    raw, qtype, (cols, rows, _) = w
    _, tile_expert, tile_row, tile_end = sched
    pairs = tile_row.new_empty(0) if rows_from is None else rows_from
    y = out if out is not None else torch.empty(xs.shape[0] if rows_from is None else rows_from.shape[0], rows,
                                                dtype=out_dtype, device=xs.device)
    kind, size, lut = _args(qtype, xs.device)
    bn, warps, stages = config or KMOE_MM_CONFIGS[block, up is not None]
    if config is None and lut is not None:  # the table's gathers, pipelined, overflow shared memory (295 of 227 KiB)
        stages = 1
    ukind, usize, ulut = _args(up[1], xs.device) if up is not None else (kind, size, lut)
    _kmoe_mm[(tile_expert.numel(), triton.cdiv(rows, bn))](
        xs, raw, up[0] if up is not None else raw, _or(lut, xs), _or(ulut, xs), y, tile_expert, tile_row, tile_end, pairs,
        rows_to if rows_to is not None else pairs, row_scale if row_scale is not None else y, rows, cols, KIND=kind,
        BLOCK_BYTES=size, UKIND=ukind, UBYTES=usize, GATED=up is not None, ACT=GLUS[act], GATHER=rows_from is not None,
        SCATTER=rows_to is not None, SCALE=row_scale is not None, BM=block, BN=bn, num_warps=warps, num_stages=stages)
    return y
