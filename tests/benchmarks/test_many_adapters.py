"""`python -m benchmarks many-adapters`: its adapters, its arguments, its arithmetic against the
targets, and a sweep end to end against a fake server on 127.0.0.1 that registers adapters
as the real one does (a 400 for a name already live, a 404 for a name not registered).

The real server is measured by the command itself (benchmarks/results/many_adapters.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response, StreamingResponse

from benchmarks import harness
from benchmarks import many_adapters as bench
from benchmarks.harness import RunResult, Sizes
from benchmarks.many_adapters import (
    DEFAULT_COUNTS,
    FULL,
    AdapterSpec,
    Registration,
    Step,
    adapter_cache_dir,
    adapter_names,
    build_adapters,
    compare,
    counts_arg,
    load_options,
    report,
    serve_config,
    sweep,
)
from replica.model.adapter_weights import load_peft_adapter
from replica.model.spec import load_model_spec
from tests.net import serving

BASE = "fake-base"

# -- arguments and the deployment (no server) ---------------------------------------------------


def test_adapter_counts_parse_sorted_and_distinct():
    assert counts_arg("16,256,1024") == (16, 256, 1024)
    assert counts_arg("1024, 16,16") == (16, 1024)
    for bad in ("", "16,x", "0,16", "-4"):
        with pytest.raises(argparse.ArgumentTypeError):
            counts_arg(bad)


def test_the_command_line():
    parse = harness.parser(bench).parse_args
    args = parse(["--adapters", "256,16"])
    assert args.adapters == (16, 256) and not args.quick
    assert parse([]).adapters == DEFAULT_COUNTS
    with pytest.raises(SystemExit):
        parse(["--adapters", "many"])


def test_the_load_is_the_issues():
    o = load_options("http://x", 1024, FULL)
    assert (o.scenario, o.adapters, o.concurrency) == ("uniform", 1024, 32)
    assert (o.prompt_tokens, o.max_tokens, o.rate) == (64, 32, None)
    assert o.num_requests == 192 and o.warmup_requests == 32


def test_the_app_is_the_demo_with_default_settings_and_one_adapter(tmp_path):
    paths = {n: tmp_path / n for n in adapter_names(3)}
    config = serve_config(paths, port=8123)
    app = config["applications"][0]
    store = app["args"]["store"]
    assert store["adapters"] == {"many-00000": str(paths["many-00000"])}
    assert str(tmp_path) in store["adapter_roots"]  # every adapter may be loaded
    from cluster import serving

    default = serving.load_config(serving.DEFAULT_CONFIG)["applications"][0]["args"]["engine"]
    assert app["args"]["engine"] == {**default, "model": "demo"}  # nothing else changed
    replica = next(d for d in app["deployments"] if d["name"] == "LoRAReplica")
    assert replica["num_replicas"] == 2 and "autoscaling_config" not in replica
    assert config["http_options"] == {"host": "127.0.0.1", "port": 8123}
    assert "resolvers" not in store


def test_with_resolvers_the_local_one_looks_in_the_adapters_directory(tmp_path):
    from cluster.config import AppConfig

    if not bench.resolvers_available():
        pytest.skip("this build has no adapter resolvers")
    paths = {n: tmp_path / n for n in adapter_names(3)}
    args = serve_config(paths, port=8123, resolve=True)["applications"][0]["args"]
    store = args["store"]
    assert store["resolvers"] == ["local"] and str(tmp_path) in store["adapter_roots"]
    AppConfig.model_validate(args)  # a config the app accepts


# -- the adapters ----------------------------------------------------------------------------------


def test_names_sort_in_build_order():
    names = adapter_names(10_000)[::997]
    assert names == sorted(names) and names[0] == "many-00000"


def test_the_cache_directory_is_keyed_by_the_spec(tmp_path):
    a = adapter_cache_dir(AdapterSpec(), tmp_path)
    assert a == adapter_cache_dir(AdapterSpec(), tmp_path) and a.parent == tmp_path
    assert adapter_cache_dir(AdapterSpec(rank=16), tmp_path) != a
    assert adapter_cache_dir(AdapterSpec(targets=("q_proj",)), tmp_path) != a


def test_adapters_are_distinct_deterministic_valid_and_built_once(tmp_path, demo):
    spec = AdapterSpec()
    first = build_adapters(3, spec, tmp_path / "a")
    assert list(first) == adapter_names(3)
    files = {n: (p / "adapter_model.safetensors").read_bytes() for n, p in first.items()}
    assert len(set(files.values())) == 3  # distinct weights
    again = build_adapters(2, spec, tmp_path / "b")  # another directory: the same bytes
    assert all((p / "adapter_model.safetensors").read_bytes() == files[n]
               for n, p in again.items())  # fmt: skip
    stamps = {n: p.stat().st_mtime_ns for n, p in first.items()}
    more = build_adapters(4, spec, tmp_path / "a")  # only the 4th is built
    assert {n: more[n].stat().st_mtime_ns for n in stamps} == stamps
    assert not [p for p in (tmp_path / "a").iterdir() if p.name.startswith(".")]  # no tmp left
    model = load_model_spec(demo.model_dir)  # the demo app's model
    for name, path in more.items():
        config = json.loads((path / "adapter_config.json").read_text())
        assert (config["r"], sorted(config["target_modules"])) == (8, ["q_proj", "v_proj"])
        weights = load_peft_adapter(path, model, 64, name)
        assert weights.rank == 8
    size = (more["many-00000"] / "adapter_model.safetensors").stat().st_size
    assert size * 4096 < 2 * 2**30  # 4,096 of them stay under 2 GB


# -- the arithmetic ----------------------------------------------------------------------------


def _step(n: int, tok_s: float, ttft: float, before: int, seconds: float) -> Step:
    figures = {"ok": 10, "requests": 10, "output_tok_per_s": tok_s, "ttft_p50_s": ttft,
               "ttft_p99_s": 2 * ttft}  # fmt: skip
    return Step(Registration(before, n, seconds), RunResult(n, {"all": figures}), [1.5, 1.0, 0.5])


def _sweep_steps(tok_1024: float = 180.0, tok_4096: float = 160.0) -> list[Step]:
    return [
        _step(16, 200.0, 0.5, 1, 1.0),
        _step(256, 190.0, 0.6, 16, 9.0),
        _step(1024, tok_1024, 1.0, 256, 30.0),
        _step(4096, tok_4096, 2.0, 1024, 150.0),
    ]


def test_ratios_to_the_smallest_count_and_the_targets():
    f = compare(_sweep_steps())
    assert f["ratio_to"] == 16
    per, met = f["per_n"], _met(f)
    assert per[16]["tok_s_ratio"] == 1.0 and "tok_s_ratio_at_16" not in met  # no target
    assert per[256]["tok_s_ratio"] == pytest.approx(0.95)
    assert per[1024]["tok_s_ratio"] == pytest.approx(0.9) and met["tok_s_ratio_at_1024"] is True
    assert per[4096]["tok_s_ratio"] == pytest.approx(0.8) and met["tok_s_ratio_at_4096"] is False
    assert per[4096]["ttft_p50_ratio"] == pytest.approx(4.0)
    reg = f["registration"]
    assert reg["count"] == 4095 and reg["seconds"] == pytest.approx(190.0)
    assert reg["per_s"] == pytest.approx(4095 / 190)
    assert reg["first_1023_s"] == pytest.approx(40.0)
    assert met["first_1023_registrations_s"] is False
    fast = compare([_step(16, 1.0, 0.1, 1, 1.0), _step(1024, 1.0, 0.1, 16, 14.0)])
    assert fast["registration"]["first_1023_s"] == 15.0  # the bound itself meets it
    assert _met(fast)["first_1023_registrations_s"] is True


def _met(figures: dict) -> dict:
    return {name: checked["met"] for name, checked in figures["targets"].items()}


def test_without_1024_adapters_there_is_no_1023_figure():
    f = compare(_sweep_steps()[:2])
    assert f["registration"]["first_1023_s"] is None
    assert _met(f)["first_1023_registrations_s"] is None
    assert _met(f)["tok_s_ratio_at_1024"] is None  # not reached: unknown
    assert compare([])["per_n"] == {}


def test_resolution_is_compared_with_registered_adapters_no_replica_held():
    cold = {"cold_ttft_p50_s": 0.2, "resolution": {"cold_ttft_p50_s": 0.3}}
    f = compare(_sweep_steps(), cold)
    assert f["resolution"]["over_registered"] == pytest.approx(1.5)
    assert _met(f)["resolution_over_registered"] is True  # the bound
    cold["resolution"]["cold_ttft_p50_s"] = 0.31
    assert _met(compare(_sweep_steps(), cold))["resolution_over_registered"] is False
    cold["resolution"]["cold_ttft_p50_s"] = None  # every probe failed
    assert _met(compare(_sweep_steps(), cold))["resolution_over_registered"] is None
    assert compare(_sweep_steps(), {"cold_ttft_p50_s": 0.2})["resolution"] is None


def test_report_has_a_row_per_count_and_the_registration_line():
    steps = _sweep_steps()
    meta = bench._meta(FULL, AdapterSpec(), DEFAULT_COUNTS, argparse.Namespace(quick=False))
    meta |= {"load_average_before": [1.0, 2.0, 3.0], "load_average_after": None}
    cold = {"cold_ttft_p50_s": 0.9, "warm_ttft_p50_s": 0.3, "cold_ttft_s": [0.9, 0.9]}
    text = report(steps, compare(steps), cold, meta)
    rows = [line for line in text.splitlines() if line.startswith("| 1024 ")]
    assert rows == ["| 1024 | 10/10 | 180.0 | 0.90x (>= 0.9: met) | 1000 / 2000 | 2.00x "
                    "| 768 in 30.0 s, 25.6/s | 1.50 / 1.00 / 0.50 |"]  # fmt: skip
    assert "0.80x (>= 0.85: NOT met)" in text
    assert "the first 1,023 in 40.0 s (target <= 15 s: NOT met)" in text
    assert "TTFT p50 900 ms; the same adapter again (resident) 300 ms" in text
    assert "load average 1.00 / 2.00 / 3.00 before" in text
    assert "first-request resolution: " + meta["resolution"] in text
    cold["resolution"] = {"cold_ttft_p50_s": 1.8}
    assert ("first-request resolution (the 'local' resolver), the same probes to adapters "
            "never registered: TTFT p50 1800 ms, 2.00x that of a registered one (target "
            "<= 1.5x: NOT met)") in report(steps, compare(steps, cold), cold, meta)  # fmt: skip


def test_plot_is_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    meta = bench._meta(FULL, AdapterSpec(), DEFAULT_COUNTS, argparse.Namespace(quick=False))
    bench.plot(_sweep_steps(), tmp_path / "p.png", meta)
    assert (tmp_path / "p.png").read_bytes().startswith(b"\x89PNG")


# -- a sweep against a fake server ---------------------------------------------------------------


def _fake_app(
    registered: dict[str, str], received: list[tuple[str, int]], root: Path | None = None
) -> FastAPI:
    """The endpoints a sweep uses: models, runtime loads, streamed completions (no stats).
    `received`: each completion's model and how many adapters were registered then. With
    `root`, an unknown model that is a directory there is registered on its first request
    (a 'local' resolver)."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict:
        cards = [{"id": BASE, "parent": None}]
        cards += [{"id": name, "parent": BASE} for name in registered]
        return {"object": "list", "data": cards}

    @app.post("/v1/load_lora_adapter")
    async def load(body: dict) -> Response:
        name, path = body["lora_name"], body["lora_path"]
        if name in registered or not Path(path, "adapter_config.json").is_file():
            return JSONResponse({"error": {"message": f"cannot load {name}"}}, 400)
        registered[name] = path
        return JSONResponse({"status": "ok", "lora_name": name, "version": len(registered)})

    @app.post("/v1/completions")
    async def completions(body: dict) -> Response:
        received.append((body["model"], len(registered)))
        if root is not None and (root / body["model"] / "adapter_config.json").is_file():
            registered.setdefault(body["model"], str(root / body["model"]))
        if body["model"] not in registered:
            return JSONResponse({"error": {"message": "no such model"}}, 404)
        return StreamingResponse(_words(body["max_tokens"]), media_type="text/event-stream")

    return app


async def _words(n: int):
    for k in range(n):
        await asyncio.sleep(0.001)
        yield f"data: {json.dumps({'choices': [{'index': 0, 'text': f' w{k}'}]})}\n\n"
    usage = {"prompt_tokens": 8, "completion_tokens": n, "total_tokens": 8 + n}
    yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
    yield "data: [DONE]\n\n"


def test_a_sweep_registers_up_to_each_count_then_loads_exactly_those(tmp_path):
    adapters = build_adapters(12, AdapterSpec(), tmp_path)
    first = next(iter(adapters))
    registered, received = {first: str(adapters[first])}, []
    sizes = Sizes(concurrency=3, prompt_tokens=8, max_tokens=3, requests=12, warmup=3,
                  register_concurrency=2, cold_probes=2, settle_s=0.0)  # fmt: skip
    with serving(_fake_app(registered, received)) as url:
        steps, cold = asyncio.run(sweep(url, adapters, (2, 12), sizes))
    assert sorted(registered) == adapter_names(12)  # each once: a second time is a 400
    assert [(s.registration.before, s.registration.after) for s in steps] == [(1, 2), (2, 12)]
    assert [s.registration.failed for s in steps] == [0, 0]
    # N=2: warm-up and run name the first 2, with 2 registered; N=12: all 12 registered
    assert {m for m, _ in received[:15]} == set(adapter_names(2))
    assert [n for _, n in received[:15]] == [2] * 15
    assert {n for _, n in received[15:]} == {12}
    for step in steps:
        a = step.summary["all"]
        assert a["ok"] == a["requests"] == 12 and a["output_tokens"] == 36
        assert set(step.summary["requests_per_model"]) <= set(adapter_names(step.adapters))
        assert len(step.load.ttfts_s) == 12 and len(step.load_average) == 3
    # the probes: adapters no request of the sweep named, each sent twice, one at a time
    probed = cold["adapters"]
    assert len(probed) == 2 and not set(probed) & {m for m, _ in received[:30]}
    assert [m for m, _ in received[30:]] == [probed[0], probed[0], probed[1], probed[1]]
    assert len(cold["cold_ttft_s"]) == len(cold["warm_ttft_s"]) == 2
    assert cold["cold_ttft_p50_s"] > 0 and cold["warm_ttft_p50_s"] > 0


def test_failed_registrations_are_counted_not_raised(tmp_path):
    adapters = build_adapters(3, AdapterSpec(), tmp_path)
    registered = {n: str(p) for n, p in adapters.items()}  # all live already: 400 each
    with serving(_fake_app(registered, [])) as url:
        r = asyncio.run(bench.register(url, list(adapters.items())[1:], 2, before=1))
    assert (r.count, r.failed) == (2, 2)
    assert all("HTTP 400" in e for e in r.errors)


def test_with_a_resolver_the_probes_go_to_adapters_never_registered_too(tmp_path):
    adapters = build_adapters(8, AdapterSpec(), tmp_path)  # 6 for the sweep, 2 to resolve
    first = next(iter(adapters))
    registered, received = {first: str(adapters[first])}, []
    sizes = Sizes(concurrency=2, prompt_tokens=8, max_tokens=2, requests=4, warmup=0,
                  register_concurrency=2, cold_probes=2, settle_s=0.0)  # fmt: skip
    with serving(_fake_app(registered, received, root=tmp_path)) as url:
        steps, cold = asyncio.run(sweep(url, adapters, (6,), sizes, resolve=True))
    resolved = cold["resolution"]
    assert resolved["adapters"] == adapter_names(8)[6:]  # past the last N: never registered
    # each resolved on its first request: 6 adapters registered then, 7 on the second
    assert received[-4:] == [("many-00006", 6), ("many-00006", 7), ("many-00007", 7),
                             ("many-00007", 8)]  # fmt: skip
    assert len(resolved["cold_ttft_s"]) == len(resolved["warm_ttft_s"]) == 2
    assert compare(steps, cold)["resolution"]["over_registered"] > 0
