"""Writing GGUF files with gguf-py's GGUFWriter: streamed tensor by tensor, and atomic (a temporary
file renamed into place only once complete, so a failed write never leaves a partial model)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
from gguf import GGUFWriter
from gguf.constants import GGMLQuantizationType, GGUFValueType

from ferry.quant import IkQuant, row_bytes
from ferry.files import atomic_file


@dataclass
class TensorSpec:
    """A tensor to write: `ne` in ggml order; `make()` returns its raw bytes when its turn comes."""

    name: str
    qtype: GGMLQuantizationType
    ne: tuple[int, ...]
    make: Callable[[], np.ndarray]

    @property
    def nbytes(self) -> int:
        return row_bytes(self.qtype, self.ne[0]) * int(np.prod(self.ne[1:], dtype=np.int64))


def _add_value(w: GGUFWriter, key: str, value: Any) -> None:
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value) if 0 <= value < 2**32 else w.add_int64(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    elif isinstance(value, np.ndarray) and value.dtype == np.int32:
        w.add_key_value(key, value.tolist(), GGUFValueType.ARRAY, GGUFValueType.INT32)
    elif isinstance(value, (list, tuple, np.ndarray)):
        w.add_array(key, list(value))
    else:
        raise TypeError(f"cannot write metadata {key}={value!r}")


def write_gguf(path: Path, arch: str, metadata: dict[str, Any], tensors: Iterable[TensorSpec],
               on_tensor: Callable[[TensorSpec], None] | None = None, shape_only: bool = False) -> None:
    """Write a GGUF atomically: metadata (general.architecture from `arch`), then each tensor in order. shape_only:
    every tensor's bytes zero, as a sparse file that takes no disk and no time to write (its `make` is not called):
    a model's shape for `ferry plan` and `ferry info`."""
    path = Path(path)
    tensors = list(tensors)
    with atomic_file(path) as tmp:
        w = GGUFWriter(None, arch)
        for key, value in metadata.items():
            _add_value(w, key, value)
        for t in tensors:
            if isinstance(t.qtype, IkQuant):  # a type gguf-py has no sizes for: its shape in values, not bytes
                w.add_tensor_info(t.name, tuple(reversed(t.ne)), np.dtype(np.float32), t.nbytes, raw_dtype=t.qtype)
                continue
            byte_shape = (*reversed(t.ne[1:]), row_bytes(t.qtype, t.ne[0]))
            w.add_tensor_info(t.name, byte_shape, np.dtype(np.uint8), t.nbytes, raw_dtype=t.qtype)
        w.write_header_to_file(tmp)
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        if shape_only:
            w.close()
            align = w.data_alignment
            start = GGUFWriter.ggml_pad(tmp.stat().st_size, align)
            os.truncate(tmp, start + sum(GGUFWriter.ggml_pad(t.nbytes, align) for t in tensors))
            return
        for t in tensors:
            data = np.ascontiguousarray(t.make()).view(np.uint8).reshape(-1)
            if data.nbytes != t.nbytes:
                raise ValueError(f"tensor {t.name}: made {data.nbytes} bytes, expected {t.nbytes}")
            w.write_tensor_data(data)
            if on_tensor:
                on_tensor(t)
        w.close()
