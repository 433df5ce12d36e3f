"""adapter_config.json: reading it, refusing what is not plain LoRA, PEFT's matching rules.

Refused, naming the field: PEFT features that are not a plain additive low-rank delta on
the served base model (DoRA, modules_to_save, trainable tokens, layer replication, a bias,
fan_in_fan_out, QALoRA, aLoRA, Arrow, BD-LoRA, KaSA, and init_lora_weights that rewrite
the base weights: PiSSA, OLoRA, CorDA, LoftQ, LoRA-GA); target_parameters other than a
mixture of experts' stacked gate_up_proj / down_proj (model/expert_adapters.py reads those).
rank_pattern / alpha_pattern keys and layers_to_transform / layers_pattern are matched as
PEFT matches them (see pattern_key and layer_filter).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any


class AdapterFormatError(ValueError):
    """An adapter directory is malformed or does not fit the base model."""


# PEFT's default lora_alpha (LoraConfig.lora_alpha) when a config leaves it out
PEFT_DEFAULT_ALPHA = 8

# Config fields that, when set, make the adapter something other than base + scaling·B·A
# on the served base model -> what it is. Set: truthy, as PEFT tests them; a sub-config
# (_SUBCONFIGS) whenever present, since PEFT turns even {} into an active config object.
_REFUSED_FIELDS = {
    "use_dora": "DoRA",
    "modules_to_save": "fully trained module copies (modules_to_save)",
    "trainable_token_indices": "trainable tokens (embedding rows trained in place)",
    "layer_replication": "layer replication",
    "use_qalora": "QALoRA (LoRA on pooled inputs)",
    "lora_bias": "a bias on lora_B",
    "alora_invocation_tokens": "aLoRA (active only after its invocation tokens)",
    "arrow_config": "Arrow routing",
    "use_bdlora": "BD-LoRA (block-diagonal factors)",
    "kasa_config": "KaSA (truncated base weights and a singular-value diagonal)",
}
# target_parameters served: the stacked experts of transformers 5's MoE blocks (PEFT
# saves them as written, e.g. mlp.experts.gate_up_proj, and may add the bare names)
EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")
_SUBCONFIGS = {"arrow_config", "use_bdlora", "kasa_config"}
# init_lora_weights values whose init rewrites the base weights (PEFT does it again when it
# loads the adapter): the adapter is a delta on that modified base, not on ours
_BASE_REWRITING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")


def peft_config_rank(config: dict) -> int:
    """The largest rank an adapter_config.json gives any module: max(r, rank_pattern's
    values), without reading weights (an upper bound: a pattern may match nothing)."""
    ranks = [int(config["r"])]
    pattern = config.get("rank_pattern") or {}
    ranks += [int(v) for v in pattern.values()]
    return max(ranks)


def pattern_key(pattern: dict, path: str) -> str:
    """peft.utils.other.get_pattern_key: the first key (in the file's order) that matches
    `path` as `(.*\\.)?(key)$` from its start; `path` itself when none does."""
    for key in pattern:
        if re.match(rf"(.*\.)?({key})$", path):
            return key
    return path


def pattern(name: str, config: dict, field_name: str) -> dict:
    pattern = config.get(field_name) or {}
    if not isinstance(pattern, dict):
        raise AdapterFormatError(
            f"{name}: {field_name}={pattern!r} is not a mapping of module patterns to values"
        )
    for key, value in pattern.items():
        try:
            re.compile(rf"(.*\.)?({key})$")
        except re.error as e:
            raise AdapterFormatError(
                f"{name}: {field_name} key {key!r} is not a valid regular expression ({e})"
            ) from None
        if field_name == "rank_pattern":
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise AdapterFormatError(
                    f"{name}: rank_pattern[{key!r}]={value!r} is not a positive integer"
                )
        else:
            check_number(name, f"{field_name}[{key!r}]", value)
    return pattern


def check_number(name: str, what: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise AdapterFormatError(f"{name}: {what}={value!r} is not a finite number")


def layer_filter(name: str, config: dict) -> Callable[[str], bool] | None:
    """Whether PEFT would put LoRA on a module (its name in the base model) given
    layers_to_transform / layers_pattern; None when they select every layer. PEFT's rule
    (tuners_utils.check_target_module_exists): a module named exactly in target_modules
    is always targeted; else its layer index is the first number after a `layers_pattern`
    segment (after any segment when unset) and must be among the listed ones."""
    indexes = config.get("layers_to_transform")
    pattern = config.get("layers_pattern")
    if indexes is None or indexes == []:  # PEFT: None or an empty list select every layer
        if pattern:
            raise AdapterFormatError(
                f"{name}: layers_pattern={pattern!r} is set without layers_to_transform"
            )
        return None
    ok_int = isinstance(indexes, int) and not isinstance(indexes, bool)
    if not ok_int and not (
        isinstance(indexes, list)
        and all(isinstance(i, int) and not isinstance(i, bool) for i in indexes)
    ):
        raise AdapterFormatError(
            f"{name}: layers_to_transform={indexes!r} is not a layer index or a list of them"
        )
    wanted = {indexes} if ok_int else set(indexes)
    patterns = [pattern] if isinstance(pattern, str) else pattern or []
    if not isinstance(patterns, list) or not all(isinstance(p, str) for p in patterns):
        raise AdapterFormatError(f"{name}: layers_pattern={pattern!r} is not a string or a list")
    if not any(patterns):
        regexes = [r".*?\.[^.]*\.(?P<idx>\d+)\."]
    else:
        regexes = [rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\." for p in patterns]
    try:
        compiled = [re.compile(x) for x in regexes]
    except re.error as e:
        raise AdapterFormatError(
            f"{name}: layers_pattern={pattern!r} is not a valid regular expression ({e})"
        ) from None
    targets = config.get("target_modules")
    exact = set(targets) if isinstance(targets, list) else set()

    def selected(path: str) -> bool:
        if path in exact:
            return True
        for rx in compiled:
            m = rx.match(path)
            if m is not None:
                return int(m.group("idx")) in wanted
        return False

    return selected


def read_config(path: Path) -> dict:
    cfg_file = path / "adapter_config.json"
    if not path.is_dir():
        raise AdapterFormatError(f"{path}: not a directory")
    if not cfg_file.is_file():
        raise AdapterFormatError(f"{path}: missing adapter_config.json")
    try:
        config = json.loads(cfg_file.read_text())
    except UnicodeDecodeError:
        raise AdapterFormatError(f"{cfg_file}: not UTF-8 text") from None
    except json.JSONDecodeError as e:
        raise AdapterFormatError(f"{cfg_file}: invalid JSON ({e})") from None
    if not isinstance(config, dict):
        raise AdapterFormatError(f"{cfg_file}: expected a JSON object")
    return config


def check_config(name: str, config: dict) -> None:
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterFormatError(f"{name}: peft_type {config.get('peft_type')!r} is not LORA")
    r = config.get("r")
    if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
        raise AdapterFormatError(f"{name}: adapter_config.json r={r!r} is not a positive integer")
    for key, what in _REFUSED_FIELDS.items():
        value = config.get(key)
        if value is not None if key in _SUBCONFIGS else value:
            raise AdapterFormatError(f"{name}: {key}={value!r}: {what} is not supported")
    params = config.get("target_parameters") or []
    others = [p for p in params if str(p).rpartition(".")[2] not in EXPERT_PARAMETERS]
    if not isinstance(params, list) or others:
        raise AdapterFormatError(
            f"{name}: target_parameters={config['target_parameters']!r}: LoRA on parameters "
            "is supported only on a mixture of experts' stacked experts.gate_up_proj and "
            "experts.down_proj"
        )
    if config.get("bias", "none") != "none":
        raise AdapterFormatError(f"{name}: bias={config['bias']!r} is not supported (only 'none')")
    if config.get("fan_in_fan_out"):
        raise AdapterFormatError(f"{name}: fan_in_fan_out=true is not supported")
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(_BASE_REWRITING_INITS):
        raise AdapterFormatError(
            f"{name}: init_lora_weights={init!r} is not supported: it rewrites the base "
            "model's weights, so the adapter is a delta on another model (convert it to "
            "plain LoRA: save_pretrained(path_initial_model_for_weight_conversion=...))"
        )
