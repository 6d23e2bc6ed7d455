"""Mutants of the request level: the hit cap, the request's hit limit, registration, failed allocations and
preemption.

The pool underneath is the reference's and is used correctly in every other
respect; each manager below makes one mistake in the bookkeeping vLLM's
KVCacheManager does around it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from kvspec.conformance.targets.builtin import ReferenceManagerAdapter
from kvspec.conformance.tools.mutants import Mutant
from kvspec.reference.kv_cache_manager import _GroupManager
from kvspec.spec.hashing import block_extra_keys, hash_block_tokens, none_hash
from kvspec.spec.manager import AllocationStep, Request, check_request
from kvspec.spec.state import BlockHash, BlockId

__all__ = ["MUTANTS"]


class HitCapOffByOne(ReferenceManagerAdapter):
    """`get_computed_blocks` caps the hit at `len(prompt) // block_size` blocks, not `(len - 1) // block_size`.

    A prompt that is entirely cached and a whole number of blocks long is
    reused in full, leaving no token to compute the first output's logits.
    """

    def get_computed_blocks(self, request: Request) -> tuple[list[BlockId], int]:
        check_request(request, "get_computed_blocks")  # the request checks the reference runs (the spec's)
        if request.request_id in self.num_computed_tokens or not self.enable_caching:
            return super().get_computed_blocks(request)  # the already-running refusal, and the caching-off answer
        max_hit_blocks = len(request.token_ids) // self.block_size  # MUTANT: `len - 1`
        hits: list[BlockId] = []
        for h in self._block_hashes(request)[:max_hit_blocks]:
            b = self.block_pool.get_cached_block(h)
            if b is None:
                break
            hits.append(b)
        return hits, len(hits) * self.block_size


class IgnoresHitLimit(ReferenceManagerAdapter):
    """`get_computed_blocks` ignores the request's `prefix_cache_hit_limit`: it looks up as if there were none.

    A request that must not read the cache (limit 0, prompt scoring from its
    first row) is served cached KV anyway, and one scored from row N gets a
    hit past N, whose prompt logprobs are then never computed.
    """

    def get_computed_blocks(
        self, request: Request, max_cache_hit_length: int | None = None
    ) -> tuple[list[BlockId], int]:
        unlimited = replace(request, prefix_cache_hit_limit=None)  # MUTANT: the request's limit is dropped
        return super().get_computed_blocks(unlimited, max_cache_hit_length)


class PartialBlockHashed(ReferenceManagerAdapter):
    """Full blocks are counted with ceiling division (`cdiv`) where floor division was meant.

    The block holding the last scheduled token is registered though it is
    not full: a request's partial tail gets the hash of its partial tokens,
    and in a chunked prefill a block only half computed gets the full
    block's hash, so a later request can hit KV that was never written.
    """

    def _register_full_blocks(self, step: AllocationStep) -> None:
        if self.enable_caching:
            num_tokens = min(step.num_tokens, len(step.request.token_ids))
            num_full = -(-num_tokens // self.block_size)  # MUTANT: cdiv
            for manager in self.managers:
                manager.cache_blocks(step, num_full)

    def _block_hashes(self, request: Request) -> tuple[BlockHash, ...]:
        full = super()._block_hashes(request)
        start, end = len(full) * self.block_size, len(request.token_ids)
        if start == end:
            return full
        # MUTANT (same cdiv): the hash loop runs over cdiv(len, block_size) blocks, the last one partial.
        parent = full[-1] if full else none_hash(self.hash_fn, self.seed)
        extra = block_extra_keys(start, end, request.lora_name, request.mm_inputs, request.cache_salt)
        return (*full, hash_block_tokens(parent, request.token_ids[start:end], extra, self.hash_fn))


class FailedAllocationLeavesTouched(ReferenceManagerAdapter):
    """`allocate_slots` touches the hit blocks before its capacity check and returns None without undoing it.

    Written as a wrapper, with the same effect as the reordered code: after
    the touch the check sees the hit blocks as taken, so it refuses exactly
    when the reference does, and then the touch stays. The hit blocks are
    held by a request that does not run: they can never be freed.
    """

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Sequence[BlockId] = (),
        num_external_computed_tokens: int = 0,
    ) -> list[BlockId] | None:
        result = super().allocate_slots(
            request, num_new_tokens, num_new_computed_tokens, new_computed_blocks, num_external_computed_tokens
        )
        if result is None and new_computed_blocks:
            self.block_pool.touch(new_computed_blocks)  # MUTANT: the touch that preceded the check stays
        return result


class _NoEvictableHits(_GroupManager):
    def evictable_hits(self, hits: Sequence[BlockId]) -> int:
        return 0  # MUTANT: hit blocks in the free queue are not counted against the free blocks


class CapacityIgnoresEvictableHits(ReferenceManagerAdapter):
    """The capacity check counts only the new blocks, not the hit blocks that still sit in the free queue.

    Touching those hits takes them out of the queue, so `get_new_blocks`
    then finds too few blocks and raises PoolExhausted in the middle of the
    step, after the touch, instead of the step being refused cleanly.
    """

    group_manager_cls = _NoEvictableHits


class _HitsNotCounted(_GroupManager):
    def add_hits(self, request_id: str, hits: Sequence[BlockId], num_computed: int) -> None:
        super().add_hits(request_id, hits, num_computed)
        self.num_cached_block[request_id] = 0  # MUTANT: the hit positions are not counted as registered


class HitBlocksReregistered(ReferenceManagerAdapter):
    """A request's registered-block count starts at 0 instead of at its hit blocks.

    The step then registers the hit blocks again, which the pool refuses
    (AlreadyCached) after the hits were touched and new blocks taken.
    """

    group_manager_cls = _HitsNotCounted


class PreemptionDropsSharedBlock(ReferenceManagerAdapter):
    """`free` hands a preempted request's blocks back whole, as if no other request shared them.

    Each block's ref_cnt is forced to 1 before the free, so a prefix block
    that another running request hit drops to 0, joins the free queue, and
    is reallocated under that request.
    """

    def free(self, request_id: str) -> None:
        for b in self.req_to_blocks.get(request_id, ()):
            self.block_pool.blocks[b].ref_cnt = 1  # MUTANT: "the request owns its blocks"
        super().free(request_id)


MUTANTS: list[Mutant] = [
    Mutant(
        name="hit_cap_off_by_one",
        description=(
            "get_computed_blocks allows len(prompt) // block_size hit blocks, reusing a fully cached prompt whole"
        ),
        level="manager",
        factory=HitCapOffByOne,
        kind="hit cap off by one",
    ),
    Mutant(
        name="partial_block_hashed",
        description="allocate_slots counts full blocks with cdiv, registering the block that holds the last token",
        level="manager",
        factory=PartialBlockHashed,
        kind="a partial block hashed",
    ),
    Mutant(
        name="failed_allocation_leaves_touched",
        description="allocate_slots touches the hit blocks before the capacity check and leaves them touched on None",
        level="manager",
        factory=FailedAllocationLeavesTouched,
        kind="a failed allocation that leaves touched blocks",
    ),
    Mutant(
        name="capacity_ignores_evictable_hits",
        description="allocate_slots' capacity check ignores hit blocks in the free queue and fails midway",
        level="manager",
        factory=CapacityIgnoresEvictableHits,
        kind="a failed allocation that leaves touched blocks",
    ),
    Mutant(
        name="hit_blocks_reregistered",
        description="allocate_slots forgets that hit blocks are registered and registers them again",
        level="manager",
        factory=HitBlocksReregistered,
        kind="a cached block re-registered",
    ),
    Mutant(
        name="ignores_hit_limit",
        description="get_computed_blocks ignores the request's prefix_cache_hit_limit (0 included)",
        level="manager",
        factory=IgnoresHitLimit,
        kind="a request's hit limit ignored",
    ),
    Mutant(
        name="preemption_drops_shared_block",
        description="free on preemption drops every block of the request, also prefix blocks another request holds",
        level="manager",
        factory=PreemptionDropsSharedBlock,
        kind="a preemption that drops a shared block",
    ),
]
