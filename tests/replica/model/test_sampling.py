"""The sampler draws from the distribution its parameters describe (seeded, so no flakes)."""

from __future__ import annotations

import pytest
import torch

from replica.model.sampler import Sampler
from replica.wire import SamplingParams

LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.0, -1.0, -3.0])
DRAWS = 6000


def frequencies(params: SamplingParams, logits: torch.Tensor = LOGITS) -> torch.Tensor:
    sampler = Sampler()
    counts = torch.zeros(logits.shape[0])
    for _ in range(DRAWS):
        counts[sampler.sample(logits[None].clone(), [params], ["r"])[0]] += 1
    return counts / DRAWS


def test_temperature_sampling_follows_the_softmax():
    for temperature in (1.0, 0.5, 2.0):
        want = torch.softmax(LOGITS / temperature, -1)
        got = frequencies(SamplingParams(temperature=temperature, seed=1))
        # 4 standard deviations of a frequency near 0.4 over DRAWS draws
        assert (got - want).abs().max() < 0.026, (temperature, got, want)


def test_top_k_and_top_p_cut_the_support_and_renormalise():
    got = frequencies(SamplingParams(temperature=1.0, top_k=2, seed=2))
    assert got[2:].sum() == 0
    want = torch.softmax(LOGITS[:2], -1)
    assert (got[:2] - want).abs().max() < 0.026, got

    probs = torch.softmax(LOGITS, -1)  # 0.46, 0.28, 0.17, ...: the first two hold < 0.8
    got = frequencies(SamplingParams(temperature=1.0, top_p=0.8, seed=3))
    assert got[3:].sum() == 0
    want = probs[:3] / probs[:3].sum()
    assert (got[:3] - want).abs().max() < 0.026, got


def test_a_seed_repeats_its_draws_and_other_seeds_differ():
    logits = torch.randn(1, 200, generator=torch.Generator().manual_seed(0))

    def draws(seed: int) -> list[int]:
        sampler, params = Sampler(), SamplingParams(temperature=1.0, seed=seed)
        return [int(sampler.sample(logits.clone(), [params], ["r"])[0]) for _ in range(40)]

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)


def test_a_zero_probability_token_is_never_drawn():
    logits = torch.tensor([[0.0, float("-inf"), 0.0, float("-inf")]])
    sampler, params = Sampler(), SamplingParams(temperature=1.0, seed=4)
    seen = {int(sampler.sample(logits.clone(), [params], ["r"])[0]) for _ in range(500)}
    assert seen == {0, 2}


@pytest.mark.slow
def test_rows_with_different_parameters_in_one_batch_keep_their_own():
    """Greedy rows, a top-k row and a plain temperature row sampled in one call."""
    logits = torch.stack([LOGITS, LOGITS.flip(0), LOGITS, LOGITS.flip(0)])
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0, top_k=2, seed=5),
        SamplingParams(temperature=1.0, seed=6),
        SamplingParams(temperature=0),
    ]
    sampler, counts = Sampler(), torch.zeros(4, LOGITS.shape[0])
    for _ in range(DRAWS):
        tokens = sampler.sample(logits.clone(), params, ["g1", "k", "t", "g2"])
        counts[torch.arange(4), tokens] += 1
    freq = counts / DRAWS
    assert freq[0, 0] == 1 and freq[3, -1] == 1  # greedy rows: the argmax every time
    assert freq[1, :-2].sum() == 0  # top-2 of the flipped logits: the last two tokens
    assert (freq[1, -2:] - torch.softmax(LOGITS.flip(0)[-2:], -1)).abs().max() < 0.026
    assert (freq[2] - torch.softmax(LOGITS, -1)).abs().max() < 0.026
