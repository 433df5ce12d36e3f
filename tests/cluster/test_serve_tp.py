"""A tensor-parallel replica under Serve: real local Ray, real Serve, HTTP on 127.0.0.1.

One LoRAReplica of tp_size 2: Serve reserves its placement group of 2 bundles, the
replica is rank 0 and rank 1 an actor in the same group. The outside oracle is the
in-process TP=1 engine (itself checked against transformers + PEFT).
"""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest
import ray
from ray import serve
from ray.util import placement_group_table
from transformers import AutoTokenizer

from cluster import serving
from replica.executor.tp_group import RANK_ACTOR_PREFIX
from replica.wire import SamplingParams
from tests.conftest import QUICK_STOP, serve_config, tiny_assets
from tests.engines import make_engine
from tests.net import free_port

pytestmark = [pytest.mark.serve, pytest.mark.slow]

ADAPTERS = ["adapter-00", "adapter-01"]
PROMPT = [5, 17, 33, 2, 101, 64, 9]


@pytest.fixture(scope="module")
def assets():
    return tiny_assets("llama")


@pytest.fixture(scope="module")
def cluster(assets):
    ray.init(num_cpus=4, include_dashboard=False, namespace="serve", log_to_driver=False)
    port = free_port()
    engine = {"model": str(assets.model_dir), "device": "cpu", "tp_size": 2,
              "adapters": {"num_slots": 3}, "kv_cache_bytes": 16 * 2**20}  # fmt: skip
    deployment = {"name": "LoRAReplica", "num_replicas": 1, "health_check_period_s": 1,
                  "health_check_timeout_s": 10, "graceful_shutdown_timeout_s": 2,
                  **QUICK_STOP}  # fmt: skip
    args = {"engine": engine, "served_model_name": "tiny-base",
            "store": {"adapters": {n: str(assets.adapters[n]) for n in ADAPTERS}}}  # fmt: skip
    stores = [{"name": "AdapterStore", **QUICK_STOP}, {"name": "Ingress", **QUICK_STOP}]
    config = serve_config(port, args, [deployment, *stores])
    try:
        serving.deploy(config, timeout_s=240)
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def expected(assets) -> dict[str | None, str]:
    """Greedy text of the in-process TP=1 engine, per model."""
    eng = make_engine(assets, {name: assets.adapters[name] for name in ADAPTERS}, num_slots=3)
    sampling = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    tokenizer = AutoTokenizer.from_pretrained(assets.model_dir)

    def text(adapter: str | None) -> str:
        ids = eng.generate([(PROMPT, sampling, adapter)])[0].output_ids
        return tokenizer.decode(ids, skip_special_tokens=True)

    return {a: text(a) for a in [None, *ADAPTERS]}


def _complete(url: str, model: str, timeout: float = 60) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    return httpx.post(url + "/v1/completions", json=body, timeout=timeout)


def _text(response: httpx.Response) -> str:
    response.raise_for_status()
    return response.json()["choices"][0]["text"]


def _rank1() -> dict:
    """The live rank-1 actor: pid and placement group (named actors: no dashboard needed)."""
    named = [a for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].startswith(RANK_ACTOR_PREFIX)]  # fmt: skip
    assert len(named) == 1, named
    actor = ray.get_actor(named[0]["name"], namespace=named[0]["namespace"])
    return ray.get(actor.ready.remote(), timeout=30)


def test_tp_replica_serves_what_tp1_serves_with_its_rank_in_its_placement_group(cluster, expected):
    for model, adapter in [("tiny-base", None), *[(a, a) for a in ADAPTERS]]:
        assert _text(_complete(cluster, model)) == expected[adapter], model
    pg = placement_group_table()[_rank1()["placement_group"]]
    assert "LoRAReplica" in pg["name"]  # Serve's group for the replica, which holds bundle 0
    assert pg["strategy"] == "STRICT_PACK" and len(pg["bundles"]) == 2


def test_a_dead_rank_gets_its_replica_restarted(cluster, expected):
    rank1 = _rank1()
    os.kill(rank1["pid"], signal.SIGKILL)
    started = time.monotonic()
    r = _complete(cluster, "adapter-01", timeout=60)  # answered, not hung
    if r.status_code == 500:  # reached the broken replica (its step or adapter load)
        assert "tensor-parallel rank 1 of 2 failed" in r.text
    else:
        assert r.status_code in (200, 503), r.text
    deadline = started + 180
    while time.monotonic() < deadline:
        r = _complete(cluster, "adapter-00", timeout=60)
        if r.status_code == 200:
            break
        time.sleep(1)
    assert _text(r) == expected["adapter-00"]
    new_rank1 = _rank1()
    assert new_rank1["pid"] != rank1["pid"]
    assert new_rank1["placement_group"] != rank1["placement_group"]  # a new replica's group
