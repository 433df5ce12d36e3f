"""The router <-> replica contract: keys, requests, replies, refusals and routing stats
survive their round trips."""

from __future__ import annotations

import pickle

import pytest
from pydantic import ValidationError

from replica.errors import DeadlineExceeded, NotFound, RequestError, RequestRefused, Unavailable
from replica.wire import (
    MAX_TEMPERATURE,
    SEED_MAX,
    AdapterKey,
    GenerateRequest,
    Reply,
    RoutingStats,
    SamplingParams,
)


@pytest.mark.parametrize("name", ["a", "sql-v2", "x@v", "odd@v3name", "@v@v"])
def test_adapter_keys_format_and_parse_back(name):
    key = AdapterKey(name, 12)
    assert str(key) == f"{name}@v12"
    assert AdapterKey.parse(str(key)) == key


@pytest.mark.parametrize("text", ["plain", "name@v", "name@vx", "@v3", "name@v-1"])
def test_what_is_not_an_adapter_key_is_refused(text):
    with pytest.raises(ValueError, match="not an adapter key"):
        AdapterKey.parse(text)


def test_a_reply_is_finished_when_it_says_how_the_choice_ended():
    assert not Reply((5,), index=1).finished
    assert Reply((7,), "length", index=1).finished and Reply((), "stop").finished


@pytest.mark.parametrize("error", [RequestError, NotFound, Unavailable, DeadlineExceeded])
def test_refusals_cross_a_process_boundary_with_their_kind_and_message(error):
    crossed = pickle.loads(pickle.dumps(error("why")))
    assert type(crossed) is error and isinstance(crossed, RequestRefused)
    assert crossed.message == "why"


def test_routing_stats_round_trip_through_the_dict_serve_publishes():
    stats = RoutingStats(frozenset({"b", "a"}), frozenset({"c"}), queue_len=4, free_slots=2,
                         tenant_lag={"acme": 12.5})  # fmt: skip
    published = stats.to_dict()
    assert published["device_adapters"] == ["a", "b"]  # sorted: stable for logs and tests
    assert RoutingStats.from_dict(published) == stats
    assert RoutingStats.from_dict(None) == RoutingStats()  # a replica that has not reported


def test_sampling_params_defaults_are_the_apis_and_bounds_hold():
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k) == (16, 1.0, 1.0, 0)
    assert SamplingParams(temperature=0).greedy and not p.greedy
    for bad in (
        {"temperature": MAX_TEMPERATURE + 0.1},
        {"temperature": float("nan")},
        {"max_tokens": 0},
        {"top_p": 0.0},
        {"top_k": -1},
        {"seed": SEED_MAX + 1},
        {"stop_token_ids": (-1,)},
    ):
        with pytest.raises(ValidationError):
            SamplingParams(**bad)


def test_a_generate_request_crosses_a_process_boundary_intact():
    request = GenerateRequest(
        [1, 2, 3], SamplingParams(seed=7), AdapterKey("sql", 3), "cmpl-1", timeout_s=5.0
    )
    assert pickle.loads(pickle.dumps(request)) == request


def test_requests_get_ids_of_their_own_unless_given_one():
    a, b = GenerateRequest([1]), GenerateRequest([1])
    assert a.request_id != b.request_id and a.sampling == SamplingParams()
