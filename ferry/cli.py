"""The command line: each subcommand's flags (groups declared once, shared by run, chat, bench, sweep, ppl, serve and
plan), parsed into a RunConfig and dispatched. A user's mistake is one line on stderr and exit code 2."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from pathlib import Path

from ferry import __version__
from ferry.config import settings
from ferry.errors import FerryError
from ferry.offload.fit import FIT_CTX, FIT_TARGET_MIB
from ferry.server.reasoning import FORMATS


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad command line as one line and exit code 2, and never takes a prefix of a flag for
    the flag (`-o` is not `-ot`, `-f` is not `-fmoe`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def _get_option_tuples(self, option_string: str) -> list:
        return []  # allow_abbrev=False leaves single-dash prefixes matched on Python 3.11 (-o as -ot): no prefix at all

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _finite(text: str) -> float:
    """A float flag's value: a finite number."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a number") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"'{text}' is not a finite number")
    return v


# ---- flag groups, each declared once ------------------------------------------------------------------------------
# `lists`: bench's form of a group, where numbers are llama-bench's lists ("128,512", "128-2048*2")

def _model_flags(p: argparse.ArgumentParser, lists: bool = False) -> None:
    p.add_argument("-m", "--model", action="append" if lists else "store",
                   help="GGUF file (first part of a split model)" + (", repeatable" if lists else "") +
                        "; default: the embedded Gemma 3 270M")


def _cpu_flags(p: argparse.ArgumentParser, lists: bool = False) -> None:
    p.add_argument("-t", "--threads", type=str if lists else int, default="0" if lists else 0,
                   help="CPU threads (0: the physical cores)" + (", comma list" if lists else ""))
    if not lists:
        p.add_argument("-tb", "--threads-batch", type=int, default=0,
                       help="CPU threads for batches above one token (0: as -t)")
    p.add_argument("--no-repack", dest="repack", action="store_false",
                   help="keep CPU weights in the mmap instead of ggml's interleaved layout (-rtr is the default)")
    p.add_argument("-rtr", "--run-time-repack", dest="repack", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("-fmoe", "--fused-moe", dest="fused_moe", action="store_true", default=True,
                   help="MoE up/gate and activation as one fused op (default; ik_llama.cpp's -fmoe)")
    p.add_argument("--no-fused-moe", dest="fused_moe", action="store_false",
                   help="MoE activation and product with the up projection as separate ops")


def _mla_flags(p: argparse.ArgumentParser, lists: bool = False) -> None:
    p.add_argument("-mla", "--mla-use", dest="mla", type=str if lists else int, default=None,
                   help="DeepSeek's latent attention (ik_llama.cpp's modes): 0 caches expanded keys and values; 1 and 2 "
                        "cache the latent and attend in it; 3 (default) caches the latent, expands it for prompts and "
                        "attends in it for generation" + (", comma list" if lists else ""))
    p.add_argument("-amb", "--attention-max-batch", dest="amb", type=int, default=0,
                   help="MiB: bound on the keys and values mode 3 expands at once (0: no bound)")


def _context_flags(p: argparse.ArgumentParser, lists: bool = False, n_ctx: int = 4096, ctx_help: str = "",
                   logical_batch: bool = True) -> None:
    if not lists:
        p.add_argument("-c", "--ctx-size", type=int, default=n_ctx,
                       help=ctx_help or "context size in tokens (0: the model's)")
    if logical_batch:
        p.add_argument("-b", "--batch-size", type=str if lists else int, default="2048" if lists else 2048,
                       help="logical batch size" + (", comma list" if lists else ""))
    p.add_argument("-ub", "--ubatch-size", type=str if lists else int, default="512" if lists else 512,
                   help="physical batch (u-batch) size: the tokens one forward takes, at most -b" +
                        (", comma list" if lists else ""))
    p.add_argument("-ctk", "--cache-type-k", default="f16", help="KV cache type of keys: f16 (default), q8_0, q4_0, "
                                                                  "bf16, f32")
    p.add_argument("-ctv", "--cache-type-v", default="f16", help="KV cache type of values (same choices)")
    p.add_argument("--swa-full", action="store_true",
                   help="keep every position in the sliding-window layers' caches (gemma3, gpt-oss), as llama.cpp's "
                        "--swa-full; default: a ring of their window and a u-batch")


def _gpu_flags(p: argparse.ArgumentParser, lists: bool = False) -> None:
    p.add_argument("-ngl", "--n-gpu-layers", type=str if lists else int, default=None,
                   help="layers on the GPU (999: all; 0: the CPU alone); the rest stay in RAM. Without -ngl and -ot a "
                        "visible GPU is filled by the fit (--fit)" + (", comma list" if lists else ""))
    p.add_argument("-ot", "--override-tensor", action="append", default=[],
                   help="REGEX=DEVICE (CPU, CUDA0), repeatable, first match wins; e.g. -ot exps=CPU")
    p.add_argument("--gpu-experts", help="LAYER:EXPERTS[;...], e.g. '3:0-31,40;7:5': routed experts kept on the GPU "
                                         "in layers whose experts stay in RAM (with -ngl / -ot; Q8_0 / Q4_0 experts); "
                                         "the fit writes it from `ferry calibrate --routing`")
    p.add_argument("-ts", "--tensor-split", help="share of the GPU layers per GPU, e.g. 3,1 (default: equal over "
                                                 "every GPU when all weights are on GPUs; 1,0 keeps them on CUDA0)")
    p.add_argument("--offload-policy", default="auto",
                   help="ops on weights in RAM: auto (predicted from `ferry calibrate`, then measured), threshold, "
                        "and/or NAME=on|off|auto for mul_mat, mul_mat_id, moe_up_gate, moe_down, all")
    p.add_argument("--offload-min-batch", type=int, default=32, help="the threshold policy's batch size "
                                                                      "(llama.cpp: 32)")
    p.add_argument("--batch-order", choices=("layer-first", "ubatch-first"), default="layer-first",
                   help="with routed experts in RAM, how a logical batch (-b) of several u-batches runs: layer by "
                        "layer over all its u-batches, so each layer's experts are read once per batch (default), "
                        "or u-batch by u-batch through every layer, as llama.cpp does")
    p.add_argument("--verbose", action="store_true", help="log every offload decision, predicted and measured")
    p.add_argument("--fit", choices=("on", "off"), default="on",
                   help="without -ngl / -ot, fill the GPU by itself: every weight but the routed experts, the KV cache "
                        "(-c shrunk to fit, down to --fit-ctx), the buffers, then as many layers' routed experts as fit "
                        "(default on; off: the CPU alone unless -ngl / -ot say otherwise)")
    p.add_argument("--fit-target", default=str(FIT_TARGET_MIB), help="MiB the fit leaves free on each GPU, comma list "
                                                                     f"per GPU (default {FIT_TARGET_MIB})")
    p.add_argument("--fit-ctx", type=int, default=FIT_CTX, help=f"the context the fit may shrink -c to, no lower "
                                                                f"(default {FIT_CTX})")
    p.add_argument("--gpu-memory", action="append", default=[],
                   help="CUDA0=12GiB[,CUDA1=...]: place and plan for GPUs of these sizes (at most what is free: a "
                        "smaller GPU tried on a big one)")


def _fit_target(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise FerryError(f"--fit-target '{text}': give MiB per GPU, e.g. --fit-target 1024 or 512,2048") from None


def _sampling_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("-n", "--n-predict", type=int, default=128,
                   help="tokens to generate per answer (-1: until end of generation; -2: until the context is full)")
    p.add_argument("--temp", type=_finite, default=0.8, help="temperature (0: greedy)")
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--top-p", type=_finite, default=0.95)
    p.add_argument("--min-p", type=_finite, default=0.05)
    p.add_argument("--repeat-penalty", type=_finite, default=1.0)
    p.add_argument("--repeat-last-n", type=int, default=64, help="tokens the penalty looks back (-1: the context)")
    p.add_argument("-s", "--seed", type=int, default=-1, help="sampling seed (-1: random)")


def _chat_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("-sys", "--system-prompt", help="system prompt, through the chat template")
    p.add_argument("--chat-template", help="a built-in template by name (chatml, gemma, llama3, llama2, deepseek3, "
                                           "glm4), a Jinja file, or the template itself (default: the file's own, "
                                           "else its family's)")
    p.add_argument("-e", "--escape", dest="escape", action="store_true", default=True,
                   help="process escapes (\\n, \\r, \\t, \\', \\\", \\\\) in prompts (default)")
    p.add_argument("--no-escape", dest="escape", action="store_false", help="take prompts literally")


def _run_config(args: argparse.Namespace, **changes):
    """The RunConfig of a command's flags (`changes` set some directly: bench's combinations, serve's batch)."""
    from ferry.runtime.loader import RunConfig

    kw = {} if "model" in changes else dict(model=Path(args.model) if getattr(args, "model", None) else None)
    for flag, dest in (("threads", "n_threads"), ("threads_batch", "n_threads_batch"), ("repack", "repack"),
                       ("fused_moe", "fused_moe"), ("mla", "mla"), ("amb", "amb"), ("ctx_size", "n_ctx"),
                       ("batch_size", "n_batch"), ("ubatch_size", "n_ubatch"), ("cache_type_k", "type_k"),
                       ("cache_type_v", "type_v"), ("n_gpu_layers", "n_gpu_layers"), ("override_tensor",
                       "override_tensor"), ("tensor_split", "tensor_split"), ("offload_policy", "offload_policy"),
                       ("offload_min_batch", "offload_min_batch"), ("batch_order", "batch_order"),
                       ("verbose", "verbose"), ("quiet", "quiet"), ("fit_ctx", "fit_ctx"),
                       ("gpu_memory", "gpu_memory"), ("gpu_experts", "gpu_experts"), ("swa_full", "swa_full")):
        if flag in vars(args):
            kw[dest] = vars(args)[flag]
    if "fit" in vars(args):
        kw["fit"], kw["fit_target"] = args.fit == "on", _fit_target(args.fit_target)
    kw.update(changes)
    return RunConfig(**kw)


# ---- the commands --------------------------------------------------------------------------------------------------

_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "'": "'", '"': '"', "\\": "\\", "a": "\a", "b": "\b", "f": "\f",
            "v": "\v", "?": "?"}
_ESCAPE_RE = re.compile(r"\\(x[0-9a-fA-F]{2}|.)", re.S)


def _escapes(text: str) -> str:
    """llama.cpp's -e: \\n, \\r, \\t, \\', \\", \\\\, \\a, \\b, \\f, \\v, \\? and \\xHH turned into the characters they
    name; a backslash before anything else stays as it is."""
    def one(m: re.Match) -> str:
        code = m.group(1)
        if code[0] == "x" and len(code) == 3:
            return chr(int(code[1:], 16))
        return _ESCAPES.get(code, m.group(0))
    return _ESCAPE_RE.sub(one, text)


def _prompt(args: argparse.Namespace) -> str | None:
    """The prompt of run / chat: the positional text, -p or -f FILE (its last newline dropped, as llama.cpp does);
    escapes processed unless --no-escape."""
    given = [v for v in (args.prompt, args.prompt_opt) if v is not None]
    if args.file is not None:
        try:
            text = Path(args.file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise FerryError(f"-f {args.file}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
        given.append(text[:-1] if text.endswith("\n") else text)
    if len(given) > 1:
        raise FerryError("give the prompt once: as text, with -p, or with -f FILE")
    if not given:
        return None
    return _escapes(given[0]) if args.escape else given[0]


def _check_n_predict(n: int) -> None:
    if n < -2:
        raise FerryError(f"-n/--n-predict {n}: give a count, -1 (until end of generation) or -2 (until the context "
                         "is full)")


def _sampler(args: argparse.Namespace):
    from ferry.runtime.sampling import Sampler, SamplingParams

    if args.seed < -1:
        raise FerryError(f"-s/--seed must be -1 (random) or a seed of 0 or more, got {args.seed}")
    if args.repeat_last_n < -1:
        raise FerryError(f"--repeat-last-n must be -1 (the context), 0 (off) or more, got {args.repeat_last_n}")
    return Sampler(SamplingParams(temp=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                                  repeat_penalty=args.repeat_penalty, repeat_last_n=args.repeat_last_n,
                                  seed=args.seed))


def cmd_run(args: argparse.Namespace) -> int:
    from ferry.runtime.loader import load
    from ferry.tokenizer import StreamDecoder, Tokenizer, chat_template, render_chat

    if args.conversation:
        return cmd_chat(args)
    prompt = _prompt(args)
    if prompt is None:
        raise FerryError("no prompt; pass one: ferry run \"The capital of France is\" (or -f FILE, or ferry chat)")
    _check_n_predict(args.n_predict)
    sampler = _sampler(args)
    cfg = _run_config(args)
    t0 = time.perf_counter()
    loaded = load(cfg)
    tok = Tokenizer(loaded.file)
    engine = loaded.engine()
    load_ms = 1000 * (time.perf_counter() - t0)
    if args.system_prompt is not None or args.chat_template:  # one turn through the chat template: the answer alone
        template, source = chat_template(tok, loaded.model.args.arch, args.chat_template)
        messages = ([{"role": "system", "content": args.system_prompt}] if args.system_prompt else []) + \
            [{"role": "user", "content": prompt}]
        ids = tok.encode_chat(render_chat(template, messages, *tok.special_texts()))
        if not cfg.quiet:
            print(f"ferry: the prompt goes through {source}", file=sys.stderr)
    else:  # a continuation, printed after its prompt
        ids = tok.encode(prompt)
        sys.stdout.write(prompt)
        sys.stdout.flush()
    stream = StreamDecoder(tok)

    def show(token: int) -> None:
        sys.stdout.write(stream.add(token))
        sys.stdout.flush()

    gen = engine.generate(ids, sampler, args.n_predict, tok.is_eog, show)
    sys.stdout.write("\n")
    gen.timings.load_ms = load_ms
    if not cfg.quiet:
        _report(loaded, engine, cfg, f"seed {sampler.seed}, stopped by {gen.stopped_by}")
        if gen.experts_hit:
            print(f"ferry: experts hit per layer in the first u-batch: {gen.experts_hit[0]}", file=sys.stderr)
        print("\n".join(gen.timings.lines()), file=sys.stderr)
    return 0


def _report(loaded, engine, cfg, what: str) -> None:
    """What a run tells the user after it: where it ran, what was repacked, auto's notes, and (--verbose) its
    offload decisions and -mla 3's measured forms."""
    backend = loaded.backend
    print(f"ferry: model {loaded.file.path.name} ({loaded.model.args.arch}), {backend.describe()}, {what}",
          file=sys.stderr)
    if loaded.repacked_bytes:
        print(f"ferry: repacked {loaded.repacked_bytes / 2**20:.0f} MiB of weights into ggml's interleaved CPU "
              f"layout in {loaded.repack_seconds:.2f} s at load (--no-repack skips this)", file=sys.stderr)
    for note in backend.notes():
        print(f"ferry: auto {note}", file=sys.stderr)
    if cfg.verbose:
        decisions = backend.report()
        if decisions:
            print("ferry: offload decisions of this run (measured: synchronized around each op)", file=sys.stderr)
            print("\n".join(decisions), file=sys.stderr)
        for line in engine.runner.report():
            print(f"ferry: {line}", file=sys.stderr)


def cmd_chat(args: argparse.Namespace) -> int:
    """`ferry chat` / `ferry run -cnv`: a conversation in the terminal through the chat template; the KV cache holds
    the conversation between turns, so a turn decodes only what it adds."""
    from ferry.runtime.chat import Conversation
    from ferry.runtime.loader import load
    from ferry.tokenizer import Tokenizer, chat_template

    _check_n_predict(args.n_predict)
    sampler = _sampler(args)
    first = _prompt(args)
    cfg = _run_config(args)
    t0 = time.perf_counter()
    loaded = load(cfg)
    tok = Tokenizer(loaded.file)
    template, source = chat_template(tok, loaded.model.args.arch, args.chat_template)
    engine = loaded.engine()
    chat = Conversation(engine, tok, template, sampler, args.n_predict, args.system_prompt)
    chat.timings.load_ms = 1000 * (time.perf_counter() - t0)
    interactive = sys.stdin.isatty()
    if not cfg.quiet:
        print(f"ferry: chatting with {loaded.file.path.name} through {source}; "
              + ("Ctrl+D or /exit ends it" if interactive else "one turn per line of input"), file=sys.stderr)
    turns = [first] if first is not None else []
    while True:
        if turns:
            line = turns.pop(0)
        else:
            if interactive:
                sys.stdout.write("\n> ")
                sys.stdout.flush()
            line = sys.stdin.readline()
            if not line:
                break
            line = line.rstrip("\n")
            if args.escape:
                line = _escapes(line)
        if line.strip() in ("/exit", "/quit"):
            break
        if not line.strip():
            continue
        try:
            chat.turn(line, lambda piece: (sys.stdout.write(piece), sys.stdout.flush()))
        except FerryError as e:
            if "context is full" not in str(e):
                raise
            print(f"\nferry: {e}; the conversation ends here", file=sys.stderr)
            break
        sys.stdout.write("\n")
        sys.stdout.flush()
    if not cfg.quiet:
        _report(loaded, engine, cfg, f"seed {sampler.seed}, {chat.turns} turns")
        print("\n".join(chat.timings.lines()), file=sys.stderr)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from ferry.tools import bench

    if args.output not in bench.FORMATS:
        raise FerryError(f"-o/--output must be one of {', '.join(bench.FORMATS)}, got '{args.output}'")
    lists = {flag: bench.parse_int_list(flag, v) for flag, v in
             (("-p", args.n_prompt), ("-n", args.n_gen), ("-b", args.batch_size), ("-ub", args.ubatch_size),
              ("-t", args.threads), ("-d", args.n_depth), ("-fa", args.flash_attn))}
    # -ngl not given: the fit places the weights (where a GPU is), as a run's default does
    lists["-ngl"] = bench.parse_int_list("-ngl", args.n_gpu_layers) if args.n_gpu_layers is not None else [None]
    mla = bench.parse_int_list("-mla", args.mla) if args.mla is not None else [None]
    if any(v != 1 for v in lists["-fa"]):
        raise FerryError("-fa 0: ferry always uses flash attention; leave -fa out or pass -fa 1")
    if args.repetitions < 1:
        raise FerryError(f"-r/--repetitions must be at least 1, got {args.repetitions}")
    pairs = bench.parse_pairs("-pg", args.pg)
    base = _run_config(args, model=None, n_threads=0, n_batch=2048, n_ubatch=512, n_gpu_layers=None, mla=None,
                       quiet=True)
    models = [Path(m) for m in args.model] if args.model else [base.model_path]
    configs = [base.with_(model=m, n_threads=t, n_gpu_layers=ngl) for m in models for t in lists["-t"]
               for ngl in lists["-ngl"]]
    from ferry.runtime.loader import check_gpu

    for cfg in configs:
        check_gpu(cfg)
    if args.output == "md":  # rows appear as they are measured, like llama-bench
        print(bench.md_header(), flush=True)
    from ferry.progress import progress

    with progress("bench", None) as bar:  # on a terminal: runs done of all, warm-ups included
        rows = bench.run_bench(configs, lists["-p"], lists["-n"], lists["-b"], lists["-ub"], args.repetitions,
                               on_row=(lambda r: print(bench.md_row(r), flush=True)) if args.output == "md" else None,
                               pg=pairs, depths=lists["-d"], mla=mla,
                               on_progress=lambda done, total, note: bar(done, note, total))
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
        from ferry.runtime.loader import load

        if args.n_predict is not None and args.n_predict < 1:
            raise FerryError(f"-n/--n-predict must be at least 1 (tokens generated per step), got {args.n_predict}")
        cfg = _run_config(args)
        loaded = load(cfg)
        n_gen = args.n_predict or max(1, cfg.n_ubatch // 4)
        rows = sweep.run(loaded, cfg, n_gen, args.quiet)
        if args.json:
            meta = {"model": loaded.file.path.name, "n_ctx": loaded.config.n_ctx, "n_batch": cfg.n_batch,
                    "n_ubatch": cfg.n_ubatch, "n_threads": loaded.backend.n_threads, "type_k": cfg.type_k,
                    "type_v": cfg.type_v, "repack": cfg.repack}
            sweep.save(rows, meta, Path(args.json))
        runs.insert(0, (loaded.file.path.stem, rows))
    if args.plot:
        sweep.plot(runs, Path(args.plot))
    return 0


def cmd_ppl(args: argparse.Namespace) -> int:
    from ferry.runtime.loader import load
    from ferry.tokenizer import Tokenizer
    from ferry.tools import ppl

    if args.kl_divergence and not args.kl_divergence_base:
        raise FerryError("--kl-divergence compares with a base: give --kl-divergence-base FILE from an earlier run")
    if args.output not in ("text", "json"):
        raise FerryError(f"-o/--output must be text or json, got '{args.output}'")
    if args.ctx_size < 2:
        raise FerryError(f"-c/--ctx-size is the chunk size: at least 2 tokens (llama-perplexity's default is 512), "
                         f"got {args.ctx_size}")
    if args.chunks == 0 or args.chunks < -1:
        raise FerryError(f"--chunks must be -1 (all) or at least 1, got {args.chunks}")
    try:
        text = Path(args.file).read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        raise FerryError(f"-f {args.file}: {e.strerror}") from None
    cfg = _run_config(args, fit_ctx=args.ctx_size, all_logits=True)  # the chunk size: the fit may not shrink it
    loaded = load(cfg)
    tok = Tokenizer(loaded.file)
    tokens = tok.encode(text)
    engine = loaded.engine()
    base = ppl.load_base(Path(args.kl_divergence_base), tokens, cfg.n_ctx) if args.kl_divergence else None
    save = Path(args.kl_divergence_base) if args.kl_divergence_base and not args.kl_divergence else None
    n_chunks = min(ppl.chunks(tokens, cfg.n_ctx, args.chunks), base["n_chunks"] if base else 1 << 30)
    quiet = cfg.quiet or args.output == "json"
    if not quiet:
        print(f"perplexity: {len(tokens)} tokens, {n_chunks} chunks, n_ctx={cfg.n_ctx}, "
              f"scoring the second half of each chunk", file=sys.stderr)
    from ferry.progress import progress

    terminal = sys.stderr.isatty()
    with progress("perplexity", n_chunks, quiet) as bar:
        def on_chunk(i: int, value: float) -> None:
            bar(i + 1, f"PPL {value:.4f}")
            if not quiet and not terminal:  # llama-perplexity's running estimate, for logs
                sys.stderr.write(f"[{i + 1}]{value:.4f},")
                sys.stderr.flush()

        result = ppl.perplexity(engine, tokens, cfg.n_ctx, tok.bos_id if tok.add_bos else None, args.chunks,
                                save, base, on_chunk)
    if not quiet and not terminal:
        sys.stderr.write("\n")
    print(ppl.to_json(result) if args.output == "json" else ppl.report(result))
    return 0


def _check_serve_args(args: argparse.Namespace) -> None:
    if args.parallel < 1:
        raise FerryError(f"-np/--parallel must be at least 1, got {args.parallel}")
    if args.ubatch_size < 1:
        raise FerryError(f"-ub/--ubatch-size must be at least 1, got {args.ubatch_size}")
    if args.batch_size < 0:
        raise FerryError(f"-b/--batch-size must be 0 (one u-batch) or more, got {args.batch_size}")
    if args.cache_ram < -1:
        raise FerryError(f"--cache-ram must be MiB of 0 (off) or more, or -1 (no limit), got {args.cache_ram}")


def build_server(args: argparse.Namespace):
    """The FastAPI app for `ferry serve` (tests start it in-process)."""
    from ferry.runtime.loader import load
    from ferry.server.app import create_app
    from ferry.server.scheduler import Scheduler
    from ferry.tokenizer import Tokenizer, chat_template

    _check_serve_args(args)
    # a prompt is prefilled u-batch by u-batch; a decode step takes one token of every slot
    cfg = _run_config(args, n_batch=max(args.ubatch_size, args.parallel), n_ubatch=max(args.ubatch_size, args.parallel),
                      quiet=True, n_seq=args.parallel)
    loaded = load(cfg)
    n_ctx = loaded.config.n_ctx or loaded.model.args.n_ctx_train  # -c 0: the model's
    if n_ctx < 2 * args.parallel:
        raise FerryError(f"-c/--ctx-size {n_ctx} gives each of -np {args.parallel} slots fewer than 2 tokens; raise -c "
                         "or lower -np")
    tok = Tokenizer(loaded.file)
    template, _ = chat_template(tok, loaded.model.args.arch, args.chat_template)
    seq_len = n_ctx // args.parallel
    engine = loaded.engine(cfg, n_ctx=seq_len * args.parallel, n_seq=args.parallel)
    name = args.alias or loaded.file.path.name
    cache_ram = args.cache_ram * 2**20 if args.cache_ram > 0 else args.cache_ram
    return create_app(Scheduler(engine, tok, args.parallel, seq_len, args.batch_size, cache_ram), tok, name,
                      args.api_key, template, args.reasoning_format)


def cmd_serve(args: argparse.Namespace) -> int:
    import socket
    import threading

    import uvicorn

    if not 0 <= args.port <= 65535:
        raise FerryError(f"--port must be 0..65535 (0: any free port), got {args.port}")
    _check_serve_args(args)
    try:  # bound before loading the model: a port in use is an error now, not after the load
        sock = socket.create_server((args.host, args.port))
    except OSError as e:
        raise FerryError(f"cannot listen on {args.host}:{args.port} ({e.strerror or e}); pick another with --port "
                         "or --host") from None
    from ferry.server.app import Loading

    # the port answers at once (503 "Loading model" until the model is loaded, as llama-server's /health)
    shell, failed = Loading(), []
    server = uvicorn.Server(uvicorn.Config(shell, log_level="warning", lifespan="off"))
    host, port = sock.getsockname()[:2]

    def load() -> None:
        try:
            app = build_server(args)
        except BaseException as e:  # re-raised in the main thread, once the server has stopped for it
            failed.append(e)
            server.should_exit = True
            return
        shell.app = app
        print(f"ferry: serving on http://{host}:{port} ({args.parallel} slots of {app.state.slot_tokens} tokens)",
              file=sys.stderr)

    print(f"ferry: loading {args.model}; http://{host}:{port}/health answers 503 until it is loaded", file=sys.stderr)
    threading.Thread(target=load, name="ferry-load", daemon=True).start()
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    if failed:
        raise failed[0]
    return 0


def _calibrate_routing(args: argparse.Namespace) -> int:
    """`ferry calibrate --routing -m MODEL -f TEXT`: how often the text routes to each expert (offload/routing.py)."""
    from ferry.offload import routing
    from ferry.progress import progress
    from ferry.runtime.loader import load
    from ferry.tokenizer import Tokenizer

    if not args.model or not args.file:
        raise FerryError("--routing counts a model's routing over a text: give -m MODEL.gguf and -f TEXT")
    try:
        text = Path(args.file).read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        raise FerryError(f"-f {args.file}: {e.strerror}") from None
    if args.ctx_size < 2:
        raise FerryError(f"-c/--ctx-size is the chunk size: at least 2 tokens, got {args.ctx_size}")
    cfg = _run_config(args, fit_ctx=args.ctx_size)
    loaded = load(cfg)
    layers = routing.moe_layers(loaded.file.tensors)
    if not layers:
        raise FerryError(f"{cfg.model.name} has no routed experts: there is no routing to count")
    tok = Tokenizer(loaded.file)
    tokens = tok.encode(text)
    a = loaded.model.args
    with progress("counting routing", -(-len(tokens) // cfg.n_ctx), cfg.quiet) as bar:
        result = routing.measure(loaded.engine(), tokens, cfg.n_ctx, len(layers), a.n_expert,
                                 tok.bos_id if tok.add_bos else None, on_chunk=lambda i, n: bar(i, total=n))
    result = {"model": cfg.model.name, "key": routing.model_key(cfg.model), "layers": layers,
              "n_expert": a.n_expert, "n_expert_used": a.n_expert_used, "n_ctx": cfg.n_ctx, **result}
    path = Path(args.out) if args.out else routing.default_path(cfg.model)
    routing.save(result, path)
    print(json.dumps(result) if args.json else routing.table(result))
    if not cfg.quiet:
        print(f"ferry: saved to {path}", file=sys.stderr)
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from ferry.backends.cpu import CpuBackend
    from ferry.offload import calibrate
    from ferry.progress import progress
    from ferry.runtime.loader import RunConfig

    if args.routing:
        return _calibrate_routing(args)
    if args.file or args.model:
        raise FerryError("-m / -f are for counting a model's routing: add --routing (ferry calibrate alone measures "
                         "the machine)")
    RunConfig(n_threads=args.threads)  # the thread count checked as a run checks it
    path = Path(args.out) if args.out else calibrate.default_path()
    if not args.quiet:
        print("ferry: measuring this machine (CPU GEMV, matmul and routed experts per quant type; pinned PCIe copies "
              "and the GPU where one is visible); keep it otherwise idle meanwhile ...", file=sys.stderr)
    backend = CpuBackend(args.threads)
    try:
        with progress("calibrating", calibrate.steps(args.quick), args.quiet) as bar:
            result = calibrate.calibrate(backend, args.quick, on_step=bar)
    finally:
        backend.close()
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
    from ferry.offload.plan import show
    from ferry.tools.bench import parse_int_list

    ubatches = parse_int_list("--ubatches", args.ubatches) if args.ubatches else None
    if ubatches is not None and min(ubatches) < 1:
        raise FerryError(f"--ubatches: every size must be at least 1, got {args.ubatches}")
    if args.parallel < 1:
        raise FerryError(f"-np/--parallel must be at least 1, got {args.parallel}")
    return show(_run_config(args, n_seq=args.parallel), ubatches, args.calibration, args.json)


def cmd_info(args: argparse.Namespace) -> int:
    from ferry.tools.info import info

    if (args.file is None) == (args.model is None):
        raise FerryError("give the GGUF file once: ferry info FILE (or -m FILE)")
    cfg = _run_config(args, model=Path(args.file or args.model))
    info(cfg, args.json)
    return 0


def cmd_synth(args: argparse.Namespace) -> int:
    from ferry.gguf.synth import MIXES, PRESETS, synth
    from ferry.quant import IkQuant, parse_qtype

    if args.preset not in PRESETS:
        raise FerryError(f"unknown preset '{args.preset}'; presets: {', '.join(PRESETS)}")
    if args.layers < 0:
        raise FerryError(f"--layers must be 0 (the preset's count) or more, got {args.layers}")
    if not 0 <= args.seed < 2**32:
        raise FerryError(f"--seed must be 0..{2**32 - 1}, got {args.seed}")
    if not 0 <= args.routing_skew <= 8:
        raise FerryError(f"--routing-skew must be 0 (even routing) to 8, got {args.routing_skew}")
    experts = args.expert_type.upper()
    if experts in IkQuant.__members__:  # ik_llama.cpp's types ferry's kernels read in place (random blocks)
        experts = IkQuant[experts]
    elif experts not in MIXES:
        try:
            experts = parse_qtype(experts)
        except FerryError as e:
            raise FerryError(f"{e}; or a mix: {', '.join(m.lower() for m in MIXES)}; or one of ik_llama.cpp's: "
                             f"{', '.join(t.name.lower() for t in IkQuant)}") from None
    out = Path(args.output)
    t0 = time.perf_counter()
    synth(PRESETS[args.preset], out, experts, parse_qtype(args.type), seed=args.seed,
          layers=args.layers, quiet=args.quiet, legacy_mla=args.legacy_mla, shape_only=args.shape_only,
          routing_skew=args.routing_skew)
    if not args.quiet:
        print(f"ferry: wrote {out} ({out.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - t0:.1f} s",
              file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="ferry", description="Run Mixture-of-Experts GGUF models with the experts in RAM.")
    parser.add_argument("--version", action="version", version=f"ferry {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    for name, help_ in (("run", "generate a continuation of a prompt (llama-cli / llama-completion)"),
                        ("chat", "a conversation in the terminal through the chat template (llama-cli -cnv)")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("prompt", nargs="?", help="prompt text" if name == "run" else "the first message")
        p.add_argument("-p", "--prompt", dest="prompt_opt", help="prompt text (same as the positional argument)")
        p.add_argument("-f", "--file", help="a file holding the prompt")
        _model_flags(p)
        _cpu_flags(p)
        _mla_flags(p)
        _context_flags(p)
        _gpu_flags(p)
        _sampling_flags(p)
        _chat_flags(p)
        if name == "chat":
            p.set_defaults(n_predict=-1)  # an answer runs to its end of turn, as llama-cli's
        p.add_argument("-cnv", "--conversation", action="store_true", default=name == "chat",
                       help="chat through the chat template, keeping the conversation in the KV cache (ferry chat)")
        p.add_argument("-q", "--quiet", action="store_true", help="print only the text, no timings")
        p.set_defaults(func=cmd_chat if name == "chat" else cmd_run)

    p = sub.add_parser("bench", help="measure prompt processing and generation speed (llama-bench semantics)")
    _model_flags(p, lists=True)
    p.add_argument("-p", "--n-prompt", default="512", help="prompt sizes, e.g. 128,512 or 128-2048*2 (0: none)")
    p.add_argument("-n", "--n-gen", default="128", help="generated token counts (0: none)")
    p.add_argument("-pg", action="append", default=[], help="PP,TG: a prompt then a generation in one timed run")
    p.add_argument("-d", "--n-depth", default="0", help="tokens in the cache before each test")
    _cpu_flags(p, lists=True)
    _mla_flags(p, lists=True)
    _context_flags(p, lists=True)
    _gpu_flags(p, lists=True)
    p.add_argument("-fa", "--flash-attn", default="1", help="flash attention (always on: 1)")
    p.add_argument("-r", "--repetitions", type=int, default=5)
    p.add_argument("-o", "--output", default="md", help="md, json, jsonl or csv")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("sweep", help="PP and TG speed as the cache fills (llama-sweep-bench's table)")
    _model_flags(p)
    _cpu_flags(p)
    _mla_flags(p)
    _context_flags(p, ctx_help="sweep until the cache holds this many tokens")
    _gpu_flags(p)
    p.add_argument("-n", "--n-predict", type=int, default=None,
                   help="tokens generated at each step (default: a quarter of -ub, as llama-sweep-bench)")
    p.add_argument("--json", help="write the rows as JSON to this file")
    p.add_argument("--plot", help="draw S_PP and S_TG against N_KV into this PNG")
    p.add_argument("--overlay", action="append", default=[], help="another sweep's JSON to draw beside, repeatable")
    p.add_argument("--no-run", action="store_true", help="only plot the --overlay files")
    p.add_argument("-q", "--quiet", action="store_true", help="no table")
    p.set_defaults(func=cmd_sweep)

    p = sub.add_parser("ppl", help="perplexity of a text (llama-perplexity's method), KL-divergence against a base")
    _model_flags(p)
    p.add_argument("-f", "--file", required=True, help="text file")
    _cpu_flags(p)
    _mla_flags(p)
    _context_flags(p, n_ctx=512, ctx_help="chunk size in tokens (the second half of each is scored)")
    _gpu_flags(p)
    p.add_argument("--chunks", type=int, default=-1, help="at most this many chunks (-1: all)")
    p.add_argument("--kl-divergence-base", help="file of base log-probabilities: written, or read with --kl-divergence")
    p.add_argument("--kl-divergence", action="store_true", help="compare with --kl-divergence-base")
    p.add_argument("-o", "--output", default="text", help="text or json")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress")
    p.set_defaults(func=cmd_ppl)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions, ...)")
    _model_flags(p)
    _cpu_flags(p)
    _mla_flags(p)
    _context_flags(p, ctx_help="context of all slots together", logical_batch=False)
    _gpu_flags(p)
    p.add_argument("-np", "--parallel", type=int, default=4, help="slots: requests generating at once")
    p.add_argument("-b", "--batch-size", type=int, default=0,
                   help="prompt tokens a step prefills at most, in u-batches of -ub, between the running slots' "
                        "tokens (default 0: one u-batch; more: a prompt's first token sooner, longer gaps in the "
                        "running streams)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/ requests")
    p.add_argument("--reasoning-format", choices=FORMATS, default="auto",
                   help="auto / deepseek: a chat answer's reasoning (<think> ... </think>, gpt-oss's analysis channel) "
                        "in reasoning_content; none: left in content (default auto; a request's reasoning_format "
                        "overrides it)")
    p.add_argument("-a", "--alias", help="model name in the API (default: the file name)")
    p.add_argument("-cram", "--cache-ram", type=int, default=8192,
                   help="MiB of RAM for slots' cached prompts written over by other requests, copied back when a "
                        "prompt shares more with one (default 8192 as llama-server; 0 off, -1 no limit)")
    p.add_argument("--chat-template", help="a built-in template by name, a Jinja file, or the template itself")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("calibrate", help="measure this machine for the offload policy and store the result")
    p.add_argument("-t", "--threads", type=int, default=0, help="CPU threads (default: physical cores)")
    p.add_argument("--quick", action="store_true", help="small sizes: seconds, less exact")
    p.add_argument("--out", help="where to store it (default: ~/.cache/ferry/calibration-HOST.json, or "
                                 "routing-KEY.json beside it with --routing)")
    p.add_argument("--json", action="store_true")
    p.add_argument("-q", "--quiet", action="store_true")
    p.add_argument("--routing", action="store_true",
                   help="count how often a text (-f) routes to each expert of a model (-m) instead, keyed by the file")
    p.add_argument("-m", "--model", help="with --routing: the GGUF file")
    p.add_argument("-f", "--file", help="with --routing: the text")
    p.add_argument("-c", "--ctx-size", type=int, default=512, help="with --routing: the chunk size (default 512)")
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser("compare", help="is B faster than A? two `ferry bench -o json` results, row by row")
    p.add_argument("a", help="baseline result (JSON)")
    p.add_argument("b", help="new result (JSON)")
    p.add_argument("-o", "--output", default="md", help="md or json")
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("plan", help="memory per device for -ngl/-ot/-c before loading, and where each op on weights "
                                    "in RAM runs per u-batch and why")
    _model_flags(p)
    _mla_flags(p)
    _context_flags(p)
    _gpu_flags(p)
    p.add_argument("--ubatches", help="u-batch sizes for the op table, e.g. 1,64,512,4096 (default: 1 and -ub)")
    p.add_argument("-np", "--parallel", type=int, default=1,
                   help="server slots (`ferry serve -np`): a recurrent layer or a compressor keeps a state for each")
    p.add_argument("--calibration", help="a `ferry calibrate` result (default: this machine's)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("info", help="architecture, sizes, quant types and placement of a GGUF model")
    p.add_argument("file", nargs="?", help="GGUF file (or -m FILE)")
    _model_flags(p)
    p.add_argument("-ngl", "--n-gpu-layers", type=int, default=0, help="layers on the GPU (999: all)")
    p.add_argument("-ot", "--override-tensor", action="append", default=[], help="REGEX=DEVICE, repeatable")
    p.add_argument("--no-repack", dest="repack", action="store_false", help="CPU tensors stay in the mmap")
    _mla_flags(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
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
    p.add_argument("--shape-only", action="store_true",
                   help="every weight zero, as a sparse file written at once: the model's shape for `ferry plan` and "
                        "`ferry info` (runs, but says nothing)")
    p.add_argument("--routing-skew", type=float, default=0.0, metavar="S",
                   help="route unevenly: the expert of popularity rank r (random per layer) gets its router column "
                        "scaled by (r+1)^-S (default 0: even)")
    p.add_argument("-q", "--quiet", action="store_true")
    p.set_defaults(func=cmd_synth)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help, --version, or a bad command line (argparse has printed it)
        return e.code if isinstance(e.code, int) else 0
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
