"""Paged decode attention: both backends against kernels.paged_attention_reference, and the
reference against a dense causal SDPA over each sequence's contiguous K/V.

Triton runs compiled on a CUDA machine and in its interpreter elsewhere (tests/conftest.py
sets TRITON_INTERPRET=1 before anything imports triton). Every cache slot a call must not
read is NaN: the tail of each sequence's last block, the blocks its table lists past its
context, the positions before its window, spare blocks, and the scratch block that padding
rows point at. A backend that reads one fails loudly rather than by a rounding error.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels import paged_attention_torch
from kernels.paged_attention_reference import paged_decode_attention_reference
from tests.conftest import CUDA, TEST_DEVICE

try:
    from triton.runtime.interpreter import InterpretedFunction

    from kernels import paged_attention_triton
except ImportError:  # a platform without triton still tests the torch path
    paged_attention_triton = None
needs_triton = pytest.mark.skipif(paged_attention_triton is None, reason="triton not installed")

BACKENDS = {"torch": paged_attention_torch} | (
    {"triton": paged_attention_triton} if paged_attention_triton else {}
)
# (rtol, atol): fp32 end to end; half outputs are rounded once, about one ulp (|out| < ~2)
TOL = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}
HD = 16
# The interpreter's numpy arithmetic warns on padding rows, whose scratch block is NaN by
# design (their outputs are unspecified; the real rows are checked finite).
pytestmark = pytest.mark.filterwarnings(
    "ignore:invalid value encountered in subtract:RuntimeWarning"
)
NAN = float("nan")


@dataclass
class Case:
    q: torch.Tensor  # [D, H, hd]
    k_cache: torch.Tensor  # [KVH, num_blocks * block_size, hd]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [D, W] int32
    context_lens: torch.Tensor  # [D] int32
    block_size: int
    window: int | None
    keys: list[torch.Tensor | None]  # per row: dense [KVH, ctx, hd] fp32 (None: padding row)
    values: list[torch.Tensor | None]
    real: torch.Tensor  # [D] bool: rows that are not padding

    @property
    def scale(self) -> float:
        return self.q.shape[2] ** -0.5

    def args(self) -> tuple:
        return (
            self.q,
            self.k_cache,
            self.v_cache,
            self.block_tables,
            self.context_lens,
            self.block_size,
            self.scale,
            self.window,
        )


def make_case(
    ctx_lens: list[int],  # one per sequence; None marks a padding row (ctx 1, scratch block)
    block_size: int,
    heads: tuple[int, int] = (8, 2),  # (H, KVH)
    dtype: torch.dtype = torch.float32,
    window: int | None = None,
    seed: int = 0,
    hd: int = HD,
) -> Case:
    rnd = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    h, kvh = heads
    need = [-(-(c or 1) // block_size) for c in ctx_lens]  # blocks each row uses
    real_blocks = sum(n for n, c in zip(need, ctx_lens) if c is not None)
    num_blocks = real_blocks + 3  # + the scratch block and two spare ones, all NaN
    ids = torch.randperm(num_blocks, generator=gen).tolist()  # shuffled, non-contiguous
    scratch, spares, ids = ids[0], ids[1:3], ids[3:]
    width = max(need) + 2  # every row has unused table entries

    k_cache = torch.full((kvh, num_blocks * block_size, hd), NAN)
    v_cache = torch.full_like(k_cache, NAN)
    table = torch.empty(len(ctx_lens), width, dtype=torch.int32)
    keys, values = [], []
    for i, (ctx, n) in enumerate(zip(ctx_lens, need)):
        if ctx is None:  # padding row: every entry the scratch block
            table[i] = scratch
            keys.append(None)
            values.append(None)
            continue
        blocks, ids = ids[:n], ids[n:]
        # unused entries point at NaN blocks and at other rows' blocks alike
        unused = [rnd.choice(spares + [scratch]) if j % 2 else rnd.randrange(num_blocks)
                  for j in range(width - n)]  # fmt: skip
        table[i] = torch.tensor(blocks + unused)
        k = torch.randn(kvh, ctx, hd, generator=gen).to(dtype).float()
        v = torch.randn(kvh, ctx, hd, generator=gen).to(dtype).float()
        slots = torch.tensor([blocks[p // block_size] * block_size + p % block_size
                              for p in range(ctx)])  # fmt: skip
        lo = 0 if window is None else max(0, ctx - window)  # before it: left NaN, never read
        k_cache[:, slots[lo:]] = k[:, lo:]
        v_cache[:, slots[lo:]] = v[:, lo:]
        keys.append(k)
        values.append(v)
    lens = [1 if c is None else c for c in ctx_lens]
    return Case(
        q=torch.randn(len(ctx_lens), h, hd, generator=gen).to(TEST_DEVICE, dtype),
        k_cache=k_cache.to(TEST_DEVICE, dtype),
        v_cache=v_cache.to(TEST_DEVICE, dtype),
        block_tables=table.to(TEST_DEVICE),
        context_lens=torch.tensor(lens, dtype=torch.int32, device=TEST_DEVICE),
        block_size=block_size,
        window=window,
        keys=keys,
        values=values,
        real=torch.tensor([c is not None for c in ctx_lens], device=TEST_DEVICE),
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


# ctx 1, exact block boundaries (k*bs, k*bs + 1) and ones in between, padding rows between
def mixed_lens(block_size: int) -> list[int | None]:
    bs = block_size
    return [1, bs, bs + 1, None, 3 * bs, 3 * bs + 1, 2 * bs + bs // 2 + 1, None, 37, 70]


HEADS = {"gqa4": (8, 2), "mqa": (8, 1), "mha": (4, 4)}


@needs_triton
def test_paged_triton_is_compiled_on_cuda_and_interpreted_elsewhere():
    assert isinstance(paged_attention_triton._paged_decode_kernel, InterpretedFunction) is not CUDA


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
    real = paged_attention_triton.decode_config
    monkeypatch.setattr(
        paged_attention_triton,
        "decode_config",
        lambda *a: real(*a) | {"BLOCK_N": 16},
    )
    check("triton", make_case(mixed_lens(4), 4, (6, 2), seed=5, hd=24))
    check("triton", make_case(mixed_lens(4), 4, (6, 2), window=21, seed=6, hd=24))


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


@needs_triton
def test_paged_triton_rejects_strided_last_dim():
    case = make_case([5, 9], 4, (8, 2))
    wide = torch.zeros(*case.q.shape[:2], 2 * HD, dtype=case.q.dtype, device=TEST_DEVICE)
    wide[..., ::2] = case.q
    args = list(case.args())
    args[0] = wide[..., ::2]
    with pytest.raises(ValueError, match="unit stride"):
        paged_attention_triton.paged_decode_attention(*args)


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
def test_paged_triton_kernel_compiles_for_cuda(tmp_path):
    """No GPU here: lower the kernel to sm_90 cubins (ptxas ships with triton) for each
    dtype at the demo model's shapes, to catch what the interpreter can't."""
    code = textwrap.dedent(
        """
        import torch
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource, compile
        from kernels import paged_attention_triton as pa

        target = GPUTarget("cuda", 90, 32)
        ptr = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16"}
        fn = pa._paged_decode_kernel
        for dtype, p in ptr.items():
            for hd, group, block_size in ((64, 4, 16), (128, 8, 1)):
                cfg = pa.decode_config(hd, group, dtype)
                opts = {"num_warps": cfg.pop("num_warps")}
                cfg |= {"GROUP": group, "BLOCK_SIZE": block_size}
                ptrs = {"q_ptr": p, "k_ptr": p, "v_ptr": p, "out_ptr": p,
                        "tables_ptr": "*i32", "lens_ptr": "*i32", "qk_scale": "fp32"}
                sig = {n: "constexpr" if n in cfg else ptrs.get(n, "i32") for n in fn.arg_names}
                kernel = compile(ASTSource(fn, sig, constexprs=cfg), target=target, options=opts)
                assert "mma" in kernel.asm["ptx"] or "fma" in kernel.asm["ptx"]
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=300)
