"""`lorafleet bench http` against a fake OpenAI server on 127.0.0.1.

The fake is a test double for the client side only: deterministic words with small
sleeps, per-replica adapter-load counters, and switches for a missing model and a
missing stats endpoint. The real server is tested in test_serve_app.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections import Counter
from dataclasses import dataclass, field

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from cluster.bench import http as bench_http
from cluster.bench.http import BenchError, LoadOptions, build_prompt, request_picker, run_load
from tests.net import serving

BASE = "fake-base"
ADAPTERS = [f"a-{i:02d}" for i in range(6)]
REPLICAS = ("r0", "r1")


@dataclass
class FakeState:
    """What the fake server does; tests change it, the `fake` fixture resets it."""

    missing: set[str] = field(default_factory=set)  # models answered with a 404
    stats: bool = True
    token_delay_s: float = 0.002
    loads: dict[str, int] = field(default_factory=lambda: {"r0": 5, "r1": 3})
    seen: set[str] = field(default_factory=set)  # adapters loaded on their home replica
    hits: dict[str, int] = field(default_factory=lambda: {"r0": 0, "r1": 0})  # found resident
    received: list[str] = field(default_factory=list)
    key: str | None = None  # when set, every endpoint wants "Authorization: Bearer <key>"
    authorizations: list[str | None] = field(default_factory=list)


def _fake_app(state: FakeState) -> FastAPI:
    app = FastAPI()

    @app.middleware("http")
    async def authorize(request: Request, call_next):
        given = request.headers.get("authorization")
        state.authorizations.append(given)
        if state.key is not None and given != f"Bearer {state.key}":
            return JSONResponse({"error": {"message": "a valid API key is required"}}, 401)
        return await call_next(request)

    @app.get("/v1/models")
    async def models() -> dict:
        cards = [{"id": BASE, "object": "model", "parent": None}]
        cards += [{"id": a, "object": "model", "parent": BASE} for a in reversed(ADAPTERS)]
        return {"object": "list", "data": cards}

    @app.get("/v1/lorafleet/stats")
    async def stats() -> JSONResponse:
        if not state.stats:
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        replicas = {
            r: {
                "adapter_loads": n,
                "num_waiting": 0,
                "telemetry": {
                    "lookups": {"device": state.hits[r], "host": 0, "miss": n},
                    "load_wait_seconds": 0.01 * n,
                },
            }
            for r, n in state.loads.items()
        }
        return JSONResponse({"replicas": replicas, "store": {}})

    @app.post("/v1/completions")
    async def completions(body: dict) -> Response:
        model = body["model"]
        state.received.append(model)
        if model in state.missing:
            message = f"model {model!r} does not exist"
            return JSONResponse({"error": {"message": message}}, status_code=404)
        if model != BASE:  # home replica: by position in ADAPTERS
            home = REPLICAS[ADAPTERS.index(model) % 2]
            if model in state.seen:
                state.hits[home] += 1
            else:
                state.seen.add(model)
                state.loads[home] += 1
        return StreamingResponse(_words(body, state.token_delay_s), media_type="text/event-stream")

    return app


async def _words(body: dict, delay_s: float):
    n = body["max_tokens"]
    for k in range(n):
        await asyncio.sleep(delay_s)
        chunk = {"object": "text_completion", "choices": [{"index": 0, "text": f" w{k}"}]}
        yield f"data: {json.dumps(chunk)}\n\n"
    prompt = len(body["prompt"].split())
    usage = {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n}
    yield f"data: {json.dumps({'object': 'text_completion', 'choices': [], 'usage': usage})}\n\n"
    yield "data: [DONE]\n\n"


@pytest.fixture(scope="module")
def server():
    state = FakeState()
    with serving(_fake_app(state)) as url:
        yield url, state


@pytest.fixture
def fake(server):
    url, state = server
    state.__init__()  # fresh switches and counters for each test
    return url, state


def _options(url: str, **kw) -> LoadOptions:
    defaults = dict(url=url, num_requests=12, max_tokens=3, prompt_tokens=8, concurrency=4,
                    stats_settle_s=0.0, timeout_s=5.0)  # fmt: skip
    return LoadOptions(**{**defaults, **kw})


# -- request picking and prompts (no server) ----------------------------------------------------


def _picks(n: int, adapters: list[str] = ADAPTERS[:4], **kw) -> list[str]:
    pick = request_picker(LoadOptions(**kw), BASE, adapters)
    return [pick(i) for i in range(n)]


def test_distinct_is_round_robin():
    picks = _picks(10, scenario="distinct")
    assert picks[:4] == ADAPTERS[:4] and picks[4:8] == ADAPTERS[:4]
    assert all(a != b for a, b in zip(picks, picks[1:]))


def test_zipf_skews_toward_the_first_adapters():
    counts = Counter(_picks(4000, scenario="zipf", zipf_alpha=1.0))
    c = [counts[a] for a in ADAPTERS[:4]]
    assert c[0] > c[1] > c[2] > c[3]
    assert c[0] / c[3] == pytest.approx(4.0, rel=0.25)  # weights 1, 1/2, 1/3, 1/4


def test_bursty_moves_through_disjoint_adapter_sets():
    options = LoadOptions(scenario="bursty", phases=3, phase_requests=10, num_requests=60)
    pick = request_picker(options, BASE, ADAPTERS)
    phases = [{pick(i) for i in range(k * 10, k * 10 + 10)} for k in range(6)]
    assert all(phases)  # every phase drew something
    for k in range(3):
        assert phases[k] <= set(ADAPTERS[k::3]) and phases[k + 3] <= set(ADAPTERS[k::3])
    assert not phases[0] & phases[1] and not phases[1] & phases[2]


def test_uniform_covers_adapters_evenly_and_never_base():
    counts = Counter(_picks(4000, scenario="uniform"))
    assert set(counts) == set(ADAPTERS[:4])
    assert max(counts.values()) / min(counts.values()) < 1.2


def test_mixed_base_fraction():
    picks = _picks(4000, scenario="mixed-base", base_fraction=0.3)
    assert picks.count(BASE) / len(picks) == pytest.approx(0.3, abs=0.03)
    assert set(picks) - {BASE} == set(ADAPTERS[:4])


def test_picks_are_seeded():
    assert _picks(50, scenario="zipf", seed=7) == _picks(50, scenario="zipf", seed=7)
    assert _picks(50, scenario="zipf", seed=7) != _picks(50, scenario="zipf", seed=8)


def test_no_adapters_only_for_base_only_runs():
    with pytest.raises(BenchError, match="at least one adapter"):
        _picks(1, adapters=[], scenario="uniform")
    assert _picks(3, adapters=[], scenario="mixed-base", base_fraction=1.0) == [BASE] * 3


def test_prompts_are_distinct_sized_and_seeded():
    prompts = [build_prompt(i, 64, seed=0) for i in range(20)]
    assert len(set(prompts)) == 20
    assert all(60 <= len(p.split()) <= 66 for p in prompts)
    assert build_prompt(3, 64, seed=0) == prompts[3] != build_prompt(3, 64, seed=1)


def test_options_must_be_bounded():
    with pytest.raises(BenchError, match="bounded"):
        LoadOptions(num_requests=None)


# -- against the fake server ---------------------------------------------------------------------


def test_counts_latencies_and_load_deltas(fake):
    url, state = fake
    result = asyncio.run(run_load(_options(url, adapters=4, scenario="distinct")))
    s = result.summary()
    assert result.adapters == ADAPTERS[:4]  # sorted by name, the first 4
    assert s["all"]["requests"] == s["all"]["ok"] == s["adapter"]["ok"] == 12
    assert s["all"]["failed"] == s["base"]["requests"] == 0
    assert s["all"]["output_tokens"] == 12 * 3
    # concurrent requests reach the server in any order: compare what was sent, as a multiset
    assert sorted(state.received) == sorted(ADAPTERS[i % 4] for i in range(12))
    assert sorted(r.model for r in result.records) == sorted(state.received)
    for r in result.records:
        assert r.status == 200 and r.output_tokens == 3 and len(r.itl_s) == 2
        assert 0 < r.ttft_s <= r.e2e_s
    assert s["all"]["ttft_p50_s"] <= s["all"]["ttft_p95_s"] <= s["all"]["ttft_p99_s"]
    assert s["all"]["e2e_p50_s"] >= s["all"]["ttft_p50_s"]
    assert s["base"]["ttft_p50_s"] is None
    # a-00 and a-02 live on r0, a-01 and a-03 on r1; counters started at 5 and 3
    assert s["adapter_loads"] == {"total": 4, "per_replica": {"r0": 2, "r1": 2}}
    # 4 first requests missed, 8 found their adapter loaded
    assert s["server"]["device_hit_rate"] == pytest.approx(8 / 12)
    assert s["server"]["host_hit_rate"] == 0 and s["server"]["load_wait_s"] == pytest.approx(0.04)


def test_warmup_requests_are_not_measured(fake):
    """distinct over 4 adapters: the 4 warm-up requests load every adapter, so the measured
    run finds them all loaded and its prompts continue after the warm-up's."""
    url, state = fake
    options = _options(url, adapters=4, scenario="distinct", warmup_requests=4, stats_settle_s=0)
    result = asyncio.run(run_load(options))
    s = result.summary()
    per_model = dict.fromkeys(["a-00", "a-01", "a-02", "a-03"], 1)  # what the warm-up named
    assert s["warmup"] == {"requests": 4, "ok": 4, "requests_per_model": per_model}
    assert s["all"]["requests"] == s["all"]["ok"] == 12
    assert len(state.received) == 16
    assert s["adapter_loads"]["total"] == 0
    assert sorted(r.index for r in result.records) == list(range(4, 16))


def test_mixed_base_splits_base_and_adapter(fake):
    url, _ = fake
    options = _options(url, num_requests=40, scenario="mixed-base", base_fraction=0.5, rate=400)
    s = asyncio.run(run_load(options)).summary()
    assert s["base"]["ok"] + s["adapter"]["ok"] == s["all"]["ok"] == 40
    assert s["base"]["ok"] > 0 and s["adapter"]["ok"] > 0
    assert s["requests_per_model"][BASE] == s["base"]["requests"]


def test_errors_are_counted_not_raised(fake):
    url, state = fake
    state.missing = {"a-01"}
    result = asyncio.run(run_load(_options(url, adapters=4, scenario="distinct", num_requests=8)))
    s = result.summary()
    assert (s["all"]["ok"], s["all"]["failed"]) == (6, 2)
    assert s["errors"] == ["HTTP 404: model 'a-01' does not exist"]
    assert {r.status for r in result.records if not r.ok} == {404}


def test_too_few_adapters_is_a_clear_error(fake):
    url, _ = fake
    with pytest.raises(BenchError, match="only 6 registered"):
        asyncio.run(run_load(_options(url, adapters=7)))


def test_missing_stats_endpoint_means_unknown_loads(fake):
    url, state = fake
    state.stats = False
    s = asyncio.run(run_load(_options(url, num_requests=4))).summary()
    assert s["all"]["ok"] == 4
    assert s["adapter_loads"] == {"total": None, "per_replica": None} and s["server"] is None


def test_duration_bounds_the_run(fake):
    url, state = fake
    state.token_delay_s = 0.5  # 20 tokens: 10 s a request, far past duration + grace
    options = _options(url, num_requests=None, duration_s=0.3, grace_s=0.2, max_tokens=20)
    t0 = time.perf_counter()
    s = asyncio.run(run_load(options)).summary()
    assert time.perf_counter() - t0 < 2.0
    assert s["all"]["requests"] == s["all"]["cancelled"] == options.concurrency
    assert s["all"]["ok"] == s["all"]["failed"] == 0


def test_cli_quick_run_writes_json(fake, tmp_path, capsys):
    url, _ = fake
    parser = argparse.ArgumentParser()
    bench_http.add_arguments(parser)
    out = tmp_path / "http.json"
    flags = f"--quick --label ci --adapters 2 --scenario zipf --stats-settle-s 0 --json {out}"
    args = parser.parse_args(["--url", url, *flags.split()])
    assert bench_http.run(args) == 0
    report = json.loads(out.read_text())
    assert report["label"] == "ci" and report["options"]["max_tokens"] == 4
    assert report["all"]["ok"] == 16 and report["all"]["output_tokens"] == 64
    assert set(report["requests_per_model"]) <= {"a-00", "a-01"}
    assert {"ttft_p95_s", "itl_p99_s", "e2e_p50_s", "output_tok_per_s"} <= set(report["adapter"])
    assert report["adapter_loads"]["total"] == len(report["requests_per_model"])
    printed = capsys.readouterr().out
    assert "[ci]" in printed and "adapter loads:" in printed and "TTFT ms p50/p95/p99" in printed


def test_cli_reports_user_errors_without_traceback(fake, capsys):
    url, _ = fake
    parser = argparse.ArgumentParser()
    bench_http.add_arguments(parser)
    assert bench_http.run(parser.parse_args(["--url", url, "--adapters", "9", "--quick"])) == 2
    assert "only 6 registered" in capsys.readouterr().err


def test_cli_sends_the_api_key(fake, capsys):
    """A server started with api_key_for_inference wants the key on every request."""
    url, state = fake
    state.key = "k-123"
    parser = argparse.ArgumentParser()
    bench_http.add_arguments(parser)
    args = parser.parse_args(["--url", url, "--quick", "--stats-settle-s", "0"])
    assert bench_http.run(args) == 2  # no key: /v1/models is refused, one line
    assert "HTTP 401" in capsys.readouterr().err
    args = parser.parse_args(
        ["--url", url, "--quick", "--stats-settle-s", "0", "--api-key", "k-123"]
    )
    assert bench_http.run(args) == 0
    assert state.authorizations[-1] == "Bearer k-123"


def test_cli_fails_when_every_request_failed(fake, capsys):
    url, state = fake
    state.missing = set(ADAPTERS) | {BASE}
    parser = argparse.ArgumentParser()
    bench_http.add_arguments(parser)
    assert (
        bench_http.run(parser.parse_args(["--url", url, "--quick", "--stats-settle-s", "0"])) == 1
    )
    err = capsys.readouterr().err
    assert err.startswith("lorafleet: error: every request failed") and "HTTP 404" in err
