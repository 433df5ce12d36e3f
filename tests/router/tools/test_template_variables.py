"""Template variables a request sets (chat_template_kwargs, reasoning_effort, the
Responses API's reasoning.effort) reach a template that reads them, and are a 400 naming
them where the template reads none: passed, they would change nothing. Informational
fields (metadata, safety_identifier) are accepted, logged or repeated in a Response
object, within OpenAI's bounds."""

from __future__ import annotations

import logging

import pytest
from transformers import AutoTokenizer

from tests.fakes import FakeReplicas
from tests.net import assert_openai_error
from tests.router.client import BASE, ingress_client
from tests.router.tools.models import HERMES_TEMPLATE, model_with_template

ASK = [{"role": "user", "content": "hi"}]
CHAT = {"model": BASE, "messages": ASK, "max_tokens": 4}
# gpt-oss's template writes the effort into its system message
EFFORT_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}\n{% endfor %}"
    "{% if reasoning_effort is defined %}Reasoning: {{ reasoning_effort }}\n{% endif %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@pytest.fixture(scope="module")
def effort_dir(tmp_path_factory) -> str:
    return model_with_template(tmp_path_factory.mktemp("effort") / "model", EFFORT_TEMPLATE)


@pytest.fixture(scope="module")
def hermes_dir(tmp_path_factory) -> str:
    return model_with_template(tmp_path_factory.mktemp("hermes") / "model", HERMES_TEMPLATE)


def post(model_dir: str, path: str, body: dict) -> tuple[object, FakeReplicas]:
    replicas = FakeReplicas()
    with ingress_client(model_dir, None, replicas) as (client, _):
        r = client.post(path, json=body)
    return r, replicas


def prompt_text(model_dir: str, replicas: FakeReplicas) -> str:
    tok = AutoTokenizer.from_pretrained(model_dir)
    return tok.decode(replicas.requests[0].prompt_ids)


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/chat/completions", {**CHAT, "reasoning_effort": "low"}),
        ("/v1/chat/completions", {**CHAT, "chat_template_kwargs": {"reasoning_effort": "low"}}),
        ("/v1/responses", {"model": BASE, "input": "hi", "reasoning": {"effort": "low"}}),
    ],
)
def test_reasoning_effort_reaches_a_template_that_reads_it(effort_dir, path, body):
    r, replicas = post(effort_dir, path, body)
    assert r.status_code == 200, r.text
    assert "Reasoning: low\n<|assistant|>" in prompt_text(effort_dir, replicas)


@pytest.mark.parametrize(
    "path, body, param, needle",
    [
        ("/v1/chat/completions", {**CHAT, "reasoning_effort": "high"}, "reasoning_effort",
         "reads no reasoning_effort"),
        ("/v1/responses", {"model": BASE, "input": "hi", "reasoning": {"effort": "high"}},
         "reasoning_effort", "reads no reasoning_effort"),
        ("/v1/chat/completions", {**CHAT, "chat_template_kwargs": {"thinking": False}},
         "chat_template_kwargs", "reads no thinking"),
        ("/v1/responses", {"model": BASE, "input": "hi", "chat_template_kwargs": {"x": 1}},
         "chat_template_kwargs", "reads no x"),
        ("/tokenize", {"messages": ASK, "chat_template_kwargs": {"enable_thinkng": False}},
         "chat_template_kwargs", "reads no enable_thinkng"),
    ],
)  # fmt: skip
def test_variables_the_template_does_not_read_are_a_400(hermes_dir, path, body, param, needle):
    r, replicas = post(hermes_dir, path, body)
    error = assert_openai_error(r, 400)
    assert error["param"] == param and needle in error["message"], error
    assert not replicas.requests


def test_a_variable_the_template_reads_is_served(hermes_dir):
    body = {"messages": ASK, "chat_template_kwargs": {"enable_thinking": False}}
    r, _ = post(hermes_dir, "/tokenize", body)
    assert r.status_code == 200, r.text


def test_reasoning_effort_and_chat_template_kwargs_must_agree(effort_dir):
    body = {**CHAT, "reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "high"}}
    r, replicas = post(effort_dir, "/v1/chat/completions", body)
    error = assert_openai_error(r, 400)
    assert error["param"] == "reasoning_effort" and "differs" in error["message"]
    assert not replicas.requests


def test_metadata_is_accepted_and_a_response_repeats_it(hermes_dir):
    metadata = {"ticket": "T-1", "team": "search"}
    r, _ = post(hermes_dir, "/v1/chat/completions", {**CHAT, "metadata": metadata})
    assert r.status_code == 200, r.text
    body = {"model": BASE, "input": "hi", "metadata": metadata, "reasoning": None}
    r, _ = post(hermes_dir, "/v1/responses", body)
    assert (r.json()["metadata"], r.json()["reasoning"]) == (metadata, None)


@pytest.mark.parametrize(
    "metadata, needle",
    [
        ({f"k{i}": "v" for i in range(17)}, "at most 16 items"),
        ({"k" * 65: "v"}, "at most 64 characters"),
        ({"k": 1}, "valid string"),
    ],
)
def test_metadata_follows_openai_bounds(hermes_dir, metadata, needle):
    r, _ = post(hermes_dir, "/v1/chat/completions", {**CHAT, "metadata": metadata})
    error = assert_openai_error(r, 400)
    assert error["param"].startswith("metadata") and needle in error["message"], error


def test_safety_identifier_is_logged_and_a_response_repeats_it(hermes_dir, caplog):
    with caplog.at_level(logging.DEBUG, logger="router.ingress"):
        r, _ = post(hermes_dir, "/v1/chat/completions", {**CHAT, "safety_identifier": "u-7"})
    assert r.status_code == 200, r.text
    assert "safety_identifier 'u-7'" in caplog.text
    body = {"model": BASE, "input": "hi", "safety_identifier": "u-7"}
    r, _ = post(hermes_dir, "/v1/responses", body)
    assert r.json()["safety_identifier"] == "u-7"
    r, _ = post(hermes_dir, "/v1/chat/completions", {**CHAT, "safety_identifier": "u" * 65})
    assert assert_openai_error(r, 400)["param"] == "safety_identifier"
