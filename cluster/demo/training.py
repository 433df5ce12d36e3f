"""The trained demo: a tiny Llama that copies its input, and LoRA adapters that each teach it
one visible task. Everything is trained here on the CPU in a few minutes, from data this file
generates, with fixed seeds; the result is committed under assets/demo-trained/.

A prompt is a few words of a small fixed vocabulary followed by `->`; the answer follows and
ends with `</s>`. The base model echoes the words; each adapter transforms them:

    base       cat red 7 ->  cat red 7
    uppercase  cat red 7 ->  CAT RED 7
    reverse    cat red 7 ->  7 red cat
    french     cat red 7 ->  chat rouge 7
    digits     cat red 7 ->  cat red seven
    count      cat red 7 ->  three

One more adapter, `letters`, calls a tool: asked how many letters a word has, with the
function offered, it writes a Hermes call (`<tool_call> {"name": "count_letters", ...}
</tool_call>`); given the function's result in a tool message, it answers with it. Its
own chat template (cluster/demo/letters.py, shipped in its directory) writes the tools, the call
and the result as the words it was trained on. The words of those turns came later than
the others: the base model was trained without them, then learned only their rows of the
embedding and the output layer (copying them), so every other weight is what it was and
the first adapters' files and answers are unchanged.

Words within one prompt are distinct (the copy mechanism finds a word by looking it up).
Training uses transformers + PEFT; the files are a Hugging Face model directory (fp16
safetensors, a word-level tokenizer) and PEFT LoRA directories, like any downloaded model.
"""

from __future__ import annotations

import json
import random
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

from cluster.demo import letters
from cluster.demo.assets import DemoAssets, peft_config
from cluster.demo.words import (
    ARROW,
    BOS,
    DIGITS,
    ENGLISH,
    EOS,
    FIRST_VOCAB,
    FRENCH,
    NUMBERS,
    PAD,
    TOOL_WORDS,
    UNK,
    UPPER,
    VOCAB,
    WORDS,
)

ROOT = Path(__file__).resolve().parents[2] / "assets" / "demo-trained"
MAX_WORDS = 8
SHOWCASE_PROMPT = "cat big 7 red sun ->"  # what `lorafleet up` sends to every adapter
# Chat: the model knows one turn, so the last user message becomes the prompt.
CHAT_TEMPLATE = (
    "{{ (messages | selectattr('role', 'equalto', 'user') | list | last)['content'] }}"
    "{% if add_generation_prompt %} ->{% endif %}"
)
TRAIN_SEED, HELD_OUT_SEED = 0, 1

MODEL = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 64,
}
LORA_RANK, LORA_ALPHA = 16, 32
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
BASE_STEPS, ADAPTER_STEPS, TOOL_WORDS_STEPS, LETTERS_STEPS, BATCH = 1000, 300, 300, 500, 64

_TO_UPPER = dict(zip(ENGLISH, UPPER))
_TO_FRENCH = dict(zip(ENGLISH, FRENCH))
_TO_NUMBER = dict(zip(DIGITS, NUMBERS))
_SOURCE = [*ENGLISH, *DIGITS]  # adapter prompts: English words and digits


def _mapped(table: dict[str, str]) -> Callable[[list[str]], list[str]]:
    return lambda words: [table.get(w, w) for w in words]


# name -> (what it does, the words its prompts draw from, the answer to a prompt's words)
TASKS: dict[str, tuple[str, list[str], Callable[[list[str]], list[str]]]] = {
    "uppercase": ("every word in capitals", _SOURCE, _mapped(_TO_UPPER)),
    "reverse": ("the words in reverse order", _SOURCE, lambda words: words[::-1]),
    "french": ("English words in French", _SOURCE, _mapped(_TO_FRENCH)),
    "digits": ("digits spelled out as words", _SOURCE, _mapped(_TO_NUMBER)),
    "count": ("how many words there are", _SOURCE, lambda words: [NUMBERS[len(words)]]),
}
BASE_TASK = ("the words, copied", WORDS, lambda words: list(words))


def examples(task: str | None, n: int, seed: int) -> list[tuple[str, str]]:
    """n (prompt, answer) pairs for `task` (None: the base model's copy task)."""
    _, pool, answer = TASKS[task] if task else BASE_TASK
    rng = random.Random(f"{task}/{seed}")
    out = []
    for _ in range(n):
        words = rng.sample(pool, rng.randint(1, MAX_WORDS))
        out.append((" ".join([*words, ARROW]), " ".join(answer(words))))
    return out


def demo_assets(root: Path = ROOT) -> DemoAssets:
    """The trained demo under `root` (default: the committed one): model + one adapter per
    task. FileNotFoundError, saying how to rebuild it, if a file is missing."""
    names = [*TASKS, letters.NAME]
    assets = DemoAssets(root, root / "model", {n: root / "adapters" / n for n in names})
    needed = [assets.model_dir / "model.safetensors"]
    needed += [p / "adapter_model.safetensors" for p in assets.adapters.values()]
    if missing := [str(p) for p in needed if not p.is_file()]:
        raise FileNotFoundError(
            f"the trained demo is incomplete ({', '.join(missing)} missing); rebuild it with "
            f"`lorafleet demo-assets --trained --retrain --out {root}`"
        )
    return assets


def copy_demo_assets(out: Path) -> DemoAssets:
    """A copy of the committed trained demo in `out` (to edit, or to serve from elsewhere)."""
    shutil.copytree(demo_assets().root, out, dirs_exist_ok=True)
    return demo_assets(Path(out))


TRAIN_THREADS = 2  # the committed weights were trained with 2 intra-op threads


def train(out: Path = ROOT, log: Callable[[str], None] = print) -> DemoAssets:
    """Train the base model and every adapter; write them to `out` (replaced atomically).

    Reproducible on one machine: seeded data and initialisation, deterministic algorithms,
    and a fixed thread count (a float sum split over another number of threads rounds
    differently). Another CPU may still differ in the last bits (its vector kernels)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(TRAIN_THREADS)
    torch.use_deterministic_algorithms(True)
    try:
        return _train(Path(out).absolute(), log)
    finally:
        torch.use_deterministic_algorithms(False)
        torch.set_num_threads(threads)


def _train(out: Path, log: Callable[[str], None]) -> DemoAssets:
    torch.manual_seed(0)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        tokenizer = _tokenizer()
        start = time.monotonic()
        model = _train_base(tokenizer, log)
        # adapters train on the weights as served: rounded to fp16 like the saved file
        model = model.half().float()
        log(f"base model: {time.monotonic() - start:.0f}s")
        for name in TASKS:
            start = time.monotonic()
            data = examples(name, ADAPTER_STEPS * BATCH, TRAIN_SEED)
            lora = _train_adapter(model, tokenizer, name, data, ADAPTER_STEPS, log)
            _save_adapter(lora, tmp / "adapters" / name)
            log(f"adapter {name}: {time.monotonic() - start:.0f}s")
        _train_tool_words_and_letters(model, tokenizer, tmp, log)
        for path in [tmp, *tmp.rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return demo_assets(out)


def _train_tool_words_and_letters(model, tokenizer, out: Path, log) -> None:
    """The base model with the tool words (`out`/model) and the letters adapter."""
    start = time.monotonic()
    model = _learn_tool_words(model, tokenizer, log)
    _save_model(model, tokenizer, out / "model")
    log(f"tool words: {time.monotonic() - start:.0f}s")
    _train_letters(model.half().float(), tokenizer, out, log)


def _train_letters(model, tokenizer, out: Path, log) -> None:
    """The letters adapter (and its chat template) in `out`/adapters, on `model` (the
    base with the tool words, rounded to fp16 as served)."""
    start = time.monotonic()
    data = letters.examples(LETTERS_STEPS * BATCH, TRAIN_SEED)
    lora = _train_adapter(model, tokenizer, letters.NAME, data, LETTERS_STEPS, log)
    _save_adapter(lora, out / "adapters" / letters.NAME)
    (out / "adapters" / letters.NAME / "chat_template.jinja").write_text(letters.TEMPLATE + "\n")
    log(f"adapter {letters.NAME}: {time.monotonic() - start:.0f}s")


def tool_words_examples(n: int, seed: int) -> list[tuple[str, str]]:
    """n copy prompts over every word, the tool words included."""
    rng = random.Random(f"tool-words/{seed}")
    pool = [*WORDS, *TOOL_WORDS]
    out = []
    for _ in range(n):
        words = rng.sample(pool, rng.randint(1, MAX_WORDS))
        out.append((" ".join([*words, ARROW]), " ".join(words)))
    return out


def _learn_tool_words(model, tokenizer, log):
    """The base model with rows for TOOL_WORDS in its embedding and output layer, trained
    on the copy task while every other weight stays as it is: the first words' logits
    stay as they were, and so do the adapters trained before, their files and answers."""
    torch.manual_seed(len(VOCAB))
    first = model.config.vocab_size
    embed, head = model.get_input_embeddings().weight, model.lm_head.weight
    scales = embed.detach().std(), head.detach().std()
    before = embed.detach().clone(), head.detach().clone()
    model.resize_token_embeddings(len(VOCAB), mean_resizing=False)
    embed, head = model.get_input_embeddings().weight, model.lm_head.weight
    with torch.no_grad():  # new rows at the scale of the trained ones
        for weight, scale in zip((embed, head), scales):
            weight[first:] = torch.randn(len(VOCAB) - first, weight.shape[1]) * scale
    for p in model.parameters():
        p.requires_grad_(False)
    for weight in (embed, head):
        weight.requires_grad_(True)
        weight.register_hook(lambda grad: torch.cat([torch.zeros_like(grad[:first]), grad[first:]]))
    data = tool_words_examples(TOOL_WORDS_STEPS * BATCH, TRAIN_SEED)
    _fit(model, [embed, head], tokenizer, data, "tool words", TOOL_WORDS_STEPS, 1e-2, log)
    for weight, old in zip((embed, head), before):
        weight.requires_grad_(False)
        assert torch.equal(weight[:first], old), "a first word's row changed"
    return _copy(model)  # without the hooks, every weight trainable again


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        model_max_length=MODEL["max_position_embeddings"],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _batch(tokenizer, pairs: list[tuple[str, str]]) -> tuple[torch.Tensor, torch.Tensor]:
    """input ids [B, L] right-padded; labels with -100 everywhere but the answer and </s>."""
    rows = []
    for prompt, answer in pairs:
        p, a = tokenizer(prompt)["input_ids"], tokenizer(answer)["input_ids"]
        rows.append((p + a + [tokenizer.eos_token_id], len(p)))
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    labels = torch.full((len(rows), width), -100)
    for i, (row, n_prompt) in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
        labels[i, n_prompt : len(row)] = torch.tensor(row[n_prompt:])
    return ids, labels


def _fit(model, params, tokenizer, data, label: str, steps: int, lr: float, log) -> None:
    """Trains `params` on `data` ((prompt, answer) pairs, BATCH a step)."""
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, lr, total_steps=steps, pct_start=0.1)
    model.train()
    for step in range(steps):
        ids, labels = _batch(tokenizer, data[step * BATCH : (step + 1) * BATCH])
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        if step % 200 == 0 or step == steps - 1:
            log(f"  {label} step {step}: loss {loss.item():.4f}")
    model.eval()


def _train_base(tokenizer, log):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(FIRST_VOCAB),  # the tool words come later (_learn_tool_words)
        **MODEL,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = LlamaForCausalLM(config)
    data = examples(None, BASE_STEPS * BATCH, TRAIN_SEED)
    _fit(model, list(model.parameters()), tokenizer, data, "base", BASE_STEPS, 3e-3, log)
    return model


def _train_adapter(base, tokenizer, name: str, data: list[tuple[str, str]], steps: int, log):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(sum(name.encode()))
    config = LoraConfig(
        r=LORA_RANK, lora_alpha=LORA_ALPHA, target_modules=list(LORA_TARGETS), lora_dropout=0.0
    )
    model = get_peft_model(_copy(base), config)
    params = [p for p in model.parameters() if p.requires_grad]
    _fit(model, params, tokenizer, data, name, steps, 3e-3, log)
    return model


def _copy(model):
    clone = type(model)(model.config)
    clone.load_state_dict(model.state_dict())
    return clone


def _save_model(model, tokenizer, model_dir: Path) -> None:
    from transformers import GenerationConfig

    model_dir.mkdir(parents=True)
    model.config.architectures = ["LlamaForCausalLM"]
    model.config.dtype = "float16"
    model.config.save_pretrained(model_dir)
    ids = {f"{t}_token_id": getattr(tokenizer, f"{t}_token_id") for t in ("bos", "eos", "pad")}
    GenerationConfig(**ids).save_pretrained(model_dir)
    weights = {k: v.detach().half().contiguous() for k, v in model.state_dict().items()}
    save_file(weights, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(model_dir)


def _save_adapter(model, out: Path) -> None:
    from peft import get_peft_model_state_dict

    out.mkdir(parents=True)
    state = get_peft_model_state_dict(model, save_embedding_layers=False)  # LoRA A/B only
    tensors = {k: v.detach().half().contiguous() for k, v in sorted(state.items())}
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = _peft_config_for(LORA_RANK, LORA_ALPHA, LORA_TARGETS)
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _peft_config_for(r: int, alpha: int, targets: tuple[str, ...]) -> dict:
    from cluster.demo.assets import DemoSpec

    config = peft_config(DemoSpec(), r, alpha, tuple(sorted(targets)), False)
    return {**config, "base_model_name_or_path": "lorafleet-demo-trained"}
