"""Mutants of the prefix-cache table: eviction, registration and reset.

A block's hash and the table entry that points at it must appear and vanish
together (hash-table-consistent), only eviction and reset may drop them
(only-eviction-removes), and a reset may not pull hashes from under running
requests. Each pool below breaks one of those in one line.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvspec.conformance.targets.builtin import ReferencePoolAdapter
from kvspec.conformance.tools.mutants import Mutant
from kvspec.reference.free_queue import KVCacheBlock
from kvspec.spec.errors import InvalidBlock, InvalidRequest
from kvspec.spec.state import BlockHash, BlockId

__all__ = ["MUTANTS"]


class EvictionKeepsHashEntry(ReferencePoolAdapter):
    """Evicting a block clears its `block_hash` but forgets to delete the table entry.

    The table still maps the old hash to a block that now holds someone
    else's KV: the next request with that prefix hits garbage.
    """

    def _evict(self, block: KVCacheBlock) -> None:
        block.block_hash = None  # MUTANT: the `del cached_block_hash_to_block[...][block_id]` is missing


class StaleHashAfterEviction(ReferencePoolAdapter):
    """Evicting a block deletes its table entry but leaves `block.block_hash` set (no `reset_hash()`).

    The reallocated block looks cached though no entry points at it, and
    registering it when it fills again is refused as already cached.
    """

    def _evict(self, block: KVCacheBlock) -> None:
        assert block.block_hash is not None, f"evicting block {block.block_id} without a hash"
        entry = self.cached_block_hash_to_block[block.block_hash]
        del entry[block.block_id]
        if not entry:
            del self.cached_block_hash_to_block[block.block_hash]
        # MUTANT: `block.block_hash = None` is missing


class DuplicateHashOverwrites(ReferencePoolAdapter):
    """The table keeps one block per hash: registering an identical full block replaces the earlier one.

    vLLM keeps every block registered under a hash (block tables are
    append-only, so duplicates cannot be merged); this pool forgets the
    first, which keeps its hash with no entry pointing at it.
    """

    def cache_full_blocks(self, block_ids: Sequence[BlockId], block_hashes: Sequence[BlockHash]) -> None:
        super().cache_full_blocks(block_ids, block_hashes)
        for b, h in zip(block_ids, block_hashes):
            self.cached_block_hash_to_block[h] = {b: self.blocks[b]}  # MUTANT: `= {...}`, not `setdefault(h, {})[b] =`


class CachedBlockReregistered(ReferencePoolAdapter):
    """`cache_full_blocks` lacks the already-cached check: a registered block is registered again.

    Under a new hash the block then sits in two table entries, one of which
    its own `block_hash` contradicts.
    """

    def cache_full_blocks(self, block_ids: Sequence[BlockId], block_hashes: Sequence[BlockHash]) -> None:
        if not self.enable_caching:
            raise InvalidRequest("cache_full_blocks: prefix caching is off (enable_caching=False), nothing is hashed")
        if len(block_ids) != len(block_hashes):
            raise InvalidRequest(
                f"cache_full_blocks: {len(block_ids)} block_ids but {len(block_hashes)} block_hashes; "
                "one hash per block"
            )
        blocks = self._blocks_of(block_ids, "cache_full_blocks")
        for block, h in zip(blocks, block_hashes):
            if not isinstance(h, bytes):
                raise InvalidRequest(f"cache_full_blocks: block_hash={h!r} for block_id={block.block_id} is not bytes")
            if block.ref_cnt == 0:
                raise InvalidBlock(
                    f"cache_full_blocks: block_id={block.block_id} has ref_cnt=0; only a held, computed block is cached"
                )
            # MUTANT: the `block.block_hash is not None` -> AlreadyCached check is missing
        for block, h in zip(blocks, block_hashes):
            block.block_hash = h
            self.cached_block_hash_to_block.setdefault(h, {})[block.block_id] = block


class EvictBlocksSparesHeld(ReferencePoolAdapter):
    """`evict_blocks` drops the hash of free blocks only, assuming a held block must stay cached.

    A block whose content is known bad (a failed external load) stays
    hittable as long as some request holds it.
    """

    def evict_blocks(self, block_ids: Sequence[BlockId]) -> None:
        for block in self._blocks_of(block_ids, "evict_blocks"):
            if block.block_hash is not None and block.ref_cnt == 0:  # MUTANT: `and block.ref_cnt == 0`
                self._evict(block)


class ResetWhileHeld(ReferencePoolAdapter):
    """`reset_prefix_cache` has no held-blocks check: it clears every hash even under running requests."""

    def reset_prefix_cache(self) -> bool:
        # MUTANT: the `num_free_blocks != num_gpu_blocks - 1: return False` guard is missing
        self.cached_block_hash_to_block = {}
        for block in self.blocks:
            block.block_hash = None
        return True


class ResetCountsNullTwice(ReferencePoolAdapter):
    """`reset_prefix_cache` subtracts the null block twice: it resets while exactly one block is held.

    vLLM's check is "used blocks == 1 (the null block)"; counting used blocks
    as `num_gpu_blocks - num_free - 1` and then comparing with 1 again lets
    one held block slip through.
    """

    def reset_prefix_cache(self) -> bool:
        num_used_blocks = self.num_gpu_blocks - self.get_num_free_blocks() - 1  # the null block excluded here...
        if num_used_blocks > 1:  # MUTANT: ...and excused again here (`!= 0` was meant)
            return False
        self.cached_block_hash_to_block = {}
        for block in self.blocks:
            block.block_hash = None
        return True


class FreeEvictsCachedBlocks(ReferencePoolAdapter):
    """`free_blocks` evicts the blocks it frees: the eviction that belongs in `get_new_blocks` runs on free.

    Every finished request's prefix is forgotten the moment it is freed, so
    nothing is ever hit after its request ends; the hash entries vanish on a
    step that evicts nothing (only-eviction-removes).
    """

    def free_blocks(self, ordered_block_ids: Sequence[BlockId]) -> None:
        super().free_blocks(ordered_block_ids)
        for b in ordered_block_ids:
            block = self.blocks[b]
            if block.ref_cnt == 0 and block.block_hash is not None:
                self._evict(block)  # MUTANT: `_maybe_evict_cached_block` called on free, not on reuse


class CachesWithCachingOff(ReferencePoolAdapter):
    """`cache_full_blocks` has no caching-off refusal: with prefix caching off it still registers blocks.

    A pool built without a prefix cache then holds hashes that nothing
    evicts in the caching-off paths, and serves hits it was told not to.
    """

    def cache_full_blocks(self, block_ids: Sequence[BlockId], block_hashes: Sequence[BlockHash]) -> None:
        caching, self.enable_caching = self.enable_caching, True  # MUTANT: the `not enable_caching` refusal skipped
        try:
            super().cache_full_blocks(block_ids, block_hashes)
        finally:
            self.enable_caching = caching


MUTANTS: list[Mutant] = [
    Mutant(
        name="eviction_keeps_hash_entry",
        description="evicting a block clears its hash but leaves its entry in the hash table",
        level="pool",
        factory=EvictionKeepsHashEntry,
        kind="eviction that keeps the hash entry",
    ),
    Mutant(
        name="stale_hash_after_eviction",
        description="evicting a block removes its table entry but leaves block_hash set",
        level="pool",
        factory=StaleHashAfterEviction,
        kind="a stale hash after eviction",
    ),
    Mutant(
        name="duplicate_hash_overwrites",
        description="registering a second block under a hash replaces the first in the table instead of adding to it",
        level="pool",
        factory=DuplicateHashOverwrites,
        kind="identical full blocks merged",
    ),
    Mutant(
        name="cached_block_reregistered",
        description="cache_full_blocks accepts a block that already has a hash and registers it again",
        level="pool",
        factory=CachedBlockReregistered,
        kind="a cached block re-registered",
    ),
    Mutant(
        name="evict_blocks_spares_held",
        description="evict_blocks drops the hashes of free blocks only; held blocks stay hittable",
        level="pool",
        factory=EvictBlocksSparesHeld,
        kind="eviction that keeps the hash entry",
    ),
    Mutant(
        name="reset_while_held",
        description="reset_prefix_cache clears every hash even while requests hold blocks",
        level="pool",
        factory=ResetWhileHeld,
        kind="reset accepted while blocks are held",
    ),
    Mutant(
        name="reset_counts_null_twice",
        description="reset_prefix_cache excludes the null block twice, so it resets while one block is held",
        level="pool",
        factory=ResetCountsNullTwice,
        kind="reset accepted while blocks are held",
    ),
    Mutant(
        name="free_evicts_cached_blocks",
        description="free_blocks evicts the cached blocks it frees, so no prefix outlives its request",
        level="pool",
        factory=FreeEvictsCachedBlocks,
        kind="a hash dropped without eviction",
    ),
    Mutant(
        name="caches_with_caching_off",
        description="cache_full_blocks registers blocks with prefix caching off instead of refusing",
        level="pool",
        factory=CachesWithCachingOff,
        kind="a hash where caching is off",
        enable_caching=False,
    ),
]
