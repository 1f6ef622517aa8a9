"""The sliding-window layers' ring (KVCache.ring): a window layer keeps its window and a u-batch's positions per
sequence instead of every position, and gives the logits of a cache that keeps them all (--swa-full), in the ggml
graph and op by op, over server slots, and after a sequence is cut back."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from ferry.cli import main
from ferry.gguf.file import GGUFFile
from ferry.placement import memory_plan
from ferry.runtime.batch import Batch
from ferry.runtime.kv_cache import KVCache
from ferry.runtime.loader import RunConfig, load


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """gpt-oss-tiny: 4 layers, the even ones within a window of 8 (a ring of 512 rows at -ub 96 up to 248)."""
    path = tmp_path_factory.mktemp("ring") / "gpt-oss-tiny.gguf"
    assert main(["synth", "gpt-oss-tiny", "-o", str(path), "-q"]) == 0
    return path


class _Ring:
    """What Batch.ring_mask reads of a cache."""

    def __init__(self, ring: int):
        self.ring = ring


@pytest.mark.parametrize("ring,window,n_seq,seed", [(16, 5, 1, 0), (16, 8, 3, 1), (24, 7, 2, 2), (32, 1, 2, 3)])
def test_the_ring_mask_opens_exactly_the_rows_that_hold_each_tokens_window(ring, window, n_seq, seed):
    """Sequences written u-batch by u-batch into their rings (a Python model of the rows: which position each holds),
    now and then cut back as far as KVCache.resumable allows: at every batch, the mask opens a row to a token exactly
    where the row holds a position of the token's sequence at or before it and within its window."""
    rng = np.random.default_rng(seed)
    held = np.full(n_seq * ring, -1)  # the position each row holds (-1: never written)
    n_past = [0] * n_seq
    reach = [0] * n_seq
    slack = ring - window
    for _ in range(60):
        seqs = [int(s) for s in rng.choice(n_seq, size=int(rng.integers(1, n_seq + 1)), replace=False)]
        seq, pos = [], []
        for s in seqs:
            if n_past[s] and rng.random() < 0.2:  # cut back within the slack, as a server's prompt reuse does
                n_past[s] = max(reach[s] - slack, n_past[s] - int(rng.integers(1, slack + 1)), 0)
            n = int(rng.integers(1, slack + 2))  # a u-batch's tokens: the ring holds them beside a window
            seq += [s] * n
            pos += list(range(n_past[s], n_past[s] + n))
            n_past[s] += n
            reach[s] = max(reach[s], n_past[s])
        batch = Batch(start=0, n_tokens=len(seq), kv=_Ring(ring), seq=torch.tensor(seq), pos=torch.tensor(pos),
                      seq_len=1 << 20)
        held[batch.ring_cells.numpy()] = pos
        rows = np.arange(n_seq * ring)
        p, s = np.array(pos)[:, None], np.array(seq)[:, None]
        truth = (rows[None, :] // ring == s) & (held[None, :] >= 0) & (held[None, :] <= p) & (p - held[None, :] < window)
        mask = batch.ring_mask(window, n_seq * ring).numpy()
        assert (mask == truth).all()
        # each token sees its whole window: min(window, position + 1) rows
        assert (mask.sum(1) == np.minimum(window, np.array(pos) + 1)).all()


def _logits(path, swa_full: bool, graph: bool, tokens: list[int], steps: int, ub: int = 96):
    cfg = RunConfig(model=path, n_ctx=2048, n_batch=ub, n_ubatch=ub, swa_full=swa_full, quiet=True, n_threads=2)
    engine = load(cfg).engine(graph=graph)
    out = [engine.decode(tokens, all_logits=True)]
    out += [engine.decode([t]) for t in tokens[:steps]]
    return torch.cat(out), engine


@pytest.fixture(scope="module")
def deepseek4(tmp_path_factory):
    """deepseek4-tiny: every layer within a window of 8 (beside its compressed entries)."""
    path = tmp_path_factory.mktemp("ring") / "deepseek4-tiny.gguf"
    assert main(["synth", "deepseek4-tiny", "-o", str(path), "-q"]) == 0
    return path


@pytest.mark.parametrize("preset,graph", [("gpt_oss", True), ("gpt_oss", False), ("deepseek4", False)],
                         ids=["gpt-oss-ggml-graph", "gpt-oss-op-by-op", "deepseek4-op-by-op"])
def test_a_ring_gives_the_logits_of_a_cache_that_keeps_every_position(request, preset, graph):
    """A 700-token prompt in u-batches of 96 wraps the window layers' 512-row rings; then 30 decode steps. Every
    position's logits equal the --swa-full cache's (the same rows attended, in another order: 1e-5), and the window
    layers hold 512 rows, not 2048 (gpt-oss: its even layers; deepseek4: all, whose compressors' rings and entries
    are apart)."""
    path = request.getfixturevalue(preset)
    tokens = torch.randint(0, 1000, (700,), generator=torch.Generator().manual_seed(0)).tolist()
    full, big = _logits(path, True, graph, tokens, 30)
    ringed, small = _logits(path, False, graph, tokens, 30)
    windowed = [512, 2048, 512, 2048] if preset == "gpt_oss" else [512] * 4
    assert big.kv.ring == 0 and [a.shape[0] for a in big.kv.k] == [2048] * 4
    assert small.kv.ring == 512 and [a.shape[0] for a in small.kv.k] == windowed
    assert (ringed - full).abs().max() < 1e-5
    assert small.kv.n_bytes < big.kv.n_bytes


def test_server_slots_each_keep_a_ring(gpt_oss):
    """Two sequences through decode_sequences in mixed batches (as the server's steps: one's prompt chunk beside the
    other's) over rings that wrap: every row's logits equal those of the same batches over full caches."""
    gen = torch.Generator().manual_seed(1)
    a, b = (torch.randint(0, 2000, (n,), generator=gen).tolist() for n in (600, 560))
    out = {}
    for swa_full in (True, False):
        cfg = RunConfig(model=gpt_oss, n_ctx=2048, n_batch=64, n_ubatch=64, quiet=True, n_threads=2,
                        swa_full=swa_full)
        engine = load(cfg).engine(n_seq=2)
        assert engine.kv.ring == (0 if swa_full else 512)
        i, rows = [0, 0], []
        while i[0] < len(a) or i[1] < len(b):
            toks, seqs, pos = [], [], []
            for s, prompt, n in ((0, a, 40), (1, b, 24)):
                take = prompt[i[s]:i[s] + n]
                toks += take
                seqs += [s] * len(take)
                pos += list(range(i[s], i[s] + len(take)))
                i[s] += len(take)
            rows.append(engine.decode_sequences(toks, seqs, pos, 1024))
        out[swa_full] = torch.cat(rows)
    assert out[True].shape[0] == len(a) + len(b)
    assert (out[False] - out[True]).abs().max() < 1e-5


def _saved_at_a_prompt(path, seed: int, n_other: int):
    """An engine (rings of 512 rows at -ub 96) that holds a 600-token prompt, its state saved there (save_state); the
    prompt, 40 more tokens and n_other others; and a fresh run's logits for the 40 after the prompt."""
    gen = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(0, 1000, (n,), generator=gen).tolist() for n in (600, 40, n_other)]
    loaded = load(RunConfig(model=path, n_ctx=2048, n_batch=96, n_ubatch=96, quiet=True, n_threads=2))
    fresh = loaded.engine()
    fresh.decode(tokens[0])
    want = fresh.decode(tokens[1], all_logits=True)
    engine = loaded.engine()
    engine.decode(tokens[0])
    return engine, engine.save_state(), tokens, want


def test_a_sequence_cut_back_within_the_slack_goes_on_as_if_never_written_past(gpt_oss):
    """truncate within ring - window positions of what was written: the next tokens' logits equal a fresh run's;
    further back the rows are gone: refused without a saved state, served with one (save_state, as ferry sweep
    removes its generated tokens)."""
    engine, saved, (prompt, more, other), want = _saved_at_a_prompt(gpt_oss, 2, 300)
    engine.decode(other[:100])  # 100 past: within 512 - 8
    engine.truncate(len(prompt))
    assert (engine.decode(more, all_logits=True) - want).abs().max() < 1e-5
    engine.truncate(len(prompt))
    engine.decode(other + other[:210])  # 510 past: more than 512 - 8
    engine.truncate(len(prompt) + 300)  # what it has written counts, not where it is
    with pytest.raises(ValueError, match="no longer hold"):
        engine.truncate(len(prompt))
    engine.truncate(len(prompt), saved)
    assert (engine.decode(more, all_logits=True) - want).abs().max() < 1e-5


def test_the_plan_counts_the_rings_as_the_cache_holds_them(gpt_oss):
    """The memory plan's KV bytes are the cache's own, with rings (one sequence and three, several u-batch sizes)
    and with --swa-full; `ferry plan` says what the window layers keep and plans less than --swa-full."""
    from ferry.models import load_model

    f = GGUFFile(gpt_oss)
    model = load_model(f)
    sizes = {t.name: t.nbytes for t in f.tensors.values()}
    for swa_full in (False, True):
        model.swa_full = swa_full
        for n_ctx, n_seq, ub in ((4096, 1, 512), (4096, 3, 96), (600, 1, 512)):
            plan = memory_plan(sizes, model.args, 0, [], ["CUDA0"], {}, n_ctx, ub, cache=model.cache_layout(),
                               n_seq=n_seq)
            cache = KVCache.of(model.cache_layout(), model.args.n_layer, n_ctx, "f16", "f16", None, None, n_seq, ub)
            assert sum(d.kv_cache for d in plan.devices) == cache.n_bytes
            assert cache.ring == (0 if swa_full or n_ctx // n_seq <= 768 else 768 if ub == 512 else 512)

    def plan(*args):
        r = subprocess.run([sys.executable, "-m", "ferry", "plan", "-m", str(gpt_oss), "-ngl", "999", "--gpu-memory",
                            "CUDA0=8GiB", "-c", "4096", *args], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        return r.stdout

    text = plan()
    assert "the 2 sliding-window layers keep a ring of their last 8 positions" in text
    kv = [next(d["kv_cache"] for d in json.loads(plan("--json", *a))["devices"] if d["device"] == "CUDA0")
          for a in ((), ("--swa-full",))]
    assert kv[0] < kv[1]


def test_a_recurrent_models_saved_state_brings_its_rings_back(deepseek4):
    """deepseek4 (compressors' states and rings both): a state saved at 600 positions, then 600 more written (past the
    ring's slack), brings back the ring rows with the states: the next tokens' logits equal a fresh run's."""
    engine, saved, (prompt, more, other), want = _saved_at_a_prompt(deepseek4, 5, 600)
    engine.decode(other)
    engine.truncate(len(prompt), saved)
    assert engine.kv.ring == 512 and (engine.decode(more, all_logits=True) - want).abs().max() < 1e-5
