"""Where adapter weights come from: the source protocols and the PEFT-directory source.

A source names the adapters it can provide, knows each one's rank per projection group
from its registration on (what a load reserves before fetching), and fetches their
converted weights (the engine layout of model/adapter_weights.py); a locator is the
picklable address of one adapter's weights, so tensor-parallel ranks can each fetch their
own shard. The cluster's source, the object store, is adapters/object_store.py.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from replica.model.adapter_weights import LoRAAdapterWeights, SelectLoRA, load_peft_adapter
from replica.model.lora_slots import adapter_group_ranks
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

    def ranks(self, name: str) -> Mapping[str, int]:
        """`name`'s rank per projection group it targets, recorded when it was registered
        (no fetch): what a load of it reserves. Raises KeyError if unknown."""


@dataclass(frozen=True)
class PeftDirectoryLocator:
    path: str
    spec: ModelSpec
    max_lora_rank: int
    generation: int  # changes when the name is registered again: other ranks re-read it
    lora_embeddings: bool = False
    lora_experts: bool = False

    def fetch(self, name: str, select: SelectLoRA | None = None) -> LoRAAdapterWeights:
        adapter = load_peft_adapter(
            self.path, self.spec, self.max_lora_rank, name, self.lora_embeddings, self.lora_experts
        )
        return adapter if select is None else adapter.select(select)


@dataclass(frozen=True)
class _Directory:
    """One registered PEFT directory: where, which registration, its rank per group."""

    path: str
    generation: int  # changes when the name is registered again: other ranks re-read it
    ranks: Mapping[str, int]


class PeftDirectorySource:
    """Adapters read from PEFT directories through the one conversion function."""

    def __init__(
        self,
        spec: ModelSpec,
        max_lora_rank: int,
        paths: Mapping[str, str | Path],
        lora_embeddings: bool = False,
        lora_experts: bool = False,
    ) -> None:
        """`paths`: name -> directory, each registered as by add(). `lora_embeddings`,
        `lora_experts`: the engine's; an adapter it could not serve is refused."""
        self.spec, self.max_lora_rank = spec, max_lora_rank
        self.lora_embeddings, self.lora_experts = lora_embeddings, lora_experts
        self._generations = itertools.count(1)
        self._directories: dict[str, _Directory] = {}
        for name, path in paths.items():
            self.add(name, path)

    def add(self, name: str, path: str | Path) -> LoRAAdapterWeights:
        """Register `path` as `name`: read and converted now (AdapterFormatError if it is
        not a valid adapter for this model; nothing registered then), its rank per group
        recorded from the converted weights. Returns them, for the caller to stage."""
        weights = self._read(name, path)
        ranks = adapter_group_ranks(self.spec, weights)
        self._directories[name] = _Directory(str(path), next(self._generations), ranks)
        return weights

    def remove(self, name: str) -> None:
        self._directories.pop(name, None)

    def names(self) -> list[str]:
        return list(self._directories)

    def __contains__(self, name: str) -> bool:
        return name in self._directories

    def ranks(self, name: str) -> Mapping[str, int]:
        return self._directories[name].ranks

    def fetch(self, name: str) -> LoRAAdapterWeights:
        return self._read(name, self._directories[name].path)

    def locate(self, name: str) -> PeftDirectoryLocator:
        directory = self._directories[name]
        return PeftDirectoryLocator(
            directory.path, self.spec, self.max_lora_rank, directory.generation,
            self.lora_embeddings, self.lora_experts,
        )  # fmt: skip

    def _read(self, name: str, path: str | Path) -> LoRAAdapterWeights:
        return load_peft_adapter(
            path, self.spec, self.max_lora_rank, name, self.lora_embeddings, self.lora_experts
        )
