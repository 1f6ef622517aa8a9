"""DeepSeek-V4's hyper-connections (layers/hyper_connection.py) on the GPU: a sub-layer's mixing (pre, post and the
Sinkhorn-normalised comb from its logits, and the streams collapsed into its input) as one launch, and the write-back
of its output into the streams as another. One program per token: its n_hc x n_hc comb in registers."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _hyper_pre(mix, base, scale, streams, x_out, post_out, comb_out, D, eps, n_iters, HC: tl.constexpr,
               BD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    row = mix + t * (2 + HC) * HC
    j = tl.arange(0, HC)
    pre = tl.sigmoid(tl.load(row + j) * tl.load(scale) + tl.load(base + j)) + eps
    post = 2.0 * tl.sigmoid(tl.load(row + HC + j) * tl.load(scale + 1) + tl.load(base + HC + j))
    jk = j[:, None] * HC + j[None, :]  # [source stream, destination stream]
    c = tl.load(row + 2 * HC + jk) * tl.load(scale + 2) + tl.load(base + 2 * HC + jk)
    c = tl.exp(c - tl.max(c, 1)[:, None])
    c = c / tl.sum(c, 1)[:, None] + eps  # softmax over destinations
    c = c / (tl.sum(c, 0)[None, :] + eps)
    for _ in range(n_iters - 1):
        c = c / (tl.sum(c, 1)[:, None] + eps)
        c = c / (tl.sum(c, 0)[None, :] + eps)
    tl.store(post_out + t * HC + j, post)
    tl.store(comb_out + t * HC * HC + jk, c)
    for d0 in range(0, D, BD):
        d = d0 + tl.arange(0, BD)
        m = d < D
        xs = tl.load(streams + t * HC * D + j[:, None] * D + d[None, :], mask=m[None, :], other=0.0)
        tl.store(x_out + t * D + d, tl.sum(pre[:, None] * xs, 0), mask=m)


@triton.jit
def _hyper_post(streams, y, post, comb, out, D, HC: tl.constexpr, BD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    m = d < D
    j = tl.arange(0, HC)
    yt = tl.load(y + t * D + d, mask=m, other=0.0)
    acc = tl.load(post + t * HC + j)[:, None] * yt[None, :]
    for src in range(HC):  # X'[k] += comb[src, k] X[src]
        xs = tl.load(streams + t * HC * D + src * D + d, mask=m, other=0.0)
        acc += tl.load(comb + t * HC * HC + src * HC + j)[:, None] * xs[None, :]
    tl.store(out + t * HC * D + j[:, None] * D + d[None, :], acc, mask=m[None, :])


def hyper_pre(streams: torch.Tensor, mix: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n_hc: int,
              n_iters: int, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams (n, n_hc * D), mix (n, (2 + n_hc) * n_hc) float32 -> (input (n, D), post (n, n_hc), comb (n, n_hc,
    n_hc)); n_hc a power of two."""
    n = streams.shape[0]
    d = streams.shape[1] // n_hc
    streams, mix = streams.float().contiguous(), mix.float().contiguous()
    x = torch.empty(n, d, device=streams.device)
    post = torch.empty(n, n_hc, device=streams.device)
    comb = torch.empty(n, n_hc, n_hc, device=streams.device)
    _hyper_pre[(n,)](mix, base, scale, streams, x, post, comb, d, eps, n_iters, HC=n_hc, BD=256)
    return x, post, comb


def hyper_post(streams: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """X'[k] = post[k] y + sum_j comb[j, k] X[j]: (n, n_hc * D)."""
    n, n_hc = post.shape
    d = y.shape[1]
    out = torch.empty(n, n_hc * d, device=y.device)
    _hyper_post[(n, triton.cdiv(d, 256))](streams.float().contiguous(), y.float().contiguous(), post, comb, out, d,
                                           HC=n_hc, BD=256)
    return out
