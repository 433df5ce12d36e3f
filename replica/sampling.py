"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, seeded."""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field

# torch.Generator.manual_seed takes a 64-bit integer
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
GREEDY_BELOW = 1e-5  # temperatures under this sample greedily


class SamplingParams(BaseModel):
    """How one request picks its tokens. temperature 0 means greedy."""

    model_config = ConfigDict(frozen=True)

    max_tokens: int = Field(16, ge=1, description="Maximum number of tokens to generate.")
    temperature: float = Field(
        0.0, ge=0.0, allow_inf_nan=False, description="0 = greedy; higher = more random."
    )
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int = Field(0, ge=0, description="Keep the k most likely tokens; 0 = all.")
    seed: int | None = Field(
        None, ge=SEED_MIN, le=SEED_MAX, description="Per-request seed for reproducible sampling."
    )
    stop_token_ids: tuple[int, ...] = Field((), description="Tokens that end the request.")
    ignore_eos: bool = Field(False, description="Keep generating past the model's EOS token.")

    @property
    def greedy(self) -> bool:
        # below this, dividing float32 logits by the temperature overflows (vLLM: the same)
        return self.temperature < GREEDY_BELOW


class Sampler:
    """Turns the last-position logits of each sequence into its next token."""

    def __init__(self) -> None:
        self._generators: dict[str, torch.Generator] = {}

    def sample(
        self, logits: torch.Tensor, params: list[SamplingParams], request_ids: list[str]
    ) -> torch.Tensor:
        """logits: [N, V] float32 -> [N] int64 token ids (still on logits' device)."""
        tokens = logits.argmax(dim=-1)
        for i, p in enumerate(params):
            if not p.greedy:
                tokens[i] = self._sample_row(logits[i], p, request_ids[i])
        return tokens

    def release(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def _sample_row(self, logits: torch.Tensor, p: SamplingParams, rid: str) -> torch.Tensor:
        logits = logits / p.temperature
        if p.top_k:
            kth = torch.topk(logits, min(p.top_k, logits.shape[-1])).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if p.top_p < 1.0:
            sorted_p, order = probs.sort(descending=True)
            # drop a token when the mass before it already reaches top_p (always keep the first)
            drop = (sorted_p.cumsum(-1) - sorted_p) >= p.top_p
            drop[0] = False  # a top_p below float32's smallest value would drop it too
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        return torch.multinomial(probs, 1, generator=self._generator(rid, p, logits.device))[0]

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
