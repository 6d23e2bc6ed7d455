"""vLLM's free-block queue: a doubly linked list threaded through the blocks themselves.

Design choice: the links live in the block objects (`prev_free_block`,
`next_free_block`) with two sentinel nodes, so removing a block that a cache
hit touches is O(1) without a search, and no allocation happens per
operation. The rejected alternative, `collections.deque`, makes `remove` O(n),
which is the operation every prefix hit performs.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from kvspec.spec.state import BlockHash

__all__ = ["FreeKVCacheBlockQueue", "KVCacheBlock"]


class KVCacheBlock:
    """One physical KV block's metadata."""

    __slots__ = ("block_id", "block_hash", "is_null", "next_free_block", "prev_free_block", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id  # fixed index into the KV tensor
        self.ref_cnt = 0  # requests holding it; changed by the pool only
        self.block_hash: BlockHash | None = None  # set when full and registered, cleared on eviction
        self.is_null = False  # True only for block 0 (never freed, touched or hashed)
        self.prev_free_block: KVCacheBlock | None = None  # free-queue link, owned by the queue
        self.next_free_block: KVCacheBlock | None = None  # free-queue link, owned by the queue

    def __repr__(self) -> str:
        return f"KVCacheBlock(block_id={self.block_id}, ref_cnt={self.ref_cnt}, block_hash={self.block_hash!r})"


class FreeKVCacheBlockQueue:
    """The free blocks in eviction order: the left end is taken first.

    A block is in the queue iff both its links are set (sentinels make every
    real node have two neighbours), which also makes membership O(1).
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        """Queue `blocks` in the given order.

        Cost: O(len(blocks)).
        """
        self.num_free_blocks = len(blocks)  # kept in step with the links
        self._head = KVCacheBlock(-1)  # sentinel before the left end
        self._tail = KVCacheBlock(-1)  # sentinel after the right end
        prev = self._head
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
        prev.next_free_block = self._tail
        self._tail.prev_free_block = prev

    def __contains__(self, block: KVCacheBlock) -> bool:
        """Whether `block` is queued. Cost: O(1)."""
        return block.next_free_block is not None

    def popleft(self) -> KVCacheBlock:
        """Remove and return the leftmost block.

        Cost: O(1).
        """
        block = self._head.next_free_block
        assert block is not None and block is not self._tail, "popleft on an empty free queue"
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Remove and return the n leftmost blocks, left to right.

        Cost: O(n).
        """
        assert n <= self.num_free_blocks, f"popleft_n(n={n}) with {self.num_free_blocks} free"
        taken: list[KVCacheBlock] = []
        node = self._head.next_free_block
        for _ in range(n):
            assert node is not None
            taken.append(node)
            nxt = node.next_free_block
            node.prev_free_block = node.next_free_block = None
            node = nxt
        assert node is not None
        self._head.next_free_block = node
        node.prev_free_block = self._head
        self.num_free_blocks -= n
        return taken

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink `block` from wherever it is.

        Cost: O(1).
        """
        prev, nxt = block.prev_free_block, block.next_free_block
        assert prev is not None and nxt is not None, f"remove: block {block.block_id} is not queued"
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Put `blocks` at the right end, in order.

        Cost: O(len(blocks)).
        """
        last = self._tail.prev_free_block
        assert last is not None
        count = 0  # counted here and added once: this runs for every block a request frees
        for block in blocks:
            last.next_free_block = block
            block.prev_free_block = last
            last = block
            count += 1
        last.next_free_block = self._tail
        self._tail.prev_free_block = last
        self.num_free_blocks += count

    def append(self, block: KVCacheBlock) -> None:
        """Put `block` at the right end. Cost: O(1)."""
        self.append_n((block,))

    def prepend_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Put `blocks` at the left end, keeping their order (the first given is taken first).

        Cost: O(len(blocks)).
        """
        first = self._head.next_free_block
        assert first is not None
        prev = self._head
        count = 0
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
            count += 1
        prev.next_free_block = first
        first.prev_free_block = prev
        self.num_free_blocks += count

    def __iter__(self) -> Iterator[KVCacheBlock]:
        """The queued blocks, left to right. Cost: O(n)."""
        node = self._head.next_free_block
        while node is not None and node is not self._tail:
            yield node
            node = node.next_free_block
