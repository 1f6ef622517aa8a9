"""gemma3 (text): embeddings scaled by sqrt(n_embd), q/k norms, norms after attention and FFN too,
GELU-tanh FFN, and 5 of every 6 layers attending within a sliding window with their own rope base."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ferry.layers.attention import Attention
from ferry.layers.ffn import DenseFFN
from ferry.layers.rope import Rope
from ferry.models.base import Model, ModelArgs, WeightLoader, load_head
from ferry.models.llama import attention, dense_ffn

ROPE_BASE_LOCAL = 10000.0  # llama.cpp and HF fix the local layers' rope base; the file holds the global one


@dataclass
class Block:
    attn_norm: torch.Tensor
    attn: Attention
    post_attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    ffn: DenseFFN
    post_ffn_norm: torch.Tensor
    eps: float

    def __call__(self, ops, x):
        h = self.attn(ops, ops.rms_norm(x, self.attn_norm, self.eps))
        x = ops.add(x, ops.rms_norm(h, self.post_attn_norm, self.eps))
        h = self.ffn(ops, ops.rms_norm(x, self.ffn_norm, self.eps))
        return ops.add(x, ops.rms_norm(h, self.post_ffn_norm, self.eps))


def build(w: WeightLoader, a: ModelArgs) -> Model:
    rope_global = Rope(a.n_rot, a.rope_base, neox=True, scale=a.rope_scale)
    rope_local = Rope(a.n_rot, ROPE_BASE_LOCAL, neox=True)
    blocks = []
    for i in range(a.n_layer):
        window = a.windows[i] if a.windows else 0  # 5 of every 6 layers local (ModelArgs.windows)
        p = f"blk.{i}."
        blocks.append(Block(
            attn_norm=w.vector(p + "attn_norm.weight", a.n_embd),
            attn=attention(w, a, i, rope_local if window else rope_global, window=window),
            post_attn_norm=w.vector(p + "post_attention_norm.weight", a.n_embd),
            ffn_norm=w.vector(p + "ffn_norm.weight", a.n_embd),
            ffn=dense_ffn(w, a, i, "gelu"),
            post_ffn_norm=w.vector(p + "post_ffw_norm.weight", a.n_embd),
            eps=a.norm_eps))
    embd, norm, out = load_head(w, a)
    return Model(a, embd, blocks, norm, out, embd_scale=math.sqrt(a.n_embd))
