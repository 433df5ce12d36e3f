"""PEFT LoRA directory -> engine layout. The one conversion every adapter source uses.

Engine layout: per layer, per target module, A `[r_m, in]` and B `[out, r_m]` at the
module's own rank, plus one rank (the largest module's) and one scaling per adapter: the
engine holds and computes each projection group at the largest rank of its modules
(LoRAAdapterWeights.group_rank; `rank` is what a load reserves before its weights are
known), and multiplies every module's delta by `scaling`.

PEFT is more general: `rank_pattern` and `alpha_pattern` give a module its own rank r_m and
alpha_m, so its own scaling s_m = alpha_m / r_m (alpha_m / sqrt(r_m) with rsLoRA). Such an
adapter is converted exactly:

- each module keeps its own rank: host and object-store bytes are the real ones, and a
  group holds and computes only as many rank rows as its largest module has (a rank-64
  attention with a rank-8 MLP holds 8 device rows per layer in the MLP arenas and costs
  rank-8 work there);
- its scaling is the default one (lora_alpha / r) when a module uses it, else the one most
  modules use; a module whose scaling differs has the ratio folded into its B
  (B_m · s_m / scaling), in fp32 and stored back in B's dtype (one extra rounding for a
  16-bit adapter, none in effect for fp32).

A module's rank is its lora_A's row count, checked against what `r` / `rank_pattern` say
for it. Pattern keys are matched as PEFT does (peft.utils.other.get_pattern_key): against
the module's name in the base model ("model.layers.1.mlp.down_proj", the tensor name less
"base_model.model." and ".lora_A.weight"), the first key in the file's order for which
`re.match(rf"(.*\\.)?({key})$", name)` matches wins; no match: `r` / `lora_alpha`.

Weights come from adapter_model.safetensors or, from older trainers (PEFT's
save_pretrained(safe_serialization=False)), adapter_model.bin, read with
torch.load(weights_only=True); safetensors wins when both are there.

Expert LoRA on a mixture of experts is read from either layout its keys show, per-expert
2D modules or PEFT target_parameters 3D (model/expert_adapters.py), and held per
(layer, expert_gate_proj / expert_up_proj / expert_down_proj) as A [E, r_m, in] and B
[E, out, r_m] (experts the adapter leaves out: zeros), with the same rank and scaling
rules per expert module.

What adapter_config.json may hold is model/peft_config.py's; refused here: LoRA on
embed_tokens / lm_head (unless engine.lora_embeddings), on the experts (unless
engine.lora_experts: their arenas are most of an MoE model's adapter memory), and tensors
of modules the family does not have.
layers_to_transform / layers_pattern are served as written: the file must hold weights
only for the layers they select.

LoRA on a k_proj / v_proj its layer does not have (Gemma 4's KV-sharing layers have
neither, its full layers whose values are the keys' projection no v_proj) is skipped, not
refused: transformers builds no such module there, so PEFT loads the file and drops those
tensors (unexpected keys under strict=False), and in any model their output would go
unused. The load report counts the layers the module is applied on (self_attn.k_proj ×4
of 6 layers), so the skip shows.

A load reports what it serves by the names the file uses within a layer
(LoRAAdapterWeights.applied: "linear_attn.in_proj_qkv" ×18, "self_attn.q_proj" ×6), so a
layer type or a layer the adapter leaves out shows.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from replica.model.expert_adapters import (
    EXPERT_MODULES,
    expert_parts,
    is_expert_key,
    stack_experts,
)
from replica.model.hybrid import LINEAR_MODULES
from replica.model.peft_config import (
    PEFT_DEFAULT_ALPHA,
    AdapterFormatError,
    check_config,
    check_number,
    layer_filter,
    pattern,
    pattern_key,
    read_config,
)
from replica.model.spec import ATTENTION_MODULES, ModelSpec

TARGETABLE = ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj", "gate_proj", "up_proj",
              "gate_up_proj", "down_proj", *LINEAR_MODULES, "embed_tokens", "lm_head",
              *EXPERT_MODULES)  # fmt: skip
# An adapter directory's weights file, in order of preference (the .bin: older trainers)
WEIGHTS_FILES = ("adapter_model.safetensors", "adapter_model.bin")
# base_model.model.<the decoder's prefix>layers.N.(self_attn|mlp).<module>.lora_(A|B).weight;
# a multimodal Gemma 3 keeps its decoder under language_model (transformers 4 or 5 naming)
_KEY = re.compile(
    r"^base_model\.model\.(?:model\.language_model\.|language_model\.model\.|model\.)"
    r"layers\.(\d+)\.(?:(?:self_attn|linear_attn|mlp)\.)?(\w+)\.lora_([AB])\.weight$"
)
_PEFT_PREFIX = "base_model.model."
# LoRA on a multimodal checkpoint's vision or audio side: images and audio are not served,
# so it never applies
_VISION = re.compile(
    r"^base_model\.model\.(?:model\.)?"
    r"(?:vision_tower|multi_modal_projector|audio_tower|embed_vision|embed_audio|visual)\."
)
# LoRA on the vocabulary modules: PEFT's embedding LoRA (lora_embedding_A [r, vocab],
# lora_embedding_B [hidden, r]) and a head LoRA (lora_A [r, hidden], lora_B [vocab, r])
_VOCAB_KEY = re.compile(
    r"^base_model\.model\.(?:(?:model\.language_model\.|language_model\.model\.|model\.)"
    r"(embed_tokens)\.lora_embedding_([AB])|(?:language_model\.)?(lm_head)\.lora_([AB])\.weight)$"
)
VOCAB_LAYER = -1  # the (layer, module) key of embed_tokens / lm_head weights
# The copies of the base's embedding / head PEFT saves beside their LoRA
# (save_embedding_layers="auto", for a resized vocabulary): with the base's vocabulary they
# are the base's own weights, not read
_VOCAB_COPY = re.compile(
    r"^base_model\.model\.(?:.*\.)?(?:embed_tokens|lm_head)\.base_layer\.weight$"
)
# A module's path in the base model up to its layer's, and an expert's index in it: what
# LoRAAdapterWeights.layer_paths leaves out
_LAYER_PREFIX = re.compile(r"^(?:.*\.)?layers\.\d+\.")
_EXPERT_INDEX = re.compile(r"\.experts\.\d+\.")
# Anything else of the input embedding or the output head (a saved copy, a bias)
_EMBED_HEAD = re.compile(r"^base_model\.model\.(?:.*\.)?(?:embed_tokens|lm_head)\.")
# (module, A [r, in], B [out, r]) -> the part of (A, B) to keep, as views: how a
# tensor-parallel rank keeps only its shard (TPShard.slice_lora).
SelectLoRA = Callable[..., tuple[Any, Any]]  # (module, A, B, layer=) -> (A, B)


@dataclass
class LoRAAdapterWeights:
    """A converted adapter, ready to be copied into a device slot."""

    name: str
    rank: int
    scaling: float
    target_modules: tuple[str, ...]
    # (layer, module) -> (A [r, in], B [out, r]); modules the adapter does not target are absent
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)
    # (layer, module) -> where the adapter's file puts it in its layer, experts' indices
    # left out ("self_attn.q_proj", "linear_attn.in_proj_qkv", "mlp.experts.gate_up_proj";
    # "embed_tokens" / "lm_head" on VOCAB_LAYER): what applied() counts; absent: `module`
    layer_paths: dict[tuple[int, str], str] = field(default_factory=dict, repr=False)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())

    def module_ranks(self) -> dict[str, int]:
        """Each targeted module's largest rank over the layers."""
        ranks: dict[str, int] = {}
        for (_, m), (a, _b) in self.weights.items():  # A [r, in], or an expert's [E, r, in]
            ranks[m] = max(ranks.get(m, 0), a.shape[-2])
        return ranks

    def applied(self) -> dict[str, int]:
        """Each module the adapter changes, named as its file names it within a layer
        ("linear_attn.in_proj_qkv", "self_attn.q_proj"), with the number of layers it
        changes it on (the vocabulary modules count one).

        What a load reports, so an adapter is never silently partly applied, per layer
        type: a hybrid model's linear-attention and attention layers show apart."""
        layers: dict[str, set[int]] = {}
        for layer, module in self.weights:
            layers.setdefault(self.layer_paths.get((layer, module), module), set()).add(layer)
        return {path: len(on) for path, on in sorted(layers.items())}

    def group_rank(self, modules: tuple[str, ...]) -> int:
        """The rank rows a projection group holds and computes with: its largest module's
        rank, over every layer (0 when the adapter targets none of `modules`)."""
        ranks = self.module_ranks()
        return max((ranks.get(m, 0) for m in modules), default=0)

    def select(self, select: SelectLoRA) -> LoRAAdapterWeights:
        """A copy keeping only the part `select` picks of each module's weights (the
        rest is not referenced afterwards, so it can be freed)."""
        weights = {}
        for (layer, module), (a, b) in self.weights.items():
            a, b = select(module, a, b, layer=layer)
            weights[(layer, module)] = (_own(a), _own(b))
        return LoRAAdapterWeights(
            self.name, self.rank, self.scaling, self.target_modules, weights, self.layer_paths
        )


def _own(t: torch.Tensor) -> torch.Tensor:
    return t.clone(memory_format=torch.contiguous_format)


def adapter_weights_file(path: str | Path) -> Path | None:
    """The weights file of adapter directory `path` (WEIGHTS_FILES order), None if none."""
    for file_name in WEIGHTS_FILES:
        f = Path(path) / file_name
        if f.is_file():
            return f
    return None


def load_peft_adapter(
    path: str | Path,
    spec: ModelSpec,
    max_lora_rank: int,
    name: str | None = None,
    lora_embeddings: bool = False,
    lora_experts: bool = False,
) -> LoRAAdapterWeights:
    """Read and validate a PEFT LoRA directory against `spec`; raise AdapterFormatError."""
    path = Path(path)
    config = read_config(path)
    weights_file = adapter_weights_file(path)
    if weights_file is None:
        raise AdapterFormatError(
            f"{path}: missing adapter_model.safetensors (or adapter_model.bin)"
        )
    tensors = _read_tensors(weights_file)
    return convert_peft_tensors(
        name or path.name, config, tensors, spec, max_lora_rank, lora_embeddings, lora_experts
    )


def _read_tensors(weights_file: Path) -> dict[str, torch.Tensor]:
    if weights_file.suffix == ".safetensors":
        try:
            return load_file(str(weights_file))
        except Exception as e:  # safetensors raises several types for corrupt files
            raise AdapterFormatError(f"{weights_file}: unreadable safetensors file ({e})") from None
    try:
        # weights_only: tensors and plain containers only, never arbitrary pickled code
        loaded = torch.load(weights_file, map_location="cpu", weights_only=True)
    except Exception as e:  # pickle, zip and torch errors for corrupt or unsafe files
        raise AdapterFormatError(f"{weights_file}: unreadable PyTorch .bin file ({e})") from None
    if not isinstance(loaded, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in loaded.items()
    ):
        raise AdapterFormatError(f"{weights_file}: expected a state dict (names -> tensors)")
    # a tensor saved as a view keeps its whole storage alive: own just its elements
    return {
        k: v if v.untyped_storage().nbytes() == v.nbytes else _own(v) for k, v in loaded.items()
    }


@dataclass
class _Module:
    """One PEFT LoRA module of the file: (layer, module) and its name in the base model."""

    path: str  # e.g. "model.layers.1.mlp.down_proj": what rank/alpha patterns match
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # "A" / "B"


def convert_peft_tensors(
    name: str,
    config: dict,
    tensors: dict[str, torch.Tensor],
    spec: ModelSpec,
    max_lora_rank: int,
    lora_embeddings: bool = False,
    lora_experts: bool = False,
) -> LoRAAdapterWeights:
    """Validate PEFT config + tensors and regroup them per (layer, module); embed_tokens
    and lm_head weights (allowed with `lora_embeddings`) under layer VOCAB_LAYER, expert
    LoRA (allowed with `lora_experts`) per EXPERT_MODULES."""
    check_config(name, config)
    r = config["r"]
    alpha = config.get("lora_alpha", PEFT_DEFAULT_ALPHA)
    check_number(name, "lora_alpha", alpha)
    rank_pattern = pattern(name, config, "rank_pattern")
    alpha_pattern = pattern(name, config, "alpha_pattern")
    in_layers = layer_filter(name, config)
    rslora = bool(config.get("use_rslora"))

    # (layer, module, expert) -> its tensors; expert -1: not an expert module
    pairs: dict[tuple[int, str, int], _Module] = {}
    multimodal = len(spec.weight_prefixes) > 1
    shapes, fused = spec.lora_shapes(), spec.fused_modules()
    expert_tensors = {}
    skipped: set[str] = set()  # LoRA on a k/v projection its layer does not have
    for key, tensor in tensors.items():
        if multimodal and _VISION.match(key):
            continue
        if is_expert_key(key):
            expert_tensors[key] = tensor
            continue
        if _VOCAB_COPY.match(key):
            if tensor.dim() != 2 or tensor.shape[0] != spec.vocab_size:
                raise AdapterFormatError(
                    f"{name}: {key!r} {tuple(tensor.shape)} has a vocabulary other than "
                    f"the base model's {spec.vocab_size} (an adapter for added tokens is "
                    "not served)"
                )
            continue
        v = _VOCAB_KEY.match(key)
        if v is not None:
            if not lora_embeddings:
                raise AdapterFormatError(
                    f"{name}: tensor {key!r} is LoRA on embed_tokens/lm_head, which this "
                    "server does not serve (engine.lora_embeddings: true serves it)"
                )
            module, which = v.group(1) or v.group(3), v.group(2) or v.group(4)
            path = "model.embed_tokens" if module == "embed_tokens" else "lm_head"
            pairs.setdefault((VOCAB_LAYER, module, -1), _Module(path)).tensors[which] = tensor
            continue
        m = _KEY.match(key)
        if m is None:
            if _EMBED_HEAD.match(key):
                raise AdapterFormatError(
                    f"{name}: unsupported tensor {key!r}: only LoRA A/B of embed_tokens "
                    "and lm_head are served (no saved copies or biases)"
                )
            raise AdapterFormatError(f"{name}: unsupported tensor {key!r}")
        layer, module, which = int(m.group(1)), m.group(2), m.group(3)
        layer_modules = spec.module_shapes() | spec.per_layer_input_shapes()
        if module not in layer_modules and module not in fused or module in _split_parts(fused):
            have = ", ".join(fused) + ", " if fused else ""
            have += ", ".join(m for m in layer_modules if m not in _split_parts(fused))
            raise AdapterFormatError(
                f"{name}: tensor {key!r} targets {module!r}, which model_type={spec.arch!r} "
                f"does not have (its projections: {have})"
            )
        if layer >= spec.num_layers:
            raise AdapterFormatError(
                f"{name}: tensor {key!r} targets layer {layer}, model has {spec.num_layers}"
            )
        if module in ("k_proj", "v_proj") and not spec.has_kv_projection(layer, module):
            skipped.add(key)  # transformers' layer has no such module: PEFT drops it too
            continue
        mixer = module in LINEAR_MODULES or module in ATTENTION_MODULES
        if mixer and (module in LINEAR_MODULES) != spec.is_linear(layer):
            kind = "a Gated DeltaNet" if spec.is_linear(layer) else "an attention"
            raise AdapterFormatError(
                f"{name}: tensor {key!r} targets {module!r}, which layer {layer} ({kind} "
                "layer) does not have"
            )
        path = key.removeprefix(_PEFT_PREFIX).removesuffix(f".lora_{which}.weight")
        _check_layer_filter(name, config, in_layers, path, key)
        pairs.setdefault((layer, module, -1), _Module(path)).tensors[which] = tensor
    if expert_tensors and spec.num_experts and not lora_experts:
        raise AdapterFormatError(
            f"{name}: tensor {next(iter(expert_tensors))!r} is LoRA on the experts, which "
            "this server does not serve (engine.lora_experts: true serves it)"
        )
    for part in expert_parts(name, expert_tensors, spec) if expert_tensors else ():
        _check_layer_filter(name, config, in_layers, part.path, part.path)
        entry = _Module(part.path, {"A": part.a, "B": part.b})
        pairs[(part.layer, part.module, part.expert)] = entry
    if not pairs:
        unused = f" the model uses ({len(skipped)} on k/v projections their layers lack)"
        raise AdapterFormatError(
            f"{name}: the adapter holds no LoRA weights{unused if skipped else ''}"
        )

    # (layer, module, A [r_m, in], B [out, r_m], r_m, s_m), validated
    modules = []
    for (layer, mod, expert), entry in sorted(pairs.items()):
        ab = entry.tensors
        module = mod if expert < 0 else f"{mod} expert {expert}"  # what messages name
        if set(ab) != {"A", "B"}:
            missing = ({"A", "B"} - set(ab)).pop()
            raise AdapterFormatError(f"{name}: layer {layer} {module} lacks lora_{missing}")
        parts = fused.get(mod, (mod,))
        # the layer's own shapes (Gemma 4's layers differ)
        own = shapes if layer == VOCAB_LAYER else spec.layer(layer).lora_shapes()
        in_f, out_f = own[parts[0]][0], sum(own[p][1] for p in parts)
        r_key = pattern_key(rank_pattern, entry.path)
        r_m = rank_pattern.get(r_key, r)
        a, b = ab["A"], ab["B"]
        vocab = a.shape[1] if module == "embed_tokens" else b.shape[0]
        if layer == VOCAB_LAYER and a.dim() == b.dim() == 2 and vocab != spec.vocab_size:
            raise AdapterFormatError(
                f"{name}: {module} LoRA has a vocabulary of {vocab}, the base model "
                f"{spec.vocab_size} (an adapter for added tokens is not served)"
            )
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_f or b.shape[0] != out_f:
            raise AdapterFormatError(
                f"{name}: layer {layer} {module}: lora_A {tuple(a.shape)} / lora_B "
                f"{tuple(b.shape)}, expected ({r_m}, {in_f}) / ({out_f}, {r_m}) "
                "for this base model"
            )
        if a.shape[0] != r_m or b.shape[1] != r_m:
            said = f"rank_pattern[{r_key!r}]" if r_key in rank_pattern else "r"
            raise AdapterFormatError(
                f"{name}: layer {layer} {module}: lora_A {tuple(a.shape)} / lora_B "
                f"{tuple(b.shape)} have rank {a.shape[0]}, but adapter_config.json "
                f"{said}={r_m} for {entry.path!r}"
            )
        if not (a.is_floating_point() and b.is_floating_point()):
            raise AdapterFormatError(f"{name}: layer {layer} {module}: non-float weights")
        if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())):
            # one NaN would poison every sequence batched with this adapter's slot row
            raise AdapterFormatError(f"{name}: layer {layer} {module}: NaN or infinite weights")
        alpha_m = alpha_pattern.get(pattern_key(alpha_pattern, entry.path), alpha)
        s_m = alpha_m / math.sqrt(r_m) if rslora else alpha_m / r_m
        modules.append((layer, module, parts, a, b, r_m, s_m, expert))

    rank = max(m[5] for m in modules)
    if rank > max_lora_rank:
        where = ""
        if rank_pattern:
            layer, module = next((m[0], m[1]) for m in modules if m[5] == rank)
            where = f" (layer {layer} {module})"
        raise AdapterFormatError(
            f"{name}: rank {rank}{where} exceeds max_lora_rank {max_lora_rank}"
        )
    default = alpha / math.sqrt(r) if rslora else alpha / r
    scaling = _adapter_scaling(default, [m[6] for m in modules])

    weights = {}
    experts: dict[tuple[int, str], dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
    paths = {(layer, mod): _layer_path(entry.path) for (layer, mod, _), entry in pairs.items()}
    for layer, module, parts, a, b, _r_m, s_m, expert in modules:
        if s_m != scaling:  # only when modules' scalings differ (then scaling != 0)
            b = (b.to(torch.promote_types(b.dtype, torch.float32)) * (s_m / scaling)).to(b.dtype)
        if expert >= 0:
            experts.setdefault((layer, parts[0]), {})[expert] = (a, b)
            continue
        # a fused module (Phi-3's qkv_proj) stays fused: one slice of its group
        weights[(layer, module)] = (a.contiguous(), b.contiguous())
    for key, per_expert in experts.items():
        weights[key] = stack_experts(per_expert, spec.num_experts)
    targets = tuple(m for m in TARGETABLE if any(k[1] == m for k in weights))
    return LoRAAdapterWeights(name, rank, scaling, targets, weights, paths)


def _layer_path(path: str) -> str:
    """A module's path within its layer, an expert's index left out:
    "model.language_model.layers.3.linear_attn.in_proj_qkv" -> "linear_attn.in_proj_qkv",
    "model.layers.1.block_sparse_moe.experts.3.w1" -> "block_sparse_moe.experts.w1";
    "model.embed_tokens" -> "embed_tokens" (the vocabulary modules are in no layer)."""
    if _LAYER_PREFIX.match(path) is None:
        return path.rsplit(".", 1)[-1]
    return _LAYER_PREFIX.sub("", _EXPERT_INDEX.sub(".experts.", path), count=1)


def _check_layer_filter(
    name: str, config: dict, in_layers: Callable[[str], bool] | None, path: str, key: str
) -> None:
    if in_layers is not None and not in_layers(path):
        shown = f"layers_to_transform={config['layers_to_transform']!r}"
        if config.get("layers_pattern"):
            shown += f", layers_pattern={config['layers_pattern']!r}"
        raise AdapterFormatError(f"{name}: tensor {key!r} is in a layer outside {shown}")


def _adapter_scaling(default: float, module_scalings: list[float]) -> float:
    """The one scaling the engine multiplies by: `default` (lora_alpha / r) when a module
    uses it, else the one most modules use; never 0 while a module's is not."""
    counts = Counter(module_scalings)
    if default in counts and default != 0:
        return default
    nonzero = [s for s in counts if s != 0]
    if nonzero:
        return max(nonzero, key=counts.__getitem__)  # ties: the first module's
    return default  # every module's delta is zero


def _split_parts(fused: dict[str, tuple[str, ...]]) -> set[str]:
    """Modules a family's checkpoint only holds inside a fused projection."""
    return {part for parts in fused.values() for part in parts}
