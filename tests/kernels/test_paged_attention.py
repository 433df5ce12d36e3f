"""Paged decode attention: both backends against kernels.attention_reference, and the
reference against a dense causal SDPA over each sequence's contiguous K/V.

Triton runs compiled on a CUDA machine and in its interpreter elsewhere (tests/conftest.py
sets TRITON_INTERPRET=1 before anything imports triton). Every cache slot a call must not
read is NaN: the tail of each sequence's last block, the blocks its table lists past its
context, the positions before its window, spare blocks, and the scratch block that padding
rows point at. A backend that reads one fails loudly rather than by a rounding error.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels import attention_torch
from kernels.attention_reference import paged_decode_attention_reference
from tests.conftest import CUDA, TEST_DEVICE
from tests.kernels.paged_cases import HD, NAN, Case, make_case, mixed_lens

try:
    import triton
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    from kernels import attention_triton
except ImportError:  # a platform without triton still tests the torch path
    attention_triton = None
needs_triton = pytest.mark.skipif(attention_triton is None, reason="triton not installed")

BACKENDS = {"torch": attention_torch} | ({"triton": attention_triton} if attention_triton else {})
# (rtol, atol): fp32 end to end; half outputs are rounded once, about one ulp (|out| < ~2)
TOL = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}
# The interpreter's numpy arithmetic warns on padding rows, whose scratch block is NaN by
# design (their outputs are unspecified; the real rows are checked finite).
pytestmark = pytest.mark.filterwarnings(
    "ignore:invalid value encountered in subtract:RuntimeWarning"
)


def dense_oracle(case: Case, i: int) -> torch.Tensor:  # [H, hd] fp32
    """Row i as the last query of a causal (windowed) prefill over its contiguous K/V:
    no table, no cache, SDPA's own GQA; the window as the model's prefill masks it."""
    k, v = case.keys[i].to(TEST_DEVICE), case.values[i].to(TEST_DEVICE)  # [KVH, ctx, hd]
    ctx, h = k.shape[1], case.q.shape[1]
    queries = torch.randn(h, ctx, k.shape[2], device=TEST_DEVICE)  # earlier rows: anything
    queries[:, -1] = case.q[i].float()
    q_pos = torch.arange(ctx, device=TEST_DEVICE)[:, None]  # [ctx, 1]
    k_pos = torch.arange(ctx, device=TEST_DEVICE)[None, :]  # [1, ctx]
    mask = k_pos <= q_pos
    if case.window is not None:
        mask &= k_pos > q_pos - case.window
    o = F.scaled_dot_product_attention(
        queries, k, v, attn_mask=mask, scale=case.scale, enable_gqa=True
    )  # [H, ctx, hd]
    return o[:, -1]


def dense_soft_cap_oracle(case: Case, i: int) -> torch.Tensor:  # [H, hd] fp32
    """Row i as the last query of a causal (windowed) prefill over its contiguous K/V, by
    hand as Gemma 2's eager attention does it: scaled scores, then cap * tanh(s / cap),
    then the additive mask, an fp32 softmax and the values. No table, no cache."""
    k, v = case.keys[i].to(TEST_DEVICE), case.values[i].to(TEST_DEVICE)  # [KVH, ctx, hd]
    ctx, h, kvh = k.shape[1], case.q.shape[1], k.shape[0]
    k, v = k.repeat_interleave(h // kvh, 0), v.repeat_interleave(h // kvh, 0)  # [H, ctx, hd]
    queries = torch.randn(h, ctx, k.shape[2], device=TEST_DEVICE)  # earlier rows: anything
    queries[:, -1] = case.q[i].float()
    scores = queries @ k.transpose(1, 2) * case.scale  # [H, ctx, ctx]
    scores = scores / case.soft_cap
    scores = torch.tanh(scores)
    scores = scores * case.soft_cap
    q_pos = torch.arange(ctx, device=TEST_DEVICE)[:, None]  # [ctx, 1]
    k_pos = torch.arange(ctx, device=TEST_DEVICE)[None, :]  # [1, ctx]
    mask = k_pos <= q_pos
    if case.window is not None:
        mask &= k_pos > q_pos - case.window
    scores = scores + torch.zeros(ctx, ctx, device=TEST_DEVICE).masked_fill(~mask, -torch.inf)
    return (scores.softmax(-1) @ v)[:, -1]


def check(backend: str, case: Case) -> torch.Tensor:
    """The backend's output on the real rows matches the reference, and is finite."""
    out = BACKENDS[backend].paged_decode_attention(*case.args())
    ref = paged_decode_attention_reference(*case.args())
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    real = case.real
    assert torch.isfinite(ref[real]).all() and torch.isfinite(out[real]).all()
    rtol, atol = TOL[case.q.dtype]
    torch.testing.assert_close(out[real], ref[real], rtol=rtol, atol=atol)
    return out


HEADS = {"gqa4": (8, 2), "mqa": (8, 1), "mha": (4, 4)}


@needs_triton
def test_paged_triton_is_compiled_on_cuda_and_interpreted_elsewhere():
    assert isinstance(attention_triton._paged_decode_kernel, InterpretedFunction) is not CUDA


@pytest.mark.parametrize("window", [None, 1, 5, 100])
@pytest.mark.parametrize("heads", list(HEADS.values()), ids=list(HEADS))
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_paged_reference_matches_dense_causal_oracle(block_size, heads, window):
    case = make_case(mixed_lens(block_size), block_size, heads, window=window, seed=block_size)
    ref = paged_decode_attention_reference(*case.args())
    for i in range(len(case.keys)):
        if case.keys[i] is not None:
            torch.testing.assert_close(ref[i], dense_oracle(case, i), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads", list(HEADS.values()), ids=list(HEADS))
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_paged_matches_reference(backend, block_size, heads):
    check(backend, make_case(mixed_lens(block_size), block_size, heads, seed=block_size + 1))


@pytest.mark.parametrize("window", [1, 3, 16, 17, 1000])  # 1000: larger than every context
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_paged_sliding_window(backend, window):
    check(backend, make_case(mixed_lens(4), 4, (8, 2), window=window, seed=window))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_paged_half_precision(backend, dtype):
    check(backend, make_case(mixed_lens(4), 4, (8, 2), dtype, window=9, seed=3))


@needs_triton
def test_paged_triton_online_softmax_over_many_tiles(monkeypatch):
    """16-position tiles: up to 5 tiles per row, the window's start inside a tile, tiles
    spanning several 4-blocks; and a head dim that is not a power of two."""
    real = attention_triton.decode_config
    monkeypatch.setattr(
        attention_triton,
        "decode_config",
        lambda *a: real(*a) | {"BLOCK_N": 16},
    )
    check("triton", make_case(mixed_lens(4), 4, (6, 2), seed=5, hd=24))
    check("triton", make_case(mixed_lens(4), 4, (6, 2), window=21, seed=6, hd=24))


# Soft-capping (Gemma 2). The scaled scores here are about N(0, 1) (hd 16, scale 1/4):
# cap 0.5 squashes nearly every score, cap 3 mostly the tails.
CAPS = [0.5, 3.0]


@pytest.mark.parametrize("cap", CAPS)
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("block_size", [1, 16])
def test_paged_reference_soft_cap_matches_dense_oracle(block_size, window, cap):
    case = make_case(mixed_lens(block_size), block_size, window=window, seed=11, soft_cap=cap)
    ref = paged_decode_attention_reference(*case.args())
    for i in range(len(case.keys)):
        if case.keys[i] is not None:
            want = dense_soft_cap_oracle(case, i)
            torch.testing.assert_close(ref[i], want, rtol=1e-5, atol=1e-5)
    # the cap is not a no-op on this data: the test above compares something
    uncapped = paged_decode_attention_reference(*case.args()[:-1])
    assert (ref[case.real] - uncapped[case.real]).abs().max() > 0.05


@pytest.mark.parametrize("cap", CAPS)
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_paged_soft_cap_matches_reference(backend, dtype, window, cap):
    case = make_case(mixed_lens(4), 4, (8, 2), dtype, window=window, seed=12, soft_cap=cap)
    check(backend, case)


@needs_triton
@pytest.mark.parametrize("window", [None, 21])
def test_paged_triton_soft_cap_over_many_tiles(monkeypatch, window):
    """Capped scores through the online softmax over up to 5 tiles of 16 positions (the
    window's start inside a tile, head dim 24): with q scaled up, uncapped scores reach
    ~+-16 and the cap (2) squashes most of them, so a tile whose scores reach the running
    max or the sum uncapped shows."""
    real = attention_triton.decode_config
    monkeypatch.setattr(
        attention_triton,
        "decode_config",
        lambda *a: real(*a) | {"BLOCK_N": 16},
    )
    case = make_case(mixed_lens(4), 4, (6, 2), window=window, seed=13, hd=24, soft_cap=2.0)
    case.q.mul_(4.0)
    check("triton", case)


# Split-KV (flash-decoding): contexts 1..8192 over cache blocks of 16, with lengths at the
# block edges (15, 16, 17), the tile edges (255, 256, 257 for 256-position tiles) and
# shares that leave splits empty (1: one tile for every split; 769: 4 tiles; 1025: 5).
LONG_LENS = [1, 15, 16, 17, 255, 256, 257, 769, 1025, 8192]


def wide_tiles(monkeypatch, block_n: int) -> None:
    """Run the Triton kernel on tiles of block_n positions (the interpreter's time goes
    by tile, so 8k contexts take 32 tiles each instead of 128)."""
    real = attention_triton.decode_config
    monkeypatch.setattr(
        attention_triton, "decode_config", lambda *a: real(*a) | {"BLOCK_N": block_n}
    )


@needs_triton
@pytest.mark.parametrize(
    "window, cap", [(None, None), (1000, None), (None, 2.0), (300, 1.5)],
    ids=["plain", "window", "cap", "window-cap"],
)  # fmt: skip
@pytest.mark.parametrize("splits", [3, 8])
@pytest.mark.slow
def test_paged_triton_split_kv_long_contexts(monkeypatch, splits, window, cap):
    wide_tiles(monkeypatch, 256)
    case = make_case(LONG_LENS, 16, (4, 2), window=window, seed=splits, soft_cap=cap)
    out = attention_triton.paged_decode_attention(*case.args(), num_splits=splits)
    ref = paged_decode_attention_reference(*case.args())
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_paged_triton_split_kv_shares_at_tile_edges(dtype):
    """Default 64-position tiles, 4 splits: contexts of 1 to 5 tiles (shares of one tile,
    empty splits, a last share shorter than the others), padding rows, MQA, a window
    whose start sits inside a share."""
    lens = [1, 63, 64, None, 65, 129, 193, 257, 300]
    for window in (None, 70):
        case = make_case(lens, 4, (8, 1), dtype, window=window, seed=21)
        out = attention_triton.paged_decode_attention(*case.args(), num_splits=4)
        ref = paged_decode_attention_reference(*case.args())
        rtol, atol = TOL[dtype]
        torch.testing.assert_close(out[case.real], ref[case.real], rtol=rtol, atol=atol)


def test_decode_splits_fills_the_device_within_bounds():
    """Enough programs for two per SM, no share under 256 positions, at most 32; host ints."""
    assert kernels.decode_splits(32768, 1, 8, num_sms=132) == 32  # 33 wanted, capped at 32
    assert kernels.decode_splits(32768, 4, 8, num_sms=132) == 9  # ceil(264 / 32)
    assert kernels.decode_splits(4096, 4, 2, num_sms=132) == 16  # 4096 / 256
    assert kernels.decode_splits(32768, 64, 8, num_sms=132) == 1  # the batch fills it
    assert kernels.decode_splits(100, 1, 1, num_sms=132) == 1  # too short to share
    assert kernels.decode_splits(1, 1, 1, num_sms=132) == 1
    if not CUDA:  # no SMs to fill: one program per (sequence, kv head)
        assert kernels.decode_splits(32768, 1, 1) == 1


@needs_triton
def test_paged_public_op_passes_num_splits(monkeypatch):
    """Given, num_splits reaches the Triton backend as is; omitted, decode_splits of the
    table's width, the batch and the kv heads (here on a 132-SM device)."""
    seen = []
    real = attention_triton.paged_decode_attention

    def spy(*args, **kw):
        seen.append(kw["num_splits"])
        return real(*args, **kw)

    monkeypatch.setattr(attention_triton, "paged_decode_attention", spy)
    case = make_case([600, 1000], 16, (8, 2), seed=22)
    ref = paged_decode_attention_reference(*case.args())
    with kernels.forced_backend("triton"):
        out = kernels.paged_decode_attention(*case.args(), num_splits=3)
        monkeypatch.setattr(kernels, "_cuda_sm_count", lambda: 132)
        kernels.paged_decode_attention(*case.args())
    width = case.block_tables.shape[1] * 16
    assert seen == [3, kernels.decode_splits(width, 2, 2, num_sms=132)] and seen[1] > 1
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bad", [0, -1, True, 2.0, "2"])
def test_paged_public_op_validates_num_splits(bad):
    case = make_case([5, 9], 4, (8, 2))
    with pytest.raises(ValueError, match="num_splits"):
        kernels.paged_decode_attention(*case.args(), num_splits=bad)


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_paged_public_op_num_splits_same_output(backend):
    """The split count changes the work's layout, not the result (the torch path has no
    programs to split: it ignores it)."""
    case = make_case(mixed_lens(4), 4, (8, 2), window=9, seed=23, soft_cap=2.0)
    with kernels.forced_backend(backend):
        one = kernels.paged_decode_attention(*case.args(), num_splits=1)
        five = kernels.paged_decode_attention(*case.args(), num_splits=5)
    torch.testing.assert_close(five[case.real], one[case.real], rtol=1e-6, atol=1e-6)


IMPLS = ["reference"] + list(BACKENDS)


def impl(name: str):
    if name == "reference":
        return paged_decode_attention_reference
    return BACKENDS[name].paged_decode_attention


@pytest.mark.parametrize("name", IMPLS)
def test_paged_soft_cap_so_large_it_is_inert(name):
    """cap 1e6 over scores of a few units: cap * tanh(s / cap) = s to within 1e-12."""
    case = make_case(mixed_lens(4), 4, (8, 2), window=9, seed=14)
    uncapped = impl(name)(*case.args()[:-1])
    capped = impl(name)(*case.args()[:-1], 1e6)
    real = case.real
    assert torch.isfinite(capped[real]).all()
    torch.testing.assert_close(capped[real], uncapped[real], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_paged_soft_cap_none_is_bit_identical(backend):
    """soft_cap=None, positional or by keyword, through the backend or the public op, is
    the uncapped op: the same bits as a call that never names it."""
    case = make_case(mixed_lens(4), 4, (8, 2), torch.bfloat16, window=9, seed=15)
    base = case.args()[:-1]
    real = case.real
    plain = BACKENDS[backend].paged_decode_attention(*base)[real]
    assert torch.equal(BACKENDS[backend].paged_decode_attention(*base, None)[real], plain)
    with kernels.forced_backend(backend):
        public = kernels.paged_decode_attention(*base, soft_cap=None)
    assert torch.equal(public[real], plain)


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_paged_public_op_soft_cap_by_keyword_with_out(backend):
    """The model's call: positional window, soft_cap= and out= by keyword."""
    case = make_case(mixed_lens(16), 16, (8, 1), torch.bfloat16, window=20, seed=16)
    q, kc, vc, bt, cl, bs, scale, window = case.args()[:-1]
    out = torch.full_like(q, NAN)
    with kernels.forced_backend(backend):
        got = kernels.paged_decode_attention(
            q, kc, vc, bt, cl, bs, scale, window, soft_cap=1.5, out=out
        )
    assert got is out
    ref = paged_decode_attention_reference(q, kc, vc, bt, cl, bs, scale, window, soft_cap=1.5)
    torch.testing.assert_close(out[case.real], ref[case.real], rtol=1.6e-2, atol=1.6e-2)


if attention_triton is not None:

    @triton.jit
    def _tanh_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < n)
        tl.store(out_ptr + offs, attention_triton._tanh(x), mask=offs < n)


@needs_triton
def test_paged_triton_tanh_is_accurate():
    """The kernel's tanh (exp2 and a series near 0) against torch's in float64: a few
    fp32 ulps everywhere, on both sides of its 1/8 switch, near 0, saturated, at +-inf;
    odd; NaN stays NaN."""
    small = torch.logspace(-30, 0, 301)
    x = torch.cat([
        torch.linspace(-20, 20, 4001), small, -small,
        torch.tensor([0.125, 0.125 - 2**-26, 0.125 + 2**-26, 0.0, 88.0, 1e30]),
        torch.tensor([float("inf"), -float("inf"), float("nan")]),
    ]).to(TEST_DEVICE)  # fmt: skip
    out = torch.empty_like(x)
    _tanh_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), BLOCK=1024)
    want = torch.tanh(x.double()).float()
    torch.testing.assert_close(out, want, rtol=1e-6, atol=0.0, equal_nan=True)
    assert (out[~x.isnan()].abs() <= 1).all()


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_paged_padding_rows_do_not_leak(backend):
    """Rows padded to the scratch block (NaN) sit between real rows: those match the same
    rows computed without the padding."""
    lens = [5, None, 17, None, 1, 9]
    case = make_case(lens, 4, (8, 2), seed=7)
    out = check(backend, case)
    real = case.real
    alone = BACKENDS[backend].paged_decode_attention(
        case.q[real], case.k_cache, case.v_cache, case.block_tables[real],
        case.context_lens[real], case.block_size, case.scale,
    )  # fmt: skip
    torch.testing.assert_close(out[real], alone, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_paged_empty_batch(backend):
    case = make_case([5], 4, (8, 2))
    empty = torch.zeros(0, 4, dtype=torch.int32, device=TEST_DEVICE)
    args = (case.q[:0], case.k_cache, case.v_cache, empty, case.context_lens[:0], 4, 0.25)
    assert BACKENDS[backend].paged_decode_attention(*args).shape == (0, 8, HD)
    assert kernels.paged_decode_attention(*args).shape == (0, 8, HD)
    assert paged_decode_attention_reference(*args).shape == (0, 8, HD)


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_paged_out_buffer_written_in_place(backend):
    case = make_case(mixed_lens(4), 4, (8, 2), torch.float16, seed=8)
    out = torch.full_like(case.q, NAN)
    with kernels.forced_backend(backend):
        got = kernels.paged_decode_attention(*case.args(), out=out)
    assert got is out
    ref = paged_decode_attention_reference(*case.args())
    torch.testing.assert_close(out[case.real], ref[case.real], rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_paged_public_op_dispatches_and_matches(backend):
    case = make_case(mixed_lens(16), 16, (8, 1), torch.bfloat16, window=20, seed=9)
    with kernels.forced_backend(backend):
        out = kernels.paged_decode_attention(*case.args())
    ref = paged_decode_attention_reference(*case.args())
    torch.testing.assert_close(out[case.real], ref[case.real], rtol=1.6e-2, atol=1.6e-2)


def test_paged_torch_path_and_dispatcher_read_no_device_value():
    """On meta tensors (shapes, no data) any host read of a value raises, and no shape can
    follow one: the dispatcher and the torch path run there; the oracle, which reads, fails."""
    meta = torch.device("meta")
    case = make_case(mixed_lens(4), 4, (8, 2), window=6, seed=10)
    args = [a.to(meta) if isinstance(a, torch.Tensor) else a for a in case.args()]
    with kernels.forced_backend("torch"):
        out = kernels.paged_decode_attention(*args)
    assert out.device == meta and out.shape == case.q.shape
    with pytest.raises(NotImplementedError, match="meta"):
        paged_decode_attention_reference(*args)


def test_paged_public_op_validates_arguments():
    case = make_case([5, 9], 4, (8, 2))
    q, kc, vc, bt, cl = case.q, case.k_cache, case.v_cache, case.block_tables, case.context_lens
    op = kernels.paged_decode_attention
    with pytest.raises(ValueError, match=r"\[D, H, hd\]"):
        op(q[0], kc, vc, bt, cl, 4, 0.25)
    with pytest.raises(ValueError, match="one \\[KVH, slots, hd\\] shape"):
        op(q, kc, vc[:, :8], bt, cl, 4, 0.25)
    with pytest.raises(ValueError, match="H % KVH"):
        op(q[:, :7], kc, vc, bt, cl, 4, 0.25)  # 7 query heads over 2 kv heads
    with pytest.raises(ValueError, match="H % KVH"):
        op(q[:, :, :8], kc, vc, bt, cl, 4, 0.25)  # head dims differ
    with pytest.raises(ValueError, match="share one of"):
        op(q.half(), kc, vc, bt, cl, 4, 0.25)
    with pytest.raises(ValueError, match="share one of"):
        op(q.long(), kc.long(), vc.long(), bt, cl, 4, 0.25)
    with pytest.raises(ValueError, match="block_size"):
        op(q, kc, vc, bt, cl, 0, 0.25)
    with pytest.raises(ValueError, match="block_size"):
        op(q, kc, vc, bt, cl, 3, 0.25)  # doesn't divide the slots
    with pytest.raises(ValueError, match="sliding_window"):
        op(q, kc, vc, bt, cl, 4, 0.25, 0)
    with pytest.raises(ValueError, match="block_tables"):
        op(q, kc, vc, bt[:1], cl, 4, 0.25)
    with pytest.raises(ValueError, match="block_tables"):
        op(q, kc, vc, bt[0], cl, 4, 0.25)
    with pytest.raises(ValueError, match="context_lens"):
        op(q, kc, vc, bt, cl[:1], 4, 0.25)
    with pytest.raises(ValueError, match="no block column"):
        op(q, kc, vc, bt[:, :0], cl, 4, 0.25)
    with pytest.raises(ValueError, match="int32"):
        op(q, kc, vc, bt.long(), cl, 4, 0.25)
    with pytest.raises(ValueError, match="int32"):
        op(q, kc, vc, bt, cl.long(), 4, 0.25)
    with pytest.raises(ValueError, match="out"):
        op(q, kc, vc, bt, cl, 4, 0.25, out=torch.empty_like(q).half())
    with pytest.raises(ValueError, match="out"):
        op(q, kc, vc, bt, cl, 4, 0.25, out=q[:1].clone())
    if CUDA:
        with pytest.raises(ValueError, match="one device"):
            op(q, kc, vc, bt.cpu(), cl, 4, 0.25)
    else:
        with pytest.raises(ValueError, match="one device"):
            op(q, kc, vc, bt.to("meta"), cl, 4, 0.25)


@pytest.mark.parametrize(
    "bad", [0, 0.0, -1.0, -1e-9, NAN, float("inf"), -float("inf"), True, "1.0", torch.tensor(2.0)],
    ids=["0", "0.0", "neg", "tiny-neg", "nan", "inf", "-inf", "bool", "str", "tensor"],
)  # fmt: skip
def test_paged_public_op_validates_soft_cap(bad):
    case = make_case([5, 9], 4, (8, 2))
    args = case.args()[:-1]
    with pytest.raises(ValueError, match="soft_cap"):
        kernels.paged_decode_attention(*args, soft_cap=bad)
    with pytest.raises(ValueError, match="soft_cap"):
        kernels.paged_decode_attention(*args, bad)  # positional, after the window


@pytest.mark.parametrize("good", [1, 50.0, 1e-3])
def test_paged_public_op_accepts_soft_cap(good):
    case = make_case([5, 9], 4, (8, 2))
    out = kernels.paged_decode_attention(*case.args()[:-1], soft_cap=good)
    assert torch.isfinite(out).all()


@needs_triton
def test_paged_triton_rejects_strided_last_dim():
    case = make_case([5, 9], 4, (8, 2))
    wide = torch.zeros(*case.q.shape[:2], 2 * HD, dtype=case.q.dtype, device=TEST_DEVICE)
    wide[..., ::2] = case.q
    args = list(case.args())
    args[0] = wide[..., ::2]
    with pytest.raises(ValueError, match="unit stride"):
        attention_triton.paged_decode_attention(*args)


@needs_triton
def test_paged_triton_on_cpu_without_interpreter_is_refused():
    """Outside the interpreter, CPU tensors forced onto triton get a clear error."""
    code = textwrap.dedent(
        """
        import os, torch
        os.environ.pop("TRITON_INTERPRET", None)
        os.environ["LORAFLEET_KERNELS"] = "triton"
        import kernels
        q, kc = torch.zeros(1, 2, 16), torch.zeros(1, 4, 16)
        one = torch.ones(1, 1, dtype=torch.int32)
        try:
            kernels.paged_decode_attention(q, kc, kc, one - 1, one[0], 4, 0.25)
        except RuntimeError as e:
            assert "TRITON_INTERPRET=1" in str(e), e
        else:
            raise SystemExit("no error")
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


@needs_triton
@pytest.mark.slow
def test_paged_triton_kernel_compiles_for_cuda(tmp_path):
    """No GPU here: lower the kernels to sm_90 cubins (ptxas ships with triton) for each
    dtype at the demo model's shapes, single-pass and split (with the merge), and
    soft-capped and with sinks in bf16 (Gemma 2's and gpt-oss's dtype), to catch what the
    interpreter can't."""
    code = textwrap.dedent(
        """
        import torch
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource, compile
        from kernels import attention_triton as pa

        target = GPUTarget("cuda", 90, 32)
        ptr = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16"}

        def lower(fn, cfg, ptrs):
            opts = {"num_warps": cfg.pop("num_warps", 4)}
            sig = {n: "constexpr" if n in cfg else ptrs.get(n, "i32") for n in fn.arg_names}
            kernel = compile(ASTSource(fn, sig, constexprs=cfg), target=target, options=opts)
            assert "mma" in kernel.asm["ptx"] or "fma" in kernel.asm["ptx"]

        for dtype, p in ptr.items():
            shapes = [(64, 4, 16, False, False, False), (128, 8, 1, False, True, False)]
            if dtype == torch.bfloat16:  # soft-capped, sinks (fp32 scores: one dtype)
                shapes += [(64, 4, 16, True, False, False), (256, 2, 16, True, True, False),
                           (64, 8, 16, False, False, True), (64, 8, 16, False, True, True)]
            for hd, group, block_size, cap, split, sinks in shapes:
                cfg = pa.decode_config(hd, group, dtype)
                cfg |= {"GROUP": group, "BLOCK_SIZE": block_size, "SOFT_CAP": cap,
                        "SPLIT": split, "SINKS": sinks}
                dest = "*fp32" if split else p
                lower(pa._paged_decode_kernel, cfg, {
                    "q_ptr": p, "k_ptr": p, "v_ptr": p, "out_ptr": dest, "lse_ptr": dest,
                    "sinks_ptr": "*fp32", "tables_ptr": "*i32", "lens_ptr": "*i32",
                    "qk_scale": "fp32", "cap_scale": "fp32"})
            for sinks in (False, True):
                lower(pa._merge_splits_kernel, {"BLOCK_S": 32, "BLOCK_D": 128, "SINKS": sinks},
                      {"part_ptr": "*fp32", "lse_ptr": "*fp32", "sinks_ptr": "*fp32",
                       "out_ptr": p})
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=300)
