"""Layers split across several GPUs (llama.cpp's -sm layer, -ts): each GPU holds a run of consecutive layers, their
KV cache and weights, and computes them; the embedding runs on the first layer's GPU, the output on the output
layer's."""

from __future__ import annotations

from ferry.backends.cuda import CudaBackend
from ferry.weight import Weight


def _torch_device(name: str) -> str:
    return f"cuda:{int(name[4:])}"  # "CUDA1" -> "cuda:1"


class SplitBackend:
    """`devices`: weight name -> "CUDA0", "CUDA1", ...; `layers`: the device of each layer and, last, the output's
    (placement.layer_devices)."""

    name = "CUDA"
    graph_safe = False  # a step crosses devices: eager

    def __init__(self, devices: dict[str, str], layers: list[str], moe: str = "auto"):
        self.gpus = {d: CudaBackend(_torch_device(d), moe) for d in dict.fromkeys(layers)}
        self.devices, self.layers = devices, layers
        self.device = self.gpus[layers[0]].device

    @property
    def layer_devices(self) -> list[str]:
        """The torch device of each layer's KV cache."""
        return [_torch_device(d) for d in self.layers[:-1]]

    def _for(self, w: Weight) -> CudaBackend:
        """The GPU of w's layer; input tensors (token_embd) go with the first layer."""
        return self.gpus.get(self.devices.get(w.name), self.gpus[self.layers[0]])

    def upload(self, w: Weight):
        return self._for(w).upload(w)

    def upload_fused(self, ws: tuple[Weight, ...]) -> None:
        self._for(ws[0]).upload_fused(ws)

    def synchronize(self) -> None:
        for b in self.gpus.values():
            b.synchronize()
