"""What attention caches per position and layer: the layout (expanded keys and values, or DeepSeek's latent and rope
key under -mla 1/2/3) and the cache's quant types (-ctk / -ctv). runtime/kv_cache.py holds the cache itself; the
model, the memory plan and `ferry plan` size it from these."""

from __future__ import annotations

from dataclasses import dataclass

from gguf.constants import GGMLQuantizationType as Q

from ferry.errors import FerryError
from ferry.quant import bytes_per_weight

KV_TYPES = {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0}


@dataclass(frozen=True)
class Compressed:
    """A compressor of DeepSeek-V4's attention (layers/compressed_attention.py) in one layer: what it keeps. Each
    complete window of `ratio` positions pools into one entry of `dim` float32 values (position-indexed: entry w
    holds window w), and the raw rows of the last `ring` positions (their kv and score projections, `width`
    values each) wait for their window to complete: a state that holds every position at once, as a recurrent
    layer's does."""

    layer: int
    name: str  # "attn" (the attention's own compressor) or "index" (the lightning indexer's)
    ratio: int
    dim: int
    width: int  # dim, or 2 * dim where windows overlap
    ring: int  # positions kept raw: ratio, or 2 * ratio where windows overlap

    def entries(self, n_ctx: int) -> int:
        return n_ctx // self.ratio + 1

    @property
    def ring_bytes(self) -> int:
        return 2 * 4 * self.ring * self.width


RING_ALIGN = 256
RING_SLACK = 256  # positions a ring holds past its window and a u-batch's at least (CacheLayout.ring)


@dataclass(frozen=True)
class CacheLayout:
    """What one layer caches per position: n_head_kv keys of head_dim_k and values of head_dim_v; v_in_k: the
    values are the first head_dim_v of each key row (MLA's latent), not stored apart."""

    n_head_kv: int
    head_dim_k: int
    head_dim_v: int
    v_in_k: bool = False
    index_dim: int = 0  # DeepSeek sparse attention: the indexer's key per position in index_layers (index_value_bytes)
    index_layers: tuple[int, ...] = ()
    compressed: tuple[Compressed, ...] = ()  # DeepSeek-V4's compressors
    windows: tuple[int, ...] = ()  # per layer, its sliding window (0: none); () where no layer keeps a ring

    def ring(self, n_ctx_seq: int, n_ubatch: int) -> int:
        """Rows per sequence each sliding-window layer keeps (a ring: position p at row p % ring), or 0 where every
        layer keeps every position: the widest window and a u-batch (at least RING_SLACK), rounded up to RING_ALIGN,
        where that is fewer than a sequence's n_ctx_seq positions (llama.cpp's SWA cache: n_swa + n_ubatch, padded to
        256). The u-batch's share lets its tokens' windows reach back past the rows it writes; the rest is slack: a
        sequence can be cut back by ring - window positions without losing a row still in some token's window."""
        widest = max(self.windows, default=0)
        if not widest:
            return 0
        ring = -(-(widest + max(n_ubatch, RING_SLACK)) // RING_ALIGN) * RING_ALIGN
        return ring if ring < n_ctx_seq else 0

    def rows(self, layer: int, n_ctx: int, n_seq: int, ring: int) -> int:
        """Cache rows of a layer: n_ctx (every position of every sequence), or n_seq rings where it has a window."""
        return n_seq * ring if ring and self.windows[layer] else n_ctx

    def bytes_per_position(self, key_bytes: float, value_bytes: float) -> float:
        """One layer's bytes per position, at key_bytes / value_bytes per cached value (the indexer's key apart:
        index_bytes)."""
        return self.n_head_kv * (self.head_dim_k * key_bytes + (0 if self.v_in_k else self.head_dim_v * value_bytes))

    def index_bytes(self, layer: int, key_bytes: float) -> int:
        """A layer's indexer key bytes per position where the layer runs an indexer (index_value_bytes)."""
        return self.index_dim * index_value_bytes(key_bytes) if layer in self.index_layers else 0

    def bytes_per_token(self, n_layer: int, type_k: str = "f16", type_v: str = "f16") -> int:
        """Bytes per position of context over the n_layer layers that keep one (the ones with a window keep a ring of
        fixed size instead: ring)."""
        key_bytes = bytes_per_weight(kv_type("-ctk", type_k))
        n_layer -= sum(1 for w in self.windows if w)
        return round(n_layer * self.bytes_per_position(key_bytes, bytes_per_weight(kv_type("-ctv", type_v)))
                     + self.index_dim * index_value_bytes(key_bytes) * len(self.index_layers)
                     + sum(4 * c.dim / c.ratio for c in self.compressed))


def index_type(type_k: Q) -> Q:
    """The type of the indexer's cached keys: float32 under an f32 key cache, else float16 (llama.cpp keeps them in
    the key cache's type, quantized ones rotated first; ferry keeps a quantized cache's in f16)."""
    return Q.F32 if type_k == Q.F32 else Q.F16


def index_value_bytes(key_bytes: float) -> int:
    """Bytes per value of index_type's keys, from the key cache's bytes per value (the memory plan's terms)."""
    return 4 if key_bytes == 4 else 2


@dataclass(frozen=True)
class StateLayout:
    """What the recurrent layers (gated delta-net) keep per sequence instead of a KV cache: each its convolution's
    last kernel - 1 inputs of `channels` values and a head_dim x head_dim state per value head, float32."""

    layers: tuple[int, ...]
    channels: int
    kernel: int
    n_v_heads: int
    head_dim: int

    @property
    def bytes_per_sequence(self) -> int:
        return 4 * len(self.layers) * ((self.kernel - 1) * self.channels + self.n_v_heads * self.head_dim ** 2)


def state_layout(args) -> StateLayout | None:
    """A model's recurrent state layout (ModelArgs), or None where no layer is recurrent."""
    layers = tuple(i for i, r in enumerate(args.recurrent) if r)
    if not layers:
        return None
    return StateLayout(layers, (2 * args.ssm_n_k_heads + args.ssm_n_v_heads) * args.ssm_head_dim,
                       args.ssm_conv_kernel, args.ssm_n_v_heads, args.ssm_head_dim)


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


def cache_layout(args, mla: int, swa_full: bool = False) -> CacheLayout:
    """What a model's KV cache holds per position and layer (ModelArgs): in MLA modes 1-3, the latent (also the
    value) and the rope key; the sliding-window layers' rings (args.windows) unless swa_full (--swa-full: every
    position kept, llama.cpp's flag)."""
    if args.v4 is not None:  # one head, the values its keys; the compressors' entries
        return CacheLayout(1, args.head_dim_k, args.head_dim_k, v_in_k=True, compressed=compressors(args),
                           windows=() if swa_full else (args.sliding_window,) * args.n_layer)
    index = dict(index_dim=args.indexer_head_dim, index_layers=args.indexer_layers)
    if args.kv_lora_rank > 0 and mla:
        return CacheLayout(1, args.kv_lora_rank + args.n_rot, args.kv_lora_rank, v_in_k=True, **index)
    return CacheLayout(args.n_head_kv, args.head_dim_k, args.head_dim_v, **index,
                       windows=() if swa_full else args.windows)


def compressors(args) -> tuple[Compressed, ...]:
    """DeepSeek-V4's compressors, layer by layer: where the ratio is not 0, the attention's; where it is the CSA ratio
    (4), their windows overlap and the indexer has one of its own."""
    out = []
    for i, ratio in enumerate(args.v4.compress_ratios):
        if not ratio:
            continue
        overlap = ratio == args.v4.CSA_RATIO
        for name, dim in (("attn", args.head_dim_k), ("index", args.indexer_head_dim))[:1 + overlap]:
            out.append(Compressed(i, name, ratio, dim, dim * (1 + overlap), ratio * (1 + overlap)))
    return tuple(out)


def describe_cache(args, mla: int, type_k: str = "f16", type_v: str = "f16",
                   swa_full: bool = False) -> tuple[int, str]:
    """A model's KV bytes per token (the layers that keep every position) under an -mla mode and cache types, and a
    line saying so."""
    cache = cache_layout(args, mla, swa_full)
    per_token = cache.bytes_per_token(len(args.kv_layers), type_k, type_v)
    kinds = type_k if type_k == type_v or cache.v_in_k else f"{type_k}/{type_v}"
    what = ("the latent and rope key" if cache.v_in_k else "expanded keys and values") if args.kv_lora_rank > 0 else ""
    if what and mla == 3:  # where the prompt form is chosen, and by what
        from ferry.layers.attention import expand_from

        cpu_from = expand_from(args.kv_lora_rank, args.head_dim_k - args.n_rot, args.head_dim_v)
        what += ("; a prompt u-batch expands it where faster: on a GPU as timed on the first u-batches of each size "
                 f"and cache length (powers of two), on the CPU from {cpu_from} tokens (fewer multiply-adds); "
                 "generation attends in latent space")
    if cache.index_layers:
        what += (f"; with the sparse attention's indexer keys ({cache.index_dim} values per position in "
                 f"{len(cache.index_layers)} layers): each query attends to its {args.indexer_top_k} best positions")
    if cache.compressed:  # DeepSeek-V4
        rings = sum(c.ring_bytes for c in cache.compressed)
        kept = ("every position kept though each layer attends to its last {w}" if swa_full else
                "a ring per layer of the last {w} positions and a u-batch's, --swa-full keeps every position")
        return per_token, (f"KV cache: {per_token} bytes per token in {kinds} (one key head per position and layer: "
                           f"{kept.format(w=args.sliding_window)}; {len(cache.compressed)} compressors' pooled entries "
                           f"in f32; their incomplete windows keep {rings / 2**10:.0f} KiB per sequence)")
    state = state_layout(args)
    if state is not None:
        what = (f"{len(args.kv_layers)} attention layers; the {len(state.layers)} recurrent layers keep "
                f"{state.bytes_per_sequence / 2**20:.1f} MiB of state per sequence instead")
        return per_token, f"KV cache: {per_token} bytes per token in {kinds} ({what})"
    if any(cache.windows):
        local = sum(1 for w in cache.windows if w)
        return per_token, (f"KV cache: {per_token} bytes per token in {kinds} (the {len(cache.windows) - local} "
                           f"full-attention layers; the {local} sliding-window layers keep a ring of their last "
                           f"{max(cache.windows)} positions and a u-batch's instead; --swa-full keeps every position)")
    return per_token, f"KV cache: {per_token} bytes per token in {kinds}" + (f" (-mla {mla}: {what})" if what else "")


def kv_type(flag: str, name: str) -> Q:
    if name not in KV_TYPES:
        raise FerryError(f"{flag}: unknown KV cache type '{name}'; valid types: {', '.join(KV_TYPES)}")
    return KV_TYPES[name]
