"""DeepSeek sparse attention's lightning indexer (DeepSeek-V3.2 `deepseek32`, GLM-5 `glm-dsa`): it scores every cached
position for each query, and the latent attention then attends to each query's `top_k` best positions only.

A position t's score for the query of token s is sum over the indexer's heads h of w_h(s) * relu(q_h(s) . k(t)) /
sqrt(heads * head_dim): the queries come from the attention's low-rank query (after its norm), the one key per
position from the block's input through a LayerNorm (eps 1e-6, with a bias), rope on each head's first rope.n_rot
values (half-split in DeepSeek-V3.2, in pairs in GLM-5), the head weights w from the block's input. The keys are
cached per position and layer beside the latent (KVCache.index). Where a query sees no more than top_k positions,
it attends to all of them: DSA is then the dense attention it extends, and no score is computed.

GLM-5.2 runs the indexer only in some layers ("full"); the others ("shared") reuse the last full layer's selection."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ferry.layers.rope import Rope
from ferry.weight import Weight

KEY_NORM_EPS = 1e-6  # the key's LayerNorm (DeepSeek's and llama.cpp's)


@dataclass
class Indexer:
    layer: int
    wq_b: Weight  # (n_head * head_dim, q_lora_rank): the heads' queries from the attention's normed low-rank query
    wk: Weight  # (head_dim, n_embd): the position's key
    k_norm: torch.Tensor  # the key's LayerNorm weight and bias (head_dim,)
    k_norm_bias: torch.Tensor
    w_heads: Weight  # (n_head, n_embd): each head's weight in a query's score
    n_head: int
    head_dim: int
    top_k: int
    rope: Rope  # on the first rope.n_rot values of each head; the rest pass through

    def select(self, ops, x, qr):
        """Each query's positions to attend to (ops.dsa_select: None where every query sees top_k or fewer), from the
        block's normed input x and the attention's normed low-rank query qr; this batch's keys go into the cache."""
        q = self._rope(ops, ops.heads(ops.linear(qr, self.wq_b), self.n_head, self.head_dim))
        k = ops.layer_norm(ops.linear(x, self.wk), self.k_norm, self.k_norm_bias, KEY_NORM_EPS)
        k = self._rope(ops, ops.heads(k, 1, self.head_dim))
        w = ops.scale(ops.linear(x, self.w_heads), (self.n_head * self.head_dim) ** -0.5)
        return ops.dsa_select(self.layer, q, k, w, self.top_k)

    def _rope(self, ops, x):
        rot = self.rope.n_rot
        if rot == self.head_dim:
            return ops.rope(x, self.rope)
        head, rest = ops.split(x, [rot, self.head_dim - rot])
        return ops.concat(ops.rope(head, self.rope), rest)


def scores(q: torch.Tensor, keys: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The indexer's scores in torch: q (n, heads, d), keys (n_kv, d), w (n, heads) already scaled -> (n, n_kv)."""
    return torch.einsum("nht,nh->nt", torch.einsum("nhd,td->nht", q, keys).relu_(), w)


def top_k_mask(score: torch.Tensor, allowed: torch.Tensor, top_k: int) -> torch.Tensor:
    """(n, n_kv) bool: each query's top_k positions by score among those `allowed` (its causal mask), and within it:
    a query that sees fewer keeps all it sees."""
    score = score.masked_fill(~allowed, float("-inf"))
    chosen = torch.zeros_like(allowed).scatter_(1, score.topk(min(top_k, score.shape[1]), dim=1).indices, True)
    return chosen & allowed
