"""The server's slots: one thread owns the engine; each step it admits waiting requests into free slots
(prefilling their prompts) and then decodes one token for every generating slot in one batched forward."""

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
    slot: int = -1
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
                self._admit(self.pending.get())  # nothing to decode: wait for work
            while self.busy < len(self.slots) and not self.pending.empty():
                self._admit(self.pending.get_nowait())
            active = [r for r in self.slots if r is not None]
            for r in active:
                if r.cancelled.is_set():
                    self._free(r)
            active = [r for r in self.slots if r is not None]
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
        if r.cancelled.is_set():
            return
        r.slot = self.slots.index(None)
        self.slots[r.slot] = r
        r.t0 = time.perf_counter()
        try:
            r.sampler = Sampler(r.params)
            r.decoder = StreamDecoder(self.tok)
            ub = self.engine.n_ubatch
            for i in range(0, len(r.prompt), ub):
                chunk = r.prompt[i:i + ub]
                logits = self.engine.decode_sequences(chunk, [r.slot] * len(chunk), list(range(i, i + len(chunk))),
                                                      self.seq_len, all_logits=False)
        except Exception as e:
            self._emit(r, "error", str(e))
            self._free(r)
            return
        r.n_past = len(r.prompt)
        r.prompt_ms = 1000 * (time.perf_counter() - r.t0)
        r.t_gen = time.perf_counter()
        self.prompt_tokens_total += len(r.prompt)
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
        n = len(r.generated)
        self._emit(r, "done", {
            "finish_reason": reason,
            "usage": {"prompt_tokens": len(r.prompt), "completion_tokens": n, "total_tokens": len(r.prompt) + n},
            "timings": {"prompt_n": len(r.prompt), "prompt_ms": r.prompt_ms,
                        "prompt_per_second": 1000 * len(r.prompt) / r.prompt_ms if r.prompt_ms else 0.0,
                        "predicted_n": n, "predicted_ms": gen_ms,
                        "predicted_per_second": 1000 * n / gen_ms if gen_ms else 0.0}})
        self._free(r)

    def _free(self, r: Request) -> None:
        if 0 <= r.slot < len(self.slots) and self.slots[r.slot] is r:
            self.slots[r.slot] = None
