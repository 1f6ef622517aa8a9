"""Rotary position embedding in ggml's two layouts: 'normal' (adjacent pairs) and 'neox' (halves)."""

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Yarn:
    """YaRN's rope scaling as llama.cpp applies it (ggml's rope_yarn): each frequency pair's angle mixes the
    interpolated (position / factor) and the original angle by a ramp between the correction dimensions of
    beta_fast and beta_slow; DeepSeek's attention scale grows by (1 + log_mul * ln(factor))^2 and its cos/sin stay
    unscaled."""

    factor: float
    n_ctx_orig: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    log_mul: float = 0.0

    def corr_dims(self, n_rot: int, base: float) -> tuple[float, float]:
        def dim(beta: float) -> float:
            return n_rot * math.log(self.n_ctx_orig / (beta * 2 * math.pi)) / (2 * math.log(base))

        return max(0.0, math.floor(dim(self.beta_fast))), min(n_rot - 1.0, math.ceil(dim(self.beta_slow)))

    @property
    def attn_scale(self) -> float:
        return (1.0 + self.log_mul * math.log(self.factor)) ** 2


@dataclass(frozen=True)
class Rope:
    n_rot: int  # rotated dimensions per head (the first n_rot; the rest pass through)
    base: float
    neox: bool
    scale: float = 1.0  # linear position scaling: positions are divided by this factor
    yarn: Yarn | None = None

    def angles(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self.base ** (-torch.arange(0, self.n_rot, 2, dtype=torch.float64) / self.n_rot)
        theta = (positions.double()[:, None] / self.scale) * inv_freq[None, :]
        if self.yarn is not None:
            low, high = self.yarn.corr_dims(self.n_rot, self.base)
            pair = torch.arange(self.n_rot // 2, dtype=torch.float64)
            mix = 1 - ((pair - low) / max(0.001, high - low)).clamp(0, 1)  # 1: keep the original angle
            theta = theta / self.yarn.factor * (1 - mix) + theta * mix
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
