"""Mutants of the guards: double frees, reference-count underflow, and the null block.

Every one of these pools behaves exactly like the reference on correct input;
they differ only when the caller makes a mistake. The harness finds them only
if it feeds bad input and holds the implementation to the spec's error type
and to "a refused call changes nothing".
"""

from __future__ import annotations

from collections.abc import Sequence

from kvspec.conformance.core.adapter import AdapterConfig
from kvspec.conformance.targets.builtin import ReferencePoolAdapter
from kvspec.conformance.tools.mutants import Mutant
from kvspec.mutants._base import ListQueuePool
from kvspec.reference.free_queue import KVCacheBlock
from kvspec.spec.errors import InvalidBlock, is_count
from kvspec.spec.state import BlockId

__all__ = ["MUTANTS"]


class DoubleFreeIgnored(ReferencePoolAdapter):
    """`free_blocks` skips a block nobody holds ("already free") instead of refusing the double free.

    The caller's bug (a request freed twice, a stale block table) goes
    unreported, and the next time it frees a block someone else holds.
    """

    def free_blocks(self, ordered_block_ids: Sequence[BlockId]) -> None:
        self._blocks_of(ordered_block_ids, "free_blocks")  # ids still checked
        # MUTANT: `if block.ref_cnt == 0: continue` where DoubleFree was raised
        super().free_blocks([b for b in ordered_block_ids if self.blocks[b].ref_cnt > 0])


class RefCntUnderflow(ReferencePoolAdapter):
    """`free_blocks` decrements without checking: freeing a free block takes its ref_cnt to -1.

    The block stays in the free queue with a negative count; once a request
    touches it, its count reads 0 while it is held.
    """

    def free_blocks(self, ordered_block_ids: Sequence[BlockId]) -> None:
        blocks = self._blocks_of(ordered_block_ids, "free_blocks")
        # MUTANT: the `block.ref_cnt == 0 -> DoubleFree` check is missing
        left: list[KVCacheBlock] = []
        right: list[KVCacheBlock] = []
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if self._unhashed_to_left and block.block_hash is None:
                    left.append(block)
                else:
                    right.append(block)
        self.free_block_queue.prepend_n(left)
        self.free_block_queue.append_n(right)


class DoubleFreeRequeues(ListQueuePool):
    """`free_blocks` clamps ref_cnt at 0 (`max(ref_cnt - 1, 0)`) and queues every block at 0.

    A double free goes unreported and queues a block that is already
    queued: two entries for one block, so two requests will be given it.
    """

    def free_blocks(self, ordered_block_ids: Sequence[BlockId]) -> None:
        blocks = self._blocks_of(ordered_block_ids, "free_blocks")
        left: list[KVCacheBlock] = []
        right: list[KVCacheBlock] = []
        for block in blocks:
            block.ref_cnt = max(block.ref_cnt - 1, 0)  # MUTANT: clamped, no DoubleFree
            if block.ref_cnt == 0:
                if self._unhashed_to_left and block.block_hash is None:
                    left.append(block)
                else:
                    right.append(block)
        self.free_block_queue.prepend_n(left)
        self.free_block_queue.append_n(right)


class NullBlockAccepted(ReferencePoolAdapter):
    """The block-id check tests the range only and forgets that block 0 is the null block.

    Freeing or evicting block 0 is then not refused as the null block: it
    is taken for a free block (a double free) or silently accepted.
    """

    def _check_block_id_slowly(self, b: object, op: str) -> None:
        if not is_count(b) or not b < self.num_gpu_blocks:
            raise InvalidBlock(f"{op}: block_id={b!r} is not a block of this pool (ids 0..{self.num_gpu_blocks - 1})")
        # MUTANT: the `b == 0 -> InvalidBlock (null block)` check is missing


class NullBlockQueued(ReferencePoolAdapter):
    """The null block is picked as `blocks[0]` but never taken out of the free queue.

    It is handed out by the first allocation like any other block, and the
    placeholder that sliding-window slots point at gets overwritten.
    """

    def __init__(self, config: AdapterConfig) -> None:
        super().__init__(config)
        self.free_block_queue.prepend_n([self.null_block])  # MUTANT: `blocks[0]`, not `popleft()`


MUTANTS: list[Mutant] = [
    Mutant(
        name="double_free_ignored",
        description="free_blocks silently skips a block with ref_cnt 0 instead of raising DoubleFree",
        level="pool",
        factory=DoubleFreeIgnored,
        kind="a double free accepted",
    ),
    Mutant(
        name="ref_cnt_underflow",
        description="free_blocks decrements ref_cnt without a check, so a double free leaves it at -1",
        level="pool",
        factory=RefCntUnderflow,
        kind="a ref_cnt underflow",
    ),
    Mutant(
        name="double_free_requeues",
        description=(
            "free_blocks clamps ref_cnt at 0 and queues the block again: a double free makes a duplicate queue entry"
        ),
        level="pool",
        factory=DoubleFreeRequeues,
        kind="a duplicate queue entry",
    ),
    Mutant(
        name="null_block_accepted",
        description=(
            "block-id checks accept block 0: freeing the null block is reported as a double free, evicting it passes"
        ),
        level="pool",
        factory=NullBlockAccepted,
        kind="the null block freed or queued",
    ),
    Mutant(
        name="null_block_queued",
        description="the null block is never taken out of the free queue and is handed out by get_new_blocks",
        level="pool",
        factory=NullBlockQueued,
        kind="the null block freed or queued",
    ),
]
