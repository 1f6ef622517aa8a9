"""GGUF blocks dequantized on the GPU by Triton kernels, one program per group of blocks, the raw bytes read
as they sit in the file (weights stay in their quant format on the GPU; this expands them where a kernel
needs floats, e.g. into a reused bf16 scratch before cuBLAS)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as Q

from ferry.quant import IK_TYPES, IQ2KL_PAIRS, IQ2NL_VALUES, IQ3NL_VALUES, IQ4K_VALUES, IQ5NL_VALUES, IkQuant

_BLOCKS = 64  # quant blocks per program


@triton.jit
def _f16_at(src, base, mask):
    """The little-endian float16 at byte offsets `base`, as float32."""
    lo = tl.load(src + base, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(src + base + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _u16_at(src, base, mask):
    """The little-endian uint16 at byte offsets `base`, as int32."""
    return tl.load(src + base, mask=mask, other=0).to(tl.int32) | (tl.load(src + base + 1, mask=mask, other=0).to(tl.int32) << 8)


@triton.jit
def _u32_at(src, base, mask):
    b0 = tl.load(src + base, mask=mask, other=0).to(tl.uint32)
    b1 = tl.load(src + base + 1, mask=mask, other=0).to(tl.uint32)
    b2 = tl.load(src + base + 2, mask=mask, other=0).to(tl.uint32)
    b3 = tl.load(src + base + 3, mask=mask, other=0).to(tl.uint32)
    return b0 | (b1 << 8) | (b2 << 16) | (b3 << 24)


@triton.jit
def _k4_scale_min(src, base, j, mask):
    """Q4_K / Q5_K: sub-block j's 6-bit scale and min from the 12 bytes at base + 4 (j < 4: low 6 bits of
    bytes j and j + 4; j >= 4: nibbles of byte j + 4 with the top 2 bits of bytes j - 4 and j)."""
    s_j = tl.load(src + base + 4 + j, mask=mask, other=0).to(tl.int32)
    s_j4 = tl.load(src + base + 8 + (j % 4), mask=mask, other=0).to(tl.int32)  # scales[j + 4] for j < 4
    s_hi = tl.load(src + base + 8 + j, mask=mask & (j >= 4), other=0).to(tl.int32)  # scales[j + 4] for j >= 4
    s_lo = tl.load(src + base + 4 + (j % 4), mask=mask, other=0).to(tl.int32)  # scales[j - 4] for j >= 4
    sc = tl.where(j < 4, s_j & 63, (s_hi & 0xF) | ((s_lo >> 6) << 4))
    mn = tl.where(j < 4, s_j4 & 63, (s_hi >> 4) | ((s_j >> 6) << 4))
    return sc, mn


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


@triton.jit
def _dequant_lut(src, dst, lut, n_blocks, per_row, KIND: tl.constexpr, VALUES: tl.constexpr, BLOCK_BYTES: tl.constexpr,
                 BLOCKS: tl.constexpr, ROW_META: tl.constexpr):
    """The K-quants (256 values, sub-block scales) and the table types IQ4_XS, IQ4_NL, MXFP4 (`lut`: 16 floats) and
    ik_llama.cpp's IQ4_KS, IQ4_KSS and IQ4_K (`lut`: IQ4K's 32), IQ3_KS / IQ3_K and IQ2_KS / IQ2_K (IQ3NL's 16, IQ2NL's
    8), IQ5_KS (IQ5NL's 64), IQ2_KL (its 32 pairs, 64 values); ROW_META bytes of
    row scale before each row's per_row blocks."""
    b = tl.program_id(0) * BLOCKS + tl.arange(0, BLOCKS)
    live = b < n_blocks
    m2 = live[:, None]
    if ROW_META:
        row = b.to(tl.int64) // per_row
        row_start = row * (ROW_META + per_row * BLOCK_BYTES)
        base1 = row_start + ROW_META + (b.to(tl.int64) % per_row) * BLOCK_BYTES
    else:
        base1 = b.to(tl.int64) * BLOCK_BYTES
    base = base1[:, None]
    i = tl.arange(0, VALUES)[None, :]
    if KIND == 0:  # Q4_K: d, dmin, 12 bytes of 6-bit scales and mins for 8 sub-blocks, 128 bytes of nibbles
        d = _f16_at(src, base1, live)[:, None]
        dmin = _f16_at(src, base1 + 2, live)[:, None]
        j = i // 32
        sc, mn = _k4_scale_min(src, base, j, m2)
        w = i % 64
        byte = tl.load(src + base + 16 + (i // 64) * 32 + (w % 32), mask=m2, other=0).to(tl.int32)
        q = tl.where(w < 32, byte & 0xF, byte >> 4)
        out = d * sc.to(tl.float32) * q.to(tl.float32) - dmin * mn.to(tl.float32)
    elif KIND == 5:  # Q5_K: Q4_K's scales, then 32 bytes of fifth bits (bit j of byte l: sub-block j), nibbles
        d = _f16_at(src, base1, live)[:, None]
        dmin = _f16_at(src, base1 + 2, live)[:, None]
        j = i // 32
        sc, mn = _k4_scale_min(src, base, j, m2)
        w = i % 64
        byte = tl.load(src + base + 48 + (i // 64) * 32 + (w % 32), mask=m2, other=0).to(tl.int32)
        high = (tl.load(src + base + 16 + (i % 32), mask=m2, other=0).to(tl.int32) >> j) & 1
        q = tl.where(w < 32, byte & 0xF, byte >> 4) | (high << 4)
        out = d * sc.to(tl.float32) * q.to(tl.float32) - dmin * mn.to(tl.float32)
    elif KIND == 6:  # Q2_K: 16 bytes of 4-bit scale/min pairs, 64 bytes of 2-bit values, d, dmin
        d = _f16_at(src, base1 + 80, live)[:, None]
        dmin = _f16_at(src, base1 + 82, live)[:, None]
        n = i // 128
        r = i % 128
        jj = r // 32
        w = r % 32
        q = (tl.load(src + base + 16 + n * 32 + w, mask=m2, other=0).to(tl.int32) >> (2 * jj)) & 3
        sc = tl.load(src + base + n * 8 + jj * 2 + w // 16, mask=m2, other=0).to(tl.int32)
        out = d * (sc & 0xF).to(tl.float32) * q.to(tl.float32) - dmin * (sc >> 4).to(tl.float32)
    elif KIND == 7:  # Q3_K: 32 bytes of high-bit masks, 64 bytes of 2-bit values, 12 bytes of 6-bit scales, d
        d = _f16_at(src, base1 + 108, live)[:, None]
        n = i // 128
        r = i % 128
        jj = r // 32
        w = r % 32
        q = (tl.load(src + base + 32 + n * 32 + w, mask=m2, other=0).to(tl.int32) >> (2 * jj)) & 3
        hm = (tl.load(src + base + w, mask=m2, other=0).to(tl.int32) >> (4 * n + jj)) & 1
        k = n * 8 + jj * 2 + w // 16  # which of the 16 scales
        grp = k // 4
        raw_lo = tl.load(src + base + 96 + tl.where(grp < 2, k, k - 8), mask=m2, other=0).to(tl.int32)
        low4 = tl.where(grp < 2, raw_lo & 0xF, raw_lo >> 4)
        high2 = (tl.load(src + base + 104 + (k % 4), mask=m2, other=0).to(tl.int32) >> (2 * grp)) & 3
        sc = (low4 | (high2 << 4)) - 32
        out = d * sc.to(tl.float32) * (q - 4 * (1 - hm)).to(tl.float32)
    elif KIND == 1:  # Q6_K: 128 bytes low nibbles, 64 bytes of 2-bit highs, 16 int8 scales, d
        d = _f16_at(src, base1 + 208, live)[:, None]
        h = i // 128
        r = i % 128
        qq = r // 32
        ll = r % 32
        lo = tl.load(src + base + h * 64 + ll + 32 * (qq % 2), mask=m2, other=0).to(tl.int32)
        lo = tl.where(qq < 2, lo & 0xF, lo >> 4)
        hi = (tl.load(src + base + 128 + h * 32 + ll, mask=m2, other=0).to(tl.int32) >> (2 * qq)) & 3
        sc = tl.load(src + base + 192 + h * 8 + ll // 16 + 2 * qq, mask=m2, other=0).to(tl.int8, bitcast=True)
        out = d * sc.to(tl.float32) * ((lo | (hi << 4)) - 32).to(tl.float32)
    elif KIND == 8:  # IQ4_KS: the row's float32 d; 8 scale bytes S (s = (S & 254) - 127, table half S & 1), nibbles
        d = _u32_at(src, row_start, live).to(tl.float32, bitcast=True)[:, None]
        ib = i // 32
        w = i % 32
        sb = tl.load(src + base + ib, mask=m2, other=0).to(tl.int32)
        byte = tl.load(src + base + 8 + ib * 16 + (w % 16), mask=m2, other=0).to(tl.int32)
        idx = tl.where(w < 16, byte & 0xF, byte >> 4) + 16 * (sb & 1)
        out = d * ((sb & 254) - 127).to(tl.float32) * tl.load(lut + idx)
    elif KIND == 12:  # IQ5_KS: the row's float32 d; 8 scale bytes S (as IQ4_KS), nibbles (byte j of group ib / 2:
        # nibble ib % 2), fifth bits (bit ib of byte j of the 32 after)
        d = _u32_at(src, row_start, live).to(tl.float32, bitcast=True)[:, None]
        ib = i // 32
        w = i % 32
        sb = tl.load(src + base + ib, mask=m2, other=0).to(tl.int32)
        lo = (tl.load(src + base + 8 + 32 * (ib // 2) + w, mask=m2, other=0).to(tl.int32) >> (4 * (ib % 2))) & 0xF
        hi = (tl.load(src + base + 136 + w, mask=m2, other=0).to(tl.int32) >> ib) & 1
        out = d * ((sb & 254) - 127).to(tl.float32) * tl.load(lut + (lo | (hi << 4)) + 32 * (sb & 1))
    elif KIND == 9:  # IQ4_K: d, 16 bits of table halves (one a 16), 4 bytes of scale high pairs, 8 of low nibbles
        d = _f16_at(src, base1, live)[:, None]
        ib = i // 32
        w = i % 32
        k = i // 16
        extra = tl.load(src + base + 2, mask=m2, other=0).to(tl.int32) | (
            tl.load(src + base + 3, mask=m2, other=0).to(tl.int32) << 8)
        high = (tl.load(src + base + 4 + ib // 2, mask=m2, other=0).to(tl.int32) >> (4 * (ib % 2) + 2 * (k % 2))) & 3
        low = (tl.load(src + base + 8 + ib, mask=m2, other=0).to(tl.int32) >> (4 * (k % 2))) & 0xF
        byte = tl.load(src + base + 16 + ib * 16 + (w % 16), mask=m2, other=0).to(tl.int32)
        idx = tl.where(w < 16, byte & 0xF, byte >> 4) + 16 * ((extra >> k) & 1)
        out = d * ((low | (high << 4)) - 32).to(tl.float32) * tl.load(lut + idx)
    elif KIND == 10 or KIND == 11:  # IQ3_KS / IQ2_KS: the row's fp16 d; 16 bits of fifth scale bits and table
        # halves, 4 bytes of scale nibbles, 64 of 2-bit indices (bits 2 (ib % 4) of byte j of group ib / 4), IQ3_KS's
        # 32 of third bits (bit ib of byte j)
        d = _f16_at(src, row_start, live)[:, None]
        ib = i // 32
        w = i % 32
        extra = tl.load(src + base, mask=m2, other=0).to(tl.int32) | (
            tl.load(src + base + 1, mask=m2, other=0).to(tl.int32) << 8)
        q = (tl.load(src + base + 6 + 32 * (ib // 4) + w, mask=m2, other=0).to(tl.int32) >> (2 * (ib % 4))) & 3
        if KIND == 10:
            nib = (tl.load(src + base + 2 + ib % 4, mask=m2, other=0).to(tl.int32) >> (4 * (ib // 4))) & 0xF
            ls = nib | (((extra >> ib) & 1) << 4)
            q = q | (((tl.load(src + base + 70 + w, mask=m2, other=0).to(tl.int32) >> ib) & 1) << 2)
            idx = q + 8 * ((extra >> (8 + ib)) & 1)
        else:
            nib = (tl.load(src + base + 2 + ib // 2, mask=m2, other=0).to(tl.int32) >> (4 * (ib % 2))) & 0xF
            ls = nib | (((extra >> (8 + ib)) & 1) << 4)
            idx = q + 4 * ((extra >> ib) & 1)
        out = d * (ls - 16).to(tl.float32) * tl.load(lut + idx)
    elif KIND == 13:  # IQ4_KSS: the row's float32 d; IQ4_KS's scale bytes and nibbles folded into 16-bit words: sub-block
        # ib's 8 words hold its scale byte S's bit k in word k's bit 0, and its 16 nibble bytes as x ^ (x >> 1) of the
        # words less that bit
        d = _u32_at(src, row_start, live).to(tl.float32, bitcast=True)[:, None]
        ib = i // 32
        w = i % 32
        word = _u16_at(src, base + 16 * ib + 2 * ((w % 16) // 2), m2)
        x = word & 0xFFFE
        byte = ((x ^ (x >> 1)) >> (8 * (w % 2))) & 0xFF
        sb = tl.zeros_like(word)
        for k in tl.static_range(8):
            sb += (_u16_at(src, base + 16 * ib + 2 * k, m2) & 1) << k
        idx = tl.where(w < 16, byte & 0xF, byte >> 4) + 16 * (sb & 1)
        out = d * ((sb & 254) - 127).to(tl.float32) * tl.load(lut + idx)
    elif KIND == 14:  # IQ2_KL: the row's fp16 d; 16 bits of scale high pairs, 4 bytes of scale nibbles, 64 of index
        # nibbles (byte j of group s / 2: sub-block s's index j, nibble s % 2), 16 of fifth bits (bit s of byte j); index
        # j of a sub-block gives its values 2j and 2j + 1 (`lut`: the 32 pairs, flat)
        d = _f16_at(src, row_start, live)[:, None]
        s = i // 32
        j = (i % 32) // 2
        high = _u16_at(src, base, m2)
        nib = (tl.load(src + base + 2 + s % 4, mask=m2, other=0).to(tl.int32) >> (4 * (s // 4))) & 0xF
        ls = nib | (((high >> (2 * s)) & 3) << 4)
        q = (tl.load(src + base + 6 + 16 * (s // 2) + j, mask=m2, other=0).to(tl.int32) >> (4 * (s % 2))) & 0xF
        q = q | (((tl.load(src + base + 70 + j, mask=m2, other=0).to(tl.int32) >> s) & 1) << 4)
        out = d * (ls - 32).to(tl.float32) * tl.load(lut + 2 * q + i % 2)
    elif KIND == 15 or KIND == 16:  # IQ2_K / IQ3_K: d, 16 bits of table halves (one a 16); IQ3_K's 16 scale signs;
        # 8 scale bytes (a nibble a 16: IQ2_K's less 8, IQ3_K's n to 2n + 1 under its sign); IQ2_KS's / IQ3_KS's 2-bit
        # indices (and third bits)
        d = _f16_at(src, base1, live)[:, None]
        ib = i // 32
        w = i % 32
        k = i // 16
        extra = _u16_at(src, base + 2, m2)
        at = 4 + 2 * (KIND - 15)  # the scale bytes
        nib = (tl.load(src + base + at + ib, mask=m2, other=0).to(tl.int32) >> (4 * (k % 2))) & 0xF
        q = (tl.load(src + base + at + 8 + 32 * (ib // 4) + w, mask=m2, other=0).to(tl.int32) >> (2 * (ib % 4))) & 3
        if KIND == 16:
            q = q | (((tl.load(src + base + 78 + w, mask=m2, other=0).to(tl.int32) >> ib) & 1) << 2)
            sign = (_u16_at(src, base + 4, m2) >> k) & 1
            sc = (2 * nib + 1) * (1 - 2 * sign)
            idx = q + 8 * ((extra >> k) & 1)
        else:
            sc = nib - 8
            idx = q + 4 * ((extra >> k) & 1)
        out = d * sc.to(tl.float32) * tl.load(lut + idx)
    elif KIND == 2:  # IQ4_XS: d, 16 bits of scale highs, 4 bytes of scale lows, 128 bytes of table indices
        d = _f16_at(src, base1, live)[:, None]
        ib = i // 32
        w = i % 32
        sh = tl.load(src + base + 2, mask=m2, other=0).to(tl.int32) | (
            tl.load(src + base + 3, mask=m2, other=0).to(tl.int32) << 8)
        sl = tl.load(src + base + 4 + ib // 2, mask=m2, other=0).to(tl.int32)
        ls = ((sl >> (4 * (ib % 2))) & 0xF) | (((sh >> (2 * ib)) & 3) << 4)
        byte = tl.load(src + base + 8 + ib * 16 + (w % 16), mask=m2, other=0).to(tl.int32)
        idx = tl.where(w < 16, byte & 0xF, byte >> 4)
        out = d * (ls - 32).to(tl.float32) * tl.load(lut + idx)
    else:  # IQ4_NL (d) and MXFP4 (E8M0 exponent): 16 bytes of table indices, Q4_0's nibble order
        if KIND == 3:
            scale = _f16_at(src, base1, live)[:, None]
            qs = base + 2
        else:
            e = tl.load(src + base, mask=m2, other=0).to(tl.float32)
            scale = tl.exp2(e - 128.0)  # 2^(e - 127), halved: the table holds doubled e2m1 values
            qs = base + 1
        byte = tl.load(src + qs + (i % 16), mask=m2, other=0).to(tl.int32)
        idx = tl.where(i < 16, byte & 0xF, byte >> 4)
        out = scale * tl.load(lut + idx)
    tl.store(dst + b.to(tl.int64)[:, None] * VALUES + i, out.to(dst.dtype.element_ty), mask=m2)


_LEGACY = {Q.Q8_0: 0, Q.Q4_0: 1, Q.Q4_1: 2, Q.Q5_0: 3, Q.Q5_1: 4}
_LUT_KINDS = {Q.Q4_K: 0, Q.Q6_K: 1, Q.IQ4_XS: 2, Q.IQ4_NL: 3, Q.MXFP4: 4, Q.Q5_K: 5, Q.Q2_K: 6, Q.Q3_K: 7,
              IkQuant.IQ4_KS: 8, IkQuant.IQ4_K: 9, IkQuant.IQ3_KS: 10, IkQuant.IQ2_KS: 11, IkQuant.IQ5_KS: 12,
              IkQuant.IQ4_KSS: 13, IkQuant.IQ2_KL: 14, IkQuant.IQ2_K: 15, IkQuant.IQ3_K: 16}
_E2M1_X2 = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12]
_VALUES = {Q.MXFP4: _E2M1_X2, IkQuant.IQ3_KS: IQ3NL_VALUES.tolist(), IkQuant.IQ2_KS: IQ2NL_VALUES.tolist(),
           IkQuant.IQ5_KS: IQ5NL_VALUES.tolist(), IkQuant.IQ2_KL: IQ2KL_PAIRS.reshape(-1).tolist(),
           IkQuant.IQ3_K: IQ3NL_VALUES.tolist(), IkQuant.IQ2_K: IQ2NL_VALUES.tolist()}
_IQ4 = IQ4K_VALUES.tolist()  # the rest: IQ4K's 32 (IQ4_NL's table is its first half)
_TABLES: dict[tuple, torch.Tensor] = {}
SUPPORTED = tuple(_LEGACY) + tuple(_LUT_KINDS)


def _table(qtype: Q, device) -> torch.Tensor:
    values = _VALUES.get(qtype, _IQ4)
    key = (tuple(values), str(device))
    if key not in _TABLES:
        _TABLES[key] = torch.tensor(values, dtype=torch.float32, device=device)
    return _TABLES[key]


def _sizes(qtype) -> tuple[int, int, int]:
    """(values a block, bytes a block, bytes of row metadata)."""
    if isinstance(qtype, IkQuant):
        _, block, size, meta = IK_TYPES[qtype]
        return block, size, meta
    return (*GGML_QUANT_SIZES[qtype], 0)


def dequantize(raw: torch.Tensor, qtype: Q, ne: tuple[int, ...], dtype: torch.dtype = torch.float16,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """raw: the tensor's bytes (uint8, on the GPU); returns (reversed ne) floats of `dtype`, or fills `out`."""
    if qtype not in SUPPORTED:
        raise NotImplementedError(f"no GPU dequantization kernel for {qtype.name} yet")
    block, size, meta = _sizes(qtype)
    n = 1
    for v in ne:
        n *= v
    n_blocks = n // block
    if raw.numel() != n_blocks * size + n // ne[0] * meta:
        raise ValueError(f"{qtype.name} tensor of {n} values needs {n_blocks * size + n // ne[0] * meta} bytes, got "
                         f"{raw.numel()}")
    if out is None:
        out = torch.empty(tuple(reversed(ne)), dtype=dtype, device=raw.device)
    if qtype in _LEGACY:
        grid = (triton.cdiv(n_blocks, _BLOCKS),)
        _dequant_legacy[grid](raw, out, n_blocks, KIND=_LEGACY[qtype], BLOCK_BYTES=size, BLOCKS=_BLOCKS)
    else:
        blocks = _BLOCKS * 32 // block
        _dequant_lut[(triton.cdiv(n_blocks, blocks),)](raw, out, _table(qtype, raw.device), n_blocks, ne[0] // block,
                                                       KIND=_LUT_KINDS[qtype], VALUES=block, BLOCK_BYTES=size,
                                                       BLOCKS=blocks, ROW_META=meta)
    return out
