"""Settings that take a redeploy, all on one: a 1 s request deadline, and an API key from
the config required for inference too (api_key_for_inference), which then takes precedence
over the environment's key. A deploy costs ~25 s here and putting the app back as much:
one redeploy for the module, not one per setting (that was ~50 s more per run). So every
request here carries the config's key, and asks for a few tokens at most where it is to
finish within the deadline."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.reliability.conftest import ADMIN, complete, post, redeploy, wait_healthy
from tests.reliability.test_faults import LONG, _aborted

pytestmark = pytest.mark.serve

CONFIG_KEY = "config-key-9876543210"
KEYED = {"Authorization": f"Bearer {CONFIG_KEY}"}


@pytest.fixture(scope="module")
def strict(cluster) -> Iterator[dict[str, Any]]:
    redeploy(cluster, request_timeout_s=1.0, api_key=CONFIG_KEY, api_key_for_inference=True)
    yield cluster
    redeploy(cluster)  # put back
    wait_healthy(cluster)
    assert complete(cluster, "adapter-00").status_code == 200  # no key needed again


def test_a_request_past_its_deadline_is_504_and_aborted(strict):
    for model in ("adapter-00", "tiny-base"):  # routed and resident: both reach an engine
        assert complete(strict, model, max_tokens=1, headers=KEYED).status_code == 200
    before = _aborted(strict, headers=KEYED)
    r = post(strict, "/v1/completions", {"model": "adapter-00", **LONG}, KEYED)
    assert r.status_code == 504, r.text
    assert "time limit" in r.json()["error"]["message"]
    body = {"model": "tiny-base", "stream": True, **LONG}
    url = strict["url"] + "/v1/completions"
    with httpx.stream("POST", url, json=body, headers=KEYED, timeout=60) as s:
        events = [line for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2].removeprefix("data: "))["error"]["code"] == 504, events[-2:]
    assert _aborted(strict, before + 2, headers=KEYED) - before == 2


def test_api_key_for_inference_guards_every_endpoint_but_health_and_metrics(strict):
    body = {"model": "adapter-00", "prompt": "hello there", "max_tokens": 2}
    # max_tokens: a chat's default is the rest of the context, past the 1 s deadline
    chat = {"model": "tiny-base", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for headers, status in [(None, 401), (ADMIN, 401), (KEYED, 200)]:  # ADMIN: env key
        assert post(strict, "/v1/completions", body, headers).status_code == status
        assert post(strict, "/v1/chat/completions", chat, headers).status_code == status
        for path in ("/v1/models", "/v1/lorafleet/stats"):
            r = httpx.get(strict["url"] + path, headers=headers, timeout=30)
            assert r.status_code == status, (path, r.text)
    r = post(strict, "/v1/unload_lora_adapter", {"lora_name": "adapter-00"}, ADMIN)
    assert r.status_code == 401  # the config's key replaced the environment's for admin too
    assert httpx.get(strict["url"] + "/health", timeout=30).status_code == 200
    # Prometheus scrapers carry no key (200, or 503 before Ray's first export)
    assert httpx.get(strict["url"] + "/metrics", timeout=30).status_code != 401
