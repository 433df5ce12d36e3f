"""Both multi-LoRA backends against kernels.reference on randomized segmented batches.

Triton runs compiled on a CUDA machine (the cases live on the GPU) and in its
interpreter elsewhere: tests/conftest.py sets TRITON_INTERPRET=1 where there is no
CUDA, before anything imports triton, and the first test checks which it is.
Every arena row that is not a used slot's rank rows (other adapters', free rows) is
NaN, so a kernel that reads past a rank or touches an unused slot fails loudly rather
than by a rounding error.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import random
import subprocess
import sys
import textwrap
import weakref
import zlib
from dataclasses import dataclass

import pytest
import torch

import kernels
from kernels import SegmentInfo, make_segment_info, parse_forced, sgmv_torch
from kernels.reference import lora_expand_reference, lora_shrink_reference
from tests.conftest import CUDA, TEST_DEVICE

try:
    from triton.runtime.interpreter import InterpretedFunction

    from kernels import sgmv_triton
    from tests.kernels.launches import recorded_launches
except ImportError:  # a platform without triton still tests the torch path
    sgmv_triton = None
needs_triton = pytest.mark.skipif(sgmv_triton is None, reason="triton is not installed")

BACKENDS = {"torch": sgmv_torch} | ({"triton": sgmv_triton} if sgmv_triton else {})
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# (rtol, atol) for expand's output, rounded once into y's dtype: about one ulp of
# y (|y| ~ 1). shrink's output is fp32 from exact products for every dtype.
EXPAND_TOL = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}
SHRINK_TOL = (1e-5, 1e-5)
R = 64  # max_lora_rank of the buffers; slot ranks are drawn from 8..64
IN = 72  # not a multiple of any K block
WIDTHS = {1: [40], 2: [40, 24], 3: [40, 16, 8]}  # uneven slices, like GQA qkv


@needs_triton
def test_triton_is_compiled_on_cuda_and_interpreted_elsewhere():
    assert isinstance(sgmv_triton._shrink_kernel, InterpretedFunction) is not CUDA
    assert isinstance(sgmv_triton._expand_kernel, InterpretedFunction) is not CUDA


@dataclass
class Case:
    x: torch.Tensor  # [T, IN]
    a: torch.Tensor  # [ns, P, IN]: the A arena
    b: torch.Tensor  # [out_total, P]: the B arena
    y: torch.Tensor  # [T, out_total]
    seg: SegmentInfo
    num_slices: int
    slice_offsets: list[int]
    base_rows: torch.Tensor  # [T] bool: rows no adapter touches


def draw_slots(popularity: str, n: int, num_slots: int, rnd: random.Random) -> list[int]:
    adapters = rnd.sample(range(1, num_slots), min(n, num_slots - 1))
    if popularity == "distinct":
        slots = adapters[:n]
    elif popularity == "uniform":
        slots = [rnd.choice(adapters) for _ in range(n)]
    elif popularity == "identical":
        slots = [adapters[0]] * n
    else:  # skewed: a zipf-like head
        slots = rnd.choices(adapters, weights=[1 / (k + 1) ** 2 for k in range(len(adapters))], k=n)
    # base-model requests interleaved with adapter ones
    return [0 if i % 3 == 1 else s for i, s in enumerate(slots)]


def draw_offsets(ranks: list[int], rnd: random.Random) -> tuple[list[int], int]:
    """Each adapter slot's first arena row and the arena's rows. Slots of one rank sit
    mostly side by side (the slot pool packs them so: the torch path's view runs), with
    gaps of whole places, of rows no slot owns, and off-grid ones (its gather runs)."""
    order = sorted(range(1, len(ranks)), key=lambda s: (ranks[s], rnd.random()))
    offsets, cursor = [0] * len(ranks), 0
    for s in order:
        cursor += rnd.choice([0, 0, 0, ranks[s], 3])
        offsets[s] = cursor
        cursor += ranks[s]
    return offsets, cursor + rnd.choice([0, 5])


def make_case(
    popularity: str,
    n: int,
    kind: str,
    dtype: torch.dtype,
    num_slices: int,
    seed: int,
    rank: int | None = None,  # every slot's rank (default: drawn from 8..64)
    scaling: float | None = None,  # every slot's scaling (default: drawn)
) -> Case:
    rnd = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    num_slots = 2 * n + 3  # room for unused slots between used ones
    slots = draw_slots(popularity, n, num_slots, rnd)
    lens = [1] * n if kind == "decode" else [rnd.choice([0, 1, 2, 5, 17, 33, 40]) for _ in range(n)]
    ranks = [0] + [rank or rnd.choice([8, 16, 32, 64]) for _ in range(num_slots - 1)]
    scalings = [0.0] + [scaling or rnd.uniform(0.25, 2.0) for _ in range(num_slots - 1)]
    offsets, arena_rows = draw_offsets(ranks, rnd)
    seg = make_segment_info(lens, slots, ranks, scalings, offsets, TEST_DEVICE)
    widths = WIDTHS[num_slices]
    cols = [0]
    for w in widths:
        cols.append(cols[-1] + w)
    used = {s for s, n_tok in zip(slots, lens) if s and n_tok}
    # NaN wherever no used slot's rank rows are: other adapters' rows, free rows
    a = torch.full((num_slices, arena_rows, IN), float("nan"))
    b = torch.full((cols[-1], arena_rows), float("nan"))
    for s in used:
        r, o = ranks[s], offsets[s]
        a[:, o : o + r] = torch.randn(num_slices, r, IN, generator=gen) / IN**0.5
        b[:, o : o + r] = torch.randn(cols[-1], r, generator=gen) / r**0.5
    tokens = sum(lens)
    base_rows = torch.ones(tokens, dtype=torch.bool)
    for g, s in enumerate(slots):
        if s:
            base_rows[seg.seg_indptr[g] : seg.seg_indptr[g + 1]] = False
    return Case(
        x=torch.randn(tokens, IN, generator=gen).to(TEST_DEVICE, dtype),
        a=a.to(TEST_DEVICE, dtype),
        b=b.to(TEST_DEVICE, dtype),
        y=torch.randn(tokens, cols[-1], generator=gen).to(TEST_DEVICE, dtype),
        seg=seg,
        num_slices=num_slices,
        slice_offsets=cols,
        base_rows=base_rows.to(TEST_DEVICE),
    )


def rank_major(case: Case) -> Case:
    """The same arenas laid out as the torch path allocates them (kernels.lora_a_buffer,
    lora_b_buffer): rank rows first."""
    a = case.a.permute(1, 0, 2).contiguous().permute(1, 0, 2)
    return dataclasses.replace(case, a=a, b=case.b.t().contiguous().t())


def check_backend(backend: str, case: Case) -> None:
    # slice rows contiguous (Triton's layout) and rank-major (the torch path's)
    _check_case(backend, case)
    _check_case(backend, rank_major(case))


def _check_case(backend: str, case: Case) -> None:
    ops = BACKENDS[backend]
    ref_inter = lora_shrink_reference(case.x, case.a, case.seg, R)
    inter = ops.lora_shrink(case.x, case.a, case.seg, R)
    assert inter.dtype == torch.float32 and inter.shape == ref_inter.shape
    torch.testing.assert_close(inter, ref_inter, rtol=SHRINK_TOL[0], atol=SHRINK_TOL[1])

    ref_y = lora_expand_reference(case.y.clone(), ref_inter, case.b, case.seg, case.slice_offsets)
    y = case.y.clone()
    out = ops.lora_expand(y, ref_inter, case.b, case.seg, case.slice_offsets)
    assert out.data_ptr() == y.data_ptr()  # in place
    rtol, atol = EXPAND_TOL[y.dtype]
    torch.testing.assert_close(y, ref_y, rtol=rtol, atol=atol)
    assert torch.equal(y[case.base_rows], case.y[case.base_rows])  # slot 0: untouched bits


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("kind", ["decode", "prefill"])
@pytest.mark.parametrize("n", [1, 3, 7, pytest.param(33, marks=pytest.mark.slow)])
@pytest.mark.parametrize("popularity", ["distinct", "uniform", "identical", "skewed"])
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_matches_reference(backend, popularity, n, kind, dtype):
    num_slices = 1 + (n + len(kind) + len(popularity)) % 3  # every count meets every axis
    seed = zlib.crc32(f"{popularity}-{n}-{kind}-{dtype}".encode())
    check_backend(backend, make_case(popularity, n, kind, dtype, num_slices, seed))


@needs_triton
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("num_slices", [1, 3])
@pytest.mark.parametrize("family", ["bgmv", "tiles"])
def test_triton_decode_through_both_kernel_families(monkeypatch, family, num_slices, dtype):
    """Decode batches take the BGMV kernels; the tile kernels must stay right for them too
    (a batch with any longer segment uses them)."""
    calls = []
    real = sgmv_triton._bgmv
    monkeypatch.setattr(
        sgmv_triton, "_bgmv", lambda seg: calls.append(1) or (family == "bgmv" and real(seg))
    )
    case = make_case("skewed", 12, "decode", dtype, num_slices, seed=21 + num_slices)
    assert case.seg.max_seg_len == 1 and real(case.seg)
    check_backend("triton", case)
    assert calls


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("popularity", ["distinct", "uniform", "skewed"])
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_graph_safe_decode_matches_reference(backend, popularity, dtype):
    """Decode batches whose metadata is read only on the device (the static decode path,
    replayed as CUDA graphs): the same results, with NaN in every byte a kernel must not
    read, other adapters' rows past each rank included (the per-token torch path masks
    them instead of reading them)."""
    seed = zlib.crc32(f"graph-{popularity}-{dtype}".encode())
    case = make_case(popularity, 9, "decode", dtype, 3, seed)
    case = dataclasses.replace(case, seg=dataclasses.replace(case.seg, graph_safe=True))
    check_backend(backend, case)


@needs_triton
def test_a_graph_safe_launch_reads_only_tensors_its_caller_holds(monkeypatch):
    """A CUDA graph keeps the addresses its launches read, so each must stay owned by the
    step's buffers for the graph's life. A decode expand's launches, then 70 expands of
    other slice layouts (past any cache of 64): every tensor the first launches read is
    still alive and where it was, and the same call reads the same addresses again."""
    case = make_case("uniform", 7, "decode", torch.float32, 3, seed=8)
    seg = dataclasses.replace(case.seg, graph_safe=True)
    inter = lora_shrink_reference(case.x, case.a, seg, R)
    kernels_ = (sgmv_triton._expand_bgmv_kernel, sgmv_triton._expand_kernel)
    y = case.y.clone()
    with kernels.forced_backend("triton"), recorded_launches(monkeypatch, *kernels_) as seen:
        kernels.lora_expand(y, inter, case.b, seg, case.slice_offsets)
        first = [dict(launch.args) for launch in seen]
        read = [
            (weakref.ref(t), t.data_ptr()) for args in first for t in args.values()
            if isinstance(t, torch.Tensor)
        ]  # fmt: skip
        del first
        seen.clear()
        other = make_case("identical", 1, "decode", torch.float32, 3, seed=1)
        for w in range(1, 71):  # 70 other slice layouts: [w, 1, 1] wide
            cols = [0, w, w + 1, w + 2]
            y_w = torch.zeros(other.x.shape[0], cols[-1], device=TEST_DEVICE)
            b_w = torch.zeros(cols[-1], other.b.shape[1], device=TEST_DEVICE)
            kernels.lora_expand(y_w, lora_shrink_reference(other.x, other.a, other.seg, R), b_w,
                                other.seg, cols)  # fmt: skip
        seen.clear()
        gc.collect()
        assert all(ref() is not None and ref().data_ptr() == ptr for ref, ptr in read)
        kernels.lora_expand(y, inter, case.b, seg, case.slice_offsets)
        again = [t.data_ptr() for t in seen[0].args.values() if isinstance(t, torch.Tensor)]
    assert again == [ptr for _, ptr in read]
    held = (y, inter, case.b, seg.seg_indptr, seg.seg_slots, seg.slot_ranks,
            seg.slot_scalings, seg.slot_offsets)  # fmt: skip
    assert set(again) == {t.data_ptr() for t in held}  # nothing but the caller's tensors


@pytest.mark.parametrize("graph_safe", [False, True])
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_shrink_writes_into_a_region_of_the_steps_workspace(backend, graph_safe):
    """One zeroed LoRA intermediate per step: each projection's shrink fills its own
    columns of it (a view with the workspace's row stride) and nothing else."""
    case = make_case("uniform", 7, "decode", torch.float32, 2, seed=5)
    case = dataclasses.replace(case, seg=dataclasses.replace(case.seg, graph_safe=graph_safe))
    width = case.num_slices * R
    for layout in (case, rank_major(case)):
        workspace = torch.zeros(case.x.shape[0], 3 * width, device=TEST_DEVICE)
        region = workspace[:, width : 2 * width]
        got = BACKENDS[backend].lora_shrink(case.x, layout.a, case.seg, R, out=region)
        assert got.data_ptr() == region.data_ptr()
        want = lora_shrink_reference(case.x, case.a, case.seg, R)
        torch.testing.assert_close(region, want, rtol=SHRINK_TOL[0], atol=SHRINK_TOL[1])
        assert not workspace[:, :width].any() and not workspace[:, 2 * width :].any()


@pytest.mark.parametrize("num_slices", [1, 2, 3])
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_slices_with_mixed_batch(backend, num_slices):
    """A prefill segment next to decode tokens and empty segments, all slices."""
    check_backend(backend, make_case("uniform", 9, "prefill", torch.float32, num_slices, seed=7))


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_no_adapter_leaves_y_bit_identical(backend, dtype):
    dev = TEST_DEVICE
    seg = make_segment_info([3, 0, 5], [0, 2, 0], [0, 16, 8], [0.0, 1.0, 2.0], [0, 0, 16], dev)
    assert not seg.has_lora  # slot 2's segment is empty
    x, y = torch.randn(8, IN).to(dev, dtype), torch.randn(8, 40).to(dev, dtype)
    a = torch.full((1, 24, IN), float("nan"), dtype=dtype, device=dev)
    b = torch.randn(40, 24).to(dev, dtype)
    ops = BACKENDS[backend]
    inter = ops.lora_shrink(x, a, seg, R)
    assert torch.equal(inter, torch.zeros(8, R, device=dev))
    y0 = y.clone()
    ops.lora_expand(y, inter, b, seg, [0, 40])
    assert torch.equal(y, y0)


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_empty_batch(backend):
    ops = BACKENDS[backend]
    dev = TEST_DEVICE
    seg = make_segment_info([], [], [0, 8], [0.0, 1.0], [0, 0], dev)
    a = torch.zeros(1, 8, IN, device=dev)
    inter = ops.lora_shrink(torch.zeros(0, IN, device=dev), a, seg, R)
    assert inter.shape == (0, R)
    y = torch.zeros(0, 40, device=dev)
    assert ops.lora_expand(y, inter, torch.zeros(40, 8, device=dev), seg, [0, 40]) is y


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_shared_scaling_runs(backend):
    """Adapters of one rank and scaling: the torch path's alpha route, no per-row scale."""
    case = make_case("uniform", 7, "decode", torch.float32, 2, seed=9, rank=16, scaling=0.75)
    check_backend(backend, case)


def test_torch_plan_follows_refilled_metadata():
    """The torch path memoizes plans by metadata values: buffers the engine refills
    in place must give the new batch's answer, never a stale plan."""
    case = make_case("distinct", 7, "decode", torch.float32, 1, seed=3)
    check_backend("torch", case)
    case.seg.seg_slots.copy_(case.seg.seg_slots.flip(0))
    case.base_rows = case.base_rows.flip(0)
    check_backend("torch", case)


def test_torch_runs_view_same_rank_neighbours_and_bridge_small_gaps_only():
    """Rank-16 slots packed side by side: slots 1, 4, 5 share one view run (the two
    unused places between are cheap at this width); a slot far away gets its own run,
    so its unused neighbours are never read. Slots every other block are one view of
    stride 32, with no unused place at all."""
    ranks, scalings = (0,) + (16,) * 40, (0.0,) + (1.0,) * 40
    offsets = (0,) + tuple(16 * i for i in range(40))  # slot s at row 16*(s-1)
    indptr, slots, cpu = (0, 1, 2, 3, 4), (5, 1, 4, 40), torch.device("cpu")
    narrow = sgmv_torch._runs(indptr, slots, ranks, scalings, offsets, 640, 512 * 4, cpu)
    assert [(r.row0, r.k, r.stride) for r in narrow] == [(0, 5, 16), (624, 1, 16)]
    wide = sgmv_torch._runs(indptr, slots, ranks, scalings, offsets, 640, 4 * 4096 * 4, cpu)
    # wide rows: the places between cost too much; 1 and 4 are a view of stride 48
    assert [(r.row0, r.k, r.stride) for r in wide] == [(0, 2, 48), (64, 2, 560)]
    spaced = sgmv_torch._runs((0, 1, 2, 3), (1, 3, 5), ranks, scalings, offsets, 640,
                              4 * 4096 * 4, cpu)  # fmt: skip
    assert [(r.row0, r.k, r.stride) for r in spaced] == [(0, 3, 32)]


def test_torch_runs_keep_ranks_apart_and_stride_over_larger_blocks():
    """Slots of ranks 8, 64, 16 side by side are three runs (past a rank lie another
    adapter's rows, not zeros); rank-12 slots in 16-row blocks are one view of stride
    16; same-rank slots closer than their rank are not a view."""
    cpu, wide = torch.device("cpu"), 512 * 4
    mixed = sgmv_torch._runs((0, 1, 2, 3), (1, 2, 3), (0, 8, 64, 16), (0.0, 1.0, 1.0, 1.0),
                             (0, 0, 8, 72), 88, wide, cpu)  # fmt: skip
    assert sorted((r.row0, r.k, r.rank) for r in mixed) == [(0, 1, 8), (8, 1, 64), (72, 1, 16)]
    blocks = sgmv_torch._runs((0, 1, 2, 3), (1, 2, 3), (0, 12, 12, 12), (0.0, 1.0, 1.0, 1.0),
                              (0, 0, 16, 48), 64, wide, cpu)  # fmt: skip
    assert [(r.row0, r.k, r.stride, r.rank) for r in blocks] == [(0, 4, 16, 12)]
    close = sgmv_torch._runs((0, 1, 2), (1, 2), (0, 8, 8), (0.0, 1.0, 1.0), (0, 0, 4),
                             12, wide, cpu)  # fmt: skip
    assert [(r.row0, r.k) for r in close] == [(0, 1), (4, 1)]


def test_dispatch():
    x = torch.zeros(1, 4)
    with kernels.forced_backend(None):
        assert kernels.backend_for(x) == "torch"
        with kernels.forced_backend("triton"):
            assert kernels.backend_for(x) == "triton"
        assert kernels.backend_for(x) == "torch"
    assert parse_forced(" Triton ") == "triton" and parse_forced("") is None
    with pytest.raises(ValueError, match="LORAFLEET_KERNELS"):
        parse_forced("cuda")
    with pytest.raises(ValueError, match="LORAFLEET_KERNELS"):
        kernels.force_backend("cuda")


def test_the_environment_is_read_once_at_import():
    """LORAFLEET_KERNELS decides the backend without a read per op."""
    code = (
        "import os; os.environ['LORAFLEET_KERNELS'] = 'triton'; import torch, kernels; "
        "os.environ['LORAFLEET_KERNELS'] = 'torch'; print(kernels.backend_for(torch.zeros(1)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "triton", out.stderr


@pytest.mark.parametrize("forced", list(BACKENDS))
def test_public_ops_dispatch_and_match(forced):
    with kernels.forced_backend(forced):
        _check_public_ops()


def _check_public_ops():
    case = make_case("skewed", 7, "prefill", torch.bfloat16, 3, seed=11)
    inter = kernels.lora_shrink(case.x, case.a, case.seg, R)
    ref_inter = lora_shrink_reference(case.x, case.a, case.seg, R)
    torch.testing.assert_close(inter, ref_inter, rtol=SHRINK_TOL[0], atol=SHRINK_TOL[1])
    y = kernels.lora_expand(case.y.clone(), inter, case.b, case.seg, case.slice_offsets)
    ref_y = lora_expand_reference(case.y.clone(), ref_inter, case.b, case.seg, case.slice_offsets)
    torch.testing.assert_close(y, ref_y, rtol=1.6e-2, atol=1.6e-2)


def test_public_ops_validate_before_launch():
    case = make_case("distinct", 3, "decode", torch.float32, 2, seed=5)
    x, a, b, seg = case.x, case.a, case.b, case.seg
    inter = kernels.lora_shrink(x, a, seg, R)
    with pytest.raises(ValueError, match="share one of"):
        kernels.lora_shrink(x.half(), a, seg, R)
    with pytest.raises(ValueError, match="max_rank"):
        kernels.lora_shrink(x, a, seg, 0)
    with pytest.raises(ValueError, match="out"):
        kernels.lora_shrink(x, a, seg, R, out=torch.zeros(x.shape[0], R, device=x.device))
    with pytest.raises(ValueError, match=r"\[num_slices, P, in\]"):
        kernels.lora_shrink(x, a[0], seg, R)
    with pytest.raises(ValueError, match="fp32"):
        kernels.lora_expand(case.y, inter.half(), b, seg, case.slice_offsets)
    with pytest.raises(ValueError, match="slice_offsets"):
        kernels.lora_expand(case.y, inter, b, seg, [0, 40, 30])
    with pytest.raises(ValueError, match="inter"):
        kernels.lora_expand(case.y, inter[:-1], b, seg, case.slice_offsets)
    with pytest.raises(ValueError, match=r"\[out, P\]|\[64, P\]"):
        kernels.lora_expand(case.y, inter, b[:-1], seg, case.slice_offsets)
    bad = make_segment_info([1, 1, 1], [1, 0, 2], [0, 8, 8], [0.0, 1.0, 1.0], [0, 0], TEST_DEVICE)
    with pytest.raises(ValueError, match="one entry per slot"):
        kernels.lora_shrink(x, a, bad, R)


def test_torch_path_rejects_rows_past_the_arena():
    seg = make_segment_info([2], [1], [0, 32], [0.0, 1.0], [0, 8])
    with pytest.raises(ValueError, match=r"rows \[8, 40\) outside the arena's 16 rows"):
        sgmv_torch.lora_shrink(torch.zeros(2, IN), torch.zeros(1, 16, IN), seg, R)


@needs_triton
def test_triton_on_cpu_without_interpreter_is_refused():
    """Outside the interpreter, CPU tensors forced onto triton get a clear error."""
    code = textwrap.dedent(
        """
        import os, torch
        os.environ.pop("TRITON_INTERPRET", None)
        os.environ["LORAFLEET_KERNELS"] = "triton"
        import kernels
        seg = kernels.make_segment_info([1], [1], [0, 8], [0.0, 1.0], [0, 0])
        try:
            kernels.lora_shrink(torch.zeros(1, 16), torch.zeros(1, 8, 16), seg, 8)
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
def test_triton_kernels_compile_for_cuda(tmp_path):
    """No GPU here: lower both kernels to sm_90 cubins (ptxas ships with triton) for
    each dtype and both tile configurations, to catch what the interpreter can't."""
    code = textwrap.dedent(
        """
        import sys, torch
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource, compile
        from kernels import sgmv_triton as st

        target = GPUTarget("cuda", 90, 32)
        ptr = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16"}

        def build(fn, ptrs, cfg):
            cfg = dict(cfg)
            opts = {"num_warps": cfg.pop("num_warps")}
            sig = {n: "constexpr" if n in cfg else ptrs.get(n, "i32") for n in fn.arg_names}
            kernel = compile(ASTSource(fn, sig, constexprs=cfg), target=target, options=opts)
            assert "mma" in kernel.asm["ptx"] or "fma" in kernel.asm["ptx"], fn.__name__

        for dtype, p in ptr.items():
            for seg_len in (1, 512):
                ints = {"indptr_ptr": "*i32", "seg_slots_ptr": "*i32", "ranks_ptr": "*i32",
                        "offsets_ptr": "*i32"}
                shrink = ints | {"x_ptr": p, "a_ptr": p, "out_ptr": "*fp32"}
                build(st._shrink_kernel, shrink, st.shrink_config(seg_len, 4096, 64, dtype))
                expand = ints | {"inter_ptr": "*fp32", "b_ptr": p, "y_ptr": p,
                                 "scalings_ptr": "*fp32"}
                build(st._expand_kernel, expand, st.expand_config(seg_len, dtype))
            for r in (16, 64):  # the decode (BGMV) kernels
                build(st._shrink_bgmv_kernel, shrink, st.shrink_bgmv_config(4096, r))
                build(st._expand_bgmv_kernel, expand, st.expand_bgmv_config(r))
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=300)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embedding_shrink_matches_reference(dtype):
    """Embedding LoRA's shrink (a gather of A's columns by token id) over ragged segments,
    slot 0 interleaved, ranks 8/16/32 at their own arena offsets; NaN in every arena row
    no adapter of the batch owns, so a read past a rank would show."""
    from kernels import lora_embedding_shrink, make_segment_info
    from kernels.reference import lora_embedding_shrink_reference

    g = torch.Generator().manual_seed(5)
    vocab, rows, r_max = 50, 96, 32
    a = torch.full((1, rows, vocab), float("nan"), dtype=dtype)
    ranks, offsets = [0, 16, 8, 32], [0, 0, 32, 64]
    for s in (1, 2, 3):
        a[0, offsets[s] : offsets[s] + ranks[s]] = torch.randn(ranks[s], vocab, generator=g)
    lens, slots = [3, 0, 5, 1, 4], [1, 2, 0, 3, 2]
    seg = make_segment_info(lens, slots, ranks, [1.0, 0.5, 2.0, 1.0], offsets)
    ids = torch.randint(0, vocab, (sum(lens),), generator=g)
    got = lora_embedding_shrink(ids, a, seg, r_max)
    want = lora_embedding_shrink_reference(ids, a, seg, r_max)
    assert got.dtype == torch.float32 and got.shape == (sum(lens), r_max)
    assert torch.equal(got, want)
    assert not got.isnan().any()
    with pytest.raises(ValueError, match="lora_embedding_shrink"):
        lora_embedding_shrink(ids.int(), a, seg, r_max)
