"""A miniature of vLLM v0's PrefixCachingBlockAllocator: its names and shapes, written for the tests.

Unlike v0 it takes free blocks without content lowest id first (first fit)
and it has no reset_prefix_cache (as v0 before 0.7.0).
"""

import bisect

from vllm.core.evictor import LRUEvictor
from vllm.utils import Device  # a real v0 import: light mode runs it from the partial vllm/utils


class _RefCounter:
    def __init__(self, block_ids):
        self._refcounts = dict.fromkeys(block_ids, 0)

    def get(self, block_id):
        return self._refcounts[block_id]


class _Hashless:
    def __init__(self, block_ids):
        self._free_block_indices = list(block_ids)


class Block:
    def __init__(self, allocator, block_id, token_ids=()):
        self._allocator = allocator
        self.block_id = block_id
        self.token_ids = list(token_ids)

    @property
    def content_hash(self):
        return hash((True, None, *self.token_ids, None)) if self.token_ids else None

    def append_token_ids(self, token_ids):
        self.token_ids += token_ids
        self.block_id = self._allocator.promote_to_immutable_block(self)


class PrefixCachingBlockAllocator:
    def __init__(self, num_blocks, block_size, block_ids=None):
        ids = list(range(num_blocks) if block_ids is None else block_ids)
        self._cached_blocks = {}
        self._refcounter = _RefCounter(ids)
        self._hashless_allocator = _Hashless(ids)
        self._last_accessed = dict.fromkeys(ids, -1)
        self.evictor = LRUEvictor()
        self.device = Device.GPU

    def _take(self, block_id):
        self._refcounter._refcounts[block_id] += 1
        return block_id

    def allocate_mutable_block(self, prev_block):
        free = self._hashless_allocator._free_block_indices
        if free:
            return Block(self, self._take(free.pop(0)))  # kept sorted: the lowest id first
        block_id, content_hash = self.evictor.evict()
        del self._cached_blocks[content_hash]
        return Block(self, self._take(block_id))

    def allocate_immutable_block(self, prev_block, token_ids):
        block = Block(self, None, token_ids)
        block.block_id = self._cached_blocks[block.content_hash]
        if self._refcounter.get(block.block_id) == 0:
            self.evictor.remove(block.block_id)
        self._take(block.block_id)
        return block

    def promote_to_immutable_block(self, block):
        if block.content_hash not in self._cached_blocks:
            self._cached_blocks[block.content_hash] = block.block_id
            return block.block_id
        self._refcounter._refcounts[block.block_id] -= 1  # the same swap as v0: the cached block is used
        bisect.insort(self._hashless_allocator._free_block_indices, block.block_id)
        return self._take(self._cached_blocks[block.content_hash])

    def free(self, block):
        b = block.block_id
        self._refcounter._refcounts[b] -= 1
        if self._refcounter.get(b) == 0:
            if block.content_hash is None:
                bisect.insort(self._hashless_allocator._free_block_indices, b)
            else:
                self.evictor.add(b, block.content_hash, len(block.token_ids), self._last_accessed[b])
        block.block_id = None

    def mark_blocks_as_accessed(self, block_ids, now):
        for b in block_ids:
            self._last_accessed[b] = now

    def mark_blocks_as_computed(self, block_ids):
        pass

    def get_num_free_blocks(self):
        return len(self._hashless_allocator._free_block_indices) + self.evictor.num_blocks
