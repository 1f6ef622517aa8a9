"""`ferry sweep`: llama-sweep-bench's loop. For N_KV = 0, ub, 2*ub, ... while the context has room: time -n
single-token decodes at that depth (default ub/4; then drop them), then one u-batch of ub prompt tokens, which stays
and deepens the cache. Same table as llama-sweep-bench, JSON, and plots of several runs overlaid."""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ferry.errors import FerryError
from ferry.files import atomic_file

HEADER = ("|    PP |     TG |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |\n"
          "|-------|--------|--------|----------|----------|----------|----------|")


@dataclass
class SweepRow:
    pp: int
    tg: int
    n_kv: int
    t_pp: float  # seconds for the u-batch of pp prompt tokens
    s_pp: float  # prompt tokens per second
    t_tg: float  # seconds for tg single-token decodes
    s_tg: float  # generated tokens per second

    def line(self) -> str:
        return (f"| {self.pp:5d} | {self.tg:6d} | {self.n_kv:6d} | {self.t_pp:8.3f} | {self.s_pp:8.2f} | "
                f"{self.t_tg:8.3f} | {self.s_tg:8.2f} |")


def sweep(engine, n_vocab: int, n_gen: int, seed: int = 0, on_row=None) -> list[SweepRow]:
    """llama-sweep-bench's loop on `engine` (its -c, -ub): at each depth N_KV = 0, ub, 2 ub, ... n_gen generated
    tokens timed and dropped, then one u-batch of prompt tokens timed and kept."""
    pp, tg, n_ctx = engine.n_ubatch, n_gen, engine.n_ctx
    if pp + tg > n_ctx:
        raise FerryError(f"-c/--ctx-size {n_ctx} holds no step of -ub {pp} prompt tokens and {tg} generated; "
                         f"raise -c to at least {pp + tg}")
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(n_vocab) for _ in range(n)]

    # warm-up: builds both graphs, as llama-sweep-bench's warm-up run does; twice, since a GPU records a prompt shape's
    # CUDA graphs at its second run (runners/cuda_graphs.py PROMPT_RECORDED_AT): the first timed depth paid for that
    # recording, 0.26-0.48x of the later depths' S_PP on an H200 (docs/performance.md, 2026-11-28: the sweep to 32k)
    for _ in range(2):
        engine.decode(tokens(pp))
        engine.decode(tokens(1))
        engine.reset()
    rows = []
    n_kv = 0
    while n_kv + max(pp, tg) <= n_ctx:
        # a recurrent state, or rings the generated tokens write past their slack, come back from a copy
        saved = engine.save_state() if engine.recurrent or not engine.kv.resumable(n_kv, n_kv + tg) else None
        t0 = time.perf_counter()
        for t in tokens(tg):
            engine.decode([t])
        t_tg = time.perf_counter() - t0
        engine.truncate(n_kv, saved)  # the generated tokens leave the cache, as llama-sweep-bench removes them
        t0 = time.perf_counter()
        engine.decode(tokens(pp))
        t_pp = time.perf_counter() - t0
        row = SweepRow(pp, tg, n_kv, t_pp, pp / t_pp, t_tg, tg / t_tg)
        rows.append(row)
        if on_row:
            on_row(row)
        n_kv += pp
    return rows


def run(loaded, cfg, n_gen: int, quiet: bool = False) -> list[SweepRow]:
    """`ferry sweep` on a loaded model: the table printed row by row (unless quiet), a progress bar on a terminal."""
    from ferry.progress import progress

    engine = loaded.engine(n_batch=loaded.config.n_ubatch)  # a step's prompt is one u-batch
    if not quiet:
        print(HEADER, flush=True)
    steps = max(0, (engine.n_ctx - engine.n_ubatch) // engine.n_ubatch + 1)
    with progress("sweep", steps, quiet) as bar:
        def on_row(r: SweepRow) -> None:
            bar(r.n_kv // engine.n_ubatch + 1, f"N_KV {r.n_kv}")
            if not quiet:
                print(r.line(), flush=True)

        return sweep(engine, loaded.model.args.n_vocab, n_gen, on_row=on_row)


def save(rows: list[SweepRow], meta: dict, path: Path) -> None:
    with atomic_file(path) as tmp:
        tmp.write_text(to_json(rows, meta))


def to_json(rows: list[SweepRow], meta: dict) -> str:
    return json.dumps({**meta, "rows": [asdict(r) for r in rows]}, indent=1)


def load(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        rows = [SweepRow(**r) for r in data["rows"]]
    except FileNotFoundError:
        raise FerryError(f"{path}: no such file") from None
    except (ValueError, KeyError, TypeError) as e:
        raise FerryError(f"{path}: not a `ferry sweep --json` result ({e})") from None
    return {**data, "rows": rows}


def plot(runs: list[tuple[str, list[SweepRow]]], out: Path) -> None:
    """S_PP and S_TG against N_KV, one line per run."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise FerryError("--plot needs matplotlib: pip install matplotlib (or ferry[plot])") from None
    fig, (ax_pp, ax_tg) = plt.subplots(1, 2, figsize=(11, 4))
    for label, rows in runs:
        ax_pp.plot([r.n_kv for r in rows], [r.s_pp for r in rows], marker="o", label=label)
        ax_tg.plot([r.n_kv for r in rows], [r.s_tg for r in rows], marker="o", label=label)
    for ax, title in ((ax_pp, "prompt processing (S_PP)"), (ax_tg, "generation (S_TG)")):
        ax.set_xlabel("N_KV (tokens in the cache)")
        ax.set_ylabel("tokens/s")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    try:
        with atomic_file(out) as tmp:
            fig.savefig(tmp)
    finally:
        plt.close(fig)
