"""KV block bookkeeping: which blocks of the paged cache are free, shared or cached.

Host-only (the scheduler's); the tensors themselves are model/kv_cache.py's. Every block
has a reference count: the sequences whose block table holds it. A block full of computed
tokens never changes again, so it can be shared: by the choices forked from one prefill,
and, with prefix caching, by every request whose prefix has the same key (see
prefix_cache.py). A cached block whose last reference goes keeps its K/V and its key
(evictable, least recently used first) until an allocation needs the space; a block
without a key goes back to the free list at once. `num_free` counts both: a cached block
costs nothing to take back.
"""

from __future__ import annotations

from collections import OrderedDict


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
