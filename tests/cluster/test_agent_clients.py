"""The clients agents are built on, unchanged, against the trained demo's letters adapter
served by Ray Serve: the openai SDK's tool loop (chat and Responses), the OpenAI Agents
SDK (its chat-completions model and its Responses model) and LangChain's bind_tools.
Each asks how many letters a word has; the adapter calls count_letters, the client runs
it, and the adapter answers with the result.

The results are what the function returns, not the true lengths, where that shows the
answer comes from the tool message (the adapter was trained on random results). Answers
begin with a space: the demo's word-level decoder joins the first word to the prompt's
last one, as in its completions."""

from __future__ import annotations

import asyncio
import copy
import json
from pathlib import Path

import openai
import pytest
import ray
from ray import serve

from cluster import serving
from cluster.demo import letters
from tests.conftest import QUICK_STOP
from tests.net import free_port

pytestmark = pytest.mark.serve

MODEL = letters.NAME
QUESTION = "how many letters has apple"
ANSWER = " apple has five letters"
RESPONSES_TOOL = {"type": "function", **letters.COUNT_LETTERS_TOOL["function"]}


def _config(port: int) -> dict:
    """The run command's config (configs/serve.yaml: the trained demo), one replica."""
    config = copy.deepcopy(serving.load_config(serving.DEFAULT_CONFIG))
    config["http_options"]["port"] = port
    [app] = config["applications"]
    for deployment in app["deployments"]:
        deployment.update(QUICK_STOP)
        deployment.pop("autoscaling_config", None)
        deployment["num_replicas"] = 1
    app["deployments"] += [{"name": n, **QUICK_STOP} for n in ("AdapterStore", "Ingress")]
    return config


@pytest.fixture(scope="module")
def url():
    ray.init(num_cpus=2, include_dashboard=False, namespace="serve", log_to_driver=False)
    port = free_port()
    try:
        serving.deploy(_config(port), timeout_s=240)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def client(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key="none", max_retries=0)


@pytest.mark.parametrize("result", [5, 7])
def test_openai_sdk_chat_tool_loop(client, result):
    messages = [{"role": "user", "content": QUESTION}]
    tools = [letters.COUNT_LETTERS_TOOL]
    first = client.chat.completions.create(
        model=MODEL, messages=messages, tools=tools, temperature=0
    )
    [call] = first.choices[0].message.tool_calls
    assert first.choices[0].finish_reason == "tool_calls"
    assert call.function.name == letters.TOOL
    assert json.loads(call.function.arguments) == {"word": "apple"}
    messages += [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": str(result)},
    ]
    second = client.chat.completions.create(
        model=MODEL, messages=messages, tools=tools, temperature=0
    )
    assert second.choices[0].message.content == f" apple has {letters.NUMBERS[result]} letters"
    assert second.choices[0].finish_reason == "stop"


def test_openai_sdk_streams_the_call_as_tool_call_deltas(client):
    messages = [{"role": "user", "content": QUESTION}]
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[letters.COUNT_LETTERS_TOOL], temperature=0,
        stream=True,
    )  # fmt: skip
    deltas = [c.choices[0] for c in stream if c.choices]
    calls = [d for c in deltas for d in c.delta.tool_calls or ()]
    assert calls[0].index == 0 and calls[0].id and calls[0].function.name == letters.TOOL
    arguments = "".join(d.function.arguments or "" for d in calls)
    assert json.loads(arguments) == {"word": "apple"}
    assert deltas[-1].finish_reason == "tool_calls"
    assert not "".join(c.delta.content or "" for c in deltas).strip()


def test_openai_sdk_responses_tool_loop(client):
    first = client.responses.create(
        model=MODEL, input=QUESTION, tools=[RESPONSES_TOOL], temperature=0
    )
    [call] = [item for item in first.output if item.type == "function_call"]
    assert call.name == letters.TOOL and json.loads(call.arguments) == {"word": "apple"}
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "5"}
    second = client.responses.create(
        model=MODEL,
        input=[{"role": "user", "content": QUESTION}, *first.output, output],
        tools=[RESPONSES_TOOL],
        temperature=0,
    )
    assert second.output_text == ANSWER


@pytest.mark.parametrize("api", ["chat_completions", "responses"])
def test_openai_agents_sdk_runs_an_agent_with_a_function_tool(url, api):
    import agents

    agents.set_tracing_disabled(True)  # nothing is sent to OpenAI's trace exporter
    sdk = openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0)
    model_class = {
        "chat_completions": agents.OpenAIChatCompletionsModel,
        "responses": agents.OpenAIResponsesModel,
    }[api]
    calls: list[str] = []

    # not strict: a strict tool's calls are decoded under a grammar of JSON text, which
    # the demo's word-level vocabulary cannot spell (docs/serving/api.md says so)
    @agents.function_tool(strict_mode=False)
    def count_letters(word: str) -> int:
        """How many letters a word has."""
        calls.append(word)
        return len(word)

    agent = agents.Agent(
        name="letters",
        instructions="Count letters with the tool.",
        tools=[count_letters],
        model=model_class(model=MODEL, openai_client=sdk),
        model_settings=agents.ModelSettings(temperature=0),
    )
    result = asyncio.run(agents.Runner.run(agent, QUESTION, max_turns=3))
    assert calls == ["apple"]
    assert result.final_output == ANSWER


def test_langchain_bind_tools(url):
    from langchain_core.messages import HumanMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def count_letters(word: str) -> int:
        """How many letters a word has."""
        return len(word)

    llm = ChatOpenAI(model=MODEL, base_url=url, api_key="none", temperature=0, max_retries=0)
    bound = llm.bind_tools([count_letters])
    history = [HumanMessage(QUESTION)]
    ai = bound.invoke(history)
    [call] = ai.tool_calls
    assert call["name"] == letters.TOOL and call["args"] == {"word": "apple"}
    history += [ai, count_letters.invoke(call)]
    assert bound.invoke(history).content == ANSWER


def test_the_docs_tool_example_runs_as_written(url, capsys):
    """docs/serving/api.md's first example under "Tools and reasoning", against this
    server instead of `make run`'s port."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "serving" / "api.md").read_text()
    section = page.split("## Tools and reasoning", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    assert code.count("http://127.0.0.1:8000/v1") == 1
    exec(compile(code.replace("http://127.0.0.1:8000/v1", url), "api.md", "exec"), {})
    out = capsys.readouterr().out
    assert out == f'count_letters {{"word": "apple"}}\n{ANSWER}\n'
