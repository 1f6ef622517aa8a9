"""Open, validate and memory-map GGUF files (split files too): the only code that parses GGUF bytes.

gguf-py's GGUFReader takes 20 s on a 262k-token vocabulary and reports corrupt headers as
generic exceptions, so the header is parsed here, strictly, with gguf-py's tables (value types,
quant block sizes). Every count and length is checked against the bytes left in the file before
anything is read or allocated, so a hostile header cannot make us allocate more than the file holds.
"""

from __future__ import annotations

import mmap
import os
import re
import struct
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from ferry.errors import FerryError
from ferry.kernels.capabilities import can
from ferry.quant import (IK_INTERLEAVED, IK_NOTE, IK_RUN_AS, IK_TYPES, IkQuant, ik_deinterleave, ik_to_q8_0,
                         ik_type_bytes, row_bytes)

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
_IK_READ = ", ".join(IK_TYPES[t][0] for t in [*IK_RUN_AS, *IK_INTERLEAVED])
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_KEY_BYTES = 1 << 16
MAX_NAME_BYTES = 256
MAX_ARRAY_NESTING = 3
MAX_ELEMENTS = 1 << 62
SPLIT_RE = re.compile(r"^(?P<prefix>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")

# (struct format, numpy dtype) per scalar value type
_SCALARS: dict[GGUFValueType, tuple[str, str]] = {
    GGUFValueType.UINT8: ("<B", "<u1"),
    GGUFValueType.INT8: ("<b", "<i1"),
    GGUFValueType.UINT16: ("<H", "<u2"),
    GGUFValueType.INT16: ("<h", "<i2"),
    GGUFValueType.UINT32: ("<I", "<u4"),
    GGUFValueType.INT32: ("<i", "<i4"),
    GGUFValueType.FLOAT32: ("<f", "<f4"),
    GGUFValueType.BOOL: ("<?", "?"),
    GGUFValueType.UINT64: ("<Q", "<u8"),
    GGUFValueType.INT64: ("<q", "<i8"),
    GGUFValueType.FLOAT64: ("<d", "<f8"),
}
# smallest encoding of one array element of each type, to bound counts before reading
_MIN_ELEMENT_BYTES = {t: struct.calcsize(f) for t, (f, _) in _SCALARS.items()}
_MIN_ELEMENT_BYTES[GGUFValueType.STRING] = 8
_MIN_ELEMENT_BYTES[GGUFValueType.ARRAY] = 12


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's entry: `ne` is in ggml order (ne[0] is the contiguous row length)."""

    name: str
    ne: tuple[int, ...]
    qtype: GGMLQuantizationType
    offset: int  # absolute byte offset inside its part's file
    nbytes: int  # its bytes as qtype
    part: int
    ik_type: int = 0  # ik_llama.cpp's type it is stored in, rewritten as qtype when read (0: stored as qtype)
    file_bytes: int = 0  # its bytes in the file, where ik_type is set
    interleaved: int = 0  # ik_llama.cpp's interleaved type the file holds it in, de-interleaved into ik_type's (or
    # qtype's) rows when read (quant.IK_INTERLEAVED)

    @property
    def stored_bytes(self) -> int:
        return self.file_bytes or self.nbytes

    @property
    def stored_as(self) -> str:
        """The type the file holds it in: qtype's name, or ik_llama.cpp's."""
        if self.interleaved or self.ik_type:
            return IK_TYPES[self.interleaved or self.ik_type][0]
        return self.qtype.name

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.ne, dtype=np.int64))

    @property
    def row_bytes(self) -> int:
        return row_bytes(self.qtype, self.ne[0])


@dataclass
class _Part:
    path: Path
    size: int
    mm: mmap.mmap | None
    version: int = 0
    metadata: dict[str, Any] = field(default_factory=dict)
    tensors: list[TensorInfo] = field(default_factory=list)
    # ik_llama.cpp's tensors, where the reader asked to keep them (GGUFFile(..., ik=True)): name -> (raw type, ne,
    # absolute offset, bytes); None: such a tensor is refused
    foreign: dict[str, tuple[int, tuple[int, ...], int, int]] | None = None


class _Cursor:
    """Bounds-checked little-endian reads from one part's bytes."""

    def __init__(self, buf: mmap.mmap | bytes, size: int, path: Path):
        self.buf, self.size, self.path, self.pos = buf, size, path, 0

    def fail(self, what: str) -> FerryError:
        return FerryError(f"{self.path}: {what} (at byte {self.pos}); the file is corrupt or not a GGUF model, re-download or re-convert it")

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise self.fail(f"header is truncated or corrupt: {what} needs {n} bytes, {self.size - self.pos} are left")

    def scalar(self, vtype: GGUFValueType, what: str) -> Any:
        fmt = _SCALARS[vtype][0]
        n = struct.calcsize(fmt)
        self.need(n, what)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return v

    def u32(self, what: str) -> int:
        return self.scalar(GGUFValueType.UINT32, what)

    def u64(self, what: str) -> int:
        return self.scalar(GGUFValueType.UINT64, what)

    def string(self, what: str, limit: int | None = None) -> str:
        n = self.u64(f"length of {what}")
        if limit is not None and n > limit:
            raise self.fail(f"absurd length {n} for {what} (limit {limit})")
        self.need(n, what)
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            # token texts of byte-level vocabularies may hold partial UTF-8; keep them lossless
            return raw.decode("utf-8", errors="surrogateescape")

    def value_type(self, what: str) -> GGUFValueType:
        raw = self.u32(f"value type of {what}")
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise self.fail(f"unknown value type {raw} for {what}") from None

    def value(self, vtype: GGUFValueType, what: str, depth: int = 0) -> Any:
        if vtype == GGUFValueType.STRING:
            return self.string(what)
        if vtype != GGUFValueType.ARRAY:
            return self.scalar(vtype, what)
        if depth >= MAX_ARRAY_NESTING:
            raise self.fail(f"arrays nested deeper than {MAX_ARRAY_NESTING} in {what}")
        etype = self.value_type(f"elements of {what}")
        count = self.u64(f"element count of {what}")
        if count * _MIN_ELEMENT_BYTES[etype] > self.size - self.pos:
            raise self.fail(f"absurd element count {count} for {what}: the rest of the file cannot hold it")
        if etype in _SCALARS:
            dtype = np.dtype(_SCALARS[etype][1])
            arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).copy()
            self.pos += count * dtype.itemsize
            return arr
        return [self.value(etype, what, depth + 1) for _ in range(count)]


def _align(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


def _own_pages(a: np.ndarray) -> np.ndarray:
    """A copy made at load, moved into pages of its own (an anonymous mapping) as flat bytes: the GPU's streamer
    page-locks the pages a weight lies in, and a heap allocation shares its first and last pages with other objects,
    which malloc may hand back to the system while they are locked (a later unlock then fails, and torch reports
    that failure at its next launch)."""
    buf = mmap.mmap(-1, max(a.nbytes, 1))
    out = np.frombuffer(buf, dtype=np.uint8, count=a.nbytes)
    out[:] = a.reshape(-1).view(np.uint8)
    return out


def _rewritten(t: TensorInfo) -> TensorInfo:
    """A tensor stored in one of ik_llama.cpp's types (qtype its raw type or IkQuant, nbytes its bytes in the file) as
    the llama.cpp type it is rewritten into when read (quant.IK_RUN_AS)."""
    qtype = IK_RUN_AS[int(t.qtype)]
    block, type_size = GGML_QUANT_SIZES[qtype]
    return replace(t, qtype=qtype, nbytes=t.n_elements // block * type_size, ik_type=int(t.qtype), file_bytes=t.nbytes)


ROUTED_EXPERTS = re.compile(r"\.ffn_(up|gate|down)_exps\.weight$")  # where ik_in_place applies


def _parse_part(path: Path, index: int, ik: bool = False, ik_in_place: frozenset[int] = frozenset()) -> _Part:
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise FerryError(f"{path}: no such file; check the model path") from None
    except OSError as e:
        raise FerryError(f"{path}: cannot read ({e.strerror}); check the path and its permissions") from None
    if path.is_dir():
        raise FerryError(f"{path}: is a folder; pass the .gguf file inside it")
    if size < 4:
        raise FerryError(f"{path}: not a GGUF file ({size} bytes); pass a .gguf model file")
    with open(path, "rb") as fh:
        mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    part = _Part(path=path, size=size, mm=mm, foreign={} if ik else None)
    cur = _Cursor(mm, size, path)
    magic = bytes(mm[:4])
    if magic != GGUF_MAGIC:
        mm.close()
        raise FerryError(f"{path}: not a GGUF file (starts with {magic!r}, expected b'GGUF'); pass a .gguf model file")
    cur.pos = 4
    part.version = cur.u32("version")
    if part.version not in SUPPORTED_VERSIONS:
        mm.close()
        raise FerryError(f"{path}: unsupported GGUF version {part.version} (ferry reads versions 2 and 3); re-convert the model with a current llama.cpp")
    try:
        _parse_header(cur, part, index, ik_in_place)
    except FerryError:
        mm.close()
        raise
    return part


def _parse_header(cur: _Cursor, part: _Part, index: int, ik_in_place: frozenset[int]) -> None:
    n_tensors = cur.u64("tensor count")
    n_kv = cur.u64("metadata count")
    left = part.size - cur.pos
    if n_kv * 14 > left:  # smallest key/value: 8-byte length, 1-byte key, 4-byte type, 1-byte value
        raise cur.fail(f"absurd metadata count {n_kv}: the file cannot hold that many entries")
    if n_tensors * 33 > left:  # smallest tensor entry: name, 1 dim, type, offset
        raise cur.fail(f"absurd tensor count {n_tensors}: the file cannot hold that many entries")
    for _ in range(n_kv):
        key = cur.string("metadata key", limit=MAX_KEY_BYTES)
        vtype = cur.value_type(f"key '{key}'")
        value = cur.value(vtype, f"key '{key}'")
        if key in part.metadata:
            raise cur.fail(f"duplicate metadata key '{key}'")
        part.metadata[key] = value
    alignment = part.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise cur.fail(f"general.alignment must be a power of two, got {alignment!r}")
    raw_infos, foreign = [], []
    for i in range(n_tensors):
        name = cur.string(f"name of tensor {i}", limit=MAX_NAME_BYTES)
        n_dims = cur.u32(f"dimension count of tensor '{name}'")
        if not 1 <= n_dims <= MAX_DIMS:
            raise cur.fail(f"tensor '{name}' has {n_dims} dimensions (1 to {MAX_DIMS} allowed)")
        ne = tuple(cur.u64(f"dimensions of tensor '{name}'") for _ in range(n_dims))
        n_elements = 1
        for d in ne:
            if d == 0 or d >= MAX_ELEMENTS:
                raise cur.fail(f"tensor '{name}' has an absurd shape {list(ne)}")
            n_elements *= d
            if n_elements >= MAX_ELEMENTS:
                raise cur.fail(f"tensor '{name}' has an absurd shape {list(ne)}")
        raw_type = cur.u32(f"type of tensor '{name}'")
        try:
            qtype = GGMLQuantizationType(raw_type)
            block, type_size = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            if (raw_type in IK_RUN_AS or raw_type in IK_INTERLEAVED) and part.foreign is None:  # read as a llama.cpp
                # type (quant.ik_to_q8_0) or in place, de-interleaved first where ik interleaved rows
                if ne[0] % IK_TYPES[raw_type][1]:
                    raise cur.fail(f"tensor '{name}' row length {ne[0]} is not a multiple of the "
                                   f"{IK_TYPES[raw_type][0]} block size {IK_TYPES[raw_type][1]}") from None
                foreign.append((name, ne, raw_type, cur.u64(f"data offset of tensor '{name}'")))
                continue
            if raw_type in IK_TYPES and part.foreign is not None:  # kept apart, for a reader that asked for them
                if ne[0] % IK_TYPES[raw_type][1]:
                    raise cur.fail(f"tensor '{name}' row length {ne[0]} is not a multiple of the "
                                   f"{IK_TYPES[raw_type][0]} block size {IK_TYPES[raw_type][1]}") from None
                foreign.append((name, ne, raw_type, cur.u64(f"data offset of tensor '{name}'")))
                continue
            if raw_type in IK_TYPES:  # a valid file, of the other engine: not "corrupt"
                raise FerryError(
                    f"{cur.path}: tensor '{name}' is {IK_TYPES[raw_type][0]} (type {raw_type}), one of ik_llama.cpp's "
                    f"own quant types, which ferry does not read yet (of ik's types it reads {_IK_READ}); run this "
                    "file with ik_llama.cpp, or requantize the model to a llama.cpp type (e.g. Q4_K_M) with "
                    "llama-quantize") from None
            raise cur.fail(f"tensor '{name}' has unknown quant type {raw_type}; this file needs a newer reader than gguf-py provides here") from None
        if ne[0] % block:
            raise cur.fail(f"tensor '{name}' row length {ne[0]} is not a multiple of the {qtype.name} block size {block}")
        offset = cur.u64(f"data offset of tensor '{name}'")
        if offset % alignment:
            raise cur.fail(f"tensor '{name}' data offset {offset} is not aligned to {alignment} bytes")
        raw_infos.append((name, ne, qtype, offset, n_elements // block * type_size))
    data_start = _align(cur.pos, alignment)
    for name, ne, raw_type, offset in foreign:
        nbytes = ik_type_bytes(raw_type, ne)
        if data_start + offset + nbytes > part.size:
            raise FerryError(f"{part.path}: file is truncated: '{name}' needs bytes up to "
                             f"{data_start + offset + nbytes}, the file has {part.size}; re-download the model")
        if part.foreign is not None:
            part.foreign[name] = (raw_type, ne, data_start + offset, nbytes)
            continue
        plain, interleaved = IK_INTERLEAVED.get(raw_type, raw_type), raw_type if raw_type in IK_INTERLEAVED else 0
        if interleaved and int(np.prod(ne[1:])) % 4:
            raise FerryError(f"{part.path}: tensor '{name}' is {IK_TYPES[raw_type][0]} over {int(np.prod(ne[1:]))} "
                             "rows, not a multiple of the 4 it interleaves; the file is corrupt, re-download it")
        t = TensorInfo(name, ne, plain, data_start + offset, nbytes, index, interleaved=interleaved)
        if plain not in IK_TYPES:  # one of llama.cpp's types, once de-interleaved: read as that type
            part.tensors.append(replace(t, qtype=GGMLQuantizationType(plain)))
        elif plain in ik_in_place and ROUTED_EXPERTS.search(name):
            part.tensors.append(replace(t, qtype=IkQuant(plain)))
        else:
            part.tensors.append(_rewritten(t))
    for name, ne, qtype, offset, nbytes in raw_infos:
        start = data_start + offset
        if start + nbytes > part.size:
            raise FerryError(
                f"{part.path}: file is truncated or tensor data lies past its end: '{name}' needs bytes up to "
                f"{start + nbytes}, the file has {part.size}; re-download the model")
        part.tensors.append(TensorInfo(name, ne, qtype, start, nbytes, index))
    by_offset = sorted(part.tensors, key=lambda t: t.offset)
    for a, b in zip(by_offset, by_offset[1:]):
        if b.offset < a.offset + a.stored_bytes:
            raise FerryError(f"{part.path}: tensors '{a.name}' and '{b.name}' overlap in the file; the file is corrupt, re-convert it")


def split_paths(path: Path) -> list[Path]:
    """All parts of a split model (`name-00001-of-00003.gguf`), given any one of them."""
    m = SPLIT_RE.match(path.name)
    if not m:
        return [path]
    count = int(m["count"])
    if count < 1:
        raise FerryError(f"{path}: split count 0 in the file name; pass the first part of a split model")
    return [path.with_name(f"{m['prefix']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


class GGUFFile:
    """A validated, memory-mapped GGUF model: metadata from the first part, tensors from all parts."""

    def __init__(self, path: str | os.PathLike, ik: bool = False, ik_in_place: frozenset[int] = frozenset()):
        """Tensors of ik_llama.cpp's quant types ferry reads are rewritten as Q8_0 when read (data), but routed experts
        of the types in ik_in_place, which stay as they are (qtype an IkQuant; kernels/cpu/native.ik_in_place says which
        ferry's kernels read here). ik: keep every such tensor apart (ik_tensor) instead."""
        self.path = Path(path)
        paths = split_paths(self.path)
        self._parts: list[_Part] = []
        try:
            for i, p in enumerate(paths):
                if not p.exists() and len(paths) > 1:
                    raise FerryError(f"{p}: missing part {i + 1} of a split model ({len(paths)} parts); put all parts in one folder")
                self._parts.append(_parse_part(p, i, ik, ik_in_place))
            self._check_split()
        except BaseException:
            self.close()
            raise
        self.metadata: dict[str, Any] = self._parts[0].metadata
        self.version = self._parts[0].version
        self.tensors: dict[str, TensorInfo] = {}
        self._rewritten: dict[str, np.ndarray] = {}
        for part in self._parts:
            for t in part.tensors:
                if t.name in self.tensors:
                    self.close()
                    raise FerryError(f"{part.path}: tensor '{t.name}' appears twice; the file is corrupt, re-convert it")
                self.tensors[t.name] = t
        self._rewrite_mixed_layers()

    def _rewrite_mixed_layers(self) -> None:
        """A layer's routed experts stay in ik_llama.cpp's type only where ferry's kernel reads all three matrices (it
        takes a layer's experts whole: up and gate of one type, each a type it reads, as IQ4_KS with a Q5_K down);
        elsewhere they are rewritten as Q8_0."""
        layers: dict[str, list[TensorInfo]] = {}
        for t in self.tensors.values():
            m = ROUTED_EXPERTS.search(t.name)
            if m:
                layers.setdefault(t.name[:m.start()], []).append(t)
        for experts in layers.values():
            by = {ROUTED_EXPERTS.search(t.name).group(1): t.qtype for t in experts}
            if len(by) == 3 and by["up"] == by["gate"] and all(can(q).cpu_native for q in by.values()):
                continue
            for t in experts:
                if isinstance(t.qtype, IkQuant):
                    self.tensors[t.name] = _rewritten(t)

    def rewrite(self, names) -> None:
        """Tensors kept in ik_llama.cpp's types (routed experts ferry's CPU kernel reads in place) rewritten as Q8_0
        after all, as the others are: those a placement puts on the GPU, whose kernels read Q8_0's blocks in place."""
        for name in names:
            t = self.tensors[name]
            if isinstance(t.qtype, IkQuant):
                self.tensors[name] = _rewritten(t)

    def _check_split(self) -> None:
        n = len(self._parts)
        declared = self._parts[0].metadata.get("split.count", 1 if n == 1 else None)
        if n > 1 and declared != n:
            raise FerryError(f"{self._parts[0].path}: file name says {n} parts but split.count is {declared}; the split is inconsistent")
        if n == 1 and declared not in (None, 1, 0):
            raise FerryError(f"{self.path}: this is part of a split model ({declared} parts) but its name lacks '-0000N-of-0000M'; pass the first part with its original name")
        for i, part in enumerate(self._parts):
            no = part.metadata.get("split.no", 0)
            if n > 1 and no != i:
                raise FerryError(f"{part.path}: split.no is {no}, expected {i}; the split parts are mixed up")
        expected = self._parts[0].metadata.get("split.tensors.count")
        total = sum(len(p.tensors) for p in self._parts)
        if expected is not None and int(expected) != total:
            raise FerryError(f"{self.path}: split.tensors.count is {expected} but the parts hold {total} tensors; a part is missing or corrupt")

    # ---- metadata access -------------------------------------------------------------------

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str) or not arch:
            raise FerryError(f"{self.path}: no general.architecture in the metadata; the file is not a model, re-convert it")
        return arch

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str, kind: type | tuple[type, ...] = (int, float, str)) -> Any:
        if key not in self.metadata:
            raise FerryError(f"{self.path}: metadata key '{key}' is missing; re-convert the model with a current llama.cpp")
        value = self.metadata[key]
        if isinstance(value, np.ndarray) and value.ndim == 1 and len(value) > 0 and kind in (int, float):
            return value  # per-layer arrays (e.g. head counts) are handled by the caller
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise FerryError(f"{self.path}: metadata key '{key}' has the wrong type ({type(value).__name__}); the file is corrupt")
        return value

    # ---- tensor access ---------------------------------------------------------------------

    def tensor(self, name: str) -> TensorInfo:
        t = self.tensors.get(name)
        if t is None:
            raise FerryError(f"{self.path}: tensor '{name}' is missing; the file does not match its architecture '{self.architecture}'")
        return t

    def ik_tensors(self) -> list[str]:
        """The names of the tensors of ik_llama.cpp's quant types (a file opened with ik=True)."""
        return [name for part in self._parts for name in (part.foreign or {})]

    def ik_tensor(self, name: str) -> tuple[int, tuple[int, ...], np.ndarray]:
        """A tensor of one of ik_llama.cpp's quant types (a file opened with ik=True): (its raw type, ne, its bytes
        over the mmap)."""
        for part in self._parts:
            if part.foreign and name in part.foreign:
                raw_type, ne, offset, nbytes = part.foreign[name]
                return raw_type, ne, np.frombuffer(part.mm, dtype=np.uint8, count=nbytes, offset=offset)
        raise KeyError(name)

    def data(self, t: TensorInfo | str) -> np.ndarray:
        """The tensor's raw bytes as a read-only uint8 array over the mmap (no copy); a tensor stored in one of
        ik_llama.cpp's types comes as its qtype's blocks, rewritten once (quant.ik_to_q8_0) and kept."""
        if isinstance(t, str):
            t = self.tensor(t)
        stored = np.frombuffer(self._parts[t.part].mm, dtype=np.uint8, count=t.stored_bytes, offset=t.offset)
        if not t.ik_type and not t.interleaved:
            return stored
        if t.name not in self._rewritten:
            from ferry.kernels.cpu import native  # the rewrite in C where it builds

            if t.interleaved:
                stored = ik_deinterleave(stored, t.interleaved, t.ne)
                if not t.ik_type:  # read in place: its rows as the plain type stores them
                    self._rewritten[t.name] = _own_pages(stored)
                    return self._rewritten[t.name]
            rows = t.n_elements // t.ne[0]
            fast = native.ik_to_q8_0(stored, t.ik_type, rows, t.ne[0])
            self._rewritten[t.name] = _own_pages(fast if fast is not None else ik_to_q8_0(stored, t.ik_type, t.ne))
        return self._rewritten[t.name]

    def ik_lines(self) -> list[str]:
        """What happens to this file's tensors of ik_llama.cpp's types, one line per type (for the load and `ferry
        info`): rewritten as Q8_0 (bytes in the file, in RAM), read in place by ferry's CPU kernel, or (interleaved
        forms of llama.cpp's types) de-interleaved into that type's rows."""
        lines = []
        for name in sorted({t.stored_as for t in self.tensors.values() if t.ik_type}):
            of = [t for t in self.tensors.values() if t.ik_type and t.stored_as == name]
            note = IK_NOTE[IK_TYPES[of[0].ik_type][0]] + (", its rows de-interleaved" if of[0].interleaved else "")
            lines.append(f"{len(of)} tensor{'s' * (len(of) != 1)} in ik_llama.cpp's {name} "
                         f"({sum(t.stored_bytes for t in of) / 2**30:.2f} GiB) run as Q8_0 "
                         f"({sum(t.nbytes for t in of) / 2**30:.2f} GiB of RAM; {note})")
        in_place = [t for t in self.tensors.values() if isinstance(t.qtype, IkQuant)]
        for name in sorted({t.stored_as for t in in_place}):
            of = [t for t in in_place if t.stored_as == name]
            how = (f"de-interleaved at load into {of[0].qtype.name}'s rows (as many bytes of RAM) and "
                   if of[0].interleaved else "")
            lines.append(f"{len(of)} routed-expert tensor{'s' * (len(of) != 1)} in ik_llama.cpp's {name} "
                         f"({sum(t.nbytes for t in of) / 2**30:.2f} GiB) {how}read in place by ferry's CPU kernel "
                         "(and the GPU's, where it keeps some)")
        plain = [t for t in self.tensors.values() if t.interleaved and not t.ik_type and not isinstance(t.qtype, IkQuant)]
        for name in sorted({t.stored_as for t in plain}):
            of = [t for t in plain if t.stored_as == name]
            lines.append(f"{len(of)} tensor{'s' * (len(of) != 1)} in ik_llama.cpp's {name} "
                         f"({sum(t.nbytes for t in of) / 2**30:.2f} GiB) de-interleaved at load into "
                         f"{of[0].qtype.name}'s rows (as many bytes of RAM)")
        return lines

    @property
    def ik_stored(self) -> dict[str, tuple[int, int, int]]:
        """ik_llama.cpp's types this file stores tensors in that are copied into RAM at load (rewritten, or
        de-interleaved): name -> (tensor count, bytes in the file, bytes as run)."""
        out: dict[str, tuple[int, int, int]] = {}
        for t in self.tensors.values():
            if t.ik_type or t.interleaved:
                n, stored, run = out.get(t.stored_as, (0, 0, 0))
                out[t.stored_as] = (n + 1, stored + t.stored_bytes, run + t.nbytes)
        return out

    @property
    def n_bytes(self) -> int:
        return sum(p.size for p in self._parts)

    @property
    def paths(self) -> list[Path]:
        return [p.path for p in self._parts]

    def close(self) -> None:
        for part in self._parts:
            if part.mm is not None:
                try:
                    part.mm.close()
                except BufferError:
                    pass  # numpy views still alive; the mapping goes with them
                part.mm = None

    def __enter__(self) -> "GGUFFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
