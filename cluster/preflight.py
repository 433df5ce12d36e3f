"""The checks `lorafleet up` and `deploy` make in their own process, before Ray starts: the
config's fields (Serve's schema, AppConfig), and where the cluster is this machine the model
directory and the adapters. One line per bad field, naming its path, in seconds and before
anything starts, not minutes later in a replica's log."""

from __future__ import annotations

import difflib
import typing
from pathlib import Path
from typing import Any

import pydantic

from cluster.config import AppConfig
from cluster.errors import ServeConfigError
from cluster.serving import IMPORT_PATH


def check_config(config: dict[str, Any], local: bool = True) -> None:
    """Refuse a config in this process, in seconds, with a ServeConfigError of one line per
    problem: fields that Serve's schema or the application config (AppConfig, for every
    application of ours) refuses or does not know, each by its path
    (`applications[0].args.adaptors: unknown field`). With `local` (the cluster runs on
    this machine, so it reads the same files) also the model directory (config.json and its
    family, the weight files) and every adapter registered at start, as the deployment
    would read them."""
    problems = _schema_problems(config)
    if problems:
        raise ServeConfigError("\n".join(problems))
    if local:
        for i, app in enumerate(config["applications"]):
            if app.get("import_path") == IMPORT_PATH:
                _check_files(AppConfig.model_validate(app.get("args") or {}), f"applications[{i}]")


def _schema_problems(config: dict[str, Any]) -> list[str]:
    from ray.serve.schema import ServeDeploySchema

    problems = _unknown_keys(config, ServeDeploySchema, "")
    try:
        ServeDeploySchema.model_validate(config)
    except pydantic.ValidationError as e:
        problems += [_field_problem(err, "") for err in e.errors()]
    for i, app in enumerate(config.get("applications") or []):
        if isinstance(app, dict) and app.get("import_path") == IMPORT_PATH:
            try:
                AppConfig.model_validate(app.get("args") or {})
            except pydantic.ValidationError as e:
                where = f"applications[{i}].args"
                problems += [_field_problem(err, where, AppConfig) for err in e.errors()]
    merged: dict[str, list[str]] = {}  # a union's members each refuse the value: one line
    for problem in problems:
        path, _, message = problem.partition(": ")
        messages = merged.setdefault(path, [])
        if message and message not in messages:
            messages.append(message)
    return [f"{path}: {' or: '.join(m)}" if m else path for path, m in merged.items()]


def _path(parent: str, loc: tuple[Any, ...]) -> str:
    path = parent
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif "[" in str(part) or "'" in str(part):  # a union member's name: not a field
            continue
        else:
            path += f".{part}" if path else str(part)
    return path


def _field_problem(error: Any, parent: str, model: type | None = None) -> str:
    loc = tuple(error.get("loc", ()))
    path = _path(parent, loc)
    if error.get("type") == "extra_forbidden":
        return f"{path}: unknown field{_guess(str(loc[-1]), _fields_at(model, loc[:-1]))}"
    message = str(error.get("msg", "invalid value")).removeprefix("Value error, ")
    return f"{path}: {message}" if path else message


def _guess(key: str, known: set[str]) -> str:
    guess = difflib.get_close_matches(key, sorted(known), n=1)
    return f" (did you mean {guess[0]!r}?)" if guess else ""


def _fields_at(model: type | None, loc: tuple[Any, ...]) -> set[str]:
    """The field names of the model that `loc` (a pydantic error's, less its last part)
    leads to from `model`; empty when it leads elsewhere."""
    for part in loc:
        field = model.model_fields.get(part) if model is not None else None
        model = _nested_model(field.annotation)[0] if field is not None else None
    return set(model.model_fields) if model is not None else set()


def _unknown_keys(value: Any, model: type, path: str) -> list[str]:
    """Keys of `value` that pydantic model `model` neither knows nor refuses (Serve's schema
    ignores unknown keys: a misspelt `route_prefix` would silently not apply), and so on
    down its nested models."""
    if not isinstance(value, dict) or model.model_config.get("extra") in ("allow", "forbid"):
        return []
    fields = model.model_fields
    known = {name for name in fields} | {f.alias for f in fields.values() if f.alias}
    problems = []
    for key, item in value.items():
        where = f"{path}.{key}" if path else str(key)
        if key not in known:
            problems.append(f"{where}: unknown field{_guess(str(key), known)}")
            continue
        field = fields.get(key) or next(f for f in fields.values() if f.alias == key)
        nested, many = _nested_model(field.annotation)
        if nested is None:
            continue
        items = enumerate(item) if many and isinstance(item, list) else [(None, item)]
        for i, element in items:
            problems += _unknown_keys(element, nested, where if i is None else f"{where}[{i}]")
    return problems


def _nested_model(annotation: Any) -> tuple[type | None, bool]:
    """(the pydantic model a field holds, whether a list of them); None unless it holds only
    that model (maybe None), alone or in a list: a field that also takes a dict is skipped."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    origin = typing.get_origin(annotation)
    if origin in (list, typing.List):  # noqa: UP006
        inner, _ = _nested_model(args[0]) if args else (None, False)
        return inner, True
    if args and origin is not None and len(args) == 1:  # Optional[X]
        return _nested_model(args[0])
    if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
        return annotation, False
    return None, False


def _check_files(app: AppConfig, where: str) -> None:
    """The model directory (config.json, weight files, tokenizer) and the adapters
    registered at start, read as the deployment will read them (the demo's assets are
    built here first, into the cache it reads)."""
    from replica.model.spec import ModelConfigError, load_model_spec  # no torch: fast

    app = app.resolved()
    model = app.engine.model
    try:
        if not Path(model).is_dir():
            raise ModelConfigError(f"{model}: not a directory")
        spec = load_model_spec(model)
    except ModelConfigError as e:
        raise ServeConfigError(f"{where}.args.engine.model: {_one_line(e)}") from None
    if not any((Path(model) / name).is_file() for name in TOKENIZER_FILES):
        # (loading it as the Ingress does would import most of transformers: seconds more)
        raise ServeConfigError(
            f"{where}.args.engine.model: {model}: no tokenizer (none of "
            f"{', '.join(TOKENIZER_FILES)})"
        )

    from replica.model.peft_config import AdapterFormatError, check_config, read_config

    assert isinstance(app.store.adapters, dict)  # resolved()
    for name, path in app.store.adapters.items():  # what needs no torch first: fast
        at = f"{where}.args.store.adapters.{name}"
        if name == app.served_model_name:
            raise ServeConfigError(f"{at}: the base model's name (served_model_name)")
        if not Path(path).is_dir():
            raise ServeConfigError(f"{at}: {path} is not a directory")
        try:
            check_config(name, read_config(Path(path)))
        except AdapterFormatError as e:
            raise ServeConfigError(f"{at}: {_one_line(e)}") from None

    from replica.model.adapter_weights import adapter_weights_file, load_peft_adapter
    from replica.model.weights import Checkpoint, WeightLoadError

    try:
        if app.engine.load_format != "dummy":  # dummy: no weight file is read
            Checkpoint(model)
    except WeightLoadError as e:
        raise ServeConfigError(f"{where}.args.engine.model: {_one_line(e)}") from None
    engine = app.engine
    for name, path in app.store.adapters.items():
        at = f"{where}.args.store.adapters.{name}"
        weights = adapter_weights_file(path)
        if weights is not None and weights.stat().st_size > app.store.max_adapter_bytes:
            raise ServeConfigError(
                f"{at}: {weights} is larger than max_adapter_bytes ({app.store.max_adapter_bytes})"
            )
        try:  # as the engine it serves reads it (an adapter the store would refuse: here)
            load_peft_adapter(path, spec, engine.max_lora_rank, name, engine.lora_embeddings,
                              engine.lora_experts)  # fmt: skip
        except AdapterFormatError as e:
            raise ServeConfigError(f"{at}: {_one_line(e)}") from None


# A tokenizer's files in a Hugging Face model directory: one of them is needed.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")


def _one_line(error: Exception) -> str:
    return " ".join(str(error).split())
