"""A miniature of vLLM's block_pool.py (0.33's shapes and free order); see kv_cache_utils.py."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock, make_block_hash_with_group_id


class BlockPool:
    def __init__(self, num_gpu_blocks: int, enable_caching: bool, hash_block_size: int) -> None:
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = enable_caching
        self.hash_block_size = hash_block_size
        self.blocks = [KVCacheBlock(i) for i in range(num_gpu_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block: dict[bytes, dict[int, KVCacheBlock]] = {}
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True

    def get_cached_block(self, block_hash: bytes, kv_cache_group_ids: list[int]) -> list[KVCacheBlock] | None:
        found = []
        for group_id in kv_cache_group_ids:
            blocks = self.cached_block_hash_to_block.get(make_block_hash_with_group_id(block_hash, group_id))
            if not blocks:
                return None
            found.append(next(iter(blocks.values())))
        return found

    def cache_full_blocks(
        self, request: Any, blocks: list[KVCacheBlock], num_cached_blocks: int, num_full_blocks: int,
        block_size: int, kv_cache_group_id: int,
    ) -> None:  # fmt: skip
        for i in range(num_cached_blocks, num_full_blocks):
            key = make_block_hash_with_group_id(request.block_hashes[i], kv_cache_group_id)
            blocks[i].block_hash = key
            self.cached_block_hash_to_block.setdefault(key, {})[blocks[i].block_id] = blocks[i]

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool")
        ret = self.free_block_queue.popleft_n(num_blocks)
        for block in ret:
            if self.enable_caching:
                self._maybe_evict_cached_block(block)
            block.ref_cnt += 1
        return ret

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            entry = self.cached_block_hash_to_block[block.block_hash]
            del entry[block.block_id]
            if not entry:
                del self.cached_block_hash_to_block[block.block_hash]
            block.block_hash = None

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        for block in blocks:
            if block.ref_cnt == 0 and not block.is_null:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        first, last = [], []
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0 and not block.is_null:
                (first if block.block_hash is None or not self.enable_caching else last).append(block)
        self.free_block_queue.prepend_n(first)
        self.free_block_queue.append_n(last)

    def reset_prefix_cache(self) -> bool:
        if self.num_gpu_blocks - self.get_num_free_blocks() != 1:
            return False
        self.cached_block_hash_to_block = {}
        for block in self.blocks:
            block.block_hash = None
        return True

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        total = self.num_gpu_blocks - 1  # the null block is not counted
        return 0.0 if total == 0 else 1.0 - self.get_num_free_blocks() / total
