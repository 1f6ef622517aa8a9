"""The server's scheduler on an engine that records its calls: a long prompt is prefilled one u-batch per step between
the decode steps of the streams already running (chunked prefill), and the prompt cache prefills only what a slot
does not hold."""

import asyncio
import threading
import time

import numpy as np
import torch

from ferry.runtime.sampling import SamplingParams
from ferry.server.scheduler import Request, Scheduler

VOCAB = 50


class RecordingEngine:
    """decode_sequences as the engine's: logits rows (one per token, the last with all_logits=False, the last tail with
    tail) whose argmax is the next token id (position + 1, below VOCAB); every call recorded as (kind, slots, first position, tokens)."""

    n_ubatch = 4
    recurrent = False  # an attention model's cache: any prefix of a slot's tokens is reusable
    kv = None  # set below: a cache that keeps every position

    def __init__(self, step_s=0.002, token_s=0.0):
        self.calls: list[tuple] = []
        self.positions: list[tuple] = []  # each call's positions
        self.lock = threading.Lock()
        self.step_s, self.token_s = step_s, token_s  # what a call takes: step_s and token_s per token

    def decode_sequences(self, tokens, slots, positions, seq_len, all_logits=True, tail=0):
        with self.lock:
            kind = "prefill" if not all_logits else "decode"
            self.calls.append((kind, tuple(slots), positions[0], len(tokens)))
            self.positions.append(tuple(positions))
        wanted = positions[-tail:] if tail else positions if all_logits else positions[-1:]
        rows = torch.zeros(len(wanted), VOCAB)
        for i, p in enumerate(wanted):
            rows[i, (p + 1) % (VOCAB - 1) + 1] = 1.0  # never 0, the end of generation
        time.sleep(self.step_s + self.token_s * len(tokens))
        return rows


class Tok:
    eog_ids = {0}

    def decode(self, ids):
        return "".join(chr(ord("a") + i % 26) for i in ids)

    def is_eog(self, token):
        return token in self.eog_ids


def _request(loop, prompt, max_tokens, **kw):
    return Request(list(prompt), SamplingParams(temp=0), max_tokens, [], loop, asyncio.Queue(), **kw)


def _done(loop, r, timeout=10.0):
    async def wait():
        while True:
            what, payload = await asyncio.wait_for(r.out.get(), timeout)
            if what != "text":
                return what, payload
    return loop.run_until_complete(wait())


def test_a_long_prompt_is_mixed_into_the_running_streams_steps_in_chunks_their_cost_allows():
    """While a stream runs, the new prompt goes in as chunks mixed into the stream's steps (never a forward apart),
    its tokens once each and in order; the chunk starts at one token and grows while a mixed step costs less than two
    decode steps (here a step 4 ms and a token 0.5 ms: up to 13 tokens)."""
    engine, loop = RecordingEngine(step_s=0.004, token_s=0.0005), asyncio.new_event_loop()
    engine.n_ubatch = 16
    sched = Scheduler(engine, Tok(), 2, 256)
    running = _request(loop, [1, 2, 3], 80)
    sched.submit(running)
    while sum(c[0] == "decode" for c in engine.calls) < 5:
        time.sleep(0.001)
    long = _request(loop, range(1, 41), 2)
    sched.submit(long)
    assert _done(loop, long)[0] == "done" and _done(loop, running)[0] == "done"
    mixed = [(c, p) for c, p in zip(engine.calls, engine.positions) if long.slot in c[1]]
    assert all(c[0] == "decode" and running.slot in c[1] for c, p in mixed)  # never a prefill apart from it
    fed = [pos for c, p in mixed for slot, pos in zip(c[1], p) if slot == long.slot]
    assert fed[:40] == list(range(40))
    chunks = [sum(slot == long.slot and pos < 40 for slot, pos in zip(c[1], p)) for c, p in mixed]
    chunks = [k for k in chunks if k]  # the prompt's, not its tokens generated after
    assert chunks[0] == 1 and chunks[:-1] == sorted(chunks[:-1]) and 6 <= max(chunks) <= 15, chunks
    loop.close()


def test_dash_b_lets_a_step_prefill_several_u_batches_before_the_next_decode():
    engine, loop = RecordingEngine(), asyncio.new_event_loop()
    sched = Scheduler(engine, Tok(), 2, 256, n_batch=10)  # 10 tokens a step: u-batches of 4, 4 and 2
    running = _request(loop, [1, 2, 3], 60)
    sched.submit(running)
    while not any(c[0] == "decode" for c in engine.calls):
        time.sleep(0.001)
    long = _request(loop, range(1, 26), 2)  # 25 tokens: steps of 10, 10 and 5
    sched.submit(long)
    assert _done(loop, long)[0] == "done" and _done(loop, running)[0] == "done"
    calls = [c for c in engine.calls if c[0] == "decode" or c[1][0] == long.slot]
    first = next(i for i, c in enumerate(calls) if c[0] == "prefill")
    steps, step = [], []
    for c in calls[first:]:
        if c[0] == "prefill":
            step.append((c[2], c[3]))
        elif step:
            steps.append(step)
            step = []
    assert steps == [[(0, 4), (4, 4), (8, 2)], [(10, 4), (14, 4), (18, 2)], [(20, 4), (24, 1)]]
    loop.close()


def test_the_prompt_cache_prefills_only_what_the_slot_does_not_hold():
    engine, loop = RecordingEngine(), asyncio.new_event_loop()
    sched = Scheduler(engine, Tok(), 2, 256)
    first = _request(loop, range(1, 11), 5)
    sched.submit(first)
    _, info = _done(loop, first)
    assert info["timings"]["cache_n"] == 0 and info["timings"]["prompt_n"] == 10
    # the next turn: the first prompt, its answer (5 tokens, the last never fed to the cache), then new text
    held = list(range(1, 11)) + first.generated[:4]
    second = _request(loop, held + [7, 8, 9], 3)
    before = len(engine.calls)
    sched.submit(second)
    _, info = _done(loop, second)
    assert second.slot == first.slot and info["timings"]["cache_n"] == len(held)
    assert info["timings"]["prompt_n"] == 3 and info["usage"]["prompt_tokens"] == len(held) + 3
    prefills = [c for c in engine.calls[before:] if c[0] == "prefill"]
    assert prefills == [("prefill", (second.slot,) * 3, len(held), 3)]
    # without cache_prompt the whole prompt is prefilled again
    third = _request(loop, held + [7, 8, 9], 3, cache_prompt=False)
    sched.submit(third)
    _, info = _done(loop, third)
    assert info["timings"]["cache_n"] == 0 and info["timings"]["prompt_n"] == len(held) + 3
    loop.close()


class EndingEngine(RecordingEngine):
    """Rows whose likeliest token is always 0, the end of generation; RecordingEngine's next token second."""

    def decode_sequences(self, tokens, slots, positions, seq_len, all_logits=True, tail=0):
        rows = super().decode_sequences(tokens, slots, positions, seq_len, all_logits, tail)
        rows[:, 0] = 2.0
        return rows


def test_ignore_eos_rules_the_end_of_generation_out_and_runs_to_the_limit():
    """llama-server's ignore_eos: where the end of generation is the likeliest token, a request without it ends at
    once (stop, eos), one with it samples the next likeliest every step and ends at its max_tokens."""
    loop = asyncio.new_event_loop()
    sched = Scheduler(EndingEngine(), Tok(), 1, 256)
    ends = _request(loop, range(1, 6), 4)
    sched.submit(ends)
    _, info = _done(loop, ends)
    assert info["finish_reason"] == "stop" and info["stop_type"] == "eos" and ends.generated == []
    goes_on = _request(loop, range(1, 6), 4, ignore_eos=True)
    sched.submit(goes_on)
    _, info = _done(loop, goes_on)
    assert info["finish_reason"] == "length" and len(goes_on.generated) == 4 and 0 not in goes_on.generated
    loop.close()


class RowsKV:
    """A KV cache of one float per position (its token) for one slot, for the RAM prompt cache's copies; `slack`: a
    ring's (KVCache.resumable: a sequence goes on from n_past only while what it held passes that by at most this)."""

    def __init__(self, n: int, slack: int | None = None):
        self.rows = np.zeros(n)
        self.slack = slack

    def copy_rows(self, seq, n):
        return [self.rows[:n].copy()]

    def put_rows(self, seq, rows, n):
        self.rows[:n] = rows[0][:n]

    def resumable(self, n_past, held):
        return self.slack is None or held - n_past <= self.slack


RecordingEngine.kv = RowsKV(0)


def test_the_ram_cache_keeps_the_most_recently_used_states_within_its_budget():
    """One slot, four conversations in turn: each written over goes to RAM (8 bytes a position here); a budget of
    two conversations' states drops the least recently used, and a state copied back holds the rows it left with."""
    engine, loop = RecordingEngine(), asyncio.new_event_loop()
    engine.kv = RowsKV(256)
    sched = Scheduler(engine, Tok(), 1, 256, cache_ram=8 * 2 * 12)

    def ask(prompt):
        r = _request(loop, prompt, 2)
        sched.submit(r)
        return _done(loop, r)[1]["timings"]["cache_n"]

    for c in (3, 4, 5, 6):
        assert ask([c] * 10) == 0
        engine.kv.rows[:10] = c  # what this conversation's prefill wrote
    # each state: its 10 tokens and the first generated (the second was never fed); the first state dropped
    assert [(t[0], len(t)) for t, *_ in sched.saved] == [(4, 11), (5, 11)]
    assert ask([4] * 10 + [9]) == 10 and engine.kv.rows[0] == 4  # copied back, its rows with it
    assert [t[0] for t, *_ in sched.saved] == [6, 4]  # 6's state kept, 5's dropped, 4's used last
    assert ask([3] * 10 + [9]) == 0  # long gone
    loop.close()


def test_a_request_that_reuses_nothing_still_keeps_what_it_writes_over_in_ram():
    """cache_prompt false: the request prefills its whole prompt, and the conversation it writes over in the one slot
    comes back from RAM for that conversation's next turn."""
    engine, loop = RecordingEngine(), asyncio.new_event_loop()
    engine.kv = RowsKV(256)
    sched = Scheduler(engine, Tok(), 1, 256, cache_ram=1 << 20)

    def ask(prompt, **kw):
        r = _request(loop, prompt, 2, **kw)
        sched.submit(r)
        return _done(loop, r)[1]["timings"]["cache_n"]

    assert ask([3] * 10) == 0
    assert ask([3] * 10, cache_prompt=False) == 0  # its own prompt, not reused
    assert ask([4] * 10, cache_prompt=False) == 0
    assert ask([3] * 10 + [9]) == 10  # back from RAM
    loop.close()


def test_a_ring_cache_is_reused_only_where_it_still_holds_the_prefix_s_last_window():
    """A sliding-window model's ring (KVCache.resumable, here a slack of 4): a prefix serves only where the slot (or
    a RAM copy) has written at most 4 positions past it; further back, the prompt is prefilled from position 0."""
    engine, loop = RecordingEngine(), asyncio.new_event_loop()
    engine.kv = RowsKV(256, slack=4)
    sched = Scheduler(engine, Tok(), 1, 256, cache_ram=1 << 20)

    def ask(prompt):
        r = _request(loop, prompt, 2)
        before = len(engine.calls)
        sched.submit(r)
        cached = _done(loop, r)[1]["timings"]["cache_n"]
        return r, cached, [c for c in engine.calls[before:] if c[0] == "prefill"][0][2]

    first, cached, start = ask(list(range(1, 21)))
    assert cached == 0 and start == 0
    held = list(range(1, 21)) + first.generated[:1]  # 21 positions written
    second, cached, start = ask(held + [30, 31])
    assert cached == start == 21  # goes on from all it held; 24 positions written now
    third, cached, start = ask(held + [50])
    assert cached == start == 21  # 3 behind what was written: within the slack
    assert ask(list(range(1, 11)) + [41, 42])[1:] == (0, 0)  # 14 behind: prefilled whole
    # the third's state went to RAM (the fourth kept less than half of it), with the 24 positions its ring had seen
    kept = held + [50] + third.generated[:1]
    assert ask(kept + [60])[1] == len(kept)  # from RAM: 1 behind those 24
    # the slot (and its RAM copy, made now) have written 25: a prefix of 12 is 13 behind, prefilled whole
    assert ask(kept[:12] + [61])[1] == 0
    assert [(len(e[0]), e[3]) for e in sched.saved] == [(25, 25)]
    loop.close()
