"""The per-forward context: positions, the KV cache, and what the layers report back (nano-vllm style)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ferry.runtime.kv_cache import KVCache


@dataclass
class Batch:
    """One u-batch of tokens of one sequence, starting at KV position `start`."""

    start: int
    n_tokens: int
    kv: KVCache
    all_logits: bool = False
    expert_ids: list[torch.Tensor] = field(default_factory=list)  # per MoE layer: (n_tokens, n_expert_used) routed to
    _masks: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    _angles: dict[object, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def positions(self) -> torch.Tensor:
        return torch.arange(self.start, self.start + self.n_tokens)

    @property
    def n_kv(self) -> int:
        return self.start + self.n_tokens

    @property
    def experts_hit(self) -> list[int]:
        """Per MoE layer, how many distinct experts this u-batch routed to."""
        if not self.expert_ids:
            return []
        ids = torch.stack(self.expert_ids).long().flatten(1)
        hit = torch.zeros(ids.shape[0], int(ids.max()) + 1).scatter_(1, ids, 1.0)
        return hit.sum(1).int().tolist()

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
            k = torch.arange(n_kv)[None, :]
            allowed = k <= q
            if window:
                allowed &= (q - k) < window
            self._masks[window, n_kv] = allowed
        return self._masks[window, n_kv]
