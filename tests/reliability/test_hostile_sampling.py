"""Sampling values at the edges of what validation lets through: each once crashed the
engine's step (and with it every request in the batch)."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from replica.model.sampler import Sampler
from replica.wire import SEED_MAX, SEED_MIN, SamplingParams
from router.protocol import CompletionRequest


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 1e-300},  # float32 rounds it to 0: logits / 0
        {"temperature": 1e-6},
        {"temperature": 2.0, "top_p": 1e-300},  # rounds to 0: every token dropped
        {"temperature": 1.0, "seed": SEED_MAX},
        {"temperature": 1.0, "seed": SEED_MIN},
        {"temperature": 1.0, "top_k": 10**9},
    ],
)
def test_edge_values_sample_a_valid_token(kwargs):
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 30
    params = SamplingParams(**kwargs)
    tokens = Sampler().sample(logits.clone(), [params] * 3, ["a", "b", "c"])
    assert tokens.shape == (3,) and bool(((tokens >= 0) & (tokens < 50)).all())
    if params.greedy or kwargs.get("top_p", 1.0) < 1e-6:
        assert tokens.tolist() == logits.argmax(-1).tolist()


@pytest.mark.parametrize(
    "field, value",
    [
        ("seed", 2**64),
        ("seed", -(2**63) - 1),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("top_p", float("nan")),
        ("top_p", 0.0),
        ("top_k", -2),
    ],
)
def test_out_of_range_values_are_refused_by_both_models(field, value):
    with pytest.raises(ValidationError, match=field):
        CompletionRequest(model="m", prompt="x", **{field: value})
    with pytest.raises(ValidationError, match=field):
        SamplingParams(**{"temperature": 1.0, field: value})
