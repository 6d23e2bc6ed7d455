"""Mutants of taking blocks: touch, get_new_blocks, and the free-block count.

A hit must take a block out of the free queue, an allocation that cannot be
served must change nothing, and the count the scheduler plans with must be
the queue's true length. Each pool below gets one of those wrong.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvspec.conformance.core.adapter import AdapterConfig
from kvspec.conformance.targets.builtin import ReferenceManagerAdapter, ReferencePoolAdapter
from kvspec.conformance.tools.mutants import Mutant
from kvspec.reference.free_queue import FreeKVCacheBlockQueue, KVCacheBlock
from kvspec.spec.errors import InvalidBlock, PoolExhausted, is_count
from kvspec.spec.state import BlockId

__all__ = ["MUTANTS"]


class TouchLeavesBlockQueued(ReferencePoolAdapter):
    """`touch` increments ref_cnt before testing `ref_cnt == 0`, so a free block is never unlinked.

    The hit block stays in the free queue while a request holds it, and the
    next allocation hands it to a second request.
    """

    def touch(self, block_ids: Sequence[BlockId]) -> None:
        blocks = self._blocks_of(block_ids, "touch")
        for block in blocks:
            if block.block_hash is None:
                raise InvalidBlock(
                    f"touch: block_id={block.block_id} has no hash (ref_cnt={block.ref_cnt}), "
                    "so no request can have hit it; stale block table?"
                )
        for block in blocks:
            block.ref_cnt += 1  # MUTANT: moved above the test below, which can then never pass
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)


class TouchUnlinksHeldBlock(ReferencePoolAdapter):
    """`touch` unlinks every hit block from the free queue, also one another request holds.

    A block shared by a second request is not in the queue; unlinking it
    follows links that are not there.
    """

    def touch(self, block_ids: Sequence[BlockId]) -> None:
        blocks = self._blocks_of(block_ids, "touch")
        for block in blocks:
            if block.block_hash is None:
                raise InvalidBlock(
                    f"touch: block_id={block.block_id} has no hash (ref_cnt={block.ref_cnt}), "
                    "so no request can have hit it; stale block table?"
                )
        for block in blocks:
            self.free_block_queue.remove(block)  # MUTANT: the `if block.ref_cnt == 0` guard is missing
            block.ref_cnt += 1


class PartialAllocationOnExhaustion(ReferencePoolAdapter):
    """`get_new_blocks` pops blocks one by one and only notices the queue is empty when it runs dry.

    A request asking for more than is free gets PoolExhausted, but the
    blocks popped before that stay taken (ref_cnt 1, hashes evicted) and
    belong to nobody: leaked.
    """

    def get_new_blocks(self, num_blocks: int) -> list[BlockId]:
        if not is_count(num_blocks):
            return super().get_new_blocks(num_blocks)  # the reference words the refusal
        # MUTANT: no up-front `num_blocks > num_free -> PoolExhausted` check
        taken: list[BlockId] = []
        for _ in range(num_blocks):
            if self.free_block_queue.num_free_blocks == 0:
                raise PoolExhausted(
                    f"cannot allocate num_blocks={num_blocks}: 0 free of "
                    f"num_gpu_blocks={self.num_gpu_blocks}, one is the null block"
                )
            block = self.free_block_queue.popleft()
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            taken.append(BlockId(block.block_id))
        return taken


class _PrependUncountedQueue(FreeKVCacheBlockQueue):
    """`prepend_n` links the blocks in but does not add them to `num_free_blocks`."""

    def prepend_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        batch = list(blocks)
        super().prepend_n(batch)
        self.num_free_blocks -= len(batch)  # MUTANT: the counter is bumped in append_n only


class NumFreeMissesLeftFrees(ReferencePoolAdapter):
    """The free-queue counter is not bumped for blocks freed to the left end.

    Every block freed without a hash makes the pool report one free block
    fewer than it has, so allocations that fit are refused.
    """

    def __init__(self, config: AdapterConfig) -> None:
        super().__init__(config)
        self.free_block_queue = _PrependUncountedQueue([])
        self.free_block_queue.append_n(block for block in self.blocks if not block.is_null)


class NumFreeCountsNullBlock(ReferencePoolAdapter):
    """`get_num_free_blocks` is computed as `num_gpu_blocks - blocks held`, counting the null block as free.

    The pool itself allocates correctly; a scheduler that plans with this
    count over-commits by one block.
    """

    def get_num_free_blocks(self) -> int:
        # MUTANT: `- 1` for the null block is missing
        return self.num_gpu_blocks - sum(1 for block in self.blocks if block.ref_cnt > 0)


class UsageCountsNullBlock(ReferencePoolAdapter):
    """`get_usage` divides by `num_gpu_blocks`, counting the null block as allocatable.

    A full pool reports less than 100% usage, and metrics and admission
    decisions built on it are off.
    """

    def get_usage(self) -> float:
        return 1.0 - self.get_num_free_blocks() / self.num_gpu_blocks  # MUTANT: `num_gpu_blocks - 1`


class ManagerOverNullCountingPool(ReferenceManagerAdapter):
    """The manager plans with a pool whose `get_num_free_blocks` counts the null block as free.

    An allocation short by exactly one block passes the capacity check and
    fails inside `get_new_blocks`, after the hit blocks were touched,
    instead of returning None with nothing changed.
    """

    def __init__(self, config: AdapterConfig) -> None:
        super().__init__(config)
        self.block_pool = NumFreeCountsNullBlock(config)  # MUTANT: the miscounting pool
        for manager in self.managers:
            manager.pool = self.block_pool  # every group allocates from it


class FreeLosesLastBlock(ReferencePoolAdapter):
    """`free_blocks` queues the blocks reaching ref_cnt 0 with an off-by-one slice (`freed[:-1]`).

    The last block of such a batch is neither free nor held: every request
    that ends leaks a block, and the pool starves.
    """

    def free_blocks(self, ordered_block_ids: Sequence[BlockId]) -> None:
        super().free_blocks(ordered_block_ids)
        freed = [self.blocks[b] for b in ordered_block_ids if self.blocks[b].ref_cnt == 0]
        if freed:
            self.free_block_queue.remove(freed[-1])  # MUTANT: the batch's last block never reaches the queue


MUTANTS: list[Mutant] = [
    Mutant(
        name="touch_leaves_block_queued",
        description="touch increments ref_cnt before its ref_cnt == 0 test, so a hit block stays in the free queue",
        level="pool",
        factory=TouchLeavesBlockQueued,
        kind="touch that leaves the block in the queue",
    ),
    Mutant(
        name="touch_unlinks_held_block",
        description="touch unlinks a hit block from the free queue even when another request holds it",
        level="pool",
        factory=TouchUnlinksHeldBlock,
        kind="touch of a held block",
    ),
    Mutant(
        name="partial_allocation_on_exhaustion",
        description="get_new_blocks has no up-front check: on PoolExhausted the blocks it already popped stay taken",
        level="pool",
        factory=PartialAllocationOnExhaustion,
        kind="a failed allocation that leaves taken blocks",
    ),
    Mutant(
        name="num_free_misses_left_frees",
        description="the free-queue counter is not incremented for blocks freed to the left end",
        level="pool",
        factory=NumFreeMissesLeftFrees,
        kind="a miscounted num_free",
    ),
    Mutant(
        name="num_free_counts_null_block",
        description="get_num_free_blocks counts the null block as free (one too many)",
        level="pool",
        factory=NumFreeCountsNullBlock,
        kind="a miscounted num_free",
    ),
    Mutant(
        name="usage_counts_null_block",
        description="get_usage divides by num_gpu_blocks instead of num_gpu_blocks - 1",
        level="pool",
        factory=UsageCountsNullBlock,
        kind="a miscounted num_free",
    ),
    Mutant(
        name="manager_over_null_counting_pool",
        description=(
            "allocate_slots plans with a free count that includes the null block and fails midway when one short"
        ),
        level="manager",
        factory=ManagerOverNullCountingPool,
        kind="a miscounted num_free",
    ),
    Mutant(
        name="free_loses_last_block",
        description="free_blocks leaves the last block of a batch out of the free queue: neither free nor held",
        level="pool",
        factory=FreeLosesLastBlock,
        kind="a block leaked",
    ),
]
