"""A conversation with one model (`ferry chat`, `ferry run -cnv`): each turn renders the whole conversation through
the chat template, and only what the KV cache does not already hold is decoded: the tokens after the longest prefix
the cache shares with the rendered conversation."""

from __future__ import annotations

from collections.abc import Callable

from ferry.runtime.engine import Engine, Timings
from ferry.runtime.sampling import Sampler
from ferry.tokenizer import StreamDecoder, Tokenizer, render_chat


def shared_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens a and b have in common."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Conversation:
    """`n_predict`: tokens per answer at most (-1: until end of generation, -2: until the context is full; the
    context is never shifted, so both end there)."""

    def __init__(self, engine: Engine, tok: Tokenizer, template: str, sampler: Sampler, n_predict: int = -1,
                 system: str | None = None):
        self.engine, self.tok, self.template, self.sampler, self.n_predict = engine, tok, template, sampler, n_predict
        self.messages: list[dict] = [{"role": "system", "content": system}] if system else []
        self.cached: list[int] = []  # the tokens the KV cache holds, in order
        self.turns = 0
        self.timings = Timings()
        self.decoded = 0  # tokens decoded as prompt over the conversation (the cache spared the rest)

    def turn(self, text: str, on_text: Callable[[str], None]) -> str:
        """The model's answer to the user's `text`, streamed through on_text as it is generated."""
        self.messages.append({"role": "user", "content": text})
        ids = self.tok.encode_chat(render_chat(self.template, self.messages, *self.tok.special_texts()))
        keep = min(shared_prefix(ids, self.cached), len(ids) - 1)  # at least one token decoded: its logits sample
        if not self.engine.keeps(keep):  # a recurrent state holds all of it or nothing; a ring only its slack
            keep = 0
        self.engine.truncate(keep)
        stream = StreamDecoder(self.tok)
        gen = self.engine.generate(ids[keep:], self.sampler, self.n_predict, self.tok.is_eog,
                                   lambda token: on_text(stream.add(token)), history=ids)
        self.decoded += len(ids) - keep
        # the cache holds the prompt and every generated token but the last (sampled, never decoded)
        self.cached = (ids + gen.tokens)[:self.engine.n_past]
        answer = self.tok.decode(gen.tokens)
        self.messages.append({"role": "assistant", "content": answer})
        self.turns += 1
        t = self.timings
        t.prompt_ms += gen.timings.prompt_ms
        t.prompt_tokens += gen.timings.prompt_tokens
        t.eval_ms += gen.timings.eval_ms
        t.eval_tokens += gen.timings.eval_tokens
        return answer
