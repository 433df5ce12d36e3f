"""The sampler: greedy, temperature, top-k, top-p, seeded, per row of one batch's logits."""

from __future__ import annotations

import torch

from replica.device import to_device
from replica.wire import SamplingParams


class Sampler:
    """Turns the last-position logits of each sequence into its next token.

    Greedy rows take the argmax. Sampled rows are processed together: temperature,
    one vocabulary sort when some row uses top-k or top-p, then an exponential race
    (argmax of p_i / E_i with E_i ~ Exp(1) drawn from the request's own generator),
    which draws token i with probability p_i as torch.multinomial would, but without
    multinomial's device synchronisation on CUDA: the step keeps its one device read
    (the sampled ids). Per-row parameters travel in pinned host tensors, copied
    without blocking."""

    def __init__(self) -> None:
        self._generators: dict[str, torch.Generator] = {}

    def sample(
        self, logits: torch.Tensor, params: list[SamplingParams], request_ids: list[str]
    ) -> torch.Tensor:
        """logits: [N, V] float32 -> [N] int64 token ids (still on logits' device)."""
        tokens = logits.argmax(dim=-1)
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if not rows:
            return tokens
        dev, vocab = logits.device, logits.shape[-1]
        every = len(rows) == len(params)
        index = None if every else to_device(torch.tensor(rows), dev)
        chosen = [params[i] for i in rows]
        temps = to_device(torch.tensor([p.temperature for p in chosen], dtype=torch.float32), dev)
        scaled = (logits if every else logits.index_select(0, index)) / temps[:, None]
        order = None
        if any(p.top_k or p.top_p < 1.0 for p in chosen):  # a vocabulary sort only if needed
            ks = to_device(torch.tensor([p.top_k or vocab for p in chosen]), dev)
            top_ps = to_device(torch.tensor([p.top_p for p in chosen], dtype=torch.float32), dev)
            scaled, order = scaled.sort(dim=-1, descending=True)
            ranks = torch.arange(vocab, device=dev)
            scaled = scaled.masked_fill(ranks[None, :] >= ks[:, None], float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        if order is not None:
            # drop a token when the mass before it already reaches top_p (always keep the
            # first: a top_p below float32's smallest value would drop it too)
            drop = (probs.cumsum(-1) - probs >= top_ps[:, None]) & (ranks[None, :] > 0)
            probs = probs.masked_fill(drop, 0.0)

        race = torch.empty_like(probs)
        for j, i in enumerate(rows):
            race[j].exponential_(generator=self._generator(request_ids[i], params[i], dev))
        # tiny: a zero draw would make 0/0 = NaN win the argmax
        picked = (probs / race.clamp_min_(torch.finfo(probs.dtype).tiny)).argmax(-1, keepdim=True)
        sampled = (picked if order is None else order.gather(-1, picked)).squeeze(-1)
        if every:
            return sampled
        return tokens.index_copy_(0, index, sampled)

    def release(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def _generator(self, rid: str, p: SamplingParams, device: torch.device) -> torch.Generator:
        gen = self._generators.get(rid)
        if gen is None:
            gen = torch.Generator(device=device)
            if p.seed is not None:
                gen.manual_seed(p.seed)
            else:
                gen.seed()
            self._generators[rid] = gen
        return gen
