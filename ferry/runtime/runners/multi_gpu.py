"""A forward over several GPUs in turn (backends/multi_gpu.py): each GPU's op set runs its layers, the activations
move to the next GPU where its run starts. Steps run op by op (no CUDA graphs yet)."""

from __future__ import annotations

import torch

from ferry.backends.multi_gpu import MultiGpuBackend
from ferry.runtime.batch import Batch
from ferry.runtime.runners.cuda_graphs import CudaGraphRunner


class MultiGpuRunner:
    """A forward over GPUs in turn: each GPU's CudaGraphRunner builds the op set of its layers (eagerly)."""

    def __init__(self, backend: MultiGpuBackend):
        self.backend = backend
        self.parts = {d: CudaGraphRunner(b, graphs=False) for d, b in backend.gpus.items()}

    layer_first = False

    def will_record(self) -> bool:
        return False

    def report(self) -> list[str]:
        return []

    def forward(self, model, tokens: torch.Tensor, batch: Batch) -> torch.Tensor:
        ops = {d: ex.placed_ops(model, batch, tokens) for d, ex in self.parts.items()}
        layers = self.backend.layers
        current = torch.cuda.current_device()
        torch.cuda.set_device(self.backend.device)  # the embedding's GPU; each block's op set moves on (take)
        try:
            return model.forward_across(ops[layers[0]], [ops[d] for d in layers[:-1]], ops[layers[-1]])
        finally:
            torch.cuda.set_device(current)
