"""An unmutated base for the mutants whose bug the reference offers no seam for.

Most mutants override one reference method; the request-level ones override
one phase of the reference's `allocate_slots` (validate, plan, touch the hits,
take new blocks, register full blocks). One bug needs more room: a duplicate
free-queue entry cannot be represented by the reference's linked list (a block
has one pair of links), so `ListQueuePool` keeps the free queue in a plain
Python list, the structure a first implementation would use (the same order,
with O(n) removal).

The base is not a mutant: tests/mutants/test_mutants.py checks that it
conforms, so a kill of a mutant built on it is due to its one change.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from kvspec.conformance.core.adapter import AdapterConfig
from kvspec.conformance.targets.builtin import ReferencePoolAdapter
from kvspec.reference.free_queue import KVCacheBlock

__all__ = ["ListFreeKVCacheBlockQueue", "ListQueuePool"]


class ListFreeKVCacheBlockQueue:
    """The free queue as a Python list: the left end is index 0.

    The same interface as the reference's linked queue. Unlike it, a list
    accepts a block twice without complaint, which is exactly how a
    duplicate entry goes unnoticed in such an implementation.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._blocks = list(blocks)  # left to right; the pool is the only writer

    @property
    def num_free_blocks(self) -> int:
        """How many entries the queue has. Cost: O(1)."""
        return len(self._blocks)

    def __contains__(self, block: KVCacheBlock) -> bool:
        return block in self._blocks

    def popleft(self) -> KVCacheBlock:
        return self._blocks.pop(0)

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        taken = self._blocks[:n]
        del self._blocks[:n]
        return taken

    def remove(self, block: KVCacheBlock) -> None:
        self._blocks.remove(block)  # the first occurrence, as list.remove does

    def append(self, block: KVCacheBlock) -> None:
        self._blocks.append(block)

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._blocks.extend(blocks)

    def prepend_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._blocks[:0] = list(blocks)

    def __iter__(self) -> Iterator[KVCacheBlock]:
        return iter(list(self._blocks))


class ListQueuePool(ReferencePoolAdapter):
    """The reference pool with its free queue kept in a list (same order, same operations)."""

    def __init__(self, config: AdapterConfig) -> None:
        super().__init__(config)
        queued = list(self.free_block_queue)
        for block in queued:
            block.prev_free_block = block.next_free_block = None
        self.free_block_queue = ListFreeKVCacheBlockQueue(queued)  # type: ignore[assignment]
