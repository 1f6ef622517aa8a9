"""What every runner offers the engine (a typing Protocol)."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from ferry.runtime.batch import Batch


@runtime_checkable
class Runner(Protocol):
    layer_first: bool  # whether it runs a logical batch's u-batches layer by layer (forward_layer_first)

    def forward(self, model, tokens: torch.Tensor, batch: Batch) -> torch.Tensor:
        """The logits of one u-batch (or of several sequences' tokens: server slots)."""

    def will_record(self) -> bool:
        """Whether a shape that has run will be recorded when it runs again: a one-time cost a benchmark's warm-up
        should take."""

    def report(self) -> list[str]:
        """What it measured and kept (--verbose): -mla 3's prompt forms on a GPU; [] elsewhere."""
