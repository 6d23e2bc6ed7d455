"""A miniature of vLLM's kv_cache_utils.py (0.33's shapes): blocks, the free queue, the hash key.

The default test suite has no vLLM wheel to load; this release, zipped into a
wheel by the tests and loaded by light mode like any other, is the base the
overlay tests put their plugin on.
"""

from __future__ import annotations

from collections.abc import Sequence

BlockHash = bytes  # vLLM: NewType("BlockHash", bytes)


def make_block_hash_with_group_id(block_hash: bytes, group_id: int) -> bytes:
    return block_hash + group_id.to_bytes(4, "big")


class KVCacheBlock:
    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None
        self.is_null = False


class FreeKVCacheBlockQueue:
    """A doubly linked list of free blocks between two sentinels; the left end is taken first."""

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self.num_free_blocks = 0
        self.fake_free_list_head = KVCacheBlock(-1)
        self.fake_free_list_tail = KVCacheBlock(-1)
        self.fake_free_list_head.next_free_block = self.fake_free_list_tail
        self.fake_free_list_tail.prev_free_block = self.fake_free_list_head
        self.append_n(list(blocks))

    def _insert_after(self, where: KVCacheBlock, block: KVCacheBlock) -> None:
        after = where.next_free_block
        assert after is not None
        block.prev_free_block, block.next_free_block = where, after
        where.next_free_block = after.prev_free_block = block
        self.num_free_blocks += 1

    def remove(self, block: KVCacheBlock) -> None:
        assert block.prev_free_block is not None and block.next_free_block is not None
        block.prev_free_block.next_free_block = block.next_free_block
        block.next_free_block.prev_free_block = block.prev_free_block
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def popleft(self) -> KVCacheBlock:
        block = self.fake_free_list_head.next_free_block
        assert block is not None and block is not self.fake_free_list_tail, "No free blocks"
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        return [self.popleft() for _ in range(n)]

    def append_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        for block in blocks:
            last = self.fake_free_list_tail.prev_free_block
            assert last is not None
            self._insert_after(last, block)

    def prepend_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        where = self.fake_free_list_head
        for block in blocks:
            self._insert_after(where, block)
            where = block
