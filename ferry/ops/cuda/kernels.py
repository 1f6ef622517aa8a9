"""Triton kernels of the GPU forward that read GGUF bytes or the KV cache directly, for few tokens at a time
(token generation): quantized GEMV, the MoE expert GEMVs for (token, expert) pairs picked on the GPU, RMSNorm,
q/k norm + RoPE from a position table, attention over the cache (f16 or q8_0 rows) up to each token's position,
and q8_0 cache row quantization. None of them needs the host to know a position or an expert id, so a decode
step can be captured once as a CUDA graph and replayed."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as Q

from ferry.ops.cuda.dequant import _f16_at

GEMV_KINDS = {Q.Q8_0: 0, Q.Q4_0: 1}  # types the quantized GEMV kernels read; others are expanded for cuBLAS


@triton.jit
def _qdot(qs, d, row, rmask, x, k0, K, KIND: tl.constexpr, BK: tl.constexpr, g=None, NORM: tl.constexpr = False):
    """Per row: the dot product of columns k0 .. k0 + BK of rows `row` (BR,) of a split Q8_0 / Q4_0 matrix with
    the matching floats of x. Split layout: the quants of each row contiguous (Q8_0: K int8; Q4_0: K / 2 bytes,
    byte j of a block holding value j in its low nibble and value j + 16 in its high one), the f16 scales of
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
        prod = ((byte & 0xF) - 8).to(tl.float32) * xlo[None, :] + ((byte >> 4) - 8).to(tl.float32) * xhi[None, :]
        part = tl.sum(tl.reshape(prod, (prod.shape[0], NB, 16)), axis=2)
    b = k0 // 32 + tl.arange(0, NB)
    dv = tl.load(d + rr * (K // 32) + b[None, :], mask=rmask[:, None] & (b < K // 32)[None, :], other=0.0)
    return tl.sum(part * dv.to(tl.float32), axis=1)


@triton.jit
def _gemv(qs, d, x, y, rows, K, g, eps, KIND: tl.constexpr, NORM: tl.constexpr, BR: tl.constexpr,
          BK: tl.constexpr):
    """y[t, r] = W[r, :] . x[t, :] for rows r of this program; grid (row blocks, tokens). NORM: of RMSNorm(x[t])
    * g instead, the norm taken by each program (x is one row, read from cache): no launch for it."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    t = tl.program_id(1).to(tl.int64)
    rmask = r < rows
    xt = x + t * K
    acc = tl.zeros((BR,), dtype=tl.float32)
    for k0 in range(0, K, BK):
        acc += _qdot(qs, d, r, rmask, xt, k0, K, KIND, BK, g, NORM)
    if NORM:
        ss = tl.zeros((BK,), dtype=tl.float32)
        for k0 in range(0, K, BK):
            c = k0 + tl.arange(0, BK)
            v = tl.load(xt + c, mask=c < K, other=0.0)
            ss += v * v
        acc = acc / tl.sqrt(tl.sum(ss, axis=0) / K + eps)
    tl.store(y + t * rows + r, acc, mask=rmask)


@triton.jit
def _sum_pairs(y, res, out, n_used, N, HAS_RES: tl.constexpr, BN: tl.constexpr):
    """out[t] = (res[t] +) the sum of y[t * n_used + j] over j in order: a token's expert outputs, and the
    residual stream they join."""
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BN + tl.arange(0, BN)
    m = c < N
    acc = tl.zeros((BN,), dtype=tl.float32)
    for j in range(n_used):
        acc += tl.load(y + (t * n_used + j) * N + c, mask=m, other=0.0)
    if HAS_RES:
        acc = tl.load(res + t * N + c, mask=m, other=0.0) + acc
    tl.store(out + t * N + c, acc, mask=m)


@triton.jit
def _act(g, ACT: tl.constexpr):
    if ACT == 0:  # silu
        return g / (1.0 + tl.exp(-g))
    else:  # gelu, tanh form (ggml's)
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        return 0.5 * g * (1.0 + (2.0 / (1.0 + tl.exp(-2.0 * inner)) - 1.0))


@triton.jit
def _moe_gate_up(gq, gd, uq, ud, x, ids, h, rows, K, n_used, KIND: tl.constexpr, ACT: tl.constexpr,
                 BR: tl.constexpr, BK: tl.constexpr):
    """Pair p = (token p // n_used, its expert ids[p]): h[p, r] = act(gate_e[r] . x) * (up_e[r] . x)."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    p = tl.program_id(1).to(tl.int64)
    rmask = r < rows
    row = tl.load(ids + p).to(tl.int64) * rows + r
    xt = x + (p // n_used) * K
    g = tl.zeros((BR,), dtype=tl.float32)
    u = tl.zeros((BR,), dtype=tl.float32)
    for k0 in range(0, K, BK):
        g += _qdot(gq, gd, row, rmask, xt, k0, K, KIND, BK)
        u += _qdot(uq, ud, row, rmask, xt, k0, K, KIND, BK)
    tl.store(h + p * rows + r, _act(g, ACT) * u, mask=rmask)


@triton.jit
def _moe_down(dq, dd, h, ids, weights, y, rows, K, KIND: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr):
    """Pair p: y[p, r] = weights[p] * (down_e[r] . h[p]); the caller sums each token's pairs in a fixed order
    (no atomics: the same inputs give the same bits). One program per pair and row block: summing a token's
    pairs in this kernel leaves too few programs (37.5-41.8 against 32.4 us for Qwen3's experts on an H100)."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    p = tl.program_id(1).to(tl.int64)
    rmask = r < rows
    row = tl.load(ids + p).to(tl.int64) * rows + r
    acc = tl.zeros((BR,), dtype=tl.float32)
    for k0 in range(0, K, BK):
        acc += _qdot(dq, dd, row, rmask, h + p * K, k0, K, KIND, BK)
    tl.store(y + p * rows + r, tl.load(weights + p) * acc, mask=rmask)


@triton.jit
def _route(logits, bias, weights, ids, n_expert, n_used, scale, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr,
           NORM: tl.constexpr, BE: tl.constexpr, BU: tl.constexpr):
    """One token's router: scores (softmax, or sigmoid) of its logits, the n_used best by score (+ bias when
    given) in descending order, their unbiased scores (renormalised to sum 1 when NORM) times scale."""
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BE)
    live = e < n_expert
    z = tl.load(logits + t * n_expert + e, mask=live, other=-float("inf"))
    if SIGMOID:
        p = tl.where(live, 1.0 / (1.0 + tl.exp(-z)), 0.0)
    else:
        p = tl.exp(z - tl.max(z, axis=0))
        p = p / tl.sum(p, axis=0)
    choice = p + tl.load(bias + e, mask=live, other=0.0) if HAS_BIAS else p
    choice = tl.where(live, choice, -float("inf"))
    j = tl.arange(0, BU)
    w_sel = tl.zeros((BU,), dtype=tl.float32)
    id_sel = tl.zeros((BU,), dtype=tl.int32)
    for i in range(n_used):
        best = tl.argmax(choice, axis=0)
        w_sel = tl.where(j == i, tl.sum(tl.where(e == best, p, 0.0), axis=0), w_sel)
        id_sel = tl.where(j == i, best.to(tl.int32), id_sel)
        choice = tl.where(e == best, -float("inf"), choice)
    if NORM:
        w_sel = w_sel / tl.sum(tl.where(j < n_used, w_sel, 0.0), axis=0)
    tl.store(weights + t * n_used + j, w_sel * scale, mask=j < n_used)
    tl.store(ids + t * n_used + j, id_sel, mask=j < n_used)


@triton.jit
def _rms_norm(x, w, y, n, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)
    m = i < n
    v = tl.load(x + row * n + i, mask=m, other=0.0)
    inv = 1.0 / tl.sqrt(tl.sum(v * v, axis=0) / n + eps)
    tl.store(y + row * n + i, v * inv * tl.load(w + i, mask=m, other=0.0), mask=m)


@triton.jit
def _add_rms_norm(x, dx, w, s, y, n, eps, BLOCK: tl.constexpr):
    """s = x + dx (the residual stream), y = RMSNorm(s) * w, per row."""
    row = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)
    m = i < n
    v = tl.load(x + row * n + i, mask=m, other=0.0) + tl.load(dx + row * n + i, mask=m, other=0.0)
    tl.store(s + row * n + i, v, mask=m)
    inv = 1.0 / tl.sqrt(tl.sum(v * v, axis=0) / n + eps)
    tl.store(y + row * n + i, v * inv * tl.load(w + i, mask=m, other=0.0), mask=m)


@triton.jit
def _rotated(x, w, cos, sin, p, dim, n_rot, eps, HAS_NORM: tl.constexpr, NEOX: tl.constexpr, BLOCK: tl.constexpr):
    """One head's values at x (dim floats): optional RMSNorm with w, then the first n_rot dims rotated by the
    angles of position p (row p of the cos/sin tables, n_rot / 2 wide). Lanes past dim are 0."""
    i = tl.arange(0, BLOCK)
    m = i < dim
    v = tl.load(x + i, mask=m, other=0.0)
    half = n_rot // 2
    if NEOX:  # pairs (i, i + n_rot / 2)
        pair = tl.where(i < half, i + half, i - half)
        k = i % half
        sign = tl.where(i < half, -1.0, 1.0)
    else:  # adjacent pairs (2k, 2k + 1)
        pair = i ^ 1
        k = i // 2
        sign = tl.where(i % 2 == 0, -1.0, 1.0)
    rot = m & (i < n_rot)
    other = tl.load(x + pair, mask=rot, other=0.0)
    if HAS_NORM:
        inv = 1.0 / tl.sqrt(tl.sum(v * v, axis=0) / dim + eps)
        v = v * inv * tl.load(w + i, mask=m, other=0.0)
        other = other * inv * tl.load(w + pair, mask=rot, other=0.0)
    c = tl.load(cos + p * half + k, mask=rot, other=1.0)
    s = tl.load(sin + p * half + k, mask=rot, other=0.0)
    return tl.where(rot, v * c + sign * other * s, v)


@triton.jit
def _store_q8_0_blocks(cache, cache16, at, v, live):
    """Blocks v (B, 32) floats as q8_0 at byte offsets `at` (B,) of `cache` (even: `cache16` is its float16 view),
    where `live`, rounded as ggml does: d = amax / 127 stored as f16, q = round(x / d) half away from zero."""
    d = tl.max(tl.abs(v), axis=1) / 127.0
    inv = tl.where(d > 0, 1.0 / d, 0.0)
    scaled = v * inv[:, None]
    q = tl.where(scaled >= 0, tl.floor(scaled + 0.5), -tl.floor(-scaled + 0.5)).to(tl.int8)
    tl.store(cache16 + at // 2, d.to(tl.float16), mask=live)
    tl.store(cache + at[:, None] + 2 + tl.arange(0, 32)[None, :], q.to(tl.uint8, bitcast=True), mask=live[:, None])


@triton.jit
def _store_cache_row(cache, cache16, at, v, n, BLOCK: tl.constexpr, Q8: tl.constexpr):
    """The first n of v (BLOCK floats) into a cache row at `at`: f16 (at in elements of the float16 view
    `cache16`), or q8_0 blocks (n a multiple of 32; at in bytes of `cache`)."""
    if Q8:
        nb = tl.arange(0, BLOCK // 32)
        _store_q8_0_blocks(cache, cache16, at + nb.to(tl.int64) * 34, tl.reshape(v, (BLOCK // 32, 32)), nb < n // 32)
    else:
        i = tl.arange(0, BLOCK)
        tl.store(cache16 + at + i, v.to(tl.float16), mask=i < n)


@triton.jit
def _qkv_rope_store(y, qn, kn, cos, sin, pos, cells, q_out, kc, kc16, vc, vc16, n_head, n_head_kv, dk, dv, n_rot,
                    eps, k_row, v_row, HAS_NORM: tl.constexpr, NEOX: tl.constexpr, K_Q8: tl.constexpr,
                    V_Q8: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """One head of token t of a fused q|k|v projection y (n, (n_head + n_head_kv) * dk + n_head_kv * dv): a query
    head normed (HAS_NORM) and rotated into q_out (n, n_head, dk); a key head the same, into cache row cells[t];
    a value head copied into its cache row. k_row / v_row: a cache row's bytes (q8_0) or f16 values."""
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    width = (n_head + n_head_kv) * dk + n_head_kv * dv
    cell = tl.load(cells + t).to(tl.int64)
    if head < n_head + n_head_kv:
        p = tl.load(pos + t).to(tl.int64)
        if head < n_head:
            out = _rotated(y + t * width + head * dk, qn, cos, sin, p, dk, n_rot, eps, HAS_NORM, NEOX, BK)
            i = tl.arange(0, BK)
            tl.store(q_out + (t * n_head + head) * dk + i, out, mask=i < dk)
        else:
            out = _rotated(y + t * width + head * dk, kn, cos, sin, p, dk, n_rot, eps, HAS_NORM, NEOX, BK)
            col = (head - n_head) * dk
            if K_Q8:
                col = col // 32 * 34
            _store_cache_row(kc, kc16, cell * k_row + col, out, dk, BK, K_Q8)
    else:
        vh = head - n_head - n_head_kv
        i = tl.arange(0, BV)
        v = tl.load(y + t * width + (n_head + n_head_kv) * dk + vh * dv + i, mask=i < dv, other=0.0)
        col = vh * dv
        if V_Q8:
            col = col // 32 * 34
        _store_cache_row(vc, vc16, cell * v_row + col, v, dv, BV, V_Q8)


@triton.jit
def _norm_rope(x, w, cos, sin, pos, y, n_heads, dim, n_rot, eps, HAS_NORM: tl.constexpr, NEOX: tl.constexpr,
               BLOCK: tl.constexpr):
    """One head of one token: optional RMSNorm over the head, then RoPE at the token's position pos[t]."""
    row = tl.program_id(0).to(tl.int64)
    p = tl.load(pos + row // n_heads).to(tl.int64)
    out = _rotated(x + row * dim, w, cos, sin, p, dim, n_rot, eps, HAS_NORM, NEOX, BLOCK)
    i = tl.arange(0, BLOCK)
    tl.store(y + row * dim + i, out, mask=i < dim)


@triton.jit
def _cache_row(cache, cell, col, row_stride, mask, Q8: tl.constexpr):
    """Float values of a (cells, cols) block of cache rows: q8_0 bytes (34-byte blocks; row_stride in bytes)
    or f16 (`cache` a float16 view; row_stride in elements)."""
    if Q8:
        base = cell.to(tl.int64)[:, None] * row_stride + (col // 32)[None, :] * 34
        q = tl.load(cache + base + 2 + (col % 32)[None, :], mask=mask, other=0).to(tl.int8, bitcast=True)
        return q.to(tl.float32) * _f16_at(cache, base, mask)
    else:
        return tl.load(cache + cell.to(tl.int64)[:, None] * row_stride + col[None, :], mask=mask,
                       other=0.0).to(tl.float32)


@triton.jit
def _attn_decode(q, kc, vc, pos, base, out, part, n_heads, group, dk, dv, k_row, v_row, scale, window, chunk,
                 K_Q8: tl.constexpr, V_Q8: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, PARTIAL: tl.constexpr):
    """One query head of one token: softmax(q . k * scale) v over the cache cells base[t] + 0 .. pos[t] (the
    last `window` of them when window > 0), online over blocks of BN cells. PARTIAL (flash-decoding): program s
    of axis 2 takes only positions s * chunk .. (s + 1) * chunk - 1 (chunk a multiple of BN) and leaves its
    unnormalised sum in out, its running max and denominator in part, for _attn_combine."""
    h = tl.program_id(0)
    t = tl.program_id(1).to(tl.int64)
    kvh = h // group
    d = tl.arange(0, BD)
    qv = tl.load(q + (t * n_heads + h) * dk + d, mask=d < dk, other=0.0) * scale
    p = tl.load(pos + t)
    b0 = tl.load(base + t)
    lo = tl.where(window > 0, tl.maximum(p - window + 1, 0), 0)
    begin = (lo // BN) * BN
    end = p + 1
    if PARTIAL:
        begin = tl.maximum(begin, tl.program_id(2) * chunk)
        end = tl.minimum(end, (tl.program_id(2) + 1) * chunk)
    m_i = -1e30
    l_i = 0.0
    acc = tl.zeros((BD,), dtype=tl.float32)
    for n0 in range(begin, end, BN):
        j = n0 + tl.arange(0, BN)
        live = (j >= lo) & (j <= p)
        kmask = live[:, None] & (d < dk)[None, :]
        k = _cache_row(kc, b0 + j, kvh * dk + d, k_row, kmask, K_Q8)
        s = tl.where(live, tl.sum(k * qv[None, :], axis=1), -1e30)
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        w = tl.where(live, tl.exp(s - m_new), 0.0)
        alpha = tl.exp(m_i - m_new)
        vmask = live[:, None] & (d < dv)[None, :]
        v = _cache_row(vc, b0 + j, kvh * dv + d, v_row, vmask, V_Q8)
        acc = acc * alpha + tl.sum(w[:, None] * v, axis=0)
        l_i = l_i * alpha + tl.sum(w, axis=0)
        m_i = m_new
    if PARTIAL:
        at = (t * n_heads + h) * tl.num_programs(2) + tl.program_id(2)
        tl.store(out + at * dv + d, acc, mask=d < dv)
        tl.store(part + at * 2, m_i)
        tl.store(part + at * 2 + 1, l_i)
    else:
        tl.store(out + (t * n_heads + h) * dv + d, acc / l_i, mask=d < dv)


@triton.jit
def _attn_combine(acc, part, out, n_heads, splits, dv, SP: tl.constexpr, BD: tl.constexpr):
    """One head of one token: its `splits` partial results from _attn_decode (PARTIAL) merged, each rescaled by
    exp(its max - the overall max); a split that saw no cell has max -1e30 and weighs nothing."""
    h = tl.program_id(0)
    t = tl.program_id(1).to(tl.int64)
    s = tl.arange(0, SP)
    d = tl.arange(0, BD)
    row = (t * n_heads + h) * splits + s
    m = tl.load(part + row * 2, mask=s < splits, other=-1e30)
    scale = tl.where(s < splits, tl.exp(m - tl.max(m, axis=0)), 0.0)
    den = tl.sum(tl.load(part + row * 2 + 1, mask=s < splits, other=0.0) * scale, axis=0)
    a = tl.load(acc + row[:, None] * dv + d[None, :], mask=(s < splits)[:, None] & (d < dv)[None, :], other=0.0)
    tl.store(out + (t * n_heads + h) * dv + d, tl.sum(a * scale[:, None], axis=0) / den, mask=d < dv)


@triton.jit
def _quantize_q8_0_rows(x, cache, cache16, cells, n_blocks, row_bytes, BLOCKS: tl.constexpr):
    """Row t of x (n_blocks * 32 floats) as q8_0 into cache row cells[t], rounded as ggml does."""
    t = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1) * BLOCKS + tl.arange(0, BLOCKS)
    live = b < n_blocks
    v = tl.load(x + t * n_blocks * 32 + b[:, None] * 32 + tl.arange(0, 32)[None, :], mask=live[:, None], other=0.0)
    _store_q8_0_blocks(cache, cache16, tl.load(cells + t).to(tl.int64) * row_bytes + b.to(tl.int64) * 34, v, live)


@triton.jit
def _block_halves(qs, d, wrow, nmask, b, K, KIND: tl.constexpr):
    """32-block b of the rows wrow (BN, 1) of a split Q8_0 / Q4_0 matrix, scaled to f16 as two (BN, 16) halves:
    its first 16 columns and its last 16 (for Q4_0, each byte's low and high nibble: every byte read once, no
    register shuffle). Rows past the matrix, or a block past K, read as zeros."""
    j = tl.arange(0, 16)
    live = nmask[:, None] & (b < K // 32)
    s = tl.load(d + wrow * (K // 32) + b, mask=live, other=0.0).to(tl.float32)  # (BN, 1)
    if KIND == 0:
        at = qs + wrow * K + b * 32 + j[None, :]
        lo = tl.load(at, mask=live, other=0).to(tl.float32)
        hi = tl.load(at + 16, mask=live, other=0).to(tl.float32)
    else:
        byte = tl.load(qs + wrow * (K // 2) + b * 16 + j[None, :], mask=live, other=0).to(tl.int32)
        lo = ((byte & 0xF) - 8).to(tl.float32)
        hi = ((byte >> 4) - 8).to(tl.float32)
    return (lo * s).to(tl.float16), (hi * s).to(tl.float16)


@triton.jit
def _moe_mm(x, qs, d, uqs, ud, y, tile_expert, tile_row, tile_end, src, dst, scale, N, K, KIND: tl.constexpr,
            GATED: tl.constexpr, ACT: tl.constexpr, GATHER: tl.constexpr, SCATTER: tl.constexpr,
            SCALE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Grouped GEMM over rows sorted by expert: tile i covers sorted rows tile_row[i] .. tile_end[i] (all of
    expert tile_expert[i], -1: no work); row r's output is x[r] . W_e[n] with W_e (split Q8_0 / Q4_0) expanded to
    f16 block by block in registers, f32 accumulation (tensor cores); BK columns (BK / 32 blocks) per loop step.
    GATED: W is the gate and (uqs, ud) the up projection of the same expert, and the output act(x . gate) *
    (x . up), one read of x for both. GATHER: row r reads x[src[r]]; SCATTER: it writes y[dst[r]]; SCALE: times
    scale[dst[r]] (the router's weight of that pair)."""
    tile = tl.program_id(0)
    e = tl.load(tile_expert + tile)
    if e >= 0:
        r0 = tl.load(tile_row + tile)
        r_end = tl.load(tile_end + tile)
        rows = r0 + tl.arange(0, BM)
        rmask = rows < r_end
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        nmask = n < N
        wrow = (e.to(tl.int64) * N + n.to(tl.int64))[:, None]
        x_rows = tl.load(src + rows, mask=rmask, other=0) if GATHER else rows
        xr = x + x_rows.to(tl.int64)[:, None] * K + tl.arange(0, 16)[None, :]
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        acc_up = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            for jb in tl.static_range(BK // 32):
                b = k0 // 32 + jb
                am = rmask[:, None] & (b < K // 32)
                a_lo = tl.load(xr + b * 32, mask=am, other=0.0)
                a_hi = tl.load(xr + b * 32 + 16, mask=am, other=0.0)
                w_lo, w_hi = _block_halves(qs, d, wrow, nmask, b, K, KIND)
                acc = tl.dot(a_lo, tl.trans(w_lo), acc)
                acc = tl.dot(a_hi, tl.trans(w_hi), acc)
                if GATED:
                    u_lo, u_hi = _block_halves(uqs, ud, wrow, nmask, b, K, KIND)
                    acc_up = tl.dot(a_lo, tl.trans(u_lo), acc_up)
                    acc_up = tl.dot(a_hi, tl.trans(u_hi), acc_up)
        if GATED:
            acc = _act(acc, ACT) * acc_up
        y_rows = tl.load(dst + rows, mask=rmask, other=0) if SCATTER else rows
        if SCALE:
            acc = acc * tl.load(scale + y_rows, mask=rmask, other=0.0)[:, None]
        tl.store(y + y_rows.to(tl.int64)[:, None] * N + n[None, :], acc.to(y.dtype.element_ty),
                 mask=rmask[:, None] & nmask[None, :])


@triton.jit
def _unpack_experts(raw, ids, d, qs, per_expert, BLOCK: tl.constexpr, PAYLOAD: tl.constexpr, BB: tl.constexpr):
    """Staged expert j (its GGUF blocks, compact in raw) into expert ids[j]'s slot of a Split: each block's two
    scale bytes to d, its other PAYLOAD bytes to qs (all as bytes)."""
    j = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1) * BB + tl.arange(0, BB)
    live = b < per_expert
    e = tl.load(ids + j).to(tl.int64)
    src = raw + (j * per_expert + b) * BLOCK
    dst = e * per_expert + b
    for i in tl.static_range(2):
        tl.store(d + dst * 2 + i, tl.load(src + i, mask=live), mask=live)
    k = tl.arange(0, PAYLOAD)
    tl.store(qs + dst[:, None] * PAYLOAD + k[None, :], tl.load(src[:, None] + 2 + k[None, :], mask=live[:, None]),
             mask=live[:, None])


# ---- launchers ----

def unpack_experts(raw: torch.Tensor, ids: torch.Tensor, split: "Split") -> None:
    """raw: the GGUF bytes of len(ids) experts of a stacked Q8_0 / Q4_0 tensor, one after another; ids (on the GPU):
    which expert each is. Fills those experts' slots of `split` in one launch (the layout Split.of makes)."""
    per_expert = split.d.numel() // split.ne[2]
    block = GGML_QUANT_SIZES[split.qtype][1]
    bb = 256
    _unpack_experts[(ids.numel(), triton.cdiv(per_expert, bb))](raw, ids, split.d.view(torch.uint8),
                                                                 split.qs.view(torch.uint8), per_expert,
                                                                 BLOCK=block, PAYLOAD=block - 2, BB=bb)


@triton.jit
def _split_floats(qs, d, out, n_blocks, KIND: tl.constexpr, BLOCKS: tl.constexpr):
    """out[b * 32 + j] = d[b] * q[b, j] for BLOCKS blocks per program: the exact product (an int8 or nibble times
    an f16 is exact in float32) rounded once to out's type."""
    b = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
    live = (b < n_blocks)[:, None]
    j = tl.arange(0, 32)[None, :]
    s = tl.load(d + b, mask=b < n_blocks, other=0.0).to(tl.float32)[:, None]
    if KIND == 0:
        q = tl.load(qs + b[:, None] * 32 + j, mask=live, other=0).to(tl.float32)
    else:  # a byte's low nibble is column j of the block, its high nibble column j + 16
        byte = tl.load(qs + b[:, None] * 16 + j % 16, mask=live, other=0).to(tl.int32)
        q = (tl.where(j < 16, byte & 0xF, byte >> 4) - 8).to(tl.float32)
    tl.store(out + b[:, None] * 32 + j, q * s, mask=live)


@triton.jit
def _head_gemv(x, w, y, M, K, sxt, sxh, sxk, swh, swm, swk, BM: tl.constexpr, BK: tl.constexpr):
    """y[t, h, m] = sum over k of x[t, h, k] * w[h, m, k], float32 accumulation, x and w read through their strides
    (broadcast or transposed views too); y (tokens, heads, M) contiguous. Grid (row blocks, heads, tokens)."""
    m = tl.program_id(0) * BM + tl.arange(0, BM)
    h = tl.program_id(1).to(tl.int64)
    t = tl.program_id(2).to(tl.int64)
    mmask = m < M
    acc = tl.zeros((BM,), dtype=tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + tl.arange(0, BK)
        kmask = k < K
        xv = tl.load(x + t * sxt + h * sxh + k * sxk, mask=kmask, other=0.0).to(tl.float32)
        wv = tl.load(w + h * swh + m[:, None].to(tl.int64) * swm + k[None, :] * swk,
                     mask=mmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(wv * xv[None, :], axis=1)
    tl.store(y + (t * tl.num_programs(1) + h) * M + m, acc, mask=mmask)


@dataclass
class Split:
    """A Q8_0 / Q4_0 tensor on the GPU as two arrays: each block's quants (32 int8, or 16 bytes of nibbles) and
    its f16 scale, in block order. The same bytes as the GGUF blocks, laid out for aligned vector loads."""

    qtype: Q
    ne: tuple[int, ...]
    qs: torch.Tensor  # (n_blocks, 32) int8 or (n_blocks, 16) uint8
    d: torch.Tensor  # (n_blocks,) float16

    @classmethod
    def of(cls, raw: torch.Tensor, qtype: Q, ne: tuple[int, ...]) -> "Split":
        blocks = raw.view(-1, GGML_QUANT_SIZES[qtype][1])
        qs = blocks[:, 2:].contiguous()
        return cls(qtype, tuple(ne), qs.view(torch.int8) if qtype == Q.Q8_0 else qs,
                   blocks[:, :2].contiguous().view(torch.float16).view(-1))

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


def gemv(w: Split, x: torch.Tensor, config: tuple[int, int, int] | None = None,
         norm: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
    """x (n, cols) float32 times the (rows, cols) matrix transposed: (n, rows) float32; with norm = (weight, eps),
    RMSNorm(x) * weight in place of x. config: (rows per program, columns per step, warps)."""
    cols, rows = w.ne[:2]
    x = x.float().contiguous()
    y = torch.empty(x.shape[0], rows, dtype=torch.float32, device=x.device)
    br, bk, warps = config or _gemv_config(rows * x.shape[0], cols)
    g, eps = norm if norm is not None else (x, 0.0)
    _gemv[(triton.cdiv(rows, br), x.shape[0])](w.qs, w.d, x, y, rows, cols, g, eps, KIND=GEMV_KINDS[w.qtype],
                                              NORM=norm is not None, BR=br, BK=bk, num_warps=warps)
    return y


def _gemv_config(outputs: int, cols: int) -> tuple[int, int, int]:
    """Enough programs for every SM, few steps per row: the fastest of sweeps on an H100 and an H200
    (benchmarks/gemv_kernels.py, sessions 7 and 8; differences under 1 us are noise there)."""
    if outputs >= 16 * 528:  # the output head
        return 16, 256, 8
    if outputs <= 1024 or cols > 2048:  # few rows (k, v, kv_a) or long ones (attn_output): a row in one step
        return 2, 2048, 4
    return 8, 512, 8


ACTS = {"silu": 0, "gelu": 1}


def moe_gemv(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate: Split, up: Split, down: Split,
             act: str, wait_down: torch.cuda.Event | None = None, residual: torch.Tensor | None = None,
             config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """The routed experts of few tokens: x (n, n_embd), ids / weights (n, n_used) on the GPU; gate/up/down the
    stacked expert tensors. Returns (n, n_embd) float32, plus `residual` (n, n_embd) when given. config: (rows per
    program, columns per step, warps)."""
    h = moe_gate_up_gemv(x, ids, gate, up, act, config)
    if wait_down is not None:  # the down projection's weights are still being copied
        torch.cuda.current_stream(x.device).wait_event(wait_down)
    return moe_down_gemv(h, ids, weights, down, residual, config)


def _moe_gemv_config(n_ff: int, pairs: int) -> tuple[int, int, int]:
    # the fastest of sweeps on an H100 / H200 at Qwen3-30B-A3B's (first) and DeepSeek-V2-Lite's (second) expert shapes
    return (8, 256, 4) if n_ff * pairs < 8192 else (8, 512, 2)


def moe_gate_up_gemv(x: torch.Tensor, ids: torch.Tensor, gate: Split, up: Split, act: str,
                     config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """The experts' first half for few tokens: act(gate . x) * (up . x) of each (token, slot) pair, (n * n_used,
    n_ff) float32 in pair order."""
    n, n_used = ids.shape
    n_embd, n_ff = gate.ne[0], gate.ne[1]
    br, bk, warps = config or _moe_gemv_config(n_ff, n * n_used)
    x = x.float().contiguous()
    ids = ids.to(torch.int32).contiguous()
    h = torch.empty(n * n_used, n_ff, dtype=torch.float32, device=x.device)
    _moe_gate_up[(triton.cdiv(n_ff, br), n * n_used)](gate.qs, gate.d, up.qs, up.d, x, ids, h, n_ff, n_embd, n_used,
                                                       KIND=GEMV_KINDS[gate.qtype], ACT=ACTS[act], BR=br, BK=bk,
                                                       num_warps=warps)
    return h


def moe_down_gemv(h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, down: Split,
                  residual: torch.Tensor | None = None, config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """The experts' second half for few tokens: h (n * n_used, n_ff) in pair order -> each token's router-weighted
    sum of down . h over its slots, (n, n_embd) float32 (plus `residual` when given)."""
    n, n_used = ids.shape
    n_ff, n_embd = down.ne[0], down.ne[1]
    br, bk, warps = config or _moe_gemv_config(n_ff, n * n_used)
    ids = ids.to(torch.int32).contiguous()
    y = torch.empty(n * n_used, n_embd, dtype=torch.float32, device=h.device)
    _moe_down[(triton.cdiv(n_embd, br), n * n_used)](down.qs, down.d, h.float().contiguous(), ids,
                                                      weights.float().contiguous(), y, n_embd, n_ff,
                                                      KIND=GEMV_KINDS[down.qtype], BR=br, BK=bk, num_warps=warps)
    if n_used == 1 and residual is None:
        return y
    return sum_pairs(y, n_used, residual)


def head_gemv(x: torch.Tensor, w: torch.Tensor, config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """Each head through its own matrix, for few tokens: x (n, heads, K) float32, w (heads, M, K) of any float type,
    either a view of any strides: (n, heads, M) float32. config: (rows per program, columns per step, warps)."""
    n, heads, k = x.shape
    m = w.shape[1]
    y = torch.empty(n, heads, m, dtype=torch.float32, device=x.device)
    bm, bk, warps = config or (32, min(128, triton.next_power_of_2(k)), 4)
    _head_gemv[(triton.cdiv(m, bm), heads, n)](x, w, y, m, k, *x.stride(), *w.stride(), BM=bm, BK=bk,
                                                num_warps=warps)
    return y


def sum_pairs(y: torch.Tensor, n_used: int, residual: torch.Tensor | None = None) -> torch.Tensor:
    """y (n * n_used, N) float32 -> (n, N): each token's n_used rows summed in order, plus residual (n, N) when
    given (one kernel: torch's reduction over the middle of (n, n_used, N) took twice as long on an H100)."""
    n, width = y.shape[0] // n_used, y.shape[1]
    out = torch.empty(n, width, dtype=torch.float32, device=y.device)
    res = residual.float().contiguous() if residual is not None else y
    _sum_pairs[(n, triton.cdiv(width, 1024))](y, res, out, n_used, width, HAS_RES=residual is not None, BN=1024)
    return out


def gemv_float(w: torch.Tensor, x: torch.Tensor, config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """x (n, cols) float32 times a float32 / float16 matrix w (rows, cols) transposed, as one launch: (n, rows)
    float32 (a router: cuBLAS ran two kernels after a copy of the weight). config: (rows per program, columns per
    step, warps)."""
    # a router's row in one step: 8 steps of 4 rows took 6.5 us on an H200, (2, 2048, 8) 4.9
    config = config or (2, min(2048, triton.next_power_of_2(w.shape[1])), 8)
    return head_gemv(x.float()[:, None], w[None], config)[:, 0]  # one head


def route(logits: torch.Tensor, n_used: int, norm: bool, scale: float, sigmoid: bool,
          bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits (n, n_expert) float32 -> the n_used best experts per token, best first: (weights (n, n_used)
    float32, ids (n, n_used) int32); see _route."""
    logits = logits.float().contiguous()
    n, n_expert = logits.shape
    weights = torch.empty(n, n_used, dtype=torch.float32, device=logits.device)
    ids = torch.empty(n, n_used, dtype=torch.int32, device=logits.device)
    _route[(n,)](logits, bias if bias is not None else logits, weights, ids, n_expert, n_used, scale,
                 SIGMOID=sigmoid, HAS_BIAS=bias is not None, NORM=norm, BE=triton.next_power_of_2(n_expert),
                 BU=triton.next_power_of_2(n_used), num_warps=1 if n_expert <= 512 else 4)  # one warp: no barriers
    return weights, ids


def sort_pairs(ids: torch.Tensor, n_expert: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The flattened (token, slot) pairs sorted by expert, on the GPU without a host sync (no bincount):
    (order, pairs per expert, cumulative ends). The keys are sorted as the narrowest integer that holds an expert
    id (a radix sort makes one pass per key byte: one for up to 256 experts instead of eight for int64), and the
    ends are found in the sorted keys."""
    key = torch.uint8 if n_expert <= 256 else torch.int16 if n_expert <= 32768 else torch.int32
    flat = ids.flatten().to(key)
    keys, order = torch.sort(flat, stable=True)
    # the end of expert e is the count of keys below e + 1, the last expert's is every pair (256 is no uint8)
    firsts = torch.arange(1, n_expert, device=ids.device, dtype=key)
    ends = torch.cat([torch.searchsorted(keys, firsts), torch.full((1,), flat.numel(), device=ids.device)])
    return order, torch.diff(ends, prepend=ends.new_zeros(1)), ends


def moe_tiles(ids: torch.Tensor, n_expert: int, block: int):
    """Schedule of the grouped GEMM, computed on the GPU: (order, tile_expert, tile_row, tile_end) where order
    sorts the flattened (token, slot) pairs by expert and tile i covers sorted rows tile_row[i] .. tile_end[i]
    of expert tile_expert[i] (-1 for the unused tail of the worst-case tile count)."""
    order, counts, ends = sort_pairs(ids, n_expert)
    tiles = (counts + block - 1) // block
    tile_ends = torch.cumsum(tiles, 0)
    n_tiles = triton.cdiv(ids.numel(), block) + n_expert  # a bound the host knows without a sync
    t = torch.arange(n_tiles, device=ids.device)
    e = torch.searchsorted(tile_ends, t, right=True).clamp_(max=n_expert - 1)
    local = t - (tile_ends[e] - tiles[e])
    row = ends[e] - counts[e] + local * block
    used = t < tile_ends[-1]
    return (order, torch.where(used, e, -1).to(torch.int32), row.to(torch.int32),
            torch.minimum(row + block, ends[e]).to(torch.int32))


def moe_tile_rows(pairs: int, n_expert: int) -> int:
    """The grouped GEMM's tile height for `pairs` (token, expert) pairs over n_expert experts: the smallest of 16,
    32, 64, 128 that holds an expert's average share."""
    per_expert = pairs / n_expert
    return 16 if per_expert <= 16 else 32 if per_expert <= 32 else 64 if per_expert <= 64 else 128


# (BN, BK, warps, stages) of the grouped GEMM per (tile height, gated): the fastest of a sweep on an H100 at the
# expert shapes of Qwen3-30B-A3B and DeepSeek-V2-Lite (benchmarks/moe_kernels.py; docs/performance.md, session 7)
MOE_MM_CONFIGS = {(16, True): (64, 64, 4, 3), (16, False): (64, 64, 4, 3),
                  (32, True): (64, 32, 4, 3), (32, False): (64, 64, 4, 3),
                  (64, True): (64, 64, 4, 3), (64, False): (128, 32, 4, 4),
                  (128, True): (64, 32, 4, 3), (128, False): (128, 32, 4, 4)}


def moe_mm(xs: torch.Tensor, w: Split, sched, out_dtype, block: int, up: Split | None = None, act: str = "silu",
           rows_from: torch.Tensor | None = None, rows_to: torch.Tensor | None = None,
           row_scale: torch.Tensor | None = None, config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """Sorted row r (sched's order) times its expert's (rows, cols) matrix transposed: xs (pairs, cols) f16, row
    r of it being xs[rows_from[r]] when given, else xs[r]; with `up`, act(xs . w) * (xs . up) (w the gate). The
    result (pairs, rows) holds row r at rows_to[r] when given (times row_scale[rows_to[r]] when given), else at r.
    config: (BN, BK, warps, stages), else MOE_MM_CONFIGS' choice."""
    cols, rows, _ = w.ne
    _, tile_expert, tile_row, tile_end = sched
    pairs = tile_row.new_empty(0) if rows_from is None else rows_from
    y = torch.empty(xs.shape[0] if rows_from is None else rows_from.shape[0], rows, dtype=out_dtype,
                    device=xs.device)
    bn, bk, warps, stages = config or MOE_MM_CONFIGS[block, up is not None]
    other = up if up is not None else w
    _moe_mm[(tile_expert.numel(), triton.cdiv(rows, bn))](
        xs, w.qs, w.d, other.qs, other.d, y, tile_expert, tile_row, tile_end, pairs,
        rows_to if rows_to is not None else pairs, row_scale if row_scale is not None else y, rows, cols,
        KIND=GEMV_KINDS[w.qtype], GATED=up is not None, ACT=ACTS[act], GATHER=rows_from is not None,
        SCATTER=rows_to is not None, SCALE=row_scale is not None, BM=block, BN=bn, BK=bk, num_warps=warps,
        num_stages=stages)
    return y


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Over the last dimension, float32."""
    x = x.float().contiguous()
    n = x.shape[-1]
    y = torch.empty_like(x)
    _rms_norm[(x.numel() // n,)](x, w, y, n, eps, BLOCK=triton.next_power_of_2(n))
    return y


def add_rms_norm(x: torch.Tensor, dx: torch.Tensor, w: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + dx, RMSNorm(x + dx) * w) over the last dimension, float32, in one pass."""
    x, dx = x.float().contiguous(), dx.float().contiguous()
    n = x.shape[-1]
    s, y = torch.empty_like(x), torch.empty_like(x)
    _add_rms_norm[(x.numel() // n,)](x, dx, w, s, y, n, eps, BLOCK=triton.next_power_of_2(n))
    return s, y


def qkv_rope_store(y: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
                   cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor, cells: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, k_q8: bool, v_q8: bool, n_head: int,
                   n_head_kv: int, dk: int, dv: int, n_rot: int, neox: bool) -> torch.Tensor:
    """A fused q|k|v projection y (n, (n_head + n_head_kv) * dk + n_head_kv * dv) float32: the keys (normed when
    norms are given, rotated) and values into cache rows `cells` (caches of q8_0 bytes, or f16 viewed as bytes or
    f16); returns the queries, normed and rotated (n, n_head, dk) float32."""
    n = y.shape[0]
    q = torch.empty(n, n_head, dk, dtype=torch.float32, device=y.device)
    k16, v16 = k_cache.view(torch.float16), v_cache.view(torch.float16)
    k_row = k_cache.shape[1] if k_q8 else k16.shape[1]
    v_row = v_cache.shape[1] if v_q8 else v16.shape[1]
    _qkv_rope_store[(n, n_head + 2 * n_head_kv)](
        y.contiguous(), q_norm if q_norm is not None else y, k_norm if k_norm is not None else y, cos, sin, pos,
        cells, q, k_cache, k16, v_cache, v16, n_head, n_head_kv, dk, dv, n_rot, eps, k_row, v_row,
        HAS_NORM=q_norm is not None, NEOX=neox, K_Q8=k_q8, V_Q8=v_q8, BK=triton.next_power_of_2(dk),
        BV=triton.next_power_of_2(dv))
    return q


def norm_rope(x: torch.Tensor, w: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
              pos: torch.Tensor, n_rot: int, neox: bool) -> torch.Tensor:
    """x (n, heads, dim): optional per-head RMSNorm with w, then RoPE at positions pos (n,) from the tables."""
    x = x.float().contiguous()
    n, heads, dim = x.shape
    y = torch.empty_like(x)
    _norm_rope[(n * heads,)](x, w if w is not None else x, cos, sin, pos, y, heads, dim, n_rot, eps,
                             HAS_NORM=w is not None, NEOX=neox, BLOCK=triton.next_power_of_2(dim))
    return y


# (cells per step, warps) for heads of up to 128 values: the fastest of a sweep on an H200 at 512 and 4096 cells
# (64: (64, 8)), Qwen3's heads. Wider heads take fewer cells per step (attention_decode).
ATTENTION_DECODE_CONFIG = (128, 4)
ATTENTION_PROGRAMS = 264  # flash-decoding splits the cache until about this many programs run (2 per H100 SM)


def attention_splits(n_cells: int, programs: int, bn: int) -> int:
    """How many parts flash-decoding cuts a cache of n_cells into: none below 4 steps of bn cells per part, and
    no more than fill the GPU beside `programs` (heads x tokens). A power of two (few distinct kernels)."""
    want = min(triton.cdiv(n_cells, 4 * bn), triton.cdiv(ATTENTION_PROGRAMS, programs))
    return 1 << (max(want, 1).bit_length() - 1)


def attention_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_q8: bool, v_q8: bool,
                     pos: torch.Tensor, base: torch.Tensor, n_head_kv: int, dv: int, scale: float,
                     window: int, config: tuple[int, int] | None = None, n_cells: int = 0,
                     splits: int | None = None) -> torch.Tensor:
    """q (n, heads, dk) against cache rows (cells, bytes) of f16 or q8_0: (n, heads * dv) float32. config: (cells
    per step, warps). n_cells: the longest context a token may have (the cache's size; fixed for a recorded
    graph): long ones are cut into `splits` parts (attention_splits) computed side by side, then merged."""
    q = q.float().contiguous()
    n, heads, dk = q.shape
    width = triton.next_power_of_2(max(dk, dv))
    # a step's keys are (cells, width) floats in registers: MLA's 576-wide latent rows at 128 cells spilled them,
    # and DeepSeek-V2-Lite's generation halved (125.7 against 229.5 t/s at 32 cells)
    bn, warps = config or ATTENTION_DECODE_CONFIG
    bn = min(bn, max(32, 16384 // width))
    if splits is None:
        splits = attention_splits(n_cells, heads * n, bn)
    if splits > 1 and n_cells < 1:
        raise ValueError("attention_decode: splitting the cache needs its size (n_cells)")
    out = torch.empty(n, heads, dv, dtype=torch.float32, device=q.device)
    kc, vc = (c if q8 else c.view(torch.float16) for c, q8 in ((k_cache, k_q8), (v_cache, v_q8)))
    chunk = triton.cdiv(triton.cdiv(max(n_cells, 1), splits), bn) * bn
    acc, part = (out, out) if splits == 1 else (
        torch.empty(n, heads, splits, dv, dtype=torch.float32, device=q.device),
        torch.empty(n, heads, splits, 2, dtype=torch.float32, device=q.device))
    _attn_decode[(heads, n, splits)](q, kc, vc, pos, base, acc, part, heads, heads // n_head_kv, dk, dv,
                                     kc.shape[1], vc.shape[1], scale, window, chunk, K_Q8=k_q8, V_Q8=v_q8, BN=bn,
                                     BD=width, PARTIAL=splits > 1, num_warps=warps)
    if splits > 1:
        _attn_combine[(heads, n)](acc, part, out, heads, splits, dv, SP=triton.next_power_of_2(splits),
                                  BD=triton.next_power_of_2(dv))
    return out.view(n, heads * dv)


def store_q8_0(x: torch.Tensor, cache: torch.Tensor, cells: torch.Tensor) -> None:
    """Rows of x (n, width) quantized to q8_0 into cache rows `cells` (n,)."""
    x = x.float().reshape(x.shape[0], -1).contiguous()
    n_blocks = x.shape[1] // 32
    _quantize_q8_0_rows[(x.shape[0], triton.cdiv(n_blocks, 16))](x, cache, cache.view(torch.float16), cells, n_blocks,
                                                                 cache.shape[1],
                                                                 BLOCKS=16)
