"""The sampler's per-row state and processing, on hand-made logits (no model)."""

from __future__ import annotations

import math
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from replica.engine.structured import _allowed_words
from replica.model.sampler import (
    Row,
    Sampler,
    TokenCounts,
    apply_bitmask,
    logprob_table,
    read_logprobs,
    seeded_exponentials,
)
from replica.wire import SamplingParams

V = 40


def test_token_counts_keep_their_rows_when_the_pool_grows():
    counts = TokenCounts()
    first = counts.rows([(f"a{i}", [i]) for i in range(6)], V, torch.device("cpu"))
    counts.add(first, torch.arange(6) + 10)  # a_i has drawn token 10 + i once
    more = counts.rows([(f"b{i}", [30 + i]) for i in range(6)], V, torch.device("cpu"))
    assert counts.output.shape[0] >= 12  # grown past its first 8 rows
    again = counts.rows([(f"a{i}", []) for i in range(6)], V, torch.device("cpu"))
    assert torch.equal(again, first)
    for i, row in enumerate(first.tolist()):
        assert counts.output[row].nonzero().flatten().tolist() == [10 + i]
        assert counts.prompt[row].nonzero().flatten().tolist() == [i]
    for i, row in enumerate(more.tolist()):
        assert counts.output[row].sum() == 0
        assert counts.prompt[row].nonzero().flatten().tolist() == [30 + i]


def test_a_released_row_comes_back_zeroed():
    counts = TokenCounts()
    row = counts.rows([("a", [1, 2])], V, torch.device("cpu"))
    counts.add(row, torch.tensor([3]))
    counts.release("a")
    again = counts.rows([("b", [5])], V, torch.device("cpu"))
    assert torch.equal(again, row)  # the same pool row, reused
    assert counts.output[row[0]].sum() == 0
    assert counts.prompt[row[0]].nonzero().flatten().tolist() == [5]


def test_processing_leaves_the_callers_logits_raw():
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(0))
    raw = logits.clone()
    rows = [  # every row processed: the path that works on a copy of all of them
        Row("p", SamplingParams(temperature=0, repetition_penalty=2.0), 0, [0, 1]),
        Row("b", SamplingParams(seed=1, logit_bias=((7, 100.0),))),
    ]
    tokens = Sampler().draw(logits, rows)
    assert torch.equal(logits, raw)
    assert tokens[1] == 7


def test_min_tokens_masks_eos_and_stop_tokens_whatever_their_bias():
    logits = torch.zeros(1, V)
    sp = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=(5,))
    sp = sp.model_copy(update={"logit_bias": ((2, 100.0), (5, 90.0), (9, 1.0))})
    sampler = Sampler(eos_token_ids=(2,))
    assert sampler.draw(logits, [Row("r", sp, num_generated=1)]).item() == 9
    assert sampler.draw(logits, [Row("r", sp, num_generated=2)]).item() == 2
    ignoring = sp.model_copy(update={"ignore_eos": True})  # EOS is then no stop token
    assert sampler.draw(logits, [Row("s", ignoring, num_generated=0)]).item() == 2


def test_presence_and_frequency_penalties_count_the_drawn_tokens():
    sampler = Sampler()
    logits = torch.zeros(1, V)
    logits[0, 3], logits[0, 4] = 2.0, 1.5  # 3 wins until penalised below 4
    sp = SamplingParams(temperature=0, presence_penalty=0.2, frequency_penalty=0.2)
    drawn = [sampler.draw(logits, [Row("r", sp)]).item() for _ in range(4)]
    # 3 (2.0), 3 (2.0 - 0.4 = 1.6), 4 (3: 1.4 < 1.5), 3 (1.4 > 4: 1.5 - 0.4 = 1.1)
    assert drawn == [3, 3, 4, 3]
    sampler.release("r")
    assert not sampler.counts._rows and not sampler._draws


def test_a_bitmask_allows_exactly_its_bits_the_sign_bit_too():
    vocab = 70
    banned = {0, 31, 32, 63, 69}
    logits = torch.zeros(2, vocab)
    apply_bitmask(logits, _allowed_words(vocab, banned).expand(2, -1))
    assert set(torch.isinf(logits[0]).nonzero().flatten().tolist()) == banned
    assert torch.equal(logits[0], logits[1])


def test_logprob_table_reads_back_as_token_logprobs():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(2))
    targets = torch.tensor([1, 5, 9])
    table = logprob_table(logits, targets, 4)
    lp = torch.log_softmax(logits, -1)
    for i in range(3):
        got = read_logprobs(int(targets[i]), table[i].tolist(), 4, keep=2)
        assert got.token_id == targets[i] and abs(got.logprob - lp[i, targets[i]].item()) < 1e-6
        top = lp[i].topk(2)
        assert [t for t, _ in got.top] == top.indices.tolist()
        assert all(abs(a - b) < 1e-6 for (_, a), b in zip(got.top, top.values.tolist()))


class _Launches(TorchDispatchMode):
    """Counts the ops a draw runs (each a kernel launch on a GPU), by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _draw_ops(num_rows: int, seeded: bool, unseeded: bool) -> Counter[str]:
    kinds = [SamplingParams(temperature=0.8, top_k=5, seed=s) for s in (1, None)]
    kinds = [p for p, used in zip(kinds, (seeded, unseeded)) if used]
    rows = [Row(i, kinds[i % len(kinds)]) for i in range(num_rows)]
    logits = torch.randn(num_rows, V, generator=torch.Generator().manual_seed(num_rows))
    with _Launches() as launches:
        Sampler().draw(logits, rows)
    return launches.ops


def test_a_draw_launches_as_many_kernels_for_2_rows_as_for_64():
    """The exponentials for all rows come from one batched draw per kind (unseeded: one
    exponential_; seeded: one counter-based draw), not from one launch per row."""
    for kinds in ((True, False), (False, True), (True, True)):
        assert _draw_ops(2, *kinds) == _draw_ops(64, *kinds), kinds
    assert _draw_ops(64, False, True)["exponential_"] == 1
    assert _draw_ops(64, True, False)["exponential_"] == 0


def test_a_seeded_choice_draws_the_same_in_any_batch():
    """Uniform logits: the token is the row's smallest exponential, so any dependence of a
    seeded row's draws on its neighbours, its position or the batch size would show."""
    mine = Row("me", SamplingParams(temperature=1.0, seed=42), choice=1)
    alone = Sampler()
    want = [int(alone.draw(torch.zeros(1, 5000), [mine])[0]) for _ in range(12)]
    batched, got = Sampler(), []
    for step in range(12):
        others = [
            Row(f"o{j}", SamplingParams(temperature=1.0, seed=None if j % 2 else j))
            for j in range(step % 5)
        ]
        rows = others[: step % 3] + [mine] + others[step % 3 :]
        tokens = batched.draw(torch.zeros(len(rows), 5000), rows)
        got.append(int(tokens[rows.index(mine)]))
    assert got == want and len(set(want)) == 12


def test_seeded_exponentials_are_exp_1_and_differ_by_seed_and_draw():
    draws = seeded_exponentials(
        [(7, 0), (7, 1), (8, 0), (-(2**63), 0)], 200_000, torch.device("cpu")
    )
    assert draws.shape == (4, 200_000) and draws.dtype == torch.float32
    assert draws.min() > 0 and draws.isfinite().all()  # a 0 would win the race outright
    # Exp(1): mean 1, variance 1, P(E > 1) = 1/e (each within 5 standard errors)
    assert (draws.mean(-1) - 1).abs().max() < 5 / 200_000**0.5
    assert (draws.var(-1) - 1).abs().max() < 5 * 8**0.5 / 200_000**0.5
    assert ((draws > 1).float().mean(-1) - 1 / math.e).abs().max() < 5 * 0.49 / 200_000**0.5
    assert len({tuple(row[:8].tolist()) for row in draws}) == 4
    assert torch.equal(draws[:1], seeded_exponentials([(7, 0)], 200_000, torch.device("cpu")))
