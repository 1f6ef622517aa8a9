"""glm4moe (GLM-4.5, GLM-4.6): attention with q/k/v biases and optional per-head q/k norms, RoPE on the first half
of each head (neox), leading dense layers, then routed experts chosen by sigmoid score + correction bias, weighted
by the unbiased scores (renormalised, scaled), plus a shared expert; the multi-token-prediction blocks at the end of
the file are not run (llama.cpp does the same)."""

from __future__ import annotations

from ferry.layers.rope import Rope
from ferry.models.base import Model, ModelArgs, WeightLoader, load_head
from ferry.models.llama import Block, attention, dense_ffn, routed_moe


def build(w: WeightLoader, a: ModelArgs) -> Model:
    rope = Rope(a.n_rot, a.rope_base, neox=True, scale=a.rope_scale)
    blocks = []
    for i in range(a.n_layer):
        p = f"blk.{i}."
        blocks.append(Block(
            attn_norm=w.vector(p + "attn_norm.weight", a.n_embd),
            attn=attention(w, a, i, rope),
            ffn_norm=w.vector(p + "post_attention_norm.weight", a.n_embd),
            ffn=dense_ffn(w, a, i, "silu") if i < a.n_layer_dense_lead else routed_moe(w, a, i),
            eps=a.norm_eps))
    for i in range(a.n_layer, a.n_layer + a.n_nextn):
        w.skip(f"blk.{i}.")
    embd, norm, out = load_head(w, a)
    return Model(a, embd, blocks, norm, out)
