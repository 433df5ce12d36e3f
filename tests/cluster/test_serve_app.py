"""The Serve application end to end: real local Ray, real Serve, real HTTP on 127.0.0.1.

One cluster for the module (2 LoRAReplica replicas, AdapterStore, Ingress); the
outside oracle for outputs is the in-process engine, itself checked against
transformers + PEFT in tests/replica.
"""

from __future__ import annotations

import asyncio
import collections
import os
import shutil
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest
import ray
import yaml
from prometheus_client.parser import text_string_to_metric_families
from ray import serve
from transformers import AutoTokenizer

from cluster import serving
from cluster.cli import main
from cluster.demo import showcase
from replica.engine.engine import LLMEngine
from replica.wire import SamplingParams
from tests.cluster import dashboard
from tests.conftest import QUICK_STOP, serve_config, tiny_assets
from tests.engines import make_engine
from tests.net import free_port

pytestmark = pytest.mark.serve

PRELOADED = ["adapter-00", "adapter-01", "adapter-02", "adapter-04", "adapter-05", "adapter-06"]
MAX_RANK = 32  # adapter-03 and adapter-07 are rank 64: refused


def _config(assets, port: int, max_replicas: int = 2, target: int = 8) -> dict:
    return serve_config(
        port,
        {
            "engine": {
                "model": str(assets.model_dir),
                "device": "cpu",
                "max_lora_rank": MAX_RANK,
                "kv_cache_bytes": 32 * 2**20,
                "adapters": {"num_slots": 4},
            },
            "served_model_name": "tiny-base",
            "store": {
                "adapters": {n: str(assets.adapters[n]) for n in PRELOADED},
                "adapter_roots": [str(assets.root / "adapters")],
            },
            "routing": {"stats_period_s": 0.5},
        },
        [
            {
                "name": "LoRAReplica",
                "max_ongoing_requests": 64,
                "ray_actor_options": {"num_cpus": 1},
                "autoscaling_config": {
                    "min_replicas": 2,
                    "initial_replicas": 2,
                    "max_replicas": max_replicas,
                    "target_ongoing_requests": target,
                },
                **QUICK_STOP,
            },
            {"name": "AdapterStore", **QUICK_STOP},
            {"name": "Ingress", **QUICK_STOP},
        ],
    )


@pytest.fixture(scope="module")
def assets():
    return tiny_assets("llama", num_adapters=8)


@pytest.fixture(scope="module")
def cluster(assets):
    ray.init(
        num_cpus=4,
        include_dashboard=False,
        namespace="serve",
        log_to_driver=False,
        # metrics reach the export port every 0.5 s instead of 10 s: GET /metrics tests wait less
        _system_config={"metrics_report_interval_ms": 500},
    )
    port = free_port()
    config = _config(assets, port)
    try:
        serving.deploy(config, timeout_s=240)
        yield {"url": f"http://127.0.0.1:{port}", "config": config, "port": port}
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster["url"] + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def engine(assets) -> LLMEngine:
    """The in-process engine with the same adapters: the reference for HTTP outputs."""
    return make_engine(assets, num_slots=8, max_lora_rank=64)


@pytest.fixture(scope="module")
def tokenizer(assets):
    return AutoTokenizer.from_pretrained(assets.model_dir)


def _reference(engine: LLMEngine, prompt_ids: list[int], adapter: str | None, n: int) -> list[int]:
    seq = engine.generate(
        [(prompt_ids, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), adapter)]
    )
    return seq[0].output_ids


def _text(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


def _stats(cluster) -> dict:
    return httpx.get(cluster["url"] + "/v1/lorafleet/stats", timeout=30).json()


def _post(cluster, path: str, body: dict) -> httpx.Response:
    return httpx.post(cluster["url"] + path, json=body, timeout=60)


def _load(cluster, name: str, path) -> httpx.Response:
    return _post(cluster, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})


# -- outputs ----------------------------------------------------------------------------------


def test_completions_equal_the_engine(cluster, client, engine, tokenizer):
    prompt = "the cat sat on"
    ids = tokenizer(prompt)["input_ids"]
    for model in ["tiny-base", "adapter-00", "adapter-02", "adapter-05"]:
        r = client.completions.create(
            model=model, prompt=prompt, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
        )
        adapter = None if model == "tiny-base" else model
        expected = _text(tokenizer, _reference(engine, ids, adapter, 8))
        assert r.choices[0].text == expected, model
        assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 8
        assert r.choices[0].finish_reason == "length"


def test_sampling_is_seeded_like_the_engine_and_top_p_narrows_it(client, engine, tokenizer):
    """temperature 1 with a seed: the engine's sample for that seed, again on a repeat,
    other samples for other seeds; a top_p that keeps one token: the greedy output."""
    prompt, n = "the cat sat on", 12
    ids = tokenizer(prompt)["input_ids"]

    def http(**kw) -> str:
        r = client.completions.create(model="adapter-01", prompt=prompt, max_tokens=n,
                                      extra_body={"ignore_eos": True}, **kw)  # fmt: skip
        return r.choices[0].text

    def ours(**kw) -> str:
        sampling = SamplingParams(max_tokens=n, ignore_eos=True, **kw)
        return _text(tokenizer, engine.generate([(ids, sampling, "adapter-01")])[0].output_ids)

    sampled = http(temperature=1.0, seed=7)
    assert sampled == http(temperature=1.0, seed=7) == ours(temperature=1.0, seed=7)
    others = {http(temperature=1.0, seed=seed) for seed in (8, 9, 10)}
    assert others - {sampled}, "three other seeds all sampled seed 7's text"
    greedy = ours(temperature=0)
    assert sampled != greedy  # so the next line tests top_p, not luck
    assert http(temperature=1.0, top_p=1e-6, seed=11) == greedy


def test_n_logprobs_echo_and_batches_through_the_openai_sdk(client, engine, tokenizer):
    """n seeded choices, logprobs, echo with prompt logprobs and a batch of prompts: what
    the engine gives for the same requests, through Serve and the openai SDK."""
    prompt = "the cat sat on"
    ids = tokenizer(prompt)["input_ids"]
    sampling = SamplingParams(max_tokens=5, n=2, seed=5, ignore_eos=True, logprobs=2)
    (ref,) = engine.generate([(ids, sampling, "adapter-01")])
    r = client.completions.create(
        model="adapter-01", prompt=prompt, max_tokens=5, n=2, seed=5, logprobs=2,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert [c.text for c in r.choices] == [_text(tokenizer, s.output_ids) for s in ref.choices]
    for choice, seq in zip(r.choices, ref.choices):
        assert choice.logprobs.token_logprobs == pytest.approx([e.logprob for e in seq.logprobs])
        assert len(choice.logprobs.top_logprobs[0]) <= 2
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 10

    # echo + logprobs + max_tokens 0: a loglikelihood harness's request
    scoring = SamplingParams(max_tokens=0, prompt_logprobs=1)
    (scored,) = engine.generate([(ids, scoring, None)])
    r = client.completions.create(
        model="tiny-base", prompt=prompt, max_tokens=0, echo=True, logprobs=1
    )
    (choice,) = r.choices
    assert choice.text == prompt and choice.finish_reason == "length"
    assert choice.logprobs.token_logprobs[0] is None
    expected = [e.logprob for e in scored.group.prompt_logprobs[1:]]
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(expected)

    # a batch of prompts: one choice each, in order; again, as the calls of one request
    # once collided in Serve's router (see ingress._own_request_id) and hung
    prompts = ["the cat sat on", "a dog ran", "two birds"]
    expected = [
        _text(tokenizer, _reference(engine, tokenizer(q)["input_ids"], None, 4)) for q in prompts
    ]
    for _ in range(3):
        r = client.with_options(timeout=60).completions.create(
            model="tiny-base", prompt=prompts, max_tokens=4, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert [c.text for c in r.choices] == expected
        assert [c.index for c in r.choices] == [0, 1, 2]

    chat = client.chat.completions.create(
        model="tiny-base", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
        logprobs=True, top_logprobs=2, temperature=0,
    )  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and len(content[0].top_logprobs) == 2
    assert content[0].logprob == pytest.approx(content[0].top_logprobs[0].logprob)  # greedy


def test_concurrent_mixed_requests_equal_the_engine(cluster, engine, tokenizer):
    """Base and adapter requests in flight together (shared batches) give solo outputs."""
    models = ["tiny-base", *PRELOADED, "tiny-base"]
    prompts = [f"request number {i} says" for i in range(len(models))]

    async def one(client: httpx.AsyncClient, model: str, prompt: str) -> str:
        body = {"model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0}
        r = await client.post(cluster["url"] + "/v1/completions", json=body | {"ignore_eos": True})
        r.raise_for_status()
        return r.json()["choices"][0]["text"]

    async def run() -> list[str]:
        async with httpx.AsyncClient(timeout=120) as c:
            return await asyncio.gather(*(one(c, m, p) for m, p in zip(models, prompts)))

    for model, prompt, text in zip(models, prompts, asyncio.run(run())):
        adapter = None if model == "tiny-base" else model
        ids = tokenizer(prompt)["input_ids"]
        assert text == _text(tokenizer, _reference(engine, ids, adapter, 6)), model


def test_chat_completion_uses_the_chat_template(cluster, client, engine, tokenizer):
    messages = [{"role": "user", "content": "hello there"}]
    r = client.chat.completions.create(
        model="adapter-01",
        messages=messages,
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert r.choices[0].message.content == _text(
        tokenizer, _reference(engine, ids, "adapter-01", 6)
    )
    assert r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(ids)


def test_streaming_equals_non_streaming(cluster, client):
    kwargs = dict(model="adapter-04", prompt="once upon a time", max_tokens=10, temperature=0)
    full = client.completions.create(**kwargs, extra_body={"ignore_eos": True})
    chunks = list(
        client.completions.create(
            **kwargs,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 10

    chat = client.chat.completions.create(
        model="tiny-base",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        temperature=0,
        stream=True,
    )
    deltas = [c.choices[0].delta for c in chat if c.choices]
    assert deltas[0].role == "assistant"
    assert len("".join(d.content or "" for d in deltas)) > 0


@pytest.mark.parametrize("model", ["tiny-base", "adapter-04"])
def test_a_repeated_prompt_is_served_from_the_prefix_cache(cluster, client, model):
    """Two replicas: the router sends both requests where the prefix is (its hash home
    for the base, the adapter's replica), and the second prefills only what follows
    the cached blocks (16 tokens each): the usage says so and the output is the same."""
    prompt = [100 + (7 * i + len(model)) % 150 for i in range(60)]
    kwargs = dict(model=model, prompt=prompt, max_tokens=4, temperature=0)
    first, second = (client.completions.create(**kwargs) for _ in range(2))
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 48  # 3 blocks, 59 asked
    assert second.choices[0].text == first.choices[0].text


def test_stop_string_cuts_the_output(cluster, client):
    full = (
        client.completions.create(
            model="adapter-00",
            prompt="a b c",
            max_tokens=12,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        .choices[0]
        .text
    )
    stop = full[3:5]
    assert stop.strip()
    r = client.completions.create(
        model="adapter-00", prompt="a b c", max_tokens=12, temperature=0, stop=[stop]
    )
    assert r.choices[0].text == full[: full.index(stop)]
    assert r.choices[0].finish_reason == "stop"


# -- models and adapters ----------------------------------------------------------------------


def test_models_lists_base_and_adapters(cluster, client):
    models = {m.id: m for m in client.models.list().data}
    assert set(PRELOADED) <= set(models) and "tiny-base" in models
    assert models["adapter-00"].model_extra["parent"] == "tiny-base"


def test_showcase_of_a_server_without_a_key(cluster, capsys):
    """What `lorafleet up` shows once an app without a key runs (the trained demo's `up`
    test runs one with a key): every model answers the showcase's requests, sent together
    without a key, and the commands printed to try more carry none."""
    names = showcase.show(cluster["url"], "the cat sat on", max_tokens=3)
    out = capsys.readouterr().out
    assert names[0] == "tiny-base" and set(PRELOADED) <= set(names)
    assert f"{len(names)} requests sent together, prompt 'the cat sat on':" in out
    assert all(f" {name} | " in out for name in names) and "<HTTP" not in out, out
    tried = showcase.try_it(cluster["url"], names[-1], "the cat sat on")
    assert "api_key='none'" in tried and "Authorization" not in tried


def test_the_printed_commands_run_as_printed_in_a_fresh_shell(cluster, tmp_path):
    """Each command `lorafleet up` prints to try the server, pasted into a new shell whose
    environment holds nothing of ours (no venv activated: a bare `python` there lacks
    openai), answers."""
    tried = showcase.try_it(cluster["url"], "adapter-01", "the cat sat on")
    commands, logical = [], ""
    for line in tried.splitlines():
        if not logical and not line.startswith("  ") or line.startswith("  ("):
            continue  # "try it:", notes
        logical += line + "\n"
        if not line.endswith("\\"):
            commands.append(logical)
            logical = ""
    assert len(commands) == 3  # curl models, curl completions, the SDK
    fresh = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    for command in commands:
        proc = subprocess.run(
            ["bash", "-c", command], capture_output=True, text=True, timeout=120, env=fresh
        )
        assert proc.returncode == 0 and proc.stdout.strip(), (command, proc.stderr[-2000:])
        assert "error" not in proc.stdout, (command, proc.stdout)


def test_unknown_model_is_404_pointing_to_the_model_list(cluster):
    r = _post(cluster, "/v1/completions", {"model": "nope", "prompt": "hi"})
    assert r.status_code == 404
    message = r.json()["error"]["message"]
    assert "'nope'" in message and "/v1/models" in message and "adapter-00" not in message


def test_load_and_unload_at_runtime(cluster, client, engine, assets, tokenizer):
    path = str(assets.adapters["adapter-06"])
    r = _post(cluster, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": path})
    assert r.status_code == 200, r.text
    ids = tokenizer("late adapter")["input_ids"]
    out = client.completions.create(
        model="late",
        prompt="late adapter",
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert out.choices[0].text == _text(tokenizer, _reference(engine, ids, "adapter-06", 6))
    assert (
        _post(
            cluster, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": path}
        ).status_code
        == 400
    )
    assert _post(cluster, "/v1/unload_lora_adapter", {"lora_name": "late"}).status_code == 200
    r = _post(cluster, "/v1/completions", {"model": "late", "prompt": "hi"})
    assert r.status_code == 404
    assert _post(cluster, "/v1/unload_lora_adapter", {"lora_name": "late"}).status_code == 404


def _refused(cluster, name: str, path: str) -> str:
    before = httpx.get(cluster["url"] + "/v1/models").json()["data"]
    r = _post(cluster, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
    assert r.status_code == 400, r.text
    assert httpx.get(cluster["url"] + "/v1/models").json()["data"] == before  # nothing registered
    return r.json()["error"]["message"]


def test_bad_adapters_are_refused_with_400(cluster, assets, tmp_path):
    roots = assets.root / "adapters"
    # rank over max_lora_rank
    assert "exceeds max_lora_rank" in _refused(cluster, "big", str(assets.adapters["adapter-03"]))
    # not a PEFT directory
    assert "adapter_config.json" in _refused(cluster, "empty", str(roots))
    # path outside the adapter roots, directly and through a symlink
    outside = tmp_path / "copy"
    shutil.copytree(assets.adapters["adapter-00"], outside)
    assert "outside the configured adapter roots" in _refused(cluster, "out", str(outside))
    link = roots / f"link-{time.monotonic_ns()}"
    link.symlink_to(outside)
    try:
        assert "outside" in _refused(cluster, "link", str(link))
        dots = str(roots) + "/" + "../" * len(roots.parts) + str(outside).lstrip("/")
        assert "outside" in _refused(cluster, "dots", dots)
    finally:
        link.unlink()
    # an adapter of another base model (other shapes)
    other = tiny_assets("llama", hidden_size=32, num_heads=2, num_kv_heads=1, num_adapters=1)
    wrong = roots / f"wrong-{time.monotonic_ns()}"
    shutil.copytree(other.adapters["adapter-00"], wrong)
    try:
        assert "for this base model" in _refused(cluster, "wrong", str(wrong))
    finally:
        shutil.rmtree(wrong)
    # the base model's name
    assert "base model" in _refused(cluster, "tiny-base", str(assets.adapters["adapter-00"]))


def test_bad_requests_are_400(cluster):
    assert _post(cluster, "/v1/completions", {"prompt": "no model"}).status_code == 400
    r = _post(
        cluster, "/v1/completions", {"model": "tiny-base", "prompt": "x", "max_tokens": 10**6}
    )
    assert r.status_code == 400 and "maximum model length" in r.json()["error"]["message"]
    r = _post(cluster, "/v1/completions", {"model": "tiny-base", "prompt": ""})
    assert r.status_code == 400


# -- metrics ----------------------------------------------------------------------------------

REQUESTS = "ray_lorafleet_requests_total"
TTFT_COUNT = "ray_lorafleet_time_to_first_token_seconds_count"
ITL_COUNT = "ray_lorafleet_inter_token_latency_seconds_count"
WAIT = "ray_lorafleet_replica_load_wait_seconds_total"
DECISIONS = "ray_lorafleet_routing_decisions_total"


def _metrics(cluster) -> tuple[dict, dict]:
    """GET /metrics, parsed: totals by (sample name, kind), and samples by name."""
    r = httpx.get(cluster["url"] + "/metrics", timeout=30)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    totals, samples = collections.defaultdict(float), collections.defaultdict(list)
    for family in text_string_to_metric_families(r.text):  # raises on an invalid page
        assert family.name.startswith("ray_lorafleet_")
        for sample in family.samples:
            totals[(sample.name, sample.labels.get("kind"))] += sample.value
            samples[sample.name].append(sample)
    return totals, samples


def _not_tenant(metric: str) -> bool:
    return "_tenant_" not in metric


def test_metrics_count_requests_latencies_routing_and_replica_state(cluster, client, assets):
    time.sleep(1.5)  # earlier tests' metrics reach the export (every 0.5 s here) first
    before, _ = _metrics(cluster)
    # a name no replica holds: its first request loads it into a slot and runs on it
    assert _load(cluster, "metrics-probe", assets.adapters["adapter-04"]).status_code == 200
    try:
        for model in ["tiny-base", "adapter-00", "metrics-probe"]:
            client.completions.create(
                model=model, prompt="metrics", max_tokens=3, extra_body={"ignore_eos": True}
            )
    finally:
        assert _post(cluster, "/v1/unload_lora_adapter", {"lora_name": "metrics-probe"}).is_success

    def grew(after: dict, name: str, kind: str | None, by: float) -> bool:
        return after[(name, kind)] >= before[(name, kind)] + by

    def moved(after: dict, samples: dict) -> bool:
        counted = all(
            grew(after, name, kind, 1)
            for name in (REQUESTS, TTFT_COUNT, ITL_COUNT)
            for kind in ("base", "adapter")
        )
        replicas = {s.labels["replica"] for s in samples["ray_lorafleet_replica_adapter_slots"]}
        reasons = {s.labels["reason"] for s in samples[DECISIONS]}
        return (
            counted
            and len(replicas) == 2
            and grew(after, "ray_lorafleet_replica_adapter_lookups_total", None, 2)
            and grew(after, "ray_lorafleet_replica_adapter_loads_total", None, 1)
            and grew(after, "ray_lorafleet_replica_adapter_loads_used_total", None, 1)
            and grew(after, "ray_lorafleet_replica_adapter_load_seconds_count", None, 1)
            and grew(after, "ray_lorafleet_replica_prefix_cache_queried_tokens_total", None, 1)
            and after[(WAIT, None)] > before[(WAIT, None)]  # nothing else ran meanwhile
            and grew(after, DECISIONS, None, 3)
            and "base" in reasons
            and reasons & {"device", "host", "free_slot", "home", "spill"}
        )

    deadline = time.monotonic() + 30  # Ray exports metrics with a delay
    while not moved(*(state := _metrics(cluster))) and time.monotonic() < deadline:
        time.sleep(0.5)
    after, samples = state
    assert moved(after, samples), dict(after)
    assert any(
        s.labels["model"] == "adapter-00" and s.labels["outcome"] == "length"
        for s in samples[REQUESTS]
    )
    assert grew(after, "ray_lorafleet_output_tokens_total", "adapter", 3)
    assert grew(after, "ray_lorafleet_e2e_latency_seconds_count", "base", 1)
    assert grew(after, "ray_lorafleet_inter_token_latency_seconds_count", "adapter", 2)
    states = {s.labels["state"] for s in samples["ray_lorafleet_replica_adapter_slots"]}
    assert states == {"free", "loading", "ready"}
    tiers = {s.labels["tier"] for s in samples["ray_lorafleet_replica_adapter_lookups_total"]}
    assert tiers <= {"device", "host", "miss"} and tiers
    # the docs' table and the Grafana dashboard's queries (metrics and the labels they group
    # and filter by); the tenants' only exist with tenants: tests/reliability/test_redeployed.py
    documented = set(filter(_not_tenant, dashboard.documented()))
    exported = set(samples) | {n.removesuffix("_count") for n in samples if n.endswith("_count")}
    assert documented and documented <= exported, documented - exported
    assert dashboard.unexported(samples, _not_tenant) == []
    for name in ["waiting_requests", "running_requests", "steps_total"]:
        assert samples[f"ray_lorafleet_replica_{name}"]


# -- placement --------------------------------------------------------------------------------


def _loads(cluster) -> dict[str, int]:
    return {rid: s["adapter_loads"] for rid, s in _stats(cluster)["replicas"].items()}


def _wait_for_reports(cluster, since: float) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        reps = _stats(cluster)["replicas"]
        if len([s for s in reps.values() if s["age_s"] < time.time() - since]) >= 2:
            return
        time.sleep(0.3)


def test_requests_follow_their_adapter(cluster, client):
    """Sequential requests: each adapter is loaded on one replica, then found there."""
    adapters = PRELOADED[:3]  # fits the 3 adapter slots of one replica
    for a in adapters:  # warm: one load each, somewhere
        client.completions.create(model=a, prompt="warm", max_tokens=2)
    time.sleep(1.5)  # residency reaches the router with the next stats period
    before = sum(_loads(cluster).values())
    for _ in range(3):
        for a in adapters:
            client.completions.create(model=a, prompt="again", max_tokens=2)
    time.sleep(1.5)
    assert sum(_loads(cluster).values()) == before  # every request found its adapter resident


def _spills(cluster) -> float:
    return sum(s.value for s in _metrics(cluster)[1][DECISIONS] if s.labels["reason"] == "spill")


def test_hot_adapter_spills_past_the_load_bound(cluster, assets):
    """24 concurrent requests of one adapter all reach the replicas together (the Ingress
    does not cap them at Serve's default of 5 in flight), and past the load bound the
    other replica takes some. The adapter is loaded here, so no earlier test has put it
    on both replicas already (sending to either would then be affinity, not a spill)."""
    url = cluster["url"]
    assert _load(cluster, "hot", assets.adapters["adapter-05"]).status_code == 200
    body = {"model": "hot", "prompt": "hot", "max_tokens": 160, "ignore_eos": True}

    async def flood() -> int:
        peak = 0  # most requests the replicas reported queued or running at once
        async with httpx.AsyncClient(timeout=120) as c:
            posts = [
                asyncio.create_task(c.post(url + "/v1/completions", json=body)) for _ in range(24)
            ]
            while not all(p.done() for p in posts):  # bounded by the client's timeout
                reps = (await c.get(url + "/v1/lorafleet/stats")).json()["replicas"]
                peak = max(peak, sum(s["queue_len"] for s in reps.values()))
                await asyncio.sleep(0.2)
            assert all(p.result().status_code == 200 for p in posts)
        return peak

    spills_before = _spills(cluster)
    assert asyncio.run(flood()) > 5
    deadline = time.monotonic() + 30  # Ray exports metrics with a delay
    while _spills(cluster) <= spills_before and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _spills(cluster) > spills_before  # the router sent some past the load bound
    time.sleep(1.5)
    holders = [
        rid
        for rid, s in _stats(cluster)["replicas"].items()
        if "hot" in s.get("device_adapters", [])
    ]
    assert len(holders) == 2


def test_one_object_store_put_per_adapter(cluster):
    """Both replicas hold 'hot' now, yet every registration put its weights once: the
    preloads plus the three runtime loads ('late', 'metrics-probe', 'hot'); refused loads
    put nothing."""
    store = _stats(cluster)["store"]
    assert store["num_puts"] == len(PRELOADED) + 3
    assert store["num_ref_requests"] > store["num_puts"]


# -- operations -------------------------------------------------------------------------------


def _replica_actor_ids() -> set[str]:
    """Serve names each replica's actor after its replica id."""
    actors = ray.util.list_named_actors(all_namespaces=True)
    return {a["name"] for a in actors if "LoRAReplica" in a["name"]}


def _autoscaling() -> dict:
    from ray.serve.context import _get_global_client  # Serve's own view of the deployment

    details = _get_global_client().get_serve_details()
    replica = details["applications"]["lorafleet"]["deployments"]["LoRAReplica"]
    return replica["deployment_config"]["autoscaling_config"]


def test_redeploy_with_edited_autoscaling_keeps_replicas(cluster, client, assets, tmp_path):
    """`lorafleet deploy` of the same file with an edited autoscaling_config: applied in
    place (Serve reports the new bounds), the replicas and a request in flight stay."""
    assert (_autoscaling()["max_replicas"], _autoscaling()["target_ongoing_requests"]) == (2, 8)
    edited = tmp_path / "serve.yaml"
    edited.write_text(yaml.safe_dump(_config(assets, cluster["port"], max_replicas=3, target=16)))
    before = _replica_actor_ids()
    assert len(before) == 2
    stream = client.completions.create(
        model="adapter-01",
        prompt="long",
        max_tokens=48,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    first = next(iter(stream))
    assert main(["deploy", str(edited), "--timeout-s", "120"]) == 0  # the running Ray
    rest = list(stream)  # the request in flight finishes across the redeploy
    assert [c.choices[0].finish_reason for c in [first, *rest] if c.choices][-1] == "length"
    assert _replica_actor_ids() == before
    config = serve.status().applications["lorafleet"].deployments["LoRAReplica"]
    assert config.status == "HEALTHY"
    assert (_autoscaling()["max_replicas"], _autoscaling()["target_ongoing_requests"]) == (3, 16)


def _joined_config(assets, port: int) -> dict:
    """A second application for the running cluster: its own name and route prefix."""
    config = _config(assets, port)
    app = config["applications"][0]
    app.update(name="joined", route_prefix="/joined")
    app["args"]["store"]["adapters"] = {}
    replica = {"name": "LoRAReplica", "num_replicas": 1, "ray_actor_options": {"num_cpus": 1}}
    app["deployments"] = [{**replica, **QUICK_STOP}, *app["deployments"][1:]]  # store, ingress
    return config


def _up(*args: str) -> list[str]:
    return [sys.executable, "-m", "cluster.cli", "up", "--no-demo-requests", *args]


def test_a_second_up_on_a_served_port_is_refused_and_the_first_keeps_serving(cluster):
    """`lorafleet up` on a port a server already holds refuses in one line, before it
    starts a Ray (Serve's proxies bind with SO_REUSEPORT: a second one would share the
    port, and requests would land on either server at random)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    port = cluster["port"]
    refused = subprocess.run(
        _up("--port", str(port), "--num-cpus", "1"),
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert refused.stderr.splitlines() == [
        f"lorafleet: error: http://127.0.0.1:{port} already accepts connections: another "
        "server listens on that port; stop it, or choose another port (--port)"
    ]
    assert refused.stdout == ""
    for _ in range(20):  # every request reaches the first server
        r = httpx.get(f"{cluster['url']}/v1/models", timeout=30)
        assert r.status_code == 200 and r.json()["data"][0]["id"] == "tiny-base"


def test_up_joining_a_cluster_adds_its_app_and_removes_only_that(cluster, assets, tmp_path):
    """`lorafleet up --address` beside an application deployed earlier: another HTTP port
    is refused in one line before anything deploys; its own app is served beside the
    other and is all it removes when stopped. Its app has no key: the commands it prints
    carry none (the trained demo's `up` test runs with one)."""
    address = ray.get_runtime_context().gcs_address
    path = tmp_path / "joined.yaml"
    path.write_text(yaml.safe_dump(_joined_config(assets, cluster["port"])))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("LORAFLEET_API_KEY", None)
    other_port = str(free_port())
    refused = subprocess.run(
        _up("--address", address, "--config", str(path), "--port", other_port),
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert f"Serve already runs on this Ray cluster with HTTP on 127.0.0.1:{cluster['port']}" in (
        refused.stderr
    )
    assert "Traceback" not in refused.stderr
    assert set(serve.status().applications) == {"lorafleet"}

    proc = subprocess.Popen(
        _up("--address", address, "--config", str(path)),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )  # fmt: skip
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not any(".choices[0].text)" in x for x in lines):
            line = proc.stdout.readline()  # up to the last line of the commands it prints
            if not line:
                break
            lines.append(line)
        out = "".join(lines)
        assert f"serving at http://127.0.0.1:{cluster['port']}/joined" in out, out[-3000:]
        assert "try it" in out and "api_key='none'" in out and "Authorization" not in out, out
        apps = serve.status().applications
        assert apps["joined"].status == "RUNNING" and apps["lorafleet"].status == "RUNNING"
        r = httpx.get(f"{cluster['url']}/joined/v1/models", timeout=30)
        assert [m["id"] for m in r.json()["data"]] == ["tiny-base"]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    assert proc.returncode == 0
    deadline = time.monotonic() + 60
    while "joined" in serve.status().applications and time.monotonic() < deadline:
        time.sleep(0.5)
    apps = serve.status().applications
    assert "joined" not in apps and apps["lorafleet"].status == "RUNNING"
    assert httpx.get(f"{cluster['url']}/v1/models", timeout=30).status_code == 200
