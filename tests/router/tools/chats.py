"""Chat requests with tools the tool tests send through the in-process ingress, and what
they read back."""

from __future__ import annotations

from tests.fakes import FakeReplicas
from tests.router.client import BASE, ingress_client

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
            "required": ["city"],
        },
    },
}
PING = {"type": "function", "function": {"name": "ping"}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
CHAT = {"model": BASE, "messages": ASK, "tools": [WEATHER, PING], "max_tokens": 50}
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
PING_TEXT = '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'


def chat(hermes_dir, body, script=None, stream=False, store=None):
    """Return (the response, the fake replicas) of POST /v1/chat/completions with `body`
    on an ingress serving the model at `hermes_dir`, its replicas answering `script`."""
    replicas = FakeReplicas(script) if script else FakeReplicas()
    with ingress_client(hermes_dir, store, replicas) as (client, _):
        r = client.post("/v1/chat/completions", json={**body, "stream": stream})
    return r, replicas


def summary(answer: dict) -> dict:
    """Return the first choice of a chat answer as the tests compare it: content,
    reasoning, the calls' functions and the finish reason."""
    choice = answer["choices"][0]
    message = choice["message"]
    return {
        "content": message["content"],
        "reasoning_content": message["reasoning_content"],
        "tool_calls": [c["function"] for c in message["tool_calls"]],
        "finish_reason": choice["finish_reason"],
    }
