"""What a request may ask of this engine, checked once when it is added.

A request the engine cannot serve is refused with a RequestError (a 400 at the ingress)
before it is queued: an empty prompt, an unknown adapter, token ids outside the
vocabulary, more tokens than the context holds, a grammar that does not compile.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from replica.engine.structured import StructuredOutputs
from replica.errors import RequestError
from replica.wire import GenerateRequest


class RequestLimits:
    def __init__(
        self,
        vocab_size: int,
        max_model_len: int,
        is_known: Callable[[str], bool],
        structured: StructuredOutputs,
    ) -> None:
        self.vocab_size, self.max_model_len = vocab_size, max_model_len
        self.is_known, self.structured = is_known, structured

    def bounded(self, request: GenerateRequest) -> GenerateRequest:
        """`request` with max_tokens None made the rest of the context (at least 1: a
        prompt that fills it is refused by check)."""
        sampling = request.sampling
        if sampling.max_tokens is not None:
            return request
        rest = max(1, self.max_model_len - len(request.prompt_ids))
        bounded = sampling.model_copy(update={"max_tokens": max(rest, sampling.min_tokens)})
        return dataclasses.replace(request, sampling=bounded)

    def check(self, request: GenerateRequest, adapter: str | None) -> None:
        """Raise RequestError if the engine cannot serve this (bounded) request, whose
        adapter the engine names `adapter`."""
        prompt_ids, sampling = request.prompt_ids, request.sampling
        if not prompt_ids:
            raise RequestError("empty prompt")
        if adapter is not None and not self.is_known(adapter):
            raise RequestError(f"unknown adapter {adapter!r}")
        vocab = self.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise RequestError(f"prompt token id out of range [0, {vocab})")
        if len(prompt_ids) + sampling.max_tokens > self.max_model_len:
            raise RequestError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({sampling.max_tokens}) "
                f"exceeds the maximum model length {self.max_model_len}"
            )
        outside = [t for t, _ in sampling.logit_bias if t >= vocab]
        if outside:
            raise RequestError(f"logit_bias token id {outside[0]} out of range [0, {vocab})")
        if sampling.structured_output is not None:
            self.structured.grammar(sampling.structured_output)  # compiled now: 400 if bad
