"""KV cache for one sequence: per layer, the keys and values of every position as rows of a ggml type
(`-ctk` / `-ctv`: f16 by default, as in llama.cpp; q8_0 halves it again). In DeepSeek's latent attention
(-mla 1/2/3) a position's key is its latent and rope key, and its value the latent: the first values of the key
row, so no value rows are stored. DeepSeek sparse attention's layers also keep their indexer's key per position
(`index`, in layers/cache.py's index_type). DeepSeek-V4's compressors keep their pooled entries per window and the
raw rows of their incomplete windows (`compressed`, layers/cache.py's Compressed). A sliding-window layer keeps only
a ring per sequence (`ring` rows: position p of sequence s at row s * ring + p % ring; CacheLayout.ring), unless
--swa-full."""

from __future__ import annotations


import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as Q

from ferry.errors import FerryError
from ferry.layers.cache import CacheLayout, Compressed, StateLayout, index_type, kv_type
from ferry.quant import row_bytes

TORCH_TYPES = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}  # types torch reads directly


class KVCache:
    """Layer i's keys are `k[i]`: (n_ctx, row_bytes) uint8, one row per position holding every KV head; a ring layer's
    (n_seq * ring, row_bytes)."""

    def __init__(self, n_layer: int, n_ctx: int, n_head_kv: int, head_dim_k: int, head_dim_v: int,
                 type_k: str = "f16", type_v: str = "f16", device: str | list[str] | None = None,
                 v_in_k: bool = False, state: StateLayout | None = None, n_seq: int = 1, index_dim: int = 0,
                 index_layers: tuple[int, ...] = (), compressed: tuple[Compressed, ...] = (),
                 windows: tuple[int, ...] = (), ring: int = 0):
        """device: None (host memory), a GPU, or each layer's GPU (layers split across GPUs). state: the recurrent
        layers, which keep no KV rows but a state for each of n_seq sequences (`conv`, `delta`). index_layers: those
        that also keep an indexer key of index_dim values per position (`index[i]`: (n_ctx, bytes) uint8 rows of
        type_index: f32 under an f32 key cache, else f16; no rows elsewhere). windows, ring: each layer's sliding
        window, and the rows per sequence of the layers that have one (0: every layer keeps every position)."""
        self.type_k, self.type_v = kv_type("-ctk/--cache-type-k", type_k), kv_type("-ctv/--cache-type-v", type_v)
        self.v_in_k = v_in_k
        if compressed and self.type_k not in TORCH_TYPES:  # refused here, not at the first step
            raise FerryError(f"-ctk {type_k}: DeepSeek-V4's compressed attention reads float cache rows; use -ctk/-ctv "
                             "f16 (or bf16, f32)")
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
        recurrent = set(state.layers) if state else set()
        self.n_seq, self.ring = n_seq, ring if any(windows) else 0
        self.windows = tuple(windows) if self.ring else ()
        self.ring_layers = frozenset(i for i, w in enumerate(self.windows) if w)
        rows = [0 if i in recurrent else n_seq * self.ring if i in self.ring_layers else n_ctx for i in range(n_layer)]
        self.state = state
        self.index_dim = index_dim
        self.type_index = index_type(self.type_k)
        ib = row_bytes(self.type_index, index_dim)
        index_rows = [n_ctx if i in index_layers else 0 for i in range(n_layer)]
        if device is None:  # host memory: ggml's graphs read it by address
            self.k = [np.zeros((r, kb), dtype=np.uint8) for r in rows]
            self.v = [] if v_in_k else [np.zeros((r, vb), dtype=np.uint8) for r in rows]
            self.index = [np.zeros((r, ib), dtype=np.uint8) for r in index_rows]
            self._states(state, n_layer, n_seq, lambda shape, i: np.zeros(shape, dtype=np.float32))
            self._compressed(compressed, n_seq, lambda shape, i: torch.zeros(shape))
        else:  # a GPU: float types or q8_0, read by the GPU attention kernels
            for flag, qtype in (("-ctk", self.type_k), ("-ctv", self.type_v)):
                if qtype not in TORCH_TYPES and qtype != Q.Q8_0:
                    raise FerryError(f"{flag} {qtype.name.lower()}: the GPU keeps f16, bf16, f32 or q8_0 caches; "
                                     "use -ctk/-ctv q8_0 or f16")
            per_layer = device if isinstance(device, list) else [device] * n_layer
            self.device = per_layer[0]
            self.k = [torch.zeros(r, kb, dtype=torch.uint8, device=d) for r, d in zip(rows, per_layer)]
            self.v = [] if v_in_k else [torch.zeros(r, vb, dtype=torch.uint8, device=d) for r, d in zip(rows, per_layer)]
            self.index = [torch.zeros(r, ib, dtype=torch.uint8, device=d)
                          for r, d in zip(index_rows, per_layer)]
            self._states(state, n_layer, n_seq, lambda shape, i: torch.zeros(shape, device=per_layer[i]))
            self._compressed(compressed, n_seq, lambda shape, i: torch.zeros(shape, device=per_layer[i]))

    def _compressed(self, compressed: tuple[Compressed, ...], n_seq: int, zeros) -> None:
        """Per compressor (layer, name): `entries` (n_seq, entries, dim), each sequence's windows pooled (a sequence
        holds n_ctx / n_seq positions); `rings` (kv, score), each (n_seq, ring, width): the raw rows of the last ring
        positions, position p at row p % ring."""
        self.compressed = {(c.layer, c.name): c for c in compressed}
        self.entries = {k: zeros((n_seq, c.entries(self.n_ctx // n_seq), c.dim), c.layer)
                        for k, c in self.compressed.items()}
        self.rings = {k: (zeros((n_seq, c.ring, c.width), c.layer), zeros((n_seq, c.ring, c.width), c.layer))
                      for k, c in self.compressed.items()}

    @property
    def recurrent(self) -> bool:
        """Whether some layer keeps a state that holds every position at once (a delta-net's, a compressor's raw
        rows): the sequence can then be cut back only to its start, or to a state saved there."""
        return self.state is not None or bool(self.compressed)

    def _state_arrays(self) -> list:
        return [t for t in self.conv + self.delta if t is not None] + [t for pair in self.rings.values() for t in pair]

    def _states(self, state: StateLayout | None, n_layer: int, n_seq: int, zeros) -> None:
        """Per layer (None where it is not recurrent), in ggml's layouts: `conv` (n_seq, channels, kernel - 1), the
        convolution's last inputs; `delta` (n_seq, heads, d_v, d_k), each value head's state transposed."""
        self.conv: list = [None] * n_layer
        self.delta: list = [None] * n_layer
        for i in state.layers if state else ():
            self.conv[i] = zeros((n_seq, state.channels, state.kernel - 1), i)
            self.delta[i] = zeros((n_seq, state.n_v_heads, state.head_dim, state.head_dim), i)

    def copy_state(self) -> list:
        """A copy of every sequence's recurrent state, and of the rings (their rows are written over: a state saved
        at a position serves there only with them; put_state puts both back)."""
        return [t.copy() if isinstance(t, np.ndarray) else t.clone() for t in self._state_arrays() + self._rings()]

    def put_state(self, saved: list) -> None:
        for t, copy in zip(self._state_arrays() + self._rings(), saved, strict=True):
            t[...] = copy

    def _rings(self) -> list:
        """The ring layers' row arrays (keys, values, indexer keys)."""
        return [a for i, a in self._layer_rows() if i in self.ring_layers]

    def clear_state(self, seq: int = 0) -> None:
        """Sequence seq's recurrent state back to zero: it starts again at position 0."""
        for t in self._state_arrays():
            t[seq] = 0

    @property
    def n_bytes(self) -> int:
        states = [t.nbytes if isinstance(t, np.ndarray) else 4 * t.numel()
                  for t in self._state_arrays() + list(self.entries.values())]
        return sum(a.nbytes if isinstance(a, np.ndarray) else a.numel() for a in self._rows()) + sum(states)

    def _rows(self) -> list:
        """Every layer's per-position arrays: keys, values, indexer keys."""
        return self.k + self.v + self.index

    def _float_view(self, rows: np.ndarray, qtype: Q, dim: int) -> torch.Tensor:
        if qtype not in TORCH_TYPES:
            raise FerryError(f"a {qtype.name.lower()} KV cache is only read by the CPU graph path so far; "
                             "use -ctk/-ctv f16 here")
        rows = torch.from_numpy(rows) if isinstance(rows, np.ndarray) else rows
        return rows.view(TORCH_TYPES[qtype]).view(rows.shape[0], self.n_head_kv, dim)

    @classmethod
    def of(cls, layout: CacheLayout, n_layer: int, n_ctx: int, type_k: str = "f16", type_v: str = "f16",
           device: str | list[str] | None = None, state: StateLayout | None = None, n_seq: int = 1,
           n_ubatch: int = 512) -> "KVCache":
        return cls(n_layer, n_ctx, layout.n_head_kv, layout.head_dim_k, layout.head_dim_v, type_k, type_v, device,
                   layout.v_in_k, state, n_seq, layout.index_dim, layout.index_layers, layout.compressed,
                   layout.windows, layout.ring(n_ctx // n_seq, n_ubatch))

    def resumable(self, n_past: int, held: int) -> bool:
        """Whether a sequence that holds `held` positions can go on from n_past <= held (the rest forgotten): always,
        except in a ring, whose rows of positions n_past - window .. n_past - 1 may have been written over; they are
        not while held - n_past is at most ring - window (a ring's slack: CacheLayout.ring)."""
        return not self.ring or held - n_past <= self.ring - max(self.windows)

    def _seq_rows(self, seq: int, n: int) -> list:
        """Per array of _rows(), the rows of sequence seq's first n positions: [seq * seq_len + 0, + n), and a ring
        layer's whole ring (its rows hold the last positions: resumable says when they serve)."""
        seq_len, out = self.n_ctx // self.n_seq, []
        for i, a in self._layer_rows():
            if i in self.ring_layers:
                out.append(a[seq * self.ring:(seq + 1) * self.ring])
            else:
                out.append(a[seq * seq_len:seq * seq_len + n])
        return out

    def copy_rows(self, seq: int, n: int) -> list:
        """Sequence seq's first n positions in every layer (keys, values, indexer keys), copied to host memory: what
        put_rows writes back (the server's RAM prompt cache)."""
        return [a.copy() if isinstance(a, np.ndarray) else a.to("cpu", copy=True)
                for a in self._seq_rows(seq, n)]

    def put_rows(self, seq: int, rows: list, n: int) -> None:
        """The first n positions of copy_rows' rows into sequence seq's (a ring's rows as they were: they serve n
        where resumable(n, the positions copied))."""
        for a, r in zip(self._seq_rows(seq, n), rows):
            if isinstance(a, np.ndarray):
                a[...] = r[:len(a)]
            else:
                a.copy_(r[:len(a)])

    def _layer_rows(self) -> list[tuple[int, object]]:
        """_rows() with each array's layer."""
        n = len(self.k)
        return [(i % n, a) for i, a in enumerate(self._rows())]

    def store(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor | None,
              first: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (n, n_head_kv, dim) at `start` (v None: a cache whose values are in the keys); return the
        keys and values of positions first..start + n - 1, as float32."""
        end = start + k.shape[0]
        keys = self._float_view(self.k[layer], self.type_k, self.head_dim_k)
        keys[start:end] = k
        if self.v_in_k:
            return keys[first:end].float(), keys[first:end, :, :self.head_dim_v].float()
        values = self._float_view(self.v[layer], self.type_v, self.head_dim_v)
        values[start:end] = v
        return keys[first:end].float(), values[first:end].float()

    def store_ring(self, layer: int, cells: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None,
                   rows: int | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write a ring layer's k, v (n, n_head_kv, dim; v None: values in the keys) into rows `cells`
        (Batch.ring_cells); return the keys and values of its first `rows` rows (Batch.ring_kv, in row order:
        Batch.ring_mask says which each token sees), or of the rows a tensor gives, as float32."""
        keys = self._float_view(self.k[layer], self.type_k, self.head_dim_k)
        keys[cells] = k.to(keys.dtype)
        if self.v_in_k:
            values = keys[..., :self.head_dim_v]
        else:
            values = self._float_view(self.v[layer], self.type_v, self.head_dim_v)
            values[cells] = v.to(values.dtype)
        if isinstance(rows, int):
            return keys[:rows].float(), values[:rows].float()
        return keys[rows].float(), values[rows].float()

    def store_index(self, layer: int, start: int, k: torch.Tensor) -> torch.Tensor:
        """Write a layer's indexer keys k (n, index_dim) at `start`; return every one up to there, as float32."""
        end = start + k.shape[0]
        rows = self.index[layer]
        keys = (torch.from_numpy(rows) if isinstance(rows, np.ndarray) else rows).view(TORCH_TYPES[self.type_index])
        keys[start:end] = k.reshape(k.shape[0], -1)
        return keys[:end].float()
