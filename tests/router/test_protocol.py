"""The OpenAI protocol models: what we refuse, what we default, what the openai SDK parses."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import typing
from types import NoneType

import openai
import pytest
from openai.types import Completion, Model
from openai.types import completion_create_params as openai_completion_params
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.chat import completion_create_params as openai_chat_params
from openai.types.responses import response_create_params as openai_response_params
from pydantic import ValidationError

from replica.wire import SamplingParams, StructuredOutput
from router.protocol import (
    SSE_DONE,
    AssistantMessage,
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamChoice,
    CompletionStreamResponse,
    DeltaMessage,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    UnloadLoRAAdapterRequest,
    UsageInfo,
    error_body,
    format_validation_errors,
    sse_event,
)
from router.responses_api.request import ResponsesRequest

CHAT = [{"role": "user", "content": "hi"}]


def completion(**fields) -> CompletionRequest:
    return CompletionRequest(**{"model": "base", "prompt": "hi", **fields})


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(**{"model": "base", "messages": CHAT, **fields})


def refusal(make, **fields) -> str:
    with pytest.raises(ValidationError) as info:
        make(**fields)
    return format_validation_errors(info.value.errors())


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"best_of": 2}, "best_of: only best_of equal to n is supported"),
        ({"suffix": "tail"}, "suffix: suffix is not supported"),
        ({"n": 17}, "n"),
        ({"n": 0}, "n"),
        ({"logprobs": 21}, "logprobs"),
        ({"prompt": ""}, "prompt must not be empty"),
        ({"prompt": []}, "prompt must not be empty"),
        ({"prompt": ["a", ""]}, "prompt must not be empty"),
        ({"prompt": [1, -2]}, "greater than or equal to 0"),
        ({"max_tokens": 0}, "max_tokens: 0 is only allowed with echo"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"presence_penalty": -2.5}, "presence_penalty"),
        ({"frequency_penalty": 3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"cat": 1}}, "logit_bias keys must be token ids"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "at most 4 stop strings"),
        ({"stop": ["a", ""]}, "stop strings must not be empty"),
        ({"stop": ""}, "stop strings must not be empty"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stream_options": {"include_usage": True}}, "only allowed with stream=true"),
        ({"frobnicate": 1}, "frobnicate: Extra inputs are not permitted"),
        ({"guided_json": {}}, "guided_json: Extra inputs are not permitted"),
    ],
)
def test_completion_refuses(fields, message):
    assert message in refusal(completion, **fields)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "role"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "content"),
        ({"messages": [{"role": "user", "content": "x", "refusal": "no"}]}, "refusal"),
        ({"top_logprobs": 3}, "top_logprobs: needs logprobs=true"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"n": 17}, "n"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"stop": ["1", "2", "3", "4", "5"]}, "at most 4 stop strings"),
        ({"tools": [{"type": "function", "function": {"name": "f g"}}]}, "tools.0.function.name"),
        ({"tool_choice": "required"}, "tool_choice: needs tools"),
        ({"functions": [{"name": "f"}]}, "functions: functions is not supported"),
        ({"response_format": {"type": "json_schema"}}, "json_schema is required"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"echo": True}, "echo: Extra inputs are not permitted"),
        ({"best_of": 2}, "best_of: Extra inputs are not permitted"),
        ({"store": True}, "store: store is not supported"),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {
                                "id": "c",
                                "function": {"name": "f", "arguments": "{}", "strict": True},
                            }
                        ],
                    }
                ]
            },
            "messages.0.tool_calls.0.function.strict: Extra inputs are not permitted",
        ),
    ],
)
def test_chat_refuses(fields, message):
    assert message in refusal(chat, **fields)


def test_accepted_spellings_of_defaults():
    req = completion(
        echo=False, logprobs=None, best_of=1, suffix=None, n=1, top_k=-1, prompt=["one"]
    )
    assert (req.top_k, req.prompts()) == (0, ["one"])
    assert completion(prompt=[[5, 6]]).prompts() == [[5, 6]]
    assert completion(prompt=[5, 6]).prompts() == [[5, 6]]
    assert chat(logprobs=False, top_logprobs=0, tools=[], tool_choice="none").n is None
    assert chat(store=False, service_tier="auto", modalities=["text"]).model == "base"


def test_explicit_null_means_the_default():
    """OpenAI and vLLM read null as "unset"; clients and proxies send it."""
    nulls = dict.fromkeys(
        ["temperature", "top_p", "n", "stream", "logprobs", "stop", "seed", "max_tokens",
         "presence_penalty", "frequency_penalty", "logit_bias", "user", "echo", "best_of"]
    )  # fmt: skip
    params = completion(**nulls).sampling_params(default_max_tokens=100)
    assert params == SamplingParams(max_tokens=100)
    chat_nulls = dict.fromkeys(["temperature", "top_p", "n", "stream", "logprobs", "stop",
                                "seed", "max_tokens", "response_format", "tools"])  # fmt: skip
    assert chat(**chat_nulls).sampling_params(50) == SamplingParams(max_tokens=50)


def test_batched_prompts():
    assert completion(prompt=["a", "b"]).prompts() == ["a", "b"]
    assert completion(prompt=[[1, 2], [3]]).prompts() == [[1, 2], [3]]


def test_sampling_params_defaults():
    """Omitted fields take the model's defaults (generation_config.json), else the API's
    (SamplingParams's own: temperature 1); max_tokens the caller's default (None for chat:
    the rest of the context)."""
    assert completion().sampling_params(default_max_tokens=16) == SamplingParams()
    assert completion(max_tokens=None).sampling_params(100).max_tokens == 100
    assert chat().sampling_params(100).max_tokens == 100
    assert chat().sampling_params(None).max_tokens is None
    assert chat(max_tokens=7).sampling_params(100).max_tokens == 7
    assert chat(max_tokens=7, max_completion_tokens=9).sampling_params(100).max_tokens == 9
    model = {"temperature": 0.6, "top_p": 0.9, "top_k": 50, "repetition_penalty": 1.1}
    got = completion(top_p=0.5).sampling_params(8, model)
    assert (got.temperature, got.top_p, got.top_k, got.repetition_penalty) == (0.6, 0.5, 50, 1.1)


def test_sampling_params_carry_every_field():
    req = chat(
        temperature=0, top_p=0.5, top_k=40, min_p=0.1, seed=3, stop_token_ids=[7, 9],
        ignore_eos=True, min_tokens=2, presence_penalty=0.5, frequency_penalty=-0.5,
        repetition_penalty=1.2, logit_bias={"11": -100, "5": 3.5}, n=2, logprobs=True,
        top_logprobs=4, response_format={"type": "json_object"},
    )  # fmt: skip
    assert req.sampling_params(10) == SamplingParams(
        max_tokens=10,
        temperature=0.0,
        top_p=0.5,
        top_k=40,
        min_p=0.1,
        seed=3,
        stop_token_ids=(7, 9),
        ignore_eos=True,
        min_tokens=2,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.2,
        logit_bias=((5, 3.5), (11, -100.0)),
        n=2,
        logprobs=4,
        structured_output=StructuredOutput(kind="json_object"),
    )
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    got = chat(response_format=fmt).sampling_params(5).structured_output
    assert got.kind == "json_schema" and json.loads(got.json_schema) == schema
    assert completion(echo=True, max_tokens=0, logprobs=2).sampling_params(8, None, 2) == (
        SamplingParams(max_tokens=0, logprobs=2, prompt_logprobs=2)
    )


def test_sampling_params_are_the_engine_params():
    params = completion(stop_token_ids=[2], seed=1).sampling_params(8)
    assert isinstance(params, SamplingParams)
    assert (params.max_tokens, params.stop_token_ids, params.seed) == (8, (2,), 1)


def test_the_http_models_and_sampling_params_share_bounds():
    """One definition: a value the HTTP model refuses, SamplingParams refuses too."""
    for bad in (
        {"temperature": 2.5}, {"temperature": float("nan")}, {"top_p": 0.0}, {"seed": 2**63},
        {"min_p": 2.0}, {"n": 17}, {"presence_penalty": 2.1}, {"repetition_penalty": 0.0},
    ):  # fmt: skip
        with pytest.raises(ValidationError):
            SamplingParams(**bad)
        assert refusal(completion, **bad)


# a value that turns each refused field on (the others take any JSON)
REFUSED_VALUES = {"suffix": "tail"}


def _openai_fields(params_type) -> set[str]:
    return set(typing.get_type_hints(params_type)) | {"stream"}


@pytest.mark.parametrize(
    "model, params_type",
    [
        (CompletionRequest, openai_completion_params.CompletionCreateParamsBase),
        (ChatCompletionRequest, openai_chat_params.CompletionCreateParamsBase),
    ],
)
def test_every_openai_field_is_honoured_or_refused(model, params_type):
    """No silent acceptance. Each field of the openai SDK's request schema is one of ours:
    either honoured (a field with its own meaning here) or accepted only with its "off"
    values (a non-default value is a 400 naming it). Anything else is a 400 too."""
    fields = _openai_fields(params_type)
    ours = set(model.model_fields)
    assert fields <= ours, f"fields of the OpenAI schema not declared: {fields - ours}"
    make = completion if model is CompletionRequest else chat
    refused = set(model._ACCEPTED)
    for name in refused & fields:
        on = REFUSED_VALUES.get(name, {"on": True})
        assert f"{name}: {name} is not supported" in refusal(make, **{name: on}), name
    honoured = (fields - refused) - {"model", "prompt", "messages"}
    assert honoured, "nothing honoured?"
    for name in honoured:  # documented: every honoured field says what it does
        assert model.model_fields[name].description, name


def test_every_responses_field_is_honoured_or_refused():
    """As above, for /v1/responses: each field of the openai SDK's schema is declared;
    those not served refuse any value but their off ones, the rest say what they do."""
    fields = _openai_fields(openai_response_params.ResponseCreateParamsBase)
    ours = set(ResponsesRequest.model_fields)
    assert fields <= ours, f"fields of the OpenAI schema not declared: {fields - ours}"
    make = functools.partial(ResponsesRequest, model="base", input="hi")
    refused = {n for n in fields if n in ResponsesRequest._ACCEPTED}
    refused |= {n for n in fields if ResponsesRequest.model_fields[n].annotation is NoneType}
    for name in refused:
        assert refusal(make, **{name: {"on": True}}).startswith(f"{name}: "), name
    for name in fields - refused - {"model", "input"}:
        assert ResponsesRequest.model_fields[name].description, name


def test_stop_strings_and_stream_options():
    assert completion().stop_strings() == []
    assert completion(stop="\n").stop_strings() == ["\n"]
    assert chat(stop=["a", "b"]).stop_strings() == ["a", "b"]
    assert not completion(stream=True).include_usage()
    assert chat(stream=True, stream_options={"include_usage": True}).include_usage()


def test_chat_message_text():
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert ChatMessage(role="user", content=parts).text() == "a\nb"
    assert ChatMessage(role="assistant", content=None).text() == ""
    req = chat(messages=[{"role": "system", "content": "s"}, {"role": "user", "content": parts}])
    assert req.chat_messages() == [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "a\nb"},
    ]


@pytest.mark.parametrize("name", ["", "a/b", "../x", "has space", "x" * 129, "ünï"])
def test_lora_name_rule(name):
    message = refusal(LoadLoRAAdapterRequest, lora_name=name, lora_path="/p")
    assert "letter, digit, '.', '_' or '-'" in message
    assert "lora_name" in refusal(UnloadLoRAAdapterRequest, lora_name=name)


def test_load_adapter_request():
    req = LoadLoRAAdapterRequest(lora_name="sql-v1.2_x", lora_path="/a/b")
    assert (req.lora_name, req.lora_path) == ("sql-v1.2_x", "/a/b")
    assert "lora_path" in refusal(LoadLoRAAdapterRequest, lora_name="ok", lora_path="")
    assert UnloadLoRAAdapterRequest(lora_name="x" * 128).lora_name == "x" * 128


@pytest.mark.parametrize(
    "make, fields",
    [
        (LoadLoRAAdapterRequest, {"lora_name": "a", "lora_path": "/p", "load_in_place": True}),
        (LoadLoRAAdapterRequest, {"lora_name": "a", "lora_path": "/p", "lora_int_id": 3}),
        (UnloadLoRAAdapterRequest, {"lora_name": "a", "lora_int_id": 3}),
    ],
)
def test_adapter_requests_refuse_unknown_fields(make, fields):
    """A misspelt load_inplace is a 400, not a load that silently does something else."""
    extra = (set(fields) - {"lora_name", "lora_path"}).pop()
    assert f"{extra}: Extra inputs are not permitted" in refusal(make, **fields)


def test_completion_response_parses_in_openai_sdk():
    resp = CompletionResponse(
        model="sql",
        choices=[CompletionChoice(text="SELECT 1", finish_reason="stop", stop_reason=";")],
        usage=UsageInfo.of(5, 3),
    )
    parsed = Completion.model_validate(json.loads(resp.model_dump_json()))
    assert parsed.id.startswith("cmpl-") and parsed.object == "text_completion"
    assert parsed.choices[0].text == "SELECT 1" and parsed.choices[0].finish_reason == "stop"
    assert parsed.usage.total_tokens == 8


def test_chat_response_parses_in_openai_sdk():
    resp = ChatCompletionResponse(
        model="base",
        choices=[
            ChatCompletionChoice(message=AssistantMessage(content="hi"), finish_reason="length")
        ],
        usage=UsageInfo.of(4, 1),
    )
    parsed = ChatCompletion.model_validate(json.loads(resp.model_dump_json()))
    assert parsed.id.startswith("chatcmpl-") and parsed.object == "chat.completion"
    assert parsed.choices[0].message.role == "assistant"
    assert parsed.choices[0].message.content == "hi"
    assert parsed.usage.prompt_tokens == 4


def chat_stream() -> list[ChatCompletionStreamResponse]:
    first = ChatCompletionStreamResponse(
        model="base", choices=[ChatCompletionStreamChoice(delta=DeltaMessage(role="assistant"))]
    )

    def chunk(**fields) -> ChatCompletionStreamResponse:
        return ChatCompletionStreamResponse(id=first.id, created=first.created, **fields)

    return [
        first,
        chunk(model="base", choices=[ChatCompletionStreamChoice(delta=DeltaMessage(content="h"))]),
        chunk(
            model="base",
            choices=[ChatCompletionStreamChoice(delta=DeltaMessage(), finish_reason="stop")],
        ),
        chunk(model="base", choices=[], usage=UsageInfo.of(3, 2)),
    ]


def test_chat_stream_chunks_parse_in_openai_sdk():
    chunks = chat_stream()
    parsed = [ChatCompletionChunk.model_validate(json.loads(c.model_dump_json())) for c in chunks]
    assert {p.id for p in parsed} == {chunks[0].id}
    assert all(p.object == "chat.completion.chunk" for p in parsed)
    assert parsed[0].choices[0].delta.role == "assistant"
    assert parsed[1].choices[0].delta.content == "h"
    assert parsed[2].choices[0].finish_reason == "stop"
    assert parsed[3].choices == [] and parsed[3].usage.completion_tokens == 2


def test_completion_stream_last_chunk_parses_in_openai_sdk():
    chunk = CompletionStreamResponse(
        model="base", choices=[CompletionStreamChoice(text="x", finish_reason="length")]
    )
    parsed = Completion.model_validate(json.loads(chunk.model_dump_json()))
    assert parsed.choices[0].text == "x" and parsed.usage is None


def sdk_client(routes: dict[str, tuple[int, str, str]]) -> openai.OpenAI:
    """An openai client whose HTTP requests are answered from `routes`, without a server."""
    httpx2 = pytest.importorskip("httpx2")  # the HTTP library of openai 3.x

    def answer(request):
        status, content_type, body = routes[request.url.path]
        return httpx2.Response(status, headers={"content-type": content_type}, text=body)

    return openai.OpenAI(
        base_url="http://lorafleet.test/v1",
        api_key="unused",
        max_retries=0,
        http_client=openai.DefaultHttpxClient(transport=httpx2.MockTransport(answer)),
    )


def test_openai_sdk_reads_our_sse_streams_and_errors():
    texts = ["he", "llo", ""]
    completion_chunks = [
        CompletionStreamResponse(
            id="cmpl-1",
            created=1,
            model="base",
            choices=[CompletionStreamChoice(text=t, finish_reason="stop" if not t else None)],
        )
        for t in texts
    ]
    sse = "text/event-stream"
    client = sdk_client(
        {
            "/v1/completions": (200, sse, "".join(map(sse_event, completion_chunks)) + SSE_DONE),
            "/v1/chat/completions": (200, sse, "".join(map(sse_event, chat_stream())) + SSE_DONE),
            "/v1/models": (
                200,
                "application/json",
                ModelList(
                    data=[ModelCard(id="base", root="/m"), ModelCard(id="a", parent="base")]
                ).model_dump_json(),
            ),
            "/v1/load_lora_adapter": (
                400,
                "application/json",
                json.dumps(error_body(400, "rank 128 > max_lora_rank 64", param="lora_path")),
            ),
        }
    )
    stream = client.completions.create(model="base", prompt="hi", stream=True)
    assert "".join(c.choices[0].text for c in stream) == "hello"
    chunks = list(client.chat.completions.create(model="base", messages=CHAT, stream=True))
    assert [c.choices[0].delta.content for c in chunks[:2]] == [None, "h"]
    assert chunks[-1].usage.total_tokens == 5
    models = client.models.list().data
    assert [(m.id, m.owned_by) for m in models] == [("base", "lorafleet"), ("a", "lorafleet")]
    assert all(isinstance(m, Model) for m in models)
    with pytest.raises(openai.BadRequestError) as info:
        client.post("/load_lora_adapter", body={"lora_name": "a"}, cast_to=object)
    err = info.value
    assert err.message.endswith("rank 128 > max_lora_rank 64")
    assert (err.type, err.param, err.body["code"]) == ("invalid_request_error", "lora_path", 400)


@pytest.mark.parametrize(
    "status, type_",
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (404, "not_found_error"),
        (429, "rate_limit_error"),
        (500, "internal_error"),
        (503, "service_unavailable_error"),
        (418, "invalid_request_error"),
        (502, "internal_error"),
    ],
)
def test_error_body_types(status, type_):
    assert error_body(status, "boom") == {
        "error": {"message": "boom", "type": type_, "param": None, "code": status}
    }


def test_error_body_explicit_type():
    assert error_body(400, "x", type_="BadRequestError")["error"]["type"] == "BadRequestError"


def test_model_card_fields():
    card = ModelCard(id="sql", root="/adapters/sql", parent="base").model_dump()
    assert card["object"] == "model" and card["owned_by"] == "lorafleet"
    assert isinstance(card["created"], int)
    assert ModelList().model_dump() == {"object": "list", "data": []}


def test_ids_are_unique():
    assert CompletionResponse(model="m", choices=[], usage=UsageInfo.of(0, 0)).id != (
        CompletionResponse(model="m", choices=[], usage=UsageInfo.of(0, 0)).id
    )


def test_router_modules_import_neither_torch_nor_ray():
    code = (
        "import sys, router.protocol, router.choices; "
        "print(sorted(m for m in ('torch', 'ray') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_validation_error_names_the_field_as_written_and_only_the_branch_meant():
    """pydantic reports each failed branch of a union under its label: the message keeps
    the branch the input got deepest into, its field without labels or tags."""
    from typing import Annotated, Literal

    from pydantic import BaseModel, Field

    from router.protocol import validation_error

    class Call(BaseModel):
        type: Literal["call"]
        namespace: None = None

    class Text(BaseModel):
        type: Literal["text"]
        text: str | list[int]

    item = Annotated[Call | Text, Field(discriminator="type")]

    class Body(BaseModel):
        input: str | list[item]

    def error(value):
        with pytest.raises(ValidationError) as e:
            Body.model_validate({"input": value})
        raw = [{**err, "loc": ("body", *err["loc"])} for err in e.value.errors()]
        return validation_error(raw)

    assert error([{"type": "call", "namespace": "x"}]) == (
        "input.0.namespace: Input should be None",
        "input.0.namespace",
    )
    message, param = error([{"type": "text", "text": 5}])
    assert param == "input.0.text" and "input.str" not in message and "[" not in message
    assert message.count("input.0.text:") == 2  # the nested union's two branches, equal depth
    message, param = error(5)  # no branch got deeper than another: all are told
    assert param == "input" and "valid string" in message and "valid list" in message
    assert validation_error([]) == ("", None)
