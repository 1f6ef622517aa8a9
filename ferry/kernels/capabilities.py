"""What each quant type can do where: the one table that backends, the offload policy, `ferry plan` and `ferry info`
ask. Asking needs no GPU and no Triton; tests/test_capabilities.py checks the table against the kernels
themselves (the GPU kernels' type maps, the CPU kernel's shapes, ggml's repack probe)."""

from __future__ import annotations

from dataclasses import dataclass

from gguf.constants import GGMLQuantizationType as Q

from ferry.quant import IkQuant, block_size


@dataclass(frozen=True)
class Can:
    """One quant type's abilities.
    gpu_gemv: the GPU's quantized kernels (GEMV, expert GEMVs, the grouped MoE GEMM) read its blocks in place;
    gpu_expand: the GPU's dequantizer expands it (for cuBLAS, or to bfloat16 for torch's grouped GEMM);
    gpu_float: a float type the GPU's matmuls read as it is (a router, a float matrix) but its expert paths do not;
    gpu_token: the GPU's few-token kernels alone (GEMV, expert GEMVs) read its GGUF blocks in place (kernels/cuda/
    kquant.py); its prompts and streamed experts expand it;
    cpu_native: ferry's CPU expert kernel reads it: "repacked" (ggml's interleaved copy), "plain" (its GGUF layout),
    or "" (ggml runs it);
    cpu_linear: ferry's CPU matrix kernel reads it as a dense weight: as cpu_native, or "own" (its own interleaved Q8_0
    copy, made at first use where ggml has none: Q8_0's bytes; Q5_0's and IQ4_NL's values exactly, in 34 bytes for 22
    and 18: quant.as_q8_0);
    cpu_linear_from: the fewest tokens of a call the kernel takes it for (Q5_0's and IQ4_NL's copies read more bytes
    than ggml's kernels do at one token; for a prompt its tiles pay)."""

    gpu_gemv: bool = False
    gpu_expand: bool = False
    gpu_float: bool = False
    gpu_token: bool = False
    cpu_native: str = ""
    cpu_linear: str = ""
    cpu_linear_from: int = 1


_TABLE = {
    Q.F32: Can(gpu_float=True),
    Q.F16: Can(gpu_float=True),
    Q.BF16: Can(gpu_float=True),
    Q.Q8_0: Can(gpu_gemv=True, gpu_expand=True, cpu_linear="own"),
    Q.Q4_0: Can(gpu_gemv=True, gpu_expand=True, cpu_native="repacked", cpu_linear="repacked"),
    Q.Q4_1: Can(gpu_expand=True),
    Q.Q5_0: Can(gpu_expand=True, cpu_linear="own", cpu_linear_from=2),
    Q.Q5_1: Can(gpu_expand=True),
    Q.Q2_K: Can(gpu_expand=True),
    Q.Q3_K: Can(gpu_expand=True),
    Q.Q4_K: Can(gpu_expand=True, gpu_token=True, cpu_native="repacked", cpu_linear="repacked"),
    Q.Q5_K: Can(gpu_expand=True, gpu_token=True, cpu_native="plain", cpu_linear="plain"),
    Q.Q6_K: Can(gpu_expand=True, gpu_token=True, cpu_native="plain", cpu_linear="plain"),
    Q.IQ4_XS: Can(gpu_expand=True, cpu_native="plain", cpu_linear="plain"),
    Q.IQ4_NL: Can(gpu_expand=True, cpu_linear="own", cpu_linear_from=2),
    Q.MXFP4: Can(gpu_gemv=True, gpu_expand=True, cpu_native="plain", cpu_linear="plain"),
    IkQuant.IQ4_KS: Can(gpu_expand=True, gpu_token=True, cpu_native="plain"),
    IkQuant.IQ4_K: Can(gpu_expand=True, gpu_token=True, cpu_native="plain"),
    IkQuant.IQ3_KS: Can(gpu_expand=True, gpu_token=True, cpu_native="plain"),
    IkQuant.IQ2_KS: Can(gpu_expand=True, gpu_token=True, cpu_native="plain"),
    IkQuant.IQ5_KS: Can(gpu_expand=True, gpu_token=True, cpu_native="plain"),
    IkQuant.IQ4_KSS: Can(gpu_expand=True, gpu_token=True, cpu_native="plain"),
    IkQuant.IQ2_KL: Can(gpu_expand=True, gpu_token=True, cpu_native="plain"),
    IkQuant.IQ2_K: Can(gpu_expand=True, gpu_token=True, cpu_native="plain"),
    IkQuant.IQ3_K: Can(gpu_expand=True, gpu_token=True, cpu_native="plain"),
}
_NONE = Can()
_CPU_BLOCK = {Q.MXFP4: 64}  # columns the CPU kernels quantize an activation block of, where not the type's block
# the weights moe_experts.c runs many tokens of on AMX-INT8 tiles (its amx_can)
CPU_AMX_TYPES = (Q.Q4_0, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS)
CPU_ACTS = ("silu", "swiglu_oai", "silu_clamp")  # the activations ferry's CPU expert kernel computes, in moe_experts.c's ACT_* order


def cpu_block(qtype: Q) -> int:
    """The columns a row of this type must be a multiple of for ferry's CPU kernels: its block, or two of MXFP4's (one
    512-bit vector of int8 activations)."""
    return _CPU_BLOCK.get(qtype, block_size(qtype))


def can(qtype: Q) -> Can:
    """The type's abilities (a type not in the table can do none of them: ggml runs it on the CPU)."""
    return _TABLE.get(qtype, _NONE)


def can_ggml(qtype) -> bool:
    """Whether ggml knows the type (every one but ik_llama.cpp's, which ferry's own kernels read)."""
    return not isinstance(qtype, IkQuant)


def gpu_gemv_types() -> frozenset[Q]:
    return frozenset(q for q, c in _TABLE.items() if c.gpu_gemv)


def gpu_expand_types() -> frozenset[Q]:
    return frozenset(q for q, c in _TABLE.items() if c.gpu_expand)


def gpu_token_types() -> frozenset[Q]:
    return frozenset(q for q, c in _TABLE.items() if c.gpu_token)


def cpu_native_types() -> frozenset[Q]:
    return frozenset(q for q, c in _TABLE.items() if c.cpu_native)


def cpu_reads_plain(qtype: Q, ne: tuple[int, ...]) -> bool:
    """Whether ferry's CPU kernels read a weight of this type and shape (a dense matrix, or stacked experts) in its GGUF
    layout, so that a repacked copy would go unread where they run (ggml repacks MXFP4, which they read plain)."""
    c = can(qtype)
    return c.cpu_native == "plain" and c.cpu_linear == "plain" and len(ne) >= 2 and ne[0] % cpu_block(qtype) == 0 \
        and ne[1] % 8 == 0


def cpu_linear_types() -> frozenset[Q]:
    return frozenset(q for q, c in _TABLE.items() if c.cpu_linear)


def cpu_native_linear(w, repacked=None) -> str:
    """Why ferry's CPU matrix kernel cannot run this dense weight (anything with qtype and ne), "" where it can on a
    CPU it was built for. `repacked(w)`: whether ggml holds a repacked copy of it (None: where cpu_repack says)."""
    kind = can(w.qtype).cpu_linear
    if not kind:
        covers = ", ".join(sorted(q.name for q in cpu_linear_types()))
        return f"it is {w.qtype.name}; the kernel covers {covers}"
    if len(w.ne) != 2 or w.ne[0] % cpu_block(w.qtype) or w.ne[1] % 8:
        return f"its shape {tuple(w.ne)} is not whole blocks of 8 rows"
    if kind == "repacked" and not (repacked or (lambda t: cpu_repack(t.qtype, t.ne)))(w):
        return "it reads ggml's repacked copy of this type, and there is none (--no-repack)"
    return ""


def gpu_reads(qtypes) -> bool:
    """Whether the GPU's quantized kernels read all these types in place (no expansion)."""
    return all(can(q).gpu_gemv for q in qtypes)


def gpu_holds(qtypes, biased: bool = False) -> bool:
    """Whether the GPU keeps some of a layer's experts of these types (the rest in RAM) and reads them for a token
    without expanding: the split kernels read them all, or kquant.py's all (a Q4_K_M file's Q4_K and Q6_K), which add
    no biases (`biased`: the experts have some)."""
    qtypes = list(qtypes)
    return gpu_reads(qtypes) or (not biased and all(can(q).gpu_token for q in qtypes))


# a block of 256 values in kernels/cuda/krows.py's rows (dense Q4_K / Q5_K / Q6_K on a GPU): its quants, its
# sub-block scales (and mins) one byte each, its f16 d (and dmin); each row padded to 16 bytes
KROWS_BLOCK_BYTES = {Q.Q4_K: 148, Q.Q5_K: 180, Q.Q6_K: 210}


def krows_row_bytes(qtype: Q, cols: int) -> int:
    """The bytes of one row of `cols` columns in krows.py's rows, padded to 16."""
    return (cols // 256 * KROWS_BLOCK_BYTES[qtype] + 15) // 16 * 16


def gpu_nbytes(t) -> int:
    """The bytes a weight (anything with qtype, ne and nbytes) takes where a GPU holds it: a dense Q4_K / Q5_K / Q6_K
    matrix in krows.py's rows (up to 2.8% more), every other as in the file."""
    if t.qtype not in KROWS_BLOCK_BYTES or len(t.ne) != 2 or t.ne[0] % 256:
        return t.nbytes
    return t.ne[1] * krows_row_bytes(t.qtype, t.ne[0])


def gpu_dense(qtype: Q) -> bool:
    """Whether a matmul weight of this type can cross PCIe and run on the GPU: as floats, read in place, or expanded."""
    c = can(qtype)
    return c.gpu_float or c.gpu_expand


def cpu_repack(qtype: Q, ne: tuple[int, ...]) -> bool:
    """Whether ggml has an interleaved CPU layout for this type and shape (asked of ggml once per pair)."""
    from ferry.kernels.cpu.ggml import has_repack_layout

    return has_repack_layout(qtype, tuple(ne))


def cpu_native_experts(up, gate, down, act: str, repacked=None) -> str:
    """Why ferry's CPU kernel cannot run one token's routed experts of these stacked tensors (anything with qtype and
    ne), "" where it can on a CPU it was built for. `repacked(tensor)`: whether ggml holds a repacked copy of it (a
    run asks its CPU backend; None: ggml repacks where cpu_repack says, as with -rtr, the default)."""
    if act not in CPU_ACTS:
        return f"its activation is {act}; the kernel computes {', '.join(CPU_ACTS)}"
    if gate.qtype != up.qtype:
        return "gate and up differ in type"
    kinds = {t.qtype: can(t.qtype).cpu_native for t in (up, down)}
    other = sorted(q.name for q, kind in kinds.items() if not kind)
    if other:
        covers = ", ".join(sorted(q.name for q in cpu_native_types()))
        return f"these experts are {', '.join(other)}; it covers {covers}"
    n_embd, n_ff = up.ne[0], up.ne[1]
    if n_embd % cpu_block(up.qtype) or n_ff % cpu_block(down.qtype) or n_embd % 8 or n_ff % 8:
        return (f"their rows ({n_embd}, {n_ff}) are not whole blocks of the kernel's {cpu_block(up.qtype)} / "
                f"{cpu_block(down.qtype)} columns and 8 rows")
    held = repacked or (lambda t: cpu_repack(t.qtype, t.ne))
    if not all(can(t.qtype).cpu_native == "plain" or held(t) for t in (up, gate, down)):
        return "it reads ggml's repacked copy of these types, and there is none (--no-repack)"
    return ""
