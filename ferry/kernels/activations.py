"""The gated activations of the feed-forward blocks, act(gate) * up, by the names layers give them, as torch
computes them (the GPU's expanded and fallback paths, references): every backend knows the same names."""

from __future__ import annotations

import torch
import torch.nn.functional as F

SWIGLU_OAI = (1.702, 7.0)  # gpt-oss's clamped SwiGLU: alpha, limit (neither is in the file; llama.cpp fixes them too)


def _swiglu_oai(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gpt-oss's: g * sigmoid(alpha g) * (u + 1), the gate clamped above at the limit, up to +-limit."""
    alpha, limit = SWIGLU_OAI
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return gate * torch.sigmoid(alpha * gate) * (up + 1)


SILU_CLAMP_LIMIT = 10.0  # DeepSeek-V4's swiglu_limit (the file's swiglu_clamp_exp; models/deepseek4.py checks it)


def _silu_clamp(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V4's: silu(g) * u, the gate clamped above at the limit, up to +-limit."""
    return F.silu(gate.clamp(max=SILU_CLAMP_LIMIT)) * up.clamp(-SILU_CLAMP_LIMIT, SILU_CLAMP_LIMIT)


GLU = {
    "silu": lambda gate, up: F.silu(gate) * up,
    "gelu": lambda gate, up: F.gelu(gate, approximate="tanh") * up,
    "swiglu_oai": _swiglu_oai,
    "silu_clamp": _silu_clamp,
}
