"""One Serve application for the reliability suite (a deploy costs ~20 s here).

Real local Ray (4 CPUs), real Serve, HTTP on 127.0.0.1. The app is set up to make limits
easy to reach: 2 LoRAReplica replicas of at most 4 requests each and 4 queued at the
ingress's handle, an admin API key from the environment (through the app's runtime_env,
as an operator would pass it on a cluster), a small adapter size limit. Tests that break
things (killed replicas, a killed store) leave the app healthy again before they return.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import ray
from ray import serve

from cluster import serving
from tests.conftest import QUICK_STOP, serve_config, tiny_assets
from tests.net import free_port

API_KEY = "test-key-0123456789"
KEY_ENV = "LORAFLEET_TEST_ADMIN_KEY"
ADMIN = {"Authorization": f"Bearer {API_KEY}"}
PRELOADED = ["adapter-00", "adapter-01", "adapter-02"]
MAX_ONGOING = 4  # per LoRAReplica
MAX_QUEUED = 4  # at the ingress's handle
MAX_MODEL_LEN = 2048  # the tiny model's context: long requests take seconds
RESOLVABLE = "resolvable-"  # the prefix of the adapter names resolved on first request
# seconds of decoding on the tiny model: still running when the client leaves
LONG = {"prompt": "go on", "max_tokens": 2000, "ignore_eos": True}


OWN_RAY_MODULES = ("test_multinode.py",)  # start a Ray of their own: run before `cluster`


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Move the tests of OWN_RAY_MODULES before this package's other tests: a process holds
    one Ray connection, and the package's shared cluster, once up, stays up to its end."""
    here = Path(__file__).parent
    own = [i for i in items if i.path.parent == here and i.path.name in OWN_RAY_MODULES]
    if not own:
        return
    moved = set(own)
    rest = [i for i in items if i not in moved]
    first = next((k for k, i in enumerate(rest) if i.path.parent == here), len(rest))
    items[:] = [*rest[:first], *own, *rest[first:]]


def app_config(assets, port: int, adapter_limit: int) -> dict[str, Any]:
    return serve_config(
        port,
        {
            "engine": {
                "model": str(assets.model_dir),
                "device": "cpu",
                "max_lora_rank": 64,
                "kv_cache_bytes": 16 * 2**20,
                "max_model_len": MAX_MODEL_LEN,
                "adapters": {"num_slots": 3},
            },
            "served_model_name": "tiny-base",
            "store": {
                "adapters": {n: str(assets.adapters[n]) for n in PRELOADED},
                "adapter_roots": [str(assets.root / "adapters")],
                # names no other test uses: test_adapters.py's resolution tests
                "resolvers": ["local"],
                "resolve_allow": [f"{RESOLVABLE}*"],
                "max_adapter_bytes": adapter_limit,
            },
            "routing": {"stats_period_s": 0.25, "max_queued_requests": MAX_QUEUED},
            "ingress": {"request_timeout_s": 60, "api_key_env": KEY_ENV},
        },
        [
            {
                "name": "LoRAReplica",
                "num_replicas": 2,
                "max_ongoing_requests": MAX_ONGOING,
                "ray_actor_options": {"num_cpus": 1},
                "health_check_period_s": 1,
                **QUICK_STOP,
            },
            {"name": "AdapterStore", "health_check_period_s": 1, **QUICK_STOP},
            {"name": "Ingress", **QUICK_STOP},
        ],
        runtime_env={"env_vars": {KEY_ENV: API_KEY}},
    )


@pytest.fixture(scope="package")
def assets():
    return tiny_assets("llama", num_adapters=8)


def adapter_file_limit(assets) -> int:
    """max_adapter_bytes: twice the largest demo adapter file."""
    sizes = [(p / "adapter_model.safetensors").stat().st_size for p in assets.adapters.values()]
    return 2 * max(sizes)


@pytest.fixture(scope="package")
def cluster(assets) -> Iterator[dict[str, Any]]:
    ray.init(num_cpus=4, include_dashboard=False, namespace="serve", log_to_driver=False)
    port = free_port()
    config = app_config(assets, port, adapter_file_limit(assets))
    try:
        serving.deploy(config, timeout_s=240)
        yield {"url": f"http://127.0.0.1:{port}", "config": config}
    finally:
        serve.shutdown()
        ray.shutdown()


def redeploy(cluster, timeout_s: float = 120.0, **sections: dict) -> None:
    """Deploy the suite's app with these config sections' keys changed (ingress={...};
    none: put it back), and wait
    until the replicas of the previous version are gone: a stopping Ingress replica still
    answers with the old settings (a 1 s deadline leaked 504s into the next test)."""
    config = copy.deepcopy(cluster["config"])
    args = config["applications"][0]["args"]
    for section, changes in sections.items():
        args[section] = {**args.get(section, {}), **changes}
    serving.deploy(config, timeout_s=timeout_s)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        app = serve.status().applications.get("lorafleet")
        states = [d.replica_states for d in app.deployments.values()] if app else []
        if states and all(set(s) <= {"RUNNING"} for s in states):
            return
        time.sleep(0.25)
    raise AssertionError(f"old replicas still there after {timeout_s} s: {serve.status()}")


def post(cluster, path: str, body: Any, headers: dict | None = None, timeout: float = 60):
    return httpx.post(cluster["url"] + path, json=body, headers=headers, timeout=timeout)


def complete(
    cluster, model: str, max_tokens: int = 4, headers: dict | None = None, **extra
) -> httpx.Response:
    body = {"model": model, "prompt": "hello there", "max_tokens": max_tokens, **extra}
    return post(cluster, "/v1/completions", body, headers)


def load(cluster, name: str, path: str | Path) -> httpx.Response:
    return post(
        cluster, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)}, ADMIN
    )


def unload(cluster, name: str) -> httpx.Response:
    return post(cluster, "/v1/unload_lora_adapter", {"lora_name": name}, ADMIN)


def model_names(cluster) -> list[str]:
    return [m["id"] for m in httpx.get(cluster["url"] + "/v1/models", timeout=30).json()["data"]]


def replica_stats(cluster, headers: dict | None = None) -> dict[str, dict]:
    r = httpx.get(cluster["url"] + "/v1/lorafleet/stats", headers=headers, timeout=30)
    return r.json()["replicas"]


def wait_idle(cluster, timeout_s: float = 30.0, headers: dict | None = None) -> dict[str, dict]:
    """Wait until every live replica reports no request, every KV block free and no slot
    referenced, in reports made after this call; return those reports. Fails the test on
    timeout: a leak. `headers`: the key, on an app that wants one for its stats."""
    started = time.monotonic()
    deadline = started + timeout_s
    last: dict[str, dict] = {}
    while time.monotonic() < deadline:
        waited = time.monotonic() - started
        stats = replica_stats(cluster, headers)
        live = {rid: s for rid, s in stats.items() if s["age_s"] < 3.0}
        last = {rid: s for rid, s in live.items() if s["age_s"] < min(waited, 1.0) - 0.05}
        if last and len(last) == len(live) and all(_idle(s) for s in last.values()):
            return last
        time.sleep(0.25)
    raise AssertionError(f"replicas not idle after {timeout_s} s: {last}")


def aborted(
    cluster, expected: int | None = None, timeout_s: float = 30.0, headers: dict | None = None
) -> int:
    """Return the count of requests the engines ended early (abort), over the live replicas,
    once they are idle. With `expected`, polled until it is reached (or the time is up): a replica
    whose report came late under load (over 3 s old) is left out of wait_idle's sum."""
    deadline = time.monotonic() + timeout_s
    while True:
        total = sum(s["aborted"] for s in wait_idle(cluster, headers=headers).values())
        if expected is None or total >= expected or time.monotonic() > deadline:
            return total
        time.sleep(0.5)


def _idle(s: dict) -> bool:
    return (
        s["num_running"] == 0
        and s["num_waiting"] == 0
        and s["kv_blocks_free"] == s["kv_blocks_total"]
        and s["slot_refs"] == 0
    )


def wait_healthy(cluster, timeout_s: float = 120.0, headers: dict | None = None) -> None:
    """Until the app is RUNNING with both replicas up and answering. `headers`: the key,
    on an app that wants one for inference."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        app = serve.status().applications.get("lorafleet")
        replicas = app.deployments["LoRAReplica"].replica_states if app else {}
        if app and app.status == "RUNNING" and replicas.get("RUNNING", 0) == 2:
            if complete(cluster, "tiny-base", headers=headers).status_code == 200:
                return
        time.sleep(0.5)
    raise AssertionError(f"app not healthy after {timeout_s} s: {serve.status()}")
