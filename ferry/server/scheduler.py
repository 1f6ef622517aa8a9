"""The server's slots: one thread owns the engine; each step it admits waiting requests into free slots, prefills one
u-batch of the earliest prompt not yet in, and decodes one token for every generating slot in one batched forward
(chunked prefill: a long prompt never stops the streams already running).

Prompt cache (llama-server's `cache_prompt`, on by default): each slot remembers the tokens its KV cache holds when
its request ends; a new request goes to the free slot holding the longest common prefix with its prompt and prefills
only the rest. A slot's attention reads its cache up to each token's position, so rows past the reused prefix are
simply written over."""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass, field

from ferry.runtime.sampling import Sampler, SamplingParams
from ferry.tokenizer import StreamDecoder


@dataclass
class Request:
    prompt: list[int]
    params: SamplingParams
    max_tokens: int  # -1: until end of generation or the slot's context
    stop: list[str]
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue  # ("text", piece) ... then ("done", info) or ("error", message)
    cancelled: threading.Event = field(default_factory=threading.Event)
    cache_prompt: bool = True  # reuse a slot's cached prefix of the prompt
    slot: int = -1
    n_cached: int = 0  # prompt tokens reused from the slot's cache (timings.cache_n)
    n_past: int = 0
    last: int = 0
    generated: list[int] = field(default_factory=list)
    text: str = ""
    sent: int = 0  # characters of text already emitted
    t0: float = 0.0
    prompt_ms: float = 0.0
    t_gen: float = 0.0
    decoder: StreamDecoder | None = None
    sampler: Sampler | None = None


class Scheduler:
    def __init__(self, engine, tokenizer, n_slots: int, seq_len: int):
        self.engine, self.tok, self.seq_len = engine, tokenizer, seq_len
        self.slots: list[Request | None] = [None] * n_slots
        self.held: list[list[int]] = [[] for _ in range(n_slots)]  # the tokens each slot's cache holds, in order
        self.pending: queue.Queue[Request] = queue.Queue()
        self.requests_total = 0
        self.prompt_tokens_total = 0
        self.predicted_tokens_total = 0
        self.thread = threading.Thread(target=self._run, name="ferry-scheduler", daemon=True)
        self.thread.start()

    @property
    def busy(self) -> int:
        return sum(r is not None for r in self.slots)

    def submit(self, r: Request) -> None:
        self.requests_total += 1
        self.pending.put(r)

    def _emit(self, r: Request, kind: str, payload) -> None:
        r.loop.call_soon_threadsafe(r.out.put_nowait, (kind, payload))

    def _run(self) -> None:
        while True:
            if self.busy == 0:
                self._admit(self.pending.get())  # nothing to do: wait for work
            while self.busy < len(self.slots) and not self.pending.empty():
                self._admit(self.pending.get_nowait())
            for r in [r for r in self.slots if r is not None and r.cancelled.is_set()]:
                self._free(r)
            # a step: one u-batch of the earliest prompt still prefilling, then one token of every generating slot, so
            # that a long prompt arriving delays the running streams by a u-batch per token, not by its whole prefill
            filling = [r for r in self.slots if r is not None and r.n_past < len(r.prompt)]
            if filling:
                self._prefill(min(filling, key=lambda r: r.t0))
            active = [r for r in self.slots if r is not None and r.n_past >= len(r.prompt)]
            if not active:
                continue
            try:
                logits = self.engine.decode_sequences([r.last for r in active], [r.slot for r in active],
                                                      [r.n_past for r in active], self.seq_len)
            except Exception as e:  # a failed step fails its requests, never the server
                for r in active:
                    self._emit(r, "error", str(e))
                    self._free(r)
                continue
            for r, row in zip(active, logits):
                r.n_past += 1
                self._accept(r, r.sampler(row, r.prompt + r.generated))

    def _admit(self, r: Request) -> None:
        """r into the free slot holding the longest prefix of its prompt; its prefill runs in the steps after."""
        if r.cancelled.is_set():
            return
        free = [i for i, s in enumerate(self.slots) if s is None]
        shared = {i: _common(self.held[i], r.prompt) if r.cache_prompt else 0 for i in free}
        r.slot = max(free, key=lambda i: (shared[i], -i))  # the longest cached prefix, else the first free slot
        # at least the prompt's last token is prefilled: its logits give the first generated token
        r.n_cached = r.n_past = min(shared[r.slot], len(r.prompt) - 1)
        self.slots[r.slot] = r
        r.t0 = time.perf_counter()
        r.sampler = Sampler(r.params)
        r.decoder = StreamDecoder(self.tok)

    def _prefill(self, r: Request) -> None:
        """The next u-batch of r's prompt into its slot's cache; after the last, its first token."""
        i = r.n_past
        chunk = r.prompt[i:i + self.engine.n_ubatch]
        try:
            logits = self.engine.decode_sequences(chunk, [r.slot] * len(chunk), list(range(i, i + len(chunk))),
                                                  self.seq_len, all_logits=False)
        except Exception as e:
            self._emit(r, "error", str(e))
            self._free(r)
            return
        r.n_past = i + len(chunk)
        if r.n_past < len(r.prompt):
            return
        r.prompt_ms = 1000 * (time.perf_counter() - r.t0)
        r.t_gen = time.perf_counter()
        self.prompt_tokens_total += len(r.prompt) - r.n_cached
        self._accept(r, r.sampler(logits[-1], r.prompt))

    def _accept(self, r: Request, token: int) -> None:
        if r.cancelled.is_set():
            self._free(r)
            return
        if self.tok.is_eog(token):
            return self._finish(r, "stop")
        r.generated.append(token)
        r.last = token
        self.predicted_tokens_total += 1
        r.text += r.decoder.add(token)
        for s in r.stop:
            at = r.text.find(s, max(0, r.sent - len(s)))
            if at >= 0:
                r.text = r.text[:at]
                return self._finish(r, "stop")
        hold = max((len(s) - 1 for s in r.stop), default=0)  # a stop string may be starting: hold its length back
        if len(r.text) - hold > r.sent:
            self._emit(r, "text", r.text[r.sent:len(r.text) - hold])
            r.sent = len(r.text) - hold
        if 0 <= r.max_tokens <= len(r.generated) or r.n_past + 1 >= self.seq_len:
            self._finish(r, "length")

    def _finish(self, r: Request, reason: str) -> None:
        if len(r.text) > r.sent:
            self._emit(r, "text", r.text[r.sent:])
            r.sent = len(r.text)
        gen_ms = 1000 * (time.perf_counter() - r.t_gen)
        n, prompt_n = len(r.generated), len(r.prompt) - r.n_cached
        self._emit(r, "done", {
            "finish_reason": reason,
            "usage": {"prompt_tokens": len(r.prompt), "completion_tokens": n, "total_tokens": len(r.prompt) + n},
            "timings": {"cache_n": r.n_cached, "prompt_n": prompt_n, "prompt_ms": r.prompt_ms,
                        "prompt_per_second": 1000 * prompt_n / r.prompt_ms if r.prompt_ms else 0.0,
                        "predicted_n": n, "predicted_ms": gen_ms,
                        "predicted_per_second": 1000 * n / gen_ms if gen_ms else 0.0}})
        self._free(r)

    def _free(self, r: Request) -> None:
        if 0 <= r.slot < len(self.slots) and self.slots[r.slot] is r:
            # what the cache holds: positions 0..n_past - 1 (the last token sampled was never fed; a prompt cut in its
            # prefill, the part that was in)
            self.held[r.slot] = (r.prompt + r.generated)[:r.n_past]
            self.slots[r.slot] = None


def _common(a: list[int], b: list[int]) -> int:
    """The length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
