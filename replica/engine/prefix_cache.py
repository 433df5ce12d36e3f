"""Automatic prefix caching: a request prefills only what follows its longest cached prefix.

The key of a sequence's i-th full KV block chains the key of block i-1 and the block's
token ids onto a root that names what computed it: the base model, or one registered
version of an adapter (its K/V differ, since LoRA changes q/k/v). So a prefix computed
under adapter A is never a hit under adapter B, nor under A after A was unloaded and
registered again with other weights (a new version, a new root). Keys are SHA-256
digests: a collision would serve one user another's K/V, so a fast non-cryptographic
hash will not do.

Within one model identity, the tenant that sent a request and its `cache_salt` (vLLM's
request field) partition the cache further: their scope joins the root, so one tenant's
prompts are never hits (nor cached_tokens) for another, and salts split one tenant's.
Without tenant or salt the scope is empty and the root is the identity's alone.

The blocks themselves (reference counts, eviction) are BlockAllocator's; this class
knows sequences: their keys, what they may reuse on admission and what they add after
each step.
"""

from __future__ import annotations

import hashlib
import itertools
from array import array

from replica.engine.block_allocator import BlockAllocator
from replica.engine.sequence import Sequence

BASE_IDENTITY = ""  # the base model's root (adapter identities are "name#generation")


def root_key(identity: str, scope: str = "") -> bytes:
    """The chain's start: what computed the K/V and, when set, the tenant and salt scope."""
    root = b"lorafleet-prefix\0" + identity.encode()
    if scope:
        root += b"\0scope\0" + scope.encode()
    return hashlib.sha256(root).digest()


def block_key(parent: bytes, tokens: list[int]) -> bytes:
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


class PrefixCache:
    def __init__(self, allocator: BlockAllocator, block_size: int, enabled: bool) -> None:
        self.allocator, self.block_size, self.enabled = allocator, block_size, enabled
        self.queried_tokens = 0  # prompt tokens looked up on admission
        self.hit_tokens = 0  # of those, found cached
        self._retired: set[str] = set()  # identities unloaded: nothing new cached under them

    def keys(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The keys of seq's first num_blocks full blocks (computed once, kept on seq:
        its tokens only ever grow)."""
        keys, bs = seq.block_keys, self.block_size
        parent = keys[-1] if keys else root_key(seq.cache_id, seq.cache_scope)
        for i in range(len(keys), num_blocks):
            parent = block_key(parent, seq.token_slice(i * bs, (i + 1) * bs))
            keys.append(parent)
        return keys[:num_blocks]

    def lookup(self, seq: Sequence) -> list[int]:
        """The cached blocks seq can start from (not taken yet): its longest cached run of
        full blocks, leaving at least its last token to compute (the step needs its
        logits). None for requests scoring their prompt: every position must be computed."""
        if not self.enabled or seq.sampling.prompt_logprobs is not None:
            return []
        hits = []
        for key in self.keys(seq, (seq.num_tokens - 1) // self.block_size):
            block = self.allocator.lookup(key)
            if block is None:
                break
            hits.append(block)
        return hits

    def admitted(self, seq: Sequence, hits: list[int]) -> None:
        """seq starts on `hits` (shared by the caller): count the lookup and record, on its
        first admission, how many of its prompt tokens were cached (the usage's
        cached_tokens)."""
        cached = len(hits) * self.block_size
        seq.num_cached_blocks = len(hits)
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = min(cached, len(seq.prompt_ids))
        if self.enabled:
            self.queried_tokens += seq.num_tokens
            self.hit_tokens += cached

    def commit(self, seq: Sequence) -> None:
        """Cache seq's blocks that are now full of computed tokens."""
        if not self.enabled or seq.cache_id in self._retired:
            return
        full = min(seq.num_computed // self.block_size, len(seq.blocks))
        if full <= seq.num_cached_blocks:
            return
        keys = self.keys(seq, full)
        for i in range(seq.num_cached_blocks, full):
            self.allocator.cache(seq.blocks[i], keys[i], seq.cache_id)
        seq.num_cached_blocks = full

    def forget(self, identity: str) -> None:
        """An adapter version is gone: its cached blocks are freed once unreferenced, and
        its requests still running cache nothing more."""
        self._retired.add(identity)
        self.allocator.forget(identity)


class CacheIdentities:
    """The prefix-cache identity of each adapter name: a new one for every registration,
    so a name registered again with other weights never hits the old version's blocks."""

    def __init__(self, prefix: PrefixCache) -> None:
        self.prefix = prefix
        self._ids: dict[str, str] = {}
        self._generations = itertools.count(1)

    def of(self, adapter: str | None) -> str:
        if adapter is None:
            return BASE_IDENTITY
        return self._ids.setdefault(adapter, f"{adapter}#{next(self._generations)}")

    def retire(self, name: str) -> None:
        """`name`'s weights change or go: its cached prefixes are never hits again."""
        old = self._ids.pop(name, None)
        if old is not None:
            self.prefix.forget(old)
