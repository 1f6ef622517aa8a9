"""CPU-resident weights on their way to the GPU: their mmap pages registered as page-locked memory where they lie
(cudaHostRegister, read-only: no second copy in RAM), copies on a side stream into reused GPU staging buffers, and
events the compute stream waits on, so copies overlap compute.

A stacked expert tensor is staged into a buffer with a slot for every expert: only the experts a u-batch routes
to are copied (runs of neighbours as one copy), into one compact buffer shared by every tensor, then spread to their
slots in the split Q8_0 / Q4_0 / MXFP4 layout the GPU kernels read (layout.Split), by a kernel on a third stream: on
the copy stream it made every later copy wait until the compute stream's kernels left it room to run. One set of
slots serves every layer: a layer's spreading waits until the compute stream has released the layer before, while its
copies, the long part, run beside that layer's compute; so streaming holds a layer and one tensor of GPU memory, which
the fit gives to experts kept on the GPU instead (docs/decisions.md, "One staging set for streamed experts"). Experts
of the other types (K-quants, IQ4_XS, ...: those ggml-style files hold most) stay as copied, their GGUF blocks in the
order of the experts copied (Compact), in a compact buffer of each staging set: the few-token kernels read K-quants
there in place, and a prompt expands one projection at a time to bfloat16 for torch's grouped GEMM
(CudaBackend.held_pairs), in the scratch the GPU's own such experts use. Their two staging sets alternate between MoE
layers, so one layer's copies can run while the previous layer still computes."""

from __future__ import annotations

import mmap
from dataclasses import dataclass

import torch

from ferry.kernels.cuda.driver import cudart_library

from ferry.placement import EXPERTS_RE, expert_runs  # noqa: F401 (tests and the staging below)
from ferry.weight import Weight

_READ_ONLY = 8  # cudaHostRegisterReadOnly: the mmap is mapped read-only
_H2D, _D2H = 1, 2  # cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost
PAGE = mmap.PAGESIZE


def page_ranges(weights: list[Weight]) -> list[tuple[int, int]]:
    """The page-aligned address ranges the weights' bytes lie in, overlapping and touching ones merged."""
    spans = sorted((w.data.ctypes.data // PAGE * PAGE, -(-(w.data.ctypes.data + w.data.nbytes) // PAGE) * PAGE)
                   for w in weights if w.data.nbytes)
    merged: list[list[int]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def _clear_last_cuda_error() -> None:
    """A failed cudaHostRegister leaves the runtime's last-error set, and torch's next kernel launch check would
    report it as its own failure: read it once."""
    lib = cudart_library()
    if lib is not None:
        lib.cudaGetLastError()


@dataclass
class Compact:
    """Staged experts of a type the GPU's split kernels do not read: w (layout.Blocks) the experts copied, in that
    order; slot_of (n_expert,) int32 on the GPU: each expert's place in w, -1 where it was not copied."""

    w: object
    slot_of: torch.Tensor


class Streamer:
    def __init__(self, device: torch.device, weights: list[Weight]):
        self.device = device
        self.copy_stream = torch.cuda.Stream(device)
        self.unpack_stream = torch.cuda.Stream(device)
        self._unpacked: dict[int, torch.cuda.Event] = {}  # compact buffer -> the unpack that reads it last
        self._host: dict[int, torch.Tensor] = {}
        self._splits: dict[tuple, object] = {}  # (slot, role, qtype, ne) -> a Split with a slot per expert
        self._slot_of: dict[object, torch.Tensor] = {}  # slot -> Compact.slot_of of the experts staged there
        # the bytes of each compact buffer a staging set holds for experts it leaves as they land: the largest
        # stacked expert tensor's
        self._compact = max((w.data.nbytes for w in weights if EXPERTS_RE.match(w.name)), default=0)
        self._raw: dict[tuple, torch.Tensor] = {}  # compact buffers copies land in (stream-ordered: shared by slots)
        self._rows: dict[tuple, tuple[torch.Tensor, torch.Tensor, int]] = {}  # see _expert_rows
        self._released: dict[object, torch.cuda.Event] = {}
        self._last_release: torch.cuda.Event | None = None  # the newest release(): the split slots are free after it
        self._registered: list[int] = []
        # the registered arrays, alive while their pages are: a copy made at load (de-interleaved, rewritten) freed
        # while still registered would leave a stale registration where the next allocation lands, and copies from
        # there fail (cudaErrorInvalidValue)
        self._kept: list = []
        self.bytes_copied = 0
        # one cudaMemcpyAsync through ctypes costs ~1 us of host time, a torch copy_ ~10: a u-batch that hits 100
        # scattered experts issues 300 copies, and the host issues them while its cores should be computing
        self._lib = cudart_library()
        self.pinned, self.why = self._register(weights)

    def _register(self, weights: list[Weight]) -> tuple[bool, str]:
        """Page-lock the weights' pages in place; on failure copies still work, from pageable memory (7x slower
        here), and `why` says so."""
        cudart = torch.cuda.cudart()
        ranges = page_ranges(weights)
        for start, end in ranges:
            rc = cudart.cudaHostRegister(start, end - start, _READ_ONLY)
            if int(rc) != 0:
                self.close()
                _clear_last_cuda_error()
                return False, (f"cudaHostRegister failed ({rc}): copies come from pageable memory; "
                               "check `ulimit -l` and free RAM")
            self._registered.append(start)
        self._kept = [w.data for w in weights]
        total = sum(e - s for s, e in ranges)
        return True, f"{total / 2 ** 30:.2f} GiB of mmap pages registered in {len(ranges)} ranges"

    def close(self) -> None:
        cudart = torch.cuda.cudart()
        while self._registered:
            cudart.cudaHostUnregister(self._registered.pop())
        self._kept = []
        _clear_last_cuda_error()  # an unlock that failed must not surface as torch's next launch's error

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def host(self, w: Weight) -> torch.Tensor:
        """The weight's bytes in the mmap as a uint8 CPU tensor (no copy)."""
        t = self._host.get(id(w))
        if t is None:
            t = self._host[id(w)] = w.host_tensor()
        return t

    def _buffer(self, key: tuple, nbytes: int) -> torch.Tensor:
        t = self._raw.get(key)
        if t is None:
            t = self._raw[key] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return t

    def _split_for(self, w: Weight, key: tuple):
        from ferry.kernels.cuda.layout import Split

        s = self._splits.get(key)
        if s is None:
            s = self._splits[key] = Split.of(torch.empty(w.data.nbytes, dtype=torch.uint8, device=self.device),
                                             w.qtype, w.ne)
        return s

    def stage_experts(self, weights: list[Weight], experts: list[int], slot,
                      expand: bool = False) -> list[tuple[object, torch.cuda.Event]]:
        """Copy `experts` (sorted) of each stacked tensor to the GPU, in order, on the copy stream: per tensor, (a
        Split with those experts' slots filled, or with `expand` a Compact, the event after which they are there).
        Host time matters here (generation stages a few experts per layer): one cudaMemcpyAsync per run of
        neighbouring experts from precomputed addresses, and one kernel per tensor that spreads the blocks to their
        slots. The Splits are the one set every layer shares: the caller releases the layer before (release) before
        it stages the next, and their spreading waits for that release. expand: for a layer with any expert tensor of
        a type other than Q8_0 / Q4_0 / MXFP4, so that all three reach the GPU alike: copied into staging set
        `slot`'s own compact buffers, left as they land."""
        from ferry.kernels.cuda.layout import Blocks
        from ferry.kernels.cuda.moe import unpack_experts

        out = []
        stream, unpack = self.copy_stream, self.unpack_stream
        runs = expert_runs(experts)
        ids = torch.tensor(experts, dtype=torch.int64).pin_memory()
        slot_of = None
        with torch.cuda.stream(stream):
            if slot in self._released:  # the layer that used these slots last has finished with them
                stream.wait_event(self._released.pop(slot))
            ids = ids.to(self.device, non_blocking=True)
            ids.record_stream(unpack)
            if expand:  # one map for the layer's tensors (the same experts), written before their copies
                slot_of = self._slot_of.get(slot)
                if slot_of is None or slot_of.numel() != weights[0].ne[2]:
                    slot_of = self._slot_of[slot] = torch.empty(weights[0].ne[2], dtype=torch.int32,
                                                                device=self.device)
                slot_of.fill_(-1).index_copy_(0, ids, torch.arange(len(experts), dtype=torch.int32,
                                                                   device=self.device))
            handle = stream.cuda_stream
            for i, w in enumerate(weights):
                raw, host, per = self._expert_rows(w, (slot, i) if expand else "split", self._compact)
                if id(raw) in self._unpacked:  # its last contents spread to their slots (long done, as a rule)
                    stream.wait_event(self._unpacked[id(raw)])
                dst, src = raw.data_ptr(), host.data_ptr()
                j = 0
                for a, b in runs:
                    if self._lib is None:
                        raw[j * per:(j + b - a) * per].copy_(host[a * per:b * per], non_blocking=True)
                    elif self._lib.cudaMemcpyAsync(dst + j * per, src + a * per, (b - a) * per, _H2D, handle):
                        raise RuntimeError("cudaMemcpyAsync failed staging experts")
                    j += b - a
                self.bytes_copied += j * per
                copied = torch.cuda.Event()
                copied.record(stream)
                if expand:  # read where they landed: the slot's own buffer, free again at the slot's release
                    out.append((Compact(Blocks(w.qtype, (w.ne[0], w.ne[1], j), raw[:j * per]), slot_of), copied))
                    continue
                with torch.cuda.stream(unpack):
                    unpack.wait_event(copied)
                    if self._last_release is not None:  # the layer before has been read: its slots may change
                        unpack.wait_event(self._last_release)
                    staged = self._split_for(w, (i, w.qtype, w.ne))
                    unpack_experts(raw, ids, staged)
                    done = torch.cuda.Event()
                    done.record(unpack)
                self._unpacked[id(raw)] = done
                out.append((staged, done))
        return out

    def _expert_rows(self, w: Weight, role, nbytes: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The compact GPU buffer of role `role` that w's experts are copied into, w's bytes in the mmap (both flat
        uint8), and the bytes per expert. role: "split" (the one buffer every tensor spread to a Split lands in), or a
        staging set and a tensor's place in its layer (slot, place); each a buffer of `nbytes` whatever the tensor (a
        Q4_K_M file's downs are Q4_K in some layers, Q6_K in others: one buffer, as memory_plan counts it)."""
        entry = self._rows.get((role, id(w)))
        if entry is None:
            entry = self._rows[role, id(w)] = (self._buffer(role, nbytes), self.host(w).view(-1),
                                               w.data.nbytes // w.ne[2])
        return entry

    def stage(self, w: Weight, slot) -> tuple[torch.Tensor, torch.cuda.Event]:
        """A whole (dense) weight's GGUF bytes copied to a reused GPU buffer in staging set `slot`."""
        key = (slot, w.data.nbytes)
        stream = self.copy_stream
        with torch.cuda.stream(stream):
            if slot in self._released:
                stream.wait_event(self._released.pop(slot))
            raw = self._buffer(key, w.data.nbytes)
            self.copy_async(raw, self.host(w), stream)
            self.bytes_copied += w.data.nbytes
            done = torch.cuda.Event()
            done.record(stream)
        return raw, done

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream) -> None:
        """dst <- src on `stream`, between GPU memory and host memory (either way; pinned, or the registered mmap),
        both contiguous and of one size, both outliving the copy: one cudaMemcpyAsync, which a CUDA graph captures
        as a copy node (a torch copy_ into pinned memory also records an event for torch's host allocator)."""
        if self._lib is None:
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
            return
        nbytes = src.numel() * src.element_size()
        assert dst.numel() * dst.element_size() == nbytes and dst.is_contiguous() and src.is_contiguous()
        kind = _H2D if dst.is_cuda else _D2H
        rc = self._lib.cudaMemcpyAsync(dst.data_ptr(), src.data_ptr(), nbytes, kind, stream.cuda_stream)
        if rc != 0:
            raise RuntimeError(f"cudaMemcpyAsync failed with error {rc}")

    def release(self, slot) -> None:
        """The compute stream has been given all work that reads staging set `slot`: the next copy into it waits."""
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        self._released[slot] = self._last_release = ev

    def staging_bytes(self) -> int:
        """GPU bytes held for staging so far."""
        return sum(t.numel() for t in self._raw.values()) + sum(
            s.qs.numel() * s.qs.element_size() + s.d.numel() * s.d.element_size() for s in self._splits.values())
