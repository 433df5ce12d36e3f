"""Command-line flags generated from EngineConfig, so the CLI never copies the schema."""

from __future__ import annotations

import argparse
from typing import Any

from pydantic.fields import FieldInfo

from replica.config import AdapterResidencyConfig, EngineConfig

SHORT_FLAGS = {"tp_size": ("--tp",)}  # the short spelling users type, besides --tp-size


def engine_fields() -> dict[str, FieldInfo]:
    """Every engine setting a flag sets: EngineConfig's, and its adapters section's (whose
    flags keep their plain names: --num-slots sets engine.adapters.num_slots)."""
    fields = {k: v for k, v in EngineConfig.model_fields.items() if k != "adapters"}
    return fields | AdapterResidencyConfig.model_fields


def add_engine_arguments(parser: argparse.ArgumentParser, skip: set[str] = frozenset()) -> None:
    group = parser.add_argument_group("engine")
    for name, field in engine_fields().items():
        if name in skip:
            continue
        group.add_argument(
            "--" + name.replace("_", "-"),
            *SHORT_FLAGS.get(name, ()),
            dest=f"engine_{name}",
            default=None,
            # argparse formats help with %: a description's own "10%" must not be read so
            help=f"{field.description} (default: {field.default})".replace("%", "%%"),
        )


def engine_config_from_args(args: argparse.Namespace, **values: Any) -> EngineConfig:
    """Flags the user gave override `values`, which override EngineConfig's defaults."""
    adapters = dict(values.pop("adapters", None) or {})
    for name in engine_fields():
        given = getattr(args, f"engine_{name}", None)
        if given is None:
            continue
        if name in AdapterResidencyConfig.model_fields:
            adapters[name] = given
        else:
            values[name] = given
    return EngineConfig(**values, adapters=adapters)
