"""glm4moe (GLM-4.5, GLM-4.6): attention with q/k/v biases and optional per-head q/k norms, RoPE on the first half
of each head (neox), leading dense layers, then routed experts chosen by sigmoid score + correction bias, weighted
by the unbiased scores (renormalised, scaled), plus a shared expert; the multi-token-prediction blocks at the end of
the file are not run (llama.cpp does the same)."""

from __future__ import annotations

from ferry.errors import FerryError
from ferry.layers.ffn import DenseFFN, Routing
from ferry.layers.rope import Rope
from ferry.models.base import Model, ModelArgs, WeightLoader, load_head
from ferry.models.llama import Block, attention, dense_ffn, sparse_moe


def build(w: WeightLoader, a: ModelArgs) -> Model:
    if a.n_expert_groups_used < a.n_expert_groups:
        raise FerryError(f"{w.f.path}: group-limited routing ({a.n_expert_groups_used} of {a.n_expert_groups} expert "
                         "groups) is not supported yet")
    rope = Rope(a.n_rot, a.rope_base, neox=True, scale=a.rope_scale)
    blocks = []
    for i in range(a.n_layer):
        p = f"blk.{i}."
        if i < a.n_layer_dense_lead:
            ffn = dense_ffn(w, a, i, "silu")
        else:
            n_shared = a.n_ff_exp * a.n_expert_shared
            bias = w.optional_vector(p + "exp_probs_b.bias", a.n_expert)
            ffn = sparse_moe(w, a, i, a.n_ff_exp)
            ffn.norm_topk = a.expert_weights_norm
            ffn.routing = Routing(a.expert_gating, bias, a.expert_weights_scale)
            if a.n_expert_shared:
                ffn.shared = DenseFFN(gate=w.weight(p + "ffn_gate_shexp.weight", n_shared, a.n_embd),
                                      up=w.weight(p + "ffn_up_shexp.weight", n_shared, a.n_embd),
                                      down=w.weight(p + "ffn_down_shexp.weight", a.n_embd, n_shared), act="silu")
        blocks.append(Block(
            attn_norm=w.vector(p + "attn_norm.weight", a.n_embd),
            attn=attention(w, a, i, rope),
            ffn_norm=w.vector(p + "post_attention_norm.weight", a.n_embd),
            ffn=ffn, eps=a.norm_eps))
    for i in range(a.n_layer, a.n_layer + a.n_nextn):
        w.skip(f"blk.{i}.")
    embd, norm, out = load_head(w, a)
    return Model(a, embd, blocks, norm, out)
