"""DeepSeek sparse attention's lightning indexer on the GPU (layers/indexer.py): every cached position's score for each
query, then each query's top-k positions, as cell ids the attention kernels read (attention_decode's `select`).

The scores kernel reads each token's sequence only up to its position (pos, base: device tensors), so a recorded CUDA
graph serves every cache length: a block of cells past it only writes -inf."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SCORE_CELLS = 64  # cells per program
SCORE_HEADS = 16  # heads per tl.dot (float32 keys)
TILED_FROM = 9  # tokens from which f16 scores take 16 tokens per program (the heads looped) rather than one


@triton.jit
def _indexer_scores(q, w, keys, pos, base, out, n_heads, d, key_row, n_cols, BN: tl.constexpr, BD: tl.constexpr,
                    BH: tl.constexpr, HALF: tl.constexpr):
    """Token t's scores of cells blk * BN ..: sum over heads of w[t, h] * relu(q[t, h] . key[cell]), for the cells of
    its sequence up to its position (base[t] .. base[t] + pos[t]); -inf for the others. BH heads at a time as the rows
    of one product with the block of keys: HALF, f16 on the tensor cores; else float32 (ieee), as the CPU's."""
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BN + tl.arange(0, BN)
    b0 = tl.load(base + t)
    last = b0 + tl.load(pos + t)
    live = (j >= b0) & (j <= last) & (j < n_cols)
    acc = tl.zeros((BN,), dtype=tl.float32)
    if tl.program_id(1) * BN <= last:
        dd = tl.arange(0, BD)
        hh = tl.arange(0, BH)
        kt = tl.load(keys + j.to(tl.int64)[None, :] * key_row + dd[:, None], mask=live[None, :] & (dd < d)[:, None],
                     other=0.0)  # (BD, BN)
        for h0 in range(0, n_heads, BH):
            qh = tl.load(q + (t * n_heads + h0 + hh)[:, None] * d + dd[None, :],
                         mask=(h0 + hh < n_heads)[:, None] & (dd < d)[None, :], other=0.0)
            if HALF:
                s = tl.dot(qh.to(tl.float16), kt.to(tl.float16))  # (BH, BN)
            else:
                s = tl.dot(qh, kt.to(tl.float32), input_precision="ieee")
            wh = tl.load(w + t * n_heads + h0 + hh, mask=h0 + hh < n_heads, other=0.0)
            acc += tl.sum(tl.maximum(s, 0.0) * wh[:, None], axis=0)
    tl.store(out + t * n_cols + j, tl.where(live, acc, float("-inf")), mask=j < n_cols)


@triton.jit
def _indexer_scores_tiled(q, w, keys, pos, base, out, n, n_heads, d, key_row, n_cols, BT: tl.constexpr,
                          BN: tl.constexpr, BD: tl.constexpr):
    """A prompt's form of _indexer_scores: tokens tb * BT .. against cells blk * BN .., the block of keys read once for
    all of them, each head's scores one tensor-core product of f16 queries and keys (float32 sums)."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    tm = t < n
    j = tl.program_id(1) * BN + tl.arange(0, BN)
    b0 = tl.load(base + t, mask=tm, other=0)
    last = b0 + tl.load(pos + t, mask=tm, other=-1)
    live = (j[None, :] >= b0[:, None]) & (j[None, :] <= last[:, None]) & (j < n_cols)[None, :] & tm[:, None]
    acc = tl.zeros((BT, BN), dtype=tl.float32)
    if tl.program_id(1) * BN <= tl.max(last, axis=0):
        dd = tl.arange(0, BD)
        kt = tl.load(keys + j.to(tl.int64)[None, :] * key_row + dd[:, None],
                     mask=(j < n_cols)[None, :] & (dd < d)[:, None], other=0.0).to(tl.float16)  # (BD, BN)
        for h in range(0, n_heads):
            qh = tl.load(q + (t.to(tl.int64)[:, None] * n_heads + h) * d + dd[None, :],
                         mask=tm[:, None] & (dd < d)[None, :], other=0.0).to(tl.float16)
            wh = tl.load(w + t * n_heads + h, mask=tm, other=0.0)
            acc += tl.maximum(tl.dot(qh, kt), 0.0) * wh[:, None]
    tl.store(out + t.to(tl.int64)[:, None] * n_cols + j[None, :], tl.where(live, acc, float("-inf")),
             mask=tm[:, None] & (j < n_cols)[None, :])


def indexer_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, pos: torch.Tensor, base: torch.Tensor,
                   n_cols: int) -> torch.Tensor:
    """q (n, heads, d), w (n, heads) float, keys (cells, d) f16 or f32 cache rows, pos / base (n,) device integers ->
    (n, n_cols) float32 scores, -inf where a token does not see the cell. Products in the keys' precision: f16 keys
    (an f16 or quantized cache) on the tensor cores, f16 queries (a prompt's tiled over 16 tokens, each block of keys
    read once for them; a decode step's with its heads as the rows); f32 keys (an f32 cache) in float32 (ieee)."""
    q, w = q.float().contiguous(), w.float().contiguous()
    n, heads, d = q.shape
    out = torch.empty(n, n_cols, dtype=torch.float32, device=q.device)
    bd = max(16, triton.next_power_of_2(d))
    half = keys.dtype == torch.float16
    if half and n >= TILED_FROM:
        _indexer_scores_tiled[(triton.cdiv(n, 16), triton.cdiv(n_cols, SCORE_CELLS))](
            q, w, keys, pos, base, out, n, heads, d, keys.stride(0), n_cols, BT=16, BN=SCORE_CELLS, BD=bd, num_warps=4)
        return out
    _indexer_scores[(n, triton.cdiv(n_cols, SCORE_CELLS))](
        q, w, keys, pos, base, out, heads, d, keys.stride(0), n_cols, BN=SCORE_CELLS, BD=bd,
        BH=min(64, max(16, triton.next_power_of_2(heads))) if half else SCORE_HEADS, HALF=half, num_warps=4)
    return out


def indexer_top_k(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, pos: torch.Tensor, base: torch.Tensor,
                  top_k: int, n_cols: int) -> torch.Tensor:
    """Each token's top_k cells by score among the first n_cols (indexer_scores), as (n, top_k) int32 cell ids; -1 in
    the slots of a token that sees fewer (it then attends to all it sees: dense attention)."""
    scores = indexer_scores(q, w, keys, pos, base, n_cols)
    vals, ids = scores.topk(min(top_k, n_cols), dim=1)
    ids = torch.where(vals > float("-inf"), ids, -1).to(torch.int32)
    if ids.shape[1] < top_k:
        ids = torch.cat([ids, ids.new_full((ids.shape[0], top_k - ids.shape[1]), -1)], 1)
    return ids


def selected_mask(select: torch.Tensor, n_kv: int) -> torch.Tensor:
    """(n, top_k) cell ids (-1: none) -> (n, n_kv) bool, True at the selected cells."""
    ids = select.long()
    mask = torch.zeros(ids.shape[0], n_kv + 1, dtype=torch.bool, device=ids.device)
    mask.scatter_(1, torch.where(ids >= 0, ids, n_kv), True)  # the empty slots land on a column dropped here
    return mask[:, :n_kv]
