"""deepseek4 (DeepSeek-V4 Flash and Pro): every layer is compressed attention (layers/compressed_attention.py: a
sliding window, plus pooled entries where its compress ratio is not 0, picked by a lightning indexer where it is
4) and a routed MoE, around which the residual's n_hc streams mix (layers/hyper_connection.py). The router's
scores are sqrt(softplus(logits)); the first hash_layer_count layers route each token to the experts a table gives
its id, the others to the top-k of score + bias; the weights, the chosen scores renormalised, are scaled. Experts
and the shared expert use a SwiGLU clamped at swiglu_limit. No MLA, no dense layers; multi-token prediction is not
in the main file."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf.constants import GGMLQuantizationType as Q

from ferry.errors import FerryError
from ferry.kernels.activations import SILU_CLAMP_LIMIT
from ferry.layers.compressed_attention import CompressedAttention, CompressedIndexer, Compressor
from ferry.layers.ffn import DenseFFN, Routing
from ferry.layers.hyper_connection import HyperConnection, HyperHead
from ferry.layers.rope import Rope
from ferry.models.base import Model, ModelArgs, WeightLoader, load_head
from ferry.weight import Weight


@dataclass
class HashRoutedMoE:
    """Routed experts (by the top-k of score + bias, or by the token's row of `hash_ids`) plus the shared expert."""

    router: Weight
    up_exps: Weight
    gate_exps: Weight
    down_exps: Weight
    n_expert_used: int
    routing: Routing
    shared: DenseFFN
    act: str
    hash_ids: torch.Tensor | None = None  # (n_vocab, n_expert_used) int64: the hash layers' experts per token id

    def __call__(self, ops, x):
        weights, ids = ops.route(ops.linear(x, self.router), self.n_expert_used, self.routing, self.hash_ids)
        out = ops.moe_routed(x, ids, weights, self.up_exps, self.gate_exps, self.down_exps, self.act)
        return ops.add(out, self.shared(ops, x))


@dataclass
class Block:
    attn_hc: HyperConnection
    attn_norm: torch.Tensor
    attn: CompressedAttention
    ffn_hc: HyperConnection
    ffn_norm: torch.Tensor
    ffn: HashRoutedMoE
    eps: float

    def __call__(self, ops, streams):
        streams = self.attn_hc(ops, streams, lambda o, x: self.attn(o, o.rms_norm(x, self.attn_norm, self.eps)))
        return self.ffn_hc(ops, streams, lambda o, x: self.ffn(o, o.rms_norm(x, self.ffn_norm, self.eps)))


@dataclass
class StreamsModel(Model):
    """A Model whose residual is n_hc streams: the embedding copied into each, collapsed by `head` before the final
    norm."""

    head: HyperHead | None = None
    n_hc: int = 1
    ggml_graph = False  # its ops (streams, compressors) are torch's: the CPU runs it op by op

    def position_free(self, kv) -> bool:
        """Its compressors, indexer and attention read the position on the GPU over an f16 cache (CudaOps'
        compressed_attention); over another, they run between CUDA graphs."""
        return kv.type_k == Q.F16

    def _embed(self, ops):
        x = ops.embed(self.token_embd)
        streams = x
        for _ in range(self.n_hc - 1):
            streams = ops.concat(streams, x)
        return streams

    def _logits(self, ops, streams):
        x = self.head(ops, ops.output_rows(streams))
        return ops.linear(ops.rms_norm(x, self.output_norm, self.args.norm_eps), self.output)


def hyper(w: WeightLoader, a: ModelArgs, prefix: str, n_mix: int, n_scale: int, ones: torch.Tensor):
    return (w.weight(prefix + "_fn.weight", n_mix, a.v4.n_hc * a.n_embd), w.vector(prefix + "_base.weight", n_mix),
            w.vector(prefix + "_scale.weight", n_scale))


def compressor(w: WeightLoader, a: ModelArgs, i: int, name: str, dim: int, ratio: int, rope: Rope) -> Compressor:
    p = f"blk.{i}.{'attn' if name == 'attn' else 'indexer'}_compressor_"
    width = dim * (2 if ratio == a.v4.CSA_RATIO else 1)
    return Compressor(layer=i, name=name, wkv=w.weight(p + "kv.weight", width, a.n_embd),
                      wgate=w.weight(p + "gate.weight", width, a.n_embd), ape=w.vector(p + "ape.weight", ratio, width),
                      norm=w.vector(p + "norm.weight", dim), ratio=ratio, dim=dim, rope=rope, norm_eps=a.norm_eps)


def attention(w: WeightLoader, a: ModelArgs, i: int, main: Rope, compress: Rope) -> CompressedAttention:
    p, h, d, ratio, v4 = f"blk.{i}.", a.n_head, a.head_dim_k, a.v4.compress_ratios[i], a.v4
    rope = compress if ratio else main
    groups, rank = v4.n_out_groups, v4.out_lora_rank
    wo_a = w.weight(p + "attn_output_a.weight", groups * rank, h * d // groups)
    indexer = None
    if ratio == v4.CSA_RATIO:
        indexer = CompressedIndexer(
            compressor=compressor(w, a, i, "index", a.indexer_head_dim, ratio, compress),
            wq_b=w.weight(p + "indexer.attn_q_b.weight", a.indexer_n_head * a.indexer_head_dim, a.q_lora_rank),
            w_heads=w.weight(p + "indexer.proj.weight", a.indexer_n_head, a.n_embd), n_head=a.indexer_n_head,
            head_dim=a.indexer_head_dim, top_k=a.indexer_top_k, rope=compress)
    return CompressedAttention(
        layer=i, wq_a=w.weight(p + "attn_q_a.weight", a.q_lora_rank, a.n_embd),
        q_norm=w.vector(p + "attn_q_a_norm.weight", a.q_lora_rank),
        wq_b=w.weight(p + "attn_q_b.weight", h * d, a.q_lora_rank), wkv=w.weight(p + "attn_kv.weight", d, a.n_embd),
        kv_norm=w.vector(p + "attn_kv_a_norm.weight", d), sinks=w.vector(p + "attn_sinks.weight", h),
        wo_a=[rows(wo_a, g * rank, rank) for g in range(groups)],
        wo_b=w.weight(p + "attn_output_b.weight", a.n_embd, groups * rank), n_head=h, head_dim=d,
        window=a.sliding_window, rope=rope, unrope=Rope(rope.n_rot, rope.base, rope.neox, rope.scale, rope.yarn, True),
        norm_eps=a.norm_eps, ones=torch.ones(d),
        compressor=compressor(w, a, i, "attn", d, ratio, compress) if ratio else None, indexer=indexer)


def rows(w: Weight, first: int, count: int) -> Weight:
    """Rows first..first + count - 1 of a matrix as a weight of their own, a view of its bytes under its name."""
    size = w.data.nbytes // w.ne[1]
    return Weight(w.name, w.qtype, (w.ne[0], count), w.data[first * size:(first + count) * size])


def moe(w: WeightLoader, a: ModelArgs, i: int) -> HashRoutedMoE:
    p, e, n_ff, hashed = f"blk.{i}.", a.n_expert, a.n_ff_exp, i < a.v4.n_hash_layers
    hash_ids = None
    if hashed:
        t = w.f.tensor(p + "ffn_gate_tid2eid.weight")
        table = np.frombuffer(w.f.data(t), dtype=np.int32).reshape(-1, a.n_expert_used)
        if table.shape[0] != a.n_vocab or table.min() < 0 or table.max() >= e:
            raise FerryError(f"{w.f.path}: {p}ffn_gate_tid2eid.weight is not a ({a.n_vocab}, {a.n_expert_used}) table "
                             f"of expert ids below {e}; the file is corrupt, re-convert it")
        w.used.add(t.name)
        hash_ids = torch.from_numpy(table.astype(np.int64))
    bias = None if hashed else w.vector(p + "exp_probs_b.bias", e)
    return HashRoutedMoE(
        router=w.weight(p + "ffn_gate_inp.weight", e, a.n_embd),
        up_exps=w.weight(p + "ffn_up_exps.weight", e, n_ff, a.n_embd),
        gate_exps=w.weight(p + "ffn_gate_exps.weight", e, n_ff, a.n_embd),
        down_exps=w.weight(p + "ffn_down_exps.weight", e, a.n_embd, n_ff),
        n_expert_used=a.n_expert_used, routing=Routing(gating="sqrtsoftplus", bias=bias, scale=a.expert_weights_scale),
        shared=DenseFFN(gate=w.weight(p + "ffn_gate_shexp.weight", n_ff * a.n_expert_shared, a.n_embd),
                        up=w.weight(p + "ffn_up_shexp.weight", n_ff * a.n_expert_shared, a.n_embd),
                        down=w.weight(p + "ffn_down_shexp.weight", a.n_embd, n_ff * a.n_expert_shared),
                        act="silu_clamp"),
        act="silu_clamp", hash_ids=hash_ids)


def build(w: WeightLoader, a: ModelArgs) -> Model:
    v4 = a.v4
    if v4.swiglu_limit != SILU_CLAMP_LIMIT:
        raise FerryError(f"{w.f.path}: the experts' SwiGLU clamp is {v4.swiglu_limit}; ferry runs DeepSeek-V4's "
                         f"{SILU_CLAMP_LIMIT} only")
    if not w.has("blk.0.attn_norm.weight"):
        raise FerryError(f"{w.f.path}: no blk.0.attn_norm.weight: this is a multi-token-prediction file (the "
                         "converter's --mtp output); run the main model's GGUF")
    if a.n_head_kv != 1 or a.q_lora_rank <= 0 or a.n_head * a.head_dim_k % v4.n_out_groups:
        raise FerryError(f"{w.f.path}: deepseek4 needs one KV head (head_count_kv {a.n_head_kv}), a low-rank query "
                         f"(q_lora_rank {a.q_lora_rank}) and heads that split into {v4.n_out_groups} output groups; "
                         "the file is corrupt, re-convert it")
    main = Rope(a.n_rot, a.rope_base, neox=False)
    compress = Rope(a.n_rot, v4.compress_rope_base, neox=False, yarn=a.yarn)
    n_mix, ones = (2 + v4.n_hc) * v4.n_hc, torch.ones(v4.n_hc * a.n_embd)
    blocks = []
    for i in range(a.n_layer):
        p = f"blk.{i}."
        hcs = [HyperConnection(*hyper(w, a, p + kind, n_mix, 3, ones), n_hc=v4.n_hc, n_iters=v4.hc_iters,
                               eps=v4.hc_eps, norm_eps=a.norm_eps, ones=ones) for kind in ("hc_attn", "hc_ffn")]
        blocks.append(Block(attn_hc=hcs[0], attn_norm=w.vector(p + "attn_norm.weight", a.n_embd),
                            attn=attention(w, a, i, main, compress), ffn_hc=hcs[1],
                            ffn_norm=w.vector(p + "ffn_norm.weight", a.n_embd), ffn=moe(w, a, i), eps=a.norm_eps))
    head = HyperHead(*hyper(w, a, "output_hc", v4.n_hc, 1, ones), n_hc=v4.n_hc, eps=v4.hc_eps, norm_eps=a.norm_eps,
                     ones=ones)
    embd, norm, out = load_head(w, a)
    return StreamsModel(a, embd, blocks, norm, out, head=head, n_hc=v4.n_hc)
