"""Dense K-quant matrices (Q4_K, Q5_K, Q6_K: a Q4_K_M / Q5_K_M file's attention and output) rewritten at upload into
rows of ferry's own (KRows), for the few-token GEMV: each row holds its blocks' quants, then their sub-block scales
unpacked to bytes, then their f16 d's, the row padded to 16 bytes. The same values as the GGUF blocks (exact: a 6-bit
scale becomes a byte, nothing is rounded), up to 2.8% more bytes, and every load a plain aligned vector load, where
the blocks as stored scatter each block's scales over 12 bytes of 6-bit fields (kquant.py reads those in place: on an
H200 a Q4_K attn_q took 8.9 us there, 6.5 here; docs/performance.md, 2026-11-29). Routed experts stay in their blocks
(kquant.py): in these rows Qwen3-30B-A3B's Q4_K_M experts ran 30.2 against 31.1 us.

Row layouts (K columns, nb = K / 256 blocks):
- Q4_K: qs (K / 2: each block's 128 bytes as stored: byte i holds values 64 (i // 32) + i % 32 and 32 further),
  scales (16 a block: the scales of sub-blocks 0, 2, 4, 6, of 1, 3, 5, 7, then their mins in the same order),
  d and dmin (f16 pairs, 4 bytes a block).
- Q5_K: Q4_K's, with each block's 32 bytes of fifth bits (bit 2c / 2c + 1 of byte l: value l of chunk c's low / high
  nibble) after the quants: qs, qh (K / 8), scales, d and dmin.
- Q6_K: ql (K / 2: byte i holds values 128 (i // 64) + i % 64 and 64 further), qh (K / 4: their top bits, byte
  32 (i // 64) + i % 32 at shift 2 ((i % 64) // 32) and 4 further), scales (16 int8 a block: those of the 8 groups
  of 16 the low nibbles hold, then the high nibbles'), d (f16, 2 bytes a block)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as Q

from ferry.kernels.capabilities import krows_row_bytes as row_bytes

KINDS = {Q.Q4_K: 0, Q.Q5_K: 1, Q.Q6_K: 2}


@triton.jit
def _rmeta(K, KIND: tl.constexpr):
    """Where in a row of K columns its scales start and its d's start (bytes from the row's start)."""
    scales = K // 2
    if KIND == 1:
        scales += K // 8
    elif KIND == 2:
        scales += K // 4
    return scales, scales + K // 16


@triton.jit
def _rquants(w, base, blk, K, m, KIND: tl.constexpr, NB: tl.constexpr):
    """Blocks blk .. blk + NB of the rows at base (R, 1) (rows masked by m): (lo, hi) (R, 128 NB) int32 quants (Q6_K's
    less 32) and the columns of lo's (1, 128 NB); hi's are 32 (Q4_K / Q5_K) or 64 (Q6_K) further. Byte i of a block's
    quants holds the values of columns 64 (i // 32) + i % 32 and 32 further (Q4_K / Q5_K, the fifth bits in qh), or
    128 (i // 64) + i % 64 and 64 further (Q6_K, the top two bits in qh)."""
    i = tl.arange(0, 128 * NB)[None, :]
    bi = i // 128
    ib = i % 128
    byte = tl.load(w + base + blk * 128 + i, mask=m, other=0).to(tl.int32)
    if KIND < 2:
        lo = byte & 0xF
        hi = byte >> 4
        chunk = ib // 32
        if KIND == 1:
            qh = tl.load(w + base + K // 2 + blk * 32 + bi * 32 + ib % 32, mask=m, other=0).to(tl.int32)
            lo += ((qh >> (2 * chunk)) & 1) << 4
            hi += ((qh >> (2 * chunk + 1)) & 1) << 4
        return lo, hi, blk * 256 + bi * 256 + chunk * 64 + ib % 32
    else:
        half = ib // 64
        p = ib % 64
        qh = tl.load(w + base + K // 2 + blk * 64 + bi * 64 + 32 * half + p % 32, mask=m, other=0).to(tl.int32)
        shift = 2 * (p // 32)
        lo = ((byte & 0xF) | (((qh >> shift) & 3) << 4)) - 32
        hi = ((byte >> 4) | (((qh >> (shift + 4)) & 3) << 4)) - 32
        return lo, hi, blk * 256 + bi * 256 + 128 * half + p


@triton.jit
def _rdot(w, w16, row, rmask, x, k0, K, S, KIND: tl.constexpr, NB: tl.constexpr):
    """Per row of `row` (BR,): columns k0 .. k0 + 256 NB of a matrix in these rows (S bytes a row; w16 the same
    buffer as f16) dotted with x there."""
    base = row.to(tl.int64)[:, None] * S  # (BR, 1)
    m = rmask[:, None]
    BR: tl.constexpr = row.shape[0]
    blk = k0 // 256  # the step's first block
    lo, hi, col = _rquants(w, base, blk, K, m, KIND, NB)
    scales, d_at = _rmeta(K, KIND)
    b = tl.arange(0, NB)[None, :]
    if KIND < 2:
        xlo = tl.load(x + col)
        xhi = tl.load(x + col + 32)
        plo = tl.sum(tl.reshape(lo.to(tl.float32) * xlo, (BR, 4 * NB, 32)), axis=2)  # sub-blocks 0, 2, 4, 6 a block
        phi = tl.sum(tl.reshape(hi.to(tl.float32) * xhi, (BR, 4 * NB, 32)), axis=2)  # 1, 3, 5, 7
        slo = tl.sum(tl.reshape(xlo, (4 * NB, 32)), axis=1)[None, :]
        shi = tl.sum(tl.reshape(xhi, (4 * NB, 32)), axis=1)[None, :]
        j = tl.arange(0, 4 * NB)[None, :]
        sat = w + base + scales + (blk + j // 4) * 16 + j % 4
        sc_e = tl.load(sat, mask=m, other=0).to(tl.float32)
        sc_o = tl.load(sat + 4, mask=m, other=0).to(tl.float32)
        mn_e = tl.load(sat + 8, mask=m, other=0).to(tl.float32)
        mn_o = tl.load(sat + 12, mask=m, other=0).to(tl.float32)
        dat = (base + d_at) // 2 + (blk + b) * 2  # in f16s
        d = tl.load(w16 + dat, mask=m, other=0).to(tl.float32)
        dmin = tl.load(w16 + dat + 1, mask=m, other=0).to(tl.float32)
        dot = tl.sum(tl.reshape(sc_e * plo + sc_o * phi, (BR, NB, 4)), axis=2)
        mins = tl.sum(tl.reshape(mn_e * slo + mn_o * shi, (BR, NB, 4)), axis=2)
        return tl.sum(d * dot - dmin * mins, axis=1)
    else:
        plo = tl.sum(tl.reshape(lo.to(tl.float32) * tl.load(x + col), (BR, 8 * NB, 16)), axis=2)
        phi = tl.sum(tl.reshape(hi.to(tl.float32) * tl.load(x + col + 64), (BR, 8 * NB, 16)), axis=2)
        g = tl.arange(0, 8 * NB)[None, :]
        sat = w + base + scales + (blk + g // 8) * 16 + g % 8
        s_lo = tl.load(sat, mask=m, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        s_hi = tl.load(sat + 8, mask=m, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        d = tl.load(w16 + (base + d_at) // 2 + blk + b, mask=m, other=0).to(tl.float32)
        return tl.sum(d * tl.sum(tl.reshape(s_lo * plo + s_hi * phi, (BR, NB, 8)), axis=2), axis=1)


@triton.jit
def _rgemv(w, w16, x, y, rows, K, S, ldy, KIND: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr):
    """y[t, r] = W[r, :] . x[t, :] for this program's rows (y's rows ldy apart); grid (row blocks, tokens)."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    t = tl.program_id(1).to(tl.int64)
    rmask = r < rows
    acc = tl.zeros((BR,), dtype=tl.float32)
    for k0 in range(0, K, BK):
        acc += _rdot(w, w16, r, rmask, x + t * K, k0, K, S, KIND, BK // 256)
    tl.store(y + t * ldy + r, acc, mask=rmask)


def _k4_unpack(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 scale bytes (..., 12) uint8 -> the 8 sub-blocks' scales and mins (..., 8) uint8."""
    s = s.to(torch.int32)
    lo4, hi4, last = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([lo4 & 63, (last & 0xF) | ((lo4 >> 6) << 4)], -1)
    mn = torch.cat([hi4 & 63, (last >> 4) | ((hi4 >> 6) << 4)], -1)
    return sc.to(torch.uint8), mn.to(torch.uint8)


def from_blocks(raw: torch.Tensor, qtype: Q, cols: int) -> torch.Tensor:
    """A matrix's GGUF blocks (flat uint8, whole rows of `cols` columns; on any device) as these rows: (rows,
    row_bytes) uint8 on the same device."""
    nb = cols // 256
    blocks = raw.view(-1, nb, GGML_QUANT_SIZES[qtype][1])
    n = blocks.shape[0]
    if qtype == Q.Q6_K:
        scales = blocks[..., 192:208].view(n, nb, 2, 2, 4)  # (half, the 4 low-nibble groups' then the high ones')
        parts = [blocks[..., 0:128], blocks[..., 128:192], scales.transpose(2, 3).reshape(n, nb, 16),
                 blocks[..., 208:210]]
    else:
        sc, mn = _k4_unpack(blocks[..., 4:16])
        order = [0, 2, 4, 6, 1, 3, 5, 7]
        meta = torch.cat([sc[..., order], mn[..., order]], -1)
        quants = [blocks[..., 48:176], blocks[..., 16:48]] if qtype == Q.Q5_K else [blocks[..., 16:144]]
        parts = quants + [meta, blocks[..., 0:4]]
    out = torch.zeros(n, row_bytes(qtype, cols), dtype=torch.uint8, device=raw.device)
    at = 0
    for part in parts:
        width = nb * part.shape[-1]
        out[:, at:at + width] = part.reshape(n, width)
        at += width
    return out


def rgemv(w: torch.Tensor, qtype: Q, ne: tuple[int, ...], x: torch.Tensor, rows_per_program: int = 0,
          blocks_per_step: int = 1, warps: int = 1, out: torch.Tensor | None = None) -> torch.Tensor:
    """x (n, cols) times the (rows, cols) matrix in these rows (w: from_blocks') transposed: (n, rows) float32, in
    `out` when given (columns of a wider float32 tensor: its rows contiguous). rows_per_program 0: gemv_config's."""
    cols, rows = ne[0], ne[1]
    if not rows_per_program:
        rows_per_program, blocks_per_step, warps = gemv_config(cols, rows)
    x = x.float().contiguous()
    y = out if out is not None else torch.empty(x.shape[0], rows, dtype=torch.float32, device=x.device)
    assert y.shape == (x.shape[0], rows) and y.stride(1) == 1 and y.dtype == torch.float32
    nb = _step(cols, blocks_per_step)
    _rgemv[(triton.cdiv(rows, rows_per_program), x.shape[0])](w, w.view(torch.float16), x, y, rows, cols,
                                                             w.shape[-1], y.stride(0), KIND=KINDS[qtype], BK=256 * nb,
                                                             BR=rows_per_program, num_warps=warps)
    return y


def _step(cols: int, want: int) -> int:
    """Blocks a step: the most up to `want` that divide the row's blocks."""
    nb = want
    while (cols // 256) % nb:
        nb //= 2
    return nb


@triton.jit
def _rfloats(w, w16, out, K, S, KIND: tl.constexpr):
    """Row program_id(0), block program_id(1) of a matrix in these rows as floats: out[row, col], each value its
    sub-block's scale times its quant (less the scaled min) in float32, rounded once to out's type."""
    r = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    base = tl.zeros((1, 1), dtype=tl.int64) + r * S
    m = base >= 0  # every row is read
    lo, hi, col = _rquants(w, base, blk, K, m, KIND, 1)
    scales, d_at = _rmeta(K, KIND)
    i = tl.arange(0, 128)[None, :]
    if KIND < 2:
        sat = w + base + scales + blk * 16 + i // 32  # sub-block 2 (i // 32), and the next, of the block
        dat = (base + d_at) // 2 + blk * 2
        d = tl.load(w16 + dat).to(tl.float32)
        dmin = tl.load(w16 + dat + 1).to(tl.float32)
        v_lo = d * tl.load(sat).to(tl.float32) * lo.to(tl.float32) - dmin * tl.load(sat + 8).to(tl.float32)
        v_hi = d * tl.load(sat + 4).to(tl.float32) * hi.to(tl.float32) - dmin * tl.load(sat + 12).to(tl.float32)
        far = 32
    else:
        sat = w + base + scales + blk * 16 + i // 16  # the group of 16 of the low nibbles, then the high's
        d = tl.load(w16 + (base + d_at) // 2 + blk).to(tl.float32)
        v_lo = d * tl.load(sat).to(tl.int8, bitcast=True).to(tl.float32) * lo.to(tl.float32)
        v_hi = d * tl.load(sat + 8).to(tl.int8, bitcast=True).to(tl.float32) * hi.to(tl.float32)
        far = 64
    tl.store(out + r * K + col, v_lo.to(out.dtype.element_ty))
    tl.store(out + r * K + col + far, v_hi.to(out.dtype.element_ty))


@dataclass
class KRows:
    """A dense K-quant matrix on the GPU in these rows: qtype, ne (cols, rows), packed (rows, row_bytes) uint8."""

    qtype: Q
    ne: tuple[int, ...]
    packed: torch.Tensor

    @classmethod
    def of(cls, raw: torch.Tensor, qtype: Q, ne: tuple[int, ...]) -> "KRows":
        """The matrix whose GGUF blocks `raw` holds (flat uint8, on the GPU)."""
        return cls(qtype, tuple(ne), from_blocks(raw, qtype, ne[0]))

    @staticmethod
    def takes(qtype, ne: tuple[int, ...]) -> bool:
        """Whether a matrix of this type and shape is held in these rows (2-D, whole blocks a row)."""
        return qtype in KINDS and len(ne) == 2 and ne[0] % 256 == 0

    def rows(self, ids: torch.Tensor) -> "KRows":
        """Rows `ids` (a token embedding's), as layout.Split.rows."""
        return KRows(self.qtype, (self.ne[0], ids.numel()), self.packed[ids])

    def gemv(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x (n, cols) times the matrix transposed, for few tokens: (n, rows) float32 (in `out`: rgemv's)."""
        return rgemv(self.packed, self.qtype, self.ne, x, out=out)

    def floats(self, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
        """(rows, cols) values of `dtype` (in `out` when given), each rounded once (bf16 through float32)."""
        cols, rows = self.ne
        if dtype not in (torch.float16, torch.float32):
            floats = self.floats(torch.float32)
            return floats.to(dtype) if out is None else out.copy_(floats.view(out.shape))
        if out is None:
            out = torch.empty(rows, cols, dtype=dtype, device=self.packed.device)
        if rows:
            _rfloats[(rows, cols // 256)](self.packed, self.packed.view(torch.float16), out, cols, self.packed.shape[1],
                                          KIND=KINDS[self.qtype])
        return out


def gemv_config(cols: int, rows: int) -> tuple[int, int, int]:
    """(rows a program, blocks a step, warps): the fastest of benchmarks/gemv_kernels.py --only krows --graphs on an
    H200 (docs/performance.md, 2026-11-29), one warp throughout: an output matrix's 151936 rows 4 rows a program
    (Q6_K 194 us against 217 with 8), attn_v's 512 one and two blocks a step (Q6_K 4.3 against 5.5), attn_output's
    4096 columns one (Q4_K 7.7), attn_q's 4096 rows two (6.5)."""
    if rows >= BIG_ROWS:
        return 4, 1, 1
    if rows <= 1024:
        return 1, 2, 1
    return (1 if cols >= 4096 else 2), 1, 1


BIG_ROWS = 65536  # an output matrix's (its vocabulary); widened by the interpreted tests as kquant.py's
