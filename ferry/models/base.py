"""What every family shares: ModelArgs read from GGUF metadata, checked weight loading, the decoder loop."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from ferry.errors import FerryError
from ferry.gguf.file import GGUFFile
from ferry.layers.attention import Attention, LatentAttention
from ferry.layers.compressed_attention import CompressedAttention
from ferry.layers.delta_net import GatedDeltaNet
from ferry.layers.ffn import SparseMoE
from ferry.layers.rope import Yarn
from ferry.weight import Weight
from ferry.quant import dequantize
from ferry.layers.cache import CacheLayout, StateLayout, cache_layout, mla_mode, state_layout

MAX_LAYERS = 4096
# where YaRN is checked against transformers
YARN_ARCHS = ("deepseek2", "deepseek32", "glm-dsa", "gpt-oss", "deepseek4")
# gpt-oss: transformers' attention factor 1 + 0.1 ln(factor) on cos / sin, its correction range not rounded
# (llama.cpp rounds it: docs/decisions.md, "gpt-oss's YaRN as transformers computes it")
YARN_DEFAULTS = {"gpt-oss": dict(log_mul=0.1, truncate=False)}
MAX_HEADS = 4096


# the layers that attend within the sliding window: every one but each PATTERN-th (gemma3: 6, llama.cpp's and HF's),
# or all but the odd ones (gpt-oss: 2, or the file's attention.sliding_window_pattern)
SWA_PATTERNS = {"gemma3": 6, "gpt-oss": 2}


def sliding_windows(f: GGUFFile, args: "ModelArgs") -> tuple[int, ...]:
    """Per layer, the window it attends within (0: the whole context); () where no layer has one."""
    pattern = SWA_PATTERNS.get(args.arch)
    if not args.sliding_window or pattern is None:
        return ()
    if args.arch == "gpt-oss":  # layer i local when i % pattern < pattern - 1
        pattern = int(f.get("gpt-oss.attention.sliding_window_pattern", pattern) or pattern)
        return tuple(args.sliding_window if i % pattern < pattern - 1 else 0 for i in range(args.n_layer))
    return tuple(args.sliding_window if (i + 1) % pattern else 0 for i in range(args.n_layer))


@dataclass
class ModelArgs:
    """Hyper-parameters from `{arch}.*` metadata keys (llama.cpp's names), validated."""

    arch: str
    n_vocab: int
    n_ctx_train: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim_k: int
    head_dim_v: int
    n_ff: int
    norm_eps: float
    rope_base: float
    rope_scale: float
    n_rot: int
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    sliding_window: int = 0
    n_expert_shared: int = 0
    n_layer_dense_lead: int = 0  # leading layers with a dense FFN instead of experts (GLM-4.5, DeepSeek)
    expert_gating: str = "softmax"  # or "sigmoid"
    expert_weights_scale: float = 1.0
    expert_weights_norm: bool = False  # the top-k weights renormalised to sum to 1 (llama.cpp's default: not)
    n_expert_groups: int = 1
    n_expert_groups_used: int = 1
    n_nextn: int = 0  # multi-token-prediction blocks after the last layer: in the file, not run
    q_lora_rank: int = 0  # DeepSeek's latent attention: 0 = a plain q projection
    kv_lora_rank: int = 0
    yarn: "Yarn | None" = None  # YaRN rope scaling (DeepSeek, gpt-oss)
    n_ff_shexp: int = 0  # the shared expert's FFN size where the file gives it apart (qwen35moe, qwen3next)
    # gated delta-net linear attention (qwen35moe, qwen3next): per layer whether it is recurrent (no KV cache), and
    # its sizes: ssm_conv_kernel taps of causal convolution, ssm_n_k_heads key heads of ssm_head_dim, ssm_n_v_heads
    # value heads of the same size (llama.cpp's ssm.group_count, ssm.time_step_rank, ssm.state_size)
    recurrent: tuple[bool, ...] = ()
    ssm_conv_kernel: int = 0
    ssm_head_dim: int = 0
    ssm_n_k_heads: int = 0
    ssm_n_v_heads: int = 0
    # DeepSeek sparse attention (deepseek32, glm-dsa): the lightning indexer's heads, their size and the positions each
    # query attends to; the layers that run an indexer (GLM-5.2's others reuse the last one's selection)
    indexer_n_head: int = 0
    indexer_head_dim: int = 0
    indexer_top_k: int = 0
    indexer_layers: tuple[int, ...] = ()
    v4: "V4Args | None" = None  # DeepSeek-V4 (deepseek4): its compressed attention, streams and hash routing
    windows: tuple[int, ...] = ()  # per layer, the sliding window it attends within (0: every position); () none

    @classmethod
    def from_gguf(cls, f: GGUFFile) -> "ModelArgs":
        arch = f.architecture

        def key(name: str, default=None, kind=int):
            k = f"{arch}.{name}"
            if default is None:
                v = f.require(k)
            else:
                v = f.get(k, default)
            if isinstance(v, np.ndarray):
                if len(set(v.tolist())) != 1:
                    raise FerryError(f"{f.path}: '{k}' differs per layer, which ferry does not support yet")
                v = v[0].item()
            if kind is int and (isinstance(v, bool) or not isinstance(v, (int, np.integer))):
                raise FerryError(f"{f.path}: metadata key '{k}' must be an integer, got {v!r}; the file is corrupt")
            if kind is float and not isinstance(v, (int, float)):
                raise FerryError(f"{f.path}: metadata key '{k}' must be a number, got {v!r}; the file is corrupt")
            return kind(v)

        n_embd = key("embedding_length")
        n_head = key("attention.head_count")
        tokens = f.get("tokenizer.ggml.tokens")
        n_vocab = key("vocab_size", len(tokens) if tokens is not None else f.tensor("token_embd.weight").ne[1])
        head_dim_k = key("attention.key_length", n_embd // max(n_head, 1))
        scaling = f.get(f"{arch}.rope.scaling.type", "none")
        yarn = scaling == "yarn" and arch in YARN_ARCHS
        if scaling not in ("none", "linear") and not yarn and f.get(f"{arch}.rope.scaling.factor", 1.0) != 1.0:
            # running without it would change every position's angles: refuse rather than lose quality silently
            raise FerryError(f"{f.path}: rope scaling '{scaling}' is not supported yet for {arch} (only linear"
                             f"{', and yarn for ' + ', '.join(YARN_ARCHS)}); use a conversion without it, or another model")
        args = cls(
            arch=arch,
            n_vocab=n_vocab,
            n_ctx_train=key("context_length"),
            n_embd=n_embd,
            n_layer=key("block_count"),
            n_head=n_head,
            n_head_kv=key("attention.head_count_kv", n_head),
            head_dim_k=head_dim_k,
            head_dim_v=key("attention.value_length", head_dim_k),
            n_ff=key("feed_forward_length", 0),
            norm_eps=key("attention.layer_norm_rms_epsilon", 1e-5, float),
            rope_base=key("rope.freq_base", 10000.0, float),
            rope_scale=key("rope.scaling.factor", 1.0, float) if scaling == "linear" else 1.0,
            n_rot=key("rope.dimension_count", head_dim_k),
            n_expert=key("expert_count", 0),
            n_expert_used=key("expert_used_count", 0),
            n_ff_exp=key("expert_feed_forward_length", 0),
            sliding_window=key("attention.sliding_window", 0),
            n_expert_shared=key("expert_shared_count", 0),
            n_layer_dense_lead=key("leading_dense_block_count", 0),
            expert_gating=GATING.get(key("expert_gating_func", _default_gating(f, arch)), "unknown"),
            expert_weights_scale=key("expert_weights_scale", 1.0, float),
            # absent means no: llama.cpp's converters write the key only where the HF config sets norm_topk_prob
            # (DeepSeek-V3, GLM), not for DeepSeek-V2 / V2-Lite
            expert_weights_norm=bool(f.get(f"{arch}.expert_weights_norm", False)),
            n_expert_groups=key("expert_group_count", 1),
            n_expert_groups_used=key("expert_group_used_count", 1),
            n_nextn=key("nextn_predict_layers", 0),
            q_lora_rank=key("attention.q_lora_rank", 0),
            kv_lora_rank=key("attention.kv_lora_rank", 0),
        )
        if yarn:
            args.yarn = Yarn(factor=key("rope.scaling.factor", 1.0, float),
                             n_ctx_orig=key("rope.scaling.original_context_length", args.n_ctx_train),
                             beta_fast=key("rope.scaling.yarn_beta_fast", 32.0, float),
                             beta_slow=key("rope.scaling.yarn_beta_slow", 1.0, float),
                             log_mul=key("rope.scaling.yarn_log_multiplier",
                                         YARN_DEFAULTS.get(arch, {}).get("log_mul", 0.0), float),
                             truncate=YARN_DEFAULTS.get(arch, {}).get("truncate", True))
        args.n_layer -= args.n_nextn  # llama.cpp's order: the prediction blocks are the last ones
        if f.get(f"{arch}.ssm.inner_size") is not None:
            args.read_recurrent(f, key)
        if arch == "deepseek4":
            args.v4 = V4Args.from_gguf(f, key, args.n_layer)
            args.indexer_n_head = key("attention.indexer.head_count")
            args.indexer_head_dim = key("attention.indexer.key_length")
            args.indexer_top_k = key("attention.indexer.top_k")
            args.indexer_layers = tuple(i for i, r in enumerate(args.v4.compress_ratios) if r == V4Args.CSA_RATIO)
        elif f.get(f"{arch}.attention.indexer.head_count") is not None:
            args.read_indexer(f, key)
        args.windows = sliding_windows(f, args)
        if f.get(f"{arch}.attention.key_length_mla") is not None:
            # an MLA conversion (DeepSeek, split attn_k_b / attn_v_b): the cache sizes above are the latent's; the
            # args keep the per-head (expanded) sizes, and Model.cache_layout gives the latent cache's
            args.head_dim_k, args.head_dim_v = key("attention.key_length_mla"), key("attention.value_length_mla")
            args.n_head_kv = args.n_head
        args.validate(f)
        return args

    def read_recurrent(self, f: GGUFFile, key) -> None:
        """The linear-attention sizes and which layers are recurrent: the file's attention.recurrent_layers, else
        every layer but each full_attention_interval-th (llama.cpp's reading)."""
        self.ssm_conv_kernel, self.ssm_head_dim = key("ssm.conv_kernel"), key("ssm.state_size")
        self.ssm_n_k_heads, self.ssm_n_v_heads = key("ssm.group_count"), key("ssm.time_step_rank")
        self.n_ff_shexp = key("expert_shared_feed_forward_length", 0)
        if key("ssm.inner_size") != self.ssm_n_v_heads * self.ssm_head_dim:
            raise FerryError(f"{f.path}: ssm.inner_size {key('ssm.inner_size')} is not time_step_rank x state_size "
                             f"({self.ssm_n_v_heads} x {self.ssm_head_dim}); the file is corrupt, re-convert it")
        flags = f.get(f"{self.arch}.attention.recurrent_layers")
        if flags is None:
            every = key("full_attention_interval", 4)
            flags = [(i + 1) % every != 0 for i in range(self.n_layer + self.n_nextn)] if every > 0 else None
        if flags is None or len(flags) < self.n_layer:
            raise FerryError(f"{f.path}: the recurrent layers are not given for all {self.n_layer} layers; the "
                             "file is corrupt, re-convert it")
        self.recurrent = tuple(bool(x) for x in list(flags)[:self.n_layer])

    def read_indexer(self, f: GGUFFile, key) -> None:
        """The lightning indexer's sizes, and its layers: those whose file has its tensors (as llama.cpp loads them),
        checked against attention.indexer.types where the file gives it (GLM-5.2's full / shared layers)."""
        self.indexer_n_head, self.indexer_head_dim = key("attention.indexer.head_count"), key("attention.indexer.key_length")
        self.indexer_top_k = key("attention.indexer.top_k")
        self.indexer_layers = tuple(i for i in range(self.n_layer) if f"blk.{i}.indexer.attn_k.weight" in f.tensors)
        types = f.get(f"{self.arch}.attention.indexer.types")
        if types is not None and [bool(t) for t in list(types)[:self.n_layer]] != [
                i in self.indexer_layers for i in range(self.n_layer)]:
            raise FerryError(f"{f.path}: attention.indexer.types does not match the layers whose indexer tensors the "
                             "file holds; the file is corrupt, re-convert it")
        if 0 not in self.indexer_layers:
            raise FerryError(f"{f.path}: layer 0 has no indexer (blk.0.indexer.*), so the layers after it have no "
                             "selection to share; the file is corrupt or truncated, re-convert it")
        if min(self.indexer_n_head, self.indexer_head_dim, self.indexer_top_k) <= 0 or self.indexer_head_dim < self.n_rot:
            raise FerryError(f"{f.path}: indexer sizes (heads {self.indexer_n_head}, size {self.indexer_head_dim}, top-k "
                             f"{self.indexer_top_k}) must be positive with room for the rope's {self.n_rot} values; "
                             "the file is corrupt, re-convert it")

    @property
    def kv_layers(self) -> list[int]:
        """The layers that keep a KV cache: all but the recurrent ones."""
        return [i for i in range(self.n_layer) if not (self.recurrent and self.recurrent[i])]

    def validate(self, f: GGUFFile) -> None:
        def bad(what: str) -> FerryError:
            return FerryError(f"{f.path}: {what}; the metadata is corrupt or the converter was wrong, re-convert the model")

        for name in ("n_vocab", "n_ctx_train", "n_embd", "n_layer", "n_head", "n_head_kv", "head_dim_k", "head_dim_v"):
            if getattr(self, name) <= 0:
                raise bad(f"{name} is {getattr(self, name)}")
        if self.n_layer > MAX_LAYERS or self.n_head > MAX_HEADS:
            raise bad(f"absurd sizes: {self.n_layer} layers, {self.n_head} heads")
        if self.n_head % self.n_head_kv:
            raise bad(f"head_count {self.n_head} is not a multiple of head_count_kv {self.n_head_kv}")
        if self.n_rot > self.head_dim_k or self.n_rot % 2:
            raise bad(f"rope dimension {self.n_rot} does not fit head size {self.head_dim_k}")
        if self.n_expert and not 0 < self.n_expert_used <= self.n_expert:
            raise bad(f"expert_used_count {self.n_expert_used} is not in 1..expert_count {self.n_expert}")
        if self.rope_scale <= 0 or self.rope_base <= 0:
            raise bad("rope base and scale must be positive")
        if self.expert_gating == "unknown":
            raise bad("expert_gating_func is not 1 (softmax), 2 (sigmoid) or 4 (sqrt of softplus, DeepSeek-V4)")
        if self.expert_gating == "sqrtsoftplus" and self.v4 is None:
            raise bad(f"expert_gating_func 4 (sqrt of softplus) is DeepSeek-V4's, not {self.arch}'s")
        if self.n_layer <= 0 or self.n_nextn < 0:
            raise bad(f"nextn_predict_layers {self.n_nextn} leaves no layer to run")
        if any(self.recurrent):
            sizes = (self.ssm_conv_kernel, self.ssm_head_dim, self.ssm_n_k_heads, self.ssm_n_v_heads)
            if min(sizes) <= 0 or self.ssm_n_v_heads % self.ssm_n_k_heads or max(sizes) > 65536:
                raise bad(f"linear attention sizes {sizes} (conv kernel, head size, key heads, value heads) are not "
                          "positive with the value heads a multiple of the key heads")


GATING = {1: "softmax", 2: "sigmoid", 4: "sqrtsoftplus"}  # llama.cpp's expert_gating_func values


@dataclass
class V4Args:
    """DeepSeek-V4's own metadata (llama.cpp's deepseek4 keys): per layer its compress ratio (0: sliding window only,
    4: compressed sparse attention with the indexer, 128: heavily compressed), the compress rope's base, the grouped
    output projection, the hyper-connection streams, and the leading hash-routed layers."""

    CSA_RATIO = 4  # the ratio whose layers run the lightning indexer (llama.cpp's and transformers' CSA)

    compress_ratios: tuple[int, ...]
    compress_rope_base: float
    n_out_groups: int
    out_lora_rank: int
    n_hc: int
    hc_iters: int
    hc_eps: float
    n_hash_layers: int
    swiglu_limit: float

    @classmethod
    def from_gguf(cls, f: GGUFFile, key, n_layer: int) -> "V4Args":
        arch = f.architecture
        ratios = f.require(f"{arch}.attention.compress_ratios", kind=int)
        ratios = [int(r) for r in np.asarray(ratios).reshape(-1).tolist()]
        if len(ratios) < n_layer or any(r not in (0, cls.CSA_RATIO) and r < 2 for r in ratios[:n_layer]):
            raise FerryError(f"{f.path}: attention.compress_ratios {ratios} does not give a ratio (0, {cls.CSA_RATIO} "
                             f"or another of at least 2) for each of the {n_layer} layers; the file is corrupt, "
                             "re-convert it")
        limits = set()
        for name in ("swiglu_clamp_exp", "swiglu_clamp_shexp"):
            v = f.get(f"{arch}.{name}")
            if v is not None:
                limits.update(float(x) for x in np.asarray(v).reshape(-1)[:n_layer].tolist())
        if len(limits) > 1:
            raise FerryError(f"{f.path}: the SwiGLU clamp differs between layers or experts ({sorted(limits)}), "
                             "which ferry does not support yet")
        return cls(compress_ratios=tuple(ratios[:n_layer]),
                   compress_rope_base=key("attention.compress_rope_freq_base", None, float),
                   n_out_groups=key("attention.output_group_count"), out_lora_rank=key("attention.output_lora_rank"),
                   n_hc=key("hyper_connection.count"), hc_iters=key("hyper_connection.sinkhorn_iterations"),
                   hc_eps=key("hyper_connection.epsilon", None, float), n_hash_layers=key("hash_layer_count", 0),
                   swiglu_limit=limits.pop() if limits else 0.0)


def _default_gating(f: GGUFFile, arch: str) -> int:
    """expert_gating_func where a file has none, as llama.cpp reads such files: glm4moe's, glm-dsa's and minimax-m2's
    routers are sigmoid; a deepseek2 file is DeepSeek-V2 / V2.5 (softmax), unless it has GLM-4.7-Flash's shape (47 or 48 blocks, a
    vocabulary of 154880), whose converter wrote deepseek2 without the key."""
    if arch in ("glm4moe", "minimax-m2", "glm-dsa"):
        return 2
    tokens = f.get("tokenizer.ggml.tokens")
    n_vocab = f.get(f"{arch}.vocab_size", len(tokens) if tokens is not None else 0)
    if arch == "deepseek2" and f.get(f"{arch}.block_count") in (47, 48) and n_vocab == 154880:
        return 2
    return 1


class WeightLoader:
    """Hands out the file's tensors as Weights or float tensors, checking each shape against the args."""

    def __init__(self, f: GGUFFile):
        self.f = f
        self.used: set[str] = set()

    def has(self, name: str) -> bool:
        return name in self.f.tensors

    def skip(self, prefix: str) -> None:
        """Tensors the file carries but ferry does not run (multi-token-prediction blocks): known, not unused."""
        self.used.update(n for n in self.f.tensors if n.startswith(prefix))

    def _checked(self, name: str, shape: tuple[int, ...]):
        t = self.f.tensor(name)
        got = tuple(reversed(t.ne))
        if got != tuple(shape):
            raise FerryError(
                f"{self.f.path}: tensor '{name}' has shape {list(got)} but the metadata implies {list(shape)}; "
                "the file is corrupt or its metadata is wrong")
        self.used.add(name)
        return t

    def weight(self, name: str, *shape: int) -> Weight:
        """A matmul weight of torch shape `shape` (rows, cols) or (n_expert, rows, cols), left in the mmap."""
        t = self._checked(name, shape)
        return Weight(name, t.qtype, t.ne, self.f.data(t))

    def vector(self, name: str, *shape: int) -> torch.Tensor:
        """A small float tensor (norm weights, biases), dequantized to float32."""
        t = self._checked(name, shape)
        return torch.from_numpy(dequantize(self.f.data(t), t.qtype, t.ne))

    def optional_vector(self, name: str, *shape: int) -> torch.Tensor | None:
        return self.vector(name, *shape) if self.has(name) else None


Block = Callable[[object, object], object]  # (ops, x) -> x, with its attention as .attn and feed-forward as .ffn


@dataclass
class Model:
    """Embedding -> blocks -> final norm -> logits; the families differ only in how they build blocks."""

    args: ModelArgs
    token_embd: Weight
    blocks: list[Block]
    output_norm: torch.Tensor
    output: Weight
    embd_scale: float = 1.0
    ggml_graph = True  # whether the CPU runs it as one ggml graph (runners/ggml_graph.py has its every op)

    def position_free(self, kv) -> bool:
        """Whether a decode step over this cache holds no work whose shapes or indices follow the position: a GPU
        records it as one CUDA graph, else that work runs between graphs (ops.cache_sized)."""
        return True

    def weights(self) -> list[Weight]:
        """Every matmul weight of the model, once each, in layer order (output last)."""
        found: dict[int, Weight] = {}

        def walk(obj) -> None:
            if isinstance(obj, Weight):
                found.setdefault(id(obj), obj)
            elif isinstance(obj, list):  # DeepSeek-V4's grouped output projection
                for o in obj:
                    walk(o)
            elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
                for f in dataclasses.fields(obj):
                    walk(getattr(obj, f.name))

        for block in self.blocks:
            walk(block)
        walk(self.output)
        return list(found.values())

    def fusable(self) -> list[tuple[Weight, ...]]:
        """Groups of weights that one input feeds and a GPU may hold as one matrix (each attention's q, k, v; each
        delta-net's q|k|v, z, beta, alpha)."""
        groups = [(b.attn.wq, b.attn.wk, b.attn.wv) for b in self.blocks
                  if isinstance(b.attn, Attention) and not b.attn.gated]
        return groups + [(b.attn.wqkv, b.attn.wz, b.attn.wbeta, b.attn.walpha) for b in self.blocks
                         if isinstance(b.attn, GatedDeltaNet)]

    def latent_layers(self) -> list:
        """The blocks' latent attentions (DeepSeek's MLA), if any."""
        return [b.attn for b in self.blocks if isinstance(b.attn, LatentAttention)]

    def ropes(self) -> set:
        """The rotary embeddings its attention layers and their indexers use (a GPU keeps a table of each's angles)."""
        attns = [b.attn for b in self.blocks if isinstance(b.attn, (Attention, LatentAttention, CompressedAttention))]
        compressed = [a for a in attns if isinstance(a, CompressedAttention)]
        return ({a.rope for a in attns} | {a.indexer.rope for a in attns if getattr(a, "indexer", None) is not None}
                | {a.unrope for a in compressed} | {a.compressor.rope for a in compressed if a.compressor}
                | {a.indexer.compressor.rope for a in compressed if a.indexer})

    def use_mla(self, mode: int | None, max_batch_mib: int = 0) -> int:
        """Set the latent attention mode (-mla, ik_llama.cpp's meaning; None: ferry's choice, 3) and -amb (MiB; 0:
        no bound) and return the mode; a model without latent attention ignores both, as ik_llama.cpp does, and
        reports 0."""
        if max_batch_mib < 0:
            raise FerryError(f"-amb {max_batch_mib}: give a size in MiB, or 0 for no bound")
        chosen = mla_mode(self.args, mode)
        for attn in self.latent_layers():
            attn.mla, attn.max_batch_mib = chosen, max_batch_mib
        return chosen

    swa_full = False  # --swa-full: the sliding-window layers keep every position, not a ring (the loader sets it)

    def cache_layout(self) -> CacheLayout:
        """What the KV cache holds per position and layer: the latent and rope key in MLA modes 1-3; the
        sliding-window layers' rings unless swa_full."""
        layers = self.latent_layers()
        return cache_layout(self.args, layers[0].mla if layers else 0, self.swa_full)

    def state_layout(self) -> StateLayout | None:
        """What the recurrent layers keep per sequence, or None where there are none."""
        return state_layout(self.args)

    def forward(self, ops):
        """Logits (n_out, n_vocab) of one u-batch, through `ops` (eager torch ops or a ggml graph builder)."""
        x = self._embed(ops)
        for block in self.blocks:
            x = block(ops, x)
        return self._logits(ops, x)

    def forward_across(self, embed_ops, block_ops: list, head_ops):
        """forward() with an op set per block (blocks on several GPUs): the embedding through `embed_ops`, block i
        through block_ops[i], the logits through `head_ops`; the activations move to each op set's device."""
        x = self._embed(embed_ops)
        for ops, block in zip(block_ops, self.blocks):
            x = block(ops, ops.take(x))
        return self._logits(head_ops, head_ops.take(x))

    def forward_layer_first(self, opss: list, joined) -> list:
        """The logits of each u-batch of one logical batch (their op sets `opss`, in order), as forward() gives
        them, computed layer by layer: a block's attention runs u-batch by u-batch (each attends to the cells the
        ones before it stored at this layer), its routed experts once over all their rows, through `joined` (an
        op set over the u-batches' rows joined). Experts kept in RAM then cross PCIe once per layer and logical
        batch instead of once per u-batch."""
        xs = [self._embed(ops) for ops in opss]
        for block in self.blocks:
            if isinstance(block.ffn, SparseMoE):
                halves = [block.attend(ops, x) for ops, x in zip(opss, xs)]
                out = block.feed_forward(joined, joined.join_rows([x for x, _ in halves]),
                                         joined.join_rows([h for _, h in halves]))
                xs = joined.split_rows(out, [x.shape[0] for x in xs])
            else:
                xs = [block(ops, x) for ops, x in zip(opss, xs)]
        return [self._logits(ops, x) for ops, x in zip(opss, xs)]

    def _embed(self, ops):
        x = ops.embed(self.token_embd)
        return x if self.embd_scale == 1.0 else ops.scale(x, self.embd_scale)

    def _logits(self, ops, x):
        x = ops.rms_norm(ops.output_rows(x), self.output_norm, self.args.norm_eps)
        return ops.linear(x, self.output)


def load_head(w: WeightLoader, a: ModelArgs) -> tuple[Weight, torch.Tensor, Weight]:
    """token_embd, output_norm and output (tied to token_embd when the file has no output.weight)."""
    embd = w.weight("token_embd.weight", a.n_vocab, a.n_embd)
    norm = w.vector("output_norm.weight", a.n_embd)
    out = w.weight("output.weight", a.n_vocab, a.n_embd) if w.has("output.weight") else embd
    return embd, norm, out
