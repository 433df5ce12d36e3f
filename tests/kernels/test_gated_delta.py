"""Gated DeltaNet ops: the reference against transformers' own Qwen3.5 functions, and both
backends (torch, Triton) against the reference over varlen batches.

Batches mix decodes (one token) and prefill chunks whose lengths cross chunk edges, with
and without an initial state, at GQA ratios 1, 2 and 3. Every pool row a call must not
read holds NaN (rows no sequence names, and the rows of sequences starting from zeros), so
a backend that reads one fails loudly; rows no sequence names must come back
bit-identical. Triton runs in its interpreter on CPU (tests/conftest.py sets
TRITON_INTERPRET=1), at small dims.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    causal_conv1d_fn,
    causal_conv1d_update,
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

import kernels
from kernels import StateBatch, forced_backend, make_state_batch
from kernels.gated_delta_reference import causal_conv1d_reference, gated_delta_rule_reference
from tests.conftest import TEST_DEVICE

try:
    from kernels import gated_delta_triton

    BACKENDS = ["torch", "triton"]
except ImportError:  # a platform without triton still tests the torch path
    gated_delta_triton = None
    BACKENDS = ["torch"]

NAN = float("nan")
DK, DV, CONV_DIM, KERNEL = 16, 24, 40, 4  # dv and D not multiples of a block
# (rtol, atol) of outputs: fp32 differs from the token loop by the chunked form's
# summation order; half outputs are rounded once (their states stay fp32, STATE_TOL)
TOL = {torch.float32: (1e-5, 2e-5), torch.bfloat16: (1.6e-2, 1.6e-2)}
STATE_TOL = (1e-5, 5e-5)
CASES = {
    # name: [(length, has_initial_state)] per sequence
    "decode": [(1, True), (1, False), (1, True), (1, True)],
    "mixed": [(1, True), (70, False), (3, True), (1, False), (64, True), (2, True), (17, False)],
    "long": [(130, True)],
}


@dataclass
class Case:
    x: torch.Tensor  # [T, CONV_DIM]: the conv's input
    q: torch.Tensor  # [T, HK, DK]
    k: torch.Tensor
    v: torch.Tensor  # [T, HV, DV]
    g: torch.Tensor  # [T, HV] float32, <= 0
    beta: torch.Tensor  # [T, HV]
    conv_state: torch.Tensor  # [slots, CONV_DIM, KERNEL-1]
    recurrent_state: torch.Tensor  # [slots, HV, DK, DV] float32
    batch: StateBatch
    unread: list[int]  # pool rows no sequence names


def make_case(
    seqs: list[tuple[int, bool]],
    heads: tuple[int, int] = (2, 4),
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> Case:
    gen = torch.Generator().manual_seed(seed)
    hk, hv = heads
    lens = [n for n, _ in seqs]
    t, slots = sum(lens), 2 * len(seqs) + 1
    order = torch.randperm(slots, generator=gen).tolist()  # shuffled, non-contiguous rows
    used, unread = order[: len(seqs)], order[len(seqs) :]

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    conv_state = randn(slots, CONV_DIM, KERNEL - 1)
    recurrent_state = randn(slots, hv, DK, DV) * 0.5
    never_read = unread + [r for r, (_, initial) in zip(used, seqs) if not initial]
    conv_state[never_read] = NAN
    recurrent_state[never_read] = NAN
    batch = make_state_batch(lens, used, [i for _, i in seqs], TEST_DEVICE)
    return Case(
        x=randn(t, CONV_DIM).to(TEST_DEVICE, dtype),
        q=randn(t, hk, DK).to(TEST_DEVICE, dtype),
        k=randn(t, hk, DK).to(TEST_DEVICE, dtype),
        v=randn(t, hv, DV).to(TEST_DEVICE, dtype),
        # Qwen3.5's gates: g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b)
        g=(-torch.rand(hv, generator=gen) * torch.nn.functional.softplus(randn(t, hv))).to(
            TEST_DEVICE
        ),
        beta=torch.sigmoid(randn(t, hv)).to(TEST_DEVICE, dtype),
        conv_state=conv_state.to(TEST_DEVICE, dtype),
        recurrent_state=recurrent_state.to(TEST_DEVICE),
        batch=batch,
        unread=unread,
    )


def assert_pool(pool: torch.Tensor, want: torch.Tensor, before: torch.Tensor, unread, tol):
    """Rows the batch names match the reference's; rows it does not are bit-identical."""
    for row in range(pool.shape[0]):
        if row in unread:
            assert torch.equal(pool[row].nan_to_num(7.0), before[row].nan_to_num(7.0)), row
        else:
            torch.testing.assert_close(pool[row], want[row], rtol=tol[0], atol=tol[1])


# --- the reference against transformers' Qwen3.5 functions (fp32, tight) -------------


@pytest.mark.parametrize("heads", [(2, 2), (2, 4), (1, 3)])
def test_reference_matches_transformers_per_sequence(heads):
    """Each sequence of a varlen batch: transformers' recurrent and chunked functions on it
    alone (initial_state from the pool or None) give the reference's outputs and final
    state."""
    c = make_case(CASES["mixed"], heads)
    before = c.recurrent_state.clone()
    out = gated_delta_rule_reference(c.q, c.k, c.v, c.g, c.beta, c.recurrent_state, c.batch)
    cu = c.batch.cu_seqlens.tolist()
    for i, (slot, initial) in enumerate(
        zip(c.batch.state_slots.tolist(), c.batch.has_initial_state.tolist())
    ):
        lo, hi = cu[i], cu[i + 1]
        args = [t[None, lo:hi] for t in (c.q, c.k, c.v, c.g, c.beta)]
        init = before[slot : slot + 1] if initial else None
        for fn in (torch_recurrent_gated_delta_rule, torch_chunk_gated_delta_rule):
            o, state = fn(*args[:3], g=args[3], beta=args[4], initial_state=init,
                          output_final_state=True, use_qk_l2norm_in_kernel=True)  # fmt: skip
            torch.testing.assert_close(out[lo:hi], o[0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(c.recurrent_state[slot], state[0], rtol=1e-5, atol=1e-5)


def test_conv_reference_matches_transformers():
    """Without a state, transformers' causal_conv1d_fn over the sequence; with one, its
    causal_conv1d_update (state and output), for decodes and chunks alike."""
    c = make_case(CASES["mixed"])
    weight = torch.randn(CONV_DIM, KERNEL)
    bias = torch.randn(CONV_DIM)
    before = c.conv_state.clone()
    out = causal_conv1d_reference(c.x, weight, bias, c.conv_state, c.batch)
    cu = c.batch.cu_seqlens.tolist()
    for i, (slot, initial) in enumerate(
        zip(c.batch.state_slots.tolist(), c.batch.has_initial_state.tolist())
    ):
        x = c.x[cu[i] : cu[i + 1]].T[None]  # [1, D, L]
        if initial:
            state = before[slot : slot + 1].clone()
            want = causal_conv1d_update(x, state, weight, bias, "silu")
            torch.testing.assert_close(c.conv_state[slot], state[0], rtol=0, atol=0)
        else:
            want = causal_conv1d_fn(x, weight, bias, activation="silu")
        torch.testing.assert_close(out[cu[i] : cu[i + 1]], want[0].T, rtol=1e-6, atol=1e-6)


# --- both backends against the reference ----------------------------------------------


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
def test_gated_delta_rule_matches_reference(name, dtype, case):
    c = make_case(CASES[case], dtype=dtype, seed=len(case))
    before = c.recurrent_state.clone()
    want_pool = before.clone()
    want = gated_delta_rule_reference(c.q, c.k, c.v, c.g, c.beta, want_pool, c.batch)
    with forced_backend(name):
        got = kernels.gated_delta_rule(c.q, c.k, c.v, c.g, c.beta, c.recurrent_state, c.batch)
    assert got.dtype == dtype and got.shape == c.v.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=TOL[dtype][0], atol=TOL[dtype][1])
    assert_pool(c.recurrent_state, want_pool, before, c.unread, STATE_TOL)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("heads", [(2, 2), (1, 3)])
def test_gated_delta_rule_head_ratios(name, heads):
    c = make_case(CASES["mixed"], heads)
    want_pool = c.recurrent_state.clone()
    want = gated_delta_rule_reference(c.q, c.k, c.v, c.g, c.beta, want_pool, c.batch)
    out = torch.full_like(c.v, NAN)  # an `out` buffer: every row written
    with forced_backend(name):
        got = kernels.gated_delta_rule(
            c.q, c.k, c.v, c.g, c.beta, c.recurrent_state, c.batch, out=out
        )
    assert got is out
    torch.testing.assert_close(got, want, rtol=TOL[torch.float32][0], atol=TOL[torch.float32][1])
    torch.testing.assert_close(c.recurrent_state, want_pool, rtol=1e-5, atol=5e-5, equal_nan=True)


@pytest.mark.parametrize("name", BACKENDS)
def test_gated_delta_rule_repeated_keys_stay_exact(name):
    """One key repeated with beta = 1 and no decay: the UT transform's inverse has
    entries of +-1 along whole rows, which an inverse by series (sum of powers of A)
    would get from huge cancelling terms; the blocked substitutions keep fp32 accuracy."""
    t = 100
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(t, 1, DK, generator=gen)
    k = torch.randn(1, 1, DK, generator=gen).expand(t, 1, DK).contiguous()
    v = torch.randn(t, 2, DV, generator=gen)
    g, beta = torch.zeros(t, 2), torch.ones(t, 2)
    batch = make_state_batch([t], [0], [False], TEST_DEVICE)
    want_pool = torch.zeros(1, 2, DK, DV)
    want = gated_delta_rule_reference(q, k, v, g, beta, want_pool, batch)
    pool = torch.zeros(1, 2, DK, DV, device=TEST_DEVICE)
    with forced_backend(name):
        got = kernels.gated_delta_rule(*(x.to(TEST_DEVICE) for x in (q, k, v, g, beta)), pool,
                                       batch)  # fmt: skip
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(pool.cpu(), want_pool, rtol=1e-5, atol=5e-5)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["decode", "mixed"])
@pytest.mark.parametrize("bias", [True, False])
def test_causal_conv1d_matches_reference(name, dtype, case, bias):
    c = make_case(CASES[case], dtype=dtype, seed=7)
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(CONV_DIM, KERNEL, generator=gen).to(TEST_DEVICE, dtype)
    b = torch.randn(CONV_DIM, generator=gen).to(TEST_DEVICE, dtype) if bias else None
    activation = "silu" if bias else None  # both activations, in half the cases
    before = c.conv_state.clone()
    want_pool = before.clone()
    want = causal_conv1d_reference(c.x, weight, b, want_pool, c.batch, activation)
    with forced_backend(name):
        got = kernels.causal_conv1d(c.x, weight, b, c.conv_state, c.batch, activation)
    assert got.dtype == dtype
    rtol, atol = (1e-6, 1e-5) if dtype == torch.float32 else TOL[dtype]
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
    assert_pool(c.conv_state, want_pool, before, c.unread, (0, 0))  # inputs, kept exactly


@pytest.mark.parametrize("name", BACKENDS)
def test_a_sequence_in_steps_equals_one_pass(name):
    """Prefill in two chunks (the first from zeros, the second from the pool), then three
    decode steps, each call continuing from the pool: the outputs and states of one
    reference pass over all the tokens. The chunks cross the 64-token chunk edge."""
    c = make_case([(70, False)], seed=5)
    weight = torch.randn(CONV_DIM, KERNEL, device=TEST_DEVICE)
    inputs = (c.q, c.k, c.v, c.g, c.beta)
    want_rec, want_conv = c.recurrent_state.clone(), c.conv_state.clone()
    want_o = gated_delta_rule_reference(*inputs, want_rec, c.batch)
    want_y = causal_conv1d_reference(c.x, weight, None, want_conv, c.batch)
    slot = c.batch.state_slots.tolist()
    for lo, hi in [(0, 60), (60, 67), (67, 68), (68, 69), (69, 70)]:
        step = make_state_batch([hi - lo], slot, [lo > 0], TEST_DEVICE)
        with forced_backend(name):
            o = kernels.gated_delta_rule(*(t[lo:hi] for t in inputs), c.recurrent_state, step)
            y = kernels.causal_conv1d(c.x[lo:hi], weight, None, c.conv_state, step)
        torch.testing.assert_close(o, want_o[lo:hi], rtol=1e-5, atol=2e-5)
        torch.testing.assert_close(y, want_y[lo:hi], rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(c.recurrent_state[slot], want_rec[slot], rtol=1e-5, atol=5e-5)
    torch.testing.assert_close(c.conv_state[slot], want_conv[slot], rtol=0, atol=0)


@pytest.mark.parametrize("name", BACKENDS)
def test_padding_rows_may_share_a_scratch_row(name):
    """A decode step padded to a CUDA-graph bucket: the padding rows all name one scratch
    row of the pools, without an initial state. The real rows' outputs and pool rows are
    those of a batch without the padding."""
    c = make_case([(1, True), (1, True), (1, False), (1, False), (1, True)], seed=11)
    slots = c.batch.state_slots.tolist()
    slots[3] = slots[2]  # rows 2 and 3 are padding: one scratch row
    padded = make_state_batch([1] * 5, slots, [True, True, False, False, True], TEST_DEVICE)
    real = [0, 1, 4]
    alone = make_state_batch([1] * 3, [slots[i] for i in real], [True] * 3, TEST_DEVICE)
    weight = torch.randn(CONV_DIM, KERNEL, device=TEST_DEVICE)
    pick = [x[real] for x in (c.q, c.k, c.v, c.g, c.beta)]
    want_pool, want_conv = c.recurrent_state.clone(), c.conv_state.clone()
    want_o = gated_delta_rule_reference(*pick, want_pool, alone)
    want_y = causal_conv1d_reference(c.x[real], weight, None, want_conv, alone)
    with forced_backend(name):
        o = kernels.gated_delta_rule(c.q, c.k, c.v, c.g, c.beta, c.recurrent_state, padded)
        y = kernels.causal_conv1d(c.x, weight, None, c.conv_state, padded)
    torch.testing.assert_close(o[real], want_o, rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(y[real], want_y, rtol=1e-6, atol=1e-5)
    rows = [slots[i] for i in real]
    torch.testing.assert_close(c.recurrent_state[rows], want_pool[rows], rtol=1e-5, atol=5e-5)
    assert torch.equal(c.conv_state[rows], want_conv[rows])


# --- no device reads, argument checks --------------------------------------------------


@pytest.mark.parametrize("lens", [[1, 1, 1], [1, 70, 3]])
def test_torch_path_reads_no_device_value(lens):
    """On the meta device every read of a value raises: both torch ops run there, for a
    decode batch and a mixed one (only host seq_lens shape the work)."""
    meta = torch.device("meta")
    batch = make_state_batch(lens, [2, 0, 1], [True, False, True], meta)
    t = sum(lens)
    conv_state = torch.empty(3, CONV_DIM, KERNEL - 1, device=meta)
    x, weight = torch.empty(t, CONV_DIM, device=meta), torch.empty(CONV_DIM, KERNEL, device=meta)
    q, v = torch.empty(t, 2, DK, device=meta), torch.empty(t, 4, DV, device=meta)
    g, pool = torch.empty(t, 4, device=meta), torch.empty(3, 4, DK, DV, device=meta)
    with forced_backend("torch"):
        assert kernels.causal_conv1d(x, weight, None, conv_state, batch).shape == x.shape
        assert kernels.gated_delta_rule(q, q, v, g, g, pool, batch).shape == v.shape


class _Launches:
    """Stands in for a Triton kernel: records each launch's grid and arguments."""

    def __init__(self) -> None:
        self.grids: list[tuple] = []

    def __getitem__(self, grid: tuple):
        return lambda *args, **kw: self.grids.append(grid)


@pytest.mark.skipif(gated_delta_triton is None, reason="triton not installed")
def test_triton_launches_are_sized_by_host_ints(monkeypatch):
    """The launchers read no device value (their tensors are on the meta device) and a
    decode batch's grids follow its shapes alone: the recurrent kernel, one program per
    (sequence, value head, dv block); a mixed batch runs the chunked kernel."""
    launches = {n: _Launches() for n in ("_conv_kernel", "_recurrent_kernel", "_chunked_kernel")}
    for n, recorder in launches.items():
        monkeypatch.setattr(gated_delta_triton, n, recorder)
    meta = torch.device("meta")
    for lens in ([1, 1, 1], [1, 70, 3]):
        batch = make_state_batch(lens, [2, 0, 1], [True, False, True], meta)
        t = sum(lens)
        q, v = torch.empty(t, 2, DK, device=meta), torch.empty(t, 4, DV, device=meta)
        g, pool = torch.empty(t, 4, device=meta), torch.empty(3, 4, DK, DV, device=meta)
        gated_delta_triton.gated_delta_rule(q, q, v, g, g, pool, batch)
        x = torch.empty(t, CONV_DIM, device=meta)
        conv_state = torch.empty(3, CONV_DIM, KERNEL - 1, device=meta)
        weight = torch.empty(CONV_DIM, KERNEL, device=meta)
        gated_delta_triton.causal_conv1d(x, weight, None, conv_state, batch)
    assert launches["_recurrent_kernel"].grids == [(3, 4, 1)]  # DV 24: one 32-wide block
    assert launches["_chunked_kernel"].grids == [(3, 4, 1)]
    assert launches["_conv_kernel"].grids == [(3, 1, 1), (3, 5, 1)]  # 70 tokens: 5 of 16


def test_state_batch_and_op_arguments_are_checked():
    c = make_case(CASES["mixed"])
    args = (c.q, c.k, c.v, c.g, c.beta, c.recurrent_state)
    short = make_state_batch([1, 2], [0, 1], [True, True], TEST_DEVICE)
    with pytest.raises(ValueError, match="tokens"):
        kernels.gated_delta_rule(*args, short)
    with pytest.raises(ValueError, match="int32"):
        slots64 = StateBatch(**{**c.batch.__dict__, "state_slots": c.batch.state_slots.long()})
        kernels.gated_delta_rule(*args, slots64)
    with pytest.raises(ValueError, match="float32"):
        kernels.gated_delta_rule(*args[:5], c.recurrent_state.bfloat16(), c.batch)
    with pytest.raises(ValueError, match="multiple"):
        kernels.gated_delta_rule(c.q, c.k, c.v[:, :3], c.g[:, :3], c.beta[:, :3],
                                 c.recurrent_state[:, :3], c.batch)  # fmt: skip
    weight = torch.randn(CONV_DIM, KERNEL, device=TEST_DEVICE)
    with pytest.raises(ValueError, match="conv_state"):
        kernels.causal_conv1d(c.x, weight, None, c.conv_state[:, :, :2], c.batch)
    with pytest.raises(ValueError, match="activation"):
        kernels.causal_conv1d(c.x, weight, None, c.conv_state, c.batch, "gelu")
    with pytest.raises(ValueError, match=">= 1"):
        make_state_batch([3, 0], [0, 1], [False, False])
    with pytest.raises(ValueError, match="one of each"):
        make_state_batch([3, 1], [0], [False, False])
