"""Token sampling with llama.cpp's chain and defaults: penalties -> top-k -> top-p -> min-p -> temperature."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ferry.errors import FerryError


@dataclass
class SamplingParams:
    temp: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    seed: int = -1  # -1: a random seed

    def validate(self) -> None:
        if self.temp < 0:
            raise FerryError(f"--temp must be >= 0 (0 is greedy), got {self.temp}")
        if not 0 < self.top_p <= 1:
            raise FerryError(f"--top-p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise FerryError(f"--min-p must be in [0, 1], got {self.min_p}")
        if self.top_k < 0:
            raise FerryError(f"--top-k must be >= 0 (0 disables it), got {self.top_k}")
        if self.repeat_penalty <= 0:
            raise FerryError(f"--repeat-penalty must be > 0 (1.0 disables it), got {self.repeat_penalty}")


class Sampler:
    def __init__(self, params: SamplingParams):
        params.validate()
        self.p = params
        self.gen = torch.Generator()
        self.seed = params.seed if params.seed >= 0 else int(torch.randint(0, 2**31 - 1, ()).item())
        self.gen.manual_seed(self.seed)

    def __call__(self, logits: torch.Tensor, history: list[int]) -> int:
        """Pick the next token from one row of logits (on any device), given the tokens so far: sampled on the CPU,
        where the generator is (a GPU row failed every sampled request of the GPU server: 'Expected a cuda device
        type for generator'), so that a seed draws the same tokens from either."""
        logits = logits.float().to("cpu", copy=True)
        p = self.p
        if p.repeat_penalty != 1.0 and p.repeat_last_n != 0 and history:
            recent = history[-p.repeat_last_n:] if p.repeat_last_n > 0 else history
            ids = torch.tensor(sorted(set(recent)), dtype=torch.long)
            vals = logits[ids]
            logits[ids] = torch.where(vals > 0, vals / p.repeat_penalty, vals * p.repeat_penalty)
        if p.temp <= 0:
            return int(torch.argmax(logits))
        if 0 < p.top_k < logits.numel():
            kth = torch.topk(logits, p.top_k).values[-1]
            logits[logits < kth] = -float("inf")
        probs = torch.softmax(logits, -1)
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            cum = torch.cumsum(sorted_probs, 0)
            drop = cum - sorted_probs >= p.top_p  # keep the smallest prefix whose mass reaches top_p
            logits[order[drop]] = -float("inf")
            probs = torch.softmax(logits, -1)
        if p.min_p > 0:
            logits[probs < p.min_p * probs.max()] = -float("inf")
        probs = torch.softmax(logits / p.temp, -1)
        return int(torch.multinomial(probs, 1, generator=self.gen))
