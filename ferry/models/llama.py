"""llama family: llama, mistral, mixtral-style MoE (llama with ffn_*_exps), qwen2 (q/k/v biases), qwen3 (q/k norms)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ferry.layers.attention import Attention
from ferry.errors import FerryError
from ferry.layers.ffn import DenseFFN, Routing, SparseMoE
from ferry.layers.rope import Rope
from ferry.models.base import Model, ModelArgs, WeightLoader, load_head

# llama.cpp's converter permutes llama's q/k rows into adjacent rotation pairs; qwen keeps HF's halves
NEOX_ROPE = {"llama": False, "qwen2": True, "qwen3": True}


@dataclass
class Block:
    attn_norm: torch.Tensor
    attn: Attention
    ffn_norm: torch.Tensor
    ffn: DenseFFN | SparseMoE
    eps: float

    def __call__(self, ops, x):
        return self.feed_forward(ops, *self.attend(ops, x))

    def attend(self, ops, x):
        """The attention half: (the residual stream after it, its normed input to the feed-forward half)."""
        return ops.add_rms_norm(x, self.attn(ops, x, self.attn_norm, self.eps), self.ffn_norm, self.eps)

    def feed_forward(self, ops, x, h):
        return self.ffn(ops, h, residual=x)


def attention(w: WeightLoader, a: ModelArgs, i: int, rope: Rope, window: int = 0, scale: float | None = None,
              norm_whole: bool = False, gated: bool = False) -> Attention:
    """The attention of block i, with whatever optional biases and q/k norms the file carries (per head, or with
    norm_whole across all heads: MiniMax-M2's); gated: attn_q gives each head's query and then its output gate."""
    p = f"blk.{i}."
    q_dim, kv_dim, v_dim = a.n_head * a.head_dim_k, a.n_head_kv * a.head_dim_k, a.n_head_kv * a.head_dim_v
    return Attention(
        layer=i,
        wq=w.weight(p + "attn_q.weight", 2 * q_dim if gated else q_dim, a.n_embd),
        wk=w.weight(p + "attn_k.weight", kv_dim, a.n_embd),
        wv=w.weight(p + "attn_v.weight", v_dim, a.n_embd),
        wo=w.weight(p + "attn_output.weight", a.n_embd, a.n_head * a.head_dim_v),
        n_head=a.n_head, n_head_kv=a.n_head_kv, head_dim_k=a.head_dim_k, head_dim_v=a.head_dim_v,
        rope=rope, scale=scale if scale is not None else a.head_dim_k ** -0.5, norm_eps=a.norm_eps,
        bq=w.optional_vector(p + "attn_q.bias", q_dim),
        bk=w.optional_vector(p + "attn_k.bias", kv_dim),
        bv=w.optional_vector(p + "attn_v.bias", v_dim),
        q_norm=w.optional_vector(p + "attn_q_norm.weight", q_dim if norm_whole else a.head_dim_k),
        k_norm=w.optional_vector(p + "attn_k_norm.weight", kv_dim if norm_whole else a.head_dim_k),
        norm_whole=norm_whole,
        window=window,
        gated=gated,
    )


def dense_ffn(w: WeightLoader, a: ModelArgs, i: int, act: str) -> DenseFFN:
    p = f"blk.{i}."
    return DenseFFN(
        gate=w.weight(p + "ffn_gate.weight", a.n_ff, a.n_embd),
        up=w.weight(p + "ffn_up.weight", a.n_ff, a.n_embd),
        down=w.weight(p + "ffn_down.weight", a.n_embd, a.n_ff),
        act=act)


def sparse_moe(w: WeightLoader, a: ModelArgs, i: int, n_ff_exp: int) -> SparseMoE:
    p = f"blk.{i}."
    return SparseMoE(
        router=w.weight(p + "ffn_gate_inp.weight", a.n_expert, a.n_embd),
        up_exps=w.weight(p + "ffn_up_exps.weight", a.n_expert, n_ff_exp, a.n_embd),
        gate_exps=w.weight(p + "ffn_gate_exps.weight", a.n_expert, n_ff_exp, a.n_embd),
        down_exps=w.weight(p + "ffn_down_exps.weight", a.n_expert, a.n_embd, n_ff_exp),
        n_expert_used=a.n_expert_used, norm_topk=True, act="silu")


def routed_moe(w: WeightLoader, a: ModelArgs, i: int) -> SparseMoE:
    """GLM-4.5's and DeepSeek's MoE block: routing from the metadata (softmax or sigmoid, the correction bias when
    the file has one, the weights' scale and renormalisation) and the shared experts."""
    p = f"blk.{i}."
    if a.n_expert_groups > 1 and (a.n_expert % a.n_expert_groups or not 0 < a.n_expert_groups_used <= a.n_expert_groups):
        raise FerryError(f"{w.f.path}: {a.n_expert} experts do not form {a.n_expert_groups} groups of which "
                         f"{a.n_expert_groups_used} are used; the metadata is corrupt, re-convert the model")
    moe = sparse_moe(w, a, i, a.n_ff_exp)
    moe.norm_topk = a.expert_weights_norm
    moe.routing = Routing(a.expert_gating, w.optional_vector(p + "exp_probs_b.bias", a.n_expert), a.expert_weights_scale,
                          a.n_expert_groups, a.n_expert_groups_used)
    if a.n_expert_shared:
        n_shared = a.n_ff_exp * a.n_expert_shared
        moe.shared = DenseFFN(gate=w.weight(p + "ffn_gate_shexp.weight", n_shared, a.n_embd),
                              up=w.weight(p + "ffn_up_shexp.weight", n_shared, a.n_embd),
                              down=w.weight(p + "ffn_down_shexp.weight", a.n_embd, n_shared), act="silu")
    return moe


def build(w: WeightLoader, a: ModelArgs) -> Model:
    rope = Rope(a.n_rot, a.rope_base, NEOX_ROPE[a.arch], a.rope_scale)
    blocks = []
    for i in range(a.n_layer):
        # mixtral-style files are arch 'llama' with expert tensors; their expert FFN size is feed_forward_length
        ffn = sparse_moe(w, a, i, a.n_ff_exp or a.n_ff) if a.n_expert else dense_ffn(w, a, i, "silu")
        blocks.append(Block(
            attn_norm=w.vector(f"blk.{i}.attn_norm.weight", a.n_embd),
            attn=attention(w, a, i, rope),
            ffn_norm=w.vector(f"blk.{i}.ffn_norm.weight", a.n_embd),
            ffn=ffn, eps=a.norm_eps))
    embd, norm, out = load_head(w, a)
    return Model(a, embd, blocks, norm, out)
