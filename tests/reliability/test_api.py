"""The API around generation, live: errors of every kind in OpenAI's shape (never
FastAPI's {"detail": ...}), vLLM's /tokenize and /detokenize, GET /v1/models/{id}, and
stop_reason."""

from __future__ import annotations

import httpx
import pytest
from transformers import AutoTokenizer

from tests.net import assert_openai_error
from tests.reliability.conftest import (
    MAX_MODEL_LEN,
    PRELOADED,
    complete,
    post,
    replica_stats,
)

pytestmark = pytest.mark.serve


def get(cluster, path: str) -> httpx.Response:
    return httpx.get(cluster["url"] + path, timeout=30)


@pytest.mark.parametrize(
    "method, path, status",
    [
        ("GET", "/v2/models", 404),
        ("POST", "/v1/embeddings", 404),
        ("GET", "/v1/completions", 405),
        ("PUT", "/v1/models", 405),
        ("DELETE", "/tokenize", 405),
    ],
)
def test_unknown_routes_and_wrong_methods_have_openai_bodies(cluster, method, path, status):
    r = httpx.request(method, cluster["url"] + path, timeout=30)
    assert r.status_code == status, r.text
    error = assert_openai_error(r)
    assert path in error["message"] and "detail" not in r.json()


def test_tokenize_then_detokenize(cluster, assets):
    tokenizer = AutoTokenizer.from_pretrained(assets.model_dir)
    text = "Hello wörld, 日本 🙂"
    r = post(cluster, "/tokenize", {"model": "adapter-00", "prompt": text})
    assert r.status_code == 200, r.text
    ids = tokenizer(text)["input_ids"]
    assert r.json() == {"count": len(ids), "max_model_len": MAX_MODEL_LEN, "tokens": ids}
    r = post(cluster, "/detokenize", {"model": "tiny-base", "tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": text}
    error = assert_openai_error(post(cluster, "/detokenize", {"tokens": [ids[0], 10**6]}))
    assert error["param"] == "tokens" and str(10**6) in error["message"]


def test_tokenized_chat_is_what_chat_completions_sends(cluster):
    messages = [{"role": "user", "content": "hi there"}]
    r = post(cluster, "/tokenize", {"model": "tiny-base", "messages": messages})
    assert r.status_code == 200, r.text
    count = r.json()["count"]
    body = {"model": "tiny-base", "messages": messages, "max_tokens": 1}
    usage = post(cluster, "/v1/chat/completions", body).json()["usage"]
    assert usage["prompt_tokens"] == count


def test_model_cards(cluster):
    base = get(cluster, "/v1/models/tiny-base")
    assert base.status_code == 200 and base.json()["id"] == "tiny-base"
    assert base.json()["parent"] is None
    adapter = get(cluster, f"/v1/models/{PRELOADED[0]}").json()
    assert (adapter["id"], adapter["parent"]) == (PRELOADED[0], "tiny-base")
    listed = {m["id"]: m for m in get(cluster, "/v1/models").json()["data"]}
    # the card alone also says which chat template and parsers the adapter's requests use
    assert adapter["chat_template"] == "tokenizer"  # the base's, inherited
    template = ("chat_template", "tool_parser", "reasoning_parser")
    assert listed[PRELOADED[0]] == {k: v for k, v in adapter.items() if k not in template}
    r = get(cluster, "/v1/models/no-such-adapter")
    assert r.status_code == 404 and assert_openai_error(r)["param"] == "model"


def test_stop_reason_names_the_stop_string(cluster):
    body = {"model": "adapter-02", "prompt": "hello there", "max_tokens": 24, "temperature": 0}
    text = post(cluster, "/v1/completions", {**body, "ignore_eos": True}).json()["choices"][0]
    text = text["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]  # greedy: the same output again
    assert stop, text
    r = post(cluster, "/v1/completions", {**body, "ignore_eos": True, "stop": [stop]})
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop, choice
    assert choice["text"] == text[: text.index(stop)]


def test_stats_slot_counts_add_up(cluster):
    """/v1/lorafleet/stats counts slots (room for one adapter of max_lora_rank each, the
    base model's included) and the adapters in them apart: adapters of lower ranks share a
    slot, so `free` slots and `ready` adapters never summed to `num_slots` (a replica
    showed num_slots 256, free 253, ready 5)."""
    for name in PRELOADED:  # adapters on the replicas' devices, of ranks 8 to 32
        assert complete(cluster, name).status_code == 200
    for rid, s in replica_stats(cluster).items():
        slots, adapters = s["slots"], s["adapters_on_device"]
        assert slots["base"] + slots["free"] + slots["used"] == s["num_slots"], (rid, s)
        assert slots["base"] == 1 and slots["free"] == s["free_slots"]
        assert adapters["ready"] == len(s["device_adapters"]), (rid, s)
        # every used slot holds an adapter; a slot may hold several
        assert (slots["used"] > 0) == (adapters["ready"] + adapters["loading"] > 0)
        assert slots["used"] <= adapters["ready"] + adapters["loading"]
        assert "slots" not in s["telemetry"]  # the old mixed counts: gone
