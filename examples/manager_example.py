"""A KVCacheManager written the simplest way, over the example pool, and its adapter.

Request block tables over `pool_example.ExamplePool`, with vLLM v1's rules:
the longest cached prefix of a new request, capped so its last token is
computed; slots for a step all or nothing (the hit blocks touched, then new
blocks taken, then every block the step fills registered); a request freed
tail first. Block hashes come from kvspec's own chain (kvspec.spec.hashing),
so the harness compares them exactly. Check both levels with

    kvspec check --impl examples/manager_example.py:factory

Its one documented bug: with KVSPEC_EXAMPLE_BUG=manager in the environment,
`get_computed_blocks` may hit a whole prompt, leaving no token to compute.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

from pool_example import ExamplePool

from kvspec.conformance import AdapterConfig
from kvspec.spec.hashing import hash_request_blocks
from kvspec.spec.manager import Request
from kvspec.spec.state import BlockHash, BlockId, Snapshot

BUG = os.environ.get("KVSPEC_EXAMPLE_BUG") == "manager"


class ExampleManager:
    """Running requests' block tables over one pool."""

    validates_bad_input = False  # trusts its caller, as vLLM's manager does
    uses_kvspec_hash_chain = True  # hashes with kvspec's chain: hash values are compared exactly
    # What it does not have, with why: the harness sends no such request and the summary lists it.
    not_applicable = {"prefix cache hit limit": "its requests carry no hit limit (vLLM 0.34's); it reads every hit"}

    def __init__(self, config: AdapterConfig) -> None:
        self.pool = ExamplePool(config.num_gpu_blocks, config.enable_caching)
        self.config = config
        self.block_tables: dict[str, list[BlockId]] = {}  # request id -> its blocks, append-only
        self.num_cached: dict[str, int] = {}  # request id -> how many leading blocks are registered
        self.num_computed: dict[str, int] = {}  # request id -> tokens computed (or scheduled)

    def _hashes(self, request: Request) -> tuple[BlockHash, ...]:
        c = self.config
        return hash_request_blocks(
            request.token_ids, c.block_size, request.lora_name, request.mm_inputs, request.cache_salt, c.hash_fn, c.seed
        )

    def get_computed_blocks(self, request: Request) -> tuple[list[BlockId], int]:
        if not self.pool.enable_caching:
            return [], 0
        num_tokens = len(request.token_ids)
        max_hit_blocks = num_tokens // self.config.block_size if BUG else (num_tokens - 1) // self.config.block_size
        hits: list[BlockId] = []
        for h in self._hashes(request)[:max_hit_blocks]:
            b = self.pool.get_cached_block(h)
            if b is None:
                break
            hits.append(b)
        return hits, len(hits) * self.config.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Sequence[BlockId] = (),
        num_external_computed_tokens: int = 0,
    ) -> list[BlockId] | None:
        rid, block_size = request.request_id, self.config.block_size
        table = self.block_tables.get(rid, [])
        num_tokens = self.num_computed.get(rid, 0) + num_new_computed_tokens + num_external_computed_tokens
        num_tokens += num_new_tokens
        num_new = max(-(-num_tokens // block_size) - len(table) - len(new_computed_blocks), 0)
        # All or nothing: a hit on a free block takes a free block too.
        num_free_hits = sum(1 for b in new_computed_blocks if self.pool.ref_cnt[b] == 0)
        if num_new + num_free_hits > len(self.pool.free_queue):
            return None
        self.pool.touch(new_computed_blocks)  # before taking new blocks, so taking them cannot evict a hit
        new_blocks = self.pool.get_new_blocks(num_new)
        table = self.block_tables[rid] = table + list(new_computed_blocks) + new_blocks
        num_cached = self.num_cached.get(rid, 0) + len(new_computed_blocks)
        num_full = num_tokens // block_size
        if self.pool.enable_caching and num_full > num_cached:  # register the blocks this step fills
            self.pool.cache_full_blocks(table[num_cached:num_full], self._hashes(request)[num_cached:num_full])
            num_cached = num_full
        self.num_cached[rid], self.num_computed[rid] = num_cached, num_tokens
        return new_blocks

    def free(self, request_id: str) -> None:
        # Tail first: a request's last blocks are the least likely to be shared, so they are evicted first.
        self.pool.free_blocks(self.block_tables.pop(request_id)[::-1])
        del self.num_cached[request_id], self.num_computed[request_id]

    def snapshot(self) -> Snapshot:
        tables = tuple(sorted((rid, tuple(blocks)) for rid, blocks in self.block_tables.items()))
        return dataclasses.replace(self.pool.snapshot(), block_tables=tables)


def factory(config: AdapterConfig) -> ExamplePool | ExampleManager:
    """The adapter for the level the harness asks for: the example pool, or the manager over it."""
    if config.level == "pool":
        return ExamplePool(config.num_gpu_blocks, config.enable_caching)
    return ExampleManager(config)
