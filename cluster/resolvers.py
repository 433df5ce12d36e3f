"""Adapter resolvers: where the AdapterStore looks for an adapter that a request names
before anyone registered it (vLLM's LoRAResolver, LoRAX's adapter sources).

A resolver maps a name to a PEFT directory on local disk, plus the roots that directory
must lie inside; it never validates weights. The store tries its resolvers in configured
order, refuses names outside the allow-list first, then applies the same path
confinement, size and rank checks as an explicit `POST /v1/load_lora_adapter`.

- `LocalDirResolver`: `name` -> `<root>/<name>` for each configured adapter root.
- `HFCacheResolver`: `org/name` -> the snapshot of that Hugging Face repo in the local hub
  cache (huggingface_hub's cache layout); downloaded first only if allowed.

Other sources (an object store through fsspec, say) are one more class with the same
`find`: copy the adapter's files (ADAPTER_FILES) into a local staging directory and return that
directory with the staging directory as its root; the store does the rest.
"""

from __future__ import annotations

import fnmatch
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

log = logging.getLogger(__name__)

# A PEFT adapter's files: all a resolver ever fetches or reads (weights as safetensors, or
# the .bin older trainers write).
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")
# A local adapter's name is one directory name: no separator, no "..", nothing hidden.
_LOCAL_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")


class ResolveError(Exception):
    """A resolver cannot resolve a name; the message says why (it reaches the client)."""


@dataclass(frozen=True)
class Found:
    """Where a resolver found an adapter: its directory and the roots it must lie in."""

    path: Path
    roots: tuple[Path, ...]
    source: str  # the resolver's kind, for logs and AdapterInfo


class AdapterResolver(Protocol):
    kind: str

    def find(self, name: str) -> Found:
        """`name`'s PEFT directory. Raises ResolveError saying why when this source does
        not have it or refuses the name. Blocking: the store calls it on a worker thread."""
        ...


class LocalDirResolver:
    """`name` -> the subdirectory `name` of the first adapter root that has one."""

    kind = "local"

    def __init__(self, roots: Sequence[str | Path]) -> None:
        if not roots:
            raise ValueError("the 'local' adapter resolver needs adapter_roots")
        self.roots = tuple(Path(r).resolve() for r in roots)

    def find(self, name: str) -> Found:
        if not _LOCAL_NAME.fullmatch(name):  # checked before any path is built or read
            raise ResolveError(
                "not a directory name (a letter, digit, '_' or '-' first, then letters, "
                "digits, '.', '_' or '-'; at most 128 characters)"
            )
        for root in self.roots:
            path = root / name
            if path.is_dir():
                return Found(path, (root,), self.kind)
        raise ResolveError("no adapter root has a directory of that name")


class HFCacheResolver:
    """`org/name` -> the snapshot of Hugging Face repo `org/name` (revision main) in the hub
    cache. With `allow_download`, a repo missing from the cache is fetched first (its two
    adapter files only); otherwise nothing leaves the machine."""

    kind = "hf_cache"

    def __init__(self, cache_dir: str | Path | None = None, allow_download: bool = False) -> None:
        self.cache_dir = None if cache_dir is None else Path(cache_dir)
        self.allow_download = allow_download

    def find(self, name: str) -> Found:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
        from huggingface_hub.utils import validate_repo_id

        if name.count("/") != 1:  # checked before any path is built or read
            raise ResolveError("not a Hugging Face repo id of the form org/name")
        try:
            validate_repo_id(name)
        except HFValidationError as e:
            raise ResolveError(f"not a valid Hugging Face repo id ({e})") from None
        cache = self._cache()
        try:
            path = snapshot_download(
                name, cache_dir=cache, allow_patterns=list(ADAPTER_FILES), local_files_only=True
            )
        except LocalEntryNotFoundError:
            if not self.allow_download:
                raise ResolveError(
                    "not in the Hugging Face cache (downloads are off: hf_allow_download)"
                ) from None
            log.info("downloading adapter %s from the Hugging Face hub", name)
            try:
                path = snapshot_download(name, cache_dir=cache, allow_patterns=list(ADAPTER_FILES))
            except Exception as e:  # no network, no such repo, gated, ...
                raise ResolveError(f"download from the Hugging Face hub failed: {e}") from None
        except Exception as e:  # an incomplete snapshot, an unreadable refs file
            raise ResolveError(f"the Hugging Face cache has no usable snapshot ({e})") from None
        # the snapshot's files are links into the repo's blobs/: confine to the repo's folder
        repo_folder = Path(path).parent.parent
        return Found(Path(path), (repo_folder.resolve(),), self.kind)

    def _cache(self) -> Path:
        if self.cache_dir is not None:
            return self.cache_dir
        from huggingface_hub import constants

        return Path(constants.HF_HUB_CACHE)  # HF_HUB_CACHE / HF_HOME, read at import


RESOLVER_KINDS = ("local", "hf_cache")


def build_resolvers(
    kinds: Sequence[str],
    adapter_roots: Sequence[str],
    hf_cache_dir: str | None = None,
    hf_allow_download: bool = False,
) -> list[AdapterResolver]:
    """The resolvers named in `kinds`, in that order (AppConfig.store.resolvers)."""
    resolvers: list[AdapterResolver] = []
    for kind in kinds:
        if kind == "local":
            resolvers.append(LocalDirResolver(adapter_roots))
        elif kind == "hf_cache":
            resolvers.append(HFCacheResolver(hf_cache_dir, hf_allow_download))
        else:
            raise ValueError(f"unknown adapter resolver {kind!r}; known: {RESOLVER_KINDS}")
    return resolvers


def allowed(name: str, patterns: Sequence[str]) -> bool:
    """Whether `name` matches one of the allow-list's glob patterns (fnmatch, case-sensitive;
    `*` matches '/' too, so `*` allows every name and `myorg/*` one organization's)."""
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)
