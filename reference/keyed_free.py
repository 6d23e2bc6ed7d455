"""The free blocks of a keyed policy (seed 002): first fit, then two heaps' worth of eviction order.

The spec derives a keyed policy's free queue by sorting (kvspec.spec.ordering):
the free blocks without a hash by id, then the hashed ones by
`eviction_key` (whose first term is the tier a free with `evict_first`
gives). This keeps the same order in two binary heaps:

- `_first_fit`: the ids of the free blocks without a hash. A block leaves it
  only from the top (an allocation takes the lowest id); nothing else can
  reach such a block while it is free (a hit needs a hash, and only a held
  block is registered), so this heap has no stale entries.
- `_cached`: `(key, block_id)` of the free blocks with a hash. A hit takes a
  block out of the middle, and so does `evict_blocks` (the block moves to
  `_first_fit`). Those removals are lazy, as in vLLM v0's `LRUEvictor`: the
  live key of each block is kept in `_live`, and an entry whose key is not
  its block's live key is skipped when it reaches the top. Every stamp is
  unique, so a block's new key never equals a stale one. When stale entries
  outnumber live ones the heap is rebuilt, so it never holds more than about
  twice the free blocks.

The rejected alternative, one sorted list, costs O(n) per insertion. Cost per
block: allocation, free and a hit O(log n) amortized (a hit on a free block
is O(1), paid when its stale entry is popped or rebuilt away); iteration (for
the snapshot only) O(n log n).

The stamps a policy reads are kept here, indexed by block id, with the
logical clock, exactly as the spec stamps them (kvspec.spec.ops): not in the
block objects, which the queue policies share.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Sequence
from fractions import Fraction
from typing import cast

from kvspec.reference.free_queue import KVCacheBlock
from kvspec.spec.ordering import PY, ProfileRule, eviction_key

__all__ = ["Key", "KeyedFreeBlocks"]

Key = tuple[Fraction | int, ...]


class KeyedFreeBlocks:
    """The free blocks in a keyed policy's eviction order, and the stamps that order reads."""

    def __init__(self, blocks: list[KVCacheBlock], rule: ProfileRule) -> None:
        """Every block free, none hashed: first fit takes them in id order. Cost: O(n)."""
        n = len(blocks)
        self._rule = rule
        self._blocks = blocks
        self.clock = 0  # the next stamp
        self.last_access = [0] * n
        self.num_accesses = [0] * n
        self.registered_at = [0] * n
        self.is_evict_first = [False] * n  # the tier each block's last free gave it
        self._first_fit = [block.block_id for block in blocks]  # sorted, so already a heap
        self._cached: list[tuple[Key, int]] = []
        self._live: dict[int, Key] = {}  # block id -> the key of its entry in _cached, for free hashed blocks
        self.num_free_blocks = n

    # --- what the pool tells it -----------------------------------------------------------

    def allocated(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Blocks just taken: each stamped, with its first access."""
        clock, last, count = self.clock, self.last_access, self.num_accesses
        for i, block in enumerate(blocks):
            last[block.block_id] = clock + i
            count[block.block_id] = 1
        self.clock = clock + len(blocks)

    def hit(self, block_ids: Sequence[int]) -> None:
        """Blocks a request hit (already out of the free blocks): each stamped, one more access."""
        clock, last, count = self.clock, self.last_access, self.num_accesses
        for i, b in enumerate(block_ids):
            last[b] = clock + i
            count[b] += 1
        self.clock = clock + len(block_ids)

    def registered(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Blocks whose content was just registered under a hash: stamped (block-age reads it)."""
        clock, registered = self.clock, self.registered_at
        for i, block in enumerate(blocks):
            registered[block.block_id] = clock + i
        self.clock = clock + len(blocks)

    def freed(self, named: Sequence[int], newly_free: Sequence[KVCacheBlock], evict_first: bool) -> None:
        """A free_blocks call: every block id it named is stamped in order (and tiered), those now at ref_cnt 0 join."""
        clock, last, tier = self.clock, self.last_access, self.is_evict_first
        for i, b in enumerate(named):
            last[b] = clock + i
            tier[b] = evict_first
        self.clock = clock + len(named)
        for block in newly_free:
            self._add(block)

    def lost_hash(self, block: KVCacheBlock) -> None:
        """A free block whose hash was dropped (`evict_blocks`): it moves to the first-fit blocks."""
        del self._live[block.block_id]  # its _cached entry is now stale
        heapq.heappush(self._first_fit, block.block_id)

    def rebuild(self) -> None:
        """After `reset_prefix_cache` (every block free, no hash left): first fit over all of them. Cost: O(n)."""
        ids = sorted([*self._first_fit, *self._live])
        self._first_fit, self._cached, self._live = ids, [], {}

    # --- the queue's face, as the pool uses the linked queue ------------------------------

    def popleft(self) -> KVCacheBlock:
        """Take the first block of the eviction order."""
        return self.popleft_n(1)[0]

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Take the first `n` blocks of the eviction order (the caller checked that n are free)."""
        taken: list[KVCacheBlock] = []
        first_fit, cached, live, blocks = self._first_fit, self._cached, self._live, self._blocks
        while len(taken) < n and first_fit:
            taken.append(blocks[heapq.heappop(first_fit)])
        while len(taken) < n:
            key, block_id = heapq.heappop(cached)
            if live.get(block_id) == key:
                del live[block_id]
                taken.append(blocks[block_id])
        self.num_free_blocks -= n
        return taken

    def remove(self, block: KVCacheBlock) -> None:
        """Take a free hashed block out (a hit): its entry goes stale. Cost: O(1)."""
        del self._live[block.block_id]
        self.num_free_blocks -= 1

    def __iter__(self) -> Iterator[KVCacheBlock]:
        """The free blocks in eviction order. Cost: O(n log n)."""
        blocks = self._blocks
        yield from (blocks[b] for b in sorted(self._first_fit))
        yield from (blocks[b] for _, b in sorted((key, b) for b, key in self._live.items()))

    # --- inside ---------------------------------------------------------------------------

    def _key(self, b: int) -> Key:
        """Block b's key under the policy, from its stamps (the spec's `eviction_key`)."""
        stamps = self.last_access[b], self.num_accesses[b], self.registered_at[b], self.is_evict_first[b]
        return cast(Key, eviction_key(self._rule, b, *stamps, PY))

    def _add(self, block: KVCacheBlock) -> None:
        b = block.block_id
        self.num_free_blocks += 1
        if block.block_hash is None:
            heapq.heappush(self._first_fit, b)
            return
        key = self._key(b)
        self._live[b] = key
        if len(self._cached) > 2 * len(self._live) + 64:  # mostly stale: keep only the live entries
            self._cached = [(k, i) for i, k in self._live.items()]
            heapq.heapify(self._cached)
        else:
            heapq.heappush(self._cached, (key, b))
