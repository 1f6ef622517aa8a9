"""The op layer: weights as layers see them, and the backend that runs the weight-bound ops.

Layers call `ctx.backend.linear(x, w)` and friends and never learn which device ran them;
float work between those ops (norms, rope, attention) is plain torch.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import numpy as np
import torch
from gguf.constants import GGMLQuantizationType

from ferry.quant import dequantize


@dataclass(eq=False)
class Weight:
    """A weight tensor in its GGUF encoding, on the mmap: `ne` is in ggml order (row length first)."""

    name: str
    qtype: GGMLQuantizationType
    ne: tuple[int, ...]
    data: np.ndarray  # raw bytes (uint8), a view of the file
    graphs: dict = field(default_factory=dict, repr=False)  # backend kernels built for this weight
    f32_copy: np.ndarray | None = field(default=None, repr=False)  # for a type no backend kernel reads
    repacked: object = field(default=None, repr=False)  # the CPU backend's interleaved copy (False: none exists)
    own_copy: np.ndarray | None = field(default=None, repr=False)  # ferry's CPU kernels' interleaved copy (Q8_0)
    # an expert tensor's biases, added to each expert's product (gpt-oss): (n_expert, rows) float32
    bias: torch.Tensor | None = field(default=None, repr=False)

    @property
    def nbytes(self) -> int:
        """Its bytes in the file (a tensor record's nbytes)."""
        return self.data.nbytes

    @property
    def shape(self) -> tuple[int, ...]:
        """torch order: (n_expert, rows, cols) or (rows, cols)."""
        return tuple(reversed(self.ne))

    def host_tensor(self) -> torch.Tensor:
        """The raw bytes as a uint8 CPU tensor over the mmap (no copy; the mmap is read-only and torch only reads)."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(self.data)

    def dequantize(self) -> np.ndarray:
        """float32 copy in torch order, by the reference dequantizer (tests and fallbacks only)."""
        return dequantize(self.data, self.qtype, self.ne)
