"""A MoE router on the GPU: scores, top-k and weights of each token in one launch."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


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
