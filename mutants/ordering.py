"""Mutants of the eviction order: which end blocks are taken from and freed to, and in what order.

The free queue is the eviction order, so each of these pools keeps every
block and every hash right and only puts blocks in the wrong place: the
harness must compare the whole queue, not just its contents, to see them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvspec.conformance.core.adapter import AdapterConfig
from kvspec.conformance.targets.builtin import ReferenceManagerAdapter, ReferencePoolAdapter
from kvspec.conformance.tools.mutants import Mutant
from kvspec.reference.free_queue import FreeKVCacheBlockQueue, KVCacheBlock
from kvspec.reference.kv_cache_manager import _GroupManager
from kvspec.spec.errors import is_count
from kvspec.spec.state import NULL_BLOCK_ID, BlockId

__all__ = ["MUTANTS"]


class AllocateFromRight(ReferencePoolAdapter):
    """`get_new_blocks` pops the right end (`pop()` where `popleft()` was meant).

    The right end holds the most recently freed cached blocks, so the pool
    evicts exactly the blocks it meant to keep longest: LRU turned into MRU.
    """

    def get_new_blocks(self, num_blocks: int) -> list[BlockId]:
        if not is_count(num_blocks) or num_blocks > self.get_num_free_blocks():
            return super().get_new_blocks(num_blocks)  # the reference words the refusal
        taken: list[BlockId] = []
        for _ in range(num_blocks):
            block = list(self.free_block_queue)[-1]  # MUTANT: the right end
            self.free_block_queue.remove(block)
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            taken.append(BlockId(block.block_id))
        return taken


class HashedFreedToLeft(ReferencePoolAdapter):
    """`free_blocks` tests `block_hash is not None` where `is None` was meant: the two ends are swapped.

    Cached blocks go to the left end and are reused first, blocks nobody can
    hit linger at the right end.
    """

    def free_blocks(self, ordered_block_ids: Sequence[BlockId]) -> None:
        blocks = self._blocks_of(ordered_block_ids, "free_blocks")
        if any(block.ref_cnt == 0 for block in blocks):
            super().free_blocks(ordered_block_ids)  # the reference refuses the double free
            return
        left: list[KVCacheBlock] = []
        right: list[KVCacheBlock] = []
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is not None:  # MUTANT: `is None`
                    left.append(block)
                else:
                    right.append(block)
        self.free_block_queue.prepend_n(left)
        self.free_block_queue.append_n(right)


class UnhashedFreedToRight(ReferencePoolAdapter):
    """Claims `vllm-v1` but frees as earlier vLLM v1 releases did: every freed block to the right end.

    A block without a hash can never be hit, yet it now waits behind every
    cached block, which gets evicted before it.
    """

    def __init__(self, config: AdapterConfig) -> None:
        super().__init__(config)
        self._unhashed_to_left = False  # MUTANT: the `vllm-v1-tail` rule under the `vllm-v1` name


class FreeIgnoresEvictFirst(ReferencePoolAdapter):
    """`free_blocks` takes vLLM 0.34.0's `evict_first` but drops it: cached blocks always go to the right end.

    Blocks whose content another tier already holds were to be the first
    cached blocks evicted; instead they are kept longest, pushing out cached
    blocks that exist nowhere else.
    """

    def free_blocks(self, ordered_block_ids: Sequence[BlockId], evict_first: bool = False) -> None:
        super().free_blocks(ordered_block_ids)  # MUTANT: evict_first not passed on


class _PrependOneByOneQueue(FreeKVCacheBlockQueue):
    """`prepend_n` written as a loop of single prepends, which reverses the batch."""

    def prepend_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        for block in blocks:
            super().prepend_n((block,))  # MUTANT: each one lands before the previous one


class LeftBatchReversed(ReferencePoolAdapter):
    """Blocks freed to the left end in one call end up in reverse order (prepended one at a time).

    The caller passes a request's blocks tail first so that its last block is
    reused first; this pool reuses its first block first.
    """

    def __init__(self, config: AdapterConfig) -> None:
        super().__init__(config)
        self.free_block_queue = _PrependOneByOneQueue([])
        self.free_block_queue.append_n(block for block in self.blocks if not block.is_null)


class _HeadFirstGroup(_GroupManager):
    def free(self, request_id: str) -> None:
        table = self.req_to_blocks.pop(request_id, None)
        self.num_cached_block.pop(request_id, None)
        held = [b for b in table or () if b != NULL_BLOCK_ID]
        if held:
            self.pool.free_blocks(held)  # MUTANT: not reversed


class FreeHeadFirst(ReferenceManagerAdapter):
    """`free` passes the block table as is (`req_blocks`) where `reversed(req_blocks)` was meant.

    The request's last blocks, the least likely to be shared, now sit to the
    right of its common leading blocks and outlive them in the cache.
    """

    group_manager_cls = _HeadFirstGroup


MUTANTS: list[Mutant] = [
    Mutant(
        name="allocate_from_right",
        description="get_new_blocks takes blocks from the right end of the free queue (MRU instead of LRU)",
        level="pool",
        factory=AllocateFromRight,
        kind="wrong free end",
    ),
    Mutant(
        name="hashed_freed_to_left",
        description=(
            "free_blocks sends cached blocks to the left end and blocks without a hash to the right (ends swapped)"
        ),
        level="pool",
        factory=HashedFreedToLeft,
        kind="wrong free end",
    ),
    Mutant(
        name="unhashed_freed_to_right",
        description=(
            "free_blocks sends every freed block to the right end, as earlier vLLM v1 did, while claiming vllm-v1"
        ),
        level="pool",
        factory=UnhashedFreedToRight,
        kind="wrong free end",
        # Without caching no block has a hash: every freed block must go left.
        enable_caching=False,
    ),
    Mutant(
        name="free_ignores_evict_first",
        description="free_blocks takes evict_first but ignores it: blocks freed with it go to the right end",
        level="pool",
        factory=FreeIgnoresEvictFirst,
        kind="wrong free end",
    ),
    Mutant(
        name="left_batch_reversed",
        description="free_blocks prepends the blocks it sends left one at a time, reversing the tail-first order",
        level="pool",
        factory=LeftBatchReversed,
        kind="no tail-first order",
        enable_caching=False,
    ),
    Mutant(
        name="free_head_first",
        description="KVCacheManager.free frees a request's block table head first, not reversed",
        level="manager",
        factory=FreeHeadFirst,
        kind="a freed block not reversed",
    ),
]
