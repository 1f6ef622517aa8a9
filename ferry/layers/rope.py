"""Rotary position embedding in ggml's two layouts: 'normal' (adjacent pairs) and 'neox' (halves)."""

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Yarn:
    """YaRN's rope scaling as llama.cpp applies it (ggml's rope_yarn): each frequency pair's angle mixes the
    interpolated (position / factor) and the original angle by a ramp between the correction dimensions of
    beta_fast and beta_slow; the attention scale grows by (1 + log_mul * ln(factor))^2 (DeepSeek's log_mul from the
    file; gpt-oss's 0.1, the cos/sin scale of its attention_factor, squared: the same for a fully rotated head) and
    cos/sin stay unscaled. `truncate`: the correction dimensions floored and ceiled, as ggml and DeepSeek's
    transformers code take them; gpt-oss's transformers code (its reference) takes them as they are."""

    factor: float
    n_ctx_orig: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    log_mul: float = 0.0
    truncate: bool = True

    def corr_dims(self, n_rot: int, base: float) -> tuple[float, float]:
        def dim(beta: float) -> float:
            return n_rot * math.log(self.n_ctx_orig / (beta * 2 * math.pi)) / (2 * math.log(base))

        low, high = dim(self.beta_fast), dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        return max(0.0, low), min(n_rot - 1.0, high)

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
    inverse: bool = False  # the rotation undone (sin negated): DeepSeek-V4 takes it off its attention's output

    def inv_freq(self) -> torch.Tensor:
        """Each rotated pair's angle per position (float64): base^(-2i / n_rot) / scale, YaRN's mix applied."""
        inv_freq = self.base ** (-torch.arange(0, self.n_rot, 2, dtype=torch.float64) / self.n_rot) / self.scale
        if self.yarn is not None:
            low, high = self.yarn.corr_dims(self.n_rot, self.base)
            pair = torch.arange(self.n_rot // 2, dtype=torch.float64)
            mix = 1 - ((pair - low) / max(0.001, high - low)).clamp(0, 1)  # 1: keep the original angle
            inv_freq = inv_freq / self.yarn.factor * (1 - mix) + inv_freq * mix
        return inv_freq

    def angles(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        theta = positions.double()[:, None] * self.inv_freq()[None, :]
        return theta.cos().float(), (-theta.sin() if self.inverse else theta.sin()).float()

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
