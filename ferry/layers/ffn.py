"""Feed-forward blocks: the dense gated FFN, and the sparse MoE block (router, top-k, experts, sum)."""

from __future__ import annotations

from dataclasses import dataclass

from ferry.ops import Weight


@dataclass
class DenseFFN:
    gate: Weight
    up: Weight
    down: Weight
    act: str

    def __call__(self, ops, x):
        return ops.ffn(x, self.gate, self.up, self.down, self.act)


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

    def __call__(self, ops, x):
        return ops.moe(x, self.router, self.up_exps, self.gate_exps, self.down_exps, self.n_expert_used,
                       self.norm_topk, self.act)
