"""qwen3moe (Qwen3-30B-A3B, Qwen3-235B-A22B): qwen3 attention (q/k norms, neox rope) and a routed MoE
in every layer, softmax router with the top-k weights renormalised, no shared expert."""

from __future__ import annotations

from ferry.layers.rope import Rope
from ferry.models.base import Model, ModelArgs, WeightLoader, load_head
from ferry.models.llama import Block, attention, sparse_moe


def build(w: WeightLoader, a: ModelArgs) -> Model:
    rope = Rope(a.n_rot, a.rope_base, neox=True, scale=a.rope_scale)
    blocks = [
        Block(
            attn_norm=w.vector(f"blk.{i}.attn_norm.weight", a.n_embd),
            attn=attention(w, a, i, rope),
            ffn_norm=w.vector(f"blk.{i}.ffn_norm.weight", a.n_embd),
            ffn=sparse_moe(w, a, i, a.n_ff_exp),
            eps=a.norm_eps)
        for i in range(a.n_layer)
    ]
    embd, norm, out = load_head(w, a)
    return Model(a, embd, blocks, norm, out)
