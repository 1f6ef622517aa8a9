"""RMSNorm (alone, or with the residual add before it) and RoPE from a position table, optionally after a per-head
norm (q/k norms)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm(x, w, y, n, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)
    m = i < n
    v = tl.load(x + row * n + i, mask=m, other=0.0)
    inv = 1.0 / tl.sqrt(tl.sum(v * v, axis=0) / n + eps)
    tl.store(y + row * n + i, v * inv * tl.load(w + i, mask=m, other=0.0), mask=m)


@triton.jit
def _add_rms_norm(x, dx, w, s, y, n, eps, BLOCK: tl.constexpr):
    """s = x + dx (the residual stream), y = RMSNorm(s) * w, per row."""
    row = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)
    m = i < n
    v = tl.load(x + row * n + i, mask=m, other=0.0) + tl.load(dx + row * n + i, mask=m, other=0.0)
    tl.store(s + row * n + i, v, mask=m)
    inv = 1.0 / tl.sqrt(tl.sum(v * v, axis=0) / n + eps)
    tl.store(y + row * n + i, v * inv * tl.load(w + i, mask=m, other=0.0), mask=m)


@triton.jit
def _rotated(x, w, cos, sin, p, dim, n_rot, eps, HAS_NORM: tl.constexpr, NEOX: tl.constexpr, BLOCK: tl.constexpr):
    """One head's values at x (dim floats): optional RMSNorm with w, then the first n_rot dims rotated by the
    angles of position p (row p of the cos/sin tables, n_rot / 2 wide). Lanes past dim are 0."""
    i = tl.arange(0, BLOCK)
    m = i < dim
    v = tl.load(x + i, mask=m, other=0.0)
    half = n_rot // 2
    if NEOX:  # pairs (i, i + n_rot / 2)
        pair = tl.where(i < half, i + half, i - half)
        k = i % half
        sign = tl.where(i < half, -1.0, 1.0)
    else:  # adjacent pairs (2k, 2k + 1)
        pair = i ^ 1
        k = i // 2
        sign = tl.where(i % 2 == 0, -1.0, 1.0)
    rot = m & (i < n_rot)
    other = tl.load(x + pair, mask=rot, other=0.0)
    if HAS_NORM:
        inv = 1.0 / tl.sqrt(tl.sum(v * v, axis=0) / dim + eps)
        v = v * inv * tl.load(w + i, mask=m, other=0.0)
        other = other * inv * tl.load(w + pair, mask=rot, other=0.0)
    c = tl.load(cos + p * half + k, mask=rot, other=1.0)
    s = tl.load(sin + p * half + k, mask=rot, other=0.0)
    return tl.where(rot, v * c + sign * other * s, v)


@triton.jit
def _norm_rope(x, w, cos, sin, pos, y, n_heads, dim, n_rot, eps, HAS_NORM: tl.constexpr, NEOX: tl.constexpr,
               BLOCK: tl.constexpr):
    """One head of one token: optional RMSNorm over the head, then RoPE at the token's position pos[t]."""
    row = tl.program_id(0).to(tl.int64)
    p = tl.load(pos + row // n_heads).to(tl.int64)
    out = _rotated(x + row * dim, w, cos, sin, p, dim, n_rot, eps, HAS_NORM, NEOX, BLOCK)
    i = tl.arange(0, BLOCK)
    tl.store(y + row * dim + i, out, mask=i < dim)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Over the last dimension, float32."""
    x = x.float().contiguous()
    n = x.shape[-1]
    y = torch.empty_like(x)
    _rms_norm[(x.numel() // n,)](x, w, y, n, eps, BLOCK=triton.next_power_of_2(n))
    return y


def add_rms_norm(x: torch.Tensor, dx: torch.Tensor, w: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + dx, RMSNorm(x + dx) * w) over the last dimension, float32, in one pass."""
    x, dx = x.float().contiguous(), dx.float().contiguous()
    n = x.shape[-1]
    s, y = torch.empty_like(x), torch.empty_like(x)
    _add_rms_norm[(x.numel() // n,)](x, dx, w, s, y, n, eps, BLOCK=triton.next_power_of_2(n))
    return s, y


def norm_rope(x: torch.Tensor, w: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
              pos: torch.Tensor, n_rot: int, neox: bool) -> torch.Tensor:
    """x (n, heads, dim): optional per-head RMSNorm with w, then RoPE at positions pos (n,) from the tables."""
    x = x.float().contiguous()
    n, heads, dim = x.shape
    y = torch.empty_like(x)
    _norm_rope[(n * heads,)](x, w if w is not None else x, cos, sin, pos, y, heads, dim, n_rot, eps,
                             HAS_NORM=w is not None, NEOX=neox, BLOCK=triton.next_power_of_2(dim))
    return y
