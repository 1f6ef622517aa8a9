"""`ferry synth`: random-weight GGUF files of real architectures, fast, loadable by llama.cpp too.

Quant blocks are random bytes with their scale fields overwritten (about memory speed), so an 18 GB
model takes seconds of arithmetic rather than a quantizer's minutes. Scales keep activations O(1);
the output projections (attn_output, ffn_down) are scaled by 0.1 because at the usual 1/sqrt(fan_in)
routing collapses onto few experts in deep layers (DESIGN.md), which would flatter any
"copy only the used experts" scheme.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import quants as gguf_quants
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType

from ferry.gguf.writer import TensorSpec, write_gguf
from ferry.quant import FLOAT_TYPES, IK_TYPES, IkQuant, Q, ik_type_bytes, quantize

OUTPUT_PROJECTION_SCALE = 0.1

# llama.cpp's K-quant mixes for the routed experts (`--expert-type q4_k_m`): gate and up of the first type, down of the
# second in the layers llama-quantize gives more bits, and the file type it writes
MIXES = {"Q4_K_M": (Q.Q4_K, Q.Q6_K, LlamaFileType.MOSTLY_Q4_K_M),
         "Q5_K_M": (Q.Q5_K, Q.Q6_K, LlamaFileType.MOSTLY_Q5_K_M)}


def more_bits(i: int, n_layer: int) -> bool:
    """llama-quantize's rule for the layers whose ffn_down a _M mix quantizes finer: the first and last eighth, and
    every third layer between (24 of Qwen3-30B-A3B's 48)."""
    return i < n_layer // 8 or i >= 7 * n_layer // 8 or (i - n_layer // 8) % 3 == 2


def expert_types(expert_type: GGMLQuantizationType | str, i: int, n_layer: int) -> tuple:
    """(gate and up's type, down's type) of layer i's routed experts: one type, or a mix of MIXES by its name."""
    if expert_type in MIXES:
        first, finer, _ = MIXES[expert_type]
        return first, finer if more_bits(i, n_layer) else first
    return expert_type, expert_type
_FILE_TYPES = {t: LlamaFileType[f"MOSTLY_{t.name}"] for t in Q if f"MOSTLY_{t.name}" in LlamaFileType.__members__}
_FILE_TYPES[Q.F32] = LlamaFileType.ALL_F32
_FILE_TYPES[Q.MXFP4] = LlamaFileType.MOSTLY_MXFP4_MOE  # gpt-oss's: MXFP4 experts, the rest other

# byte offsets of the f16 scale `d` and of the f16 min/offset `dmin` (None: the type has none)
_SCALE_FIELDS: dict[GGMLQuantizationType, tuple[int, int | None]] = {
    Q.Q4_0: (0, None), Q.Q4_1: (0, 2), Q.Q5_0: (0, None), Q.Q5_1: (0, 2), Q.Q8_0: (0, None),
    Q.Q2_K: (80, 82), Q.Q3_K: (108, None), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208, None),
    # the i-quants below need an importance matrix to quantize, so random blocks are the only cheap source
    Q.IQ2_XXS: (0, None), Q.IQ2_XS: (0, None), Q.IQ2_S: (0, None), Q.IQ3_XXS: (0, None), Q.IQ3_S: (0, None),
    Q.IQ1_S: (0, None), Q.TQ1_0: (52, None),
}


MXFP4_UNIT_STD = float(np.sqrt(np.mean(np.array([0, 1, 2, 3, 4, 6, 8, 12], np.float64) ** 2)))


@dataclass(frozen=True)
class Preset:
    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_ff: int
    n_vocab: int
    n_ctx: int = 40960
    rope_base: float = 1_000_000.0
    norm_eps: float = 1e-6
    # deepseek2 (multi-head latent attention): head_dim is the no-rope part of a key
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    head_dim_rope: int = 0
    head_dim_v: int = 0
    n_expert_shared: int = 0
    n_layer_dense_lead: int = 0
    gating: int = 1  # llama.cpp's expert_gating_func: 1 softmax, 2 sigmoid (with a correction bias)
    expert_weights_scale: float = 1.0
    expert_weights_norm: bool = False
    n_rot: int = 0  # glm4moe, minimax-m2: rope on the first n_rot values of each head (0: all)
    sliding_window: int = 0  # gpt-oss: the even layers' window
    # qwen35moe / qwen3next: gated delta-net layers (all but every full_attention_interval-th) with ssm_k_heads key
    # heads serving ssm_v_heads value heads of ssm_head_dim, a convolution of ssm_kernel taps; a gated shared expert
    # of n_ff_shexp
    ssm_k_heads: int = 0
    ssm_v_heads: int = 0
    ssm_head_dim: int = 0
    ssm_kernel: int = 4
    full_attention_interval: int = 4
    n_ff_shexp: int = 0
    # deepseek32 / glm-dsa: DeepSeek sparse attention's indexer (heads of indexer_dim, each query's indexer_top_k
    # positions), in every layer or (indexer_every > 1, GLM-5.2's pattern) every indexer_every-th, the others sharing
    indexer_heads: int = 0
    indexer_dim: int = 0
    indexer_top_k: int = 0
    indexer_every: int = 1
    # deepseek4: each layer's compress ratio (0 sliding only, 4 with the indexer, else heavily compressed), the grouped
    # output projection, the residual streams and the leading hash-routed layers
    compress_ratios: tuple[int, ...] = ()
    out_groups: int = 0
    out_lora_rank: int = 0
    n_hc: int = 4
    n_hash_layers: int = 0


def v4_ratios(n_layer: int) -> tuple[int, ...]:
    """DeepSeek-V4-Flash's pattern: two sliding-only layers, then compressed sparse (4) and heavily compressed (128)
    in turn."""
    return (0, 0) + tuple(4 if i % 2 == 0 else 128 for i in range(2, n_layer))


PRESETS = {
    # Qwen3-30B-A3B's shapes: 18 GB with Q4_0 experts and Q8_0 for the rest
    "qwen3-30b-a3b": Preset("qwen3moe", 48, 2048, 32, 4, 128, 128, 8, 768, 6144, 151936),
    # about 1.4 GB: larger than any CPU cache, small enough for a laptop
    "qwen3-moe-mid": Preset("qwen3moe", 24, 1024, 16, 4, 64, 64, 8, 512, 3072, 32000),
    # a few MB: for tests
    "qwen3-moe-tiny": Preset("qwen3moe", 4, 256, 4, 2, 64, 16, 4, 256, 768, 2048, n_ctx=4096),
    # DeepSeek-V2-Lite's shapes (15.7B, about 9 GB with Q4_0 experts): no low-rank query, first layer dense;
    # its YaRN rope scaling (factor 40 over 4096 positions) is left out of the file
    "deepseek-v2-lite": Preset("deepseek2", 27, 2048, 16, 16, 128, 64, 6, 1408, 10944, 102400, n_ctx=163840,
                               rope_base=10000.0, kv_lora_rank=512, head_dim_rope=64, head_dim_v=128,
                               n_expert_shared=2, n_layer_dense_lead=1),
    # DeepSeek-V3 / R1's layer shapes in 6 layers (3 dense, 3 MoE; about 30 GB with Q4_0 experts): low-rank query,
    # sigmoid routing with a correction bias, weights renormalised and scaled by 2.5; group-limited routing off
    "deepseek-v3-6l": Preset("deepseek2", 6, 7168, 128, 128, 128, 256, 8, 2048, 18432, 129280, n_ctx=163840,
                             rope_base=10000.0, q_lora_rank=1536, kv_lora_rank=512, head_dim_rope=64, head_dim_v=128,
                             n_expert_shared=1, n_layer_dense_lead=3, gating=2, expert_weights_scale=2.5,
                             expert_weights_norm=True),
    # GLM-4.5-Air's shapes (106B, 46 layers: about 60 GB with Q4_0 experts; --layers cuts it): q/k/v biases, no q/k
    # norms, rope on half of each head, first layer dense, sigmoid routing with a correction bias, one shared expert
    "glm-4.5-air": Preset("glm4moe", 46, 4096, 96, 8, 128, 128, 8, 1408, 10944, 151552, n_ctx=131072,
                          n_expert_shared=1, n_layer_dense_lead=1, gating=2, expert_weights_scale=1.0,
                          expert_weights_norm=True, n_rot=64),
    # a few MB of the same kinds, for tests
    "glm4moe-tiny": Preset("glm4moe", 4, 256, 4, 2, 64, 16, 4, 128, 512, 2048, n_ctx=4096, n_expert_shared=1,
                           n_layer_dense_lead=1, gating=2, expert_weights_scale=2.5, expert_weights_norm=True,
                           n_rot=32),
    # gpt-oss-20b's and gpt-oss-120b's shapes (about 12 and 61 GB with MXFP4 experts, the rest Q8_0): biases, sinks,
    # a window of 128 on even layers, YaRN 32 over 4096
    "gpt-oss-20b": Preset("gpt-oss", 24, 2880, 64, 8, 64, 32, 4, 2880, 2880, 201088, n_ctx=131072, rope_base=150000.0,
                          norm_eps=1e-5, sliding_window=128),
    "gpt-oss-120b": Preset("gpt-oss", 36, 2880, 64, 8, 64, 128, 4, 2880, 2880, 201088, n_ctx=131072,
                           rope_base=150000.0, norm_eps=1e-5, sliding_window=128),
    # MiniMax-M2's shapes (230B-A10B, 62 layers: about 130 GB with Q4_0 experts; --layers cuts it): q and k normed
    # across all heads, rope on half of each head, 256 experts of 1536 chosen 8 by sigmoid score + correction bias
    "minimax-m2": Preset("minimax-m2", 62, 3072, 48, 8, 128, 256, 8, 1536, 1536, 200064, n_ctx=196608,
                         rope_base=5_000_000.0, gating=2, expert_weights_norm=True, n_rot=64),
    "minimax-m2-tiny": Preset("minimax-m2", 4, 256, 4, 2, 64, 16, 4, 128, 128, 2048, n_ctx=4096, gating=2,
                              expert_weights_norm=True, n_rot=32),
    "gpt-oss-tiny": Preset("gpt-oss", 4, 256, 4, 2, 64, 8, 2, 256, 256, 2048, n_ctx=4096, rope_base=150000.0,
                           norm_eps=1e-5, sliding_window=8),
    # Qwen3.5-397B-A17B's and Qwen3.5-35B-A3B's shapes (about 220 and 20 GB with Q4_0 experts; --layers cuts them),
    # and Qwen3-Next-80B-A3B's: three delta-net layers then one gated attention layer (2 KV heads of 256, rope on a
    # quarter of each head), 512 or 256 experts and a gated shared expert
    "qwen3.5-397b-a17b": Preset("qwen35moe", 60, 4096, 32, 2, 256, 512, 10, 1024, 1024, 248320, n_ctx=262144,
                                rope_base=10_000_000.0, n_rot=64, ssm_k_heads=16, ssm_v_heads=64, ssm_head_dim=128,
                                n_ff_shexp=1024),
    "qwen3.5-35b-a3b": Preset("qwen35moe", 40, 2048, 16, 2, 256, 256, 8, 512, 512, 248320, n_ctx=262144,
                              rope_base=10_000_000.0, n_rot=64, ssm_k_heads=16, ssm_v_heads=32, ssm_head_dim=128,
                              n_ff_shexp=512),
    "qwen3-next-80b-a3b": Preset("qwen3next", 48, 2048, 16, 2, 256, 512, 10, 512, 512, 151936, n_ctx=262144,
                                 rope_base=10_000_000.0, n_rot=64, ssm_k_heads=16, ssm_v_heads=32, ssm_head_dim=128,
                                 n_ff_shexp=512),
    "qwen35moe-tiny": Preset("qwen35moe", 8, 256, 4, 2, 64, 16, 4, 128, 128, 2048, n_ctx=4096, n_rot=16,
                             ssm_k_heads=2, ssm_v_heads=4, ssm_head_dim=32, n_ff_shexp=192),
    "qwen3next-tiny": Preset("qwen3next", 8, 256, 4, 2, 64, 16, 4, 128, 128, 2048, n_ctx=4096, n_rot=16,
                             ssm_k_heads=2, ssm_v_heads=4, ssm_head_dim=32, n_ff_shexp=192),
    # DeepSeek-V3.2's shapes (671B-A37B, 61 layers: about 360 GB with Q4_0 experts; --layers cuts it): DeepSeek-V3's
    # layers with the lightning indexer (64 heads of 128, each query's top 2048 positions)
    "deepseek-v3.2": Preset("deepseek32", 61, 7168, 128, 128, 128, 256, 8, 2048, 18432, 129280, n_ctx=163840,
                            rope_base=10000.0, q_lora_rank=1536, kv_lora_rank=512, head_dim_rope=64, head_dim_v=128,
                            n_expert_shared=1, n_layer_dense_lead=3, gating=2, expert_weights_scale=2.5,
                            expert_weights_norm=True, indexer_heads=64, indexer_dim=128, indexer_top_k=2048),
    # GLM-5's shapes (744B-A40B, 78 layers: about 420 GB with Q4_0 experts; --layers cuts it): heads of 192 + 64, values
    # of 256, an indexer of 32 heads in every layer
    "glm-5": Preset("glm-dsa", 78, 6144, 64, 64, 192, 256, 8, 2048, 12288, 154880, n_ctx=202752, rope_base=10000.0,
                    q_lora_rank=2048, kv_lora_rank=512, head_dim_rope=64, head_dim_v=256, n_expert_shared=1,
                    n_layer_dense_lead=3, gating=2, expert_weights_scale=2.5, expert_weights_norm=True,
                    indexer_heads=32, indexer_dim=128, indexer_top_k=2048),
    # a few MB of each, with a top-k of 16 that short tests pass; glm-dsa-tiny's layers 1 and 3 share the selection
    "deepseek32-tiny": Preset("deepseek32", 4, 256, 4, 4, 32, 16, 4, 128, 512, 2048, n_ctx=4096, rope_base=10000.0,
                              q_lora_rank=96, kv_lora_rank=64, head_dim_rope=16, head_dim_v=32, n_expert_shared=1,
                              n_layer_dense_lead=1, gating=2, expert_weights_scale=2.5, expert_weights_norm=True,
                              indexer_heads=8, indexer_dim=32, indexer_top_k=16),
    "glm-dsa-tiny": Preset("glm-dsa", 4, 256, 4, 4, 32, 16, 4, 128, 512, 2048, n_ctx=4096, rope_base=10000.0,
                           q_lora_rank=96, kv_lora_rank=64, head_dim_rope=16, head_dim_v=32, n_expert_shared=1,
                           n_layer_dense_lead=1, gating=2, expert_weights_scale=2.5, expert_weights_norm=True,
                           indexer_heads=8, indexer_dim=32, indexer_top_k=16, indexer_every=2),
    # DeepSeek-V4-Flash's shapes (284B-A13B, 43 layers: about 150 GB with Q4_0 experts; --layers cuts it): one shared
    # key/value head of 512, 64 query heads in 8 output groups, 256 experts of 2048 chosen 6 (3 hash-routed layers),
    # a window of 128, the indexer's 64 heads of 128 picking 512 entries
    "deepseek-v4-flash": Preset("deepseek4", 43, 4096, 64, 1, 512, 256, 6, 2048, 2048, 129280, n_ctx=1048576,
                                rope_base=10000.0, q_lora_rank=1024, head_dim_rope=64, n_expert_shared=1, gating=4,
                                expert_weights_scale=1.5, expert_weights_norm=True, sliding_window=128,
                                indexer_heads=64, indexer_dim=128, indexer_top_k=512, compress_ratios=v4_ratios(43),
                                out_groups=8, out_lora_rank=1024, n_hash_layers=3),
    # a few MB of the same kinds: heavily compressed at 16, windows of 8, top-k 4 (short tests pass them)
    "deepseek4-tiny": Preset("deepseek4", 4, 256, 4, 1, 64, 16, 4, 128, 128, 2048, n_ctx=4096, rope_base=10000.0,
                             q_lora_rank=96, head_dim_rope=16, n_expert_shared=1, gating=4, expert_weights_scale=1.5,
                             expert_weights_norm=True, sliding_window=8, indexer_heads=16, indexer_dim=32,
                             indexer_top_k=4, compress_ratios=(0, 4, 16, 4), out_groups=2, out_lora_rank=32,
                             n_hash_layers=1),
    "deepseek2-tiny": Preset("deepseek2", 4, 256, 4, 4, 32, 16, 4, 128, 512, 2048, n_ctx=4096, rope_base=10000.0,
                             q_lora_rank=96, kv_lora_rank=64, head_dim_rope=16, head_dim_v=32, n_expert_shared=1,
                             n_layer_dense_lead=1, gating=2, expert_weights_scale=2.5, expert_weights_norm=True),
}


@functools.lru_cache(maxsize=None)
def _calibration(qtype: GGMLQuantizationType) -> tuple[float, float]:
    """(dmin per unit d that centres the values, std of the values at d = 1) for random blocks of a type."""
    d_off, m_off = _SCALE_FIELDS[qtype]
    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(1234)
    blocks = rng.integers(0, 256, size=(4096, size), dtype=np.uint8)

    def values(d: float, dmin: float) -> np.ndarray:
        b = blocks.copy()
        b[:, d_off:d_off + 2] = np.frombuffer(np.float16(d).tobytes(), np.uint8)
        if m_off is not None:
            b[:, m_off:m_off + 2] = np.frombuffer(np.float16(dmin).tobytes(), np.uint8)
        return gguf_quants.dequantize(b.reshape(-1), qtype).astype(np.float64)

    ratio = 0.0
    if m_off is not None:  # the value is d * a(q) -/+ dmin * b(m): pick dmin so that the mean is 0
        ratio = -values(1.0, 0.0).mean() / values(0.0, 1.0).mean()
    return ratio, float(values(1.0, ratio).std())


# rms of a random block's values under a scale of 1, for ik_llama.cpp's types (random sub-block scales times random
# table values: IQ4_KS's, IQ4_KSS's and IQ5_KS's (S & 254) - 127 and IQ4K's / IQ5NL's, IQ4_K's 6 bits less 32 and
# IQ4K's, IQ3_KS's and IQ2_KS's 5 bits less 16 and IQ3NL's / IQ2NL's, IQ2_KL's 6 bits less 32 and its pairs')
_IK_UNIT_RMS = {IkQuant.IQ4_KS: 4975.0, IkQuant.IQ4_K: 1244.0, IkQuant.IQ3_KS: 316.0, IkQuant.IQ2_KS: 174.0,
                IkQuant.IQ5_KS: 4894.0, IkQuant.IQ4_KSS: 4967.0, IkQuant.IQ2_KL: 543.0, IkQuant.IQ2_K: 85.0,
                IkQuant.IQ3_K: 623.0}


def random_tensor(qtype: GGMLQuantizationType, ne: tuple[int, ...], std: float, rng: np.random.Generator) -> np.ndarray:
    """Raw bytes of a tensor whose dequantized values have mean ~0 and standard deviation ~std."""
    n = int(np.prod(ne, dtype=np.int64))
    if qtype in FLOAT_TYPES:
        values = rng.standard_normal(n, dtype=np.float32) * np.float32(std)
        if qtype == Q.F32:
            return values.view(np.uint8)
        if qtype == Q.F16:
            return values.astype(np.float16).view(np.uint8)
        return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)  # BF16: the top half of f32
    if isinstance(qtype, IkQuant):  # random bytes under one scale: each row's (float32 or fp16, before it), or each
        # block's fp16 d (opening it)
        _, _, size, meta = IK_TYPES[qtype]
        raw = np.frombuffer(rng.bytes(ik_type_bytes(qtype, ne)), dtype=np.uint8)
        raw = (raw.reshape(n // ne[0], -1) if meta else raw.reshape(-1, size)).copy()
        scale = std / _IK_UNIT_RMS[qtype]
        raw[:, :meta or 2] = np.frombuffer((np.float32(scale) if meta == 4 else np.float16(scale)).tobytes(), np.uint8)
        return raw.reshape(-1)
    if qtype == Q.MXFP4:  # random nibbles under one E8M0 exponent: ggml's values (twice e2m1's) have rms 5.85
        blocks = np.frombuffer(rng.bytes(n // 32 * 17), dtype=np.uint8).reshape(-1, 17).copy()
        blocks[:, 0] = np.uint8(np.clip(round(128 + np.log2(std / MXFP4_UNIT_STD)), 2, 254))
        return blocks.reshape(-1)
    if qtype not in _SCALE_FIELDS:  # no single scale field to set (IQ4_*, TQ2_0): quantize real values
        return quantize(rng.standard_normal((n // ne[0], ne[0]), dtype=np.float32) * np.float32(std), qtype)
    block, size = GGML_QUANT_SIZES[qtype]
    blocks = np.frombuffer(rng.bytes(n // block * size), dtype=np.uint8).reshape(-1, size).copy()
    ratio, unit_std = _calibration(qtype)
    d = std / unit_std
    d_off, m_off = _SCALE_FIELDS[qtype]
    blocks[:, d_off:d_off + 2] = np.frombuffer(np.float16(d).tobytes(), np.uint8)
    if m_off is not None:
        blocks[:, m_off:m_off + 2] = np.frombuffer(np.float16(d * ratio).tobytes(), np.uint8)
    return blocks.reshape(-1)


def byte_level_vocab(n_vocab: int, specials: list[str], rng: np.random.Generator) -> tuple[list[str], list[int], list[str]]:
    """A valid byte-level BPE vocabulary: 256 byte tokens, merges of random token pairs, then specials."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = list(bytes_to_unicode().values())
    seen = set(tokens)
    merges: list[str] = []
    n_plain = n_vocab - len(specials)
    draws = iter(())
    while len(tokens) < n_plain:
        try:
            u, v = next(draws), next(draws)
        except StopIteration:  # random numbers drawn in blocks: one numpy call per draw took a minute for 152k tokens
            draws = iter(rng.random(1 << 16).tolist())
            continue
        a, b = tokens[int(u * len(tokens))], tokens[int(v * len(tokens))]
        if len(a) + len(b) > 12 or a + b in seen:
            continue
        tokens.append(a + b)
        seen.add(a + b)
        merges.append(f"{a} {b}")
    token_type = [1] * len(tokens) + [3] * len(specials)  # 1 NORMAL, 3 CONTROL
    return tokens + specials, token_type, merges


def _mla_layer(p: Preset, b: str, i: int, mat, named, ones, experts: tuple, other_type, rng,
               legacy: bool) -> list[TensorSpec]:
    """One deepseek2 block: latent attention, then a dense FFN (leading layers) or routed + shared experts. The
    latent's expansion is split per head into attn_k_b (transposed) and attn_v_b as llama.cpp's converters write it
    since 2025, or (legacy) one attn_kv_b as older files hold it."""
    d, h, qk = p.n_embd, p.n_head, p.head_dim + p.head_dim_rope
    specs = [named(ones(d), b + "attn_norm.weight")]
    if p.q_lora_rank:
        specs += [mat(b + "attn_q_a.weight", other_type, (d, p.q_lora_rank)),
                  named(ones(p.q_lora_rank), b + "attn_q_a_norm.weight"),
                  mat(b + "attn_q_b.weight", other_type, (p.q_lora_rank, h * qk))]
    else:
        specs.append(mat(b + "attn_q.weight", other_type, (d, h * qk)))
    specs += [mat(b + "attn_kv_a_mqa.weight", other_type, (d, p.kv_lora_rank + p.head_dim_rope)),
              named(ones(p.kv_lora_rank), b + "attn_kv_a_norm.weight")]
    if legacy:
        specs.append(mat(b + "attn_kv_b.weight", other_type, (p.kv_lora_rank, h * (p.head_dim + p.head_dim_v))))
    else:
        specs += [mat(b + "attn_k_b.weight", other_type, (p.head_dim, p.kv_lora_rank, h)),
                  mat(b + "attn_v_b.weight", other_type, (p.kv_lora_rank, p.head_dim_v, h))]
    specs += [mat(b + "attn_output.weight", other_type, (h * p.head_dim_v, d), OUTPUT_PROJECTION_SCALE),
              named(ones(d), b + "ffn_norm.weight")]
    if p.indexer_heads and i % p.indexer_every == 0:  # the lightning indexer (f32 vectors as llama.cpp keeps them)
        zeros = lambda n: TensorSpec("", Q.F32, (n,), lambda: np.zeros(n, np.float32))  # noqa: E731
        specs += [mat(b + "indexer.attn_q_b.weight", other_type, (p.q_lora_rank, p.indexer_heads * p.indexer_dim)),
                  mat(b + "indexer.attn_k.weight", other_type, (d, p.indexer_dim)),
                  named(ones(p.indexer_dim), b + "indexer.k_norm.weight"),
                  named(zeros(p.indexer_dim), b + "indexer.k_norm.bias"),
                  mat(b + "indexer.proj.weight", other_type, (d, p.indexer_heads))]
    return specs + _ffn(p, b, i, mat, experts, other_type, rng)


def _glm_layer(p: Preset, b: str, i: int, mat, named, ones, experts: tuple, other_type, rng) -> list[TensorSpec]:
    """One glm4moe block: attention with q/k/v biases, then a dense FFN (leading layers) or routed experts with a
    correction bias and a shared expert."""
    d, q_dim, kv_dim = p.n_embd, p.n_head * p.head_dim, p.n_head_kv * p.head_dim
    small = lambda n, name: TensorSpec(name, Q.F32, (n,), lambda: (0.02 * rng.standard_normal(n)).astype(np.float32))  # noqa: E731
    specs = [named(ones(d), b + "attn_norm.weight"),
             mat(b + "attn_q.weight", other_type, (d, q_dim)), small(q_dim, b + "attn_q.bias"),
             mat(b + "attn_k.weight", other_type, (d, kv_dim)), small(kv_dim, b + "attn_k.bias"),
             mat(b + "attn_v.weight", other_type, (d, kv_dim)), small(kv_dim, b + "attn_v.bias"),
             mat(b + "attn_output.weight", other_type, (q_dim, d), OUTPUT_PROJECTION_SCALE),
             named(ones(d), b + "post_attention_norm.weight")]
    return specs + _ffn(p, b, i, mat, experts, other_type, rng)


def _minimax_layer(p: Preset, b: str, mat, named, ones, experts: tuple, other_type, rng) -> list[TensorSpec]:
    """One minimax-m2 block: attention with q and k norms across all heads, then routed experts with the correction
    bias of sigmoid routing (no shared expert)."""
    d, q_dim, kv_dim = p.n_embd, p.n_head * p.head_dim, p.n_head_kv * p.head_dim

    def near_one(n: int, name: str) -> TensorSpec:
        return TensorSpec(name, Q.F32, (n,), lambda: (1 + 0.1 * rng.standard_normal(n)).astype(np.float32))

    return [named(ones(d), b + "attn_norm.weight"),
            mat(b + "attn_q.weight", other_type, (d, q_dim)), mat(b + "attn_k.weight", other_type, (d, kv_dim)),
            mat(b + "attn_v.weight", other_type, (d, kv_dim)),
            mat(b + "attn_output.weight", other_type, (q_dim, d), OUTPUT_PROJECTION_SCALE),
            near_one(q_dim, b + "attn_q_norm.weight"), near_one(kv_dim, b + "attn_k_norm.weight"),
            named(ones(d), b + "ffn_norm.weight"),
            mat(b + "ffn_gate_inp.weight", Q.F32, (d, p.n_expert)),
            mat(b + "ffn_gate_exps.weight", experts[0], (d, p.n_ff_exp, p.n_expert)),
            mat(b + "ffn_up_exps.weight", experts[0], (d, p.n_ff_exp, p.n_expert)),
            mat(b + "ffn_down_exps.weight", experts[1], (p.n_ff_exp, d, p.n_expert), OUTPUT_PROJECTION_SCALE),
            TensorSpec(b + "exp_probs_b.bias", Q.F32, (p.n_expert,),
                       lambda: (0.01 * rng.standard_normal(p.n_expert)).astype(np.float32))]


def _gptoss_layer(p: Preset, b: str, mat, named, ones, experts: tuple, other_type, rng) -> list[TensorSpec]:
    """One gpt-oss block: attention with biases (output's too) and sinks, then routed experts with biases (router's
    too); the experts of the first of `experts`' types (MXFP4 in the real files)."""
    d, q_dim, kv_dim = p.n_embd, p.n_head * p.head_dim, p.n_head_kv * p.head_dim

    def small(name: str, *ne: int, std: float = 0.02) -> TensorSpec:
        n = int(np.prod(ne))
        return TensorSpec(name, Q.F32, ne, lambda: (std * rng.standard_normal(n)).astype(np.float32))

    return [named(ones(d), b + "attn_norm.weight"),
            mat(b + "attn_q.weight", other_type, (d, q_dim)), small(b + "attn_q.bias", q_dim),
            mat(b + "attn_k.weight", other_type, (d, kv_dim)), small(b + "attn_k.bias", kv_dim),
            mat(b + "attn_v.weight", other_type, (d, kv_dim)), small(b + "attn_v.bias", kv_dim),
            mat(b + "attn_output.weight", other_type, (q_dim, d), OUTPUT_PROJECTION_SCALE),
            small(b + "attn_output.bias", d), small(b + "attn_sinks.weight", p.n_head, std=1.0),
            named(ones(d), b + "post_attention_norm.weight"),
            mat(b + "ffn_gate_inp.weight", Q.F32, (d, p.n_expert)), small(b + "ffn_gate_inp.bias", p.n_expert),
            mat(b + "ffn_gate_exps.weight", experts[0], (d, p.n_ff_exp, p.n_expert)),
            small(b + "ffn_gate_exps.bias", p.n_ff_exp, p.n_expert),
            mat(b + "ffn_up_exps.weight", experts[0], (d, p.n_ff_exp, p.n_expert)),
            small(b + "ffn_up_exps.bias", p.n_ff_exp, p.n_expert),
            mat(b + "ffn_down_exps.weight", experts[0], (p.n_ff_exp, d, p.n_expert), OUTPUT_PROJECTION_SCALE),
            small(b + "ffn_down_exps.bias", d, p.n_expert)]


def _qwen35_layer(p: Preset, b: str, i: int, mat, named, ones, experts: tuple, other_type, rng) -> list[TensorSpec]:
    """One qwen35moe / qwen3next block: gated delta-net (all but every full_attention_interval-th layer) or gated
    attention, then routed experts beside a gated shared expert."""
    d, q_dim, kv_dim = p.n_embd, p.n_head * p.head_dim, p.n_head_kv * p.head_dim
    hv, dk = p.ssm_v_heads, p.ssm_head_dim
    channels = (2 * p.ssm_k_heads + hv) * dk

    def vector(name: str, *ne: int, mean: float = 0.0, std: float = 0.1) -> TensorSpec:
        n = int(np.prod(ne))
        return TensorSpec(name, Q.F32, ne, lambda: (mean + std * rng.standard_normal(n)).astype(np.float32))

    specs = [named(ones(d), b + "attn_norm.weight")]
    if (i + 1) % p.full_attention_interval:
        beta_alpha = ([mat(b + "ssm_ba.weight", other_type, (d, 2 * hv))] if p.arch == "qwen3next" else
                      [mat(b + "ssm_beta.weight", other_type, (d, hv)), mat(b + "ssm_alpha.weight", other_type, (d, hv))])
        specs += [mat(b + "attn_qkv.weight", other_type, (d, channels)),
                  mat(b + "attn_gate.weight", other_type, (d, hv * dk)), *beta_alpha,
                  vector(b + "ssm_conv1d.weight", p.ssm_kernel, channels, std=0.5),
                  vector(b + "ssm_dt.bias", hv, std=1.0), vector(b + "ssm_a", hv, mean=-1.0, std=0.2),
                  vector(b + "ssm_norm.weight", dk, mean=1.0),
                  mat(b + "ssm_out.weight", other_type, (hv * dk, d), OUTPUT_PROJECTION_SCALE)]
    else:
        specs += [mat(b + "attn_q.weight", other_type, (d, 2 * q_dim)), mat(b + "attn_k.weight", other_type, (d, kv_dim)),
                  mat(b + "attn_v.weight", other_type, (d, kv_dim)),
                  mat(b + "attn_output.weight", other_type, (q_dim, d), OUTPUT_PROJECTION_SCALE),
                  vector(b + "attn_q_norm.weight", p.head_dim, mean=1.0), vector(b + "attn_k_norm.weight", p.head_dim, mean=1.0)]
    shared = p.n_ff_shexp
    return specs + [named(ones(d), b + "post_attention_norm.weight"),
                    mat(b + "ffn_gate_inp.weight", Q.F32, (d, p.n_expert)),
                    mat(b + "ffn_gate_exps.weight", experts[0], (d, p.n_ff_exp, p.n_expert)),
                    mat(b + "ffn_up_exps.weight", experts[0], (d, p.n_ff_exp, p.n_expert)),
                    mat(b + "ffn_down_exps.weight", experts[1], (p.n_ff_exp, d, p.n_expert), OUTPUT_PROJECTION_SCALE),
                    mat(b + "ffn_gate_shexp.weight", other_type, (d, shared)),
                    mat(b + "ffn_up_shexp.weight", other_type, (d, shared)),
                    mat(b + "ffn_down_shexp.weight", other_type, (shared, d), OUTPUT_PROJECTION_SCALE),
                    mat(b + "ffn_gate_inp_shexp.weight", Q.F32, (d, 1))]


def _v4_layer(p: Preset, b: str, i: int, mat, named, ones, experts: tuple, other_type, rng) -> list[TensorSpec]:
    """One deepseek4 block: the hyper-connections' mixing, compressed attention (its compressor and indexer where the
    layer's ratio asks), routed experts (hash-routed in the leading layers) and the shared expert."""
    d, h, hd, ratio = p.n_embd, p.n_head, p.head_dim, p.compress_ratios[i]

    def vector(name: str, *ne: int, mean: float = 0.0, std: float = 0.1) -> TensorSpec:
        n = int(np.prod(ne))
        return TensorSpec(name, Q.F32, ne, lambda: (mean + std * rng.standard_normal(n)).astype(np.float32))

    mix = (2 + p.n_hc) * p.n_hc
    specs = []
    for kind in ("attn", "ffn"):
        specs += [mat(f"{b}hc_{kind}_fn.weight", Q.F32, (p.n_hc * d, mix)), vector(f"{b}hc_{kind}_base.weight", mix),
                  vector(f"{b}hc_{kind}_scale.weight", 3, mean=1.0)]
    group = h * hd // p.out_groups
    specs += [named(ones(d), b + "attn_norm.weight"), mat(b + "attn_q_a.weight", other_type, (d, p.q_lora_rank)),
              named(ones(p.q_lora_rank), b + "attn_q_a_norm.weight"),
              mat(b + "attn_q_b.weight", other_type, (p.q_lora_rank, h * hd)),
              mat(b + "attn_kv.weight", other_type, (d, hd)), named(ones(hd), b + "attn_kv_a_norm.weight"),
              vector(b + "attn_sinks.weight", h),
              mat(b + "attn_output_a.weight", other_type, (group, p.out_groups * p.out_lora_rank)),
              mat(b + "attn_output_b.weight", other_type, (p.out_groups * p.out_lora_rank, d), OUTPUT_PROJECTION_SCALE),
              named(ones(d), b + "ffn_norm.weight")]
    compressors = ([("attn", hd)] if ratio else []) + ([("indexer", p.indexer_dim)] if ratio == 4 else [])
    for name, dim in compressors:
        width = dim * (2 if ratio == 4 else 1)
        specs += [mat(f"{b}{name}_compressor_kv.weight", other_type, (d, width)),
                  mat(f"{b}{name}_compressor_gate.weight", other_type, (d, width)),
                  vector(f"{b}{name}_compressor_ape.weight", width, ratio),
                  named(ones(dim), f"{b}{name}_compressor_norm.weight")]
    if ratio == 4:
        specs += [mat(b + "indexer.attn_q_b.weight", other_type, (p.q_lora_rank, p.indexer_heads * p.indexer_dim)),
                  mat(b + "indexer.proj.weight", other_type, (d, p.indexer_heads))]
    ffn = _ffn(p, b, i, mat, experts, other_type, rng)
    if i < p.n_hash_layers:  # each token id's experts, distinct, instead of the correction bias
        ffn = [s for s in ffn if not s.name.endswith("exp_probs_b.bias")]
        k = p.n_expert_used
        ffn.append(TensorSpec(b + "ffn_gate_tid2eid.weight", Q.I32, (k, p.n_vocab), lambda: np.argsort(
            rng.random((p.n_vocab, p.n_expert)), axis=1)[:, :k].astype(np.int32).reshape(-1).view(np.uint8)))
    return specs + ffn


def _ffn(p: Preset, b: str, i: int, mat, experts: tuple, other_type, rng) -> list[TensorSpec]:
    """Block i's FFN: dense in the leading layers; else routed experts (router, gate/up/down of the types
    `experts`), shared experts, and the correction bias of sigmoid routing."""
    d = p.n_embd
    if i < p.n_layer_dense_lead:
        return [mat(b + "ffn_gate.weight", other_type, (d, p.n_ff)),
                mat(b + "ffn_up.weight", other_type, (d, p.n_ff)),
                mat(b + "ffn_down.weight", other_type, (p.n_ff, d), OUTPUT_PROJECTION_SCALE)]
    shared = p.n_ff_exp * p.n_expert_shared
    specs = [mat(b + "ffn_gate_inp.weight", Q.F32, (d, p.n_expert)),
             mat(b + "ffn_gate_exps.weight", experts[0], (d, p.n_ff_exp, p.n_expert)),
             mat(b + "ffn_up_exps.weight", experts[0], (d, p.n_ff_exp, p.n_expert)),
             mat(b + "ffn_down_exps.weight", experts[1], (p.n_ff_exp, d, p.n_expert), OUTPUT_PROJECTION_SCALE),
             mat(b + "ffn_gate_shexp.weight", other_type, (d, shared)),
             mat(b + "ffn_up_shexp.weight", other_type, (d, shared)),
             mat(b + "ffn_down_shexp.weight", other_type, (shared, d), OUTPUT_PROJECTION_SCALE)]
    if p.gating in (2, 4):  # the correction bias: small, so the choice stays the scores' but not exactly
        specs.append(TensorSpec(b + "exp_probs_b.bias", Q.F32, (p.n_expert,),
                                lambda: (0.01 * rng.standard_normal(p.n_expert)).astype(np.float32)))
    return specs


def skewed(router: TensorSpec, skew: float, seed: int) -> TensorSpec:
    """A router whose experts are routed to unevenly, as trained models' are: the expert of popularity rank r (a
    random order per layer) has its router column scaled by (r + 1) ** -skew, the scales then set to a mean square
    of 1. A larger column spreads that expert's scores wider, so more of them land among a token's top k: the share
    of (token, expert) pairs falls with r, steeply for skew 1 or more (`ferry calibrate --routing` measures it). Its
    own random numbers (from seed and the layer), so that the other weights stay those of the unskewed file."""
    d, n_expert = router.ne
    layer = int(router.name.split(".")[1])
    make = router.make

    def scaled() -> np.ndarray:
        w = make().view(np.float32).reshape(n_expert, d).copy()  # row e: expert e's column in ggml's order
        rank = np.random.default_rng([seed, layer, 0x5E]).permutation(n_expert)
        scale = (rank + 1.0) ** -skew
        w *= (scale / np.sqrt(np.mean(scale ** 2)))[:, None].astype(np.float32)
        return w.reshape(-1).view(np.uint8)
    return TensorSpec(router.name, router.qtype, router.ne, scaled)


def synth(p: Preset, out: Path, expert_type: GGMLQuantizationType | str, other_type: GGMLQuantizationType,
          seed: int = 0, layers: int = 0, quiet: bool = False, legacy_mla: bool = False,
          shape_only: bool = False, routing_skew: float = 0.0) -> None:
    """A random-weight GGUF of the preset's architecture and shapes; shape_only: every weight zero, as a sparse file
    written at once (for planning and inspecting, not for running); routing_skew: some experts routed to more than
    others (skewed())."""
    rng = np.random.default_rng(seed)
    n_layer = layers or p.n_layer
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens, token_type, merges = byte_level_vocab(p.n_vocab, specials, rng)
    a = p.arch
    metadata = {
        "general.name": f"ferry synth {a} {n_layer}L",
        # llama.cpp names a model by its file type: the experts' type, since they hold most of the bytes
        "general.file_type": (MIXES[expert_type][2] if expert_type in MIXES
                              else _FILE_TYPES.get(expert_type, LlamaFileType.GUESSED)).value,
        f"{a}.context_length": p.n_ctx,
        f"{a}.embedding_length": p.n_embd,
        f"{a}.block_count": n_layer,
        f"{a}.feed_forward_length": p.n_ff,
        f"{a}.attention.head_count": p.n_head,
        f"{a}.attention.head_count_kv": p.n_head_kv,
        f"{a}.attention.key_length": p.head_dim,
        f"{a}.attention.value_length": p.head_dim,
        f"{a}.attention.layer_norm_rms_epsilon": p.norm_eps,
        f"{a}.rope.freq_base": p.rope_base,
        f"{a}.expert_count": p.n_expert,
        f"{a}.expert_used_count": p.n_expert_used,
        f"{a}.expert_feed_forward_length": p.n_ff_exp,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": np.array(token_type, dtype=np.int32),
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.eos_token_id": len(tokens) - 1,
        "tokenizer.ggml.bos_token_id": len(tokens) - 3,
        "tokenizer.ggml.padding_token_id": len(tokens) - 3,
        "tokenizer.ggml.add_bos_token": False,
    }
    mla = a in ("deepseek2", "deepseek32", "glm-dsa")
    if a == "deepseek4":
        metadata.update({f"{a}.attention.key_length": p.head_dim, f"{a}.attention.value_length": p.head_dim,
                         f"{a}.rope.dimension_count": p.head_dim_rope, f"{a}.attention.q_lora_rank": p.q_lora_rank,
                         f"{a}.attention.sliding_window": p.sliding_window,
                         f"{a}.expert_shared_count": p.n_expert_shared, f"{a}.expert_gating_func": p.gating,
                         f"{a}.expert_weights_scale": p.expert_weights_scale,
                         f"{a}.expert_weights_norm": p.expert_weights_norm,
                         f"{a}.swiglu_clamp_exp": [10.0] * n_layer, f"{a}.swiglu_clamp_shexp": [10.0] * n_layer,
                         f"{a}.attention.indexer.head_count": p.indexer_heads,
                         f"{a}.attention.indexer.key_length": p.indexer_dim,
                         f"{a}.attention.indexer.top_k": p.indexer_top_k,
                         f"{a}.attention.output_group_count": p.out_groups,
                         f"{a}.attention.output_lora_rank": p.out_lora_rank,
                         f"{a}.attention.compress_ratios": np.array(p.compress_ratios[:n_layer], dtype=np.int32),
                         f"{a}.attention.compress_rope_freq_base": 160000.0, f"{a}.hyper_connection.count": p.n_hc,
                         f"{a}.hyper_connection.sinkhorn_iterations": 20, f"{a}.hyper_connection.epsilon": 1e-6,
                         f"{a}.hash_layer_count": p.n_hash_layers, f"{a}.rope.scaling.type": "yarn",
                         f"{a}.rope.scaling.factor": 16.0, f"{a}.rope.scaling.original_context_length": 65536,
                         f"{a}.rope.scaling.yarn_beta_fast": 32.0, f"{a}.rope.scaling.yarn_beta_slow": 1.0})
    if a == "gpt-oss":
        metadata.update({f"{a}.attention.sliding_window": p.sliding_window, f"{a}.rope.scaling.type": "yarn",
                         f"{a}.rope.scaling.factor": 32.0, f"{a}.rope.scaling.original_context_length": 4096})
    if a == "minimax-m2":
        metadata.update({f"{a}.rope.dimension_count": p.n_rot or p.head_dim, f"{a}.expert_gating_func": p.gating,
                         "tokenizer.ggml.pre": "minimax-m2"})
    if a == "glm4moe":
        metadata.update({f"{a}.rope.dimension_count": p.n_rot or p.head_dim, f"{a}.nextn_predict_layers": 0,
                         f"{a}.expert_shared_count": p.n_expert_shared,
                         f"{a}.leading_dense_block_count": p.n_layer_dense_lead, f"{a}.expert_gating_func": p.gating,
                         f"{a}.expert_weights_scale": p.expert_weights_scale,
                         f"{a}.expert_weights_norm": p.expert_weights_norm})
    if a in ("qwen35moe", "qwen3next"):
        metadata.update({f"{a}.rope.dimension_count": p.n_rot, f"{a}.ssm.conv_kernel": p.ssm_kernel,
                         f"{a}.ssm.state_size": p.ssm_head_dim, f"{a}.ssm.group_count": p.ssm_k_heads,
                         f"{a}.ssm.time_step_rank": p.ssm_v_heads, f"{a}.ssm.inner_size": p.ssm_v_heads * p.ssm_head_dim,
                         f"{a}.full_attention_interval": p.full_attention_interval,
                         f"{a}.expert_shared_feed_forward_length": p.n_ff_shexp})
        if a == "qwen35moe":  # the multi-axis rope's sections, pairs of rotated values per axis (text: one position)
            metadata[f"{a}.rope.dimension_sections"] = np.array([11, 11, 10, 0], dtype=np.int32)
    if mla:
        metadata.update({f"{a}.attention.key_length": p.head_dim + p.head_dim_rope,
                         f"{a}.attention.value_length": p.head_dim_v, f"{a}.rope.dimension_count": p.head_dim_rope,
                         f"{a}.attention.kv_lora_rank": p.kv_lora_rank, f"{a}.expert_shared_count": p.n_expert_shared,
                         f"{a}.leading_dense_block_count": p.n_layer_dense_lead, f"{a}.expert_gating_func": p.gating,
                         f"{a}.expert_weights_scale": p.expert_weights_scale,
                         f"{a}.expert_weights_norm": p.expert_weights_norm})
        if p.q_lora_rank:
            metadata[f"{a}.attention.q_lora_rank"] = p.q_lora_rank
        if p.indexer_heads:
            metadata.update({f"{a}.attention.indexer.head_count": p.indexer_heads,
                             f"{a}.attention.indexer.key_length": p.indexer_dim,
                             f"{a}.attention.indexer.top_k": p.indexer_top_k})
            if p.indexer_every > 1:
                metadata[f"{a}.attention.indexer.types"] = [i % p.indexer_every == 0 for i in range(n_layer)]
        if not legacy_mla:  # the cache's sizes are the latent's; the expanded per-head sizes apart (llama.cpp's MLA)
            metadata.update({f"{a}.attention.head_count_kv": 1,
                             f"{a}.attention.key_length": p.kv_lora_rank + p.head_dim_rope,
                             f"{a}.attention.value_length": p.kv_lora_rank,
                             f"{a}.attention.key_length_mla": p.head_dim + p.head_dim_rope,
                             f"{a}.attention.value_length_mla": p.head_dim_v})
    d, q_dim, kv_dim = p.n_embd, p.n_head * p.head_dim, p.n_head_kv * p.head_dim
    ones = lambda n: TensorSpec("", Q.F32, (n,), lambda: np.ones(n, np.float32))  # noqa: E731

    def mat(name: str, qtype: GGMLQuantizationType, ne: tuple[int, ...], scale: float = 1.0) -> TensorSpec:
        return TensorSpec(name, qtype, ne, lambda: random_tensor(qtype, ne, scale / np.sqrt(ne[0]), rng))

    def named(spec: TensorSpec, name: str) -> TensorSpec:
        spec.name = name
        return spec

    specs = [mat("token_embd.weight", other_type, (d, p.n_vocab), scale=np.sqrt(d))]
    for i in range(n_layer):
        b = f"blk.{i}."
        experts = expert_types(expert_type, i, n_layer)
        if mla:
            specs += _mla_layer(p, b, i, mat, named, ones, experts, other_type, rng, legacy_mla)
            continue
        if a == "glm4moe":
            specs += _glm_layer(p, b, i, mat, named, ones, experts, other_type, rng)
            continue
        if a == "gpt-oss":
            specs += _gptoss_layer(p, b, mat, named, ones, experts, other_type, rng)
            continue
        if a == "minimax-m2":
            specs += _minimax_layer(p, b, mat, named, ones, experts, other_type, rng)
            continue
        if a == "deepseek4":
            specs += _v4_layer(p, b, i, mat, named, ones, experts, other_type, rng)
            continue
        if a in ("qwen35moe", "qwen3next"):
            specs += _qwen35_layer(p, b, i, mat, named, ones, experts, other_type, rng)
            continue
        specs += [
            named(ones(d), b + "attn_norm.weight"),
            mat(b + "attn_q.weight", other_type, (d, q_dim)),
            mat(b + "attn_k.weight", other_type, (d, kv_dim)),
            mat(b + "attn_v.weight", other_type, (d, kv_dim)),
            mat(b + "attn_output.weight", other_type, (q_dim, d), OUTPUT_PROJECTION_SCALE),
            named(ones(p.head_dim), b + "attn_q_norm.weight"),
            named(ones(p.head_dim), b + "attn_k_norm.weight"),
            named(ones(d), b + "ffn_norm.weight"),
            mat(b + "ffn_gate_inp.weight", Q.F32, (d, p.n_expert)),
            mat(b + "ffn_gate_exps.weight", experts[0], (d, p.n_ff_exp, p.n_expert)),
            mat(b + "ffn_up_exps.weight", experts[0], (d, p.n_ff_exp, p.n_expert)),
            mat(b + "ffn_down_exps.weight", experts[1], (p.n_ff_exp, d, p.n_expert), OUTPUT_PROJECTION_SCALE),
        ]
    specs += [named(ones(d), "output_norm.weight"), mat("output.weight", other_type, (d, p.n_vocab))]
    if a == "deepseek4":
        specs += [mat("output_hc_fn.weight", Q.F32, (p.n_hc * d, p.n_hc)),
                  TensorSpec("output_hc_base.weight", Q.F32, (p.n_hc,), lambda: np.zeros(p.n_hc, np.float32)),
                  TensorSpec("output_hc_scale.weight", Q.F32, (1,), lambda: np.ones(1, np.float32))]
    if routing_skew:
        specs = [skewed(spec, routing_skew, seed) if spec.name.endswith(".ffn_gate_inp.weight") else spec
                 for spec in specs]

    if quiet or shape_only:
        write_gguf(out, a, metadata, specs, shape_only=shape_only)
        return
    from rich.progress import Progress

    with Progress(transient=True) as progress:
        task = progress.add_task(f"writing {out.name}", total=sum(s.nbytes for s in specs))
        write_gguf(out, a, metadata, specs, on_tensor=lambda s: progress.advance(task, s.nbytes))
