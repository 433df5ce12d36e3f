"""An adapter directory, checked and converted once into the engine layout, put in Ray's
object store: what the registry then registers under a version.

The checks (reserved names, weights size before reading, the conversion's own validation
against the base model and max_lora_rank) refuse with a BadRequestError naming the
problem. Conversions run on worker threads, at most MAX_CONCURRENT_LOADS at once: each
holds an adapter's tensors in memory (up to max_adapter_bytes), and two overlap one
load's disk reads with another's conversion.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import ray

from cluster.store.adapter_tokens import tokens_beyond_vocab
from replica.adapters.packing import pack_adapter
from replica.model.adapter_weights import (
    AdapterFormatError,
    adapter_weights_file,
    load_peft_adapter,
)
from replica.model.lora_slots import adapter_group_ranks
from replica.model.spec import load_model_spec
from replica.wire import AdapterInfo
from router.errors import BadRequestError

MAX_CONCURRENT_LOADS = 2
T = TypeVar("T")


@dataclass(frozen=True)
class Converted:
    """A validated adapter in the object store, not registered yet."""

    name: str
    path: str
    ranks: Mapping[str, int]  # per projection group it targets: computed here, once
    target_modules: tuple[str, ...]
    nbytes: int
    weights: ray.ObjectRef  # the packed arrays (replica/adapters/packing.py)
    source: str | None  # the resolver that found it; None: loaded or preloaded
    applied: Mapping[str, int]  # "self_attn.q_proj" -> layers it is applied on

    def info(self, version: int, created: int | None = None) -> AdapterInfo:
        """What the registry lists for it under `version` (`created`: now by default)."""
        return AdapterInfo(
            name=self.name,
            version=version,
            ranks=self.ranks,
            path=self.path,
            target_modules=self.target_modules,
            nbytes=self.nbytes,
            created=int(time.time()) if created is None else created,
            source=self.source,
            applied=self.applied,
        )


class Converter:
    def __init__(
        self,
        model: str,
        max_lora_rank: int,
        reserved_names: tuple[str, ...] = (),
        max_adapter_bytes: int | None = None,
        lora_embeddings: bool = False,
        lora_experts: bool = False,
    ) -> None:
        """`lora_embeddings`, `lora_experts`: the engine's; an adapter it could not serve
        is refused."""
        self.spec = load_model_spec(model)
        self.max_lora_rank = max_lora_rank
        self.reserved = set(reserved_names)
        self.max_adapter_bytes = max_adapter_bytes
        self.lora_embeddings, self.lora_experts = lora_embeddings, lora_experts
        self._slots = asyncio.Semaphore(MAX_CONCURRENT_LOADS)

    def convert(self, name: str, path: str | Path, source: str | None = None) -> Converted:
        """Check and convert `path`, put the weights in the object store (blocking)."""
        if name in self.reserved:
            raise BadRequestError(f"adapter name {name!r} is reserved (the base model's name)")
        self._check_size(Path(path))
        if added := tokens_beyond_vocab(path, self.spec.vocab_size):
            shown = ", ".join(map(repr, added[:8])) + (", ..." if len(added) > 8 else "")
            raise BadRequestError(
                f"adapter {Path(path).name!r} adds tokens to the vocabulary ({shown}): the "
                f"base model has {self.spec.vocab_size} token ids and no weights for these"
            )
        try:
            weights = load_peft_adapter(
                path, self.spec, self.max_lora_rank, name, self.lora_embeddings, self.lora_experts
            )
        except AdapterFormatError as e:
            raise BadRequestError(str(e)) from None
        return Converted(
            name=name,
            path=str(path),
            ranks=adapter_group_ranks(self.spec, weights),
            target_modules=weights.target_modules,
            nbytes=weights.nbytes,
            weights=ray.put(pack_adapter(weights)),
            source=source,
            applied=weights.applied(),
        )

    async def convert_async(
        self, name: str, path: str | Path, source: str | None = None
    ) -> Converted:
        """convert() on a worker thread, in its turn (in_turn)."""
        return await self.in_turn(functools.partial(self.convert, name, path, source))

    async def in_turn(self, convert: Callable[[], T]) -> T:
        """`convert` (something that calls convert()) on a worker thread, once fewer than
        MAX_CONCURRENT_LOADS conversions run."""
        async with self._slots:
            return await asyncio.to_thread(convert)

    def _check_size(self, path: Path) -> None:
        """Refuse weights over max_adapter_bytes before reading them."""
        weights = adapter_weights_file(path)
        if self.max_adapter_bytes is None or weights is None:
            return  # the format check names a missing file
        size = weights.stat().st_size
        if size > self.max_adapter_bytes:
            raise BadRequestError(
                f"adapter {path.name!r}: {weights.name} is {size} bytes, over the "
                f"limit of {self.max_adapter_bytes} (max_adapter_bytes)"
            )
