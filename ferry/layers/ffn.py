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
        out, ids = self.ops.moe(x, self.router, self.up_exps, self.gate_exps, self.down_exps, self.n_expert_used,
                                self.norm_topk, self.act)
        batch.experts_hit.append(int(ids.unique().numel()))
        return out
