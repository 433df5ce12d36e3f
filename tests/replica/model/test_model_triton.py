"""The model end to end with Triton kernels forced equals the torch path: compiled on a
CUDA machine, in the interpreter elsewhere (tests/conftest.py picks)."""

from __future__ import annotations

import torch

import kernels
from replica.wire import SamplingParams
from tests.conftest import TEST_DEVICE
from tests.engines import make_engine


def test_model_output_unchanged_with_triton_forced(tiny, monkeypatch):
    eng = make_engine(tiny, device=str(TEST_DEVICE), dtype="float32", num_slots=5)
    sampling = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    requests = [([5, 6, 7, 8, 9], sampling, "adapter-00"), ([10, 11], sampling, None),
                ([12, 13, 14], sampling, "adapter-02"), ([15], sampling, "adapter-03")]  # fmt: skip
    with kernels.forced_backend("torch"):
        want = [s.output_ids for s in eng.generate(requests)]
        want_logits = eng.score([5, 6, 7, 8, 9], "adapter-01")
    from kernels import sgmv_triton

    calls = []
    real = sgmv_triton.lora_expand
    monkeypatch.setattr(sgmv_triton, "lora_expand", lambda *a: calls.append(1) or real(*a))
    with kernels.forced_backend("triton"):
        got = [s.output_ids for s in eng.generate(requests)]
        got_logits = eng.score([5, 6, 7, 8, 9], "adapter-01")
    assert calls, "the Triton backend was not used"
    assert got == want
    torch.testing.assert_close(got_logits, want_logits, atol=1e-4, rtol=1e-4)
