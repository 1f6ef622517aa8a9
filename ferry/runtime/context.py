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
    experts_hit: list[int] = field(default_factory=list)  # per MoE layer: distinct experts routed to
    _masks: dict[int, torch.Tensor] = field(default_factory=dict)
    _angles: dict[object, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def positions(self) -> torch.Tensor:
        return torch.arange(self.start, self.start + self.n_tokens)

    @property
    def n_kv(self) -> int:
        return self.start + self.n_tokens

    def rope_angles(self, rope) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of this batch's positions for a rope, computed once per batch instead of per layer."""
        if rope not in self._angles:
            self._angles[rope] = rope.angles(self.positions)
        return self._angles[rope]

    def mask(self, window: int = 0) -> torch.Tensor:
        """(n_tokens, n_kv) bool: causal, and within `window` positions when window > 0."""
        if window not in self._masks:
            q = self.positions[:, None]
            k = torch.arange(self.n_kv)[None, :]
            allowed = k <= q
            if window:
                allowed &= (q - k) < window
            self._masks[window] = allowed
        return self._masks[window]
