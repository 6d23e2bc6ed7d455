"""A miniature of vLLM v0's LRUEvictor: the same names and heap key, written for the tests."""

import heapq


class LRUEvictor:
    def __init__(self):
        self.free_table = {}  # block id -> (content hash, last accessed)
        self.priority_queue = []

    def __contains__(self, block_id):
        return block_id in self.free_table

    def add(self, block_id, content_hash, num_hashed_tokens, last_accessed):
        self.free_table[block_id] = (content_hash, last_accessed)
        heapq.heappush(self.priority_queue, (last_accessed, -num_hashed_tokens, block_id, content_hash))

    def evict(self):
        while self.priority_queue:
            last_accessed, _, block_id, content_hash = heapq.heappop(self.priority_queue)
            if self.free_table.get(block_id, (None, None))[1] == last_accessed:
                del self.free_table[block_id]
                return block_id, content_hash
        raise ValueError("No usable cache memory left")

    def remove(self, block_id):
        del self.free_table[block_id]

    @property
    def num_blocks(self):
        return len(self.free_table)
