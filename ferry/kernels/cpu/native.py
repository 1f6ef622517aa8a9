"""ferry's own CPU kernels (C beside this file), compiled for this machine at first use and kept in the cache.

So far one: a token's routed experts for Q4_0 and Q4_K weights in ggml's repacked layouts and Q6_K weights in their
plain one (moe_experts.c), which reads them faster than ggml's mul_mat_id at one token (benchmarks/expert_reads.py;
docs/decisions.md). Where no C compiler works, the CPU lacks AVX512-VNNI, or FERRY_NATIVE=0, `library()` is None
(`why_not()` says why) and ggml runs those experts."""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import torch

from ferry.config import Settings, settings

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
            lib.ferry_moe_experts.argtypes = [p, p, p, i, i, i, i, p, p, p, i, i, p, p, i]
            _built[key] = lib if lib.ferry_moe_fast() else (
                "this CPU lacks AVX512-VNNI, which ferry's expert kernel is written for")
        except (OSError, subprocess.SubprocessError) as e:
            _built[key] = f"ferry's CPU kernels did not build ({e})"
    return _built[key]


def library(s: Settings | None = None) -> ctypes.CDLL | None:
    """The compiled kernels, or None (why_not() says why): with Settings.native_kernels off (FERRY_NATIVE=0), where no
    C compiler works, or where the CPU lacks the instructions they are written for."""
    s = s or settings()
    lib = _load(s) if s.native_kernels else None
    return lib if isinstance(lib, ctypes.CDLL) else None


def why_not(s: Settings | None = None) -> str:
    """Why library() is None ("" where it is not), for `ferry plan` and verbose runs."""
    s = s or settings()
    if not s.native_kernels:
        return "FERRY_NATIVE=0"
    lib = _load(s)
    return "" if isinstance(lib, ctypes.CDLL) else lib


class MoeExperts:
    """One token's routed experts of one shape and types through moe_experts.c, with its scratch memory kept.
    up_type: the up and gate matrices' ggml type number, down_type: the down matrices'."""

    def __init__(self, lib: ctypes.CDLL, n_embd: int, n_ff: int, up_type: int, down_type: int, n_threads: int):
        self.lib, self.n_embd, self.n_ff, self.n_threads = lib, n_embd, n_ff, n_threads
        self.up_type, self.down_type = up_type, down_type
        self._scratch: dict[int, tuple[np.ndarray, int]] = {}  # n_used -> its buffer and 64-byte aligned address

    def _scratch_for(self, n_used: int) -> int:
        if n_used not in self._scratch:  # sized once: a layer's call on the decode path asks nothing of the library
            size = self.lib.ferry_moe_scratch(self.n_embd, self.n_ff, n_used, self.up_type, self.down_type)
            buf = np.empty(size + 64, dtype=np.uint8)
            self._scratch[n_used] = buf, buf.ctypes.data + (-buf.ctypes.data) % 64
        return self._scratch[n_used][1]

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, up: int, gate: int, down: int,
                 n_expert: int, out: torch.Tensor) -> torch.Tensor:
        """x (1, n_embd) float32, ids (1, n_used) int32, weights (1, n_used) float32, contiguous; up, gate, down: the
        addresses of the stacked expert tensors in the layout of their type (PLAIN or ggml's repacked); out (1,
        n_embd) float32."""
        n_used = ids.shape[-1]
        if self.lib.ferry_moe_experts(x.data_ptr(), ids.data_ptr(), weights.data_ptr(), n_used, self.n_embd, self.n_ff,
                                      n_expert, up, gate, down, self.up_type, self.down_type, out.data_ptr(),
                                      self._scratch_for(n_used), self.n_threads):
            raise ValueError(f"expert ids {ids.tolist()} are not all below {n_expert}")
        return out
