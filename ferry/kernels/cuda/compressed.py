"""DeepSeek-V4's compressed attention (layers/compressed_attention.py) on the GPU, as kernels whose shapes and indices
do not follow the position (they read it from the device), so that a recorded decode step serves every length:

- compress_step: each token's kv and score rows into its compressor's ring (position p at row p % ring); where a
  token completes a window, that window's rows pooled into its entry (a softmax over the window's positions per
  channel, RMSNorm, rope at the window's first position), all in one program.
- attention_compressed: each query's heads over the last `window` cache cells of its sequence and the compressed
  entries it sees (every complete one, or those the indexer chose), with each head's sink logit: tensor-core
  products over blocks of slots, the slots split between programs and merged (attention's _attn_combine). Decode
  steps and prompt u-batches alike (a prompt's windows are pooled by TorchOps.compress instead)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ferry.kernels.cuda.attention import _attn_combine, attention_splits

POOL_ROWS = 8  # a window's positions pooled per step (4 blocks of them in registers: kv and score, each pair's halves)
HEADS, SLOTS = 16, 32  # attention: heads per program (tl.dot's least rows), slots per step


@triton.jit
def _compress_step(kv, score, ape, ring_kv, ring_score, entries, norm, cos, sin, pos, n, ratio, ring, d, width,
                   n_rot, angle_row, eps, BW: tl.constexpr, BP: tl.constexpr, BR: tl.constexpr, OVERLAP: tl.constexpr,
                   NEOX: tl.constexpr):
    """Tokens 0 .. n - 1 in turn: the row into the ring (the score with its bias by place), then, where position p
    completes window w = (p + 1) / ratio - 1, the window pooled. OVERLAP: rows 0 .. ratio - 1 of the pool are the
    previous window's first `d` channels, rows ratio .. 2 ratio - 1 this window's last `d` (width 2 d); window 0 has
    no previous one (score -inf). The channels go as pairs (a, b): rope's pairs in its tail, neighbours before it."""
    c = tl.arange(0, BW)
    cm = c < width
    i = tl.arange(0, BP)
    live = i < d // 2
    k = i - (d - n_rot) // 2  # the pair's place in rope's tail (< 0: before it)
    if NEOX:
        a = tl.where(k < 0, 2 * i, d - n_rot + k)
        b = tl.where(k < 0, 2 * i + 1, d - n_rot + k + n_rot // 2)
    else:
        a = 2 * i
        b = 2 * i + 1
    for t in range(0, n):
        p = tl.load(pos + t)
        at = (p % ring) * width + c
        tl.store(ring_kv + at, tl.load(kv + t * width + c, mask=cm), mask=cm)
        tl.store(ring_score + at, tl.load(score + t * width + c, mask=cm)
                 + tl.load(ape + (p % ratio) * width + c, mask=cm), mask=cm)
        tl.debug_barrier()  # the rows just stored, read back below by other threads of the program
        if (p + 1) % ratio == 0:
            w = (p + 1) // ratio - 1
            rows = ratio
            first = w * ratio
            if OVERLAP:
                rows = 2 * ratio
                first = w * ratio - ratio
            m_a = tl.full((BP,), -1e30, dtype=tl.float32)
            m_b = tl.full((BP,), -1e30, dtype=tl.float32)
            l_a = tl.zeros((BP,), dtype=tl.float32)
            l_b = tl.zeros((BP,), dtype=tl.float32)
            x_a = tl.zeros((BP,), dtype=tl.float32)
            x_b = tl.zeros((BP,), dtype=tl.float32)
            for r0 in range(0, rows, BR):
                r = r0 + tl.arange(0, BR)
                at_pos = first + r  # each row's position
                ok = (r < rows) & (at_pos >= 0)
                half = 0 * r
                if OVERLAP:
                    half = tl.where(r >= ratio, d, 0)
                row = tl.where(ok, at_pos % ring, 0) * width + half
                m2 = ok[:, None] & live[None, :]
                s_a = tl.load(ring_score + row[:, None] + a[None, :], mask=m2, other=float("-inf"))
                s_b = tl.load(ring_score + row[:, None] + b[None, :], mask=m2, other=float("-inf"))
                v_a = tl.load(ring_kv + row[:, None] + a[None, :], mask=m2, other=0.0)
                v_b = tl.load(ring_kv + row[:, None] + b[None, :], mask=m2, other=0.0)
                new_a = tl.maximum(m_a, tl.max(s_a, 0))
                new_b = tl.maximum(m_b, tl.max(s_b, 0))
                e_a = tl.exp(s_a - new_a[None, :])
                e_b = tl.exp(s_b - new_b[None, :])
                x_a = x_a * tl.exp(m_a - new_a) + tl.sum(e_a * v_a, 0)
                x_b = x_b * tl.exp(m_b - new_b) + tl.sum(e_b * v_b, 0)
                l_a = l_a * tl.exp(m_a - new_a) + tl.sum(e_a, 0)
                l_b = l_b * tl.exp(m_b - new_b) + tl.sum(e_b, 0)
                m_a, m_b = new_a, new_b
            x_a = tl.where(live, x_a / tl.where(live, l_a, 1.0), 0.0)
            x_b = tl.where(live, x_b / tl.where(live, l_b, 1.0), 0.0)
            rs = 1.0 / tl.sqrt((tl.sum(x_a * x_a, 0) + tl.sum(x_b * x_b, 0)) / d + eps)
            x_a = x_a * rs * tl.load(norm + a, mask=live, other=0.0)
            x_b = x_b * rs * tl.load(norm + b, mask=live, other=0.0)
            roped = live & (k >= 0)
            at_angle = w * ratio * angle_row + k  # the window's first position's angles
            cs = tl.load(cos + at_angle, mask=roped, other=1.0)
            sn = tl.load(sin + at_angle, mask=roped, other=0.0)
            tl.store(entries + w * d + a, x_a * cs - x_b * sn, mask=live)
            tl.store(entries + w * d + b, x_a * sn + x_b * cs, mask=live)
        tl.debug_barrier()  # the next token's row may take the slot of a row this one pooled


def compress_step(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor, ring_kv: torch.Tensor,
                  ring_score: torch.Tensor, entries: torch.Tensor, norm: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, pos: torch.Tensor, ratio: int, n_rot: int, neox: bool, eps: float) -> None:
    """A compressor's step for one sequence's tokens at positions pos (n,) (device integers, consecutive): kv and
    score (n, width) its projections, ape (ratio, width) the score's bias by place; ring_kv / ring_score (ring,
    width) and entries (cap, d) its state, float32, updated in place; norm (d,); cos / sin (positions, n_rot / 2) its
    rope's angles by position."""
    n, width = kv.shape
    d = entries.shape[1]
    _compress_step[(1,)](kv.float().contiguous(), score.float().contiguous(), ape, ring_kv, ring_score, entries,
                         norm, cos, sin, pos, n, ratio, ring_kv.shape[0], d, width, n_rot, cos.stride(0), eps,
                         BW=triton.next_power_of_2(width), BP=triton.next_power_of_2(d // 2), BR=POOL_ROWS,
                         OVERLAP=width == 2 * d, NEOX=neox, num_warps=4)


@triton.jit
def _attn_compressed(q, cache, entries, sel, pos, base, acc_out, part, n_heads, n_sel, window, ratio, ring, n_slots,
                     d, k_row, scale, chunk, BH: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                     SELECT: tl.constexpr):
    """Heads hb * BH .. of token t over its slots s * chunk .. (s + 1) * chunk - 1: slot j < window is the cell of
    position pos - window + 1 + j (f16 cache rows from base; ring > 0: position a at base + a % ring), slot window + e the entry e (SELECT: the entry
    sel[t, e], -1 none), seen where its window is complete, e < (pos + 1) / ratio. Keys are the values. The
    unnormalised sum, running max and denominator go to _attn_combine's layout."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    hm = h < n_heads
    kk = tl.arange(0, BK)
    vv = tl.arange(0, BV)
    p = tl.load(pos + t)
    b0 = tl.load(base + t)
    seen = tl.where(ratio > 0, (p + 1) // tl.maximum(ratio, 1), 0)
    begin = tl.program_id(2) * chunk
    end = tl.minimum(n_slots, begin + chunk)
    if not SELECT:
        end = tl.minimum(end, window + seen)
    m_i = tl.full((BH,), -1e30, dtype=tl.float32)
    l_i = tl.zeros((BH,), dtype=tl.float32)
    acc = tl.zeros((BH, BV), dtype=tl.float32)
    for n0 in range(begin, end, BN):
        j = n0 + tl.arange(0, BN)
        at = p - window + 1 + j
        in_win = (j < window) & (at >= 0) & (j < end)
        cell = tl.where(in_win, b0 + tl.where(ring > 0, at % tl.maximum(ring, 1), at), 0)
        if SELECT:
            e = tl.load(sel + t * n_sel + j - window, mask=(j >= window) & (j < end), other=-1).to(tl.int64)
        else:
            e = (j - window).to(tl.int64)
        in_ent = (j >= window) & (j < end) & (e >= 0) & (e < seen)
        e = tl.where(in_ent, e, 0)
        live = in_win | in_ent
        s = tl.zeros((BH, BN), dtype=tl.float32)
        for k0 in range(0, d, BK):
            km = (k0 + kk < d)[:, None]
            qc = tl.load(q + (t * n_heads + h)[:, None] * d + (k0 + kk)[None, :],
                         mask=hm[:, None] & (k0 + kk < d)[None, :], other=0.0)
            kt = tl.load(cache + cell[None, :] * k_row + (k0 + kk)[:, None], mask=in_win[None, :] & km, other=0.0)
            kt += tl.load(entries + e[None, :] * d + (k0 + kk)[:, None], mask=in_ent[None, :] & km,
                          other=0.0).to(tl.float16)
            s += tl.dot(qc, kt)
        s = tl.where(live[None, :], s * scale, -1e30)
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        w = tl.where(live[None, :], tl.exp(s - m_new[:, None]), 0.0)
        alpha = tl.exp(m_i - m_new)
        vm = (vv < d)[None, :]
        v = tl.load(cache + cell[:, None] * k_row + vv[None, :], mask=in_win[:, None] & vm, other=0.0)
        v += tl.load(entries + e[:, None] * d + vv[None, :], mask=in_ent[:, None] & vm, other=0.0).to(tl.float16)
        acc = acc * alpha[:, None] + tl.dot(w.to(tl.float16), v)
        l_i = l_i * alpha + tl.sum(w, axis=1)
        m_i = m_new
    at_out = (t * n_heads + h) * tl.num_programs(2) + tl.program_id(2)
    tl.store(acc_out + at_out[:, None] * d + vv[None, :], acc, mask=hm[:, None] & (vv < d)[None, :])
    tl.store(part + at_out * 2, m_i, mask=hm)
    tl.store(part + at_out * 2 + 1, l_i, mask=hm)


def attention_compressed(q: torch.Tensor, cache: torch.Tensor, entries: torch.Tensor | None,
                         select: torch.Tensor | None, pos: torch.Tensor, base: torch.Tensor, window: int, ratio: int,
                         scale: float, sinks: torch.Tensor, splits: int | None = None, ring: int = 0) -> torch.Tensor:
    """q (n, heads, d) of one sequence's batch (a decode step or a prompt u-batch): each token's heads over the cache
    cells base + the last `window` positions up to its own (cache: (cells, d) f16 rows, as bytes or f16), then the
    compressed entries (entries: (cap, d) float32, ratio their compression; None: none) that it sees, all of them or
    (select: (n, top_k) entry ids, -1 none) those chosen; sinks (heads,) float32 in each head's denominator: (n,
    heads * d) float32. ring > 0: the window's cells are a ring of that many rows (KVCache.ring), position a at
    base + a % ring."""
    n, heads, d = q.shape
    q = q.to(torch.float16).contiguous()
    cache = cache.view(torch.float16)
    if entries is None:
        entries, ratio = cache, 0  # no entries: their pointer never read
    n_sel = select.shape[1] if select is not None else 0
    n_slots = window + (n_sel if select is not None else (entries.shape[0] if ratio else 0))
    blocks = triton.cdiv(heads, HEADS)
    if splits is None:
        splits = attention_splits(n_slots, n * blocks, SLOTS // 4)
    chunk = triton.cdiv(triton.cdiv(n_slots, splits), SLOTS) * SLOTS
    acc = torch.empty(n, heads, splits, d, dtype=torch.float32, device=q.device)
    part = torch.empty(n, heads, splits, 2, dtype=torch.float32, device=q.device)
    sel = select.to(torch.int32).contiguous() if select is not None else pos
    _attn_compressed[(n, blocks, splits)](q, cache, entries, sel, pos, base, acc, part, heads, n_sel, window, ratio,
                                          ring, n_slots, d, cache.shape[1], scale, chunk, BH=HEADS, BN=SLOTS, BK=64,
                                          BV=triton.next_power_of_2(d), SELECT=select is not None, num_warps=8)
    out = torch.empty(n, heads, d, dtype=torch.float32, device=q.device)
    _attn_combine[(heads, n)](acc, part, out, sinks.float().contiguous(), heads, splits, d,
                              SP=triton.next_power_of_2(splits), BD=triton.next_power_of_2(d), SINKS=True)
    return out.view(n, heads * d)
