"""The per-forward context: positions, the KV cache, and what the layers report back (nano-vllm style)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ferry.runtime.kv_cache import KVCache


@dataclass
class Batch:
    """One u-batch of tokens of one sequence, starting at KV position `start`; or, with `seq` and `pos`, tokens
    of several sequences (server slots), sequence s owning cache cells [s * seq_len, (s + 1) * seq_len)."""

    start: int
    n_tokens: int
    kv: KVCache
    all_logits: bool = False
    tail: int = 0  # > 0: the logits of the last `tail` rows (a server step's generating slots), whatever all_logits
    seq: torch.Tensor | None = None  # per token: its sequence (slot)
    pos: torch.Tensor | None = None  # per token: its position in that sequence
    seq_len: int = 0
    expert_ids: list[torch.Tensor] = field(default_factory=list)  # per MoE layer: (n_tokens, n_expert_used) routed to
    _masks: dict[tuple, torch.Tensor] = field(default_factory=dict)
    _angles: dict[object, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @staticmethod
    def join(batches: list[Batch]) -> Batch:
        """One batch over the tokens of consecutive u-batches of one sequence (for the ops of a logical batch that
        run over all its rows at once, which read no position)."""
        return Batch(start=batches[0].start, n_tokens=sum(b.n_tokens for b in batches), kv=batches[0].kv,
                     all_logits=batches[0].all_logits, tail=batches[0].tail)

    @property
    def logit_rows(self) -> int:
        """How many of the last rows get logits: tail, else every row or the last."""
        return self.tail or (self.n_tokens if self.all_logits else 1)

    def spread_expert_ids(self, batches: list[Batch]) -> None:
        """This joined batch's routing, per MoE layer, handed back to the u-batches it joined (their rows)."""
        r0 = 0
        for b in batches:
            b.expert_ids = [ids[r0:r0 + b.n_tokens] for ids in self.expert_ids]
            r0 += b.n_tokens

    @property
    def positions(self) -> torch.Tensor:
        return self.pos if self.pos is not None else torch.arange(self.start, self.start + self.n_tokens)

    @property
    def cells(self) -> torch.Tensor:
        """The cache row each token's keys and values go to."""
        return self.seq * self.seq_len + self.pos if self.seq is not None else self.positions

    @property
    def n_kv(self) -> int:
        """Cache cells attended: up to the last one written."""
        return int(self.cells.max()) + 1 if self.seq is not None else self.start + self.n_tokens

    @property
    def ring_cells(self) -> torch.Tensor:
        """The row each token's keys and values go to in a ring layer (KVCache.ring): its sequence's ring, at its
        position modulo the ring (the cells where the cache keeps no rings)."""
        ring = self.kv.ring
        if not ring:
            return self.cells
        return (0 if self.seq is None else self.seq * ring) + self.positions % ring

    @property
    def ring_kv(self) -> int:
        """Ring rows attended: up to the last one written (a sequence's ring is full once it reaches ring positions)."""
        ring = self.kv.ring
        if self.seq is None:
            return min(ring, self.start + self.n_tokens)
        return int((self.seq * ring + torch.clamp(self.pos + 1, max=ring)).max())

    def ring_mask(self, window: int, n_kv: int | None = None) -> torch.Tensor:
        """(n_tokens, n_kv) bool over ring rows (mask's, for a ring layer): a row of the token's sequence whose
        position is at or before the token's and within its window. After this batch's writes, row r of a sequence
        whose last position here is L holds L - ((L - r) mod ring): rows written before a cut back (resumable) hold
        later positions than that, but ones outside every window of the tokens that follow (so masked here too)."""
        ring, n_kv = self.kv.ring, n_kv or self.ring_kv
        key = ("ring", window, n_kv)
        if key not in self._masks:
            q = self.positions[:, None]
            seq = torch.zeros(self.n_tokens, dtype=torch.long) if self.seq is None else self.seq.long()
            last = torch.full((int(seq.max()) + 1,), -1, dtype=torch.long).scatter_reduce(
                0, seq, self.positions.long(), "amax")[seq][:, None]  # each token's sequence's last position here
            row = torch.arange(n_kv)[None, :]
            held = last - (last - row % ring) % ring
            if self.n_tokens + window > ring + 1 and self.seq is None:
                raise ValueError(f"a u-batch of {self.n_tokens} tokens does not fit a ring of {ring} rows beside a "
                                 f"window of {window}")
            allowed = (row // ring == seq[:, None]) & (held >= 0) & (held <= q) & (q - held < window)
            self._masks[key] = allowed
        return self._masks[key]

    def routing_to_host(self) -> list[torch.Tensor]:
        """This u-batch's routing per MoE layer, copied to the host without waiting for the GPU (pinned memory,
        enqueued behind the forward): read it only after the GPU has finished (Engine.experts_hit does)."""
        return [i.to("cpu", non_blocking=True) if i.is_cuda else i.clone() for i in self.expert_ids]

    def rope_angles(self, rope) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of this batch's positions for a rope, computed once per batch instead of per layer."""
        if rope not in self._angles:
            self._angles[rope] = rope.angles(self.positions)
        return self._angles[rope]

    def mask(self, window: int = 0, n_kv: int | None = None) -> torch.Tensor:
        """(n_tokens, n_kv) bool: causal, and within `window` positions when window > 0 (a longer n_kv
        only adds masked positions)."""
        n_kv = n_kv or self.n_kv
        if (window, n_kv) not in self._masks:
            q = self.positions[:, None]
            cell = torch.arange(n_kv)[None, :]
            if self.seq is not None:  # a cell of the token's own sequence, at or before its position
                k = cell - self.seq[:, None] * self.seq_len
                allowed = (k >= 0) & (k < self.seq_len) & (k <= q)
            else:
                k = cell
                allowed = k <= q
            if window:
                allowed &= (q - k) < window
            self._masks[window, n_kv] = allowed
        return self._masks[window, n_kv]


def count_hits(expert_ids: list[torch.Tensor]) -> list[int]:
    """Per MoE layer, how many distinct experts a u-batch's routing (n_tokens, n_expert_used) went to."""
    if not expert_ids:
        return []
    ids = torch.stack([i.long() for i in expert_ids]).flatten(1)
    hit = torch.zeros(ids.shape[0], int(ids.max()) + 1).scatter_(1, ids, 1.0)
    return hit.sum(1).int().tolist()
