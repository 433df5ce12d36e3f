"""The showcase's tool round trip (cluster/demo/showcase.py) against a fake server: the
call it prints, the function run on the call's arguments, its result sent back as a tool
message, the answer; a model that does not call is an error, not a silent line."""

from __future__ import annotations

import json

import pytest
from fastapi import FastAPI, Request

from cluster.demo import letters, showcase
from tests.net import serving

CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": letters.TOOL, "arguments": '{"word": "apple"}'},
}


def _app(first: dict, bodies: list[dict]) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> dict:
        body = await request.json()
        bodies.append(body)
        if body["messages"][-1]["role"] == "user":
            message = first
        else:
            message = {"role": "assistant", "content": f"got {body['messages'][-1]['content']}"}
        return {"choices": [{"index": 0, "message": message, "finish_reason": "stop"}]}

    return app


def test_tool_round_trip_runs_the_function_and_sends_its_result(capsys):
    bodies: list[dict] = []
    first = {"role": "assistant", "content": None, "tool_calls": [CALL]}
    with serving(_app(first, bodies)) as url:
        answer = showcase.tool_round_trip(
            url,
            "letters",
            "how many letters has apple",
            letters.COUNT_LETTERS_TOOL,
            lambda word: 42,
        )
    assert answer == "got 42"
    assert [b["tools"] for b in bodies] == [[letters.COUNT_LETTERS_TOOL]] * 2
    assert bodies[1]["messages"][1:] == [
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": json.dumps(42)},
    ]
    out = capsys.readouterr().out
    assert f'  letters | calls {letters.TOOL} {{"word": "apple"}}' in out
    assert f"     here | {letters.TOOL}(word='apple') = 42" in out
    assert "  letters | 'got 42'" in out


def test_a_model_that_does_not_call_is_a_showcase_error():
    first = {"role": "assistant", "content": "five"}
    with serving(_app(first, [])) as url:
        with pytest.raises(showcase.ShowcaseError, match="was to call count_letters"):
            showcase.tool_round_trip(url, "letters", "?", letters.COUNT_LETTERS_TOOL, len)
