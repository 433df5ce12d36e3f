"""KV blocks: which blocks of the paged cache are free, shared or cached, and the
automatic prefix cache over them (a request prefills only what follows its longest
cached prefix).

Host-only (the scheduler's); the tensors themselves are model/kv_cache.py's.

BlockAllocator: every block has a reference count, the sequences whose block table holds
it. A block full of computed tokens never changes again, so it can be shared: by the
choices forked from one prefill, and, with prefix caching, by every request whose prefix
has the same key. A cached block whose last reference goes keeps its K/V and its key
(evictable, least recently used first) until an allocation needs the space; a block
without a key goes back to the free list at once. `num_free` counts both: a cached block
costs nothing to take back.

PrefixCache: the key of a sequence's i-th full KV block chains the key of block i-1 and
the block's token ids onto a root that names what computed it: the base model, or one
registered version of an adapter (its K/V differ, since LoRA changes q/k/v). So a prefix
computed under adapter A is never a hit under adapter B, nor under A after A was
unloaded and registered again with other weights (a new version, a new root). Keys are
SHA-256 digests: a collision would serve one user another's K/V, so a fast
non-cryptographic hash will not do. Within one model identity, the tenant that sent a
request and its `cache_salt` (vLLM's request field) partition the cache further: their
scope joins the root, so one tenant's prompts are never hits (nor cached_tokens) for
another, and salts split one tenant's. Without tenant or salt the scope is empty and the
root is the identity's alone. The blocks themselves (reference counts, eviction) are
BlockAllocator's; PrefixCache knows sequences: their keys, what they may reuse on
admission and what they add after each step.
"""

from __future__ import annotations

import hashlib
import itertools
from array import array
from collections import OrderedDict

from replica.engine.sequence import Sequence


class BlockAllocator:
    """Reference-counted KV blocks, with the keys of those that are cached."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() yields the lowest id
        self._refs = [0] * num_blocks
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; LRU first
        self._key_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self._owner_of: dict[int, str] = {}  # cached block -> the identity its key is under
        self._blocks_of: dict[str, set[int]] = {}  # identity -> its cached blocks

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take: free ones and unreferenced cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        return len(self._block_of)

    def refs(self, block: int) -> int:
        return self._refs[block]

    def allocate(self, n: int) -> list[int]:
        """n blocks with one reference each: free ones first, then the least recently used
        cached ones (their keys dropped)."""
        if n > self.num_free:
            raise MemoryError(f"KV cache: asked for {n} blocks, {self.num_free} free")
        blocks = []
        for _ in range(n):
            if self._free:
                block = self._free.pop()
            else:
                block, _ = self._evictable.popitem(last=False)
                self._uncache(block)
            self._refs[block] = 1
            blocks.append(block)
        return blocks

    def share(self, blocks: list[int]) -> None:
        """One more reference to each block (a cached one stops being evictable)."""
        for block in blocks:
            if self._refs[block] == 0:
                if block not in self._evictable:
                    raise ValueError(f"KV block {block} is free: it cannot be shared")
                del self._evictable[block]
            self._refs[block] += 1

    def free(self, blocks: list[int]) -> None:
        """One reference fewer to each block. A block nobody holds is free again, or, if
        cached, evictable; a table's last blocks are evicted before its first ones (the
        first are the prefix other requests share)."""
        for block in reversed(blocks):
            if self._refs[block] <= 0:
                raise ValueError(f"KV block {block} freed more often than it was taken")
            self._refs[block] -= 1
            if self._refs[block]:
                continue
            if block in self._key_of:
                self._evictable[block] = None
            else:
                self._free.append(block)

    def unreferenced(self, blocks: list[int]) -> int:
        """How many of `blocks` nobody holds: sharing them takes that many from num_free."""
        return sum(1 for b in blocks if self._refs[b] == 0)

    # -- the cache -----------------------------------------------------------------------------

    def lookup(self, key: bytes) -> int | None:
        """The cached block with `key`, if any."""
        return self._block_of.get(key)

    def key_of(self, block: int) -> bytes | None:
        return self._key_of.get(block)

    def cache(self, block: int, key: bytes, owner: str) -> None:
        """Give a held block full of computed tokens its key. A key already cached in
        another block keeps that one (two requests computed the same prefix at once)."""
        if self._refs[block] <= 0:
            raise ValueError(f"KV block {block} is not held: it cannot be cached")
        if key in self._block_of or block in self._key_of:
            return
        self._key_of[block], self._block_of[key] = key, block
        self._owner_of[block] = owner
        self._blocks_of.setdefault(owner, set()).add(block)

    def forget(self, owner: str) -> int:
        """Drop the keys of every block cached under `owner` (an adapter version unloaded):
        unreferenced ones are free at once, held ones when their last holder lets go.
        Returns how many blocks lost their key."""
        blocks = self._blocks_of.pop(owner, set())
        for block in blocks:
            self._uncache(block, owner_known=False)
            if block in self._evictable:
                del self._evictable[block]
                self._free.append(block)
        return len(blocks)

    def _uncache(self, block: int, owner_known: bool = True) -> None:
        key = self._key_of.pop(block)
        del self._block_of[key]
        owner = self._owner_of.pop(block)
        if owner_known:
            owned = self._blocks_of[owner]
            owned.discard(block)
            if not owned:
                del self._blocks_of[owner]

    def check(self) -> None:
        """Raise AssertionError unless the bookkeeping is consistent (tests)."""
        free, evictable = set(self._free), set(self._evictable)
        assert len(free) == len(self._free), "a block is twice in the free list"
        assert not free & evictable, "a block is both free and evictable"
        for block, refs in enumerate(self._refs):
            assert refs >= 0, f"block {block} has {refs} references"
            if refs:
                assert block not in free and block not in evictable, f"block {block} is held"
            else:
                assert (block in free) != (block in evictable), f"block {block} is lost"
                assert (block in evictable) == (block in self._key_of), f"block {block} key"
        assert all(self._block_of[k] == b for b, k in self._key_of.items()), "key maps disagree"
        assert len(self._block_of) == len(self._key_of) == len(self._owner_of)
        owned = {b for blocks in self._blocks_of.values() for b in blocks}
        assert owned == set(self._key_of), "cached blocks and owners disagree"


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


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
