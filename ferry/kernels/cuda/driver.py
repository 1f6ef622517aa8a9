"""The process's CUDA runtime (libcudart, loaded by torch) and driver (libcuda) through ctypes, for the calls torch does
not expose: asynchronous copies issued in a microsecond, graph launches, stream memory operations."""

from __future__ import annotations

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
