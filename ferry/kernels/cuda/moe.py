"""The routed experts on the GPU: expert GEMVs over (token, expert) pairs for few tokens, the grouped GEMM over pairs
sorted by expert for many (its schedule computed on the GPU, weights expanded in registers), the fixed-order sum of a
token's pairs, and the unpacking of streamed experts into their slots. None needs the host to know which experts
were hit."""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from gguf.constants import GGML_QUANT_SIZES

from ferry.kernels.activations import SILU_CLAMP_LIMIT, SWIGLU_OAI
from ferry.kernels.cuda.layout import GEMV_KINDS, SCALE_BYTES, Split, _nibbles, _qdot, _scale

_OAI_ALPHA: tl.constexpr = tl.constexpr(SWIGLU_OAI[0])
_OAI_LIMIT: tl.constexpr = tl.constexpr(SWIGLU_OAI[1])
_CLAMP_LIMIT: tl.constexpr = tl.constexpr(SILU_CLAMP_LIMIT)


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
def _glu(g, u, ACT: tl.constexpr):
    """The gated activation of GLUS' number ACT: act(g) * u, or gpt-oss's or DeepSeek-V4's clamped SwiGLU
    (kernels/activations.py)."""
    if ACT == 2:
        g = tl.minimum(g, _OAI_LIMIT)
        u = tl.minimum(tl.maximum(u, -_OAI_LIMIT), _OAI_LIMIT)
        return g / (1.0 + tl.exp(-_OAI_ALPHA * g)) * (u + 1.0)
    elif ACT == 3:
        g = tl.minimum(g, _CLAMP_LIMIT)
        u = tl.minimum(tl.maximum(u, -_CLAMP_LIMIT), _CLAMP_LIMIT)
        return g / (1.0 + tl.exp(-g)) * u
    else:
        return _act(g, ACT) * u


@triton.jit
def _pair_rows(ids, p, r, rmask, rows):
    """Pair p's rows r of its expert in a stacked tensor of `rows` rows an expert: (their row indices, which to read);
    a pair whose id is -1 (its expert elsewhere) reads none (index 0)."""
    e = tl.load(ids + p).to(tl.int64)
    return tl.maximum(e, 0) * rows + r, rmask & (e >= 0)


@triton.jit
def _moe_gate_up(gq, gd, uq, ud, gbias, ubias, x, ids, h, rows, K, n_used, KIND: tl.constexpr, ACT: tl.constexpr,
                 BIAS: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr):
    """Pair p = (token p // n_used, its expert ids[p]): h[p, r] = glu(gate_e[r] . x (+ its bias), up_e[r] . x (+ its
    bias)); a pair whose id is -1 (its expert elsewhere: the hybrid runtime's resident experts) reads no weights
    and gives zeros."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    p = tl.program_id(1).to(tl.int64)
    rmask = r < rows
    row, live = _pair_rows(ids, p, r, rmask, rows)
    xt = x + (p // n_used) * K
    g = tl.zeros((BR,), dtype=tl.float32)
    u = tl.zeros((BR,), dtype=tl.float32)
    for k0 in range(0, K, BK):
        g += _qdot(gq, gd, row, live, xt, k0, K, KIND, BK)
        u += _qdot(uq, ud, row, live, xt, k0, K, KIND, BK)
    if BIAS:
        g += tl.load(gbias + row, mask=live, other=0.0)
        u += tl.load(ubias + row, mask=live, other=0.0)
    tl.store(h + p * rows + r, _glu(g, u, ACT), mask=rmask)


@triton.jit
def _moe_down(dq, dd, dbias, h, ids, weights, y, rows, K, KIND: tl.constexpr, BIAS: tl.constexpr, BR: tl.constexpr,
              BK: tl.constexpr):
    """Pair p: y[p, r] = weights[p] * (down_e[r] . h[p] (+ its bias)); the caller sums each token's pairs in a fixed
    order (no atomics: the same inputs give the same bits). One program per pair and row block: summing a token's
    pairs in this kernel leaves too few programs (37.5-41.8 against 32.4 us for Qwen3's experts on an H100). A pair
    whose id is -1 reads no weights and gives zeros."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    p = tl.program_id(1).to(tl.int64)
    rmask = r < rows
    row, live = _pair_rows(ids, p, r, rmask, rows)
    acc = tl.zeros((BR,), dtype=tl.float32)
    for k0 in range(0, K, BK):
        acc += _qdot(dq, dd, row, live, h + p * K, k0, K, KIND, BK)
    if BIAS:
        acc += tl.load(dbias + row, mask=live, other=0.0)
    tl.store(y + p * rows + r, tl.load(weights + p) * acc, mask=rmask)


@triton.jit
def _block_halves(qs, d, wrow, nmask, b, K, KIND: tl.constexpr):
    """32-block b of the rows wrow (BN, 1) of a split Q8_0 / Q4_0 / MXFP4 matrix, scaled to f16 as two (BN, 16)
    halves: its first 16 columns and its last 16 (for Q4_0 and MXFP4, each byte's low and high nibble: every byte
    read once, no register shuffle). Rows past the matrix, or a block past K, read as zeros."""
    j = tl.arange(0, 16)
    live = nmask[:, None] & (b < K // 32)
    s = _scale(tl.load(d + wrow * (K // 32) + b, mask=live, other=0), KIND)  # (BN, 1)
    if KIND == 0:
        at = qs + wrow * K + b * 32 + j[None, :]
        lo = tl.load(at, mask=live, other=0).to(tl.float32)
        hi = tl.load(at + 16, mask=live, other=0).to(tl.float32)
    else:
        byte = tl.load(qs + wrow * (K // 2) + b * 16 + j[None, :], mask=live, other=0).to(tl.int32)
        lo, hi = _nibbles(byte, KIND)
    return (lo * s).to(tl.float16), (hi * s).to(tl.float16)


@triton.jit
def _tile(tile_row, tile_end, tile, e, src, N, GATHER: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """A grouped GEMM program's share of tile `tile` (of expert e, a stacked tensor of N rows an expert): its sorted
    rows and their mask, its BN output columns n and their mask, those columns' rows of the stacked weight (BN, 1)
    int64, and the rows of x its rows read (src[rows] with GATHER)."""
    r0 = tl.load(tile_row + tile)
    r_end = tl.load(tile_end + tile)
    rows = r0 + tl.arange(0, BM)
    rmask = rows < r_end
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    nmask = n < N
    wrow = (e.to(tl.int64) * N + n.to(tl.int64))[:, None]
    x_rows = tl.load(src + rows, mask=rmask, other=0) if GATHER else rows
    return rows, rmask, n, nmask, wrow, x_rows


@triton.jit
def _store_tile(y, dst, scale, acc, rows, rmask, n, nmask, N, SCATTER: tl.constexpr, SCALE: tl.constexpr):
    """A grouped GEMM program's outputs acc (BM, BN) to y's rows (dst[rows] with SCATTER), times scale at those rows
    with SCALE."""
    y_rows = tl.load(dst + rows, mask=rmask, other=0) if SCATTER else rows
    if SCALE:
        acc = acc * tl.load(scale + y_rows, mask=rmask, other=0.0)[:, None]
    tl.store(y + y_rows.to(tl.int64)[:, None] * N + n[None, :], acc.to(y.dtype.element_ty),
             mask=rmask[:, None] & nmask[None, :])


@triton.jit
def _moe_mm(x, qs, d, uqs, ud, bias, ubias, y, tile_expert, tile_row, tile_end, src, dst, scale, N, K,
            KIND: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr, BIAS: tl.constexpr, GATHER: tl.constexpr,
            SCATTER: tl.constexpr, SCALE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Grouped GEMM over rows sorted by expert: tile i covers sorted rows tile_row[i] .. tile_end[i] (all of
    expert tile_expert[i], -1: no work); row r's output is x[r] . W_e[n] with W_e (split Q8_0 / Q4_0) expanded to
    f16 block by block in registers, f32 accumulation (tensor cores); BK columns (BK / 32 blocks) per loop step.
    GATED: W is the gate and (uqs, ud) the up projection of the same expert, and the output act(x . gate) *
    (x . up), one read of x for both. BIAS: each output plus its expert's bias (bias (n_expert, N); gated, ubias the
    up projection's), before the activation. GATHER: row r reads x[src[r]]; SCATTER: it writes y[dst[r]]; SCALE:
    times scale[dst[r]] (the router's weight of that pair)."""
    tile = tl.program_id(0)
    e = tl.load(tile_expert + tile)
    if e >= 0:
        rows, rmask, n, nmask, wrow, x_rows = _tile(tile_row, tile_end, tile, e, src, N, GATHER, BM, BN)
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
        if BIAS:
            at = e.to(tl.int64) * N + n
            acc += tl.load(bias + at, mask=nmask, other=0.0)[None, :]
            if GATED:
                acc_up += tl.load(ubias + at, mask=nmask, other=0.0)[None, :]
        if GATED:
            acc = _glu(acc, acc_up, ACT)
        _store_tile(y, dst, scale, acc, rows, rmask, n, nmask, N, SCATTER, SCALE)


@triton.jit
def _unpack_experts(raw, ids, d, qs, per_expert, BLOCK: tl.constexpr, HEAD: tl.constexpr, PAYLOAD: tl.constexpr,
                    BB: tl.constexpr):
    """Staged expert j (its GGUF blocks, compact in raw) into expert ids[j]'s slot of a Split: each block's HEAD
    scale bytes to d, its other PAYLOAD bytes to qs (all as bytes)."""
    j = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1) * BB + tl.arange(0, BB)
    live = b < per_expert
    e = tl.load(ids + j).to(tl.int64)
    src = raw + (j * per_expert + b) * BLOCK
    dst = e * per_expert + b
    for i in tl.static_range(HEAD):
        tl.store(d + dst * HEAD + i, tl.load(src + i, mask=live), mask=live)
    k = tl.arange(0, PAYLOAD)
    tl.store(qs + dst[:, None] * PAYLOAD + k[None, :], tl.load(src[:, None] + HEAD + k[None, :], mask=live[:, None]),
             mask=live[:, None])


def unpack_experts(raw: torch.Tensor, ids: torch.Tensor, split: "Split") -> None:
    """raw: the GGUF bytes of len(ids) experts of a stacked Q8_0 / Q4_0 / MXFP4 tensor, one after another; ids (on the
    GPU): which expert each is. Fills those experts' slots of `split` in one launch (the layout Split.of makes)."""
    per_expert = split.d.numel() // split.ne[2]
    block, head = GGML_QUANT_SIZES[split.qtype][1], SCALE_BYTES[split.qtype]
    bb = 256
    _unpack_experts[(ids.numel(), triton.cdiv(per_expert, bb))](raw, ids, split.d.view(torch.uint8),
                                                                 split.qs.view(torch.uint8), per_expert,
                                                                 BLOCK=block, HEAD=head, PAYLOAD=block - head, BB=bb)


GLUS = {"silu": 0, "gelu": 1, "swiglu_oai": 2, "silu_clamp": 3}  # the gated activations of the expert kernels (_glu)


def moe_gemv(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate: Split, up: Split, down: Split,
             act: str, wait_down: torch.cuda.Event | None = None, residual: torch.Tensor | None = None,
             config: tuple[int, int, int] | None = None, biases: tuple | None = None) -> torch.Tensor:
    """The routed experts of few tokens: x (n, n_embd), ids / weights (n, n_used) on the GPU; gate/up/down the
    stacked expert tensors; act a name of GLUS; biases: gate's, up's and down's (n_expert, rows) float32 on the GPU
    (gpt-oss), or None. Returns (n, n_embd) float32, plus `residual` (n, n_embd) when given. config: (rows per
    program, columns per step, warps)."""
    gb, ub, db = biases if biases is not None else (None, None, None)
    h = moe_gate_up_gemv(x, ids, gate, up, act, config, (gb, ub) if biases is not None else None)
    if wait_down is not None:  # the down projection's weights are still being copied
        torch.cuda.current_stream(x.device).wait_event(wait_down)
    return moe_down_gemv(h, ids, weights, down, residual, config, db)


def _moe_gemv_config(n_ff: int, pairs: int) -> tuple[int, int, int]:
    # the fastest of sweeps on an H100 / H200 at Qwen3-30B-A3B's (first) and DeepSeek-V2-Lite's (second) expert shapes
    return (8, 256, 4) if n_ff * pairs < 8192 else (8, 512, 2)


def moe_gate_up_gemv(x: torch.Tensor, ids: torch.Tensor, gate: Split, up: Split, act: str,
                     config: tuple[int, int, int] | None = None, biases: tuple | None = None) -> torch.Tensor:
    """The experts' first half for few tokens: glu(gate . x (+ its bias), up . x (+ its bias)) of each (token, slot)
    pair, (n * n_used, n_ff) float32 in pair order; biases: (gate's, up's) or None."""
    n, n_used = ids.shape
    n_embd, n_ff = gate.ne[0], gate.ne[1]
    br, bk, warps = config or _moe_gemv_config(n_ff, n * n_used)
    x = x.float().contiguous()
    ids = ids.to(torch.int32).contiguous()
    h = torch.empty(n * n_used, n_ff, dtype=torch.float32, device=x.device)
    gb, ub = (b.float().contiguous() for b in biases) if biases is not None else (x, x)
    _moe_gate_up[(triton.cdiv(n_ff, br), n * n_used)](gate.qs, gate.d, up.qs, up.d, gb, ub, x, ids, h, n_ff, n_embd,
                                                       n_used, KIND=GEMV_KINDS[gate.qtype], ACT=GLUS[act],
                                                       BIAS=biases is not None, BR=br, BK=bk, num_warps=warps)
    return h


def moe_down_gemv(h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, down: Split,
                  residual: torch.Tensor | None = None, config: tuple[int, int, int] | None = None,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """The experts' second half for few tokens: h (n * n_used, n_ff) in pair order -> each token's router-weighted
    sum of down . h (+ its bias) over its slots, (n, n_embd) float32 (plus `residual` when given)."""
    n, n_used = ids.shape
    n_ff, n_embd = down.ne[0], down.ne[1]
    br, bk, warps = config or _moe_gemv_config(n_ff, n * n_used)
    ids = ids.to(torch.int32).contiguous()
    y = torch.empty(n * n_used, n_embd, dtype=torch.float32, device=h.device)
    h = h.float().contiguous()
    _moe_down[(triton.cdiv(n_embd, br), n * n_used)](down.qs, down.d, bias.float().contiguous() if bias is not None
                                                      else h, h, ids, weights.float().contiguous(), y, n_embd, n_ff,
                                                      KIND=GEMV_KINDS[down.qtype], BIAS=bias is not None, BR=br,
                                                      BK=bk, num_warps=warps)
    if n_used == 1 and residual is None:
        return y
    return sum_pairs(y, n_used, residual)


def sum_pairs(y: torch.Tensor, n_used: int, residual: torch.Tensor | None = None) -> torch.Tensor:
    """y (n * n_used, N) float32 -> (n, N): each token's n_used rows summed in order, plus residual (n, N) when
    given (one kernel: torch's reduction over the middle of (n, n_used, N) took twice as long on an H100)."""
    n, width = y.shape[0] // n_used, y.shape[1]
    out = torch.empty(n, width, dtype=torch.float32, device=y.device)
    res = residual.float().contiguous() if residual is not None else y
    _sum_pairs[(n, triton.cdiv(width, 1024))](y, res, out, n_used, width, HAS_RES=residual is not None, BN=1024)
    return out


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
# expert shapes of Qwen3-30B-A3B and DeepSeek-V2-Lite (benchmarks/moe_kernels.py; docs/performance.md, 2026-11-23)
MOE_MM_CONFIGS = {(16, True): (64, 64, 4, 3), (16, False): (64, 64, 4, 3),
                  (32, True): (64, 32, 4, 3), (32, False): (64, 64, 4, 3),
                  (64, True): (64, 64, 4, 3), (64, False): (128, 32, 4, 4),
                  (128, True): (64, 32, 4, 3), (128, False): (128, 32, 4, 4)}


def moe_mm(xs: torch.Tensor, w: Split, sched, out_dtype, block: int, up: Split | None = None, act: str = "silu",
           rows_from: torch.Tensor | None = None, rows_to: torch.Tensor | None = None,
           row_scale: torch.Tensor | None = None, config: tuple[int, int, int, int] | None = None,
           out: torch.Tensor | None = None, bias: torch.Tensor | None = None,
           up_bias: torch.Tensor | None = None) -> torch.Tensor:
    """Sorted row r (sched's order) times its expert's (rows, cols) matrix transposed: xs (pairs, cols) f16, row
    r of it being xs[rows_from[r]] when given, else xs[r]; with `up`, act(xs . w) * (xs . up) (w the gate). The
    result (pairs, rows) holds row r at rows_to[r] when given (times row_scale[rows_to[r]] when given), else at r.
    bias (n_expert, rows) float32, and up_bias with `up`: added to each expert's outputs (gpt-oss), act a name of
    GLUS. config: (BN, BK, warps, stages), else MOE_MM_CONFIGS' choice. out: where to write it (rows no tile covers keep
    what it held), else a new tensor."""
    cols, rows, _ = w.ne
    _, tile_expert, tile_row, tile_end = sched
    pairs = tile_row.new_empty(0) if rows_from is None else rows_from
    y = out if out is not None else torch.empty(xs.shape[0] if rows_from is None else rows_from.shape[0], rows,
                                                dtype=out_dtype, device=xs.device)
    bn, bk, warps, stages = config or MOE_MM_CONFIGS[block, up is not None]
    other = up if up is not None else w
    bias = bias.float().contiguous() if bias is not None else None
    up_bias = up_bias.float().contiguous() if up_bias is not None else bias
    _moe_mm[(tile_expert.numel(), triton.cdiv(rows, bn))](
        xs, w.qs, w.d, other.qs, other.d, bias if bias is not None else y, up_bias if up_bias is not None else y, y,
        tile_expert, tile_row, tile_end, pairs, rows_to if rows_to is not None else pairs,
        row_scale if row_scale is not None else y, rows, cols, KIND=GEMV_KINDS[w.qtype], GATED=up is not None,
        ACT=GLUS[act], BIAS=bias is not None, GATHER=rows_from is not None,
        SCATTER=rows_to is not None, SCALE=row_scale is not None, BM=block, BN=bn, BK=bk, num_warps=warps,
        num_stages=stages)
    return y
