"""POST /v1/responses through the openai SDK (in-process ingress, fake replicas answering
fixed text): input items to the chat template, output items and their stream events,
function calls and their outputs, refusals of what is not served."""

from __future__ import annotations

import asyncio
import json

import httpx2
import openai
import pytest
from transformers import AutoTokenizer

from replica.wire import Reply
from router.responses_api.request import ResponsesRequest
from tests.fakes import FakeReplicas
from tests.net import assert_openai_error
from tests.router.client import BASE, KEY, ingress_client, served_app
from tests.router.tools.chats import CALL_TEXT, WEATHER
from tests.router.tools.models import answering, model_with_template

TOOL = {"type": "function", **WEATHER["function"]}  # the Responses shape: flat


@pytest.fixture(scope="module")
def hermes_dir(tmp_path_factory) -> str:
    return model_with_template(tmp_path_factory.mktemp("hermes-responses") / "model")


@pytest.fixture(scope="module")
def tok(hermes_dir):
    return AutoTokenizer.from_pretrained(hermes_dir)


def sdk_run(model_dir, replicas, calls):
    """`calls(sdk)` with an AsyncOpenAI on an ingress over `replicas`; its result."""
    with ingress_client(model_dir, None, replicas):

        async def go():
            transport = httpx2.ASGITransport(app=served_app())
            async with httpx2.AsyncClient(transport=transport) as http:
                sdk = openai.AsyncOpenAI(
                    base_url="http://ingress/v1", api_key="x", http_client=http, max_retries=0
                )
                return await calls(sdk)

        return asyncio.run(go())


def test_text_in_text_out_with_instructions(hermes_dir, tok):
    replicas = FakeReplicas(answering(tok, "Sunny in Paris."))

    async def calls(sdk):
        return await sdk.responses.create(
            model=BASE, input="Weather?", instructions="Be brief.", max_output_tokens=9
        )

    r = sdk_run(hermes_dir, replicas, calls)
    assert r.output_text == "Sunny in Paris." and r.status == "completed"
    assert r.id.startswith("resp_") and r.store is False and r.instructions == "Be brief."
    assert r.usage.output_tokens == len(tok.encode("Sunny in Paris.", add_special_tokens=False))
    request = replicas.requests[0]
    assert request.sampling.max_tokens == 9
    prompt = tok.decode(request.prompt_ids)
    assert prompt.index("Be brief.") < prompt.index("Weather?")


def test_a_function_call_and_its_output_round_trip_streamed_or_not(hermes_dir, tok):
    replicas = FakeReplicas(answering(tok, "<think>Paris.</think>\n" + CALL_TEXT, per_token=True))

    async def calls(sdk):
        whole = await sdk.responses.create(model=BASE, input="Weather in Paris?", tools=[TOOL])
        events = [e async for e in await sdk.responses.create(
            model=BASE, input="Weather in Paris?", tools=[TOOL], stream=True
        )]  # fmt: skip
        call = whole.output[-1]
        follow = [
            {"role": "user", "content": "Weather in Paris?"},
            *[item.model_dump() for item in whole.output],  # the SDK's Nones included
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
        ]
        await sdk.responses.create(model=BASE, input=follow, tools=[TOOL])
        return whole, events

    whole, events = sdk_run(hermes_dir, replicas, calls)
    reasoning, call = whole.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "Paris."
    assert (call.type, call.name, json.loads(call.arguments)) == (
        "function_call", "get_weather", {"city": "Paris"},
    )  # fmt: skip
    assert call.call_id.startswith("call_") and whole.status == "completed"
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "response.reasoning_text.delta" in types
    arguments = "".join(
        e.delta for e in events if e.type == "response.function_call_arguments.delta"
    )
    assert json.loads(arguments) == {"city": "Paris"}
    done = events[-1].response
    assert [i.type for i in done.output] == ["reasoning", "function_call"]
    assert done.output[1].arguments == call.arguments
    # the third request: the call and its result rendered back through the template
    prompt = tok.decode(replicas.requests[2].prompt_ids)
    assert '"name": "get_weather", "arguments": {"city": "Paris"}' in prompt
    assert "<tool_response>sunny</tool_response>" in prompt


def test_a_named_function_and_text_format_reach_the_grammar(hermes_dir, tok):
    replicas = FakeReplicas(answering(tok, '{"city": "Rome"}'))
    with ingress_client(hermes_dir, None, replicas) as (client, _):
        named = {"type": "function", "name": "get_weather"}
        r = client.post(
            "/v1/responses",
            json={"model": BASE, "input": "hi", "tools": [TOOL], "tool_choice": named},
        )
        schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
        fmt = {"format": {"type": "json_schema", "name": "a", "schema": schema}}
        client.post("/v1/responses", json={"model": BASE, "input": "hi", "text": fmt})
    assert r.json()["output"][0]["arguments"] == '{"city": "Rome"}'
    first, second = (
        json.loads(q.sampling.structured_output.json_schema) for q in replicas.requests
    )
    assert first == WEATHER["function"]["parameters"] and second == schema


def test_a_length_cut_is_incomplete(hermes_dir):
    replicas = FakeReplicas(lambda r: [Reply((300, 301), "length", num_prompt_tokens=3)])
    with ingress_client(hermes_dir, None, replicas) as (client, _):
        body = client.post("/v1/responses", json={"model": BASE, "input": "hi"}).json()
    assert body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}


@pytest.mark.parametrize(
    "fields, param, needle",
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id", "not stored"),
        ({"store": True}, "store", "not stored"),
        ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice",
         "'nope' is not among tools"),
        ({"tools": [{"type": "web_search"}]}, "tools.0.type", "function"),
        ({"input": [{"type": "image_generation_call"}]}, "input.0", "image_generation_call"),
        ({"reasoning": {"effort": "high"}}, "reasoning_effort", "reads no reasoning_effort"),
        ({"reasoning": {"summary": "auto"}}, "reasoning.summary", "Input should be None"),
        ({"metadata": {"k": "v" * 513}}, "metadata.k", "at most 512 characters"),
        ({"input": []}, "input", "must not be empty"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}",
                     "namespace": "mcp"}]}, "input.0.namespace", "Input should be None"),
    ],
)  # fmt: skip
def test_what_is_not_served_is_a_400_naming_it(hermes_dir, fields, param, needle):
    replicas = FakeReplicas()
    with ingress_client(hermes_dir, None, replicas) as (client, _):
        r = client.post("/v1/responses", json={"model": BASE, "input": "hi", **fields})
    error = assert_openai_error(r, 400)
    assert error["param"] == param and needle in error["message"], error
    assert "input.str" not in error["message"] and "union" not in error["message"]
    assert not replicas.requests


def test_keys_and_models_apply_as_on_chat(hermes_dir):
    body = {"model": BASE, "input": "hi"}
    with ingress_client(hermes_dir, api_key=KEY, api_key_for_inference=True) as (client, _):
        assert_openai_error(client.post("/v1/responses", json=body), 401)
        ok = client.post("/v1/responses", json=body, headers={"Authorization": f"Bearer {KEY}"})
        assert ok.status_code == 200 and ok.json()["object"] == "response"
        ghost = {**body, "model": "ghost"}
        auth = {"Authorization": f"Bearer {KEY}"}
        assert_openai_error(client.post("/v1/responses", json=ghost, headers=auth), 404, "model")


def test_a_named_function_output_passes_its_name_to_the_template():
    """A tool message's name reaches the chat template, as on chat (not dropped)."""
    output = {"type": "function_call_output", "call_id": "c1", "output": "21 C", "name": "temp"}
    messages = ResponsesRequest(model=BASE, input=[output]).chat_request().chat_messages()
    assert messages == [{"role": "tool", "content": "21 C", "name": "temp", "tool_call_id": "c1"}]
