"""deepseek2 (DeepSeek-V2/V2-Lite, V3/R1, Kimi K2): multi-head latent attention (with or without the low-rank query;
a latent or an expanded cache, -mla), leading dense layers, then routed experts (softmax or sigmoid scores, an optional correction
bias, weights scaled) plus shared experts. Rope is the 'normal' (adjacent pairs) layout, on the rope part only.

deepseek32 (DeepSeek-V3.2) and glm-dsa (GLM-5) are the same with DeepSeek sparse attention: a lightning indexer per layer
(layers/indexer.py; GLM-5.2's "shared" layers have none and reuse the last one's selection), whose rope is half-split
in DeepSeek-V3.2 and in pairs in GLM-5."""

from __future__ import annotations

import torch

from ferry.errors import FerryError
from ferry.layers.attention import LatentAttention
from ferry.layers.indexer import Indexer
from ferry.layers.rope import Rope
from ferry.models.base import Model, ModelArgs, WeightLoader, load_head
from ferry.models.llama import Block, dense_ffn, routed_moe
from ferry.weight import Weight


def _kv_b(w: WeightLoader, a: ModelArgs, i: int, nope: int) -> tuple[Weight | None, torch.Tensor, torch.Tensor]:
    """The file's kv_b (the latent's expansion into every head's no-rope key and value) if it has one, and its two
    halves per head as the absorbed form uses them: k_b (n_head, kv_lora_rank, nope) and v_b (n_head, v,
    kv_lora_rank), float32. Files carry attn_kv_b or, as llama.cpp's converters write them since 2025, attn_k_b
    (per head, transposed) and attn_v_b; LatentAttention.kv_b() then joins kv_b when ggml first needs it."""
    p, h, lora, v = f"blk.{i}.", a.n_head, a.kv_lora_rank, a.head_dim_v
    if not w.has(p + "attn_k_b.weight"):
        kv_b = w.weight(p + "attn_kv_b.weight", h * (nope + v), lora)
        per_head = torch.from_numpy(kv_b.dequantize()).reshape(h, nope + v, lora)
        return kv_b, per_head[:, :nope].transpose(1, 2).contiguous(), per_head[:, nope:].contiguous()
    k_b = torch.from_numpy(w.weight(p + "attn_k_b.weight", h, lora, nope).dequantize()).reshape(h, lora, nope)
    v_b = torch.from_numpy(w.weight(p + "attn_v_b.weight", h, v, lora).dequantize()).reshape(h, v, lora)
    return None, k_b, v_b


def latent_attention(w: WeightLoader, a: ModelArgs, i: int, rope: Rope) -> LatentAttention:
    p = f"blk.{i}."
    rot = a.n_rot
    nope = a.head_dim_k - rot
    q_dim = a.n_head * a.head_dim_k
    low_rank_q = a.q_lora_rank > 0
    kv_b, k_b, v_b = _kv_b(w, a, i, nope)
    return LatentAttention(
        layer=i,
        wq=None if low_rank_q else w.weight(p + "attn_q.weight", q_dim, a.n_embd),
        wq_a=w.weight(p + "attn_q_a.weight", a.q_lora_rank, a.n_embd) if low_rank_q else None,
        q_a_norm=w.vector(p + "attn_q_a_norm.weight", a.q_lora_rank) if low_rank_q else None,
        wq_b=w.weight(p + "attn_q_b.weight", q_dim, a.q_lora_rank) if low_rank_q else None,
        wkv_a=w.weight(p + "attn_kv_a_mqa.weight", a.kv_lora_rank + rot, a.n_embd),
        kv_a_norm=w.vector(p + "attn_kv_a_norm.weight", a.kv_lora_rank),
        file_kv_b=kv_b, k_b=k_b, v_b=v_b,
        wo=w.weight(p + "attn_output.weight", a.n_embd, a.n_head * a.head_dim_v),
        n_head=a.n_head, kv_lora_rank=a.kv_lora_rank, head_dim_nope=nope, head_dim_rope=rot,
        head_dim_v=a.head_dim_v, rope=rope, scale=a.head_dim_k ** -0.5 * (a.yarn.attn_scale if a.yarn else 1.0),
        norm_eps=a.norm_eps, indexer=indexer(w, a, i) if i in a.indexer_layers else None,
        shares_selection=bool(a.indexer_layers) and i not in a.indexer_layers)


INDEXER_NEOX = {"deepseek32": True, "glm-dsa": False}  # the indexer's rope: half-split (DeepSeek-V3.2) or pairs (GLM-5)


def indexer(w: WeightLoader, a: ModelArgs, i: int) -> Indexer:
    p, h, d = f"blk.{i}.indexer.", a.indexer_n_head, a.indexer_head_dim
    return Indexer(layer=i, wq_b=w.weight(p + "attn_q_b.weight", h * d, a.q_lora_rank),
                   wk=w.weight(p + "attn_k.weight", d, a.n_embd), k_norm=w.vector(p + "k_norm.weight", d),
                   k_norm_bias=w.vector(p + "k_norm.bias", d), w_heads=w.weight(p + "proj.weight", h, a.n_embd),
                   n_head=h, head_dim=d, top_k=a.indexer_top_k,
                   rope=Rope(a.n_rot, a.rope_base, neox=INDEXER_NEOX[a.arch], scale=a.rope_scale, yarn=a.yarn))


def build(w: WeightLoader, a: ModelArgs) -> Model:
    if a.kv_lora_rank <= 0:
        raise FerryError(f"{w.f.path}: {a.arch} without attention.kv_lora_rank; re-convert the model")
    if a.indexer_layers and a.q_lora_rank <= 0:
        raise FerryError(f"{w.f.path}: {a.arch} without attention.q_lora_rank: the indexer reads the low-rank query; "
                         "the file is corrupt, re-convert the model")
    if a.arch in INDEXER_NEOX and not a.indexer_layers:
        raise FerryError(f"{w.f.path}: {a.arch} without attention.indexer.* metadata; re-convert the model with a "
                         "current llama.cpp")
    if a.n_head_kv != a.n_head:
        raise FerryError(f"{w.f.path}: head_count_kv {a.n_head_kv} != head_count {a.n_head} without "
                         "attention.key_length_mla; re-convert the model with a current llama.cpp")
    rope = Rope(a.n_rot, a.rope_base, neox=False, scale=a.rope_scale, yarn=a.yarn)
    blocks = []
    for i in range(a.n_layer):
        p = f"blk.{i}."
        ffn = dense_ffn(w, a, i, "silu") if i < a.n_layer_dense_lead else routed_moe(w, a, i)
        blocks.append(Block(attn_norm=w.vector(p + "attn_norm.weight", a.n_embd), attn=latent_attention(w, a, i, rope),
                            ffn_norm=w.vector(p + "ffn_norm.weight", a.n_embd), ffn=ffn, eps=a.norm_eps))
    for i in range(a.n_layer, a.n_layer + a.n_nextn):
        w.skip(f"blk.{i}.")
    embd, norm, out = load_head(w, a)
    return Model(a, embd, blocks, norm, out)
