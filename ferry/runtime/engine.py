"""The engine: one sequence's KV cache, prompts split into batches and u-batches (llama.cpp's -b/-ub),
generation with a sampler, and llama.cpp-style timings."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from ferry.errors import FerryError
from ferry.models.base import Model
from ferry.runtime.runners.eager import EagerRunner
from ferry.runtime.runners.ggml_graph import GgmlGraphRunner
from ferry.runtime.batch import Batch, count_hits
from ferry.runtime.kv_cache import KVCache
from ferry.runtime.sampling import Sampler


@dataclass
class Timings:
    load_ms: float = 0.0
    prompt_ms: float = 0.0
    prompt_tokens: int = 0
    eval_ms: float = 0.0
    eval_tokens: int = 0

    def lines(self) -> list[str]:
        def rate(ms: float, n: int, unit: str) -> str:
            per = ms / n if n else 0.0
            tps = 1000.0 * n / ms if ms else 0.0
            return f"{ms:10.2f} ms / {n:5d} {unit} ({per:8.2f} ms per token, {tps:8.2f} tokens per second)"

        return [
            f"ferry:        load time = {self.load_ms:10.2f} ms",
            f"ferry: prompt eval time = {rate(self.prompt_ms, self.prompt_tokens, 'tokens')}",
            f"ferry:        eval time = {rate(self.eval_ms, self.eval_tokens, 'runs  ')}",
            f"ferry:       total time = {self.prompt_ms + self.eval_ms:10.2f} ms / {self.prompt_tokens + self.eval_tokens:5d} tokens",
        ]


@dataclass
class Generation:
    tokens: list[int]
    stopped_by: str  # "eog" | "length" | "context"
    timings: Timings
    experts_hit: list[list[int]] = field(default_factory=list)  # per prompt u-batch, per MoE layer


class Engine:
    """`graph`: run each u-batch as one ggml graph where the KV cache is in host memory (the CPU-only path); otherwise
    op by op (TorchOps).
    `layer_first`: run a logical batch of several u-batches layer by layer (Model.forward_layer_first), so that
    weights kept in RAM cross PCIe once per batch; default: where the backend keeps routed experts in RAM.
    `n_seq`: the sequences (server slots) a recurrent model keeps a state for."""

    def __init__(self, model: Model, backend, n_ctx: int = 4096, n_batch: int = 2048, n_ubatch: int = 512,
                 type_k: str = "f16", type_v: str = "f16", graph: bool = True, layer_first: bool | None = None,
                 n_seq: int = 1):
        a = model.args
        if n_ctx <= 0:
            n_ctx = a.n_ctx_train  # llama.cpp: -c 0 takes the model's training context
        for flag, v in (("-c/--ctx-size", n_ctx), ("-b/--batch-size", n_batch), ("-ub/--ubatch-size", n_ubatch)):
            if v < 1:
                raise FerryError(f"{flag} must be at least 1, got {v}")
        self.model = model
        self.n_ctx = n_ctx
        self.n_batch = n_batch
        self.n_ubatch = min(n_ubatch, n_batch)
        devices = backend.kv_devices(a.n_layer)  # None: host memory, for ggml's graphs
        self.kv = KVCache.of(model.cache_layout(), a.n_layer, n_ctx, type_k, type_v,
                             None if devices is None else [str(d) for d in devices], model.state_layout(), n_seq,
                             self.n_ubatch)
        self.runner = _runner(backend, devices, graph and model.ggml_graph)
        layer_first = backend.layer_first if layer_first is None else layer_first
        self.layer_first = layer_first and self.runner.layer_first
        self.n_past = 0
        self.reach = 0  # the positions written since the sequence last started from 0 (a ring may hold up to these)
        self._hits: list[list[int]] = []
        self._routing: list[list[torch.Tensor]] = []  # prompt u-batches' routing on its way to the host

    def reset(self) -> None:
        self.n_past = self.reach = 0
        self._hits.clear()
        self._routing.clear()  # not counted: nothing waits for the GPU to drop it

    @property
    def experts_hit(self) -> list[list[int]]:
        """Per prompt u-batch since the last reset, per MoE layer: how many distinct experts it routed to. Reading
        it waits for the GPU; the forward itself never does (a host sync per u-batch would drain the GPU's queue)."""
        self.take_routing()
        return self._hits

    def take_routing(self) -> list[list[torch.Tensor]]:
        """The routing of each prompt u-batch since the last reset or take, per MoE layer its (n_tokens,
        n_expert_used) expert ids on the host (waits for the GPU); counted into experts_hit as well."""
        routing = self._routing
        if routing:
            if torch.cuda.is_initialized():
                for d in range(torch.cuda.device_count()):
                    torch.cuda.synchronize(d)
            self._hits.extend(count_hits(ids) for ids in routing)
            self._routing = []
        return routing

    @property
    def recurrent(self) -> bool:
        """Whether layers keep a recurrent state, which holds every position at once: the sequence can be cut back
        only to its start (truncate), not to an earlier position."""
        return self.kv.recurrent

    def save_state(self) -> tuple[int, list, int] | None:
        """A copy of the recurrent state (and a ring's rows: they may be written over) as it is now, for truncate;
        None where the cache holds neither."""
        if self.recurrent:
            return self.n_past, self.kv.copy_state(), self.reach
        return (self.n_past, self.kv.copy_rows(0, self.n_past), self.reach) if self.kv.ring else None

    def keeps(self, n_past: int) -> bool:
        """Whether the sequence can go back to n_past without a saved state (truncate): always to its start or where
        it is; a recurrent state never elsewhere; a ring within its slack (KVCache.resumable)."""
        if n_past in (0, self.n_past):
            return True
        return not self.recurrent and self.kv.resumable(n_past, self.reach)

    def truncate(self, n_past: int, saved: tuple | None = None) -> None:
        """Forget every position from n_past on (llama.cpp's seq_rm): later tokens overwrite them. A recurrent
        state holds every position at once, and a ring the last ones: where keeps(n_past) says no, it goes back to a
        state saved at n_past (save_state)."""
        if not 0 <= n_past <= self.n_past:
            raise ValueError(f"cannot truncate to {n_past} of {self.n_past} positions")
        if not self.keeps(n_past):  # a recurrent state, or a ring written over since n_past: back from a copy
            if saved is None or saved[0] != n_past:
                what = (f"a recurrent model's state cannot go back to position {n_past} of {self.n_past}"
                        if self.recurrent else f"the sliding-window layers' rings no longer hold the positions before "
                        f"{n_past} ({self.reach} written since; --swa-full keeps them)")
                raise ValueError(f"{what}, and no state was saved there (save_state)")
            if self.recurrent:
                self.kv.put_state(saved[1])
            else:
                self.kv.put_rows(0, saved[1], n_past)
            self.reach = saved[2]
        if not n_past:
            self.reach = 0
        self.n_past = n_past

    @torch.inference_mode()
    def decode(self, tokens: list[int], all_logits: bool = False) -> torch.Tensor:
        """Append tokens to the sequence; logits of the last token (1, n_vocab), or of all (n, n_vocab)."""
        if not tokens:
            raise FerryError("nothing to decode: the prompt is empty")
        if self.n_past + len(tokens) > self.n_ctx:
            raise FerryError(f"context is full: {self.n_past} + {len(tokens)} tokens > -c {self.n_ctx}; raise -c/--ctx-size or shorten the prompt")
        bad = [t for t in tokens if not 0 <= t < self.model.args.n_vocab]
        if bad:
            raise FerryError(f"token id {bad[0]} is outside the vocabulary (0..{self.model.args.n_vocab - 1})")
        outs = []
        ids = torch.tensor(tokens, dtype=torch.int32)
        if self.n_past == 0 and self.recurrent:
            self.kv.clear_state()
        for b0 in range(0, len(tokens), self.n_batch):  # the logical batch, then its u-batches
            b1 = min(b0 + self.n_batch, len(tokens))
            spans = [(u0, min(u0 + self.n_ubatch, b1)) for u0 in range(b0, b1, self.n_ubatch)]
            batches = [Batch(start=self.n_past + u0 - b0, n_tokens=u1 - u0, kv=self.kv, all_logits=all_logits)
                       for u0, u1 in spans]
            if self.layer_first and len(spans) > 1:
                joined = Batch.join(batches)
                logits = self.runner.forward_layer_first(self.model, [ids[u0:u1] for u0, u1 in spans], batches,
                                                           joined)
                joined.spread_expert_ids(batches)
                for b in batches:
                    self._count_hits(b)
            else:
                logits = []
                for (u0, u1), b in zip(spans, batches):
                    logits.append(self.runner.forward(self.model, ids[u0:u1], b))
                    self._count_hits(b)  # now: a replayed graph's routing is overwritten by its next replay
            self.n_past += b1 - b0
            self.reach = max(self.reach, self.n_past)
            outs.extend(logits if all_logits else logits[-1:])
        return torch.cat(outs) if all_logits else outs[-1]

    def _count_hits(self, batch: Batch) -> None:
        if batch.n_tokens > 1 and batch.expert_ids:  # prompts (a generated token hits n_expert_used by definition)
            self._routing.append(batch.routing_to_host())

    @torch.inference_mode()
    def decode_sequences(self, tokens: list[int], seqs: list[int], positions: list[int], seq_len: int,
                         all_logits: bool = True, tail: int = 0) -> torch.Tensor:
        """One forward over tokens of several sequences (server slots): token i goes to sequence seqs[i] at
        positions[i], sequence s owning cache cells [s * seq_len, (s + 1) * seq_len). Logits of every token
        (or of the last; tail > 0: of the last tail). The caller keeps each sequence's positions; n_past is not
        used."""
        if not tokens or len(tokens) > self.n_ubatch:
            raise ValueError(f"a multi-sequence batch holds 1..{self.n_ubatch} tokens, got {len(tokens)}")
        seq, pos = torch.tensor(seqs), torch.tensor(positions)
        if (int(pos.max()) >= seq_len or int((seq * seq_len + pos).max()) >= self.n_ctx
                or (self.kv.ring and int(seq.max()) >= self.kv.n_seq)):
            raise FerryError("a sequence ran past its share of the context; raise -c or lower -np")
        if self.recurrent:
            return self._sequence_by_sequence(tokens, seq, pos, seq_len, all_logits, tail)
        batch = Batch(start=0, n_tokens=len(tokens), kv=self.kv, all_logits=all_logits, tail=tail, seq=seq, pos=pos,
                      seq_len=seq_len)
        return self.runner.forward(self.model, torch.tensor(tokens, dtype=torch.int32), batch)

    def _sequence_by_sequence(self, tokens: list[int], seq: torch.Tensor, pos: torch.Tensor, seq_len: int,
                              all_logits: bool, tail: int) -> torch.Tensor:
        """decode_sequences for a recurrent model: each run of one sequence's tokens as a forward of its own, from
        that sequence's state (cleared where the run starts at position 0). The logits decode_sequences gives."""
        rows = tail or (len(tokens) if all_logits else 1)  # the last rows whose logits are wanted
        starts = [i for i in range(len(tokens)) if i == 0 or seq[i] != seq[i - 1]] + [len(tokens)]
        outs = []
        for a, b in zip(starts, starts[1:]):
            if int(pos[a]) == 0:
                self.kv.clear_state(int(seq[a]))
            want = max(0, min(b - a, rows - (len(tokens) - b)))  # this run's rows among them
            batch = Batch(start=0, n_tokens=b - a, kv=self.kv, tail=max(want, 1), seq=seq[a:b], pos=pos[a:b],
                          seq_len=seq_len)
            logits = self.runner.forward(self.model, torch.tensor(tokens[a:b], dtype=torch.int32), batch)
            if want:
                outs.append(logits)
        return torch.cat(outs)

    def generate(self, prompt: list[int], sampler: Sampler, n_predict: int,
                 is_eog: Callable[[int], bool], on_token: Callable[[int], None] | None = None,
                 history: list[int] | None = None) -> Generation:
        """Process the prompt (after what the cache holds), then sample up to n_predict tokens (-1: until end of
        generation, -2: until the context is full; the context is not shifted, so -1 ends there too). history: the
        tokens the repetition penalty looks back over (default: the prompt)."""
        t = Timings()
        t0 = time.perf_counter()
        logits = self.decode(prompt)
        t.prompt_ms = 1000 * (time.perf_counter() - t0)
        t.prompt_tokens = len(prompt)
        history = list(prompt if history is None else history)
        out: list[int] = []
        stopped = "length"
        t0 = time.perf_counter()
        while n_predict < 0 or len(out) < n_predict:
            token = sampler(logits[-1], history)
            if is_eog(token):
                stopped = "eog"
                break
            out.append(token)
            history.append(token)
            if on_token:
                on_token(token)
            if n_predict >= 0 and len(out) >= n_predict:
                break
            if self.n_past >= self.n_ctx:
                stopped = "context"
                break
            logits = self.decode([token])
            t.eval_tokens += 1
        t.eval_ms = 1000 * (time.perf_counter() - t0)
        return Generation(out, stopped, t, self.experts_hit)


def _runner(backend, devices, graph: bool):
    """The runner for a backend whose KV cache lives on `devices` (its kv_devices): ggml graphs (or eager ops) where
    it is in host memory, CUDA graphs on one GPU, eager ops layer by layer over several."""
    if devices is None:
        return GgmlGraphRunner(backend) if graph else EagerRunner(backend)
    if len(set(map(str, devices))) > 1:
        from ferry.runtime.runners.multi_gpu import MultiGpuRunner

        return MultiGpuRunner(backend)
    from ferry.runtime.runners.cuda_graphs import CudaGraphRunner

    return CudaGraphRunner(backend)
