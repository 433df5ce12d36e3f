"""Hugging Face transformers + PEFT: the outside oracle for our model and adapters."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM


def hf_model(model_dir: Path, adapter_dir: Path | None = None):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir)
    return model.eval()


@torch.no_grad()
def hf_logits(model, prompt: list[int]) -> torch.Tensor:
    """[len(prompt), vocab] float32 logits of every position."""
    return model(input_ids=torch.tensor([prompt])).logits[0].float()


@torch.no_grad()
def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    out = model.generate(
        input_ids=torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()
