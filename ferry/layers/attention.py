"""Self-attention with a KV cache: GQA, optional q/k/v biases (qwen2), per-head q/k norms (qwen3, gemma3),
and a sliding window (gemma3's local layers)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ferry.layers.norm import rms_norm
from ferry.layers.rope import Rope
from ferry.ops import Weight
from ferry.runtime.context import Batch


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
    ops: object
    bq: torch.Tensor | None = None
    bk: torch.Tensor | None = None
    bv: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    window: int = 0

    def __call__(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = (self.ops.linear(x, w) for w in (self.wq, self.wk, self.wv))
        if self.bq is not None:
            q, k, v = q + self.bq, k + self.bk, v + self.bv
        q = q.view(n, self.n_head, self.head_dim_k)
        k = k.view(n, self.n_head_kv, self.head_dim_k)
        v = v.view(n, self.n_head_kv, self.head_dim_v)
        if self.q_norm is not None:
            q = rms_norm(q, self.q_norm, self.norm_eps)
            k = rms_norm(k, self.k_norm, self.norm_eps)
        cos, sin = batch.rope_angles(self.rope)
        q, k = self.rope(q, cos, sin), self.rope(k, cos, sin)
        keys, values = batch.kv.store(self.layer, batch.start, k, v)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
            attn_mask=batch.mask(self.window), scale=self.scale, enable_gqa=self.n_head != self.n_head_kv)
        return self.ops.linear(out.transpose(0, 1).reshape(n, self.n_head * self.head_dim_v), self.wo)
