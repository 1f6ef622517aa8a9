"""Attention of a decode-sized batch over the KV cache (f16 or q8_0 rows read in place; flash-decoding over long caches),
DeepSeek sparse attention's prompts over each token's selected cells (attention_selected), and the cache stores: a
fused q|k|v projection's keys and values normed, rotated and written, q8_0 row quantization."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ferry.kernels.cuda.dequant import _f16_at
from ferry.kernels.cuda.norm_rope import _rotated


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
def _attn_decode(q, kc, vc, pos, base, sel, n_sel, out, part, sinks, n_heads, group, dk, dv, k_row, v_row, scale,
                 window, ring, chunk, K_Q8: tl.constexpr, V_Q8: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
                 PARTIAL: tl.constexpr, SINKS: tl.constexpr, SELECT: tl.constexpr):
    """One query head of one token: softmax(q . k * scale) v over the cache cells base[t] + 0 .. pos[t] (the
    last `window` of them when window > 0; ring > 0: position j in cell base[t] + j % ring), online over blocks of BN
    cells; SINKS: the head's sink logit joins the
    denominator (gpt-oss). SELECT (DeepSeek sparse attention): over the cells sel[t, 0 .. n_sel - 1] instead (-1: no
    cell), only those rows read. PARTIAL (flash-decoding): program s of axis 2 takes only positions (slots of sel)
    s * chunk .. (s + 1) * chunk - 1 (chunk a multiple of BN) and leaves its unnormalised sum in out, its running max
    and denominator in part, for _attn_combine (which adds the sink)."""
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
    if SELECT:
        begin = 0
        end = n_sel
    if PARTIAL:
        begin = tl.maximum(begin, tl.program_id(2) * chunk)
        end = tl.minimum(end, (tl.program_id(2) + 1) * chunk)
    m_i = -1e30
    l_i = 0.0
    acc = tl.zeros((BD,), dtype=tl.float32)
    for n0 in range(begin, end, BN):
        j = n0 + tl.arange(0, BN)
        if SELECT:
            cell = tl.load(sel + t * n_sel + j, mask=j < end, other=-1)
            live = cell >= 0
        else:
            cell = b0 + tl.where(ring > 0, j % tl.maximum(ring, 1), j)
            live = (j >= lo) & (j <= p)
        kmask = live[:, None] & (d < dk)[None, :]
        k = _cache_row(kc, cell, kvh * dk + d, k_row, kmask, K_Q8)
        s = tl.where(live, tl.sum(k * qv[None, :], axis=1), -1e30)
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        w = tl.where(live, tl.exp(s - m_new), 0.0)
        alpha = tl.exp(m_i - m_new)
        vmask = live[:, None] & (d < dv)[None, :]
        v = _cache_row(vc, cell, kvh * dv + d, v_row, vmask, V_Q8)
        acc = acc * alpha + tl.sum(w[:, None] * v, axis=0)
        l_i = l_i * alpha + tl.sum(w, axis=0)
        m_i = m_new
    if PARTIAL:
        at = (t * n_heads + h) * tl.num_programs(2) + tl.program_id(2)
        tl.store(out + at * dv + d, acc, mask=d < dv)
        tl.store(part + at * 2, m_i)
        tl.store(part + at * 2 + 1, l_i)
    else:
        if SINKS:
            sink = tl.load(sinks + h)
            m_all = tl.maximum(m_i, sink)
            acc = acc * tl.exp(m_i - m_all)
            l_i = l_i * tl.exp(m_i - m_all) + tl.exp(sink - m_all)
        tl.store(out + (t * n_heads + h) * dv + d, acc / l_i, mask=d < dv)


@triton.jit
def _attn_combine(acc, part, out, sinks, n_heads, splits, dv, SP: tl.constexpr, BD: tl.constexpr,
                  SINKS: tl.constexpr):
    """One head of one token: its `splits` partial results from _attn_decode (PARTIAL) merged, each rescaled by
    exp(its max - the overall max); a split that saw no cell has max -1e30 and weighs nothing. SINKS: the head's
    sink logit joins the denominator."""
    h = tl.program_id(0)
    t = tl.program_id(1).to(tl.int64)
    s = tl.arange(0, SP)
    d = tl.arange(0, BD)
    row = (t * n_heads + h) * splits + s
    m = tl.load(part + row * 2, mask=s < splits, other=-1e30)
    m_all = tl.max(m, axis=0)
    if SINKS:
        sink = tl.load(sinks + h)
        m_all = tl.maximum(m_all, sink)
    scale = tl.where(s < splits, tl.exp(m - m_all), 0.0)
    den = tl.sum(tl.load(part + row * 2 + 1, mask=s < splits, other=0.0) * scale, axis=0)
    if SINKS:
        den += tl.exp(sink - m_all)
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
                     splits: int | None = None, sinks: torch.Tensor | None = None,
                     select: torch.Tensor | None = None, ring: int = 0) -> torch.Tensor:
    """q (n, heads, dk) against cache rows (cells, bytes) of f16 or q8_0: (n, heads * dv) float32. config: (cells
    per step, warps). n_cells: the longest context a token may have (the cache's size; fixed for a recorded
    graph): long ones are cut into `splits` parts (attention_splits) computed side by side, then merged. sinks:
    (heads,) float32 on the GPU, each head's sink logit in the softmax's denominator (gpt-oss). select: (n, top_k)
    int32 cell ids (-1: none) each token attends to instead of its whole context (kernels/cuda/indexer.py). ring > 0:
    a sliding window's ring of that many rows per sequence (KVCache.ring): position j at cell base + j % ring."""
    q = q.float().contiguous()
    n, heads, dk = q.shape
    width = triton.next_power_of_2(max(dk, dv))
    # a step's keys are (cells, width) floats in registers: MLA's 576-wide latent rows at 128 cells spilled them,
    # and DeepSeek-V2-Lite's generation halved (125.7 against 229.5 t/s at 32 cells)
    bn, warps = config or ATTENTION_DECODE_CONFIG
    bn = min(bn, max(32, 16384 // width))
    if select is not None:
        select = select.to(torch.int32).contiguous()
        n_cells = select.shape[1]
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
    sink_ptr = q if sinks is None else sinks.float().contiguous()
    _attn_decode[(heads, n, splits)](q, kc, vc, pos, base, pos if select is None else select, n_cells, acc, part,
                                     sink_ptr, heads, heads // n_head_kv, dk, dv, kc.shape[1], vc.shape[1], scale,
                                     window, ring, chunk, K_Q8=k_q8, V_Q8=v_q8, BN=bn, BD=width, PARTIAL=splits > 1,
                                     SINKS=sinks is not None, SELECT=select is not None, num_warps=warps)
    if splits > 1:
        _attn_combine[(heads, n)](acc, part, out, sink_ptr, heads, splits, dv, SP=triton.next_power_of_2(splits),
                                  BD=triton.next_power_of_2(dv), SINKS=sinks is not None)
    return out.view(n, heads * dv)


@triton.jit
def _attn_selected(q, kc, sel, out, part, n_heads, n_sel, dk, dv, k_row, scale, chunk, BH: tl.constexpr,
                   BN: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PARTIAL: tl.constexpr):
    """Heads hb * BH .. of token t against the one key head of the cells sel[t, :] (-1: none), whose values are the
    first dv of each key row (MLA's latent): online softmax over blocks of BN selected cells, the scores and the
    weighted values as tensor-core products (f16 in, float32 sums), dk in pieces of BK. PARTIAL (flash-decoding):
    program s of axis 2 takes slots s * chunk .. (s + 1) * chunk - 1 only and leaves its unnormalised sum in out, its
    running max and denominator in part (_attn_combine's layout)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    hm = h < n_heads
    kk = tl.arange(0, BK)
    vv = tl.arange(0, BV)
    m_i = tl.full((BH,), -1e30, dtype=tl.float32)
    l_i = tl.zeros((BH,), dtype=tl.float32)
    acc = tl.zeros((BH, BV), dtype=tl.float32)
    begin, end = 0, n_sel
    if PARTIAL:
        begin = tl.program_id(2) * chunk
        end = tl.minimum(n_sel, begin + chunk)
    for n0 in range(begin, end, BN):
        j = n0 + tl.arange(0, BN)
        cell = tl.load(sel + t * n_sel + j, mask=j < end, other=-1).to(tl.int64)
        live = cell >= 0
        s = tl.zeros((BH, BN), dtype=tl.float32)
        for k0 in range(0, dk, BK):
            qc = tl.load(q + (t * n_heads + h)[:, None] * dk + (k0 + kk)[None, :],
                         mask=hm[:, None] & (k0 + kk < dk)[None, :], other=0.0)
            kt = tl.load(kc + cell[None, :] * k_row + (k0 + kk)[:, None], mask=live[None, :] & (k0 + kk < dk)[:, None],
                         other=0.0)
            s += tl.dot(qc, kt)
        s = tl.where(live[None, :], s * scale, -1e30)
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.where(live[None, :], tl.exp(s - m_new[:, None]), 0.0)
        alpha = tl.exp(m_i - m_new)
        v = tl.load(kc + cell[:, None] * k_row + vv[None, :], mask=live[:, None] & (vv < dv)[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    keep = hm[:, None] & (vv < dv)[None, :]
    if PARTIAL:
        at = (t * n_heads + h) * tl.num_programs(2) + tl.program_id(2)
        tl.store(out + at[:, None] * dv + vv[None, :], acc, mask=keep)
        tl.store(part + at * 2, m_i, mask=hm)
        tl.store(part + at * 2 + 1, l_i, mask=hm)
    else:
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out + (t * n_heads + h)[:, None] * dv + vv[None, :], o, mask=keep)


SELECTED_HEADS, SELECTED_CELLS = 16, 32  # heads per program (tl.dot's least rows), selected cells per step


def attention_selected(q: torch.Tensor, cache: torch.Tensor, select: torch.Tensor, dv: int, scale: float,
                       splits: int | None = None) -> torch.Tensor:
    """q (n, heads, dk) against one shared key head of f16 cache rows (cells, dk), the values the first dv of each row
    (MLA's latent cache), each token over its selected cells only (select: (n, top_k) cell ids, -1 none;
    kernels/cuda/indexer.py): (n, heads * dv) float32. Reads top_k rows per token and block of 16 heads instead of
    the whole cache; a few tokens' (decode) cut into `splits` parts of the selection side by side, then merged
    (attention_splits' rule: the GPU filled)."""
    n, heads, dk = q.shape
    q = q.to(torch.float16).contiguous()
    select = select.to(torch.int32).contiguous()
    cache = cache.view(torch.float16)
    n_sel, blocks = select.shape[1], triton.cdiv(heads, SELECTED_HEADS)
    if splits is None:
        splits = attention_splits(n_sel, n * blocks, SELECTED_CELLS // 4)
    chunk = triton.cdiv(triton.cdiv(n_sel, splits), SELECTED_CELLS) * SELECTED_CELLS
    out = torch.empty(n, heads, dv, dtype=torch.float32, device=q.device)
    acc, part = (out, out) if splits == 1 else (
        torch.empty(n, heads, splits, dv, dtype=torch.float32, device=q.device),
        torch.empty(n, heads, splits, 2, dtype=torch.float32, device=q.device))
    _attn_selected[(n, blocks, splits)](q, cache, select, acc, part, heads, n_sel, dk, dv, cache.shape[1], scale, chunk,
                                        BH=SELECTED_HEADS, BN=SELECTED_CELLS, BK=64, BV=triton.next_power_of_2(dv),
                                        PARTIAL=splits > 1, num_warps=8)
    if splits > 1:
        _attn_combine[(heads, n)](acc, part, out, q, heads, splits, dv, SP=triton.next_power_of_2(splits),
                                  BD=triton.next_power_of_2(dv), SINKS=False)
    return out.view(n, heads * dv)


def store_q8_0(x: torch.Tensor, cache: torch.Tensor, cells: torch.Tensor) -> None:
    """Rows of x (n, width) quantized to q8_0 into cache rows `cells` (n,)."""
    x = x.float().reshape(x.shape[0], -1).contiguous()
    n_blocks = x.shape[1] // 32
    _quantize_q8_0_rows[(x.shape[0], triton.cdiv(n_blocks, 16))](x, cache, cache.view(torch.float16), cells, n_blocks,
                                                                 cache.shape[1],
                                                                 BLOCKS=16)
