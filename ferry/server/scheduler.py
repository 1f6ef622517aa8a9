"""The server's slots: one thread owns the engine; each step it admits waiting requests into free slots and decodes one
token for every generating slot in one batched forward, into which it mixes the next chunk of the earliest prompt not
yet in (chunked prefill: a long prompt never stops the streams already running). Prompt tokens get PREFILL_SHARE of
the decode steps' time: each decode step earns that share of its time as credit, each mixed step spends what it took
beyond a decode step, and a chunk is mixed in only while the credit lasts. So running streams keep 1 / 1.4 = 71% of
their speed while a prompt fills, whatever a mixed step's fixed costs. The chunk grows while a mixed step takes less
than two decode steps and halves past 2.5 (few, larger chunks spread a mixed step's fixed cost; no stream waits more
than about twice its usual gap). -b N mixes N prompt tokens into every step instead; with no stream running, a prompt is
prefilled in whole u-batches (-b of them at most a step).

Prompt cache (llama-server's `cache_prompt`, on by default): each slot remembers the tokens its KV cache holds when
its request ends; a new request goes to the free slot holding the longest common prefix with its prompt and prefills
only the rest. A slot's attention reads its cache up to each token's position, so rows past the reused prefix are
simply written over. RAM prompt cache (llama-server's --cache-ram): before a slot's cached tokens are written over, they
and their cache rows are copied to RAM (least recently used dropped beyond the budget); a request whose prompt shares
more with such a copy than with any free slot gets it copied back into its slot first.

Each generated token goes out with its text as a record (id, the text it ended, and with `logprobs` >= 0 its log
probability and the `logprobs` likeliest tokens', from the softmax of the model's logits before any sampler, as
llama-server's n_probs and OpenAI's logprobs report them); a token whose text a stop string cut is not sent."""

from __future__ import annotations

import asyncio
import math
import queue
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field

import torch

from ferry.runtime.sampling import Sampler, SamplingParams
from ferry.tokenizer import StreamDecoder

PREFILL_SHARE = 0.4  # a mixed step's prompt tokens may cost this share of a decode step: streams keep 1 / 1.4 = 71%
EMA = 0.3  # weight of the newest measurement in the step costs' running averages


@dataclass
class Request:
    prompt: list[int]
    params: SamplingParams
    max_tokens: int  # -1: until end of generation or the slot's context; 0: the prompt into the cache, nothing more
    stop: list[str]
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue  # ("text", piece) ... then ("done", info) or ("error", message)
    cancelled: threading.Event = field(default_factory=threading.Event)
    cache_prompt: bool = True  # reuse a slot's cached prefix of the prompt
    logprobs: int = -1  # >= 0: each token's log probability and that many alternatives'
    ignore_eos: bool = False  # llama-server's: the end-of-generation tokens never sampled; it ends at its limit
    slot: int = -1
    n_cached: int = 0  # prompt tokens reused from the slot's cache (timings.cache_n)
    n_past: int = 0
    last: int = 0
    generated: list[int] = field(default_factory=list)
    text: str = ""
    sent: int = 0  # characters of text already emitted
    records: list[dict] = field(default_factory=list)  # generated tokens not yet emitted (Scheduler._record)
    t0: float = 0.0
    prompt_ms: float = 0.0
    t_gen: float = 0.0
    decoder: StreamDecoder | None = None
    sampler: Sampler | None = None


class Scheduler:
    def __init__(self, engine, tokenizer, n_slots: int, seq_len: int, n_batch: int = 0, cache_ram: int = 0):
        """n_batch: -b, the prompt tokens mixed into every step (0: as the credit allows); with no slot generating, a
        step prefills max(n_batch, u-batch) prompt tokens in u-batches. cache_ram: bytes of slot states the RAM prompt
        cache keeps (0: none, -1: no limit)."""
        self.engine, self.tok, self.seq_len = engine, tokenizer, seq_len
        self.n_batch = n_batch
        self.step_tokens = max(n_batch, engine.n_ubatch)
        self.decode_s: float | None = None  # a decode-only step's seconds (running average)
        self.chunk = 1  # prompt tokens a mixed step takes (without -b), adapted to the steps' times
        self.credit = 0.0  # seconds of prompt work the decode steps have earned (PREFILL_SHARE of theirs)
        self.cache_ram = 0 if engine.recurrent else cache_ram  # RAM copies hold KV rows, not recurrent states
        # RAM copies (tokens, cache rows, bytes, reach: the positions their rings may hold), oldest use first
        self.saved: list[tuple[list[int], list, int, int]] = []
        self.slots: list[Request | None] = [None] * n_slots
        self.held: list[list[int]] = [[] for _ in range(n_slots)]  # the tokens each slot's cache holds, in order
        # per slot, the positions written since it last started from 0: a ring (KVCache.ring) may hold up to these,
        # and goes on from a shorter prefix only where KVCache.resumable says so
        self.reach = [0] * n_slots
        self.used = [0.0] * n_slots  # when each slot last ended a request (0: never)
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
            try:
                if self.busy == 0:
                    self._admit(self.pending.get())  # nothing to do: wait for work
                self._step()
            except Exception as e:  # a fault outside the forward (caught in _step) fails the requests in the slots
                print(f"ferry serve: a step failed: {e!r}; its requests get the error, the server goes on",
                      file=sys.stderr)
                traceback.print_exc()
                for r in [r for r in self.slots if r is not None]:
                    self._emit(r, "error", f"the server failed this request: {e}")
                    self._free(r)

    def _step(self) -> None:
        """One step: admit what waits for a free slot, drop cancelled requests, then one forward (below)."""
        while self.busy < len(self.slots) and not self.pending.empty():
            self._admit(self.pending.get_nowait())
        for r in [r for r in self.slots if r is not None and r.cancelled.is_set()]:
            self._free(r)
        # a step: one token of every generating slot, with a chunk of the earliest prompt still prefilling mixed
        # in, so that a long prompt arriving slows the running streams by a bounded share, never stops them
        filling = [r for r in self.slots if r is not None and r.n_past < len(r.prompt)]
        active = [r for r in self.slots if r is not None and r.n_past >= len(r.prompt)]
        first = min(filling, key=lambda r: r.t0) if filling else None
        k = 0
        if first and (not active or self.n_batch > self.engine.n_ubatch - len(active)):
            self._prefill(first)  # no stream to keep going, or -b more than a forward holds beside them
            active = [r for r in self.slots if r is not None and r.n_past >= len(r.prompt)]
        elif first and (self.n_batch or (self.credit >= 0 and self.decode_s is not None)):
            k = self._chunk(first, len(active))
        if not active:
            return
        # the prompt's chunk first, the generating slots' tokens last: logits for the last rows only (the chunk's
        # last too where it ends the prompt)
        i, slot = (first.n_past, first.slot) if k else (0, 0)
        ends = bool(k) and i + k == len(first.prompt)
        tokens = (first.prompt[i:i + k] if k else []) + [r.last for r in active]
        seqs = [slot] * k + [r.slot for r in active]
        positions = list(range(i, i + k)) + [r.n_past for r in active]
        t0 = time.perf_counter()
        try:
            logits = self.engine.decode_sequences(tokens, seqs, positions, self.seq_len,
                                                  tail=len(active) + ends)
        except Exception as e:  # a failed step fails its requests, never the server
            for r in active + ([first] if k else []):
                self._emit(r, "error", str(e))
                self._free(r)
            return
        self._measured(time.perf_counter() - t0, k)
        for r, row in zip(active, logits[int(ends):]):
            r.n_past += 1
            self._accept(r, self._sample(r, row, r.prompt + r.generated), row)
        if k:
            first.n_past += k
            if ends:
                self._prompt_done(first, logits[0])

    def _chunk(self, r: Request, n_active: int) -> int:
        """The prompt tokens of r a step mixes in beside n_active generating slots': -b's, else the adapted chunk."""
        return min(self.n_batch or self.chunk, self.engine.n_ubatch - n_active, len(r.prompt) - r.n_past)

    def _measured(self, seconds: float, k: int) -> None:
        """A step's time: a decode-only step's into its running average and, as PREFILL_SHARE of it, the credit
        (at most two decode steps' worth kept); a mixed step's beyond a decode step out of the credit, and the chunk
        grown or halved by it."""
        if not k:
            self.decode_s = seconds if self.decode_s is None else (1 - EMA) * self.decode_s + EMA * seconds
            self.credit = min(self.credit + PREFILL_SHARE * seconds, 2 * PREFILL_SHARE * self.decode_s)
        elif self.decode_s is not None:
            extra = max(seconds - self.decode_s, 0.0)
            self.credit -= extra
            if extra < self.decode_s and k == self.chunk:
                self.chunk += max(1, self.chunk // 2)
            elif extra > 1.5 * self.decode_s:
                self.chunk = max(1, min(self.chunk, k) // 2)

    def _admit(self, r: Request) -> None:
        """r into the free slot holding the longest prefix of its prompt; its prefill runs in the steps after."""
        if r.cancelled.is_set():
            return
        free = [i for i, s in enumerate(self.slots) if s is None]
        shared = {i: self._usable(_common(self.held[i], r.prompt), self.reach[i], r.prompt) if r.cache_prompt else 0
                  for i in free}
        # the longest cached prefix, else the slot used longest ago (an empty one first): the least cache written over
        r.slot = max(free, key=lambda i: (shared[i], -self.used[i], -i))
        self.slots[r.slot] = r  # in its slot first: a fault from here on fails it (_run) rather than losing it
        if self.cache_ram:  # a request that reuses nothing (cache_prompt false) still keeps what it writes over
            shared[r.slot] = self._from_ram(r.slot, r.prompt if r.cache_prompt else [], shared[r.slot])
        # at least the prompt's last token is prefilled: its logits give the first generated token
        r.n_cached = r.n_past = min(shared[r.slot], len(r.prompt) - 1)
        if self.engine.recurrent and r.n_past < len(self.held[r.slot]):  # a state holds all the slot's tokens or none
            r.n_cached = r.n_past = 0
        if not r.n_past:
            self.reach[r.slot] = 0
        r.t0 = time.perf_counter()
        r.sampler = Sampler(r.params)
        r.decoder = StreamDecoder(self.tok)

    def _usable(self, common: int, reach: int, prompt: list[int]) -> int:
        """A cached prefix of `common` tokens of the prompt, or 0 where the cache's rings (written up to `reach`)
        no longer hold what precedes the position the request goes on from (KVCache.resumable)."""
        return common if self.engine.kv.resumable(min(common, len(prompt) - 1), reach) else 0

    def _from_ram(self, slot: int, prompt: list[int], shared: int) -> int:
        """Keep the slot's state in RAM where the prompt shares less than half of it (a conversation's own next turn or
        edit keeps most, and is not copied); where a RAM copy shares more of the prompt than the slot, copy that back
        into the slot (set aside first, so that keeping the slot's state never drops it). The tokens of the prompt the
        slot then holds."""
        commons = [self._usable(_common(e[0], prompt), e[3], prompt) for e in self.saved]
        best = max(range(len(commons)), key=commons.__getitem__, default=None)
        n = commons[best] if best is not None else 0
        entry = self.saved.pop(best) if n > shared else None
        if 2 * shared < len(self.held[slot]):  # the request keeps less than half of the slot's state: keep it all
            self._to_ram(slot, self.held[slot])
        if entry is None:
            return shared
        self.engine.kv.put_rows(slot, entry[1], n)
        self.held[slot] = entry[0][:n]
        self.reach[slot] = entry[3]
        self.saved.append(entry)  # used last
        self._trim()
        return n

    def _to_ram(self, slot: int, held: list[int]) -> None:
        """A copy of the slot's cached tokens in RAM, unless one already holds them all; copies they extend go."""
        if any(_common(e[0], held) == len(held) for e in self.saved):
            return
        rows = self.engine.kv.copy_rows(slot, len(held))
        nbytes = sum(r.nbytes for r in rows)
        if 0 <= self.cache_ram < nbytes:
            return
        self.saved = [e for e in self.saved if _common(e[0], held) < len(e[0])]
        self.saved.append((list(held), rows, nbytes, max(self.reach[slot], len(held))))
        self._trim()

    def _trim(self) -> None:
        """The least recently used copies dropped until the rest fit --cache-ram."""
        while self.cache_ram >= 0 and sum(e[2] for e in self.saved) > self.cache_ram:
            self.saved.pop(0)

    def _prefill(self, r: Request) -> None:
        """The next step_tokens of r's prompt into its slot's cache, u-batch by u-batch; after the last, its first
        token."""
        end = min(len(r.prompt), r.n_past + self.step_tokens)
        while r.n_past < end:
            i = r.n_past
            chunk = r.prompt[i:min(end, i + self.engine.n_ubatch)]
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
        self._prompt_done(r, logits[-1])

    def _prompt_done(self, r: Request, row: torch.Tensor) -> None:
        """r's prompt is all in its slot's cache: its timings, then its first token from the last prompt row."""
        r.prompt_ms = 1000 * (time.perf_counter() - r.t0)
        r.t_gen = time.perf_counter()
        self.prompt_tokens_total += len(r.prompt) - r.n_cached
        if r.max_tokens == 0:  # llama-server's n_predict 0: the prompt evaluated into the cache, no token
            return self._finish(r, "length")
        self._accept(r, self._sample(r, row, r.prompt), row)

    def _sample(self, r: Request, row: torch.Tensor, history: list[int]) -> int:
        """r's next token from its row of logits; with ignore_eos the end-of-generation tokens ruled out first."""
        if r.ignore_eos and self.tok.eog_ids:
            row = row.clone()
            row[sorted(self.tok.eog_ids)] = -float("inf")
        return r.sampler(row, history)

    def _accept(self, r: Request, token: int, row: torch.Tensor) -> None:
        if r.cancelled.is_set():
            self._free(r)
            return
        if self.tok.is_eog(token):
            return self._finish(r, "stop", "eos")
        r.generated.append(token)
        r.last = token
        self.predicted_tokens_total += 1
        start = len(r.text)
        r.text += r.decoder.add(token)
        r.records.append(self._record(r, token, row, start))
        for s in r.stop:
            at = r.text.find(s, max(0, r.sent - len(s)))
            if at >= 0:
                r.text = r.text[:at]
                return self._finish(r, "stop", "word", s)
        hold = max((len(s) - 1 for s in r.stop), default=0)  # a stop string may be starting: hold its length back
        self._flush(r, len(r.text) - hold)
        if 0 <= r.max_tokens <= len(r.generated) or r.n_past + 1 >= self.seq_len:
            self._finish(r, "length")

    def _record(self, r: Request, token: int, row: torch.Tensor, start: int) -> dict:
        """What goes out with a generated token: its id, where its text starts and ends in the completion, and with
        r.logprobs >= 0 its log probability and the r.logprobs likeliest tokens' (id, logprob)."""
        rec = {"id": token, "start": start, "end": len(r.text)}
        if r.logprobs >= 0:
            lp = torch.log_softmax(row.float(), -1)
            rec["logprob"] = _finite(lp[token].item())
            if r.logprobs:
                top = torch.topk(lp, min(r.logprobs, lp.numel()))
                rec["top"] = [(int(i), _finite(v)) for v, i in zip(top.values.tolist(), top.indices.tolist())]
        return rec

    def _flush(self, r: Request, upto: int) -> None:
        """Emit the completion's text up to character `upto` with the records of the tokens whose text ends there."""
        done = 0
        while done < len(r.records) and r.records[done]["end"] <= upto:
            done += 1
        if upto > r.sent or done:
            self._emit(r, "text", (r.text[r.sent:max(upto, r.sent)], r.records[:done]))
            r.sent, r.records = max(upto, r.sent), r.records[done:]

    def _finish(self, r: Request, reason: str, why: str = "limit", word: str = "") -> None:
        """End r: `reason` as OpenAI's finish_reason, `why` as llama-server's stop_type (eos, limit, word) with the
        stop string that ended it."""
        self._flush(r, len(r.text))
        gen_ms = 1000 * (time.perf_counter() - r.t_gen)
        n, prompt_n = len(r.generated), len(r.prompt) - r.n_cached
        self._emit(r, "done", {
            "finish_reason": reason, "stop_type": why, "stopping_word": word,
            "truncated": why == "limit" and r.n_past + 1 >= self.seq_len,
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
            self.reach[r.slot] = max(self.reach[r.slot], r.n_past)
            self.used[r.slot] = time.perf_counter()
            self.slots[r.slot] = None


def _finite(v: float) -> float:
    """A log probability JSON can carry: -inf (a token the logits rule out) as the lowest float."""
    return v if math.isfinite(v) else -3.4028234663852886e38


def _common(a: list[int], b: list[int]) -> int:
    """The length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
