"""Mixture-of-experts kernels against kernels.moe_reference: the grouped GEMM (torch eager,
torch graph-safe, Triton) and expert LoRA (lora_shrink / lora_expand over the plan's
(adapter, expert) groups), over expert loads that leave experts empty, pile onto one,
or spread evenly.

Weights of experts no token routes to, and every expert-arena row outside a used
(adapter, expert) block's rank rows, are NaN: a kernel that reads them fails loudly.
Triton runs in its interpreter on CPU (tests/conftest.py sets TRITON_INTERPRET=1).
"""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels import forced_backend, make_expert_plan, make_segment_infos
from kernels.moe_reference import expert_lora_reference, moe_grouped_gemm_reference
from tests.conftest import TEST_DEVICE

try:
    from kernels import moe_triton  # noqa: F401

    BACKENDS = ["torch", "triton"]
except ImportError:  # a platform without triton still tests the torch path
    BACKENDS = ["torch"]

E, K_TOP, H, INTER = 6, 2, 40, 24  # not multiples of any block
LOADS = ["empty", "skewed", "uniform"]


def topk_ids(load: str, t: int, gen: torch.Generator) -> torch.Tensor:
    """[t, K_TOP] distinct experts per token: experts 4 and 5 unused ("empty"), most
    tokens on expert 0 ("skewed"), a random permutation each ("uniform")."""
    rows = []
    for i in range(t):
        if load == "empty":
            rows.append(torch.randperm(4, generator=gen)[:K_TOP])
        elif load == "skewed":
            other = 1 + int(torch.randint(0, E - 1, (1,), generator=gen)) if i % 5 == 4 else 1
            rows.append(torch.tensor([0, other]))
        else:
            rows.append(torch.randperm(E, generator=gen)[:K_TOP])
    return torch.stack(rows).to(TEST_DEVICE)


def segments(lens: list[int], slots: list[int], ranks: list[int], graph_safe: bool = False):
    scalings = [0.0] + [0.5 + 0.25 * s for s in range(1, len(ranks))]
    offsets = [0] + [16 * (s - 1) for s in range(1, len(ranks))]  # 16-row blocks
    seg = make_segment_infos(lens, slots, {"g": ranks}, scalings, {"g": offsets}, TEST_DEVICE)["g"]
    if graph_safe:
        seg = type(seg)(**{**seg.__dict__, "graph_safe": True})
    return seg


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("load", LOADS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_gemm_matches_reference(name, load, dtype):
    gen = torch.Generator().manual_seed(LOADS.index(load))
    t = 13
    ids = topk_ids(load, t, gen)
    plan = make_expert_plan(ids, E)
    assert plan.expert_indptr.tolist()[-1] == t * K_TOP
    assert (plan.experts.diff() >= 0).all() and (plan.tokens == plan.order // K_TOP).all()
    x = torch.randn(t * K_TOP, H, generator=gen).to(TEST_DEVICE, dtype)
    w = torch.randn(E, INTER, H, generator=gen).to(TEST_DEVICE, dtype)
    used = set(ids.flatten().tolist())
    w[[e for e in range(E) if e not in used]] = float("nan")
    want = moe_grouped_gemm_reference(x, w, plan.expert_indptr)
    with forced_backend(name):
        got = kernels.moe_grouped_gemm(x, w, plan)
    tol = 1e-5 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("load", LOADS)
def test_graph_safe_torch_path_equals_eager_and_reads_no_device_value(load):
    from torch.utils._python_dispatch import TorchDispatchMode

    gen = torch.Generator().manual_seed(11)
    t = 7
    ids = topk_ids(load, t, gen).cpu()
    seg = segments([1] * t, [0] * t, [0, 8], graph_safe=True)
    x = torch.randn(t * K_TOP, H, generator=gen)
    w = torch.randn(E, INTER, H, generator=gen)
    reads = []

    class ScalarReads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if str(func.overloadpacket) in ("aten._local_scalar_dense", "aten.item"):
                reads.append(str(func))
            return func(*args, **(kwargs or {}))

    with ScalarReads(), forced_backend("torch"):
        plan = make_expert_plan(ids, E, seg)
        got = kernels.moe_grouped_gemm(x, w, plan)
    assert plan.graph_safe and not reads, reads[:3]
    want = moe_grouped_gemm_reference(x, w, plan.expert_indptr)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("load", LOADS)
@pytest.mark.parametrize("mode", ["prefill", "decode", "graph-safe"])
def test_expert_lora_matches_reference(name, load, mode):
    """gate/up-like (2 slices) expert LoRA of three adapters (ranks 8, 16, 4) and the base,
    in segments of mixed lengths, of one token each (decode: the torch path's per-pair
    gather), and graph-safe (one token each, no device read)."""
    gen = torch.Generator().manual_seed(21 + LOADS.index(load))
    lens = [3, 1, 5, 2, 4] if mode == "prefill" else [1] * 6
    slots = [1, 0, 2, 3, 1, 2][: len(lens)]
    ranks = [0, 8, 16, 4]
    seg = segments(lens, slots, ranks, mode == "graph-safe")
    t = sum(lens)
    ids = topk_ids(load, t, gen)
    plan = make_expert_plan(ids, E, seg)
    rows = 16 * 3  # rows per expert: three 16-row blocks
    slice_offsets = [0, INTER, 2 * INTER]
    a = torch.full((2, E * rows, H), float("nan"))
    b = torch.full((2 * INTER, E * rows), float("nan"))
    token_slot = torch.repeat_interleave(torch.tensor(slots), torch.tensor(lens))
    for tok in range(t):
        s = int(token_slot[tok])
        for e in ids[tok].tolist() if s else ():
            o = 16 * (s - 1) + e * rows
            a[:, o : o + ranks[s]] = torch.randn(2, ranks[s], H, generator=gen)
            b[:, o : o + ranks[s]] = torch.randn(2 * INTER, ranks[s], generator=gen)
    a, b = a.to(TEST_DEVICE), b.to(TEST_DEVICE)
    x = torch.randn(t * K_TOP, H, generator=gen).to(TEST_DEVICE)
    y0 = torch.randn(t * K_TOP, 2 * INTER, generator=gen).to(TEST_DEVICE)
    pair_slots = token_slot.to(TEST_DEVICE).index_select(0, plan.tokens)
    want = y0 + expert_lora_reference(
        x, a, b, pair_slots, plan.experts, seg.slot_ranks, seg.slot_scalings,
        seg.slot_offsets, rows, slice_offsets,
    )  # fmt: skip
    with forced_backend(name):
        inter = kernels.expert_lora_shrink(x, a, plan, seg, 16)
        got = kernels.expert_lora_expand(y0.clone(), inter, b, plan, seg, slice_offsets)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
