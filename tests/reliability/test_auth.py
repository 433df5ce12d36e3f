"""Admin endpoints require the API key the app read from its environment; inference does
not (api_key_for_inference is off in this app; test_redeployed.py turns it on, with a key
from the config, which then takes precedence over the environment's)."""

from __future__ import annotations

import pytest

from tests.reliability.conftest import (
    ADMIN,
    API_KEY,
    complete,
    model_names,
    post,
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
