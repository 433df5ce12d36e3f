"""Offline generation over text: tokenizer + engine, for `lorafleet generate` and the demo."""

from __future__ import annotations

from dataclasses import dataclass

from transformers import AutoTokenizer

from replica.config import EngineConfig
from replica.engine.engine import LLMEngine
from replica.model.spec import ModelConfigError
from replica.wire import SamplingParams


@dataclass
class GenerateRequest:
    prompt: str
    adapter: str | None
    sampling: SamplingParams


@dataclass
class GenerateResult:
    prompt: str
    adapter: str | None
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    text: str
    finish_reason: str | None

    def to_json(self) -> dict:
        return {
            "prompt": self.prompt,
            "adapter": self.adapter,
            "prompt_token_ids": self.prompt_token_ids,
            "output_token_ids": self.output_token_ids,
            "text": self.text,
            "finish_reason": self.finish_reason,
        }


class OfflineGenerator:
    def __init__(self, config: EngineConfig, loras: dict[str, str]) -> None:
        self.engine = LLMEngine(config)  # first: it names what is wrong with a model directory
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(config.model)
        except (OSError, ValueError) as e:
            self.engine.shutdown()
            raise ModelConfigError(f"{config.model}: no usable tokenizer ({e})") from None
        # adapter -> the modules it changes, with their layer counts (what a load reports)
        self.applied: dict[str, dict[str, int]] = {}
        try:
            for name, path in loras.items():
                self.applied[name] = self.engine.load_adapter(name, path).applied()
        except BaseException:
            self.engine.shutdown()
            raise

    def close(self) -> None:
        """Stop the engine's loader and any tensor-parallel ranks."""
        self.engine.shutdown()

    def generate(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        """All requests run as one continuous batch; results in request order."""
        prompts = [self.tokenizer(r.prompt)["input_ids"] for r in requests]
        seqs = self.engine.generate(
            [(ids, r.sampling, r.adapter) for ids, r in zip(prompts, requests)]
        )
        return [
            GenerateResult(
                r.prompt,
                r.adapter,
                s.prompt_ids,
                s.output_ids,
                self.tokenizer.decode(s.output_ids, skip_special_tokens=True),
                s.finish_reason,
            )
            for r, s in zip(requests, seqs)
        ]
