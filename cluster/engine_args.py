"""Command-line flags generated from EngineConfig, so the CLI never copies the schema."""

from __future__ import annotations

import argparse
from typing import Any

from replica.config import EngineConfig

SHORT_FLAGS = {"tp_size": ("--tp",)}  # the short spelling users type, besides --tp-size


def add_engine_arguments(parser: argparse.ArgumentParser, skip: set[str] = frozenset()) -> None:
    group = parser.add_argument_group("engine")
    for name, field in EngineConfig.model_fields.items():
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
    for name in EngineConfig.model_fields:
        given = getattr(args, f"engine_{name}", None)
        if given is not None:
            values[name] = given
    return EngineConfig(**values)
