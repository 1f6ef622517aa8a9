"""`ferry calibrate`: measures this machine for the offload policy (policy.Calibration): how fast the CPU reads
quantized weights (GEMV) and multiplies batches through ggml, and, where a CUDA GPU is visible, pinned
host-to-device bandwidth and latency, GPU memory bandwidth and matmul throughput. Stored per machine."""

from __future__ import annotations

import itertools
import json
import platform
import time
from pathlib import Path

import numpy as np
import torch

from ferry.config import settings
from ferry.errors import FerryError
from ferry.gguf.synth import random_tensor
from ferry.kernels.capabilities import can
from ferry.kernels.cpu import native
from ferry.offload.cost import Calibration
from ferry.quant import Q, qtype_named
from ferry.weight import Weight

def default_path() -> Path:
    """This machine's stored calibration (in Settings.cache_dir)."""
    return settings().cache_dir / f"calibration-{platform.node() or 'machine'}.json"


def _best(fn, reps: int) -> float:
    """The fastest of `reps` timed runs after one warm-up (seconds)."""
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def ggml_build() -> list[str]:
    """The CPU features ggml-python's ggml was compiled for (its ggml_cpu_has_* that say yes). The CPU's rates
    depend on them: the same Xeon ran ferry's CPU-only generation 16% faster built -march=native than with an
    explicit list of ISA flags (docs/decisions.md)."""
    import ggml

    found = []
    for name in sorted(n for n in dir(ggml) if n.startswith("ggml_cpu_has_")):
        try:
            if getattr(ggml, name)():
                found.append(name[len("ggml_cpu_has_"):])
        except (RuntimeError, AttributeError):  # not in this build's library
            pass
    return found


def stale(path: Path) -> str | None:
    """Why the stored calibration no longer describes this machine's CPU side (ggml rebuilt with other features
    since, or stored before builds were recorded); None when it still does, or when there is none."""
    try:
        cpu = json.loads(path.read_text())["cpu"]
    except (OSError, ValueError, KeyError, TypeError):
        return None  # load() says what is wrong with it
    stored, now = cpu.get("ggml_build"), ggml_build()
    if stored is None:
        return "it does not record which ggml build it measured"
    if sorted(stored) != now:
        return f"ggml was built for other CPU features since (then: {' '.join(stored)}; now: {' '.join(now)})"
    kernels, now_kernels = cpu.get("cpu_kernels"), native.kernel_id()
    if kernels != now_kernels:
        return f"ferry's CPU kernels changed since (then: {kernels or 'not recorded'}; now: {now_kernels})"
    return None


# the routed experts' quant types a full `ferry calibrate` measures (a run measures its model's others once, quickly)
EXPERT_TYPES = ("Q4_0", "Q4_K", "Q5_K", "Q6_K", "Q8_0", "IQ4_XS")


def measure_cpu(backend, quick: bool = False, on_step=None) -> dict:
    """ggml on this CPU (`backend`: a CpuBackend of the threads to measure, used here alone): Q4_0 GEMV bytes/s over a
    weight larger than the caches, Q4_0 x 512-token matmul FLOP/s, and the routed experts' tables (measure_experts:
    Q4_0 when quick, else EXPERT_TYPES); quick: fewer sizes and repetitions; on_step(done, note) after each part."""
    rng = np.random.default_rng(0)
    rows, cols = (16384, 16384) if quick else (65536, 16384)  # 151 MB / 604 MB of Q4_0: beyond the caches
    w = Weight("calibration", Q.Q4_0, (cols, rows), random_tensor(Q.Q4_0, (cols, rows), 1.0, rng))
    backend.repack(w)
    x1 = torch.randn(1, cols)
    gemv_s, gemv_bytes = _best(lambda: backend.linear(x1, w), 5), w.nbytes
    n, k, m = 512, 4096, 4096
    wb = Weight("calibration-batch", Q.Q4_0, (k, m), random_tensor(Q.Q4_0, (k, m), 1.0, rng))
    backend.repack(wb)
    xb = torch.randn(n, k)
    gemm_s = _best(lambda: backend.linear(xb, wb), 2 if quick else 3)
    if on_step:
        on_step(1, "CPU GEMV and matmul")
    return {"cpu_bytes_per_s": gemv_bytes / gemv_s, "cpu_flops": 2.0 * n * k * m / gemm_s, "threads": backend.n_threads,
            **measure_experts(backend, _expert_types(quick), quick, on_step), "ggml_build": ggml_build(),
            "cpu_kernels": native.kernel_id()}


def _expert_types(quick: bool) -> tuple[str, ...]:
    return ("Q4_0",) if quick else EXPERT_TYPES


def steps(quick: bool) -> int:
    """The parts calibrate() reports through on_step: the CPU's GEMV and matmul, each expert type, the GPU."""
    return 2 + len(_expert_types(quick))


def l3_bytes() -> int:
    """The CPU's last-level cache (0 where the system does not say)."""
    try:
        size = Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
    except OSError:
        return 0
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(size[:-1]) * units[size[-1]] if size[-1:] in units else int(size or 0)


def measure_experts(backend, qtypes, quick: bool = False, on_step=None) -> dict:
    """The CPU's routed experts of each quant type on Qwen3-30B-A3B-shaped layers (64 experts of 2048 x 768),
    repacked like a run's: {"cpu_moe": type -> ggml's table of (tokens per expert, seconds per byte of expert
    weights)}, and {"cpu_moe_token": type -> seconds per byte} for the types ferry's own kernel runs at one token (a
    token's 8 experts, a different 8 each call, every expert once per pass); each point the best of two passes.
    Each timed call runs the next of enough layers (4x the L3, 1 GiB at least) that its weights come from RAM, as a
    model's do: one 170 MB layer read again and again sat half in the H100 machine's 260 MB L3 (ggml 78.7 GB/s at
    one token per expert, against 44-48 in benchmarks/expert_reads.py; docs/performance.md, 2026-11-24)."""
    n_expert, n_used, d, ff = 64, 8, 2048, 768
    rng = np.random.default_rng(0)
    tables, token = {}, {}
    for done, name in enumerate(qtypes):
        q = qtype_named(name)
        # one random expert per matrix, copied to every slot of every layer: the rate depends on the bytes read, not
        # their values, and types without a scale field to set are quantized from floats, slowly (IQ4_XS: 100 s
        # for 64 experts)
        one = {n: (ne, random_tensor(q, ne, 1.0, rng)) for n, ne in (("up", (d, ff)), ("gate", (d, ff)),
                                                                     ("down", (ff, d)))}
        layer_bytes = n_expert * sum(b.nbytes for _, b in one.values())
        n_layers = max(2, -(-max(4 * l3_bytes(), 1 << 30) // layer_bytes))
        layers = []
        for i in range(n_layers):
            up, gate, down = (Weight(f"calibration-{i}-{n}", q, (*ne, n_expert), np.tile(b, n_expert))
                              for n, (ne, b) in one.items())
            backend.repack(up, gate, down)
            layers.append((up, gate, down))
        turn = itertools.cycle(layers)
        kernel = backend.native_experts(1, True, *layers[0], "silu") is not None
        x1, weights = torch.randn(1, d), torch.full((1, n_used), 1.0 / n_used)
        groups = torch.from_numpy(rng.permutation(n_expert).astype(np.int32)).view(-1, 1, n_used)  # each once

        def one_pass() -> None:  # a token's experts through ferry's kernel, over every expert of the next layer
            layer = next(turn)
            for g in groups:
                backend.moe_experts(x1, g, weights, *layer, "silu")

        best: dict = {}
        # two passes, each point's best: a disturbance shorter than a pass falls on one of them (on the H100 machine
        # the first seconds after writing an 18 GB file read the experts at 4.2 GB/s; docs/performance.md, 2026-11-24)
        for _ in range(2):
            for c in ((1, 4, 16, 64) if quick else (1, 2, 4, 8, 16, 32, 64, 128)):  # tokens per expert
                ids = torch.arange(n_expert, dtype=torch.int32).repeat(c).view(-1, 1)
                x = torch.randn(ids.shape[0], d)
                ones = torch.ones(ids.shape[0], 1)  # weighted, as the hybrid's CPU side runs them (ferry's kernel)
                t = _best(lambda: backend.moe_experts(x, ids, ones, *next(turn), "silu"), 3 if quick else 5)
                best[c] = min(best.get(c, t), t)
            if kernel:
                t = _best(one_pass, 3 if quick else 5)
                best["token"] = min(best.get("token", t), t)
        if on_step:
            on_step(2 + done, f"{name} routed experts")
        tables[name] = [[float(c), t / layer_bytes] for c, t in best.items() if c != "token"]
        if kernel:
            token[name] = best["token"] / layer_bytes
        del layers, turn
    return {"cpu_moe": tables, "cpu_moe_token": token}


def missing_experts(path: Path, qtypes) -> list[str]:
    """The routed experts' types this run needs that the stored calibration has not measured: no table, or no rate
    of ferry's own kernel where it now runs them (capabilities' cpu_native types, on a CPU the kernel was built for)."""
    from ferry.kernels.cpu import native

    try:
        cpu = json.loads(path.read_text())["cpu"]
    except (OSError, ValueError, KeyError, TypeError):
        return []  # load() says what is wrong with it
    tables, token = _tables(cpu.get("cpu_moe")), cpu.get("cpu_moe_token") or {}
    kernel = native.library() is not None
    return sorted(q for q in set(qtypes)
                  if q not in tables or (kernel and can(qtype_named(q)).cpu_native and q not in token))


def add_experts(path: Path, backend, qtypes) -> None:
    """Measure the routed experts of these types (quickly, with `backend`, a CpuBackend) into the stored calibration."""
    data = json.loads(path.read_text())
    got = measure_experts(backend, qtypes, quick=True)
    data["cpu"]["cpu_moe"] = {**_tables(data["cpu"].get("cpu_moe")), **got["cpu_moe"]}
    data["cpu"]["cpu_moe_token"] = {**(data["cpu"].get("cpu_moe_token") or {}), **got["cpu_moe_token"]}
    save(data, path)


def _tables(stored) -> dict:
    """The experts' tables by type; a file written by an earlier ferry holds Q4_0's alone, as a list."""
    return {"Q4_0": stored} if isinstance(stored, list) else dict(stored or {})


def measure_gpu(quick: bool = False) -> dict | None:
    """Pinned H2D bandwidth (large copies) and latency (small ones), device copy bandwidth, bf16 matmul
    FLOP/s; None without a CUDA GPU."""
    if not torch.cuda.is_available():
        return None
    dev = torch.device("cuda:0")
    size = (64 if quick else 1024) << 20
    host = torch.empty(size, dtype=torch.uint8).pin_memory()
    gpu = torch.empty(size, dtype=torch.uint8, device=dev)

    def timed(fn) -> float:
        torch.cuda.synchronize()
        return _best(lambda: (fn(), torch.cuda.synchronize()), 5)

    h2d_s = timed(lambda: gpu.copy_(host, non_blocking=True))
    small = 4096
    lat_s = timed(lambda: [gpu[:small].copy_(host[:small], non_blocking=True) for _ in range(100)]) / 100
    d2d_s = timed(lambda: gpu[size // 2:].copy_(gpu[:size // 2]))
    n = 4096 if quick else 8192
    a = torch.randn(n, n, dtype=torch.bfloat16, device=dev)
    mm_s = timed(lambda: a @ a)
    one = torch.zeros(1, device=dev)
    launch_s = timed(lambda: [one.add_(1) for _ in range(200)]) / 200
    return {"h2d_bytes_per_s": size / h2d_s, "h2d_latency_s": lat_s, "gpu_bytes_per_s": size / d2d_s,
            "gpu_flops": 2.0 * n ** 3 / mm_s, "launch_s": launch_s, "gpu_name": torch.cuda.get_device_name(0),
            **measure_steps(dev, timed)}


STEP_FIELDS = ("graph_kernel_s", "gpu_gemv_bytes_per_s", "handshake_s", "gpu_moe_flops")  # 0 in older files


def measure_steps(dev, timed) -> dict:
    """What a step's forecast (`ferry plan`) is made of, through ferry's own GPU kernels: a small Q4_0 GEMV's time
    inside a replayed CUDA graph (a decode step is hundreds of such small kernels: latency, not bandwidth), the
    bytes/s of a Q4_0 GEMV over a weight beyond the L2, a host step's handshake inside a replayed graph (a hybrid
    decode step waits at one per layer with work in RAM), and the grouped Q4_0 expert GEMM's FLOP/s at a prompt's
    32 tokens per expert (Qwen3-30B-A3B's experts, 512 tokens)."""
    from ferry.kernels.cuda import moe
    from ferry.kernels.cuda.gemv import gemv
    from ferry.kernels.cuda.layout import Split
    from ferry.kernels.cuda.driver import Handshakes

    def q4_0(*ne: int) -> Split:
        n_blocks = int(np.prod(ne)) // 32
        return Split(Q.Q4_0, ne, torch.randint(0, 256, (n_blocks, 16), dtype=torch.uint8, device=dev),
                     torch.full((n_blocks,), 0.01, dtype=torch.float16, device=dev))

    def graph_s(fn, count: int) -> float:
        """One replay of `count` calls of fn captured as a CUDA graph, per call."""
        fn()  # compiled before the capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(count):
                fn()
        return timed(g.replay) / count

    small = q4_0(2048, 512)
    x = torch.randn(1, 2048, device=dev)
    kernel_s = graph_s(lambda: gemv(small, x), 64)
    big = q4_0(16384, 16384)  # 151 MB: beyond any GPU's L2
    xb = torch.randn(1, 16384, device=dev)
    gemv_s = timed(lambda: gemv(big, xb))
    gemv_bytes = big.qs.numel() + 2 * big.d.numel()
    hs = Handshakes.of(dev)
    handshake_s = 0.0
    if hs is not None:
        count = 32
        out = torch.zeros(count, 4, device=dev)
        result = torch.ones(4).pin_memory()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for k in range(count):
                hs.record(k, out[k], result)

        def replay() -> None:
            g.replay()
            for k in range(count):
                hs.serve(k, lambda: None)
        handshake_s = _best(lambda: (replay(), torch.cuda.synchronize()), 5) / count
    n_expert, n_used, d, ff, n_tokens = 128, 8, 2048, 768, 512
    gate, up, down = q4_0(d, ff, n_expert), q4_0(d, ff, n_expert), q4_0(ff, d, n_expert)
    ids = torch.stack([torch.randperm(n_expert, device=dev)[:n_used] for _ in range(n_tokens)])
    block = moe.moe_tile_rows(n_tokens * n_used, n_expert)
    sched = moe.moe_tiles(ids, n_expert, block)
    order = sched[0].to(torch.int32)
    src = torch.div(order, n_used, rounding_mode="floor")
    tokens = torch.randn(n_tokens, d, device=dev, dtype=torch.float16)
    scale = torch.rand(n_tokens * n_used, device=dev)
    moe_s = timed(lambda: moe.moe_mm(moe.moe_mm(tokens, gate, sched, torch.float16, block, up=up, rows_from=src),
                                     down, sched, torch.float32, block, rows_to=order, row_scale=scale))
    return {"graph_kernel_s": kernel_s, "gpu_gemv_bytes_per_s": gemv_bytes / gemv_s, "handshake_s": handshake_s,
            "gpu_moe_flops": n_tokens * n_used * 3 * 2.0 * d * ff / moe_s}


def calibrate(backend, quick: bool = False, on_step=None) -> dict:
    """This machine measured: the CPU through `backend` (a CpuBackend of the threads to measure), and the GPU where
    one is visible; on_step(done, note) after each of steps(quick) parts (a progress bar)."""
    cpu = measure_cpu(backend, quick, on_step)
    gpu = measure_gpu(quick)
    if on_step:
        on_step(steps(quick), "GPU and PCIe" if gpu else "no GPU visible")
    return {"machine": platform.node(), "cpu": cpu, "gpu": gpu,
            "quick": quick, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


def save(result: dict, path: Path) -> None:
    from ferry.files import atomic_file

    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path) as tmp:
        tmp.write_text(json.dumps(result, indent=1))


def load(path: Path) -> Calibration | None:
    """The policy's view of a stored calibration; None where it has no GPU part (nothing to offload to)."""
    try:
        data = json.loads(path.read_text())
        gpu, cpu = data["gpu"], data["cpu"]
        if gpu is None:
            return None
        fields = {**{k: cpu[k] for k in ("cpu_bytes_per_s", "cpu_flops")},
                  **{k: gpu[k] for k in ("h2d_bytes_per_s", "h2d_latency_s", "gpu_bytes_per_s", "gpu_flops")}}
        fields["cpu_moe"] = {q: tuple((float(c), float(s)) for c, s in t) for q, t in _tables(cpu.get("cpu_moe")).items()}
        fields["cpu_moe_token"] = {q: float(s) for q, s in (cpu.get("cpu_moe_token") or {}).items()}
        fields["launch_s"] = float(gpu.get("launch_s", 0.0))
        fields.update({k: float(gpu[k]) for k in STEP_FIELDS if k in gpu})
    except FileNotFoundError:
        raise FerryError(f"{path}: no calibration; run `ferry calibrate`") from None
    except (ValueError, KeyError, TypeError) as e:
        raise FerryError(f"{path}: not a `ferry calibrate` result ({e}); run `ferry calibrate` again") from None
    return Calibration(**fields)


def table(result: dict) -> str:
    cpu, gpu = result["cpu"], result["gpu"]
    lines = ["| what | measured |", "| --- | --- |",
             f"| CPU Q4_0 GEMV ({cpu['threads']} threads) | {cpu['cpu_bytes_per_s'] / 1e9:.1f} GB/s of weights |",
             f"| CPU Q4_0 x 512 tokens | {cpu['cpu_flops'] / 1e12:.2f} TFLOP/s |",
             f"| ggml built for | {' '.join(cpu.get('ggml_build', [])) or 'not recorded'} |"]
    for q, t in _tables(cpu.get("cpu_moe")).items():
        lines += [f"| CPU {q} routed experts, {c:g} tokens each | {1 / spb / 1e9:.1f} GB/s of expert weights |"
                  for c, spb in t]
    for q, spb in (cpu.get("cpu_moe_token") or {}).items():
        lines.append(f"| CPU {q} routed experts, one token, ferry's kernel | {1 / spb / 1e9:.1f} GB/s of expert "
                     "weights |")
    if gpu:
        lines += [f"| H2D pinned ({gpu['gpu_name']}) | {gpu['h2d_bytes_per_s'] / 1e9:.1f} GB/s, "
                  f"{gpu['h2d_latency_s'] * 1e6:.1f} us per small copy |",
                  f"| GPU device copy | {gpu['gpu_bytes_per_s'] / 1e9:.0f} GB/s |",
                  f"| GPU bf16 matmul | {gpu['gpu_flops'] / 1e12:.0f} TFLOP/s |",
                  f"| GPU kernel launch from Python | {gpu.get('launch_s', 0) * 1e6:.1f} us |"]
        if "graph_kernel_s" in gpu:
            lines += [f"| a small Q4_0 GEMV in a CUDA graph | {gpu['graph_kernel_s'] * 1e6:.2f} us |",
                      f"| Q4_0 GEMV beyond the L2 | {gpu['gpu_gemv_bytes_per_s'] / 1e9:.0f} GB/s of weights |",
                      f"| a host step's handshake in a CUDA graph | {gpu['handshake_s'] * 1e6:.1f} us |",
                      f"| Q4_0 grouped expert GEMM, 32 tokens each | {gpu['gpu_moe_flops'] / 1e12:.0f} TFLOP/s |"]
    else:
        lines.append("| GPU | none visible: every op stays on the CPU |")
    return "\n".join(lines)
