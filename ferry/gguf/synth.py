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
from ferry.quant import FLOAT_TYPES, Q, quantize

OUTPUT_PROJECTION_SCALE = 0.1
_FILE_TYPES = {t: LlamaFileType[f"MOSTLY_{t.name}"] for t in Q if f"MOSTLY_{t.name}" in LlamaFileType.__members__}
_FILE_TYPES[Q.F32] = LlamaFileType.ALL_F32

# byte offsets of the f16 scale `d` and of the f16 min/offset `dmin` (None: the type has none)
_SCALE_FIELDS: dict[GGMLQuantizationType, tuple[int, int | None]] = {
    Q.Q4_0: (0, None), Q.Q4_1: (0, 2), Q.Q5_0: (0, None), Q.Q5_1: (0, 2), Q.Q8_0: (0, None),
    Q.Q2_K: (80, 82), Q.Q3_K: (108, None), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208, None),
    # the i-quants below need an importance matrix to quantize, so random blocks are the only cheap source
    Q.IQ2_XXS: (0, None), Q.IQ2_XS: (0, None), Q.IQ2_S: (0, None), Q.IQ3_XXS: (0, None), Q.IQ3_S: (0, None),
    Q.IQ1_S: (0, None), Q.TQ1_0: (52, None),
}


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


PRESETS = {
    # Qwen3-30B-A3B's shapes: 18 GB with Q4_0 experts and Q8_0 for the rest
    "qwen3-30b-a3b": Preset("qwen3moe", 48, 2048, 32, 4, 128, 128, 8, 768, 6144, 151936),
    # about 1.4 GB: larger than any CPU cache, small enough for a laptop
    "qwen3-moe-mid": Preset("qwen3moe", 24, 1024, 16, 4, 64, 64, 8, 512, 3072, 32000),
    # a few MB: for tests
    "qwen3-moe-tiny": Preset("qwen3moe", 4, 256, 4, 2, 64, 16, 4, 256, 768, 2048, n_ctx=4096),
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
    if qtype not in _SCALE_FIELDS:  # no single scale field to set (IQ4_*, MXFP4, TQ2_0): quantize real values
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
    while len(tokens) < n_plain:
        i, j = rng.integers(0, len(tokens), size=2)
        a, b = tokens[i], tokens[j]
        if len(a) + len(b) > 12 or a + b in seen:
            continue
        tokens.append(a + b)
        seen.add(a + b)
        merges.append(f"{a} {b}")
    token_type = [1] * len(tokens) + [3] * len(specials)  # 1 NORMAL, 3 CONTROL
    return tokens + specials, token_type, merges


def synth(p: Preset, out: Path, expert_type: GGMLQuantizationType, other_type: GGMLQuantizationType,
          seed: int = 0, layers: int = 0, quiet: bool = False) -> None:
    rng = np.random.default_rng(seed)
    n_layer = layers or p.n_layer
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens, token_type, merges = byte_level_vocab(p.n_vocab, specials, rng)
    a = p.arch
    metadata = {
        "general.name": f"ferry synth {a} {n_layer}L",
        # llama.cpp names a model by its file type: the experts' type, since they hold most of the bytes
        "general.file_type": _FILE_TYPES.get(expert_type, LlamaFileType.GUESSED).value,
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
            mat(b + "ffn_gate_exps.weight", expert_type, (d, p.n_ff_exp, p.n_expert)),
            mat(b + "ffn_up_exps.weight", expert_type, (d, p.n_ff_exp, p.n_expert)),
            mat(b + "ffn_down_exps.weight", expert_type, (p.n_ff_exp, d, p.n_expert), OUTPUT_PROJECTION_SCALE),
        ]
    specs += [named(ones(d), "output_norm.weight"), mat("output.weight", other_type, (d, p.n_vocab))]

    if quiet:
        write_gguf(out, a, metadata, specs)
        return
    from rich.progress import Progress

    with Progress(transient=True) as progress:
        task = progress.add_task(f"writing {out.name}", total=sum(s.nbytes for s in specs))
        write_gguf(out, a, metadata, specs, on_tensor=lambda s: progress.advance(task, s.nbytes))
