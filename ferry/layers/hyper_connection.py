"""DeepSeek-V4's manifold-constrained hyper-connections (mHC): the residual is n_hc parallel streams,
(n, n_hc * n_embd). Around each sub-layer, `pre` mixes the streams into the sub-layer's input and `post` writes its output back:
X'[k] = post[k] * y + sum_j comb[j, k] * X[j], with pre = sigmoid(.) + eps, post = 2 sigmoid(.) and comb a
softmax made doubly stochastic by Sinkhorn rounds, all from a linear map of the RMS-normed streams. The head
collapses the streams with a `pre` of its own."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ferry.weight import Weight


@dataclass
class HyperConnection:
    fn: Weight  # ((2 + n_hc) * n_hc, n_hc * n_embd): pre, post and comb logits from the normed streams
    base: torch.Tensor  # ((2 + n_hc) * n_hc,)
    scale: torch.Tensor  # (3,): pre's, post's and comb's
    n_hc: int
    n_iters: int  # Sinkhorn rounds
    eps: float  # hyper_connection.epsilon
    norm_eps: float
    ones: torch.Tensor  # (n_hc * n_embd,): the streams' RMSNorm has no weight

    def pre(self, ops, streams):
        """(the sub-layer's input (n, n_embd), post (n, n_hc), comb (n, n_hc, n_hc)) from streams (n, n_hc * n_embd)."""
        mix = ops.linear(ops.rms_norm(streams, self.ones, self.norm_eps), self.fn)
        return ops.hyper_pre(streams, mix, self.base, self.scale, self.n_hc, self.n_iters, self.eps)

    def __call__(self, ops, streams, sublayer):
        """The streams after sublayer(ops, input) wrapped in pre and post."""
        x, post, comb = self.pre(ops, streams)
        return ops.hyper_post(streams, sublayer(ops, x), post, comb)


@dataclass
class HyperHead:
    """The streams collapsed into one before the final norm: sum_j pre[j] X[j], pre = sigmoid(.) + eps."""

    fn: Weight  # (n_hc, n_hc * n_embd)
    base: torch.Tensor  # (n_hc,)
    scale: torch.Tensor  # (1,)
    n_hc: int
    eps: float
    norm_eps: float
    ones: torch.Tensor

    def __call__(self, ops, streams):
        mix = ops.linear(ops.rms_norm(streams, self.ones, self.norm_eps), self.fn)
        return ops.hyper_collapse(streams, mix, self.base, self.scale, self.n_hc, self.eps)


def sinkhorn(comb: torch.Tensor, n_iters: int, eps: float) -> torch.Tensor:
    """comb (n, src, dst) after its softmax over dst (+ eps): columns normalised, then n_iters - 1 rounds of rows
    and columns (transformers' and llama.cpp's order)."""
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(n_iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return comb
