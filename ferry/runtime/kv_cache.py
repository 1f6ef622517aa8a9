"""KV cache for one sequence: per layer, keys and values of every position, in f16 (llama.cpp's default)."""

from __future__ import annotations

import torch

from ferry.errors import FerryError

KV_TYPES = {"f16": torch.float16, "f32": torch.float32}


class KVCache:
    def __init__(self, n_layer: int, n_ctx: int, n_head_kv: int, head_dim_k: int, head_dim_v: int,
                 kv_type: str = "f16"):
        if kv_type not in KV_TYPES:
            raise FerryError(f"unknown KV cache type '{kv_type}'; valid types: {', '.join(KV_TYPES)}")
        dtype = KV_TYPES[kv_type]
        self.n_ctx = n_ctx
        self.k = [torch.zeros(n_ctx, n_head_kv, head_dim_k, dtype=dtype) for _ in range(n_layer)]
        self.v = [torch.zeros(n_ctx, n_head_kv, head_dim_v, dtype=dtype) for _ in range(n_layer)]

    @property
    def n_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def store(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (n, n_head_kv, dim) at `start`; return all keys and values up to there, as float32."""
        end = start + k.shape[0]
        self.k[layer][start:end] = k
        self.v[layer][start:end] = v
        return self.k[layer][:end].float(), self.v[layer][:end].float()
