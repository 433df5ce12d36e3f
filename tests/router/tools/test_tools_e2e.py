"""The openai SDK's tool loop against the ingress (in-process) and a real engine running
the tiny model: the model's output is random, so calls are forced (a named function,
`required`); the grammar makes each a call whose arguments validate against the tool's
schema, streamed or not, and the tool's result goes back through the template."""

from __future__ import annotations

import asyncio
import json

import httpx2
import jsonschema
import openai
import pytest

from replica.config import EngineConfig
from replica.engine.engine import LLMEngine
from replica.wire import GenerateRequest, Reply
from tests.fakes import FakeReplicas
from tests.router.client import BASE, ingress_client, served_app
from tests.router.tools.chats import PING, WEATHER
from tests.router.tools.models import model_with_template


@pytest.fixture(scope="module")
def hermes_dir(tmp_path_factory) -> str:
    return model_with_template(tmp_path_factory.mktemp("hermes-e2e") / "model")


@pytest.fixture(scope="module")
def engine(hermes_dir) -> LLMEngine:
    return LLMEngine(EngineConfig(model=hermes_dir, device="cpu", kv_cache_bytes=16 << 20))


def engine_replicas(engine: LLMEngine) -> FakeReplicas:
    """Replicas whose answer is the engine's: one reply per generated token."""

    def script(request: GenerateRequest) -> list[Reply]:
        [seq] = engine.generate([(request.prompt_ids, request.sampling, None)])
        last = len(seq.output_ids) - 1
        return [
            Reply(
                (t,),
                seq.finish_reason if i == last else None,
                num_prompt_tokens=len(seq.prompt_ids),
            )
            for i, t in enumerate(seq.output_ids)
        ]

    return FakeReplicas(script)


def run(hermes_dir, engine, calls):
    """`calls(sdk)` (a coroutine) with an AsyncOpenAI on the ingress; its result."""
    with ingress_client(hermes_dir, None, engine_replicas(engine)):

        async def go():
            transport = httpx2.ASGITransport(app=served_app())
            async with httpx2.AsyncClient(transport=transport) as http:
                sdk = openai.AsyncOpenAI(
                    base_url="http://ingress/v1", api_key="x", http_client=http, max_retries=0
                )
                return await calls(sdk)

        return asyncio.run(go())


ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
SCHEMA = WEATHER["function"]["parameters"]


@pytest.mark.parametrize("seed", [0, 1])
def test_a_named_choice_is_always_a_valid_call_and_the_loop_goes_on(hermes_dir, engine, seed):
    async def calls(sdk):
        first = await sdk.chat.completions.create(
            model=BASE, messages=ASK, tools=[WEATHER, PING], tool_choice=NAMED, seed=seed,
            max_tokens=40,
        )  # fmt: skip
        call = first.choices[0].message.tool_calls[0]
        history = [
            *ASK,
            first.choices[0].message,  # as OpenAI's docs do: the SDK's object itself
            {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
        ]
        second = await sdk.chat.completions.create(
            model=BASE, messages=history, tools=[WEATHER, PING], tool_choice="none", max_tokens=3,
        )  # fmt: skip
        return first, second

    first, second = run(hermes_dir, engine, calls)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMA)
    assert second.choices[0].message.tool_calls == []  # none: an answer in text


def test_required_streams_valid_calls_that_reassemble(hermes_dir, engine):
    body = dict(
        model=BASE, messages=ASK, tools=[WEATHER, PING], tool_choice="required",
        parallel_tool_calls=False, seed=3, max_tokens=60,
    )  # fmt: skip

    async def calls(sdk):
        whole = await sdk.chat.completions.create(**body)
        stream = await sdk.chat.completions.create(**body, stream=True)
        return whole, [chunk async for chunk in stream]

    whole, chunks = run(hermes_dir, engine, calls)
    [call] = whole.choices[0].message.tool_calls
    assert whole.choices[0].finish_reason == "tool_calls"
    tool = {"get_weather": WEATHER, "ping": PING}[call.function.name]["function"]
    jsonschema.validate(json.loads(call.function.arguments), tool.get("parameters", {}))
    # the same seed: the stream's deltas add up to the same call
    deltas = [tc for c in chunks for ch in c.choices for tc in ch.delta.tool_calls or ()]
    assert deltas[0].id and deltas[0].function.name == call.function.name
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_the_responses_api_forces_a_valid_call_too(hermes_dir, engine):
    tool = {"type": "function", **WEATHER["function"]}

    async def calls(sdk):
        return await sdk.responses.create(
            model=BASE, input="Weather in Paris?", tools=[tool], max_output_tokens=40,
            tool_choice={"type": "function", "name": "get_weather"},
        )  # fmt: skip

    r = run(hermes_dir, engine, calls)
    [call] = r.output
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), SCHEMA)


def test_auto_with_a_strict_tool_runs_under_the_structural_tag(hermes_dir, engine):
    """The engine takes the tag (free text until a call begins); the random model's
    text stays text."""
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}

    async def calls(sdk):
        return await sdk.chat.completions.create(
            model=BASE, messages=ASK, tools=[strict], max_tokens=6, seed=0
        )

    r = run(hermes_dir, engine, calls)
    assert r.choices[0].finish_reason in ("length", "stop")
    assert r.choices[0].message.content and r.choices[0].message.tool_calls == []
