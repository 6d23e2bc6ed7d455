"""Unmutated bases for mutants whose bug the reference offers no seam for.

Most mutants override one reference method. Two bugs need more room:

- a duplicate free-queue entry cannot be represented by the reference's
  linked list (a block has one pair of links), so `ListQueuePool` keeps the
  free queue in a plain Python list, the structure a first implementation
  would use (the same order, with O(n) removal);
- three request-level bugs live inside `allocate_slots`, so
  `StepwiseManager` restates it with the lines those bugs change split into
  small methods.

Neither base is a mutant: tests/mutants/test_mutants.py checks that each
conforms, so a kill of a mutant built on them is due to its one change.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from kvspec.conformance.adapter import AdapterConfig
from kvspec.conformance.builtin import ReferenceManagerAdapter, ReferencePoolAdapter
from kvspec.reference.free_queue import KVCacheBlock
from kvspec.reference.kv_cache_manager import _check_request
from kvspec.spec.errors import InvalidBlock, InvalidRequest
from kvspec.spec.manager import Request
from kvspec.spec.state import BlockId

__all__ = ["ListFreeKVCacheBlockQueue", "ListQueuePool", "StepwiseManager", "is_count"]


def is_count(value: object) -> bool:
    """Whether `value` is a valid block count (a non-negative int, not a bool), as the reference checks it."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


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


class StepwiseManager(ReferenceManagerAdapter):
    """The reference manager, with `allocate_slots` restated in named steps.

    Identical behaviour; only the lines that request-level bugs touch are
    methods of their own (`_num_evictable_hits`, `_num_cached_blocks`,
    `_num_full_blocks`), so a mutant overrides one of them.
    """

    def _num_evictable_hits(self, new_computed_blocks: Sequence[BlockId]) -> int:
        # Hit blocks in the free queue leave it when touched: they use up free blocks too.
        return sum(1 for b in new_computed_blocks if self.block_pool.blocks[b].ref_cnt == 0)

    def _num_cached_blocks(self, request_id: str, new_computed_blocks: Sequence[BlockId]) -> int:
        # The hit blocks are registered already (that is why they hit).
        return self.num_cached_block.get(request_id, 0) + len(new_computed_blocks)

    def _num_full_blocks(self, request: Request, num_computed_tokens: int) -> int:
        # Only a full block is registered: a partial one could still change.
        return min(num_computed_tokens, len(request.token_ids)) // self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Sequence[BlockId] = (),
        num_external_computed_tokens: int = 0,
    ) -> list[BlockId] | None:
        """The reference's `allocate_slots`, line for line, with three lines made methods."""
        _check_request(request, "allocate_slots")
        for name, value in (
            ("num_new_tokens", num_new_tokens),
            ("num_new_computed_tokens", num_new_computed_tokens),
            ("num_external_computed_tokens", num_external_computed_tokens),
        ):
            if not is_count(value):
                raise InvalidRequest(f"allocate_slots: {name} must be a non-negative integer; got {name}={value!r}")
        if num_new_tokens == 0:
            raise InvalidRequest("allocate_slots: num_new_tokens=0; a step must schedule at least one token")
        rid = request.request_id
        running = rid in self.req_to_blocks
        if running and (new_computed_blocks or num_new_computed_tokens or num_external_computed_tokens):
            raise InvalidRequest(
                f"allocate_slots: request_id={rid!r} is running; prefix hits are only for its first step"
            )
        if len(new_computed_blocks) * self.block_size != num_new_computed_tokens:
            raise InvalidRequest(
                f"allocate_slots: num_new_computed_tokens={num_new_computed_tokens} but "
                f"{len(new_computed_blocks)} hit blocks of block_size={self.block_size}"
            )
        if new_computed_blocks and not self.enable_caching:
            raise InvalidRequest("allocate_slots: prefix caching is off, so there can be no hit blocks")
        pool = self.block_pool
        hashes = self._block_hashes(request)
        if len(new_computed_blocks) > len(hashes):
            raise InvalidRequest(
                f"allocate_slots: {len(new_computed_blocks)} hit blocks but request_id={rid!r} "
                f"has only {len(hashes)} full blocks"
            )
        for i, b in enumerate(new_computed_blocks):
            in_range = isinstance(b, int) and not isinstance(b, bool) and 0 <= b < pool.num_gpu_blocks
            if not in_range or pool.blocks[b].block_hash != hashes[i]:
                raise InvalidBlock(f"allocate_slots: hit block_id={b!r} is not registered under the request's hash {i}")
        table = self.req_to_blocks.get(rid, [])
        num_computed = self.num_computed_tokens.get(rid, 0)
        total = num_computed + num_new_computed_tokens + num_external_computed_tokens + num_new_tokens
        if total > len(request.token_ids):
            raise InvalidRequest(
                f"allocate_slots: {total} tokens would be computed but request_id={rid!r} has {len(request.token_ids)}"
            )
        num_required = -(-total // self.block_size)
        num_to_allocate = max(num_required - len(table) - len(new_computed_blocks), 0)
        if num_to_allocate + self._num_evictable_hits(new_computed_blocks) > pool.get_num_free_blocks():
            return None
        if new_computed_blocks:
            pool.touch(new_computed_blocks)
        new_blocks = pool.get_new_blocks(num_to_allocate)
        table = table + list(new_computed_blocks) + new_blocks
        self.req_to_blocks[rid] = table
        num_cached = self._num_cached_blocks(rid, new_computed_blocks)
        if self.enable_caching:
            num_full = self._num_full_blocks(request, total)
            if num_full > num_cached:
                pool.cache_full_blocks(table[num_cached:num_full], hashes[num_cached:num_full])
                num_cached = num_full
        self.num_cached_block[rid] = num_cached
        self.num_computed_tokens[rid] = total
        return new_blocks
