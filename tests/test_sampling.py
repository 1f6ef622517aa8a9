"""Sampling: greedy, the truncations (top-k, top-p, min-p), the repeat penalty, seeds."""

import pytest
import torch

from ferry.errors import FerryError
from ferry.runtime.sampling import Sampler, SamplingParams

LOGITS = torch.tensor([0.0, 3.0, 2.9, 1.0, -1.0])


def draws(n=300, **kw):
    s = Sampler(SamplingParams(seed=1, **kw))
    return {s(LOGITS, []) for _ in range(n)}


def test_temperature_zero_is_greedy():
    assert draws(temp=0) == {1}


def test_top_k_keeps_only_the_k_best():
    assert draws(temp=5.0, top_k=2, top_p=1.0, min_p=0.0) == {1, 2}


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    # probabilities ~ [0.04, 0.47, 0.42, 0.06, 0.01]: 0.47 + 0.42 >= 0.85
    assert draws(temp=1.0, top_k=0, top_p=0.85, min_p=0.0) == {1, 2}


def test_min_p_drops_tokens_below_a_fraction_of_the_best():
    assert draws(temp=1.0, top_k=0, top_p=1.0, min_p=0.5) == {1, 2}


def test_repeat_penalty_demotes_recent_tokens():
    s = Sampler(SamplingParams(temp=0, repeat_penalty=1.5))
    assert s(LOGITS, [1]) == 2


def test_same_seed_same_tokens():
    a, b = (Sampler(SamplingParams(seed=42, temp=1.0, top_k=0, top_p=1.0, min_p=0.0)) for _ in range(2))
    assert [a(LOGITS, []) for _ in range(20)] == [b(LOGITS, []) for _ in range(20)]


def test_invalid_parameters_are_user_errors():
    with pytest.raises(FerryError, match="--temp"):
        Sampler(SamplingParams(temp=-1))
