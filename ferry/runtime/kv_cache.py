"""KV cache for one sequence: per layer, the keys and values of every position as rows of a ggml type
(`-ctk` / `-ctv`: f16 by default, as in llama.cpp; q8_0 halves it again). In DeepSeek's latent attention
(-mla 1/2/3) a position's key is its latent and rope key, and its value the latent: the first values of the key
row, so no value rows are stored."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as Q

from ferry.errors import FerryError
from ferry.quant import bytes_per_weight, row_bytes

KV_TYPES = {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0}
TORCH_TYPES = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}  # types torch reads directly


@dataclass(frozen=True)
class CacheLayout:
    """What one layer caches per position: n_head_kv keys of head_dim_k and values of head_dim_v; v_in_k: the
    values are the first head_dim_v of each key row (MLA's latent), not stored apart."""

    n_head_kv: int
    head_dim_k: int
    head_dim_v: int
    v_in_k: bool = False

    def bytes_per_position(self, key_bytes: float, value_bytes: float) -> float:
        """One layer's bytes per position, at key_bytes / value_bytes per cached value."""
        return self.n_head_kv * (self.head_dim_k * key_bytes + (0 if self.v_in_k else self.head_dim_v * value_bytes))

    def bytes_per_token(self, n_layer: int, type_k: str = "f16", type_v: str = "f16") -> int:
        return round(n_layer * self.bytes_per_position(bytes_per_weight(kv_type("-ctk", type_k)),
                                                        bytes_per_weight(kv_type("-ctv", type_v))))


MLA_MODES = (0, 1, 2, 3)


def mla_mode(args, flag: int | None) -> int:
    """The latent attention mode a model runs in: -mla as given (ik_llama.cpp's meaning), 3 when it is absent, 0 for
    a model without latent attention (which ignores the flag, as ik_llama.cpp does)."""
    if flag is not None and flag not in MLA_MODES:
        raise FerryError(f"-mla {flag}: valid modes are 0 (expanded cache), 1 and 2 (latent cache, absorbed "
                         "attention), 3 (latent cache; expanded for prompts, absorbed for generation)")
    if args.kv_lora_rank <= 0:
        return 0
    return 3 if flag is None else flag


def cache_layout(args, mla: int) -> CacheLayout:
    """What a model's KV cache holds per position and layer (ModelArgs): in MLA modes 1-3, the latent (also the
    value) and the rope key."""
    if args.kv_lora_rank > 0 and mla:
        return CacheLayout(1, args.kv_lora_rank + args.n_rot, args.kv_lora_rank, v_in_k=True)
    return CacheLayout(args.n_head_kv, args.head_dim_k, args.head_dim_v)


def describe_cache(args, mla: int, type_k: str = "f16", type_v: str = "f16") -> tuple[int, str]:
    """A model's KV bytes per token (every layer) under an -mla mode and cache types, and a line saying so."""
    cache = cache_layout(args, mla)
    per_token = cache.bytes_per_token(args.n_layer, type_k, type_v)
    kinds = type_k if type_k == type_v or cache.v_in_k else f"{type_k}/{type_v}"
    what = ("the latent and rope key" if cache.v_in_k else "expanded keys and values") if args.kv_lora_rank > 0 else ""
    if what and mla == 3:  # where the prompt form is chosen, and by what
        from ferry.layers.attention import expand_from

        cpu_from = expand_from(args.kv_lora_rank, args.head_dim_k - args.n_rot, args.head_dim_v)
        what += ("; a prompt u-batch expands it where faster: on a GPU as timed on the first u-batches of each size "
                 f"and cache length (powers of two), on the CPU from {cpu_from} tokens (fewer multiply-adds); "
                 "generation attends in latent space")
    return per_token, f"KV cache: {per_token} bytes per token in {kinds}" + (f" (-mla {mla}: {what})" if what else "")


def kv_type(flag: str, name: str) -> Q:
    if name not in KV_TYPES:
        raise FerryError(f"{flag}: unknown KV cache type '{name}'; valid types: {', '.join(KV_TYPES)}")
    return KV_TYPES[name]


class KVCache:
    """Layer i's keys are `k[i]`: (n_ctx, row_bytes) uint8, one row per position holding every KV head."""

    def __init__(self, n_layer: int, n_ctx: int, n_head_kv: int, head_dim_k: int, head_dim_v: int,
                 type_k: str = "f16", type_v: str = "f16", device: str | list[str] | None = None,
                 v_in_k: bool = False):
        """device: None (host memory), a GPU, or each layer's GPU (layers split across GPUs)."""
        self.type_k, self.type_v = kv_type("-ctk/--cache-type-k", type_k), kv_type("-ctv/--cache-type-v", type_v)
        self.v_in_k = v_in_k
        if v_in_k and self.type_v != self.type_k:  # the values are read from the key rows, in the keys' type
            raise FerryError(f"-ctv {type_v} differs from -ctk {type_k}, but the latent cache (-mla 1/2/3) keeps the "
                             "values inside the keys: give -ctk and -ctv the same type, or use -mla 0")
        for flag, qtype, dim in (("-ctk", self.type_k, head_dim_k), ("-ctv", self.type_v, head_dim_v)):
            block = GGML_QUANT_SIZES[qtype][0]
            if dim % block:
                raise FerryError(f"{flag} {qtype.name.lower()} needs a head size that is a multiple of {block}, "
                                 f"this model's is {dim}; use -ctk/-ctv f16")
        self.n_ctx, self.n_head_kv, self.head_dim_k, self.head_dim_v = n_ctx, n_head_kv, head_dim_k, head_dim_v
        kb, vb = row_bytes(self.type_k, n_head_kv * head_dim_k), row_bytes(self.type_v, n_head_kv * head_dim_v)
        self.device = device
        if device is None:  # host memory: ggml's graphs read it by address
            self.k = [np.zeros((n_ctx, kb), dtype=np.uint8) for _ in range(n_layer)]
            self.v = [] if v_in_k else [np.zeros((n_ctx, vb), dtype=np.uint8) for _ in range(n_layer)]
        else:  # a GPU: float types or q8_0, read by the GPU attention kernels
            for flag, qtype in (("-ctk", self.type_k), ("-ctv", self.type_v)):
                if qtype not in TORCH_TYPES and qtype != Q.Q8_0:
                    raise FerryError(f"{flag} {qtype.name.lower()}: the GPU keeps f16, bf16, f32 or q8_0 caches; "
                                     "use -ctk/-ctv q8_0 or f16")
            per_layer = device if isinstance(device, list) else [device] * n_layer
            self.device = per_layer[0]
            self.k = [torch.zeros(n_ctx, kb, dtype=torch.uint8, device=d) for d in per_layer]
            self.v = [] if v_in_k else [torch.zeros(n_ctx, vb, dtype=torch.uint8, device=d) for d in per_layer]

    @property
    def n_bytes(self) -> int:
        return sum(a.nbytes if isinstance(a, np.ndarray) else a.numel() for a in self.k + self.v)

    def _float_view(self, rows: np.ndarray, qtype: Q, dim: int) -> torch.Tensor:
        if qtype not in TORCH_TYPES:
            raise FerryError(f"a {qtype.name.lower()} KV cache is only read by the CPU graph path so far; "
                             "use -ctk/-ctv f16 here")
        rows = torch.from_numpy(rows) if isinstance(rows, np.ndarray) else rows
        return rows.view(TORCH_TYPES[qtype]).view(self.n_ctx, self.n_head_kv, dim)

    @classmethod
    def of(cls, layout: CacheLayout, n_layer: int, n_ctx: int, type_k: str = "f16", type_v: str = "f16",
           device: str | list[str] | None = None) -> "KVCache":
        return cls(n_layer, n_ctx, layout.n_head_kv, layout.head_dim_k, layout.head_dim_v, type_k, type_v, device,
                   layout.v_in_k)

    def store(self, layer: int, start: int, k: torch.Tensor,
              v: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (n, n_head_kv, dim) at `start` (v None: a cache whose values are in the keys); return all
        keys and values up to there, as float32."""
        end = start + k.shape[0]
        keys = self._float_view(self.k[layer], self.type_k, self.head_dim_k)
        keys[start:end] = k
        if self.v_in_k:
            return keys[:end].float(), keys[:end, :, :self.head_dim_v].float()
        values = self._float_view(self.v[layer], self.type_v, self.head_dim_v)
        values[start:end] = v
        return keys[:end].float(), values[:end].float()
