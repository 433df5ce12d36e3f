"""max_tokens left to the engine (None) runs to the end of the model's context."""

from __future__ import annotations

import pytest

from replica.errors import RequestError
from replica.wire import GenerateRequest, SamplingParams
from tests.engines import make_engine


def test_max_tokens_none_is_the_rest_of_the_context(tiny):
    eng = make_engine(tiny, {}, max_model_len=40, kv_cache_bytes=8 << 20)
    prompt = list(range(3, 33))
    (seq,) = eng.generate(
        [(prompt, SamplingParams(temperature=0, max_tokens=None, ignore_eos=True), None)]
    )
    assert seq.finish_reason == "length"
    assert len(prompt) + len(seq.output_ids) == 40
    with pytest.raises(RequestError, match="maximum model length"):
        eng.add_request(GenerateRequest(list(range(3, 43)), SamplingParams(max_tokens=None)))
