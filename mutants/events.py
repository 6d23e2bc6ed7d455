"""Mutants of what the pool tells the world: its KV cache events and its hit statistics.

Each is the reference with one plausible mistake in what it publishes or
counts, every block, hash and ref_cnt staying right, so only a check of the
events (the router's mirror rules, the stream against the spec's) or of the
counters can see it. Routers have drifted from engines through exactly these:
a removal never sent, a parent that is not the block before, a block
announced again when it is reused, a reset that clears nothing downstream;
and hit rates have been inflated by counting a preempted request's recompute
as a new request's hit, or the external cache's tokens as local hits.
"""

from __future__ import annotations

from dataclasses import replace

from kvspec.conformance.targets.builtin import ReferenceManagerAdapter, ReferencePoolAdapter
from kvspec.conformance.tools.mutants import Mutant
from kvspec.reference.free_queue import KVCacheBlock
from kvspec.reference.kv_cache_manager import _GroupManager
from kvspec.spec.events import BlockStored
from kvspec.spec.manager import AllocationStep, Request
from kvspec.spec.state import BlockHash, BlockId

__all__ = ["MUTANTS"]


class EvictionWithoutBlockRemoved(ReferencePoolAdapter):
    """Reallocating a cached block drops its hash but publishes no `BlockRemoved`.

    A router keeps offering the prefix to requests routed here, which then
    miss: its mirror holds a key the pool no longer has.
    """

    def _evict(self, block: KVCacheBlock) -> None:
        queue, self.kv_event_queue = self.kv_event_queue, None  # MUTANT: the removal goes unpublished
        try:
            super()._evict(block)
        finally:
            self.kv_event_queue = queue


class ResetWithoutAllBlocksCleared(ReferencePoolAdapter):
    """A successful `reset_prefix_cache` forgets every hash but publishes no `AllBlocksCleared`."""

    def reset_prefix_cache(self) -> bool:
        queue, self.kv_event_queue = self.kv_event_queue, None  # MUTANT: the clear goes unpublished
        try:
            return super().reset_prefix_cache()
        finally:
            self.kv_event_queue = queue


class HitAnnouncedAgain(ReferencePoolAdapter):
    """A prefix hit publishes a `BlockStored` for the blocks it reuses, though they were cached already.

    A router that counts references then holds each reused key once more
    than the pool has blocks under it, and keeps it after its last block goes.
    """

    def touch(self, block_ids: list[BlockId]) -> None:  # type: ignore[override]
        super().touch(block_ids)
        if self.kv_event_queue is not None and block_ids:  # MUTANT: reused blocks announced as stored
            keys = tuple(self.blocks[b].block_hash for b in block_ids)
            self.kv_event_queue.append(
                BlockStored(block_hashes=tuple(k for k in keys if k is not None), parent_block_hash=None)
            )


class _ParentIsFirstBlock(_GroupManager):
    def _stored(
        self, step: AllocationStep, num_cached: int, num_full: int, positions: list[int], keys: list[BlockHash]
    ) -> BlockStored:
        event = super()._stored(step, num_cached, num_full, positions, keys)
        parent = self.key(step.hashes[num_cached]) if num_cached else None  # MUTANT: not num_cached - 1
        return replace(event, parent_block_hash=parent)


class StoredWithWrongParent(ReferenceManagerAdapter):
    """A registration names as parent the first block it registers, not the block before it.

    A router that chains blocks by parent attaches every continuation of a
    cached prefix to a block it has not heard of yet.
    """

    group_manager_cls = _ParentIsFirstBlock


class PreemptedCountedAsNew(ReferenceManagerAdapter):
    """A request admitted again after a preemption is counted as a new request: its recompute inflates hits."""

    def _record_admission(self, request: Request, num_local_hits: int, num_external: int) -> None:
        preempted = False  # MUTANT: request.num_preemptions is not read
        self.stats = self.stats.admitted(
            len(request.token_ids), num_local_hits, num_external, preempted, self._lookup_enabled(request)
        )


class ExternalCountedAsLocal(ReferenceManagerAdapter):
    """The external connector's tokens are counted as local hits: the prefix cache gets the external cache's credit."""

    def _record_admission(self, request: Request, num_local_hits: int, num_external: int) -> None:
        preempted = request.num_preemptions > 0
        # MUTANT: the connector's tokens added to the local hits, and the connector credited nothing
        self.stats = self.stats.admitted(
            len(request.token_ids), num_local_hits + num_external, 0, preempted, self._lookup_enabled(request)
        )


class SkippedLookupCounted(ReferenceManagerAdapter):
    """A request whose lookup did not run (caching off, a hit limit of 0) is counted in the local statistics.

    Its tokens count as queries the cache missed, so the hit rate of a
    deployment that serves many such requests (prompt scoring) drops for a
    cache that was never asked.
    """

    def _record_admission(self, request: Request, num_local_hits: int, num_external: int) -> None:
        preempted = request.num_preemptions > 0
        # MUTANT: counted locally whether or not its lookup ran
        self.stats = self.stats.admitted(len(request.token_ids), num_local_hits, num_external, preempted, True)


MUTANTS: list[Mutant] = [
    Mutant(
        name="eviction_without_block_removed",
        description="an evicted cached block publishes no BlockRemoved",
        level="pool",
        factory=EvictionWithoutBlockRemoved,
        kind="an eviction that publishes no BlockRemoved",
        events=True,
    ),
    Mutant(
        name="reset_without_all_blocks_cleared",
        description="a successful reset publishes no AllBlocksCleared",
        level="pool",
        factory=ResetWithoutAllBlocksCleared,
        kind="a reset without AllBlocksCleared",
        events=True,
    ),
    Mutant(
        name="hit_announced_again",
        description="a prefix hit publishes BlockStored for blocks that were cached already",
        level="pool",
        factory=HitAnnouncedAgain,
        kind="a stored event for a block already cached",
        events=True,
    ),
    Mutant(
        name="stored_with_wrong_parent",
        description="a registration's BlockStored names its first block as parent, not the block before",
        level="manager",
        factory=StoredWithWrongParent,
        kind="a BlockStored with the wrong parent",
        events=True,
    ),
    Mutant(
        name="preempted_counted_as_new",
        description="a re-admitted preempted request's hits are counted as a new request's",
        level="manager",
        factory=PreemptedCountedAsNew,
        kind="a hit counted for a preempted request",
        events=True,
    ),
    Mutant(
        name="external_counted_as_local",
        description="the external connector's tokens are counted as local prefix-cache hits",
        level="manager",
        factory=ExternalCountedAsLocal,
        kind="an external hit counted as local",
        events=True,
    ),
    Mutant(
        name="skipped_lookup_counted",
        description="an admitted request whose prefix-cache lookup did not run is counted in the local hit statistics",
        level="manager",
        factory=SkippedLookupCounted,
        kind="a skipped lookup counted as a query",
        enable_caching=False,
        events=True,
    ),
]
