"""Layers split across several GPUs (llama.cpp's -sm layer, -ts): each GPU holds a run of consecutive layers, their
KV cache and weights, and computes them; the embedding runs on the first layer's GPU, the output on the output
layer's. The runner (runtime/runners/multi_gpu.py) gives each GPU's layers to that GPU's CudaBackend; an op called
here goes to the GPU that holds its weight."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ferry.backends.cuda import CudaBackend
from ferry.weight import Weight


def _torch_device(name: str) -> torch.device:
    return torch.device(f"cuda:{int(name[4:])}")  # "CUDA1" -> cuda:1


class MultiGpuBackend:
    """`devices`: weight name -> "CUDA0", "CUDA1", ...; `layers`: the device of each layer and, last, the output's
    (placement.layer_devices)."""

    label = "CUDA"
    graph_safe = False  # a step crosses devices: eager
    layer_first = False

    def __init__(self, devices: dict[str, str], layers: list[str], moe: str = "auto", n_threads: int = 0):
        self.gpus = {d: CudaBackend(_torch_device(d), moe, n_threads) for d in dict.fromkeys(layers)}
        self.devices, self.layers = devices, layers
        self.device = self.gpus[layers[0]].device
        self.n_threads = n_threads

    def kv_devices(self, n_layer: int) -> list[torch.device]:
        return [_torch_device(d) for d in self.layers[:n_layer]]

    def _for(self, w: Weight) -> CudaBackend:
        """The GPU of w's layer; input tensors (token_embd) go with the first layer."""
        return self.gpus.get(self.devices.get(w.name), self.gpus[self.layers[0]])

    def prepare(self, weights: list[Weight], fused: list[tuple[Weight, ...]] = (),
                progress: Callable[[int, int], None] | None = None) -> None:
        for group in fused:
            self._for(group[0]).upload_fused(group)
        total, done = sum(w.nbytes for w in weights), 0
        for w in weights:
            self._for(w).upload(w)
            done += w.nbytes
            if progress:
                progress(done, total)

    def upload(self, w: Weight):
        return self._for(w).upload(w)

    def linear(self, x: torch.Tensor, w: Weight) -> torch.Tensor:
        return self._for(w).linear(x, w)

    def ffn(self, x: torch.Tensor, gate: Weight, up: Weight, down: Weight, act: str) -> torch.Tensor:
        return self._for(gate).ffn(x, gate, up, down, act)

    def get_rows(self, w: Weight, ids: torch.Tensor) -> torch.Tensor:
        return self._for(w).get_rows(w, ids)

    def moe(self, x: torch.Tensor, router: Weight, up: Weight, gate: Weight, down: Weight, n_used: int,
            norm_topk: bool, act: str, routing=None, residual: torch.Tensor | None = None):
        return self._for(gate).moe(x, router, up, gate, down, n_used, norm_topk, act, routing, residual)

    def moe_experts(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, up: Weight, gate: Weight,
                    down: Weight, act: str) -> torch.Tensor:
        return self._for(gate).moe_experts(x, ids, weights, up, gate, down, act)

    def vector(self, t: torch.Tensor) -> torch.Tensor:
        return self.gpus[self.layers[0]].vector(t)

    def synchronize(self) -> None:
        for b in self.gpus.values():
            b.synchronize()

    def describe(self) -> str:
        return "layers on " + ", ".join(f"{d} x{self.layers[:-1].count(d)}" for d in self.gpus)

    def notes(self) -> list[str]:
        return []

    def report(self) -> list[str]:
        return []

    def close(self) -> None:
        pass
