"""`lorafleet bench http`'s prefix scenarios (shared-prefix, multi-turn): their prompts, the
hit-rate arithmetic, and runs against a fake server on 127.0.0.1 that caches prefixes.

The fake's tokens are the prompt's words and it caches blocks of BLOCK words per model,
generated words included (as the engine does), counting as the engine's telemetry does.
The real server is measured by `python -m benchmarks prefix` (tests/benchmarks/test_prefix.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import time
from dataclasses import dataclass, field

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response, StreamingResponse

from cluster.bench import http as bench_http
from cluster.bench.http import (
    ONE_TOKEN_WORDS,
    WORDS,
    BenchError,
    LoadOptions,
    RequestRecord,
    counter_deltas,
    next_turn_prompt,
    prefix_figures,
    request_picker,
    run_load,
    shared_prefix_prompt,
    system_prompt,
    user_message,
)
from tests.net import serving

BASE = "fake-base"
ADAPTERS = [f"a-{i:02d}" for i in range(4)]
BLOCK = 4  # the fake's block, in words


# -- prompts (no server) ------------------------------------------------------------------------


def _shared(model: str, i: int, **kw) -> str:
    options = LoadOptions(scenario="shared-prefix", prefix_tokens=50, prompt_tokens=10, **kw)
    return shared_prefix_prompt(model, i, options)


def test_system_prompts_are_per_adapter_and_deterministic():
    prompts = {a: system_prompt(a, 200, seed=0) for a in ADAPTERS}
    assert len(set(prompts.values())) == len(ADAPTERS)  # a different one per adapter
    assert all(system_prompt(a, 200, seed=0) == p for a, p in prompts.items())  # and stable
    assert system_prompt("a-00", 200, seed=1) != prompts["a-00"]
    for p in prompts.values():
        head, *words = p.split()
        assert head == "System:" and len(words) == 200 and set(words) <= set(ONE_TOKEN_WORDS)


def test_shared_prefix_requests_share_their_adapters_system_prompt_and_nothing_else():
    # request i names adapter i % 4: 20 requests each
    prompts = {i: (ADAPTERS[i % 4], _shared(ADAPTERS[i % 4], i)) for i in range(80)}
    for a, p in prompts.values():
        assert p.startswith(system_prompt(a, 50, seed=0) + "\nUser: ")
        assert p.endswith("\nAssistant:")
    suffixes = [p.split("\nUser: ", 1)[1] for _, p in prompts.values()]
    assert len(set(suffixes)) == len(suffixes)  # every user message its own
    assert all(9 <= len(s.split()) <= 12 for s in suffixes)
    assert LoadOptions(scenario="shared-prefix").prompt_tokens == bench_http.SUFFIX_TOKENS == 32
    assert LoadOptions(scenario="multi-turn").prompt_tokens == bench_http.PROMPT_TOKENS


def test_multi_turn_prompts_extend_the_previous_turn_exactly():
    prompt, answers = "", [" first answer", "2nd!", " third"]
    for turn in range(len(answers)):
        message = user_message(f"7.{turn}", 12, seed=0)
        extended = next_turn_prompt(prompt, answers[turn - 1] if turn else "", message)
        if turn == 0:
            assert extended == message and extended.startswith("User: 7.0: ")
        else:
            assert extended == f"{prompt}{answers[turn - 1]}\n{message}"
        assert extended.endswith("\nAssistant:")
        prompt = extended
    assert user_message("7.1", 12, seed=0) != user_message("7.2", 12, seed=0)


def test_prompt_words_are_one_token_each_and_prefixes_tokenize_as_prefixes(demo):
    """With the demo tokenizer: --prefix-tokens words are that many tokens (ONE_TOKEN_WORDS;
    WORDS are ~1.6 a word), and the text a request shares is a token prefix too, whatever
    a multi-turn answer (random token ids, as from the random-weight demo) starts with."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo.model_dir)
    assert set(ONE_TOKEN_WORDS) <= set(WORDS)
    assert all(len(tok(" " + w)["input_ids"]) == 1 for w in ONE_TOKEN_WORDS)
    ids = tok(system_prompt("a-00", 1000, seed=0))["input_ids"]
    assert 1000 < len(ids) <= 1008  # "System:" is a few
    options = LoadOptions(scenario="shared-prefix")  # 1000 + 32 words
    for i in range(5):
        prompt = tok(shared_prefix_prompt("a-00", i, options))["input_ids"]
        assert prompt[: len(ids)] == ids and 1030 < len(prompt) < 1050
    rng = random.Random(0)
    prompt = user_message("0.0", 32, seed=0)
    for turn in range(1, 12):
        answer = tok.decode([rng.randrange(3, tok.vocab_size) for _ in range(16)])
        extended = next_turn_prompt(prompt, answer, user_message(f"0.{turn}", 32, seed=0))
        before = tok(prompt)["input_ids"]
        assert tok(extended)["input_ids"][: len(before)] == before, (prompt[-40:], answer)
        prompt = extended


def test_picks_for_the_prefix_scenarios_are_uniform_and_seeded():
    for scenario in ("shared-prefix", "multi-turn"):
        pick = request_picker(LoadOptions(scenario=scenario, seed=3), BASE, ADAPTERS)
        picks = [pick(i) for i in range(4000)]
        counts = [picks.count(a) for a in ADAPTERS]
        assert min(counts) > 0 and max(counts) / min(counts) < 1.2
        again = request_picker(LoadOptions(scenario=scenario, seed=3), BASE, ADAPTERS)
        assert [again(i) for i in range(50)] == picks[:50]


def test_the_prefix_scenarios_without_adapters_run_on_the_base_model():
    for scenario in ("shared-prefix", "multi-turn"):
        pick = request_picker(LoadOptions(scenario=scenario), BASE, [])
        assert {pick(i) for i in range(20)} == {BASE}
    with pytest.raises(BenchError, match="at least one adapter"):
        request_picker(LoadOptions(scenario="uniform"), BASE, [])


def test_multi_turn_is_closed_loop_only():
    with pytest.raises(BenchError, match="closed loop"):
        LoadOptions(scenario="multi-turn", rate=2.0)
    with pytest.raises(BenchError, match="turns"):
        LoadOptions(scenario="multi-turn", turns=0)


# -- the arithmetic ------------------------------------------------------------------------------


def _record(prompt: int | None, cached: int | None, context: int | None = None) -> RequestRecord:
    r = RequestRecord(0, "a", False, e2e_s=0.1, prompt_tokens=prompt, cached_tokens=cached)
    r.context_tokens = context
    return r


def test_hit_rate_is_cached_over_prompt_tokens_of_the_requests_that_report_both():
    figures = prefix_figures([_record(100, 80), _record(50, 0), _record(30, None)])
    assert figures["cached_tokens"] == 80
    assert figures["prompt_tokens"] == 180  # every usage counts in the total...
    assert figures["prefix_hit_rate"] == pytest.approx(80 / 150)  # ...the rate: both fields
    assert figures["previous_prompt_share"] is None  # no multi-turn records


def test_hit_rate_is_unknown_without_cached_tokens():
    figures = prefix_figures([_record(100, None), _record(None, None)])
    assert figures["cached_tokens"] is None and figures["prefix_hit_rate"] is None
    assert prefix_figures([])["prefix_hit_rate"] is None


def test_previous_prompt_share_of_multi_turn_records():
    turns = [_record(20, 0, context=0), _record(50, 16, context=20), _record(80, 48, context=50)]
    figures = prefix_figures(turns)
    assert figures["previous_prompt_share"] == pytest.approx(70 / 150)
    assert figures["prefix_hit_rate"] == pytest.approx(64 / 150)


def test_server_hit_rate_from_the_replicas_prefix_counters():
    before = {"r0": {"adapter_loads": 1, "prefix_queried_tokens": 100, "prefix_hit_tokens": 10}}
    after = {
        "r0": {"adapter_loads": 1, "prefix_queried_tokens": 300, "prefix_hit_tokens": 160},
        "r1": {"adapter_loads": 2, "prefix_queried_tokens": 100, "prefix_hit_tokens": 50},
    }
    server = bench_http._server_side(counter_deltas(before, after))["server"]
    assert (server["prefix_queried_tokens"], server["prefix_hit_tokens"]) == (300, 200)
    assert server["prefix_hit_rate"] == pytest.approx(200 / 300)
    older = bench_http._server_side({"r0": {"adapter_loads": 1}})["server"]  # no counters
    assert older["prefix_hit_rate"] is None and older["prefix_queried_tokens"] is None
    idle = {"r0": {"adapter_loads": 0, "prefix_queried_tokens": 0, "prefix_hit_tokens": 0}}
    assert bench_http._server_side(idle)["server"]["prefix_hit_rate"] is None


# -- against a fake server that caches prefixes -------------------------------------------------


@dataclass
class FakeState:
    details: bool = True  # usage.prompt_tokens_details and the telemetry's prefix counters
    token_delay_s: float = 0.002
    blocks: dict[str, set[tuple[str, ...]]] = field(default_factory=dict)  # per model
    queried: int = 0
    hit: int = 0
    log: list[dict] = field(default_factory=list)  # one entry per request, in arrival order
    in_flight: int = 0
    max_in_flight: int = 0


def _fake_app(state: FakeState) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict:
        cards = [{"id": BASE, "object": "model", "parent": None}]
        return {"object": "list", "data": cards + [{"id": a, "parent": BASE} for a in ADAPTERS]}

    @app.get("/v1/lorafleet/stats")
    async def stats() -> JSONResponse:
        telemetry: dict = {"lookups": {}, "load_wait_seconds": 0.0}
        if state.details:
            telemetry |= {"prefix_queried_tokens": state.queried, "prefix_hit_tokens": state.hit}
        replica = {"adapter_loads": 0, "telemetry": telemetry}
        return JSONResponse({"replicas": {"r0": replica}, "store": {}})

    @app.post("/v1/completions")
    async def completions(body: dict) -> Response:
        entry = {"model": body["model"], "prompt": body["prompt"], "n": len(state.log),
                 "received": time.perf_counter()}  # fmt: skip
        state.log.append(entry)
        return StreamingResponse(_answer(body, entry, state), media_type="text/event-stream")

    return app


def _cached_words(state: FakeState, model: str, words: list[str]) -> int:
    """The longest run of cached full blocks, leaving the last word to compute."""
    cached = state.blocks.setdefault(model, set())
    n = 0
    while (n + 1) * BLOCK <= len(words) - 1 and tuple(words[: (n + 1) * BLOCK]) in cached:
        n += 1
    return n * BLOCK


async def _answer(body: dict, entry: dict, state: FakeState):
    state.in_flight += 1
    state.max_in_flight = max(state.max_in_flight, state.in_flight)
    try:
        words = body["prompt"].split()
        cached = _cached_words(state, body["model"], words)
        state.queried, state.hit = state.queried + len(words), state.hit + cached
        entry["cached"], entry["answer"] = cached, ""
        for k in range(body["max_tokens"]):
            await asyncio.sleep(state.token_delay_s)
            text = f" r{entry['n']}w{k}"
            entry["answer"] += text
            yield f"data: {json.dumps({'choices': [{'index': 0, 'text': text}]})}\n\n"
        done = words + entry["answer"].split()  # generated blocks are cached too
        state.blocks[body["model"]] |= {
            tuple(done[:end]) for end in range(BLOCK, len(done) + 1, BLOCK)
        }
        usage = {"prompt_tokens": len(words), "completion_tokens": body["max_tokens"]}
        if state.details:
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
        entry["done"] = time.perf_counter()
        yield "data: [DONE]\n\n"
    finally:
        state.in_flight -= 1


@pytest.fixture(scope="module")
def server():
    state = FakeState()
    with serving(_fake_app(state)) as url:
        yield url, state


@pytest.fixture
def fake(server):
    url, state = server
    state.__init__()
    return url, state


def _options(url: str, **kw) -> LoadOptions:
    defaults = dict(url=url, num_requests=16, max_tokens=3, prompt_tokens=6, prefix_tokens=24,
                    concurrency=4, stats_settle_s=0.0, timeout_s=5.0)  # fmt: skip
    return LoadOptions(**{**defaults, **kw})


def _conversation(prompt: str) -> tuple[int, list[int]]:
    """(conversation, its turns so far) from the tags "User: C.T:" of a multi-turn prompt."""
    tags = [(int(c), int(t)) for c, t in re.findall(r"User: (\d+)\.(\d+):", prompt)]
    assert len({c for c, _ in tags}) == 1, prompt
    return tags[0][0], [t for _, t in tags]


def test_shared_prefix_run_reports_client_and_server_hit_rates(fake):
    url, state = fake
    result = asyncio.run(run_load(_options(url, scenario="shared-prefix", num_requests=24)))
    s = result.summary()
    assert s["all"]["ok"] == 24 and len(state.log) == 24
    by_prompt = {e["prompt"]: e for e in state.log}
    for r in result.records:  # each request's own prompt, its adapter's system prompt first
        entry = by_prompt[shared_prefix_prompt(r.model, r.index, result.options)]
        assert entry["model"] == r.model and r.cached_tokens == entry["cached"]
    prompt = sum(len(e["prompt"].split()) for e in state.log)
    cached = sum(e["cached"] for e in state.log)
    assert (s["all"]["prompt_tokens"], s["all"]["cached_tokens"]) == (prompt, cached)
    assert s["all"]["prefix_hit_rate"] == pytest.approx(cached / prompt)
    assert s["server"]["prefix_hit_rate"] == pytest.approx(cached / prompt)
    # a request sent after one of its adapter's had finished finds the 24-word system prompt
    for e in state.log:
        if any(o["model"] == e["model"] and o["done"] < e["received"] for o in state.log):
            assert e["cached"] >= 24, e
    assert s["all"]["prefix_hit_rate"] > 0.5
    assert s["all"]["previous_prompt_share"] is None


def test_multi_turn_turns_are_sequential_and_extend_the_previous_prompt_and_answer(fake):
    url, state = fake
    state.token_delay_s = 0.02  # the 3 conversations' first turns overlap, even on a busy CPU
    options = _options(url, scenario="multi-turn", turns=3, num_requests=14, concurrency=3)
    result = asyncio.run(run_load(options))
    s = result.summary()
    assert s["all"]["requests"] == s["all"]["ok"] == 14 == len(state.log)  # turns counted
    conversations: dict[int, list[dict]] = {}
    for e in state.log:  # arrival order
        conversation, turns = _conversation(e["prompt"])
        conversations.setdefault(conversation, []).append(e)
        assert turns == list(range(len(conversations[conversation])))
    assert sorted(conversations) == list(range(len(conversations)))
    assert [len(c) for c in conversations.values()].count(3) >= 3  # some ran all 3 turns
    for turns in conversations.values():
        assert len({e["model"] for e in turns}) == 1  # one adapter per conversation
        for prev, e in zip(turns, turns[1:]):
            assert e["received"] > prev["done"]  # sent once the previous answer had arrived
            assert e["prompt"].startswith(prev["prompt"] + prev["answer"] + "\nUser: ")
            assert e["cached"] >= len(prev["prompt"].split()) - BLOCK  # its prefix was cached
    assert state.max_in_flight == 3  # concurrency bounds conversations in flight
    # records mirror the turns: the context is the previous turn's prompt
    for r in result.records:
        assert r.turn is not None and r.conversation in conversations
        entry = conversations[r.conversation][r.turn]
        previous = conversations[r.conversation][r.turn - 1] if r.turn else None
        assert r.prompt_tokens == len(entry["prompt"].split())
        assert r.cached_tokens == entry["cached"]
        assert r.context_tokens == (len(previous["prompt"].split()) if previous else 0)
    context = sum(r.context_tokens for r in result.records)
    prompt = sum(r.prompt_tokens for r in result.records)
    assert s["all"]["previous_prompt_share"] == pytest.approx(context / prompt)
    assert 0 < s["all"]["prefix_hit_rate"] == pytest.approx(s["server"]["prefix_hit_rate"])


def test_multi_turn_warmup_conversations_are_not_measured_and_not_reused(fake):
    url, state = fake
    options = _options(url, scenario="multi-turn", turns=2, num_requests=6, warmup_requests=4,
                       concurrency=2)  # fmt: skip
    result = asyncio.run(run_load(options))
    warmup = result.summary()["warmup"]
    assert len(state.log) == 10 and (warmup["requests"], warmup["ok"]) == (4, 4)
    warm = {_conversation(e["prompt"])[0] for e in state.log[:4]}
    measured = {r.conversation for r in result.records}
    assert not warm & measured and min(measured) >= 4
    assert sorted(r.index for r in result.records) == list(range(4, 10))


def test_multi_turn_duration_bounds_the_run(fake):
    url, state = fake
    state.token_delay_s = 0.5
    options = _options(url, scenario="multi-turn", num_requests=None, duration_s=0.3,
                       grace_s=0.2, max_tokens=20, concurrency=2)  # fmt: skip
    t0 = time.perf_counter()
    s = asyncio.run(run_load(options)).summary()
    assert time.perf_counter() - t0 < 2.0
    assert s["all"]["requests"] == s["all"]["cancelled"] == 2


def test_a_server_without_prefix_details_reads_unknown(fake, capsys):
    """Until the engine reports them: no prompt_tokens_details, no prefix counters."""
    url, state = fake
    state.details = False
    parser = argparse.ArgumentParser()
    bench_http.add_arguments(parser)
    flags = "--quick --scenario shared-prefix --prefix-tokens 16 --stats-settle-s 0"
    assert bench_http.run(parser.parse_args(["--url", url, *flags.split()])) == 0
    printed = capsys.readouterr().out
    assert "~16 (shared) + ~16+4 tokens" in printed
    assert "prefix cache: hit rate unknown client-side" in printed
    assert "server: no counters" in printed
    result = asyncio.run(run_load(_options(url, scenario="multi-turn", turns=2)))
    s = result.summary()
    assert s["all"]["ok"] == 16 and s["all"]["prefix_hit_rate"] is None
    assert s["server"]["prefix_hit_rate"] is None and s["all"]["cached_tokens"] is None
    assert all(r.prompt_tokens is not None and r.cached_tokens is None for r in result.records)


def test_cli_multi_turn_prints_the_hit_rates_and_writes_them(fake, tmp_path, capsys):
    url, _ = fake
    parser = argparse.ArgumentParser()
    bench_http.add_arguments(parser)
    out = tmp_path / "mt.json"
    flags = f"--quick --scenario multi-turn --turns 3 --stats-settle-s 0 --json {out}"
    assert bench_http.run(parser.parse_args(["--url", url, *flags.split()])) == 0
    printed = capsys.readouterr().out
    assert "4 concurrent conversations" in printed and "3 turns each adding ~16+4" in printed
    line = next(x for x in printed.splitlines() if x.startswith("prefix cache:"))
    assert "client-side" in line and "server-side" in line and "previous turns:" in line
    report = json.loads(out.read_text())
    assert report["options"]["turns"] == 3 and report["all"]["ok"] == 16
    assert report["all"]["prefix_hit_rate"] > 0 and report["server"]["prefix_hit_rate"] > 0
    args = parser.parse_args(["--url", url, "--scenario", "multi-turn", "--rate", "2"])
    assert bench_http.run(args) == 2
    assert "closed loop" in capsys.readouterr().err


# -- multi-turn in token ids (servers that return them) ----------------------------------------


def test_next_turn_ids_repeat_the_previous_prompt_and_answer_exactly():
    previous = bench_http.Answer("x", prompt_ids=[1, 5, 6], token_ids=[9, 8])
    assert bench_http.next_turn_ids(previous, [4, 4]) == [1, 5, 6, 9, 8, 4, 4]


def test_multi_turn_goes_on_in_token_ids_when_the_server_returns_them():
    """A server answering with prompt_token_ids and token_ids: every later turn's prompt is
    the previous turn's ids + its answer's ids + the new message's ids (from /tokenize)."""
    sent: list = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if request.url.path == "/tokenize":
            assert body["add_special_tokens"] is False and body["prompt"].startswith("\n")
            return httpx.Response(200, json={"tokens": [70, 71]})
        sent.append(body["prompt"])
        assert body["return_token_ids"] is True
        prompt = [1, 2, 3] if isinstance(body["prompt"], str) else body["prompt"]
        answer = [50 + len(sent), 60 + len(sent)]
        chunks = [
            {"choices": [{"index": 0, "text": "a", "prompt_token_ids": prompt,
                          "token_ids": answer[:1]}]},
            {"choices": [{"index": 0, "text": "b", "token_ids": answer[1:]}]},
            {"choices": [], "usage": {"prompt_tokens": len(prompt), "completion_tokens": 2,
                                      "prompt_tokens_details": {"cached_tokens": 0}}},
        ]  # fmt: skip
        lines = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, text=lines, headers={"content-type": "text/event-stream"})

    options = LoadOptions(scenario="multi-turn", num_requests=3, turns=3, concurrency=1)

    async def run() -> list[RequestRecord]:
        transport = httpx.MockTransport(handler)
        async with httpx.AsyncClient(transport=transport) as client:
            return await bench_http._drive_conversations(
                client, "http://fake", options, lambda i: "m", BASE
            )

    records = asyncio.run(run())
    assert isinstance(sent[0], str)  # the first turn is text: nothing to go on from yet
    assert sent[1] == [1, 2, 3, 51, 61, 70, 71]
    assert sent[2] == [*sent[1], 52, 62, 70, 71]
    assert [r.context_tokens for r in records] == [0, 5, 9]  # prompt + answer ids repeated
