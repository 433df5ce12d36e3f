"""The ingress's answers with several choices, several prompts, logprobs and echo, and the
SamplingParams it sends: in-process (fake replicas scripting the Replies an engine sends)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from replica.errors import RequestError
from replica.wire import GenerateRequest, Reply, TokenLogprobs
from tests.fakes import FakeReplicas, FakeStore
from tests.net import assert_openai_error
from tests.router.client import BASE, ingress_client
from tests.router.client import streamed as streamed_text_and_chunks

COMPLETION = {"model": BASE, "prompt": "hello there", "max_tokens": 4}
CHAT = {"model": BASE, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def lp(token: int, logprob: float, *top: tuple[int, float]) -> TokenLogprobs:
    return TokenLogprobs(token, logprob, tuple(top))


def per_choice(tokens: dict[int, list[int]], logprobs: bool = False, cached: int = 0):
    """A replica script: choice i's tokens one per reply, choices interleaved, each
    choice's last reply finished ("length"); with logprobs, token t has logprob -t/10 and
    one alternative (t + 1, -t/10 - 1); `cached` of the prompt's tokens were cached."""

    def script(request: GenerateRequest) -> list[Reply]:
        n = len(request.prompt_ids)
        replies = []
        longest = max(len(t) for t in tokens.values())
        for step in range(longest):
            for index, ids in tokens.items():
                if step < len(ids):
                    t = ids[step]
                    k = request.sampling.logprobs or 0  # alternatives asked for: at most 1
                    entries = (lp(t, -t / 10, *[(t + 1, -t / 10 - 1)][:k]),) if logprobs else ()
                    last = step == len(ids) - 1
                    replies.append(
                        Reply(
                            (t,),
                            finish_reason="length" if last else None,
                            num_prompt_tokens=n,
                            num_cached_tokens=min(cached, n),
                            index=index,
                            logprobs=entries,
                        )
                    )
        return replies

    return script


def streamed(client: TestClient, path: str, body: dict[str, Any]) -> list[dict]:
    return streamed_text_and_chunks(client, path, body)[1]


# -- n choices and batched prompts --------------------------------------------------------------


def test_n_choices_come_back_by_index(client, replicas, tokenizer):
    replicas.script = per_choice({0: [5, 6], 1: [7, 8, 9]}, cached=1)
    r = client.post("/v1/completions", json={**COMPLETION, "n": 2, "seed": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    (request,) = replicas.requests  # one prefill for both choices
    assert request.sampling.n == 2 and request.sampling.seed == 3
    texts = [c["text"] for c in body["choices"]]
    assert texts == [tokenizer.decode([5, 6]), tokenizer.decode([7, 8, 9])]
    assert [c["index"] for c in body["choices"]] == [0, 1]
    prompt_tokens = len(request.prompt_ids)
    assert body["usage"] == {
        "prompt_tokens": prompt_tokens,  # once: the choices share the prompt
        "completion_tokens": 5,
        "total_tokens": prompt_tokens + 5,
        "prompt_tokens_details": {"cached_tokens": 1},  # the replica's prefix cache served 1
    }


def test_a_stream_ends_with_the_usage_and_its_cached_tokens(client, replicas):
    replicas.script = per_choice({0: [5, 6]}, cached=2)
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    chunks = streamed(client, "/v1/chat/completions", body)
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == [] and usage["completion_tokens"] == 2
    assert usage["prompt_tokens_details"] == {"cached_tokens": 2}


def test_batched_prompts_answer_one_choice_per_prompt_and_n(client, replicas, tokenizer):
    replicas.script = per_choice({0: [5], 1: [6]}, cached=2)
    body = {**COMPLETION, "prompt": ["hello", "a longer prompt"], "n": 2}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]  # prompt * n + choice
    assert [c["text"] for c in choices] == [tokenizer.decode([t]) for t in (5, 6, 5, 6)]
    first, second = replicas.requests
    assert first.prompt_ids == tokenizer("hello")["input_ids"]
    assert second.prompt_ids == tokenizer("a longer prompt")["input_ids"]
    assert len({first.request_id, second.request_id}) == 2
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] == len(first.prompt_ids) + len(second.prompt_ids)
    assert usage["completion_tokens"] == 4
    assert usage["prompt_tokens_details"] == {"cached_tokens": 4}  # 2 of each prompt
    r = client.post("/v1/completions", json={**COMPLETION, "prompt": [[3, 4], [11, 12, 13]]})
    assert len(r.json()["choices"]) == 2
    assert [q.prompt_ids for q in replicas.requests[2:]] == [[3, 4], [11, 12, 13]]


def test_streamed_choices_each_end_with_their_finish_reason(client, replicas, tokenizer):
    replicas.script = per_choice({0: [5, 6], 1: [7]})
    chunks = streamed(client, "/v1/chat/completions", {**CHAT, "n": 2})
    by_index: dict[int, list[dict]] = {0: [], 1: []}
    for chunk in chunks:
        for choice in chunk["choices"]:
            by_index[choice["index"]].append(choice)
    for index, ids in ((0, [5, 6]), (1, [7])):
        choices = by_index[index]
        assert choices[0]["delta"] == {"role": "assistant", "content": ""}
        text = "".join(c["delta"].get("content") or "" for c in choices)
        assert text == tokenizer.decode(ids)
        assert [c["finish_reason"] for c in choices][-1] == "length"
        assert all(c["finish_reason"] is None for c in choices[:-1])


def test_a_stop_string_ends_one_choice_and_the_others_go_on(client, replicas, tokenizer):
    stop = tokenizer.decode([6])
    replicas.script = per_choice({0: [5, 6, 7], 1: [8, 9]})
    r = client.post("/v1/completions", json={**COMPLETION, "n": 2, "stop": [stop]})
    first, second = r.json()["choices"]
    assert first["finish_reason"] == "stop" and first["stop_reason"] == stop
    assert first["text"] == tokenizer.decode([5, 6]).split(stop)[0]
    assert second["finish_reason"] == "length" and second["text"] == tokenizer.decode([8, 9])


# -- return_token_ids (vLLM) ---------------------------------------------------------------------


def test_token_ids_come_back_when_asked_and_end_with_a_stop_string(client, replicas, tokenizer):
    stop = tokenizer.decode([6])
    replicas.script = per_choice({0: [5, 6, 7], 1: [8, 9]})
    body = {**COMPLETION, "n": 2, "stop": [stop], "return_token_ids": True}
    first, second = client.post("/v1/completions", json=body).json()["choices"]
    (request,) = replicas.requests
    assert first["prompt_token_ids"] == second["prompt_token_ids"] == request.prompt_ids
    assert first["token_ids"] == [5, 6]  # up to the token that completed the stop string
    assert second["token_ids"] == [8, 9]
    replicas.script = per_choice({0: [5]})
    plain = client.post("/v1/completions", json={**COMPLETION}).json()["choices"][0]
    assert plain["token_ids"] is None and plain["prompt_token_ids"] is None


def test_streamed_token_ids_add_up_and_the_prompt_ids_come_first(client, replicas):
    replicas.script = per_choice({0: [5, 6, 7], 1: [8, 9]})
    body = {**COMPLETION, "n": 2, "stream": True, "return_token_ids": True}
    chunks = streamed(client, "/v1/completions", body)
    (request,) = replicas.requests
    for index, want in ((0, [5, 6, 7]), (1, [8, 9])):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert [t for c in mine for t in c["token_ids"]] == want
        assert mine[0]["prompt_token_ids"] == request.prompt_ids
        assert all(c["prompt_token_ids"] is None for c in mine[1:])


def test_chat_token_ids_and_the_rendered_prompt_ids(client, replicas):
    replicas.script = per_choice({0: [5, 6]})
    body = {**CHAT, "return_token_ids": True}
    r = client.post("/v1/chat/completions", json=body).json()
    (request,) = replicas.requests
    assert r["prompt_token_ids"] == request.prompt_ids
    assert r["choices"][0]["token_ids"] == [5, 6]
    chunks = streamed(client, "/v1/chat/completions", {**body, "stream": True})
    assert chunks[0]["prompt_token_ids"] == replicas.requests[1].prompt_ids
    assert all(c["prompt_token_ids"] is None for c in chunks[1:])
    assert [t for c in chunks[1:] for t in c["choices"][0]["token_ids"]] == [5, 6]


def test_a_refused_prompt_of_a_batch_refuses_the_request_and_cancels_the_others(client, replicas):
    def script(request: GenerateRequest) -> list[Reply]:
        if request.prompt_ids == [11, 12]:
            return [RequestError("prompt too long")]
        return per_choice({0: [5, 6]})(request)

    replicas.script = script
    r = client.post("/v1/completions", json={**COMPLETION, "prompt": [[3, 4], [11, 12]]})
    assert_openai_error(r, 400)
    assert replicas.streams[0].cancelled


# -- logprobs and echo ------------------------------------------------------------------------


def test_completion_logprobs_are_parallel_lists(client, replicas, tokenizer):
    replicas.script = per_choice({0: [5, 6]}, logprobs=True)
    r = client.post("/v1/completions", json={**COMPLETION, "logprobs": 1})
    assert r.status_code == 200, r.text
    assert replicas.requests[0].sampling.logprobs == 1
    assert replicas.requests[0].sampling.prompt_logprobs is None
    logprobs = r.json()["choices"][0]["logprobs"]
    tokens = [tokenizer.decode([5]), tokenizer.decode([6])]
    assert logprobs["tokens"] == tokens
    assert logprobs["token_logprobs"] == pytest.approx([-0.5, -0.6])
    assert logprobs["top_logprobs"] == [
        {tokenizer.decode([6]): pytest.approx(-1.5)},
        {tokenizer.decode([7]): pytest.approx(-1.6)},
    ]
    assert logprobs["text_offset"] == [0, len(tokens[0])]


def test_streamed_completion_logprobs_continue_the_text_offset(client, replicas, tokenizer):
    replicas.script = per_choice({0: [5, 6, 7]}, logprobs=True)
    chunks = streamed(client, "/v1/completions", {**COMPLETION, "logprobs": 0})
    lists = [c["choices"][0]["logprobs"] for c in chunks if c["choices"]]
    tokens = [t for lst in lists for t in lst["tokens"]]
    offsets = [o for lst in lists for o in lst["text_offset"]]
    assert tokens == [tokenizer.decode([t]) for t in (5, 6, 7)]
    assert offsets == [0, len(tokens[0]), len(tokens[0]) + len(tokens[1])]
    assert all(top == {} for lst in lists for top in lst["top_logprobs"])


def test_chat_logprobs_list_each_generated_token(client, replicas, tokenizer):
    replicas.script = per_choice({0: [5, 6]}, logprobs=True)
    body = {**CHAT, "logprobs": True, "top_logprobs": 1}
    r = client.post("/v1/chat/completions", json=body)
    assert replicas.requests[0].sampling.logprobs == 1
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == [tokenizer.decode([5]), tokenizer.decode([6])]
    assert content[0]["logprob"] == pytest.approx(-0.5)
    assert content[0]["bytes"] == list(tokenizer.decode([5]).encode())
    (alt,) = content[0]["top_logprobs"]
    assert alt["token"] == tokenizer.decode([6]) and alt["logprob"] == pytest.approx(-1.5)


def test_chat_logprobs_true_alone_asks_for_no_alternatives(client, replicas):
    replicas.script = per_choice({0: [5]}, logprobs=True)
    client.post("/v1/chat/completions", json={**CHAT, "logprobs": True})
    assert replicas.requests[0].sampling.logprobs == 0


def echo_script(request: GenerateRequest) -> list[Reply]:
    """A replica that scores the prompt (-1 per token, alternative 0) and generates
    max_tokens tokens 5, 6, ...: as an engine answers prompt_logprobs."""
    ids = request.prompt_ids
    scored = (None, *(lp(t, -1.0, (0, -2.0)) for t in ids[1:]))
    made = list(range(5, 5 + request.sampling.max_tokens))
    entries = tuple(lp(t, -0.5) for t in made) if request.sampling.logprobs is not None else ()
    return [
        Reply(
            tuple(made),
            finish_reason="length",
            num_prompt_tokens=len(ids),
            logprobs=entries,
            prompt_logprobs=scored,
        )
    ]


def test_echo_with_logprobs_scores_the_prompt(client, replicas, tokenizer):
    replicas.script = echo_script
    body = {**COMPLETION, "prompt": [7, 8, 9], "echo": True, "logprobs": 1, "max_tokens": 0}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    sampling = replicas.requests[0].sampling
    assert (sampling.max_tokens, sampling.prompt_logprobs, sampling.logprobs) == (0, 1, 1)
    (choice,) = r.json()["choices"]
    assert choice["text"] == tokenizer.decode([7, 8, 9])
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == [tokenizer.decode([t]) for t in (7, 8, 9)]
    assert logprobs["token_logprobs"] == [None, -1.0, -1.0]  # the first has no context
    assert logprobs["top_logprobs"][0] is None
    assert logprobs["top_logprobs"][1] == {tokenizer.decode([0]): -2.0}
    assert r.json()["usage"]["completion_tokens"] == 0


def test_echo_then_generated_tokens(client, replicas, tokenizer):
    replicas.script = echo_script
    body = {**COMPLETION, "echo": True, "logprobs": 0, "max_tokens": 2}
    r = client.post("/v1/completions", json=body)
    (choice,) = r.json()["choices"]
    assert choice["text"] == "hello there" + tokenizer.decode([5, 6])
    prompt = replicas.requests[0].prompt_ids
    assert len(choice["logprobs"]["tokens"]) == len(prompt) + 2
    assert choice["logprobs"]["token_logprobs"][-2:] == [-0.5, -0.5]


def test_echo_streams_the_prompt_first(client, replicas, tokenizer):
    replicas.script = echo_script
    chunks = streamed(client, "/v1/completions", {**COMPLETION, "echo": True, "max_tokens": 2})
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
    assert "".join(texts) == "hello there" + tokenizer.decode([5, 6])
    assert texts[0].startswith("hello there")
    assert replicas.requests[0].sampling.prompt_logprobs is None  # echo alone: no scoring


def test_echo_without_logprobs_and_max_tokens_0_is_only_the_prompt(client, replicas):
    replicas.script = echo_script
    body = {**COMPLETION, "echo": True, "max_tokens": 0}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "hello there"
    assert r.json()["choices"][0]["logprobs"] is None


def test_logprob_floor_keeps_the_body_json(client, replicas):
    def script(request: GenerateRequest) -> list[Reply]:
        entry = lp(5, -math.inf, (6, -math.inf))
        return [Reply((5,), "length", num_prompt_tokens=2, logprobs=(entry,))]

    replicas.script = script
    r = client.post("/v1/completions", json={**COMPLETION, "logprobs": 1})
    assert r.json()["choices"][0]["logprobs"]["token_logprobs"] == [-9999.0]


# -- what the replica is asked --------------------------------------------------------------


def test_chat_max_tokens_defaults_to_the_rest_of_the_context(client, replicas):
    client.post("/v1/chat/completions", json={k: v for k, v in CHAT.items() if k != "max_tokens"})
    assert replicas.requests[0].sampling.max_tokens is None  # the engine: context - prompt


def test_completion_max_tokens_defaults_to_the_servers_setting(model_dir):
    replicas = FakeReplicas()
    with ingress_client(model_dir, FakeStore(), replicas, default_max_tokens=7) as (client, _):
        body = {k: v for k, v in COMPLETION.items() if k != "max_tokens"}
        assert client.post("/v1/completions", json=body).status_code == 200
    assert replicas.requests[0].sampling.max_tokens == 7


def test_generation_config_supplies_defaults_the_request_leaves_out(tmp_path, model_dir):
    model = tmp_path / "model"
    model.mkdir()
    for f in Path(model_dir).iterdir():
        if f.is_file():
            (model / f.name).write_bytes(f.read_bytes())
    (model / "generation_config.json").write_text(
        json.dumps({"temperature": 0.6, "top_p": 0.9, "top_k": 20, "eos_token_id": [2, 9]})
    )
    replicas = FakeReplicas()
    with ingress_client(str(model), FakeStore(), replicas) as (client, _):
        client.post("/v1/completions", json=COMPLETION)
        client.post("/v1/completions", json={**COMPLETION, "temperature": 0, "top_k": None})
    implicit, explicit = (r.sampling for r in replicas.requests)
    assert (implicit.temperature, implicit.top_p, implicit.top_k) == (0.6, 0.9, 20)
    assert (explicit.temperature, explicit.top_p, explicit.top_k) == (0.0, 0.9, 20)


def test_sampling_fields_reach_the_replica(client, replicas):
    body = {
        **COMPLETION,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "repetition_penalty": 1.3,
        "min_p": 0.1,
        "min_tokens": 2,
        "logit_bias": {"7": 5.0, "3": -100},
        "stop_token_ids": [4],
    }
    assert client.post("/v1/completions", json=body).status_code == 200
    s = replicas.requests[0].sampling
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (0.5, -0.5, 1.3)
    assert (s.min_p, s.min_tokens, s.stop_token_ids) == (0.1, 2, (4,))
    assert s.logit_bias == ((3, -100.0), (7, 5.0))


def test_response_format_becomes_a_structured_output(client, replicas):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    body = {
        **CHAT,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    }
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    structured = replicas.requests[0].sampling.structured_output
    assert structured.kind == "json_schema" and json.loads(structured.json_schema) == schema
    client.post("/v1/chat/completions", json={**CHAT, "response_format": {"type": "json_object"}})
    assert replicas.requests[1].sampling.structured_output.kind == "json_object"
    client.post("/v1/chat/completions", json={**CHAT, "response_format": {"type": "text"}})
    assert replicas.requests[2].sampling.structured_output is None


def test_a_replicas_refusal_of_a_schema_is_a_400(client, replicas):
    replicas.script = lambda r: [RequestError("invalid JSON schema: bad")]
    body = {**CHAT, "response_format": {"type": "json_object"}}
    error = assert_openai_error(client.post("/v1/chat/completions", json=body), 400)
    assert "schema" in error["message"]


def test_prompts_whose_choices_all_stopped_are_cancelled(client, replicas, tokenizer):
    stop = tokenizer.decode([6])
    replicas.script = per_choice({0: [5, 6, 7, 8, 9]})
    body = {**COMPLETION, "prompt": [[3, 4], [11, 12]], "stop": [stop]}
    r = client.post("/v1/completions", json=body)
    assert [c["finish_reason"] for c in r.json()["choices"]] == ["stop", "stop"]
    assert all(s.cancelled for s in replicas.streams)  # the replicas' work after the stop
