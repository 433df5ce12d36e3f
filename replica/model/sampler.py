"""The sampler: per-row logit processing, then greedy or a seeded draw, for one batch's logits.

Also the logprob tables a step reads back with its sampled ids (`logprob_table`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from replica.device import to_device
from replica.wire import SamplingParams, TokenLogprobs


@dataclass(frozen=True)
class Row:
    """One row to draw a token for. `key` names the state the sampler keeps for it across
    steps (its generator, its token counts): one per choice of a request."""

    key: Hashable
    params: SamplingParams
    choice: int = 0  # which of the request's n choices: seeds the generator with (seed, choice)
    prompt_ids: Sequence[int] = ()  # the repetition penalty's prompt tokens, read at first use
    num_generated: int = 0  # tokens the choice has made before this one (min_tokens)
    bitmask_row: int | None = None  # structured output: its row of the step's token bitmask


class Sampler:
    """Turns each row's logits into its next token.

    Rows whose params are `plain` (nothing but temperature / top-k / top-p) take the fast
    path: greedy rows the argmax, sampled rows together through temperature, one vocabulary
    sort when some row uses top-k or top-p, then an exponential race (argmax of p_i / E_i
    with E_i ~ Exp(1) drawn in vocabulary order), which draws token i with probability
    p_i as torch.multinomial would, but without its device synchronisation on CUDA: the
    step keeps its one device read. The E_i come from one batched draw per kind of row,
    however many rows: unseeded rows share one exponential_ from the device's generator;
    seeded rows are computed from a counter (seeded_exponentials), so a seeded choice draws
    the same whatever its batch neighbours, on every run and device. Other rows are first
    processed on a copy of their logits in vLLM's order: logit_bias, min_tokens, repetition
    penalty, presence and frequency penalties, the structured-output bitmask; then min_p
    with the draw. Per-row parameters travel in host tensors copied without blocking; the
    penalties' token counts stay on the device (TokenCounts)."""

    def __init__(self, eos_token_ids: Sequence[int] = ()) -> None:
        self.eos_token_ids = tuple(eos_token_ids)  # masked with stop tokens under min_tokens
        self._draws: dict[Hashable, int] = {}  # per seeded choice: the draws it has made
        self.counts = TokenCounts()

    def sample(
        self, logits: torch.Tensor, params: list[SamplingParams], request_ids: list[Hashable]
    ) -> torch.Tensor:
        """logits: [N, V] float32 -> [N] int64 token ids; row i is request_ids[i]'s."""
        return self.draw(logits, [Row(rid, p) for rid, p in zip(request_ids, params)])

    def draw(
        self, logits: torch.Tensor, rows: list[Row], bitmask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """logits: [N, V] float32, row i for rows[i], left unchanged (the raw logits the
        logprobs are read from) -> [N] int64 token ids, still on logits' device. `bitmask`:
        int32 [B, ceil(V / 32)] (xgrammar's layout) for rows with a bitmask_row."""
        tokens = logits.argmax(dim=-1)
        todo = [i for i, r in enumerate(rows) if not (r.params.greedy and r.params.plain)]
        if not todo:
            return tokens
        dev = logits.device
        every = len(todo) == len(rows)
        index = None if every else to_device(torch.tensor(todo), dev)
        chosen = [rows[i] for i in todo]
        x = logits if every else logits.index_select(0, index)
        special = [j for j, r in enumerate(chosen) if not r.params.plain]
        counted = None
        if special:  # processed in place: on a copy, never the caller's logits
            x = x.clone() if every else x
            counted = self._process(x, special, chosen, bitmask)
        drawn = [j for j, r in enumerate(chosen) if not r.params.greedy]
        if len(drawn) == len(chosen):
            picked = self._race(x, chosen)
        else:
            picked = x.argmax(dim=-1)
            if drawn:
                at = to_device(torch.tensor(drawn), dev)
                race = self._race(x.index_select(0, at), [chosen[j] for j in drawn])
                picked.index_copy_(0, at, race)
        if counted is not None:  # the drawn tokens of penalised rows, counted on the device
            at, state = counted
            self.counts.add(state, picked.index_select(0, at))
        return picked if every else tokens.index_copy_(0, index, picked)

    def release(self, key: Hashable) -> None:
        """Forget a choice's state (it has finished)."""
        self._draws.pop(key, None)
        self.counts.release(key)

    # -- logit processing (rows that are not plain) ---------------------------------------------

    def _process(
        self, x: torch.Tensor, special: list[int], rows: list[Row], bitmask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """x's special rows, in place, in vLLM's order. Returns the penalised rows (of x)
        and their TokenCounts rows, whose drawn tokens are to be counted."""
        self._bias_and_mask(x, special, rows)
        counted = None
        penalised = [j for j in special if _penalised(rows[j].params)]
        if penalised:
            counted = self._penalise(x, penalised, rows)
        masked = [j for j in special if rows[j].bitmask_row is not None]
        if masked and bitmask is not None:
            at = to_device(torch.tensor(masked), x.device)
            which = to_device(torch.tensor([rows[j].bitmask_row for j in masked]), x.device)
            y = x.index_select(0, at)
            apply_bitmask(y, to_device(bitmask, x.device).index_select(0, which))
            x.index_copy_(0, at, y)
        return counted

    def _bias_and_mask(self, x: torch.Tensor, special: list[int], rows: list[Row]) -> None:
        """logit_bias added, then min_tokens: EOS and stop tokens to -inf while too few."""
        vocab = x.shape[-1]
        edits: list[tuple[int, int, float]] = []  # (row of x, token, added)
        for j in special:
            p = rows[j].params
            edits += [(j, token, b) for token, b in p.logit_bias]  # the engine refused ids >= V
            if rows[j].num_generated < p.min_tokens:
                banned = p.stop_token_ids + (() if p.ignore_eos else self.eos_token_ids)
                edits += [(j, t, float("-inf")) for t in dict.fromkeys(banned) if t < vocab]
        if edits:  # accumulated: a banned token with a bias still ends at -inf
            at, ids, added = zip(*edits)
            values = to_device(torch.tensor(added, dtype=x.dtype), x.device)
            x.index_put_(_on(x.device, at, ids), values, accumulate=True)

    def _penalise(
        self, x: torch.Tensor, penalised: list[int], rows: list[Row]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Repetition penalty over prompt and output tokens (positive logits divided,
        negative multiplied), then presence and frequency over output tokens (OpenAI's:
        logit -= presence * (count > 0) + frequency * count)."""
        dev = x.device
        wanted = [(rows[j].key, rows[j].prompt_ids) for j in penalised]
        state = self.counts.rows(wanted, x.shape[-1], dev)
        counts, prompt = self.counts.output[state], self.counts.prompt[state]
        ps = [rows[j].params for j in penalised]

        def column(values: list[float]) -> torch.Tensor:
            return to_device(torch.tensor(values, dtype=x.dtype), dev)[:, None]

        rep = column([p.repetition_penalty for p in ps])
        presence = column([p.presence_penalty for p in ps])
        frequency = column([p.frequency_penalty for p in ps])
        at = to_device(torch.tensor(penalised), dev)
        y = x.index_select(0, at)
        seen = counts > 0
        scale = torch.where(seen | prompt, rep, torch.ones_like(rep))
        y = torch.where(y > 0, y / scale, y * scale)
        y -= presence * seen + frequency * counts
        x.index_copy_(0, at, y)
        return at, state

    # -- the draw -------------------------------------------------------------------------------

    def _race(self, x: torch.Tensor, rows: list[Row]) -> torch.Tensor:
        """Temperature, top-k, top-p and min_p, then the exponential race: [M] int64."""
        dev, vocab = x.device, x.shape[-1]
        ps = [r.params for r in rows]
        temps = to_device(torch.tensor([p.temperature for p in ps], dtype=torch.float32), dev)
        scaled = x / temps[:, None]
        order = None
        if any(p.top_k or p.top_p < 1.0 for p in ps):  # a vocabulary sort only if needed
            ks = to_device(torch.tensor([p.top_k or vocab for p in ps]), dev)
            top_ps = to_device(torch.tensor([p.top_p for p in ps], dtype=torch.float32), dev)
            scaled, order = scaled.sort(dim=-1, descending=True)
            ranks = torch.arange(vocab, device=dev)
            scaled = scaled.masked_fill(ranks[None, :] >= ks[:, None], float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        if order is not None:
            # drop a token when the mass before it already reaches top_p (always keep the
            # first: a top_p below float32's smallest value would drop it too)
            drop = (probs.cumsum(-1) - probs >= top_ps[:, None]) & (ranks[None, :] > 0)
            probs = probs.masked_fill(drop, 0.0)
        if any(p.min_p > 0.0 for p in ps):  # relative to the top token: never drops it
            min_ps = to_device(torch.tensor([p.min_p for p in ps], dtype=torch.float32), dev)
            probs = probs.masked_fill(probs < min_ps[:, None] * probs.amax(-1, keepdim=True), 0.0)

        race = self._exponentials(probs, rows)
        if order is not None:  # each token keeps its own draw, sorted or not: a row's
            race = race.gather(-1, order)  # tokens do not depend on the rest of the batch
        # tiny: a zero draw would make 0/0 = NaN win the argmax
        picked = (probs / race.clamp_min_(torch.finfo(probs.dtype).tiny)).argmax(-1, keepdim=True)
        return (picked if order is None else order.gather(-1, picked)).squeeze(-1)

    def _exponentials(self, probs: torch.Tensor, rows: list[Row]) -> torch.Tensor:
        """[M, V] Exp(1) draws, row j for rows[j]: unseeded rows in one exponential_,
        seeded rows from their (seed, choice, draw count) in one counter-based draw."""
        seeded = [j for j, r in enumerate(rows) if r.params.seed is not None]
        if not seeded:
            return torch.empty_like(probs).exponential_()
        streams = []
        for j in seeded:
            row = rows[j]
            count = self._draws.get(row.key, 0)
            self._draws[row.key] = count + 1
            streams.append((choice_seed(row.params.seed, row.choice), count))
        drawn = seeded_exponentials(streams, probs.shape[-1], probs.device)
        if len(seeded) == len(rows):
            return drawn
        race = torch.empty_like(probs).exponential_()
        return race.index_copy_(0, to_device(torch.tensor(seeded), probs.device), drawn)


class TokenCounts:
    """The penalties' per-choice state on the device, one pooled row per choice: how often
    each token occurs in its output (int32 [rows, V]) and which occur in its prompt (bool
    [rows, V], filled once at first use). Updated from the drawn ids by a scatter-add on
    the device: no host read."""

    def __init__(self) -> None:
        self.output: torch.Tensor | None = None
        self.prompt: torch.Tensor | None = None
        self._rows: dict[Hashable, int] = {}
        self._free: list[int] = []

    def rows(
        self, wanted: list[tuple[Hashable, Sequence[int]]], vocab: int, device: torch.device
    ) -> torch.Tensor:
        """The pool rows of (key, prompt ids) on the device; a new key gets a zeroed row
        with its prompt's tokens marked."""
        new = [(key, prompt) for key, prompt in wanted if key not in self._rows]
        if new:
            self._allocate(new, vocab, device)
        return to_device(torch.tensor([self._rows[key] for key, _ in wanted]), device)

    def add(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        assert self.output is not None
        ones = torch.ones_like(tokens, dtype=self.output.dtype)
        self.output.index_put_((rows, tokens), ones, accumulate=True)

    def release(self, key: Hashable) -> None:
        row = self._rows.pop(key, None)
        if row is not None:
            self._free.append(row)

    def _allocate(
        self, new: list[tuple[Hashable, Sequence[int]]], vocab: int, device: torch.device
    ) -> None:
        need = len(new) - len(self._free)
        if need > 0:
            self._grow(need, vocab, device)
        rows = [self._free.pop() for _ in new]
        self._rows.update((key, row) for (key, _), row in zip(new, rows))
        assert self.output is not None and self.prompt is not None
        at = to_device(torch.tensor(rows), device)
        self.output.index_fill_(0, at, 0)
        self.prompt.index_fill_(0, at, False)
        marks = [(row, t) for row, (_, prompt) in zip(rows, new) for t in prompt]
        if marks:
            self.prompt.index_put_(_on(device, *zip(*marks)), torch.tensor(True, device=device))

    def _grow(self, need: int, vocab: int, device: torch.device) -> None:
        """At least `need` more rows (doubling): the old rows copied on the device."""
        old = 0 if self.output is None else self.output.shape[0]
        size = max(8, 2 * old, old + need)
        output = torch.zeros(size, vocab, dtype=torch.int32, device=device)
        prompt = torch.zeros(size, vocab, dtype=torch.bool, device=device)
        if self.output is not None and self.prompt is not None:
            output[:old], prompt[:old] = self.output, self.prompt
        self.output, self.prompt = output, prompt
        self._free += range(size - 1, old - 1, -1)


def _penalised(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _on(device: torch.device, *columns: Sequence[int]) -> tuple[torch.Tensor, ...]:
    """Host index columns as device tensors (index_put_'s indices)."""
    return tuple(to_device(torch.tensor(c, dtype=torch.int64), device) for c in columns)


_MASK32, _MASK64 = (1 << 32) - 1, (1 << 64) - 1
# Mueller's 32-bit mixing multiplier: below 2**27, so a 32-bit value times it stays
# exact in int64 (torch has no unsigned 32-bit arithmetic on every device)
_MIX32 = 0x45D9F3B
_GOLDEN32 = 0x9E3779B9  # spreads token indices over the 32-bit counter space


def seeded_exponentials(
    streams: Sequence[tuple[int, int]], vocab: int, device: torch.device
) -> torch.Tensor:
    """[len(streams), vocab] float32 Exp(1) draws: row i is a pure function of
    streams[i] = (64-bit seed, draw count) and the token index, so a seeded choice's
    draws do not depend on which rows share its batch, nor on the device. A counter-based
    generator: the host mixes each (seed, count) into two 32-bit words (splitmix64); the
    device combines each token's index with them (a bijection of the index for each
    key) and hashes that into 23 uniform bits: the same ~20 elementwise launches for any
    number of rows."""
    keys = [_splitmix64(seed ^ _splitmix64(count)) for seed, count in streams]
    words = torch.tensor([[k & _MASK32, k >> 32] for k in keys], dtype=torch.int64)
    words = to_device(words, device)
    spread = torch.arange(vocab, device=device, dtype=torch.int64) * _GOLDEN32 & _MASK32
    x = _mix32(((spread ^ words[:, :1]) + words[:, 1:]) & _MASK32)  # [rows, vocab]
    # 23 bits, so h + 0.5 is exact in float32: u in (0, 1), never 1 (which would give a
    # draw of 0, winning the race for any token) nor 0
    uniform = ((x >> 9).to(torch.float32) + 0.5) * 2.0**-23
    return uniform.log_().neg_()


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijection of 32-bit values (held in int64) that mixes every bit into every bit."""
    x = ((x >> 16) ^ x) * _MIX32 & _MASK32
    x = ((x >> 16) ^ x) * _MIX32 & _MASK32
    return (x >> 16) ^ x


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def choice_seed(seed: int, choice: int) -> int:
    """Choice 0 uses the request's seed as is (n = 1 draws what it always drew); choice i
    a 63-bit seed derived from (seed, i), the same on every run and in every batch."""
    if choice == 0:
        return seed
    digest = hashlib.sha256(f"{seed}/{choice}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """-inf where the bitmask forbids a token, in place: xgrammar's layout (bit j of int32
    word w allows token 32 w + j), unpacked with torch ops (any device, no host read)."""
    rows, vocab = logits.shape
    bits = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((bitmask[:, :, None] >> bits) & 1).view(rows, -1)[:, :vocab].bool()
    logits.masked_fill_(~allowed, float("-inf"))


def logprob_table(logits: torch.Tensor, targets: torch.Tensor, k: int) -> torch.Tensor:
    """[R, 1 + 2k] float64 per row: the target token's logprob, the k best logprobs, their
    ids (float64 holds every id exactly, so one tensor carries both back in one read).

    Raw logprobs, as vLLM returns by default: log_softmax of the logits as the model gave
    them, in float32, before any bias, penalty, mask or temperature."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    parts = [lp.gather(-1, targets[:, None])]
    if k:
        top = lp.topk(k, dim=-1)
        parts += [top.values, top.indices]
    return torch.cat([p.double() for p in parts], dim=-1)


def read_logprobs(
    target: int, values: Sequence[float], k: int, keep: int | None = None
) -> TokenLogprobs:
    """One row of a logprob_table of width k, read back on the host, with its `keep` best."""
    keep = k if keep is None else keep
    ids = values[1 + k : 1 + k + keep]
    return TokenLogprobs(target, values[0], tuple(zip(map(int, ids), values[1 : 1 + keep])))
