"""GET /health: 200 while a replica can serve, 503 (OpenAI body) once none can, found
without sending a generation; and 200 again when replicas are back."""

from __future__ import annotations

import copy
import time

import httpx
import pytest
from ray import serve

from cluster import serving
from router.ingress import HEALTH_MAX_REPORT_AGE_S
from tests.reliability.conftest import redeploy, wait_healthy
from tests.reliability.test_bad_input import assert_openai_error

pytestmark = pytest.mark.serve


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


def test_health_is_503_with_no_replica_and_200_once_they_are_back(cluster):
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
        redeploy(cluster, timeout_s=240)
    wait_healthy(cluster)
    r = _await_health(cluster, 200, 30)
    assert r.status_code == 200 and r.json() == {"status": "ok"}, r.text
