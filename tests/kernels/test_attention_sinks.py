"""Attention sinks (gpt-oss: each head's softmax has one more logit, its probability
dropped) in paged decode and prefill attention: the references against the closed form
out_plain · sigmoid(lse - sink), then the torch and Triton paths against the references,
with windows, paged slots, split-KV decode and sinks large enough to take most of a
row's mass.
"""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels import attention_torch
from kernels.attention_reference import (
    paged_decode_attention_reference,
    prefill_attention_reference,
)
from tests.conftest import TEST_DEVICE
from tests.kernels import paged_cases as paged_tests
from tests.kernels import prefill_cases as prefill_tests

try:
    from kernels import attention_triton
except ImportError:  # a platform without triton still tests the torch path
    attention_triton = None
needs_triton = pytest.mark.skipif(attention_triton is None, reason="triton not installed")
pytestmark = pytest.mark.filterwarnings(
    "ignore:invalid value encountered in subtract:RuntimeWarning"
)


def sinks_for(heads: int, seed: int) -> torch.Tensor:
    """[H] fp32 sink logits from -2 to 4: some heads barely touched, some mostly sunk."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.rand(heads, generator=gen) * 6 - 2).to(TEST_DEVICE)


def closed_form(scores: torch.Tensor, values: torch.Tensor, sinks: torch.Tensor):
    """softmax([s, sink]) without the sink's column, @ V, written as the plain attention
    times sigmoid(logsumexp(s) - sink): [H, m] scores, [H, m, hd] values -> [H, hd]."""
    plain = torch.einsum("hm,hmd->hd", scores.softmax(-1), values)
    return plain * torch.sigmoid(scores.logsumexp(-1) - sinks)[:, None]


def test_prefill_reference_with_sinks_is_the_closed_form():
    case = prefill_tests.make_case(6, 20, (8, 2), window=5, seed=3)
    sinks = sinks_for(8, 3)
    got = prefill_attention_reference(*case.args(), sinks=sinks)
    k = case.keys.repeat_interleave(4, 0)  # [H, ctx, hd]
    v = case.values.repeat_interleave(4, 0)
    for i in range(6):
        t = 20 - 6 + i
        lo = max(0, t - 5 + 1)
        scores = torch.einsum("hd,hmd->hm", case.q[i].float(), k[:, lo : t + 1]) * case.scale
        want = closed_form(scores, v[:, lo : t + 1], sinks)
        torch.testing.assert_close(got[i], want, rtol=1e-5, atol=1e-6)
    plain = prefill_attention_reference(*case.args())
    assert (got - plain).abs().max() > 0.1  # the sinks bite


def test_decode_reference_with_sinks_is_the_closed_form():
    case = paged_tests.make_case([3, 9, 17], 4, (8, 2), window=6, seed=5)
    sinks = sinks_for(8, 5)
    got = paged_decode_attention_reference(*case.args(), sinks=sinks)
    for i, ctx in enumerate([3, 9, 17]):
        lo = max(0, ctx - 6)
        k = case.keys[i][:, lo:].repeat_interleave(4, 0)
        v = case.values[i][:, lo:].repeat_interleave(4, 0)
        scores = torch.einsum("hd,hmd->hm", case.q[i].float(), k) * case.scale
        torch.testing.assert_close(got[i], closed_form(scores, v, sinks), rtol=1e-5, atol=1e-6)


PREFILL = {"torch": attention_torch.prefill_attention}
DECODE = {"torch": attention_torch.paged_decode_attention}
if attention_triton is not None:

    def _prefill_triton(q, k, v, scale, slots, window, cap, sinks=None):
        return attention_triton.prefill_attention_kernel(
            q, k, v, scale, slots, window, cap, torch.empty_like(q), sinks
        )

    PREFILL["triton"] = _prefill_triton
    DECODE["triton"] = attention_triton.paged_decode_attention


@pytest.mark.parametrize("backend", list(PREFILL))
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("shape", [(9, 9), (70, 70), (16, 40)], ids=["9of9", "70of70", "16of40"])
def test_prefill_with_sinks_matches_reference(backend, shape, window):
    case = prefill_tests.make_case(*shape, (8, 2), window=window, seed=shape[0])
    sinks = sinks_for(8, shape[1])
    out = PREFILL[backend](*case.args(), sinks=sinks)
    ref = prefill_attention_reference(*case.args(), sinks=sinks)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_prefill_torch_by_hand_with_sinks_matches_reference(monkeypatch):
    """Where torch has no flash op with a log-sum-exp, sinks take the by-hand chunks."""
    monkeypatch.setattr(attention_torch, "FLASH_CPU_WITH_LSE", None)
    for shape, window in (((9, 9), None), ((16, 40), 7), ((37, 37), 5)):
        case = prefill_tests.make_case(*shape, (8, 2), window=window, seed=shape[1])
        sinks = sinks_for(8, shape[0])
        out = attention_torch.prefill_attention(*case.args(), sinks=sinks)
        ref = prefill_attention_reference(*case.args(), sinks=sinks)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_prefill_torch_with_sinks_in_half_precision(dtype):
    for shape, window in (((40, 40), None), ((16, 40), 7)):
        case = prefill_tests.make_case(*shape, (8, 2), dtype=dtype, window=window, seed=6)
        sinks = sinks_for(8, 6)
        out = attention_torch.prefill_attention(*case.args(), sinks=sinks)
        ref = prefill_attention_reference(*case.args(), sinks=sinks)
        rtol, atol = prefill_tests.TOL[dtype]
        torch.testing.assert_close(out, ref, rtol=rtol, atol=atol)


@pytest.mark.parametrize("backend", list(DECODE))
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("window", [None, 6])
def test_decode_with_sinks_matches_reference(backend, splits, window):
    case = paged_tests.make_case(paged_tests.mixed_lens(4), 4, (8, 2), window=window, seed=9)
    sinks = sinks_for(8, 9)
    out = DECODE[backend](*case.args(), num_splits=splits, sinks=sinks)
    ref = paged_decode_attention_reference(*case.args(), sinks=sinks)
    real = case.real
    assert torch.isfinite(out[real]).all()
    torch.testing.assert_close(out[real], ref[real], rtol=1e-5, atol=1e-5)


def test_public_ops_pass_sinks_and_check_them():
    case = prefill_tests.make_case(16, 40, (8, 2), window=9, seed=2)
    sinks = sinks_for(8, 2)
    got = kernels.prefill_attention(*case.args(), sinks=sinks)
    torch.testing.assert_close(got, prefill_attention_reference(*case.args(), sinks=sinks))
    with pytest.raises(ValueError, match="sinks"):
        kernels.prefill_attention(*case.args(), sinks=sinks[:4])
    dec = paged_tests.make_case([5, 12], 4, (8, 2), seed=4)
    got = kernels.paged_decode_attention(*dec.args(), sinks=sinks)
    torch.testing.assert_close(got, paged_decode_attention_reference(*dec.args(), sinks=sinks))
    with pytest.raises(ValueError, match="sinks"):
        kernels.paged_decode_attention(*dec.args(), sinks=sinks.double())
