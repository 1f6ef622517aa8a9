"""gpt-oss (gpt-oss-20b, gpt-oss-120b): attention with q/k/v/output biases and a learned sink logit per head (in the
softmax's denominator only), every even layer within a sliding window; YaRN rope; a routed MoE in every layer whose
router has a bias and chooses by its logits (the weights a softmax over the chosen ones), experts with biases and a
clamped SwiGLU (kernels/activations.py), usually MXFP4."""

from __future__ import annotations

from ferry.errors import FerryError
from ferry.layers.ffn import Routing
from ferry.layers.rope import Rope
from ferry.models.base import Model, ModelArgs, WeightLoader, load_head
from ferry.models.llama import Block, attention, sparse_moe


def build(w: WeightLoader, a: ModelArgs) -> Model:
    if a.n_rot != a.head_dim_k:
        # the YaRN attention factor is taken as an attention scale, which equals scaling cos / sin only for a head
        # rotated whole (gpt-oss's are)
        raise FerryError(f"{w.f.path}: gpt-oss with {a.n_rot} of {a.head_dim_k} head dimensions rotated is not "
                         "supported; the known models rotate every dimension, re-convert the model")
    rope = Rope(a.n_rot, a.rope_base, neox=True, scale=a.rope_scale, yarn=a.yarn)
    scale = a.head_dim_k ** -0.5 * (a.yarn.attn_scale if a.yarn else 1.0)
    blocks = []
    for i in range(a.n_layer):
        p = f"blk.{i}."
        attn = attention(w, a, i, rope, window=a.windows[i] if a.windows else 0, scale=scale)
        attn.bo = w.vector(p + "attn_output.bias", a.n_embd)
        attn.sinks = w.vector(p + "attn_sinks.weight", a.n_head)
        moe = sparse_moe(w, a, i, a.n_ff_exp)
        moe.norm_topk, moe.act = False, "swiglu_oai"
        moe.routing = Routing("softmax_weight", logit_bias=w.vector(p + "ffn_gate_inp.bias", a.n_expert))
        for weight, rows in ((moe.gate_exps, a.n_ff_exp), (moe.up_exps, a.n_ff_exp), (moe.down_exps, a.n_embd)):
            weight.bias = w.vector(weight.name.replace(".weight", ".bias"), a.n_expert, rows)
        blocks.append(Block(
            attn_norm=w.vector(p + "attn_norm.weight", a.n_embd),
            attn=attn,
            ffn_norm=w.vector(p + "post_attention_norm.weight", a.n_embd),
            ffn=moe, eps=a.norm_eps))
    embd, norm, out = load_head(w, a)
    return Model(a, embd, blocks, norm, out)
