"""Rotary position embedding in ggml's two layouts: 'normal' (adjacent pairs) and 'neox' (halves)."""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Rope:
    n_rot: int  # rotated dimensions per head (the first n_rot; the rest pass through)
    base: float
    neox: bool
    scale: float = 1.0  # linear position scaling: positions are divided by this factor

    def angles(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self.base ** (-torch.arange(0, self.n_rot, 2, dtype=torch.float64) / self.n_rot)
        theta = (positions.double()[:, None] / self.scale) * inv_freq[None, :]
        return theta.cos().float(), theta.sin().float()

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: (n_tokens, n_heads, head_dim); cos/sin: (n_tokens, n_rot / 2)."""
        rot, rest = x[..., :self.n_rot], x[..., self.n_rot:]
        cos, sin = cos[:, None, :], sin[:, None, :]
        if self.neox:
            a, b = rot[..., : self.n_rot // 2], rot[..., self.n_rot // 2:]
            out = torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)
        else:
            a, b = rot[..., 0::2], rot[..., 1::2]
            out = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)
        return torch.cat([out, rest], dim=-1) if rest.shape[-1] else out
