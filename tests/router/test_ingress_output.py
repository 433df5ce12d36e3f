"""The text the ingress returns for a replica's tokens, on a Llama-2-style SentencePiece
tokenizer (Metaspace "▁" word starts, byte fallback): the first token's leading space, the
same text streamed and not, and vLLM's stop_reason."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from replica.wire import GenerateRequest, Reply
from tests.fakes import FakeReplicas, FakeStore
from tests.router.client import BASE, ingress_client, streamed
from tests.router.tokenizers import added_text, sentencepiece_tokenizer

EOS = 2


@pytest.fixture(scope="module")
def sp():
    return sentencepiece_tokenizer()


@pytest.fixture(scope="module")
def model_dir(sp, tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("sentencepiece-model")
    sp.save_pretrained(path)
    (path / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    return str(path)


@pytest.fixture
def replicas() -> FakeReplicas:
    return FakeReplicas()


@pytest.fixture
def client(model_dir, replicas) -> Iterator[TestClient]:
    with ingress_client(model_dir, FakeStore(), replicas) as (c, _):
        yield c


def answer(token_ids: list[int], finish: str = "length", stop_token: int | None = None):
    """A replica script: the tokens two at a time, then the end."""

    def script(request: GenerateRequest) -> list[Reply]:
        n = len(request.prompt_ids)
        chunks = [tuple(token_ids[i : i + 2]) for i in range(0, len(token_ids), 2)] or [()]
        replies = [Reply(chunk, num_prompt_tokens=n) for chunk in chunks[:-1]]
        last = Reply(chunks[-1], finish, num_prompt_tokens=n, stop_token=stop_token)
        return [*replies, last]

    return script


COMPLETION = {"model": BASE, "prompt": "Hello world", "max_tokens": 8}
CHAT = {"model": BASE, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8}


@pytest.mark.parametrize(
    "path, body", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)]
)
def test_first_token_keeps_its_leading_space(client, replicas, sp, path, body):
    output = sp("the quick brown fox 日本🙂 jumps", add_special_tokens=False)["input_ids"]
    assert sp.convert_ids_to_tokens(output)[0] == "▁the"
    replicas.script = answer(output)
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    text = choice["text"] if "text" in choice else choice["message"]["content"]
    prompt = replicas.requests[-1].prompt_ids
    assert text == added_text(sp, prompt, output)
    if path == "/v1/completions":  # after "Hello world" the output starts a word
        assert text == " the quick brown fox 日本🙂 jumps"
    stream_text, _ = streamed(client, path, body)
    assert stream_text == text


def test_streamed_deltas_add_up_to_the_text_with_byte_fallback(client, replicas, sp):
    output = sp("日本語 Straße 🙂🙂 ü dog", add_special_tokens=False)["input_ids"] + [EOS]
    replicas.script = answer(output, finish="stop")
    text = client.post("/v1/completions", json=COMPLETION).json()["choices"][0]["text"]
    stream_text, chunks = streamed(client, "/v1/completions", COMPLETION)
    deltas = [c["choices"][0]["text"] for c in chunks]
    assert stream_text == text == " 日本語 Straße 🙂🙂 ü dog"
    assert not any("\ufffd" in d for d in deltas)


def test_skip_special_tokens_false_keeps_them(client, replicas, sp):
    output = sp("the dog", add_special_tokens=False)["input_ids"] + [EOS]
    replicas.script = answer(output, finish="stop")
    body = {**COMPLETION, "skip_special_tokens": False}
    assert client.post("/v1/completions", json=body).json()["choices"][0]["text"] == " the dog</s>"


# -- stop_reason ------------------------------------------------------------------------------


def final_choice(chunks: list[dict]) -> dict:
    [last] = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    return last


@pytest.mark.parametrize(
    "path, body", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)]
)
def test_stop_reason_is_the_matched_stop_string(client, replicas, sp, path, body):
    replicas.script = answer(sp("the quick brown fox", add_special_tokens=False)["input_ids"])
    body = {**body, "stop": ["zzz", "brown"]}
    choice = client.post(path, json=body).json()["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", "brown")
    text, chunks = streamed(client, path, body)
    assert text.endswith(" the quick ") and "brown" not in text
    last = final_choice(chunks)
    assert (last["finish_reason"], last["stop_reason"]) == ("stop", "brown")
    # the stop string kept in the text, on request (vLLM's include_stop_str_in_output)
    kept = client.post(path, json={**body, "include_stop_str_in_output": True}).json()
    content = kept["choices"][0].get("text") or kept["choices"][0]["message"]["content"]
    assert content.endswith("quick brown")


@pytest.mark.parametrize(
    "path, body", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)]
)
def test_stop_reason_is_the_stop_token_the_replica_reports(client, replicas, sp, path, body):
    stop_id = sp.convert_tokens_to_ids("▁dog")
    output = sp("the lazy", add_special_tokens=False)["input_ids"] + [stop_id]
    replicas.script = answer(output, finish="stop", stop_token=stop_id)
    body = {**body, "stop_token_ids": [stop_id]}
    choice = client.post(path, json=body).json()["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop_id)
    _, chunks = streamed(client, path, body)
    assert final_choice(chunks)["stop_reason"] == stop_id
    # only the final chunk carries it: the others say nothing ended yet
    others = [
        c["choices"][0] for c in chunks if c["choices"] and not c["choices"][0]["finish_reason"]
    ]
    assert all(c["stop_reason"] is None for c in others)


@pytest.mark.parametrize("finish", ["stop", "length"])
def test_stop_reason_is_null_for_eos_and_length(client, replicas, sp, finish):
    output = sp("the dog", add_special_tokens=False)["input_ids"] + (
        [EOS] if finish == "stop" else []
    )
    replicas.script = answer(output, finish=finish)
    choice = client.post("/v1/completions", json=COMPLETION).json()["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"]) == (finish, None)
    _, chunks = streamed(client, "/v1/completions", COMPLETION)
    assert final_choice(chunks)["stop_reason"] is None
