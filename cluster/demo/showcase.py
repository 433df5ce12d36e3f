"""What `lorafleet up` shows once the server runs: one request per adapter and one to the
base model, sent together so they share batches, answers side by side; then how to try more."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import shlex
import sys
from collections.abc import Callable, Collection
from typing import Any

import httpx

PROMPT = "The quick brown fox"  # for a model of the user's; the trained demo has its own


def _headers(api_key: str | None) -> dict[str, str]:
    return {} if api_key is None else {"Authorization": f"Bearer {api_key}"}


def model_names(url: str, api_key: str | None = None) -> list[str]:
    """The served models, the base first (GET /v1/models, with the key when one is set)."""
    r = httpx.get(f"{url}/v1/models", headers=_headers(api_key), timeout=60)
    return _names(r)


def _names(r: httpx.Response) -> list[str]:
    if r.status_code != 200:
        message = r.json().get("error", {}).get("message", r.text) if r.content else r.text
        raise ShowcaseError(f"GET /v1/models: HTTP {r.status_code}: {message}")
    return [m["id"] for m in r.json()["data"]]


class ShowcaseError(RuntimeError):
    """The server answered the showcase with an error."""


async def _ask(client: httpx.AsyncClient, url: str, model: str, prompt: str, n: int) -> str:
    body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0}
    r = await client.post(f"{url}/v1/completions", json=body)
    if r.status_code != 200:
        return f"<HTTP {r.status_code}: {r.json().get('error', {}).get('message', r.text)}>"
    return r.json()["choices"][0]["text"]


async def _all(
    url: str, prompt: str, max_tokens: int, api_key: str | None, leave_out: Collection[str]
) -> list[tuple[str, str]]:
    async with httpx.AsyncClient(timeout=120, headers=_headers(api_key)) as client:
        models = [m for m in _names(await client.get(f"{url}/v1/models")) if m not in leave_out]
        asks = (_ask(client, url, m, prompt, max_tokens) for m in models)
        texts = await asyncio.gather(*asks)
    return list(zip(models, texts))


def show(
    url: str,
    prompt: str = PROMPT,
    max_tokens: int = 16,
    notes: dict[str, str] | None = None,
    api_key: str | None = None,
    leave_out: Collection[str] = (),
) -> list[str]:
    """Print the side-by-side answers, each with its model's note (what it was trained to
    do) if given; returns the model names (the base model first). `api_key`: sent as a
    bearer token (a server started with api_key_for_inference needs it). Models in
    `leave_out` get no request (the tool-calling adapter: its round trip is its own)."""
    results = asyncio.run(_all(url, prompt, max_tokens, api_key, leave_out))
    notes = notes or {}
    width = max(len(m) for m, _ in results)
    answers = [repr(text.strip()) for _, text in results]
    answer_width = max(len(a) for a in answers)
    print(f"{len(results)} requests sent together, prompt {prompt!r}:")
    for (model, _), answer in zip(results, answers):
        note = f"  ({notes[model]})" if model in notes else ""
        print(f"  {model:>{width}} | {answer:<{answer_width}}{note}".rstrip())
    return [m for m, _ in results]


def tool_round_trip(
    url: str,
    model: str,
    question: str,
    tool: dict[str, Any],
    function: Callable[..., Any],
    api_key: str | None = None,
) -> str:
    """Print a chat with `model` that calls `tool` (an OpenAI function tool), `function`
    run here on the call's arguments, and the model's answer given its result; returns
    the answer. ShowcaseError if the model answers without calling the tool."""
    name = tool["function"]["name"]
    messages: list[dict[str, Any]] = [{"role": "user", "content": question}]
    with httpx.Client(base_url=f"{url}/v1", timeout=120, headers=_headers(api_key)) as client:
        called = _chat(client, model, messages, tool)
        calls = called.get("tool_calls") or []
        if len(calls) != 1 or calls[0]["function"]["name"] != name:
            raise ShowcaseError(f"{model} was to call {name}; it answered {called!r}")
        arguments = json.loads(calls[0]["function"]["arguments"])
        result = function(**arguments)
        messages += [
            {"role": "assistant", "content": None, "tool_calls": calls},
            {"role": "tool", "tool_call_id": calls[0]["id"], "content": json.dumps(result)},
        ]
        answer = _chat(client, model, messages, tool).get("content") or ""
    shown = ", ".join(f"{k}={v!r}" for k, v in arguments.items())
    print(f"a tool call, {model} offered {name}:")
    print(f"  {'user':>9} | {question!r}")
    print(f"  {model:>9} | calls {name} {calls[0]['function']['arguments']}")
    print(f"  {'here':>9} | {name}({shown}) = {result!r}")
    print(f"  {model:>9} | {answer.strip()!r}")
    return answer


def _chat(
    client: httpx.Client, model: str, messages: list[dict[str, Any]], tool: dict[str, Any]
) -> dict[str, Any]:
    body = {"model": model, "messages": messages, "tools": [tool], "temperature": 0}
    r = client.post("/chat/completions", json=body)
    if r.status_code != 200:
        message = r.json().get("error", {}).get("message", r.text) if r.content else r.text
        raise ShowcaseError(f"POST /v1/chat/completions: HTTP {r.status_code}: {message}")
    return r.json()["choices"][0]["message"]


def try_it(
    url: str,
    model: str,
    prompt: str = PROMPT,
    key_env: str | None = None,
    key_exported: bool = True,
) -> str:
    """How to send requests yourself; on a secured server the commands read the key from
    the environment variable `key_env` (the key itself is never printed), and say to set
    it first when the shell does not hold it (`key_exported` False: the key is the
    config's api_key or its runtime_env's)."""
    auth = f' -H "Authorization: Bearer ${key_env}"' if key_env else ""
    first = ""
    if key_env and not key_exported:
        first = f"\n  (the key is set in the Serve config, not here: export {key_env}=<key> first)"
    key = f"os.environ['{key_env}']" if key_env else "'none'"
    imports = "import openai, os" if key_env else "import openai"
    # this interpreter by its path (a fresh shell's `python` may be another, without openai)
    python = shlex.quote(sys.executable)
    if importlib.util.find_spec("openai") is None:
        first += f"\n  ({python} -m pip install openai first, for the last one)"
    return f"""
try it:{first}
  curl {url}/v1/models{auth}
  curl {url}/v1/completions -H 'Content-Type: application/json'{auth} \\
       -d '{{"model": "{model}", "prompt": "{prompt}", "max_tokens": 16, "temperature": 0}}'
  {python} -c "{imports}; c = openai.OpenAI(base_url='{url}/v1', api_key={key}); \\
print(c.completions.create(model='{model}', prompt='{prompt}', max_tokens=16).choices[0].text)"
"""
