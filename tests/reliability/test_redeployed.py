"""Settings that take a redeploy, all on one: a 1 s request deadline, an API key from the
config required for inference too (api_key_for_inference), which then takes precedence
over the environment's key, and one tenant (its metrics exist only with tenants: the
Grafana dashboard's tenant panels are checked here). A deploy costs ~25 s here and putting
the app back as much: one redeploy for the module, not one per setting (that was ~50 s
more per run). So every request here carries the config's key (the admin's) or the
tenant's, and asks for a few tokens at most where it is to finish within the deadline.

GET /health is here too: 200 while a replica can serve, 503 (OpenAI body) once none can,
found without sending a generation; and 200 again when replicas are back. Bringing them
back starts two replicas, as the module's redeploy does: its test brings them back with
the module's settings, and that is the module's redeploy (a test of its own put the app
back first, then the module redeployed it: ~25 s more)."""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from ray import serve

from cluster import serving
from router.ingress import HEALTH_MAX_REPORT_AGE_S
from router.tenancy import key_digest
from tests.cluster import dashboard
from tests.net import assert_openai_error
from tests.reliability.conftest import (
    ADMIN,
    LONG,
    aborted,
    complete,
    post,
    redeploy,
    wait_healthy,
)

pytestmark = pytest.mark.serve

CONFIG_KEY = "config-key-9876543210"
KEYED = {"Authorization": f"Bearer {CONFIG_KEY}"}
TENANT_KEY = "tenant-key-1357924680"
TENANT = {"Authorization": f"Bearer {TENANT_KEY}"}
SETTINGS = {  # of the app's ingress section
    "request_timeout_s": 1.0,
    "api_key": CONFIG_KEY,
    "api_key_for_inference": True,
    "tenants": [
        {
            "name": "dash",
            "key_sha256": [key_digest(TENANT_KEY)],
            "base_model": True,
            "requests_per_minute": 2,  # the third request of the minute is a 429
        }
    ],
}


@pytest.fixture(scope="module")
def deploy_settings(cluster) -> Iterator[Callable[[], None]]:
    """Redeploys the app with SETTINGS and waits for its two replicas; once it has, the app
    is put back after the module's last test."""
    deployed = []

    def deploy() -> None:
        deployed.append(True)
        redeploy(cluster, timeout_s=240, ingress=SETTINGS)  # all four replicas start again
        wait_healthy(cluster, headers=KEYED)

    yield deploy
    if deployed:
        redeploy(cluster)  # put back
        wait_healthy(cluster)
        assert complete(cluster, "adapter-00").status_code == 200  # no key needed again


@pytest.fixture
def strict(cluster, deploy_settings) -> dict[str, Any]:
    """The app with SETTINGS: deployed by the first test that needs it, unless /health's
    test brought the replicas back with them."""
    if not _settings_deployed():
        deploy_settings()
    return cluster


def _settings_deployed() -> bool:
    from ray.serve.context import _get_global_client

    details = _get_global_client().get_serve_details()["applications"]["lorafleet"]
    ingress = details["deployed_app_config"]["args"]["ingress"]
    return all(ingress.get(k) == v for k, v in SETTINGS.items())


# -- /health: no replica, then replicas back (with SETTINGS) -----------------------------------


def _health(cluster) -> httpx.Response:
    return httpx.get(cluster["url"] + "/health", timeout=30)


def _await_health(cluster, status: int, timeout_s: float) -> httpx.Response:
    """Poll /health until it answers `status`; the last answer either way."""
    deadline = time.monotonic() + timeout_s
    while True:
        r = _health(cluster)
        if r.status_code == status or time.monotonic() > deadline:
            return r
        time.sleep(0.5)


def _running_replicas() -> int:
    app = serve.status().applications["lorafleet"]
    return app.deployments["LoRAReplica"].replica_states.get("RUNNING", 0)


def test_health_is_503_with_no_replica_and_200_once_they_are_back(cluster, deploy_settings):
    assert _health(cluster).json() == {"status": "ok"}
    # Serve's config allows no num_replicas of 0: autoscaling down to zero instead, with
    # no traffic to scale it up again (/health sends none)
    config = copy.deepcopy(cluster["config"])
    [replica] = [d for d in config["applications"][0]["deployments"] if d["name"] == "LoRAReplica"]
    del replica["num_replicas"]
    replica["autoscaling_config"] = {
        "min_replicas": 0,
        "initial_replicas": 0,
        "max_replicas": 2,
        "downscale_delay_s": 0,
        "downscale_to_zero_delay_s": 0,
    }
    try:
        serving.deploy(config, timeout_s=120)
        deadline = time.monotonic() + 60
        while _running_replicas() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _running_replicas() == 0, serve.status()
        # the last reports age out within HEALTH_MAX_REPORT_AGE_S
        r = _await_health(cluster, 503, HEALTH_MAX_REPORT_AGE_S + 10)
        assert r.status_code == 503, r.text
        assert "no replica can serve" in assert_openai_error(r)["message"]
    finally:
        deploy_settings()  # two replicas again, with this module's settings
    r = _await_health(cluster, 200, 30)
    assert r.status_code == 200 and r.json() == {"status": "ok"}, r.text


# -- the settings --------------------------------------------------------------------------


def test_a_request_past_its_deadline_is_504_andaborted(strict):
    for model in ("adapter-00", "tiny-base"):  # routed and resident: both reach an engine
        assert complete(strict, model, max_tokens=1, headers=KEYED).status_code == 200
    before = aborted(strict, headers=KEYED)
    r = post(strict, "/v1/completions", {"model": "adapter-00", **LONG}, KEYED)
    assert r.status_code == 504, r.text
    assert "time limit" in r.json()["error"]["message"]
    body = {"model": "tiny-base", "stream": True, **LONG}
    url = strict["url"] + "/v1/completions"
    with httpx.stream("POST", url, json=body, headers=KEYED, timeout=60) as s:
        events = [line for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2].removeprefix("data: "))["error"]["code"] == 504, events[-2:]
    assert aborted(strict, before + 2, headers=KEYED) - before == 2


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


def _samples(cluster) -> dict[str, list]:
    """GET /metrics: each sample name's samples."""
    r = httpx.get(cluster["url"] + "/metrics", timeout=30)
    samples: dict[str, list] = {}
    if r.status_code == 200:  # 503 before Ray's first export
        for family in text_string_to_metric_families(r.text):
            for sample in family.samples:
                samples.setdefault(sample.name, []).append(sample)
    return samples


def _tenant_metric(name: str) -> bool:
    return "_tenant_" in name


def test_tenant_metrics_are_on_the_metrics_page_as_the_dashboard_queries_them(strict):
    """A tenant's requests (the second a prefix-cache hit: cached tokens) and its 429 over
    the request limit reach /metrics as lorafleet_tenant_*, with every label the Grafana
    dashboard's tenant panels group by."""
    body = {"model": "tiny-base", "prompt": "one two three four five six " * 6, "max_tokens": 1}
    for status in (200, 200, 429):
        assert post(strict, "/v1/completions", body, TENANT).status_code == status
    deadline = time.monotonic() + 30  # Ray exports every metrics_report_interval_ms (10 s)
    while (missing := dashboard.unexported(_samples(strict), _tenant_metric)) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.5)
    assert missing == []
