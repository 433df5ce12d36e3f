"""Admin endpoints require the API key the app read from its environment; inference does
not (api_key_for_inference is off in this app) until a redeploy turns it on, with a key
from the config, which then takes precedence over the environment's."""

from __future__ import annotations

import httpx
import pytest

from tests.reliability.conftest import (
    ADMIN,
    API_KEY,
    complete,
    model_names,
    post,
    redeploy,
    wait_healthy,
)

pytestmark = pytest.mark.serve


@pytest.mark.parametrize(
    "headers",
    [
        None,
        {"Authorization": "Bearer wrong"},
        {"Authorization": f"Bearer {API_KEY}x"},
        {"Authorization": f"Basic {API_KEY}"},
        {"Authorization": API_KEY},
    ],
    ids=["none", "wrong", "longer", "basic", "no-scheme"],
)
def test_admin_endpoints_refuse_without_the_key(cluster, assets, headers):
    body = {"lora_name": "intruder", "lora_path": str(assets.adapters["adapter-04"])}
    r = post(cluster, "/v1/load_lora_adapter", body, headers)
    assert r.status_code == 401, r.text
    assert r.headers["www-authenticate"] == "Bearer"
    assert "API key" in r.json()["error"]["message"]
    assert "intruder" not in model_names(cluster)
    r = post(cluster, "/v1/unload_lora_adapter", {"lora_name": "adapter-00"}, headers)
    assert r.status_code == 401
    assert "adapter-00" in model_names(cluster)


def test_admin_endpoints_accept_the_key_and_inference_needs_none(cluster, assets):
    body = {"lora_name": "keyed", "lora_path": str(assets.adapters["adapter-04"])}
    assert post(cluster, "/v1/load_lora_adapter", body, ADMIN).status_code == 200
    try:
        assert complete(cluster, "keyed").status_code == 200
    finally:
        r = post(cluster, "/v1/unload_lora_adapter", {"lora_name": "keyed"}, ADMIN)
        assert r.status_code == 200


def test_api_key_for_inference_guards_every_endpoint_but_health_and_metrics(cluster):
    config_key = "config-key-9876543210"
    redeploy(cluster, api_key=config_key, api_key_for_inference=True)
    try:
        keyed = {"Authorization": f"Bearer {config_key}"}
        body = {"model": "adapter-00", "prompt": "hello there", "max_tokens": 2}
        chat = {"model": "tiny-base", "messages": [{"role": "user", "content": "hi"}]}
        for headers, status in [(None, 401), (ADMIN, 401), (keyed, 200)]:  # ADMIN: env key
            assert post(cluster, "/v1/completions", body, headers).status_code == status
            assert post(cluster, "/v1/chat/completions", chat, headers).status_code == status
            for path in ("/v1/models", "/v1/lorafleet/stats"):
                r = httpx.get(cluster["url"] + path, headers=headers, timeout=30)
                assert r.status_code == status, (path, r.text)
        r = post(cluster, "/v1/unload_lora_adapter", {"lora_name": "adapter-00"}, ADMIN)
        assert r.status_code == 401  # the config's key replaced the environment's for admin too
        assert httpx.get(cluster["url"] + "/health", timeout=30).status_code == 200
        # Prometheus scrapers carry no key (200, or 503 before Ray's first export)
        assert httpx.get(cluster["url"] + "/metrics", timeout=30).status_code != 401
    finally:
        redeploy(cluster)
    wait_healthy(cluster)
    assert complete(cluster, "adapter-00").status_code == 200  # no key needed again
