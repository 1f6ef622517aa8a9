"""What every backend offers, as typing Protocols: the engine, the runners and the tools ask a backend what it can do
through these, never by its class or its name."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch

from ferry.weight import Weight


@runtime_checkable
class Backend(Protocol):
    """Runs a model's weight-bound ops (linear, ffn, get_rows, moe, ...) where its weights are placed."""

    label: str  # for reports only (llama-bench's backend column): "CPU", "CUDA", "CUDA+CPU"
    device: torch.device  # where a forward's activations live
    n_threads: int  # the CPU threads it computes with (-t; reported where nothing runs on the CPU, as llama-bench)
    layer_first: bool  # whether a logical batch of several u-batches should run layer by layer (experts in RAM)

    def kv_devices(self, n_layer: int) -> list[torch.device] | None:
        """Where each layer's KV cache lives; None: in host memory, for ggml's graphs (the CPU-only forward)."""

    def prepare(self, weights: list[Weight], fused: list[tuple[Weight, ...]],
                progress: Callable[[int, int], None] | None = None) -> None:
        """Put the model's weights where they run (upload, repack, register for streaming); `fused`: groups that one
        input feeds (attention's q, k, v); progress(done, total) in bytes, for a bar."""

    def linear(self, x: torch.Tensor, w: Weight) -> torch.Tensor: ...

    def ffn(self, x: torch.Tensor, gate: Weight, up: Weight, down: Weight, act: str) -> torch.Tensor: ...

    def get_rows(self, w: Weight, ids: torch.Tensor) -> torch.Tensor: ...

    def moe(self, x: torch.Tensor, router: Weight, up: Weight, gate: Weight, down: Weight, n_used: int,
            norm_topk: bool, act: str, routing=None): ...

    def moe_experts(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, up: Weight, gate: Weight,
                    down: Weight, act: str) -> torch.Tensor:
        """The routed experts chosen elsewhere (ids, weights (n, k)): their weighted sum (n, n_embd)."""

    def vector(self, t: torch.Tensor) -> torch.Tensor:
        """A small float model tensor (norm weight, bias) where this backend computes."""

    def synchronize(self) -> None:
        """Wait for the queued work (a no-op where nothing is queued)."""

    def describe(self) -> str:
        """One line for the run's report: where the weights are and what runs where."""

    def notes(self) -> list[str]:
        """What the user should hear after a run (auto measured far from the calibration, ...)."""

    def report(self) -> list[str]:
        """The recorded offload decisions as table lines (--verbose); [] where nothing is decided."""

    def close(self) -> None: ...


@runtime_checkable
class GpuBackend(Backend, Protocol):
    """A backend whose activations live on a GPU: what the CUDA graph runner (runtime/runners/cuda_graphs.py) and the
    GPU op set (runtime/runners/cuda.py) ask of it."""

    graph_safe: bool  # a forward needs nothing from the host: a step can be recorded as one CUDA graph
    recorder: object  # set by the runner while it records a step cut at host steps or cache-sized work

    @property
    def host_steps(self) -> bool:
        """Whether a step may be recorded as CUDA graphs between host steps (ops on weights in RAM)."""

    def decided(self, n_tokens: int) -> str | None:
        """auto's measured way for u-batches of n_tokens, once it has one (a step recorded before is recorded again)."""

    def half(self, t: torch.Tensor) -> torch.Tensor:
        """A float model tensor read by matmuls, as float16 on the GPU (once)."""

    def fused(self, ws: tuple[Weight, ...]):
        """The weights of `ws` uploaded as one matrix (prepare's fused groups), or None."""

    def joined(self, ts: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Small float model tensors (a fused matrix's biases) end to end on the GPU as one float32 vector (once)."""
