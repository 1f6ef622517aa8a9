"""The process's CUDA runtime (libcudart, loaded by torch) and driver (libcuda) through ctypes, for the calls torch does
not expose: asynchronous copies issued in a microsecond, graph launches, stream memory operations (Handshakes: a
replayed CUDA graph and the host taking turns through page-locked words)."""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable

import torch

_CUDART: list = []  # the library once found


def cudart_library():
    """The process's libcudart (loaded by torch), for the calls torch does not expose; None if not found (yet)."""
    import ctypes

    if _CUDART:
        return _CUDART[0]
    try:
        with open("/proc/self/maps") as fh:
            lib = ctypes.CDLL(next(line.split()[-1] for line in fh if "libcudart.so" in line))
    except (OSError, StopIteration):
        return None
    lib.cudaMemcpyAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    _CUDART.append(lib)
    return lib


_DRIVER: list = []  # (the library or None) once looked for


def cuda_driver():
    """The CUDA driver library (libcuda) with the stream memory operations' entry points typed (a GPU stream
    writing or waiting on a word of memory); None where it or they are missing."""
    import ctypes

    if _DRIVER:
        return _DRIVER[0]
    lib = None
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        for name in ("cuStreamWaitValue32_v2", "cuStreamWriteValue32_v2"):
            getattr(lib, name).argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        lib.cuMemHostGetDevicePointer_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]
    except (OSError, AttributeError):
        lib = None
    _DRIVER.append(lib)
    return lib


class Handshakes:
    """Words of page-locked memory through which a replayed CUDA graph and the host take turns with no CUDA call
    between them (the driver's stream memory operations): at host step k the graph writes ready[k] = 1, waits until
    done[k] = 1, sets it back to 0 and copies the step's result in; the host, which launched the graph, reads
    ready[k] until it is set, runs the step and writes done[k]. Right after ggml's threads have run, each CUDA call
    of the host costs 30-40 us against 10 on an idle host (docs/decisions.md, "A hybrid decode step is one CUDA graph
    that waits at its host steps"): a hybrid decode step cut into a graph per layer paid a launch, a copy and a
    synchronize per MoE layer; this way it pays one launch."""

    CAPACITY = 1024  # host steps of one recording
    TIMEOUT_S = 120.0  # a host step the graph never reaches: an error, not a hang

    def __init__(self, lib, device):
        self.lib = lib
        self.device = device
        self.words = torch.zeros(2 * self.CAPACITY, dtype=torch.int32).pin_memory()
        self.host = self.words.numpy()  # ready[k] at 2k, done[k] at 2k + 1
        ptr = ctypes.c_uint64()
        if lib.cuMemHostGetDevicePointer_v2(ctypes.byref(ptr), ctypes.c_void_p(self.words.data_ptr()), 0):
            raise RuntimeError("cuMemHostGetDevicePointer failed on a page-locked buffer")
        self.base = ptr.value

    @classmethod
    def of(cls, device, enabled: bool = True) -> Handshakes | None:
        """Handshakes for recordings on `device`, or None where the driver lacks stream memory operations (or
        `enabled` is False: Settings.handshakes): steps are then cut into graphs at every host step."""
        lib = cuda_driver()
        if lib is None or cudart_library() is None or not enabled:
            return None
        return cls(lib, device)

    def record(self, k: int, out: torch.Tensor, result: torch.Tensor) -> None:
        """Capture host step k into the current graph: signal, wait, then copy `result` (page-locked, which the
        host step fills) into `out`."""
        assert out.shape == result.shape and out.dtype == result.dtype and result.is_contiguous()
        stream = ctypes.c_void_p(torch.cuda.current_stream(self.device).cuda_stream)
        ready, done = self.base + 8 * k, self.base + 8 * k + 4
        for rc in (self.lib.cuStreamWriteValue32_v2(stream, ready, 1, 0),
                   self.lib.cuStreamWaitValue32_v2(stream, done, 1, _WAIT_EQ),
                   self.lib.cuStreamWriteValue32_v2(stream, done, 0, 0),
                   cudart_library().cudaMemcpyAsync(out.data_ptr(), result.data_ptr(),
                                                    result.numel() * result.element_size(), _H2D, stream)):
            if rc != 0:
                raise RuntimeError(f"recording a host step's handshake failed with CUDA error {rc}")

    def serve(self, k: int, step: Callable[[], None]) -> None:
        """At replay: wait until the graph reaches host step k, run it, and let the graph go on."""
        words, i = self.host, 2 * k
        spins = 0
        while words[i] != 1:
            spins += 1
            if not spins & 0xFFFFF:
                if spins == 0x100000:
                    start = time.monotonic()
                elif time.monotonic() - start > self.TIMEOUT_S:
                    raise RuntimeError(f"the GPU did not reach host step {k} in {self.TIMEOUT_S:.0f} s")
        words[i] = 0
        step()
        words[i + 1] = 1

    def release(self, ks: list[int]) -> None:
        """After a host step failed: let the graph past the steps ks it would wait at, wait for it to end, and
        clear what it signalled, so that the next replay starts from clean words."""
        for k in ks:
            self.host[2 * k + 1] = 1
        torch.cuda.synchronize(self.device)
        for k in ks:
            self.host[2 * k] = 0


_WAIT_EQ = 1  # CU_STREAM_WAIT_VALUE_EQ


_H2D = 1  # cudaMemcpyHostToDevice
