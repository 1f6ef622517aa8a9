"""Feed-forward blocks: the dense gated FFN, and the sparse MoE block (router, top-k, experts, sum)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ferry.ops import Weight
from ferry.runtime.context import Batch

@dataclass
class DenseFFN:
    gate: Weight
    up: Weight
    down: Weight
    act: str
    ops: object

    def __call__(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        return self.ops.ffn(x, self.gate, self.up, self.down, self.act)


@dataclass
class SparseMoE:
    """softmax router -> top-k -> (optionally) renormalise -> experts -> weighted sum."""

    router: Weight
    up_exps: Weight
    gate_exps: Weight
    down_exps: Weight
    n_expert_used: int
    norm_topk: bool
    act: str
    ops: object

    def __call__(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        probs = torch.softmax(self.ops.linear(x, self.router), dim=-1)
        weights, ids = torch.topk(probs, self.n_expert_used, dim=-1)
        if self.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        batch.experts_hit.append(int(ids.unique().numel()))
        out = self.ops.moe_ffn(x, self.up_exps, self.gate_exps, self.down_exps, ids, self.act)
        return (out * weights[..., None]).sum(1)
