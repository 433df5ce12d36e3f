"""Where adapter weights come from: the source protocols and the PEFT-directory source.

A source names the adapters it can provide and fetches their converted weights (the
engine layout of model/adapter_weights.py); a locator is the picklable address of one
adapter's weights, so tensor-parallel ranks can each fetch their own shard. The cluster's
source, the object store, is adapters/object_store.py.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from replica.model.adapter_weights import LoRAAdapterWeights, SelectLoRA, load_peft_adapter
from replica.model.peft_config import peft_config_rank
from replica.model.spec import ModelSpec


class AdapterLocator(Protocol):
    """Where one adapter's weights are, in a form another process can read them from
    (picklable): tensor-parallel ranks each fetch their own shard through it."""

    def fetch(self, name: str, select: SelectLoRA | None = None) -> LoRAAdapterWeights:
        """The converted weights, only the part `select` picks if given."""


class AdapterSource(Protocol):
    """Where adapter weights come from (a PEFT directory here, the object store in a cluster)."""

    def fetch(self, name: str) -> LoRAAdapterWeights:
        """Converted weights of `name`; raises KeyError if unknown."""

    def locate(self, name: str) -> AdapterLocator:
        """Where `name`'s weights are; raises KeyError if unknown."""

    def names(self) -> list[str]:
        """Every adapter the source can provide."""

    def __contains__(self, name: str) -> bool:
        """Whether the source can provide `name` (without listing them all)."""

    def remove(self, name: str) -> None:
        """Forget `name` (unloaded)."""

    def rank_of(self, name: str) -> int | None:
        """`name`'s rank without fetching its weights, None when that is not known: a
        load then reserves rows for max_lora_rank."""


@dataclass(frozen=True)
class PeftDirectoryLocator:
    path: str
    spec: ModelSpec
    max_lora_rank: int
    generation: int  # changes when the name is registered again: other ranks re-read it
    lora_embeddings: bool = False

    def fetch(self, name: str, select: SelectLoRA | None = None) -> LoRAAdapterWeights:
        adapter = load_peft_adapter(
            self.path, self.spec, self.max_lora_rank, name, self.lora_embeddings
        )
        return adapter if select is None else adapter.select(select)


class PeftDirectorySource:
    """Adapters read from PEFT directories through the one conversion function."""

    def __init__(
        self,
        spec: ModelSpec,
        max_lora_rank: int,
        paths: dict[str, str | Path],
        lora_embeddings: bool = False,
    ) -> None:
        self.spec, self.max_lora_rank = spec, max_lora_rank
        self.lora_embeddings = lora_embeddings
        self.paths = dict(paths)
        self._generations = itertools.count(1)
        self._generation: dict[str, int] = {}

    def add(self, name: str, path: str | Path) -> None:
        self.paths[name] = path
        self._generation[name] = next(self._generations)

    def remove(self, name: str) -> None:
        self.paths.pop(name, None)

    def names(self) -> list[str]:
        return list(self.paths)

    def __contains__(self, name: str) -> bool:
        return name in self.paths

    def fetch(self, name: str) -> LoRAAdapterWeights:
        return load_peft_adapter(
            self.paths[name], self.spec, self.max_lora_rank, name, self.lora_embeddings
        )

    def rank_of(self, name: str) -> int | None:
        """The largest rank the directory's adapter_config.json gives a module (`r`, or a
        larger rank_pattern value; a small read, no weights), at most max_lora_rank."""
        try:
            config = json.loads((Path(self.paths[name]) / "adapter_config.json").read_text())
            return min(peft_config_rank(config), self.max_lora_rank)
        except (KeyError, OSError, ValueError, TypeError, AttributeError):
            return None

    def locate(self, name: str) -> PeftDirectoryLocator:
        path = str(self.paths[name])
        return PeftDirectoryLocator(
            path, self.spec, self.max_lora_rank, self._generation.get(name, 0),
            self.lora_embeddings,
        )  # fmt: skip
