"""Hugging Face transformers + PEFT: the outside oracle for our model and adapters."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM


def hf_model(model_dir: Path, adapter_dir: Path | None = None, eager: bool = False):
    """The reference model (with `eager`: transformers' eager attention, which applies
    every family's soft-caps and windows as written)."""
    kw = {"attn_implementation": "eager"} if eager else {}
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **kw)
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
    """n argmax tokens, end-of-sequence included (what an engine with ignore_eos emits;
    generate's min_new_tokens would instead forbid EOS until n tokens)."""
    out, past, step = [], None, torch.tensor([prompt])
    for _ in range(n):
        res = model(input_ids=step, past_key_values=past, use_cache=True)
        past = res.past_key_values
        out.append(int(res.logits[0, -1].argmax()))
        step = torch.tensor([[out[-1]]])
    return out


def peft_adapter(
    model_dir: Path, out: Path, targets: list[str] | str, r: int, alpha: int, seed: int, **lora
) -> Path:
    """A LoRA adapter written by peft itself, with random A and B (not PEFT's zero B)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(
        r=r, lora_alpha=alpha, target_modules=targets, init_lora_weights=False, **lora
    )
    model = get_peft_model(base, config)
    with torch.no_grad():  # B of std ~1/sqrt(r): deltas that change greedy tokens
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn_like(p) / r**0.5)
            elif "lora_embedding" in name:  # PEFT's embedding LoRA: A [r, vocab], B [h, r]
                p.copy_(torch.randn_like(p) * (0.3 if "_B" in name else 1.0))
    model.save_pretrained(out)
    return out


ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
EVERYTHING = ATTENTION + ["gate_proj", "up_proj", "down_proj"]
# Qwen3.5's Gated DeltaNet projections (its attention layers have q/k/v/o)
LINEAR_ATTENTION = ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"]
PHI3 = {"attn": ["qkv_proj", "o_proj"], "all": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]}


# PEFT target_parameters on transformers 5's stacked experts (the 3D expert layout)
EXPERTS = {"target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
           "rank_pattern": {"layers.0.mlp.experts.down_proj": 4}}  # fmt: skip


# Gemma 4's multimodal wrapper: its vision tower's projections are ClippableLinear (PEFT
# cannot wrap them), so adapters target the language model by regex, "all" the tower's
# inner .linear too (LoRA that the text path never reads)
GEMMA4_MM = {
    "attn": r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj)",
    "all": r".*(language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj"
    r"|per_layer_input_gate|per_layer_projection)|vision_tower.*\.(q_proj|v_proj)\.linear)",
}
# Gemma 4's per-layer-input projections, which its "all" adapters target too
GEMMA4_PER_LAYER = ["per_layer_input_gate", "per_layer_projection"]


GEMMA4_EXPERTS = {"target_parameters": ["experts.gate_up_proj", "experts.down_proj"],
                  "rank_pattern": {"layers.0.experts.down_proj": 4}}  # fmt: skip


def family_adapters(family: str, model_dir: Path, root: Path) -> dict[str, Path]:
    """Two peft adapters of a family's model: rank 8 on attention, rank 16 on everything
    (Phi-3's adapters target its fused qkv_proj and gate_up_proj; on a mixture of experts
    "all" adds the experts' stacked parameters, layer 0's down at rank 4; gpt-oss has
    no dense MLP, so its "all" is attention and experts)."""
    targets = PHI3 if family.startswith("phi3") else {"attn": ATTENTION, "all": EVERYTHING}
    if family == "gptoss":  # no dense MLP: attention and the stacked experts
        targets = {"attn": ATTENTION, "all": ATTENTION}
    if family == "gemma4-mm":
        targets = GEMMA4_MM
    elif family.startswith("gemma4"):
        targets = {"attn": ATTENTION, "all": EVERYTHING + GEMMA4_PER_LAYER}
    if family == "qwen35":  # every linear module, the linear attention's too
        targets = {"attn": ATTENTION, "all": EVERYTHING + LINEAR_ATTENTION}
    if family == "qwen35moe":  # no dense MLP (gate_proj would name the shared expert's)
        targets = {"attn": ATTENTION, "all": ATTENTION + LINEAR_ATTENTION}
    experts = EXPERTS if family in ("mixtral", "qwen3moe", "gptoss", "qwen35moe") else {}
    if family == "gemma4moe":  # its experts sit at layers.L.experts, beside the mlp
        experts = GEMMA4_EXPERTS
    return {
        "attn": peft_adapter(model_dir, root / "attn", targets["attn"], r=8, alpha=16, seed=1),
        "all": peft_adapter(
            model_dir, root / "all", targets["all"], r=16, alpha=8, seed=2, **experts
        ),
    }


def check_mixed_batch(engine, model_dir: Path, adapters: dict, prompts, new_tokens: int):
    """The engine against transformers (eager) + PEFT for the base and each adapter: logits
    of every prompt position within 2e-4, then one mixed batch of every (prompt, model)
    whose greedy tokens equal the reference's. Returns {adapter name or None: outputs}."""
    from replica.wire import SamplingParams

    refs = {None: hf_model(model_dir, eager=True)}
    refs |= {name: hf_model(model_dir, path, eager=True) for name, path in adapters.items()}
    for name, ref in refs.items():
        for p in prompts:
            diff = (engine.score(p, name) - hf_logits(ref, p)).abs().max().item()
            assert diff < 2e-4, f"{name}: max |logit diff| {diff} (prompt of {len(p)})"
    greedy = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    batch = [(p, name) for p in prompts for name in refs]
    outputs = engine.generate([(p, greedy, name) for p, name in batch])
    got: dict = {name: [] for name in refs}
    for (p, name), seq in zip(batch, outputs):
        assert seq.output_ids == hf_greedy(refs[name], p, new_tokens), (name, len(p))
        got[name].append(seq.output_ids)
    return got


def build_peft_adapter(model_dir, out, seed: int, safe: bool = True, **lora_kwargs):
    """Return `out`, where PEFT itself saved an adapter of `model_dir` (init_lora_weights=False
    so that B is not zero)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = get_peft_model(base, LoraConfig(init_lora_weights=False, **lora_kwargs))
        model.save_pretrained(out, safe_serialization=safe)
    return out
