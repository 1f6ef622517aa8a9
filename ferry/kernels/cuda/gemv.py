"""Quantized GEMV for few tokens (token generation): a split Q8_0 / Q4_0 / MXFP4 matrix times float rows, optionally
with the RMSNorm of the input taken inside; per-head float GEMVs (MLA's latent projections) and a float router's
GEMV."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ferry.kernels.cuda.layout import GEMV_KINDS, Split, _qdot


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
    (benchmarks/gemv_kernels.py, docs/performance.md 2026-11-23; differences under 1 us are noise there)."""
    if outputs >= 16 * 528:  # the output head
        return 16, 256, 8
    if outputs <= 1024 or cols > 2048:  # few rows (k, v, kv_a) or long ones (attn_output): a row in one step
        return 2, 2048, 4
    return 8, 512, 8


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


def gemv_float(w: torch.Tensor, x: torch.Tensor, config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """x (n, cols) float32 times a float32 / float16 matrix w (rows, cols) transposed, as one launch: (n, rows)
    float32 (a router: cuBLAS ran two kernels after a copy of the weight). config: (rows per program, columns per
    step, warps)."""
    # a router's row in one step: 8 steps of 4 rows took 6.5 us on an H200, (2, 2048, 8) 4.9
    config = config or (2, min(2048, triton.next_power_of_2(w.shape[1])), 8)
    return head_gemv(x.float()[:, None], w[None], config)[:, 0]  # one head
