"""ferry's own CPU kernels (C beside this file), compiled for this machine at first use and kept in the cache.

So far the routed experts, of one token or of many, for Q4_0 and Q4_K weights in ggml's repacked layouts and Q5_K,
Q6_K and IQ4_XS weights in their plain ones (moe_experts.c): at one token it reads them faster than ggml's mul_mat_id
(benchmarks/expert_reads.py; docs/decisions.md), at many it reads each expert once per tile of its tokens; dense
weights; and attention over a float16 cache (Attention). Where no C compiler works, the CPU lacks AVX512-VNNI, or
FERRY_NATIVE=0, `library()` is None (`why_not()` says why) and ggml runs all of these."""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import ggml
import numpy as np
import torch

from ferry.config import Settings, settings
from ferry.kernels.activations import SILU_CLAMP_LIMIT, SWIGLU_OAI
from ferry.kernels.capabilities import CPU_ACTS

_SOURCE = Path(__file__).with_name("moe_experts.c")
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
_built: dict[tuple, ctypes.CDLL | str] = {}  # (cache_dir, cflags) -> the loaded library, or why there is none


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            return next((line for line in fh if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


def _compile(s: Settings) -> Path:
    """The shared library for this source, compiler, flags and CPU, built once into Settings.cache_dir (written whole,
    then renamed)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise OSError("no C compiler (cc) on PATH")
    flags = _FLAGS + list(s.native_cflags)
    source = _SOURCE.read_bytes()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256(source + " ".join([cc, version, *flags, _cpu_flags()]).encode()).hexdigest()[:16]
    target = s.cache_dir / f"native-{key}.so"
    if target.exists():
        return target
    s.cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=s.cache_dir) as tmp:
        built = Path(tmp) / "lib.so"
        r = subprocess.run([cc, *flags, "-o", str(built), str(_SOURCE), "-lm"], capture_output=True, text=True,
                           timeout=300)
        if r.returncode != 0:
            raise OSError(f"{cc} failed: {(r.stderr or r.stdout).strip().splitlines()[-1:]}")
        os.replace(built, target)
    return target


def _load(s: Settings) -> ctypes.CDLL | str:
    """The compiled kernels, or why they are unavailable: built and loaded once per process and build settings."""
    key = (s.cache_dir, s.native_cflags)
    if key not in _built:
        try:
            lib = ctypes.CDLL(str(_compile(s)))
            lib.ferry_moe_scratch.restype = ctypes.c_size_t
            lib.ferry_moe_scratch.argtypes = [ctypes.c_int] * 5
            p, i = ctypes.c_void_p, ctypes.c_int
            lib.ferry_moe_experts.restype = ctypes.c_int
            f = ctypes.c_float
            lib.ferry_moe_experts.argtypes = [p, p, p, i, i, i, i, p, p, p, i, i, p, p, i, i, f, f, p, p, p]
            lib.ferry_moe_batch_scratch.restype = ctypes.c_size_t
            lib.ferry_moe_batch_scratch.argtypes = [ctypes.c_int] * 7
            lib.ferry_moe_batch.restype = ctypes.c_int
            lib.ferry_moe_batch.argtypes = [p, p, p, i, i, i, i, i, p, p, p, i, i, p, p, i, i, f, f, p, p, p]
            lib.ferry_linear_scratch.restype = ctypes.c_size_t
            lib.ferry_linear_scratch.argtypes = [i, i, i]
            lib.ferry_linear.restype = ctypes.c_int
            lib.ferry_linear.argtypes = [p, i, ctypes.c_int64, p, i, i, i, p, ctypes.c_int64, p, i]
            lib.ferry_repack_q8_0.restype = None
            lib.ferry_repack_q8_0.argtypes = [p, p, ctypes.c_int64, ctypes.c_int64, i]
            lib.ferry_ggml_linear_size.restype = ctypes.c_size_t
            if lib.ferry_ggml_linear_size() != ctypes.sizeof(_GgmlLinear):
                raise OSError("moe_experts.c's ferry_ggml_linear and native.py's _GgmlLinear differ")
            lib.ferry_ggml_moe_size.restype = ctypes.c_size_t
            if lib.ferry_ggml_moe_size() != ctypes.sizeof(_GgmlMoe):
                raise OSError("moe_experts.c's ferry_ggml_moe and native.py's _GgmlMoe differ")
            lib.ferry_ggml_attention_size.restype = ctypes.c_size_t
            if lib.ferry_ggml_attention_size() != ctypes.sizeof(_GgmlAttention):
                raise OSError("moe_experts.c's ferry_ggml_attention and native.py's _GgmlAttention differ")
            i64 = ctypes.c_int64
            lib.ferry_attention_scratch.restype = ctypes.c_size_t
            lib.ferry_attention_scratch.argtypes = [i, i]
            lib.ferry_attention.restype = ctypes.c_int
            lib.ferry_attention.argtypes = [p, i64, i64, p, i64, i64, p, i64, i64, p, i64, p, p, i, i, i, i, i, i, i,
                                            i, ctypes.c_float, i]
            lib.ferry_amx.restype = i
            lib.ferry_amx.argtypes = [i]
            lib.ferry_amx(int(s.amx))
            lib.ferry_phases.restype = None
            lib.ferry_phases.argtypes = [i, p]
            lib.ferry_ik_to_q8_0.restype = i64
            lib.ferry_ik_to_q8_0.argtypes = [p, p, i64, i64, i, i, i, i]
            _built[key] = lib
        except (OSError, subprocess.SubprocessError) as e:
            _built[key] = f"ferry's CPU kernels did not build ({e})"
    return _built[key]


ACTS = {name: i for i, name in enumerate(CPU_ACTS)}  # moe_experts.c's ACT_SILU, ACT_SWIGLU_OAI, ACT_SILU_CLAMP


class _Extras(ctypes.Structure):
    """moe_experts.c's expert_extras: the activation (gpt-oss's alpha and limit) and the biases' addresses (0: none)."""
    _fields_ = [("act", ctypes.c_int), ("alpha", ctypes.c_float), ("limit", ctypes.c_float),
                ("up", ctypes.c_void_p), ("gate", ctypes.c_void_p), ("down", ctypes.c_void_p)]


class _GgmlMoe(ctypes.Structure):
    """moe_experts.c's ferry_ggml_moe: a layer's fixed operands of the graph node, and where ggml_tensor keeps the
    fields the node reads."""
    _fields_ = [("up", ctypes.c_void_p), ("gate", ctypes.c_void_p), ("down", ctypes.c_void_p),
                ("n_embd", ctypes.c_int), ("n_ff", ctypes.c_int), ("n_expert", ctypes.c_int), ("n_used", ctypes.c_int),
                ("up_type", ctypes.c_int), ("down_type", ctypes.c_int), ("scratch", ctypes.c_void_p),
                ("barrier", ctypes.c_void_p), ("off_ne", ctypes.c_int64), ("off_nb", ctypes.c_int64),
                ("off_src", ctypes.c_int64), ("off_data", ctypes.c_int64), ("ex", _Extras)]


class _GgmlLinear(ctypes.Structure):
    """moe_experts.c's ferry_ggml_linear: a dense weight's fixed operands of the graph node."""
    _fields_ = [("w", ctypes.c_void_p), ("type", ctypes.c_int), ("m", ctypes.c_int), ("k", ctypes.c_int),
                ("scratch", ctypes.c_void_p), ("barrier", ctypes.c_void_p), ("off_ne", ctypes.c_int64),
                ("off_nb", ctypes.c_int64), ("off_src", ctypes.c_int64), ("off_data", ctypes.c_int64)]


class _GgmlAttention(ctypes.Structure):
    """moe_experts.c's ferry_ggml_attention: the node's scale, whether it reads sinks, the cache's types."""
    _fields_ = [("scale", ctypes.c_float), ("with_sinks", ctypes.c_int), ("type_k", ctypes.c_int),
                ("type_v", ctypes.c_int), ("scratch", ctypes.c_void_p),
                ("barrier", ctypes.c_void_p), ("off_ne", ctypes.c_int64), ("off_nb", ctypes.c_int64),
                ("off_src", ctypes.c_int64), ("off_data", ctypes.c_int64)]


def _offsets() -> tuple[int, int, int, int]:
    """Where ggml_tensor keeps ne, nb, src and data: the C side reads a node's operands through them."""
    t = ggml.ggml_tensor
    return t.ne.offset, t.nb.offset, t.src.offset, t.data.offset


def _aligned(size: int) -> tuple[np.ndarray, int]:
    """A buffer of `size` bytes and its first 64-byte aligned address."""
    buf = np.empty(size + 64, dtype=np.uint8)
    return buf, buf.ctypes.data + (-buf.ctypes.data) % 64


class _Scratch:
    """One growing 64-byte aligned buffer that graph nodes find through `where`, the address of a pointer to it: a
    graph built for more tokens grows it (before any graph runs again), and every node reads the pointer at each run."""

    def __init__(self):
        self.buf: np.ndarray | None = None
        self.slot = (ctypes.c_void_p * 1)()
        self.where = ctypes.addressof(self.slot)

    def grow(self, size: int) -> None:
        if self.buf is None or self.buf.nbytes < size + 64:
            self.buf, self.slot[0] = _aligned(size)


def library(s: Settings | None = None) -> ctypes.CDLL | None:
    """The compiled kernels, or None (why_not() says why): with Settings.native_kernels off (FERRY_NATIVE=0), where no
    C compiler works, or where the CPU lacks the instructions they are written for."""
    lib = compiled(s)
    return lib if lib is not None and lib.ferry_moe_fast() else None


def amx(s: Settings | None = None) -> bool:
    """Whether many tokens' weights of the types CPU_AMX_TYPES lists run on AMX-INT8 tiles here: the CPU has them,
    Linux lets the process use them, and Settings.amx (FERRY_AMX) was on when the kernels loaded (or use_amx turned
    them on since)."""
    lib = library(s)
    return lib is not None and bool(lib.ferry_amx(-1))


PHASES = ("quantize", "sort", "gather", "up", "glu", "down", "sum", "wait")  # moe_experts.c's PH_*, in order


def phases(on: bool, s: Settings | None = None) -> np.ndarray | None:
    """The many-token expert calls' time per thread and phase (PHASES) since the last call, in ns (threads x phases,
    every row of a thread that ran), then timing on or off from now; None where the kernels do not run."""
    lib = library(s)
    if lib is None:
        return None
    out = np.zeros((256, len(PHASES)), dtype=np.int64)
    lib.ferry_phases(int(on), out.ctypes.data)
    ran = np.flatnonzero(out.any(axis=1))
    return out[:ran[-1] + 1 if ran.size else 1]


def use_amx(on: bool, s: Settings | None = None) -> bool:
    """AMX on or off for this process from now (the kernels' tests and A/B runs take both paths); returns amx()."""
    lib = library(s)
    return lib is not None and bool(lib.ferry_amx(int(on)))


def compiled(s: Settings | None = None) -> ctypes.CDLL | None:
    """The compiled C file whatever this CPU's instructions (its portable functions: ik_to_q8_0), or None with
    Settings.native_kernels off or no working C compiler."""
    s = s or settings()
    lib = _load(s) if s.native_kernels else None
    return lib if isinstance(lib, ctypes.CDLL) else None


def kernel_id(s: Settings | None = None) -> str:
    """Which CPU kernels run ferry's matmuls here: "ggml", or "ferry-" and the hash of this source (a calibration
    that measured others is stale)."""
    s = s or settings()
    if library(s) is None:
        return "ggml"
    return "ferry-" + hashlib.sha256(_SOURCE.read_bytes()).hexdigest()[:12] + ("-amx" if amx(s) else "")


def why_not(s: Settings | None = None) -> str:
    """Why library() is None ("" where it is not), for `ferry plan` and verbose runs."""
    s = s or settings()
    if not s.native_kernels:
        return "FERRY_NATIVE=0"
    lib = _load(s)
    if not isinstance(lib, ctypes.CDLL):
        return lib
    return "" if lib.ferry_moe_fast() else "this CPU lacks AVX512-VNNI, which ferry's expert kernel is written for"


def ik_in_place(s: Settings | None = None) -> frozenset[int]:
    """ik_llama.cpp's types a file's routed experts stay in (GGUFFile's ik_in_place): those the expert kernel reads
    (quant.IkQuant), where it runs; every other tensor of ik's types is rewritten at load as Q8_0."""
    from ferry.quant import IkQuant

    return frozenset(int(t) for t in IkQuant) if library(s) is not None else frozenset()


def ik_to_q8_0(raw: np.ndarray, raw_type: int, rows: int, n: int, s: Settings | None = None) -> np.ndarray | None:
    """ik_llama.cpp's rows (a type quant.IK_RUN_AS names) as Q8_0 blocks by moe_experts.c, on every core (None where
    it did not build; quant.ik_to_q8_0, numpy, is what it is tested against). Returns None too where a scale is
    beyond fp16, for numpy to name."""
    from ferry.quant import IK_TYPES

    lib = compiled(s)
    if lib is None:
        return None
    _, _, block_bytes, meta = IK_TYPES[raw_type]
    out = np.empty(rows * (n // 32) * 34, dtype=np.uint8)
    raw = np.ascontiguousarray(raw)
    bad = lib.ferry_ik_to_q8_0(raw.ctypes.data, out.ctypes.data, rows, n, raw_type, meta, block_bytes,
                               torch.get_num_threads())
    return out if bad == 0 else None


class MoeExperts:
    """Routed experts of one shape, types and activation through moe_experts.c, with its scratch memory kept: one
    token's (ferry_moe_experts) or many tokens' (ferry_moe_batch). up_type: the up and gate matrices' ggml type number,
    down_type: the down matrices'; act: "silu", "swiglu_oai" (gpt-oss's, with activations.SWIGLU_OAI) or "silu_clamp" (DeepSeek-V4's, with
    activations.SILU_CLAMP_LIMIT)."""

    def __init__(self, lib: ctypes.CDLL, n_embd: int, n_ff: int, up_type: int, down_type: int, n_threads: int,
                 n_threads_batch: int | None = None, act: str = "silu"):
        self.lib, self.n_embd, self.n_ff, self.n_threads = lib, n_embd, n_ff, n_threads
        self.n_threads_batch = n_threads_batch or n_threads  # many tokens' threads (-tb)
        self.up_type, self.down_type = up_type, down_type
        self.act = (ACTS[act], SWIGLU_OAI[0], SILU_CLAMP_LIMIT if act == "silu_clamp" else SWIGLU_OAI[1])
        self._scratch: dict[tuple, tuple[np.ndarray, int]] = {}  # (kind, n_used) -> its buffer and aligned address
        self._barrier = np.zeros(16, dtype=np.int32)  # the graph nodes' spin barrier (they run one at a time)
        self._nodes = _Scratch()  # the graph nodes' scratch

    def _scratch_for(self, n: int, n_used: int, n_expert: int) -> int:
        """A 64-byte aligned buffer for n tokens (one token's sized once: a layer's call on the decode path asks nothing
        of the library; many tokens' grown to the largest batch and kept)."""
        if n == 1:
            key, size = (1, n_used), None
        else:
            key = ("batch", n_used)
            size = self.lib.ferry_moe_batch_scratch(n, n_used, self.n_embd, self.n_ff, n_expert, self.up_type,
                                                    self.down_type)
        held = self._scratch.get(key)
        if held is None or (size is not None and held[0].nbytes < size + 64):
            if size is None:
                size = self.lib.ferry_moe_scratch(self.n_embd, self.n_ff, n_used, self.up_type, self.down_type)
            held = self._scratch[key] = _aligned(size)
        return held[1]

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, up: int, gate: int, down: int,
                 n_expert: int, out: torch.Tensor, biases: tuple[int, int, int] = (0, 0, 0)) -> torch.Tensor:
        """x (n, n_embd) float32, ids (n, n_used) int32, weights (n, n_used) float32, contiguous; up, gate, down: the
        addresses of the stacked expert tensors in the layout of their type (PLAIN or ggml's repacked); out (n,
        n_embd) float32; biases: the addresses of up's, gate's and down's (n_expert, rows) float32 biases, 0 where a
        matrix has none. Over one token every id must name an expert; over many, an id of -1 adds nothing (an expert
        computed elsewhere)."""
        n, n_used = ids.shape
        scratch = self._scratch_for(n, n_used, n_expert)
        if n == 1:
            failed = self.lib.ferry_moe_experts(x.data_ptr(), ids.data_ptr(), weights.data_ptr(), n_used, self.n_embd,
                                                self.n_ff, n_expert, up, gate, down, self.up_type, self.down_type,
                                                out.data_ptr(), scratch, self.n_threads, *self.act, *biases)
        else:
            failed = self.lib.ferry_moe_batch(x.data_ptr(), ids.data_ptr(), weights.data_ptr(), n, n_used,
                                              self.n_embd, self.n_ff, n_expert, up, gate, down, self.up_type,
                                              self.down_type, out.data_ptr(), scratch, self.n_threads_batch,
                                              *self.act, *biases)
        if failed:
            bad = sorted(set(ids[(ids < (0 if n == 1 else -1)) | (ids >= n_expert)].tolist()))
            raise ValueError(f"expert ids {bad} are not all below {n_expert}")
        return out

    def node(self, ctx, x, ids, weights, up: int, gate: int, down: int, n_expert: int, keep: list,
             biases: tuple[int, int, int] = (0, 0, 0)):
        """The experts as a node of a ggml graph (ggml_custom_4d, run by ggml's threads): x (n_embd, n) float32, ids
        (>= n_used, n) int32 (top_k's view), weights (n_used, n) float32, rows at their strides; up, gate, down and
        biases as for __call__. Returns the (n_embd, n) float32 node; what it reads stays alive in `keep` (the
        graph's). Its scratch is this kernel's one buffer, grown to the largest graph built: every graph and layer
        shares it, as they run one at a time, and reads where it is at each run."""
        n, n_used = x.contents.ne[1], weights.contents.ne[0]
        self._nodes.grow(self.lib.ferry_moe_batch_scratch(n, n_used, self.n_embd, self.n_ff, n_expert, self.up_type,
                                                          self.down_type))
        fixed = _GgmlMoe(up, gate, down, self.n_embd, self.n_ff, n_expert, n_used, self.up_type, self.down_type,
                         self._nodes.where, self._barrier.ctypes.data, *_offsets(), _Extras(*self.act, *biases))
        fun = ggml.ggml_custom_op_t(ctypes.cast(self.lib.ferry_moe_ggml, ctypes.c_void_p).value)
        args = (ctypes.POINTER(ggml.ggml_tensor) * 3)(x, ids, weights)
        keep += [fixed, fun, args, self._nodes, self._barrier]
        return ggml.ggml_custom_4d(ctx, ggml.GGML_TYPE_F32, self.n_embd, n, 1, 1, args, 3, fun, -1,
                                   ctypes.addressof(fixed))


def repack_q8_0(lib: ctypes.CDLL, data: np.ndarray, rows: int, cols: int, n_threads: int) -> np.ndarray:
    """Plain Q8_0 rows in the layout ferry's kernels read (8 rows interleaved, bytes XOR 0x80), 64-byte aligned."""
    buf, at = _aligned(data.nbytes)
    lib.ferry_repack_q8_0(data.ctypes.data, at, rows, cols, n_threads)
    offset = at - buf.ctypes.data
    return buf[offset:offset + data.nbytes]


class Dense:
    """Dense weights through moe_experts.c's matrix kernel (ferry_linear): y = W x for n rows, W in the layout of its
    type (capabilities.cpu_native_linear), with the activations' scratch grown to the largest call and kept."""

    def __init__(self, lib: ctypes.CDLL, n_threads: int, n_threads_batch: int):
        self.lib, self.n_threads, self.n_threads_batch = lib, n_threads, n_threads_batch
        self._eager, self._nodes = _Scratch(), _Scratch()  # the calls' scratch and the graph nodes', as MoeExperts'
        self._barrier = np.zeros(16, dtype=np.int32)

    def __call__(self, x: torch.Tensor, w: int, qtype: int, m: int, out: torch.Tensor) -> torch.Tensor:
        """x (n, k) float32 contiguous, w: the weight's address, out (n, m) float32."""
        n, k = x.shape
        threads = self.n_threads if n == 1 else self.n_threads_batch
        self._eager.grow(self.lib.ferry_linear_scratch(n, k, qtype))
        if self.lib.ferry_linear(x.data_ptr(), n, k, w, qtype, m, k, out.data_ptr(), m, self._eager.slot[0], threads):
            raise ValueError(f"ferry's matrix kernel does not take a {m} x {k} weight of type {qtype}")
        return out

    def node(self, ctx, x, w: int, qtype: int, m: int, keep: list):
        """y = W x as a node of a ggml graph: x (k, n) float32 rows at their stride -> (m, n) float32."""
        k, n = x.contents.ne[0], x.contents.ne[1]
        self._nodes.grow(self.lib.ferry_linear_scratch(n, k, qtype))
        fixed = _GgmlLinear(w, qtype, m, k, self._nodes.where, self._barrier.ctypes.data, *_offsets())
        fun = ggml.ggml_custom_op_t(ctypes.cast(self.lib.ferry_linear_ggml, ctypes.c_void_p).value)
        args = (ctypes.POINTER(ggml.ggml_tensor) * 1)(x)
        keep += [fixed, fun, args, self._nodes, self._barrier]
        return ggml.ggml_custom_4d(ctx, ggml.GGML_TYPE_F32, m, n, 1, 1, args, 1, fun, -1, ctypes.addressof(fixed))


class Attention:
    """Attention over a float16 or Q8_0 cache through moe_experts.c (ferry_attention): softmax(scale q k^T + mask) v
    for each query row and head, heads sharing key heads (GQA), with gpt-oss's sinks; head sizes up to MAX_DIM, in
    multiples of 16 (float16) or 32 (Q8_0) (`reads`). ggml's flash attention runs the rest. Where (key head, heads,
    queries) give fewer units of work than threads (a decode step), each unit's keys are split between threads and the
    parts combined."""

    MAX_DIM = 256
    # (query, head) rows of a key head below which ggml's kernel is the faster: a key block's conversion is shared by
    # the rows (benchmarks/cpu_attention.py, 2 threads: Gemma 3's decode step, 4 rows, 0.85x ggml's; Qwen3's, 8, 1.75x)
    MIN_ROWS = 8

    def __init__(self, lib: ctypes.CDLL, n_threads: int):
        self.lib, self.n_threads = lib, n_threads
        self._nodes = _Scratch()  # the graph nodes' partial results where they split the keys (decode steps)
        self._barrier = np.zeros(16, dtype=np.int32)

    @classmethod
    def reads(cls, d: int, d_v: int, type_k: int, type_v: int) -> bool:
        """Whether the kernel takes keys of d and values of d_v values of these ggml types."""
        step = {ggml.GGML_TYPE_F16: 16, ggml.GGML_TYPE_Q8_0: 32}
        return all(t in step and 0 < x <= cls.MAX_DIM and x % step[t] == 0 for x, t in ((d, type_k), (d_v, type_v)))

    @classmethod
    def pays(cls, n: int, n_head: int, n_kv_head: int) -> bool:
        """Whether n queries of n_head heads over n_kv_head key heads give each key head rows enough (MIN_ROWS)."""
        return n * (n_head // n_kv_head) >= cls.MIN_ROWS

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                 sinks: torch.Tensor | None, scale: float, d_v: int | None = None, type_k: int = ggml.GGML_TYPE_F16,
                 type_v: int = ggml.GGML_TYPE_F16) -> torch.Tensor:
        """q (n, n_head, d) float32; k (n_kv, n_kv_head, ...) and v (n_kv, n_kv_head, ...): float16 values (v's last
        size d_v), or the bytes of Q8_0 rows of d and d_v values (type_k, type_v); mask (n, n_kv) float16 or None;
        sinks (n_head) float32 or None -> (n, n_head, d_v)."""
        n, n_head, d = q.shape
        n_kv, n_kv_head = k.shape[:2]
        d_v = d_v or v.shape[2]
        out = torch.empty(n, n_head, d_v, dtype=torch.float32)
        b = lambda t, i: t.stride(i) * t.element_size()  # noqa: E731
        failed = self.lib.ferry_attention(
            q.data_ptr(), b(q, 0), b(q, 1), k.data_ptr(), b(k, 0), b(k, 1), v.data_ptr(), b(v, 0), b(v, 1),
            None if mask is None else mask.data_ptr(), 0 if mask is None else b(mask, 0),
            None if sinks is None else sinks.data_ptr(), out.data_ptr(), n, n_kv, n_head, n_kv_head, d, d_v, type_k,
            type_v, scale, self.n_threads)
        if failed:
            raise ValueError(f"ferry's attention kernel does not take heads of {d} / {d_v} values")
        return out

    def node(self, ctx, q, keys, values, mask, sinks, scale: float, n_threads: int, keep: list):
        """As a node of a ggml graph run by n_threads threads: q (d, n_head, n) float32, keys (d, n_kv, n_kv_head) and
        values (d_v, n_kv, n_kv_head) views of the cache (`reads` their types), the mask (n_kv, n) float16, sinks
        (n_head) float32 or None -> (d_v, n_head, n) float32."""
        self._nodes.grow(self.lib.ferry_attention_scratch(n_threads, values.contents.ne[0]))
        fixed = _GgmlAttention(scale, sinks is not None, keys.contents.type, values.contents.type, self._nodes.where,
                               self._barrier.ctypes.data, *_offsets())
        fun = ggml.ggml_custom_op_t(ctypes.cast(self.lib.ferry_attention_ggml, ctypes.c_void_p).value)
        srcs = [q, keys, values, mask] + ([sinks] if sinks is not None else [])
        args = (ctypes.POINTER(ggml.ggml_tensor) * len(srcs))(*srcs)
        keep += [fixed, fun, args, self._nodes, self._barrier]
        return ggml.ggml_custom_4d(ctx, ggml.GGML_TYPE_F32, values.contents.ne[0], q.contents.ne[1], q.contents.ne[2],
                                   1, args, len(srcs), fun, -1, ctypes.addressof(fixed))
