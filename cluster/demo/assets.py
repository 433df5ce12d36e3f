"""Deterministic demo assets: a random Llama-family model and PEFT LoRA adapters.

Nothing can be downloaded here, so demos and tests serve a model built from a seed: a real
Hugging Face directory (config, safetensors, tokenizer) plus adapters in exact PEFT format,
written without importing peft. The same spec gives byte-identical files on every build.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import shutil
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from safetensors.torch import save_file

FORMAT_VERSION = 1
MANIFEST = "lorafleet_demo.json"
ARCHS = ("llama", "mistral", "qwen2")
# ids 0, 1, 2 for <pad>, <s>, </s>: the usual Llama bos=1 / eos=2 convention
PAD, BOS, EOS = "<pad>", "<s>", "</s>"
LLAMA3_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,
}
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}"
    "{{ eos_token }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
# Init scales. Every linear layer reads an RMS-normed (unit-rms) input, so weights of std
# 1/sqrt(in) give unit-variance outputs: q.k/sqrt(head_dim) then has std ~1, i.e. attention
# is neither uniform nor one-hot. The logits are norm(h) . lm_head, so an lm_head (and an
# embedding that may be tied to it) of std LOGIT_STD/sqrt(hidden) gives logits of std
# ~LOGIT_STD: the top-1/top-2 gap is then ~1-2 logits, far above float noise, so greedy
# decoding is reproducible across kernels. The residual branches (o_proj, down_proj) write
# ~LOGIT_STD/sqrt(2 * layers) each, so the final residual has rms ~LOGIT_STD whatever the
# depth and the embedding is only ~1/sqrt(hidden) of it: a tied lm_head does not just echo
# the input token.
LOGIT_STD = 6.0
# Each LoRA delta B@A*scaling has entries of LORA_REL times the std of the weight it adapts:
# it changes most greedy tokens of these chaotic random models, yet logits stay as peaky.
LORA_REL = 0.3
ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TARGET_CYCLE = (ALL_TARGETS, ALL_TARGETS[:4], ("q_proj", "v_proj"))
RANK_CYCLE = (8, 16, 32, 64)


@dataclass(frozen=True)
class DemoSpec:
    arch: str = "llama"  # "llama" | "mistral" | "qwen2"
    hidden_size: int = 512
    num_layers: int = 8
    num_heads: int = 8
    num_kv_heads: int = 2  # GQA
    intermediate_size: int = 1408
    vocab_size: int = 2048  # the tokenizer is trained to exactly this size
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # e.g. LLAMA3_ROPE_SCALING
    tie_word_embeddings: bool = False
    num_adapters: int = 8
    seed: int = 0

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"arch must be one of {ARCHS}, got {self.arch!r}")
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError("hidden_size % num_heads and num_heads % num_kv_heads must be 0")
        if self.vocab_size < 300:
            raise ValueError("vocab_size must be >= 300 (256 bytes + specials + merges)")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def to_json(self) -> dict:
        return {"format_version": FORMAT_VERSION, "spec": asdict(self)}


@dataclass(frozen=True)
class DemoAssets:
    root: Path
    model_dir: Path
    adapters: dict[str, Path]  # name -> PEFT directory, insertion-ordered


def tiny_spec(arch: str = "llama", **overrides) -> DemoSpec:
    """A spec small enough for unit tests (a build takes well under a second)."""
    base = DemoSpec(
        arch=arch,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=128,
        vocab_size=512,
        num_adapters=4,
        tie_word_embeddings=arch == "qwen2",  # as the small Qwen2 checkpoints do
    )
    return replace(base, **overrides)


def build_demo_assets(out_dir: str | Path, spec: DemoSpec = DemoSpec()) -> DemoAssets:
    """Build (or reuse) the demo model and adapters under `out_dir`.

    Idempotent: a finished build of the same spec is returned untouched. The tree is built in
    a temp dir beside `out_dir` and renamed into place, so readers never see half a tree; if
    another process wins the rename with the same spec, its tree is used.
    """
    out = Path(out_dir).expanduser().absolute()
    if _manifest_matches(out, spec):
        return _assets(out, spec)
    if out.exists() and any(out.iterdir()) and not (out / MANIFEST).exists():
        raise FileExistsError(f"{out} exists and is not a lorafleet demo build; refusing")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        _build_tree(tmp, spec)
        if out.exists() and any(out.iterdir()) and not _manifest_matches(out, spec):
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.rename(out, old / "tree")  # a build of another spec: swap it out
            shutil.rmtree(old, ignore_errors=True)
        try:
            os.rename(tmp, out)  # atomic; replaces `out` only if it is an empty dir
        except OSError:
            if not _manifest_matches(out, spec):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return _assets(out, spec)


def cached_demo_assets(
    spec: DemoSpec = DemoSpec(), cache_root: str | Path | None = None
) -> DemoAssets:
    """Build once per spec under `cache_root`, $LORAFLEET_CACHE or ~/.cache/lorafleet."""
    root = cache_root or os.environ.get("LORAFLEET_CACHE") or Path.home() / ".cache/lorafleet"
    digest = hashlib.sha256(json.dumps(spec.to_json(), sort_keys=True).encode()).hexdigest()
    return build_demo_assets(Path(root) / f"demo-{spec.arch}-{digest[:12]}", spec)


def _manifest_matches(out: Path, spec: DemoSpec) -> bool:
    try:
        return json.loads((out / MANIFEST).read_text()) == spec.to_json()
    except (OSError, ValueError):
        return False


def _assets(out: Path, spec: DemoSpec) -> DemoAssets:
    names = [plan[0] for plan in adapter_plans(spec)]
    return DemoAssets(out, out / "model", {n: out / "adapters" / n for n in names})


def _build_tree(root: Path, spec: DemoSpec) -> None:
    model_dir = root / "model"
    tokenizer = _build_tokenizer(spec, model_dir)
    _write_configs(spec, model_dir, tokenizer)
    weights = _model_weights(spec)
    save_file(weights, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    for plan in adapter_plans(spec):
        write_adapter(spec, root / "adapters" / plan[0], *plan)
    for path in [root, *root.rglob("*")]:  # mkdtemp and safetensors create owner-only modes
        path.chmod(0o755 if path.is_dir() else 0o644)
    # the manifest goes last: its presence marks a complete tree
    (root / MANIFEST).write_text(json.dumps(spec.to_json(), indent=2, sort_keys=True) + "\n")


def seeded_randn(spec: DemoSpec, name: str, shape: tuple[int, ...], std: float) -> torch.Tensor:
    """One tensor from its own generator, seeded by (spec.seed, name) through sha256."""
    digest = hashlib.sha256(f"{spec.seed}/{name}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    return torch.randn(shape, generator=gen, dtype=torch.float32) * std


def _module_shapes(spec: DemoSpec) -> dict[str, tuple[int, int, float]]:
    """module -> (in_features, out_features, weight std), per the scales described above."""
    h, kv, inter = spec.hidden_size, spec.num_kv_heads * spec.head_dim, spec.intermediate_size
    branch = LOGIT_STD / math.sqrt(2 * spec.num_layers)
    return {
        "q_proj": (h, h, h**-0.5),
        "k_proj": (h, kv, h**-0.5),
        "v_proj": (h, kv, h**-0.5),
        "o_proj": (h, h, branch * h**-0.5),
        "gate_proj": (h, inter, h**-0.5),
        "up_proj": (h, inter, h**-0.5),
        "down_proj": (inter, h, branch * inter**-0.5),
    }


def _model_weights(spec: DemoSpec) -> dict[str, torch.Tensor]:
    h, emb_std = spec.hidden_size, LOGIT_STD / math.sqrt(spec.hidden_size)
    w = {"model.embed_tokens.weight": seeded_randn(spec, "embed", (spec.vocab_size, h), emb_std)}
    shapes = _module_shapes(spec)
    for i in range(spec.num_layers):
        p = f"model.layers.{i}"
        for mod, (n_in, n_out, std) in shapes.items():
            group = "mlp" if mod in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            w[f"{p}.{group}.{mod}.weight"] = seeded_randn(spec, f"{p}.{mod}", (n_out, n_in), std)
            if spec.arch == "qwen2" and mod in ("q_proj", "k_proj", "v_proj"):
                w[f"{p}.self_attn.{mod}.bias"] = seeded_randn(spec, f"{p}.{mod}.b", (n_out,), 0.1)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            w[f"{p}.{norm}.weight"] = 1.0 + seeded_randn(spec, f"{p}.{norm}", (h,), 0.1)
    w["model.norm.weight"] = 1.0 + seeded_randn(spec, "norm", (h,), 0.1)
    if not spec.tie_word_embeddings:
        w["lm_head.weight"] = seeded_randn(spec, "lm_head", (spec.vocab_size, h), emb_std)
    return w


def _write_configs(spec: DemoSpec, model_dir: Path, tokenizer) -> None:
    from transformers import GenerationConfig, LlamaConfig, MistralConfig, Qwen2Config

    cls = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config}[spec.arch]
    ids = {f"{t}_token_id": getattr(tokenizer, f"{t}_token_id") for t in ("bos", "eos", "pad")}
    extra = {"sliding_window": None} if spec.arch != "llama" else {}
    config = cls(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        rope_theta=spec.rope_theta,
        rope_scaling=dict(spec.rope_scaling) if spec.rope_scaling else None,
        tie_word_embeddings=spec.tie_word_embeddings,
        dtype="float32",
        **ids,
        **extra,
    )
    config.architectures = [cls.__name__.replace("Config", "ForCausalLM")]
    config.save_pretrained(model_dir)
    GenerationConfig(**ids).save_pretrained(model_dir)


def _corpus(seed: int) -> list[str]:
    """English-like lines: a fixed word list, invented names, numbers and punctuation."""
    rng = random.Random(seed)
    words = (
        "the a an of to and in is was it for on with as at by from that this be are not or "
        "have has had but what all were when we there can more if no out so said up about "
        "time day year way people man woman child world life hand part place week case point "
        "number group problem fact server model token request adapter batch cache memory queue "
        "replica router kernel layer weight vector matrix stream slot rank cluster node worker "
        "good new first last long great little own other old right big high small large next "
        "early young important few public bad same able quick slow bright dark red blue green "
        "make go know take see come think look want give use find tell ask work seem feel try "
        "leave call run serve load move write read learn build send keep hold bring begin show "
        "city river mountain garden window table letter story music paper market light water"
    ).split()
    # invented names give BPE enough distinct words to fill a few thousand merges
    syllables = "ka lo mi ren tor sa vel dun ia pho bre qui zan ost el um ar ith gor nep".split()
    names = ["".join(rng.choices(syllables, k=rng.randint(2, 4))) for _ in range(1500)]
    lines = []
    for _ in range(4000):
        toks = [rng.choice(words) for _ in range(rng.randint(4, 14))]
        for _ in range(rng.randint(0, 3)):
            name = rng.choice(names)
            toks.insert(rng.randrange(len(toks)), name.title() if rng.random() < 0.7 else name)
        if rng.random() < 0.4:
            toks.insert(rng.randrange(len(toks)), str(rng.randint(0, 10 ** rng.randint(1, 6))))
        toks[0] = toks[0].capitalize()
        if rng.random() < 0.3:
            toks[rng.randrange(len(toks))] += rng.choice([",", ";", ":"])
        lines.append(" ".join(toks) + rng.choice([".", ".", ".", "?", "!"]))
    return lines


def _build_tokenizer(spec: DemoSpec, model_dir: Path):
    """Byte-level BPE trained on `_corpus`, saved with save_pretrained.

    `tokenizer("text")` returns the BPE ids only: no bos/eos is added (the chat template
    writes `<s>` itself). Decoding round-trips any NFC text, ASCII included: all 256 bytes
    are tokens.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from tokenizers.trainers import BpeTrainer
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    # Qwen2's pipeline (NFC, its split regex, then byte-level), because AutoTokenizer rebuilds
    # a qwen2 model's tokenizer with exactly that pipeline from tokenizer.json's vocab/merges.
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=[PAD, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(spec.seed), trainer=trainer)
    # a corpus too small for the requested size: fill with reserved tokens, never leave a gap
    fill = spec.vocab_size - tok.get_vocab_size()
    tok.add_special_tokens([f"<|reserved_{k}|>" for k in range(fill)])
    # unk_token=None is written out explicitly, else Qwen2Tokenizer adds its own <|endoftext|>
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=None,
        model_max_length=spec.max_position_embeddings,
    )
    hf.chat_template = CHAT_TEMPLATE
    hf.save_pretrained(model_dir)
    return hf


def adapter_plans(spec: DemoSpec) -> list[tuple[str, int, int, tuple[str, ...], bool]]:
    """(name, r, lora_alpha, target_modules, use_rslora) per adapter; cycles give variety."""
    plans = []
    for i in range(spec.num_adapters):
        r = RANK_CYCLE[i % len(RANK_CYCLE)]
        alpha = 2 * r if i % 2 else 16
        targets = tuple(sorted(TARGET_CYCLE[i % len(TARGET_CYCLE)]))
        plans.append((f"adapter-{i:02d}", r, alpha, targets, i % 5 == 2))
    return plans


def write_adapter(
    spec: DemoSpec, out: Path, name: str, r: int, alpha: int, targets: tuple, rslora: bool
) -> None:
    """Writes a PEFT adapter of `spec`'s model at `out` (made here): its weights drawn by
    (spec.seed, name), deltas of LORA_REL of each targeted weight's scale."""
    scaling = alpha / math.sqrt(r) if rslora else alpha / r
    shapes = _module_shapes(spec)
    tensors = {}
    for i in range(spec.num_layers):
        for mod in targets:
            n_in, n_out, std = shapes[mod]
            group = "mlp" if mod in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{i}.{group}.{mod}"
            # std(scaling * B @ A) = scaling * b_std * a_std * sqrt(r) = LORA_REL * std
            a_std, b_std = n_in**-0.5, LORA_REL * std * math.sqrt(n_in / r) / scaling
            tensors[f"{key}.lora_A.weight"] = seeded_randn(
                spec, f"{name}/{key}.A", (r, n_in), a_std
            )
            tensors[f"{key}.lora_B.weight"] = seeded_randn(
                spec, f"{name}/{key}.B", (n_out, r), b_std
            )
    out.mkdir(parents=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(
        json.dumps(peft_config(spec, r, alpha, targets, rslora), indent=2, sort_keys=True) + "\n"
    )


def peft_config(spec: DemoSpec, r: int, alpha: int, targets: tuple, rslora: bool) -> dict:
    """The adapter_config.json of a demo adapter (its base named after spec.arch)."""
    # The LoraConfig fields peft has written since 0.13; newer peft fills later ones with its
    # defaults, and older peft would reject keys it does not know.
    return {
        "alpha_pattern": {},
        "auto_mapping": None,
        "base_model_name_or_path": f"lorafleet-demo-{spec.arch}",
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "layer_replication": None,
        "layers_pattern": None,
        "layers_to_transform": None,
        "loftq_config": {},
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "megatron_config": None,
        "megatron_core": "megatron.core",
        "modules_to_save": None,
        "peft_type": "LORA",
        "r": r,
        "rank_pattern": {},
        "revision": None,
        "target_modules": list(targets),
        "task_type": "CAUSAL_LM",
        "use_dora": False,
        "use_rslora": rslora,
    }
