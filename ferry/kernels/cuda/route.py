"""A MoE router on the GPU: scores, top-k and weights of each token in one launch."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _route(logits, bias, logit_bias, weights, ids, n_expert, n_used, scale, GATING: tl.constexpr,
           HAS_BIAS: tl.constexpr, HAS_LOGIT_BIAS: tl.constexpr, NORM: tl.constexpr, BE: tl.constexpr,
           BU: tl.constexpr):
    """One token's router: its logits (+ the router's own bias when given), scores (GATING 0: softmax, 1: sigmoid,
    2: the logits themselves, gpt-oss's), the n_used best by score (+ the choice bias when given) in descending
    order, their unbiased scores (renormalised to sum 1 when NORM; gpt-oss's: a softmax over the chosen logits) times
    scale."""
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BE)
    live = e < n_expert
    z = tl.load(logits + t * n_expert + e, mask=live, other=-float("inf"))
    if HAS_LOGIT_BIAS:
        z += tl.load(logit_bias + e, mask=live, other=0.0)
    if GATING == 2:
        p = z
    elif GATING == 1:
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
    if GATING == 2:  # a softmax over the chosen logits
        w_sel = tl.where(j < n_used, tl.exp(w_sel - tl.max(tl.where(j < n_used, w_sel, -float("inf")), axis=0)), 0.0)
        w_sel = w_sel / tl.sum(w_sel, axis=0)
    elif NORM:
        w_sel = w_sel / tl.sum(tl.where(j < n_used, w_sel, 0.0), axis=0)
    tl.store(weights + t * n_used + j, w_sel * scale, mask=j < n_used)
    tl.store(ids + t * n_used + j, id_sel, mask=j < n_used)


GATINGS = {"softmax": 0, "sigmoid": 1, "softmax_weight": 2}  # layers.ffn.Routing's gating -> _route's GATING


def route(logits: torch.Tensor, n_used: int, norm: bool, scale: float, gating: str,
          bias: torch.Tensor | None, logit_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits (n, n_expert) float32 -> the n_used best experts per token, best first: (weights (n, n_used)
    float32, ids (n, n_used) int32); gating: a name of GATINGS; see _route."""
    gating = GATINGS[gating]
    logits = logits.float().contiguous()
    n, n_expert = logits.shape
    weights = torch.empty(n, n_used, dtype=torch.float32, device=logits.device)
    ids = torch.empty(n, n_used, dtype=torch.int32, device=logits.device)
    _route[(n,)](logits, bias if bias is not None else logits, logit_bias if logit_bias is not None else logits,
                 weights, ids, n_expert, n_used, scale, GATING=gating, HAS_BIAS=bias is not None,
                 HAS_LOGIT_BIAS=logit_bias is not None, NORM=norm, BE=triton.next_power_of_2(n_expert),
                 BU=triton.next_power_of_2(n_used), num_warps=1 if n_expert <= 512 else 4)  # one warp: no barriers
    return weights, ids
