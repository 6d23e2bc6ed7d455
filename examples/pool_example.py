"""A block pool written the simplest way, with vLLM v1's BlockPool rules, and its adapter.

Plain lists and a dict, O(n) where vLLM is O(1): what kvspec checks is the
behaviour, not the data structures. Check it with

    kvspec check --impl examples/pool_example.py:factory --level pool

Its one documented bug: with KVSPEC_EXAMPLE_BUG=pool in the environment,
`touch` leaves a hit block in the free queue, so a block a request holds can
be handed to another request and overwritten.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from kvspec.conformance import AdapterConfig
from kvspec.spec.state import BlockHash, BlockId, Snapshot, canonical_hash_to_blocks

BUG = os.environ.get("KVSPEC_EXAMPLE_BUG") == "pool"


class ExamplePool:
    """One BlockPool. Block 0 is the null block: never free, never handed out, never hashed."""

    # It trusts its caller, as vLLM's pool does: the harness then sends it no caller mistakes
    # (a double free, an unknown id, ...) and the summary names the ones it left out.
    validates_bad_input = False

    def __init__(self, num_gpu_blocks: int, enable_caching: bool = True) -> None:
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = enable_caching
        self.ref_cnt = [0] * num_gpu_blocks  # requests holding each block
        self.block_hash: list[BlockHash | None] = [None] * num_gpu_blocks  # set once full and registered
        self.free_queue = [BlockId(b) for b in range(1, num_gpu_blocks)]  # the eviction order: left end first
        self.cached: dict[BlockHash, list[BlockId]] = {}  # hash -> its blocks, first registered first

    def get_new_blocks(self, num_blocks: int) -> list[BlockId]:
        taken, self.free_queue = self.free_queue[:num_blocks], self.free_queue[num_blocks:]
        for b in taken:
            self._evict(b)  # taking a block is what evicts it: until now its old prefix could still hit
            self.ref_cnt[b] = 1
        return taken

    def _evict(self, b: BlockId) -> None:
        h = self.block_hash[b]
        if h is not None:
            self.cached[h].remove(b)
            if not self.cached[h]:
                del self.cached[h]
            self.block_hash[b] = None

    def touch(self, block_ids: Sequence[BlockId]) -> None:
        for b in block_ids:
            if self.ref_cnt[b] == 0 and not BUG:  # the bug: a held block stays evictable
                self.free_queue.remove(b)  # a hit on a free block takes it out of the eviction order
            self.ref_cnt[b] += 1

    def free_blocks(self, block_ids: Sequence[BlockId]) -> None:
        for b in block_ids:
            self.ref_cnt[b] -= 1
        freed = [b for b in block_ids if self.ref_cnt[b] == 0]
        # In the order given (a request's blocks tail first): a block without a hash can never
        # be hit, so it goes to the left end to be reused first; one with a hash goes to the
        # right end, kept for hits as long as possible.
        left = [b for b in freed if self.block_hash[b] is None]
        right = [b for b in freed if self.block_hash[b] is not None]
        self.free_queue = left + self.free_queue + right

    def cache_full_blocks(self, block_ids: Sequence[BlockId], block_hashes: Sequence[BlockHash]) -> None:
        for b, h in zip(block_ids, block_hashes):
            self.block_hash[b] = h
            self.cached.setdefault(h, []).append(b)  # a duplicate is kept, not merged

    def get_cached_block(self, block_hash: BlockHash) -> BlockId | None:
        blocks = self.cached.get(block_hash)
        return blocks[0] if blocks else None

    def reset_prefix_cache(self) -> bool:
        if len(self.free_queue) != self.num_gpu_blocks - 1:
            return False  # refused while any block is held
        self.block_hash = [None] * self.num_gpu_blocks
        self.cached = {}
        return True

    def snapshot(self) -> Snapshot:
        return Snapshot(
            num_gpu_blocks=self.num_gpu_blocks,
            enable_caching=self.enable_caching,
            ref_cnt=tuple(self.ref_cnt),
            block_hash=tuple(self.block_hash),
            free_queue=tuple(self.free_queue),
            hash_to_blocks=canonical_hash_to_blocks(tuple((h, tuple(bs)) for h, bs in self.cached.items())),
        )


def factory(config: AdapterConfig) -> ExamplePool:
    """The adapter the harness drives: here the pool itself, which already speaks vLLM's names."""
    return ExamplePool(config.num_gpu_blocks, config.enable_caching)


factory.levels = ("pool",)  # type: ignore[attr-defined]  # no request level: those rows are n/a
