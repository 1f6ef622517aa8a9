"""`ferry bench`: llama-bench's measurements (pp: a u-batch of random prompt tokens from an empty cache;
tg: single-token decodes from an empty cache; pp+tg: both in one timed run; `-d`: the cache filled with that
many tokens first), one row per parameter combination, mean ± std."""

from __future__ import annotations

import csv
import io
import itertools
import json
import math
import random
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

from ferry.errors import FerryError

FORMATS = ("md", "json", "jsonl", "csv")


def parse_int_list(flag: str, text: str) -> list[int]:
    """llama-bench's lists: '128,512', 'first-last', 'first-last+step', 'first-last*mult'."""
    values: list[int] = []
    for part in text.split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+)(?:([+*])(\d+))?)?", part.strip())
        if not m:
            raise FerryError(f"{flag}: '{part}' is not a number or a range like 128-512*2 or 1-8+1")
        first = int(m.group(1))
        if m.group(2) is None:
            values.append(first)
            continue
        last, op, step = int(m.group(2)), m.group(3) or "+", int(m.group(4) or 1)
        if last < first or step < 1 or (op == "*" and (step < 2 or first < 1)):
            raise FerryError(f"{flag}: range '{part}' is empty or never ends")
        v = first
        while v <= last:
            values.append(v)
            v = v + step if op == "+" else v * step
    return values


@dataclass
class BenchRow:
    model: str
    size_bytes: int
    n_params: int
    backend: str
    n_threads: int
    n_batch: int
    n_ubatch: int
    repack: bool  # weights were repacked into ggml's CPU layout (-rtr, where weights stay in RAM)
    type_k: str
    type_v: str
    n_prompt: int
    n_gen: int
    n_depth: int = 0  # tokens in the cache before each timed run (llama-bench's -d)
    mla: int = 0  # the latent attention mode it ran in (deepseek2; 0 elsewhere)
    layer_first: bool = False  # a logical batch ran layer by layer (routed experts in RAM, --batch-order)
    samples_ts: list[float] = field(default_factory=list)
    experts_hit: list[int] = field(default_factory=list)  # pp: distinct experts per MoE layer, first u-batch
    placement: str = ""  # the fit's placement as flags, where the fit placed (no -ngl / -ot given)

    @property
    def test(self) -> str:
        name = "+".join(([f"pp{self.n_prompt}"] if self.n_prompt else []) + ([f"tg{self.n_gen}"] if self.n_gen else []))
        return f"{name} @ d{self.n_depth}" if self.n_depth else name

    @property
    def avg_ts(self) -> float:
        return statistics.mean(self.samples_ts)

    @property
    def stddev_ts(self) -> float:
        return statistics.stdev(self.samples_ts) if len(self.samples_ts) > 1 else 0.0

    def record(self) -> dict:
        return {**asdict(self), "test": self.test, "avg_ts": self.avg_ts, "stddev_ts": self.stddev_ts}


class Runs:
    """One test's timed runs on one engine, llama-bench's way: each run resets the cache, fills it with `n_depth`
    random tokens untimed, then times a prompt of `n_prompt` random tokens and `n_gen` single-token decodes. The
    tokens come from the run's seed, so two engines given the same seeds run the same tokens."""

    def __init__(self, loaded, cfg, n_prompt: int, n_gen: int, n_depth: int = 0):
        self.loaded = loaded
        self.n_prompt, self.n_gen, self.n_depth = n_prompt, n_gen, n_depth
        self.engine = loaded.engine(cfg, n_ctx=n_depth + n_prompt + n_gen + 1)

    def once(self, seed: int) -> float:
        """tokens/s of one run."""
        engine, rng, vocab = self.engine, random.Random(seed), self.loaded.model.args.n_vocab
        engine.reset()
        if self.n_depth:  # fill the cache first, untimed
            engine.decode([rng.randrange(vocab) for _ in range(self.n_depth)])
            engine.experts_hit.clear()
        t0 = time.perf_counter()
        if self.n_prompt:
            engine.decode([rng.randrange(vocab) for _ in range(self.n_prompt)])
        for _ in range(self.n_gen):
            engine.decode([rng.randrange(vocab)])
        self.loaded.backend.synchronize()  # a GPU: wait for the queued work
        return (self.n_prompt + self.n_gen) / (time.perf_counter() - t0)

    def warm_up(self, seed: int = -1) -> int:
        """The untimed runs a steady state needs: one, and a second where it records a prompt shape's CUDA graphs
        (a prompt of one u-batch on a GPU). Returns how many ran."""
        self.once(seed)
        if self.engine.runner.will_record():
            self.once(seed)
            return 2
        return 1

    @property
    def experts_hit(self) -> list[int]:
        """The experts hit per layer in the first u-batch of the last run's prompt."""
        hit = self.engine.experts_hit
        return hit[0] if hit and self.n_prompt else []

    def timed(self, reps: int, seed: int = 0) -> tuple[list[float], list[int]]:
        """tokens/s of `reps` runs (seeds seed + 1 on), and the experts hit per layer in the first one."""
        samples, hit = [], []
        for i in range(reps):
            samples.append(self.once(seed + 1 + i))
            if i == 0:  # the first timed run's, read once
                hit = self.experts_hit
        return samples, hit


def measure(loaded, cfg, n_prompt: int, n_gen: int, reps: int, n_depth: int = 0,
            seed: int = 0) -> tuple[list[float], list[int], int]:
    """tokens/s of `reps` runs after the warm-up, the experts hit per layer in the first timed u-batch, and the
    warm-up runs."""
    runs = Runs(loaded, cfg, n_prompt, n_gen, n_depth)
    warmups = runs.warm_up(seed)
    return *runs.timed(reps, seed), warmups


def parse_pairs(flag: str, texts: list[str]) -> list[tuple[int, int]]:
    """llama-bench's -pg: 'pp,tg' pairs (the flag may repeat)."""
    pairs = []
    for text in texts:
        parts = text.split(",")
        if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
            raise FerryError(f"{flag}: '{text}' is not a pair like 512,128")
        pairs.append((int(parts[0]), int(parts[1])))
    return pairs


def run_bench(configs: list, n_prompt: list[int], n_gen: list[int], n_batch: list[int], n_ubatch: list[int],
              reps: int, on_row=None, pg: list[tuple[int, int]] = (), depths: list[int] = (0,),
              mla: list[int | None] = (None,), on_progress=None) -> list[BenchRow]:
    """A row per model, threads and -ngl (each of `configs`, a RunConfig: loaded once) and per -mla, -b, -ub, test and
    depth. on_progress(done, total, note): after each run, warm-ups included (a progress bar)."""
    from ferry.runtime.loader import load

    if reps < 1:
        raise FerryError(f"-r/--repetitions must be at least 1, got {reps}")
    tests = [(p, 0) for p in n_prompt if p > 0] + [(0, n) for n in n_gen if n > 0] + [(p, n) for p, n in pg if p or n]
    if not tests:
        raise FerryError("nothing to measure: give -p, -n or -pg a value above 0")
    rows = []
    combos = list(itertools.product(mla, n_batch, n_ubatch, tests, depths))
    total, done = len(configs) * len(combos) * (reps + 1), 0
    for base in configs:
        # loaded for the largest cache, logical batch and u-batch its tests need (the memory plan's sizes; RunConfig
        # clamps the u-batch to the batch, here as in each test)
        ctx = max(depths) + max(p + n for p, n in tests) + 1
        cfg = base.with_(n_ctx=ctx, n_batch=min(max(n_batch), max(max(p for p, _ in tests), 1)),
                         n_ubatch=max(n_ubatch))
        loaded = load(cfg)
        f, backend, model = loaded.file, loaded.backend, loaded.model
        size = sum(info.nbytes for info in f.tensors.values())
        n_params = sum(math.prod(info.ne) for info in f.tensors.values())
        for mode, b, ub, (p, n), d in combos:
            run = base.with_(n_batch=b, n_ubatch=ub, mla=mode)  # u-batch clamped to the batch, as llama.cpp does
            row = BenchRow(f.path.name, size, n_params, backend.label, backend.n_threads, run.n_batch, run.n_ubatch,
                           loaded.repacked_bytes > 0,
                           run.type_k, run.type_v, p, n, d, mla=model.use_mla(mode, run.amb))
            row.layer_first = backend.layer_first and min(p, run.n_batch) > run.n_ubatch
            row.placement = loaded.fit.flags() if loaded.fit else ""
            row.samples_ts, row.experts_hit, _ = measure(loaded, run, p, n, reps, d)
            rows.append(row)
            done += reps + 1
            if on_progress:
                on_progress(done, total, row.test)
            if on_row:
                on_row(row)
        for note in backend.notes():
            print(f"ferry: auto {note}", file=sys.stderr)
        backend.close()
    return rows


def md_header() -> str:
    return ("| model | size | params | backend | threads | n_ubatch | type_k | type_v | test | t/s | experts hit/layer |\n"
            "| --- | ---: | ---: | --- | ---: | ---: | --- | --- | ---: | ---: | --- |")


def md_row(r: BenchRow) -> str:
    hit = f"{min(r.experts_hit)}-{max(r.experts_hit)}" if r.experts_hit else ""
    backend = f"{r.backend} mla{r.mla}" if r.mla else r.backend  # ik_llama-bench's mla column, where it applies
    if r.layer_first:
        backend += f" layer-first b{min(r.n_batch, r.n_prompt)}"
    return (f"| {r.model} | {r.size_bytes / 2**20:.2f} MiB | {r.n_params / 1e6:.2f} M | {backend} | {r.n_threads} | "
            f"{r.n_ubatch} | {r.type_k} | {r.type_v} | {r.test} | {r.avg_ts:.2f} ± {r.stddev_ts:.2f} | {hit} |")


def render(rows: list[BenchRow], fmt: str) -> str:
    records = [r.record() for r in rows]
    if fmt == "md":
        return "\n".join([md_header(), *(md_row(r) for r in rows)])
    if fmt == "json":
        return json.dumps(records, indent=1)
    if fmt == "jsonl":
        return "\n".join(json.dumps(r) for r in records)
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(records[0]))
    w.writeheader()
    for r in records:
        w.writerow({k: json.dumps(v) if isinstance(v, list) else v for k, v in r.items()})
    return buf.getvalue().rstrip("\n")
