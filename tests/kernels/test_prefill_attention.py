"""Prefill attention: both backends against kernels.attention_reference, the
reference against dense oracles (SDPA's MATH with an explicit mask; Gemma 2's eager
soft-capped attention by hand), and the torch path held to fused SDPA kernels and
bounded intermediates.

Cases: a whole prompt over its fresh K/V (a strided [KVH, n, hd] view of [n, KVH, hd]
rows, as the model passes it), and a chunk or prefix-cache hit over the paged cache
through slots (lower-right causal), the cache's blocks shuffled. Every slot no row may
see is NaN (positions before the first row's window, spare blocks), so a read of one
fails loudly. Triton runs in its interpreter here (tests/conftest.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode

import kernels
from kernels import attention_torch
from kernels.attention_reference import prefill_attention_reference
from tests.conftest import CUDA, TEST_DEVICE
from tests.kernels.prefill_cases import HD, NAN, TOL, Case, make_case

try:
    from kernels import attention_triton
except ImportError:  # a platform without triton still tests the torch path
    attention_triton = None
needs_triton = pytest.mark.skipif(attention_triton is None, reason="triton not installed")

FUSED = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
HEADS = {"gqa4": (8, 2), "mqa": (8, 1), "mha": (4, 4)}


def dense_oracle(case: Case) -> torch.Tensor:  # [n, H, hd] fp32
    """The prefill as one masked attention over contiguous K/V: SDPA's MATH for uncapped
    scores, Gemma 2's eager recipe by hand (scale, cap * tanh(s / cap), additive mask,
    fp32 softmax) for capped ones."""
    n, h, _ = case.q.shape
    ctx, kvh = case.keys.shape[1], case.keys.shape[0]
    k = case.keys.to(TEST_DEVICE).repeat_interleave(h // kvh, 0)  # [H, ctx, hd]
    v = case.values.to(TEST_DEVICE).repeat_interleave(h // kvh, 0)
    t = torch.arange(ctx - n, ctx, device=TEST_DEVICE)[:, None]
    p = torch.arange(ctx, device=TEST_DEVICE)[None, :]
    mask = p <= t
    if case.window is not None:
        mask &= p > t - case.window
    qh = case.q.float().transpose(0, 1)  # [H, n, hd]
    if case.soft_cap is None:
        with sdpa_kernel([SDPBackend.MATH]):
            o = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, scale=case.scale)
    else:
        scores = torch.tanh(qh @ k.transpose(1, 2) * case.scale / case.soft_cap) * case.soft_cap
        scores = scores + torch.zeros(n, ctx, device=TEST_DEVICE).masked_fill(~mask, -torch.inf)
        o = scores.softmax(-1) @ v
    return o.transpose(0, 1)


BACKENDS = {"torch": attention_torch.prefill_attention}
if attention_triton is not None:

    def _triton(q, k, v, scale, slots=None, sliding_window=None, soft_cap=None, out=None):
        out = torch.empty_like(q) if out is None else out
        return attention_triton.prefill_attention_kernel(
            q, k, v, scale, slots, sliding_window, soft_cap, out
        )

    BACKENDS["triton"] = _triton


def check(backend: str, case: Case) -> torch.Tensor:
    out = BACKENDS[backend](*case.args())
    ref = prefill_attention_reference(*case.args())
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    assert torch.isfinite(ref).all() and torch.isfinite(out).all()
    rtol, atol = TOL[case.q.dtype]
    torch.testing.assert_close(out, ref, rtol=rtol, atol=atol)
    return out


# (n, ctx): one token; whole prompts (ctx == n); chunks and prefix hits (ctx > n), at and
# around the 4-blocks and the kernels' tiles
SHAPES = [(1, 1), (5, 5), (37, 37), (70, 70), (1, 9), (16, 40), (17, 64), (37, 100), (64, 65)]
SHAPE_IDS = [f"{n}of{c}" for n, c in SHAPES]


@pytest.mark.parametrize("cap", [None, 2.0])
@pytest.mark.parametrize("window", [None, 1, 7, 1000])
@pytest.mark.parametrize("shape", [(9, 9), (16, 40)], ids=["9of9", "16of40"])
def test_prefill_reference_matches_dense_oracle(shape, window, cap):
    case = make_case(*shape, (8, 2), window=window, soft_cap=cap, seed=1)
    ref = prefill_attention_reference(*case.args())
    torch.testing.assert_close(ref.float(), dense_oracle(case), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_prefill_matches_reference(backend, shape):
    check(backend, make_case(*shape, seed=shape[0]))


@pytest.mark.parametrize("heads", list(HEADS.values()), ids=list(HEADS))
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_prefill_heads(backend, heads):
    check(backend, make_case(37, 37, heads, seed=2))
    check(backend, make_case(16, 40, heads, seed=3))


@pytest.mark.parametrize("window", [1, 5, 17, 1000])
@pytest.mark.parametrize("shape", [(37, 37), (16, 40), (1, 40)], ids=["37of37", "16of40", "1of40"])
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_prefill_sliding_window(backend, shape, window):
    check(backend, make_case(*shape, window=window, seed=window))


@pytest.mark.parametrize("cap", [0.5, 3.0])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("shape", [(37, 37), (16, 40)], ids=["37of37", "16of40"])
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_prefill_soft_cap(backend, shape, window, cap):
    case = make_case(*shape, window=window, soft_cap=cap, seed=4)
    out = check(backend, case)
    uncapped = prefill_attention_reference(*case.args()[:-1])
    assert (out - uncapped).abs().max() > 0.05  # the cap is not a no-op on this data


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_prefill_half_precision(backend, dtype):
    check(backend, make_case(37, 37, dtype=dtype, window=9, seed=5))
    check(backend, make_case(16, 40, dtype=dtype, soft_cap=1.5, seed=6))


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_prefill_whole_prompt_from_the_cache(backend):
    """ctx == n read through slots (a whole prompt the caller chose to read back)."""
    check(backend, make_case(20, 20, paged=True, seed=7))
    check(backend, make_case(20, 20, paged=True, window=6, soft_cap=2.0, seed=8))


@needs_triton
@pytest.mark.parametrize(
    "window, cap", [(None, None), (21, None), (None, 2.0), (9, 1.5)],
    ids=["plain", "window", "cap", "window-cap"],
)  # fmt: skip
def test_prefill_triton_many_programs_and_tiles(monkeypatch, window, cap):
    """16-row programs over 16-position tiles: up to 7 programs and 7 tiles each, rows
    that meet tiles before their window opens, a last program with rows past n; head
    dim 24 (not a power of two)."""
    real = attention_triton.prefill_config
    monkeypatch.setattr(
        attention_triton, "prefill_config",
        lambda *a: real(*a) | {"BLOCK_M": 16, "BLOCK_N": 16},
    )  # fmt: skip
    case = make_case(100, 100, (4, 2), window=window, soft_cap=cap, seed=9, hd=24)
    case.q.mul_(3.0)  # scores of several units: a missed rescale or cap shows
    check("triton", case)
    check("triton", make_case(45, 110, (4, 2), window=window, soft_cap=cap, seed=10, hd=24))


def test_prefill_torch_chunks_agree(monkeypatch):
    """Query chunks of 16 rows (CHUNK_BYTES small) give the one-chunk result, also for a
    chunk after earlier positions on a torch without the flash-with-LSE op."""
    monkeypatch.setattr(attention_torch, "FLASH_CPU_WITH_LSE", None)
    cases = [
        make_case(70, 70, window=9, seed=11),
        make_case(37, 100, seed=12),
        make_case(37, 100, window=20, soft_cap=2.0, seed=13),
    ]
    whole = [attention_torch.prefill_attention(*c.args()) for c in cases]
    monkeypatch.setattr(attention_torch, "CHUNK_BYTES", 1)
    for c, want in zip(cases, whole):
        got = attention_torch.prefill_attention(*c.args())
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "shape, window", [((64, 64), None), ((32, 96), None), ((64, 64), 9), ((32, 96), 9)],
    ids=["whole", "chunk", "whole-window", "chunk-window"],
)  # fmt: skip
@pytest.mark.parametrize("heads", [(8, 2), (4, 4)], ids=["gqa4", "mha"])
@pytest.mark.parametrize("lse_op", [True, False], ids=["lse-op", "no-lse-op"])
def test_prefill_torch_runs_on_fused_sdpa_only(monkeypatch, lse_op, shape, window, heads):
    """Every uncapped path of the torch backend runs with SDPA's MATH backend disabled:
    4-D inputs and enable_gqa, masks included, reach a fused kernel (on the CPU, flash),
    with or without the op that returns flash's log-sum-exp."""
    if not lse_op:
        monkeypatch.setattr(attention_torch, "FLASH_CPU_WITH_LSE", None)
    case = make_case(*shape, heads, window=window, seed=14)
    with sdpa_kernel(FUSED):
        out = attention_torch.prefill_attention(*case.args())
    torch.testing.assert_close(out, prefill_attention_reference(*case.args()))


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor any op produces (elements)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_prefill_torch_chunk_takes_flash_with_lse_where_torch_has_it(monkeypatch):
    """A plain chunk after earlier positions is the two flash calls, on every dtype."""
    if attention_torch.FLASH_CPU_WITH_LSE is None or CUDA:
        pytest.skip("this torch has no CPU flash op returning its log-sum-exp")
    calls = []
    real = attention_torch.FLASH_CPU_WITH_LSE
    monkeypatch.setattr(
        attention_torch, "FLASH_CPU_WITH_LSE",
        lambda *a, **kw: calls.append(kw.get("is_causal", False)) or real(*a, **kw),
    )  # fmt: skip
    for dtype in TOL:
        check("torch", make_case(37, 100, dtype=dtype, seed=20))
    assert calls == [False, True] * len(TOL)


@pytest.mark.parametrize("cap", [None, 2.0])
@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("shape", [(256, 256), (128, 320)], ids=["whole", "chunk"])
def test_prefill_torch_holds_no_score_matrix(monkeypatch, shape, window, cap):
    """No op of the torch backend makes a tensor a quarter the size of the [H, n, ctx]
    scores (SDPA's MATH would make several), with chunks of 16 rows for soft-capped
    attention: the fused kernels keep their blocks to themselves."""
    monkeypatch.setattr(attention_torch, "CHUNK_BYTES", 16 * 8 * 320 * 4)
    n, ctx = shape
    case = make_case(n, ctx, (8, 2), window=window, soft_cap=cap, seed=15)
    with LargestTensor() as seen:
        out = attention_torch.prefill_attention(*case.args())
    assert seen.largest < 8 * n * ctx // 4, seen.largest
    torch.testing.assert_close(out, prefill_attention_reference(*case.args()))


def test_prefill_public_op_dispatches_and_writes_out():
    case = make_case(16, 40, window=9, soft_cap=2.0, seed=16)
    ref = prefill_attention_reference(*case.args())
    for backend in BACKENDS:
        big = torch.full((20, 8, HD), NAN, device=TEST_DEVICE)
        with kernels.forced_backend(backend):
            got = kernels.prefill_attention(*case.args(), out=big[2:18])
        assert got.data_ptr() == big[2:18].data_ptr()
        torch.testing.assert_close(big[2:18], ref)
        assert big[:2].isnan().all() and big[18:].isnan().all()


def test_prefill_public_op_reads_no_device_value():
    """On meta tensors any host read of a value raises: the checks and the torch path run."""
    case = make_case(16, 40, window=9, seed=17)
    args = [a.to("meta") if isinstance(a, torch.Tensor) else a for a in case.args()]
    with kernels.forced_backend("torch"):
        out = kernels.prefill_attention(*args)
    assert out.device.type == "meta" and out.shape == case.q.shape


def test_prefill_public_op_validates_arguments():
    case = make_case(16, 40, seed=18)
    q, k, v, scale, slots = case.q, case.k, case.v, case.scale, case.slots
    op = kernels.prefill_attention
    with pytest.raises(ValueError, match=r"\[n, H, hd\]"):
        op(q[0], k, v, scale, slots)
    with pytest.raises(ValueError, match="one \\[KVH, S, hd\\] shape"):
        op(q, k, v[:, :8], scale, slots)
    with pytest.raises(ValueError, match="H % KVH"):
        op(q[:, :7], k, v, scale, slots)
    with pytest.raises(ValueError, match="share one of"):
        op(q.half(), k, v, scale, slots)
    with pytest.raises(ValueError, match="int64"):
        op(q, k, v, scale, slots.int())
    with pytest.raises(ValueError, match="only 10 positions"):
        op(q, k, v, scale, slots[:10])
    with pytest.raises(ValueError, match="sliding_window"):
        op(q, k, v, scale, slots, 0)
    with pytest.raises(ValueError, match="soft_cap"):
        op(q, k, v, scale, slots, None, -1.0)
    with pytest.raises(ValueError, match="out"):
        op(q, k, v, scale, slots, out=q[:3].clone())
    other = "meta" if not CUDA else "cpu"
    with pytest.raises(ValueError, match="one device"):
        op(q, k, v, scale, slots.to(other))


@needs_triton
def test_prefill_triton_backend_routes_by_case(monkeypatch):
    """The CUDA backend sends plain causal attention to SDPA's flash kernel when flash
    takes the inputs, everything else (window, cap, or flash refusing) to Triton."""
    calls = []
    monkeypatch.setattr(attention_triton, "_flash", lambda *a: calls.append("flash"))
    real = attention_triton.prefill_attention_kernel
    monkeypatch.setattr(
        attention_triton, "prefill_attention_kernel",
        lambda *a: calls.append("triton") or real(*a),
    )  # fmt: skip
    op = attention_triton.prefill_attention
    for flash in (True, False):
        monkeypatch.setattr(attention_triton, "flash_applies", lambda q, k, f=flash: f)
        op(*make_case(16, 40, seed=19).args())
        op(*make_case(16, 16, seed=19).args())
        op(*make_case(16, 40, window=1000, seed=19).args())  # a window past everything
        op(*make_case(16, 40, window=5, seed=19).args())
        op(*make_case(16, 40, soft_cap=2.0, seed=19).args())
    assert calls == ["flash"] * 3 + ["triton"] * 2 + ["triton"] * 5


@needs_triton
def test_prefill_triton_flash_is_asked_only_on_cuda():
    case = make_case(16, 16, dtype=torch.bfloat16)
    qh, kh = case.q.transpose(0, 1).unsqueeze(0), case.k.unsqueeze(0)
    assert attention_triton.flash_applies(qh, kh) is CUDA


@needs_triton
@pytest.mark.slow
def test_prefill_triton_kernel_compiles_for_cuda(tmp_path):
    """No GPU here: lower the prefill kernel to sm_90 cubins for each dtype, with and
    without slots, cap and sinks, at head dims 64, 128 and 256 (Gemma 2's, in bf16)."""
    code = textwrap.dedent(
        """
        import torch
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource, compile
        from kernels import attention_triton as pa

        target = GPUTarget("cuda", 90, 32)
        ptr = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16"}
        fn = pa._prefill_kernel
        shapes = [(torch.bfloat16, 64, 4, False, False, False),
                  (torch.bfloat16, 128, 8, True, False, False),
                  (torch.bfloat16, 256, 2, True, True, False),
                  (torch.float16, 128, 8, True, False, False),
                  (torch.float32, 64, 4, False, True, False),
                  (torch.bfloat16, 64, 8, True, False, True)]  # gpt-oss: sinks
        for dtype, hd, group, slots, cap, sinks in shapes:
            p = ptr[dtype]
            cfg = pa.prefill_config(hd, dtype)
            opts = {"num_warps": cfg.pop("num_warps")}
            cfg |= {"GROUP": group, "HAS_SLOTS": slots, "SOFT_CAP": cap, "SINKS": sinks}
            ptrs = {"q_ptr": p, "k_ptr": p, "v_ptr": p, "out_ptr": p, "sinks_ptr": "*fp32",
                    "slots_ptr": "*i64", "qk_scale": "fp32", "cap_scale": "fp32"}
            sig = {n: "constexpr" if n in cfg else ptrs.get(n, "i32") for n in fn.arg_names}
            kernel = compile(ASTSource(fn, sig, constexprs=cfg), target=target, options=opts)
            assert "mma" in kernel.asm["ptx"] or "fma" in kernel.asm["ptx"]
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=300)
