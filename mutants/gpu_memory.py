"""Mutants of gpu_impl's KV memory: bookkeeping right, memory wrong.

Each manager below keeps the same block tables, ref counts, hash table and
free queue as gpu_impl (every snapshot equals the spec's), and makes one
mistake in where a step's KV lands in device memory, the kind a paged
attention kernel or its block-table upload gets wrong. Only a check of the
memory itself can catch them: reading a prefix hit back (hit_content_intact),
or gpu_impl's own checksums, which quarantine the overwritten block and so
shorten a hit the spec says is whole.

The writes go straight to the KV tensor, past the writability check, as a
kernel's stores do. The mutants run on the CPU unless a device is asked for:
their bugs are in the placement logic, not the device, and the harness runs
each campaign in a forked child, where CUDA cannot start again once the test
process has used it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from kvspec.conformance.core.adapter import AdapterConfig
from kvspec.conformance.tools.mutants import Mutant
from kvspec.gpu_impl.adapter import TensorManagerAdapter
from kvspec.spec.manager import Request
from kvspec.spec.state import BlockId

__all__ = ["MUTANTS"]


class WriteWrongSlot(TensorManagerAdapter):
    """A token's KV is stored one slot further along its block (`(p + 1) % block_size`).

    Every block holds its own tokens' values, rotated: the block is sealed
    with the rotated content, so only reading a hit back shows that token i
    of the prefix gets the KV of token i - 1.
    """

    def _write_step(self, request_id: str, block_table: torch.Tensor, start: int, values: torch.Tensor) -> None:
        if not values.numel():
            return
        blocks, offsets = self.kv_cache.slots(block_table, start, start + values.numel())
        self.kv_cache.kv[blocks, (offsets + 1) % self.block_size] = values  # MUTANT: `offsets`


class WriteSharedBlock(TensorManagerAdapter):
    """The block-table index of a token is `cdiv(p, block_size) - 1` instead of `p // block_size`.

    The two agree except on a block's first slot, which lands in the
    previous block's first slot: right after a prefix hit, that is the last
    hit block, a registered block shared with every request that can hit it.
    """

    def _write_step(self, request_id: str, block_table: torch.Tensor, start: int, values: torch.Tensor) -> None:
        if not values.numel():
            return
        positions = torch.arange(start, start + values.numel(), device=block_table.device)
        index = -(-positions // self.block_size) - 1  # MUTANT: `positions // self.block_size`
        self.kv_cache.kv[block_table[index], positions % self.block_size] = values


class ReuseWithoutEviction(TensorManagerAdapter):
    """A freed block's page goes back to the page allocator while the block is still cached.

    The next block a step takes is given that page: its KV overwrites the
    cached block's, whose hash still names it, so a later hit on the cached
    block reads another prefix's KV (and the new block's own page is never
    written).
    """

    def __init__(self, config: AdapterConfig) -> None:
        super().__init__(config)
        self._recycled_pages: list[int] = []  # pages of blocks freed with a hash, reused first
        self._page_of: dict[int, int] = {}  # block -> the page its writes go to, while held
        self._num_old_blocks = 0  # blocks the request held (or hit) before this step

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Sequence[BlockId] = (),
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
    ) -> list[BlockId] | None:
        self._num_old_blocks = len(self.req_to_blocks.get(request.request_id, [])) + len(new_computed_blocks)
        return super().allocate_slots(
            request, num_new_tokens, num_new_computed_tokens, new_computed_blocks, num_external_computed_tokens,
            delay_cache_blocks,
        )  # fmt: skip

    def _write_step(self, request_id: str, block_table: torch.Tensor, start: int, values: torch.Tensor) -> None:
        for b in block_table[self._num_old_blocks :].tolist():
            if self._recycled_pages:
                self._page_of[b] = self._recycled_pages.pop()  # MUTANT: the page still backs a cached block
        pages = torch.tensor([self._page_of.get(b, b) for b in block_table.tolist()], device=block_table.device)
        if values.numel():
            blocks, offsets = self.kv_cache.slots(pages, start, start + values.numel())
            self.kv_cache.kv[blocks, offsets] = values

    def free(self, request_id: str) -> None:
        table = list(self.req_to_blocks.get(request_id, []))
        super().free(request_id)
        for b in table:
            page = self._page_of.pop(b, b)
            if int(self.block_pool.ref_cnt[b]) == 0 and bool(self.block_pool.has_hash[b]):
                self._recycled_pages.append(page)


def _on_cpu(config: AdapterConfig) -> AdapterConfig:
    """The config with the CPU as its device unless it names one."""
    return replace(config, device=config.device or "cpu")


# Factories at module level, so a trace names each as `module:function` and `kvspec replay --impl` loads it.
def write_wrong_slot(config: AdapterConfig) -> TensorManagerAdapter:
    """gpu_impl with `WriteWrongSlot`'s store, on the CPU unless a device is asked for."""
    return WriteWrongSlot(_on_cpu(config))


def write_shared_block(config: AdapterConfig) -> TensorManagerAdapter:
    """gpu_impl with `WriteSharedBlock`'s store, on the CPU unless a device is asked for."""
    return WriteSharedBlock(_on_cpu(config))


def reuse_without_eviction(config: AdapterConfig) -> TensorManagerAdapter:
    """gpu_impl with `ReuseWithoutEviction`'s pages, on the CPU unless a device is asked for."""
    return ReuseWithoutEviction(_on_cpu(config))


MUTANTS: list[Mutant] = [
    Mutant(
        name="gpu_write_wrong_slot",
        description="gpu_impl stores each token's KV one slot further along its block",
        level="manager",
        factory=write_wrong_slot,
        kind="a write into the wrong slot",
    ),
    Mutant(
        name="gpu_write_shared_block",
        description="gpu_impl indexes the block table with cdiv(p, block_size) - 1, writing a block's first token "
        "into the previous (possibly shared, cached) block",
        level="manager",
        factory=write_shared_block,
        kind="a write into a shared block",
    ),
    Mutant(
        name="gpu_reuse_without_eviction",
        description=(
            "gpu_impl recycles a freed block's page while the block is still cached, so a hit reads overwritten KV"
        ),
        level="manager",
        factory=reuse_without_eviction,
        kind="a block reused without eviction",
    ),
]
