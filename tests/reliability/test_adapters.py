"""Adapter loading is safe: malformed or oversized adapters are refused with nothing
registered, concurrent loads and unloads of one name are serialized, and an unload lets
the requests in flight finish while refusing new ones. An adapter in a root that no one
registered is loaded by its first request (the app's local resolver), once."""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import safetensors
from safetensors.torch import load_file, save_file

from tests.reliability.conftest import (
    ADMIN,
    RESOLVABLE,
    complete,
    load,
    model_names,
    post,
    unload,
    wait_idle,
)

pytestmark = pytest.mark.serve


@pytest.fixture
def scratch(assets):
    """A fresh directory inside the adapter roots, removed afterwards."""
    root = assets.root / "adapters" / f"scratch-{time.monotonic_ns()}"
    root.mkdir()
    yield root
    shutil.rmtree(root)


def _copy(assets, scratch, name: str = "adapter-04"):
    dst = scratch / name
    shutil.copytree(assets.adapters[name], dst)
    return dst


def _refused(cluster, name: str, path) -> str:
    before = model_names(cluster)
    r = load(cluster, name, path)
    assert r.status_code == 400, r.text
    assert model_names(cluster) == before  # nothing registered
    return r.json()["error"]["message"]


def test_malformed_adapters_are_refused(cluster, assets, scratch):
    garbage = _copy(assets, scratch)
    (garbage / "adapter_model.safetensors").write_bytes(b"\x00" * 64 + b"not a safetensors file")
    assert "unreadable safetensors" in _refused(cluster, "garbage", garbage)

    latin1 = _copy(assets, scratch, "adapter-05")
    (latin1 / "adapter_config.json").write_bytes('{"r": 8, "x": "caf\xe9"}'.encode("latin-1"))
    assert "not UTF-8" in _refused(cluster, "latin1", latin1)

    alpha = _copy(assets, scratch, "adapter-06")
    config = json.loads((alpha / "adapter_config.json").read_text())
    (alpha / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": "lots"}))
    assert "lora_alpha" in _refused(cluster, "alpha", alpha)

    nan = _copy(assets, scratch, "adapter-07")
    tensors = load_file(nan / "adapter_model.safetensors")
    key = next(iter(tensors))
    tensors[key] = tensors[key].clone()
    tensors[key][0, 0] = float("nan")
    save_file(tensors, nan / "adapter_model.safetensors")
    assert "NaN" in _refused(cluster, "nan", nan)


def test_oversized_adapter_is_refused_before_it_is_read(cluster, assets, scratch):
    big = _copy(assets, scratch)
    limit = cluster["config"]["applications"][0]["args"]["store"]["max_adapter_bytes"]
    with open(big / "adapter_model.safetensors", "ab") as f:
        f.write(b"\x00" * (limit + 1))
    assert "max_adapter_bytes" in _refused(cluster, "big", big)


def test_symlinked_weights_outside_the_roots_are_refused(cluster, assets, scratch, tmp_path):
    outside = tmp_path / "weights.safetensors"
    shutil.copy(assets.adapters["adapter-04"] / "adapter_model.safetensors", outside)
    linked = _copy(assets, scratch)
    (linked / "adapter_model.safetensors").unlink()
    (linked / "adapter_model.safetensors").symlink_to(outside)
    assert "outside the configured adapter roots" in _refused(cluster, "linked", linked)


def test_concurrent_loads_and_unloads_of_one_name_are_serialized(cluster, assets):
    path = assets.adapters["adapter-04"]
    with ThreadPoolExecutor(8) as pool:
        codes = sorted(pool.map(lambda _: load(cluster, "twin", path).status_code, range(8)))
    assert codes == [200] + [400] * 7
    assert model_names(cluster).count("twin") == 1
    with ThreadPoolExecutor(8) as pool:
        codes = sorted(pool.map(lambda _: unload(cluster, "twin").status_code, range(8)))
    assert codes == [200] + [404] * 7
    assert "twin" not in model_names(cluster)


def test_unload_lets_requests_in_flight_finish_and_refuses_new_ones(cluster, assets):
    loaded = load(cluster, "leaving", assets.adapters["adapter-05"])
    assert loaded.status_code == 200
    # the load says what it applies: each module (named within its layer, as
    # "self_attn.q_proj") with its layer count, as its file holds them
    keys = safetensors.safe_open(
        str(assets.adapters["adapter-05"] / "adapter_model.safetensors"), "pt"
    ).keys()
    modules = Counter(
        k.split(".layers.")[1].split(".", 1)[1].removesuffix(".lora_A.weight")
        for k in keys
        if k.endswith("lora_A.weight")
    )
    assert loaded.json()["applied"] == dict(sorted(modules.items()))
    body = {"model": "leaving", "prompt": "tell me", "max_tokens": 200, "ignore_eos": True}
    body["stream"] = True
    with httpx.stream("POST", cluster["url"] + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert "error" not in first
        assert unload(cluster, "leaving").status_code == 200
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    finish = json.loads(rest[-2].removeprefix("data: "))["choices"][0]["finish_reason"]
    assert finish == "length", rest[-3:]
    r = complete(cluster, "leaving")
    assert r.status_code == 404 and "does not exist" in r.json()["error"]["message"]
    wait_idle(cluster)


def test_runtime_adapter_output_survives_a_reload(cluster, assets):
    """Load, unload and load again under one name: the new version serves, same weights."""
    path = assets.adapters["adapter-06"]
    body = {"model": "again", "prompt": "abc", "max_tokens": 6, "temperature": 0}
    assert load(cluster, "again", path).status_code == 200
    first = post(cluster, "/v1/completions", body).json()["choices"][0]["text"]
    assert unload(cluster, "again").status_code == 200
    assert load(cluster, "again", path).status_code == 200
    second = post(cluster, "/v1/completions", body).json()["choices"][0]["text"]
    assert unload(cluster, "again").status_code == 200
    assert first == second


def _until(done: threading.Event, call, limit: int = 500) -> list:
    """call() again and again until `done` is set (and once after), at most `limit` times."""
    results = []
    for _ in range(limit):
        finished = done.is_set()
        results.append(call())
        if finished:
            break
    return results


def test_load_inplace_swaps_a_live_adapter_without_a_gap(cluster, assets):
    """A request streaming on the old weights finishes on them; requests sent throughout
    the swap all succeed (no 404 window); afterwards the name serves the new weights."""
    old, new = assets.adapters["adapter-04"], assets.adapters["adapter-05"]
    greedy = {"prompt": "abc", "max_tokens": 6, "temperature": 0}
    assert load(cluster, "swap", old).status_code == 200
    assert load(cluster, "swap-ref", new).status_code == 200
    want = post(cluster, "/v1/completions", {**greedy, "model": "swap-ref"}).json()
    before = post(cluster, "/v1/completions", {**greedy, "model": "swap"}).json()
    refused = load(cluster, "swap", new)  # without the flag the name stays taken
    assert refused.status_code == 400 and "load_inplace" in refused.text

    body = {"model": "swap", "prompt": "tell me", "max_tokens": 120, "ignore_eos": True}
    done = threading.Event()
    with ThreadPoolExecutor(2) as pool:
        with httpx.stream(
            "POST", cluster["url"] + "/v1/completions", json={**body, "stream": True}, timeout=60
        ) as r:
            lines = r.iter_lines()
            assert "error" not in next(line for line in lines if line.startswith("data: "))
            statuses = pool.submit(_until, done, lambda: complete(cluster, "swap", 1).status_code)
            swap = post(
                cluster,
                "/v1/load_lora_adapter",
                {"lora_name": "swap", "lora_path": str(new), "load_inplace": True},
                ADMIN,
            )
            assert swap.status_code == 200 and swap.json()["version"] > 0, swap.text
            done.set()
            rest = [line for line in lines if line.startswith("data: ")]
        codes = statuses.result()
        assert len(codes) >= 2 and set(codes) == {200}, codes
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "length"
    after = post(cluster, "/v1/completions", {**greedy, "model": "swap"}).json()
    assert after["choices"][0]["text"] == want["choices"][0]["text"]
    assert before["choices"][0]["text"] != after["choices"][0]["text"]
    assert model_names(cluster).count("swap") == 1
    for name in ("swap", "swap-ref"):
        assert unload(cluster, name).status_code == 200
    wait_idle(cluster)


def _store_stats(cluster) -> dict:
    return httpx.get(cluster["url"] + "/v1/lorafleet/stats", timeout=30).json()["store"]


def test_an_adapter_in_a_root_is_loaded_by_its_first_requests_once(cluster, assets):
    """Ten concurrent first requests for an unregistered adapter: one load, and every
    answer is the one the same weights give when registered explicitly."""
    name = f"{RESOLVABLE}{time.monotonic_ns()}"
    shutil.copytree(assets.adapters["adapter-04"], assets.root / "adapters" / name)
    greedy = {"prompt": "abc", "max_tokens": 6, "temperature": 0}
    try:
        assert load(cluster, "explicit-04", assets.adapters["adapter-04"]).status_code == 200
        want = post(cluster, "/v1/completions", {**greedy, "model": "explicit-04"}).json()
        before = _store_stats(cluster)
        with ThreadPoolExecutor(10) as pool:
            body = {**greedy, "model": name}
            replies = list(pool.map(lambda _: post(cluster, "/v1/completions", body), range(10)))
        # every one resolves the name at the ingress first; past that, this app's small
        # queue (MAX_ONGOING per replica, MAX_QUEUED) may refuse some with a 429
        served = [r for r in replies if r.status_code == 200]
        assert served and all(r.status_code == 429 for r in replies if r not in served)
        texts = {r.json()["choices"][0]["text"] for r in served}
        assert texts == {want["choices"][0]["text"]}
        after = _store_stats(cluster)
        assert after["num_puts"] == before["num_puts"] + 1  # one load for the ten
        assert after["num_resolved"] == before["num_resolved"] + 1
        assert name in model_names(cluster)
    finally:
        shutil.rmtree(assets.root / "adapters" / name)
        for adapter in ("explicit-04", name):
            unload(cluster, adapter)
    wait_idle(cluster)


def test_names_the_resolvers_may_not_resolve_are_404_and_load_nothing(cluster, assets):
    before, names = _store_stats(cluster), model_names(cluster)
    reasons = {
        "adapter-05": "resolve_allow",  # in the root, but outside the allow-list
        "../adapter-05": "resolve_allow",
        f"{RESOLVABLE}../adapter-05": "not a directory name",  # allowed, escapes the root
        f"{RESOLVABLE}absent": "no resolver found it",
    }
    for model, reason in reasons.items():
        r = complete(cluster, model)
        assert r.status_code == 404, r.text
        message = r.json()["error"]["message"]
        assert "does not exist" in message and reason in message, message
    after = _store_stats(cluster)
    assert after["num_puts"] == before["num_puts"] and model_names(cluster) == names
