"""minimax-m2 (MiniMax-M2, M2.1): attention whose q and k are RMS-normed across all heads at once (one weight of
n_head x head_dim and one of n_head_kv x head_dim, not per head), rope on the first n_rot values of each head (neox);
a routed MoE in every layer, experts chosen by sigmoid score + correction bias and weighted by the unbiased scores,
renormalised (llama.cpp renormalises minimax-m2's whatever the file says); no shared expert."""

from __future__ import annotations

from ferry.layers.rope import Rope
from ferry.models.base import Model, ModelArgs, WeightLoader, load_head
from ferry.models.llama import Block, attention, routed_moe


def build(w: WeightLoader, a: ModelArgs) -> Model:
    rope = Rope(a.n_rot, a.rope_base, neox=True, scale=a.rope_scale)
    blocks = []
    for i in range(a.n_layer):
        p = f"blk.{i}."
        moe = routed_moe(w, a, i)
        moe.norm_topk = True
        blocks.append(Block(
            attn_norm=w.vector(p + "attn_norm.weight", a.n_embd),
            attn=attention(w, a, i, rope, norm_whole=True),
            ffn_norm=w.vector(p + "ffn_norm.weight", a.n_embd),
            ffn=moe, eps=a.norm_eps))
    embd, norm, out = load_head(w, a)
    return Model(a, embd, blocks, norm, out)
