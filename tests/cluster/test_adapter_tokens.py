"""An adapter that adds tokens to its base's vocabulary is refused at registration, the
tokens named; one shipping a tokenizer within the vocabulary is not."""

from __future__ import annotations

import json
import shutil

import pytest

from cluster.store.adapter_tokens import tokens_beyond_vocab
from cluster.store.conversion import Converter
from router.errors import BadRequestError
from tests.conftest import tiny_assets

VOCAB = 1000


@pytest.mark.parametrize(
    "name, content",
    [
        ("added_tokens.json", {"<tool>": VOCAB, "<old>": 5}),
        ("tokenizer_config.json", {"added_tokens_decoder": {
            str(VOCAB + 1): {"content": "<tool>"}, "5": {"content": "<old>"}}}),
        ("tokenizer.json", {"added_tokens": [{"id": VOCAB, "content": "<tool>"},
                                             {"id": 2, "content": "<old>"}]}),
    ],
)  # fmt: skip
def test_tokens_past_the_vocabulary_are_found_in_each_file(tmp_path, name, content):
    (tmp_path / name).write_text(json.dumps(content))
    assert tokens_beyond_vocab(tmp_path, VOCAB) == ["<tool>"]


def test_no_tokenizer_files_add_nothing(tmp_path):
    assert tokens_beyond_vocab(tmp_path, VOCAB) == []


def test_registration_refuses_an_adapter_that_adds_tokens(tmp_path):
    assets = tiny_assets("llama")
    adapter = tmp_path / "tool-adapter"
    shutil.copytree(assets.adapters["adapter-00"], adapter)
    converter = Converter(str(assets.model_dir), max_lora_rank=64)
    vocab = converter.spec.vocab_size
    (adapter / "added_tokens.json").write_text(json.dumps({"<tool_call>": vocab}))
    with pytest.raises(BadRequestError, match=r"adds tokens to the vocabulary \('<tool_call>'\)"):
        converter.convert("tool-adapter", adapter)
