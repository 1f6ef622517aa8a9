"""Feed-forward blocks: the dense gated FFN, and the sparse MoE block (router, top-k, experts, sum)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ferry.weight import Weight


@dataclass
class DenseFFN:
    gate: Weight
    up: Weight
    down: Weight
    act: str

    def __call__(self, ops, x, residual=None):
        out = ops.ffn(x, self.gate, self.up, self.down, self.act)
        return out if residual is None else ops.add(residual, out)


@dataclass(frozen=True, eq=False)
class Routing:
    """How a router's logits become expert weights when it is not a plain softmax (GLM-4.5, DeepSeek-V3): sigmoid
    scores, experts chosen by score + bias (the correction bias), weights from the unbiased scores, scaled; or
    (gpt-oss, llama.cpp's SOFTMAX_WEIGHT) experts chosen by their logits, weights the softmax of the chosen
    logits alone."""

    gating: str = "softmax"  # or "sigmoid", "softmax_weight"
    bias: torch.Tensor | None = None  # (n_expert,) float32, added for the choice only
    scale: float = 1.0  # routed_scaling_factor / expert_weights_scale
    # group-limited routing (DeepSeek-V2/V3, GLM): experts only from the n_group_used best of n_group groups, a
    # group scored by its best expert (softmax, DeepSeek-V2) or its two best summed (sigmoid, V3 and GLM)
    n_group: int = 1
    n_group_used: int = 1
    logit_bias: torch.Tensor | None = None  # (n_expert,) float32, the router's own bias: added to its logits

    @property
    def grouped(self) -> bool:
        return self.n_group_used < self.n_group

    @property
    def group_top(self) -> int:
        """Experts whose scores make a group's score."""
        return 2 if self.gating == "sigmoid" else 1


@dataclass
class SparseMoE:
    """router -> top-k -> (optionally) renormalise -> experts -> weighted sum, plus a shared expert if any."""

    router: Weight
    up_exps: Weight
    gate_exps: Weight
    down_exps: Weight
    n_expert_used: int
    norm_topk: bool
    act: str
    routing: Routing | None = None  # None: softmax
    shared: DenseFFN | None = None
    shared_gate: Weight | None = None  # (1, n_embd): the shared expert's output times sigmoid(x . it) (Qwen3.5)

    def __call__(self, ops, x, residual=None):
        """The block's output, added to `residual` when given (the residual stream: one pass less on a GPU)."""
        out = ops.moe(x, self.router, self.up_exps, self.gate_exps, self.down_exps, self.n_expert_used,
                      self.norm_topk, self.act, self.routing, residual if self.shared is None else None)
        if self.shared is None:
            return out
        shared = self.shared(ops, x)
        if self.shared_gate is not None:
            shared = ops.mul(shared, ops.sigmoid(ops.linear(x, self.shared_gate)))
        out = ops.add(out, shared)
        return out if residual is None else ops.add(residual, out)
