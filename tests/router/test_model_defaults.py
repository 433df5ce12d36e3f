"""A model's generation_config.json gives the defaults of fields a request leaves unset."""

from __future__ import annotations

import json

from router.model_defaults import sampling_defaults
from router.protocol import CompletionRequest


def test_generation_config_sets_the_defaults(tmp_path):
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.6, "top_p": 0.9, "top_k": 20, "do_sample": True,
                    "repetition_penalty": 1.05, "max_new_tokens": 99, "eos_token_id": [1, 7]})
    )  # fmt: skip
    defaults = sampling_defaults(tmp_path)
    assert defaults == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.05}
    req = CompletionRequest(model="m", prompt="x", temperature=0.2)
    params = req.sampling_params(16, defaults)
    assert (params.temperature, params.top_p, params.top_k) == (0.2, 0.9, 20)


def test_without_or_with_a_broken_generation_config_the_api_defaults_hold(tmp_path):
    assert sampling_defaults(tmp_path) == {}
    (tmp_path / "generation_config.json").write_text("{not json")
    assert sampling_defaults(tmp_path) == {}
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 7, "top_p": 0.5}))
    assert sampling_defaults(tmp_path) == {"top_p": 0.5}  # 7 is out of range: left out
