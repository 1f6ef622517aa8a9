"""qwen35moe (Qwen3.5 MoE), qwen35 (dense Qwen3.5: a dense FFN where the others have experts) and qwen3next
(Qwen3-Next): three of every four layers are gated delta-net linear
attention with a recurrent state (layers/delta_net.py), the rest full attention whose query projection also gives an
output gate, q/k normed per head, neox rope on the first n_rot values of each head (Qwen3.5's interleaved
multi-axis rope is that for text, every axis at the token's position); every layer a routed MoE (softmax, top-k
renormalised) beside a shared expert scaled by sigmoid(x . gate). llama.cpp's converter orders qwen35(moe)'s value
heads so that value head h reads key head h % n_k_heads; qwen3next's keep transformers' order (h // ratio), and
its beta and alpha projections are one matrix, per key head its ratio betas then its ratio alphas."""

from __future__ import annotations

import numpy as np

from ferry.layers.delta_net import GatedDeltaNet
from ferry.quant import row_bytes
from ferry.weight import Weight
from ferry.layers.ffn import DenseFFN
from ferry.layers.rope import Rope
from ferry.models.base import Model, ModelArgs, WeightLoader, load_head
from ferry.models.llama import Block, attention, dense_ffn, sparse_moe


def rows(w: Weight, picked: list[int]) -> Weight:
    """Some rows of a matrix, in the order given, as a weight of their own (a copy, under the matrix's name)."""
    size = row_bytes(w.qtype, w.ne[0])
    data = np.concatenate([w.data[r * size:(r + 1) * size] for r in picked])
    return Weight(w.name, w.qtype, (w.ne[0], len(picked)), data)


def beta_alpha(w: WeightLoader, a: ModelArgs, i: int) -> tuple[Weight, Weight]:
    """The beta and alpha projections: qwen35moe's two matrices, or qwen3next's one (ssm_ba), which holds per key
    head its ratio beta rows, then its ratio alpha rows."""
    p, hk, hv = f"blk.{i}.", a.ssm_n_k_heads, a.ssm_n_v_heads
    if not w.has(p + "ssm_ba.weight"):
        return w.weight(p + "ssm_beta.weight", hv, a.n_embd), w.weight(p + "ssm_alpha.weight", hv, a.n_embd)
    ba, r = w.weight(p + "ssm_ba.weight", 2 * hv, a.n_embd), hv // hk
    # both keep the file tensor's name: placement (-ngl, -ot) finds them by it
    return (rows(ba, [g * 2 * r + j for g in range(hk) for j in range(r)]),
            rows(ba, [g * 2 * r + r + j for g in range(hk) for j in range(r)]))


def delta_net(w: WeightLoader, a: ModelArgs, i: int) -> GatedDeltaNet:
    p = f"blk.{i}."
    d, hk, hv = a.ssm_head_dim, a.ssm_n_k_heads, a.ssm_n_v_heads
    channels = (2 * hk + hv) * d
    wbeta, walpha = beta_alpha(w, a, i)
    return GatedDeltaNet(
        layer=i,
        wqkv=w.weight(p + "attn_qkv.weight", channels, a.n_embd),
        wz=w.weight(p + "attn_gate.weight", hv * d, a.n_embd),
        wbeta=wbeta,
        walpha=walpha,
        conv=w.vector(p + "ssm_conv1d.weight", channels, a.ssm_conv_kernel),
        dt_bias=w.vector(p + "ssm_dt.bias", hv),
        a=w.vector(p + "ssm_a", hv),
        norm=w.vector(p + "ssm_norm.weight", d),
        wo=w.weight(p + "ssm_out.weight", a.n_embd, hv * d),
        n_k_heads=hk, n_v_heads=hv, head_dim=d, norm_eps=a.norm_eps, tiled=a.arch != "qwen3next")


def build(w: WeightLoader, a: ModelArgs) -> Model:
    rope = Rope(a.n_rot, a.rope_base, neox=True, scale=a.rope_scale)
    n_shared = a.n_ff_shexp or a.n_ff_exp
    blocks = []
    for i in range(a.n_layer):
        p = f"blk.{i}."
        if a.recurrent[i]:
            mixer = delta_net(w, a, i)
        else:
            mixer = attention(w, a, i, rope, gated=True)
        if a.n_expert:
            ffn = sparse_moe(w, a, i, a.n_ff_exp)
            ffn.shared = DenseFFN(gate=w.weight(p + "ffn_gate_shexp.weight", n_shared, a.n_embd),
                                  up=w.weight(p + "ffn_up_shexp.weight", n_shared, a.n_embd),
                                  down=w.weight(p + "ffn_down_shexp.weight", a.n_embd, n_shared), act="silu")
            ffn.shared_gate = w.weight(p + "ffn_gate_inp_shexp.weight", 1, a.n_embd)
        else:  # dense Qwen3.5 (qwen35)
            ffn = dense_ffn(w, a, i, "silu")
        blocks.append(Block(attn_norm=w.vector(p + "attn_norm.weight", a.n_embd), attn=mixer,
                            ffn_norm=w.vector(p + "post_attention_norm.weight", a.n_embd), ffn=ffn, eps=a.norm_eps))
    w.skip(f"blk.{a.n_layer}.")  # multi-token-prediction blocks: in the file, not run
    embd, norm, out = load_head(w, a)
    return Model(a, embd, blocks, norm, out)
