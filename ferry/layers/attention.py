"""Self-attention with a KV cache: GQA, optional q/k/v biases (qwen2), per-head q/k norms (qwen3, gemma3),
and a sliding window (gemma3's local layers)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ferry.layers.rope import Rope
from ferry.ops import Weight


@dataclass
class Attention:
    layer: int
    wq: Weight
    wk: Weight
    wv: Weight
    wo: Weight
    n_head: int
    n_head_kv: int
    head_dim_k: int
    head_dim_v: int
    rope: Rope
    scale: float
    norm_eps: float
    bq: torch.Tensor | None = None
    bk: torch.Tensor | None = None
    bv: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    window: int = 0

    def __call__(self, ops, x):
        q = ops.heads(ops.linear(x, self.wq, self.bq), self.n_head, self.head_dim_k)
        k = ops.heads(ops.linear(x, self.wk, self.bk), self.n_head_kv, self.head_dim_k)
        v = ops.heads(ops.linear(x, self.wv, self.bv), self.n_head_kv, self.head_dim_v)
        if self.q_norm is not None:
            q = ops.rms_norm(q, self.q_norm, self.norm_eps)
            k = ops.rms_norm(k, self.k_norm, self.norm_eps)
        q, k = ops.rope(q, self.rope), ops.rope(k, self.rope)
        return ops.linear(ops.attention(self.layer, q, k, v, self.scale, self.window), self.wo)
