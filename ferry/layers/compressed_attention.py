"""DeepSeek-V4's attention: one key head that is also the value (shared-KV MQA), a low-rank query normed per head,
rope on the last rope.n_rot values of each head (in pairs), a sink logit per head, the output's rope taken off
again at the query's position, and a grouped output projection (each group of heads through its own low-rank
matrix, then one matrix for all).

Every layer attends to the last `window` positions. Layers with a compress ratio also attend to pooled entries:
each complete window of `ratio` positions pools into one entry (a softmax over the window's positions, per
channel, of the gate projection plus a learned bias by place, weighting the kv projection; then an RMSNorm and
rope at the window's first position). A query at position t sees entry w if w < (t + 1) // ratio. The heavily
compressed layers (ratio 128) see every entry they may; the compressed sparse ones (ratio 4, windows that overlap:
each entry also pools the previous window's first half of a double-width projection) see the top_k entries that
a lightning indexer picks, scored over an indexer compressor's entries of their own."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ferry.layers.rope import Rope
from ferry.weight import Weight


def rope_tail(ops, x, d: int, rope: Rope):
    """rope on the last rope.n_rot values of each head of x (n, heads, d); the first ones pass through."""
    if rope.n_rot == d:
        return ops.rope(x, rope)
    rest, tail = ops.split(x, [d - rope.n_rot, rope.n_rot])
    return ops.concat(rest, ops.rope(tail, rope))


@dataclass
class Compressor:
    """One compressor: its layer's (or its indexer's) entries, one per complete window."""

    layer: int
    name: str  # "attn" or "index": layers/cache.py's Compressed, where its state lives
    wkv: Weight  # (width, n_embd): width = dim, or 2 * dim where windows overlap
    wgate: Weight  # (width, n_embd)
    ape: torch.Tensor  # (ratio, width): the gate's bias by place in the window
    norm: torch.Tensor  # (dim,)
    ratio: int
    dim: int
    rope: Rope  # at each entry's window's first position, on its last rope.n_rot values
    norm_eps: float

    @property
    def overlap(self) -> bool:
        return self.wkv.ne[1] == 2 * self.dim

    def rows(self, ops, x):
        """This batch's kv and score rows (n, width) (the score without its bias by place): what ops.compress pools."""
        return ops.linear(x, self.wkv), ops.linear(x, self.wgate)


@dataclass
class CompressedIndexer:
    """The lightning indexer of a compressed sparse layer: entry w's score for the query at t is sum over heads h of
    w_h(t) * relu(q_h(t) . k(w)) / sqrt(heads * head_dim), with keys from its own compressor, queries from the
    attention's normed low-rank query (rope on their tails), head weights from the layer's input."""

    compressor: Compressor
    wq_b: Weight  # (n_head * head_dim, q_lora_rank)
    w_heads: Weight  # (n_head, n_embd)
    n_head: int
    head_dim: int
    top_k: int
    rope: Rope

    def inputs(self, ops, x, qr):
        """(its compressor's kv and score rows, the heads' queries (n, heads, head_dim), their weights (n, heads)) of
        this batch: what ops.compressed_select scores."""
        q = ops.heads(ops.linear(qr, self.wq_b), self.n_head, self.head_dim)
        w = ops.scale(ops.linear(x, self.w_heads), (self.n_head * self.head_dim) ** -0.5)
        return (*self.compressor.rows(ops, x), rope_tail(ops, q, self.head_dim, self.rope), w)


@dataclass
class CompressedAttention:
    layer: int
    wq_a: Weight  # (q_lora_rank, n_embd)
    q_norm: torch.Tensor  # (q_lora_rank,)
    wq_b: Weight  # (n_head * head_dim, q_lora_rank)
    wkv: Weight  # (head_dim, n_embd): the one key (and value) head
    kv_norm: torch.Tensor  # (head_dim,)
    sinks: torch.Tensor  # (n_head,)
    wo_a: list[Weight]  # per group of heads: (out_lora_rank, n_head * head_dim / groups)
    wo_b: Weight  # (n_embd, groups * out_lora_rank)
    n_head: int
    head_dim: int
    window: int
    rope: Rope  # plain for sliding-only layers, YaRN's compress rope for the others
    unrope: Rope  # rope, undone
    norm_eps: float
    ones: torch.Tensor  # (head_dim,): the query's per-head RMSNorm has no weight
    compressor: Compressor | None = None
    indexer: CompressedIndexer | None = None

    @property
    def ratio(self) -> int:
        return self.compressor.ratio if self.compressor else 0

    def __call__(self, ops, x):
        """x: the normed input (n, n_embd) -> (n, n_embd)."""
        qr = ops.rms_norm(ops.linear(x, self.wq_a), self.q_norm, self.norm_eps)
        q = ops.rms_norm(ops.heads(ops.linear(qr, self.wq_b), self.n_head, self.head_dim), self.ones, self.norm_eps)
        q = rope_tail(ops, q, self.head_dim, self.rope)
        kv = ops.heads(ops.rms_norm(ops.linear(x, self.wkv), self.kv_norm, self.norm_eps), 1, self.head_dim)
        kv = rope_tail(ops, kv, self.head_dim, self.rope)
        pooled = self.compressor.rows(ops, x) if self.compressor else ()
        indexed = self.indexer.inputs(ops, x, qr) if self.indexer else ()
        out = ops.compressed_attention(self, q, kv, pooled, indexed)
        out = ops.merge_heads(rope_tail(ops, ops.heads(out, self.n_head, self.head_dim), self.head_dim,
                                         self.unrope))
        groups = ops.split(out, [self.n_head * self.head_dim // len(self.wo_a)] * len(self.wo_a))
        low = ops.linear(groups[0], self.wo_a[0])
        for g, w in zip(groups[1:], self.wo_a[1:]):
            low = ops.concat(low, ops.linear(g, w))
        return ops.linear(low, self.wo_b)
