"""A forward over several GPUs in turn (backends/multi_gpu.py): each GPU's op set runs its layers, the activations
move to the next GPU where its run starts. Steps run op by op (no CUDA graphs yet)."""

from __future__ import annotations

import torch

from ferry.backends.multi_gpu import SplitBackend
from ferry.runtime.batch import Batch
from ferry.runtime.runners.cuda_graphs import CudaExecutor


class SplitExecutor:
    """A forward over GPUs in turn: each GPU's CudaExecutor builds the op set of its layers (eagerly)."""

    def __init__(self, backend: SplitBackend):
        self.backend = backend
        self.parts = {d: CudaExecutor(b, graphs=False) for d, b in backend.gpus.items()}

    def forward(self, model, tokens: torch.Tensor, batch: Batch) -> torch.Tensor:
        ops = {d: ex.placed_ops(model, batch, tokens) for d, ex in self.parts.items()}
        layers = self.backend.layers
        current = torch.cuda.current_device()
        torch.cuda.set_device(self.backend.device)  # the embedding's GPU; each block's op set moves on (take)
        try:
            return model.forward_across(ops[layers[0]], [ops[d] for d in layers[:-1]], ops[layers[-1]])
        finally:
            torch.cuda.set_device(current)
