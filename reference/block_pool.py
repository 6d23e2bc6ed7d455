"""The reference BlockPool: vLLM's data structures, O(1) work per block.

The same observable behaviour as `kvspec.spec.ops`, built the way vLLM builds
it: block objects, a linked free queue (reference.free_queue), and a dict from
hash to the blocks registered under it; under a keyed policy (seed 002) the
free blocks are kept by reference.keyed_free instead of the linked queue. Hot
paths carry no contracts; every
state invariant is checked by `check_invariants()`, which builds a `Snapshot`
and calls the spec's predicates (none is restated here).

With `enable_kv_cache_events`, the pool publishes what vLLM's does
(kvspec.spec.events): a `BlockRemoved` per key a block loses when evicted,
a `BlockStored` per registration, `AllBlocksCleared` per reset; `take_events`
drains them.

Every operation validates all its arguments before it changes anything (touch
takes each reference as it checks the id and gives them back if a later check
fails), so a caller's mistake raises the spec's error type and leaves the pool
as it was.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import islice
from typing import cast

from kvspec.reference.free_queue import FreeKVCacheBlockQueue, KVCacheBlock
from kvspec.reference.keyed_free import KeyedFreeBlocks
from kvspec.spec.errors import (
    AlreadyCached,
    DoubleFree,
    InvalidBlock,
    InvalidRequest,
    PoolExhausted,
    is_int,
)
from kvspec.spec.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from kvspec.spec.invariants import check_all
from kvspec.spec.ordering import profile_rule
from kvspec.spec.state import BlockHash, BlockId, Snapshot, canonical_hash_to_blocks

__all__ = ["BlockPool"]


class BlockPool:
    """A pool of `num_gpu_blocks` KV blocks with prefix caching."""

    def __init__(
        self,
        num_gpu_blocks: int,
        enable_caching: bool = True,
        profile: str = "vllm-v1",
        enable_kv_cache_events: bool = False,
    ) -> None:
        """Build the pool; block 0 becomes the null block; with `enable_kv_cache_events` it publishes events.

        Raises:
            InvalidRequest: num_gpu_blocks is not an integer >= 1, or the profile is unknown.

        Cost: O(num_gpu_blocks).
        """
        if not is_int(num_gpu_blocks) or num_gpu_blocks < 1:
            raise InvalidRequest(
                "num_gpu_blocks must be an integer >= 1 (block 0 is the null block); "
                f"got num_gpu_blocks={num_gpu_blocks!r}"
            )
        try:
            rule = profile_rule(profile)
        except ValueError as e:
            raise InvalidRequest(str(e)) from None
        self.num_gpu_blocks = num_gpu_blocks  # fixed
        self.enable_caching = bool(enable_caching)  # fixed
        self.profile = profile  # fixed: the ordering rule it claims
        self._unhashed_to_left = rule.unhashed_to_left  # fixed, read on every free
        self.blocks = [KVCacheBlock(i) for i in range(num_gpu_blocks)]  # indexed by block_id
        # The eviction order: the queue itself (vLLM v1), or the keyed policy's first fit and heap.
        self._keyed: KeyedFreeBlocks | None = KeyedFreeBlocks(self.blocks, rule) if rule.keyed else None
        self.free_block_queue: FreeKVCacheBlockQueue | KeyedFreeBlocks = self._keyed or FreeKVCacheBlockQueue(
            self.blocks
        )
        # hash -> {block_id: block}; a dict keeps registration order, and the
        # first entry is what a hit returns. Duplicates are kept (see cache_full_blocks).
        self.cached_block_hash_to_block: dict[BlockHash, dict[int, KVCacheBlock]] = {}
        # Cached blocks get_new_blocks has reallocated (their hash dropped), for `kvspec simulate`;
        # not part of the state the spec compares.
        self.num_evictions = 0
        # Events published and not yet taken; None when events are off (nothing is kept).
        self.kv_event_queue: list[KVCacheEvent] | None = [] if enable_kv_cache_events else None
        # NOTE: the null block is a placeholder for slots that need no memory;
        # its ref_cnt is never maintained, so it leaves the queue for good here.
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True

    # --- argument checks ------------------------------------------------------------------

    def _blocks_of(self, block_ids: Sequence[BlockId], op: str) -> list[KVCacheBlock]:
        """The blocks named, after checking every id (in range, not null, named once).

        This runs on every touch and free, so the common case is one type test
        and one range test per id; the error wording is built only on failure.
        """
        n = self.num_gpu_blocks
        all_blocks = self.blocks
        blocks = []
        for b in block_ids:
            if type(b) is not int or not 0 < b < n:
                self._check_block_id_slowly(b, op)
            blocks.append(all_blocks[b])
        if len(blocks) > 1 and len(set(block_ids)) != len(blocks):
            raise InvalidRequest(f"{op}: block_ids={list(block_ids)} names a block twice")
        return blocks

    def _check_block_id_slowly(self, b: object, op: str) -> None:
        """The full check for ids the fast path did not accept (an int subclass is still an id)."""
        if is_int(b) and 0 < b < self.num_gpu_blocks:
            return
        if is_int(b) and b == 0:
            raise InvalidBlock(f"{op}: block_id=0 is the null block, whose ref_cnt is never maintained")
        raise InvalidBlock(f"{op}: block_id={b!r} is not a block of this pool (ids 0..{self.num_gpu_blocks - 1})")

    # --- operations -----------------------------------------------------------------------

    def get_num_free_blocks(self) -> int:
        """How many blocks are free. Cost: O(1)."""
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """The fraction of allocatable blocks held by requests. Cost: O(1)."""
        num_allocatable = self.num_gpu_blocks - 1
        if num_allocatable == 0:
            return 0.0
        return 1.0 - self.free_block_queue.num_free_blocks / num_allocatable

    def get_new_blocks(self, num_blocks: int) -> list[BlockId]:
        """Take blocks from the left end of the free queue, evicting their cached hashes.

        Raises:
            InvalidRequest: num_blocks is not a non-negative integer.
            PoolExhausted: fewer than num_blocks are free.

        Cost: O(num_blocks).
        """
        if not is_int(num_blocks) or num_blocks < 0:
            raise InvalidRequest(
                f"get_new_blocks: num_blocks must be a non-negative integer; got num_blocks={num_blocks!r}"
            )
        num_free = self.free_block_queue.num_free_blocks
        if num_blocks > num_free:
            raise PoolExhausted(
                f"cannot allocate num_blocks={num_blocks}: {num_free} free of "
                f"num_gpu_blocks={self.num_gpu_blocks}, one is the null block"
            )
        taken = self.free_block_queue.popleft_n(num_blocks)
        for block in taken:
            if block.block_hash is not None:
                self._evict(block)
                self.num_evictions += 1
            block.ref_cnt = 1
        if self._keyed is not None:
            self._keyed.allocated(taken)
        return [BlockId(block.block_id) for block in taken]

    def _evict(self, block: KVCacheBlock) -> None:
        """Drop `block` from the hash table and clear its hash. Cost: O(1)."""
        assert block.block_hash is not None, f"evicting block {block.block_id} without a hash"
        entry = self.cached_block_hash_to_block[block.block_hash]
        del entry[block.block_id]
        if not entry:
            del self.cached_block_hash_to_block[block.block_hash]
        if self.kv_event_queue is not None:
            self.kv_event_queue.append(BlockRemoved((block.block_hash,)))
        block.block_hash = None

    def touch(self, block_ids: Sequence[BlockId]) -> None:
        """Take a hit: each block leaves the free queue if there, and gains a reference.

        Raises:
            InvalidBlock: an id is out of range, the null block, or has no hash.
            InvalidRequest: an id is named twice.

        Cost: O(len(block_ids)).
        """
        # Every prefix hit lands here, a few blocks at a time, so the common case
        # is one loop that tests an id and takes its reference at once. The free
        # queue is left alone until every id has passed; anything the loop does
        # not accept goes to `_touch_slowly`, which gives those references back first.
        n, all_blocks = self.num_gpu_blocks, self.blocks
        was_free: list[KVCacheBlock] = []
        for b in block_ids:
            if type(b) is not int or not 0 < b < n or (block := all_blocks[b]).block_hash is None:
                return self._touch_slowly(block_ids)
            if block.ref_cnt == 0:
                was_free.append(block)
            block.ref_cnt += 1
        if len(block_ids) > 1 and len(set(block_ids)) != len(block_ids):
            return self._touch_slowly(block_ids)
        if was_free:  # cached blocks nobody held: they leave the free queue
            remove = self.free_block_queue.remove
            for block in was_free:
                remove(block)
        if self._keyed is not None:
            self._keyed.hit(block_ids)

    def _touch_slowly(self, block_ids: Sequence[BlockId]) -> None:
        """`touch` for a call its loop did not accept: usually a mistake, else an int subclass as an id.

        Gives back the references the loop took, raises the spec's error in the
        spec's order (ids, then duplicates, then hashes), and touches only a
        call with no mistake.
        """
        n, all_blocks = self.num_gpu_blocks, self.blocks
        for b in block_ids:  # touch's own test, so this stops where its loop stopped
            if type(b) is not int or not 0 < b < n or all_blocks[b].block_hash is None:
                break
            all_blocks[b].ref_cnt -= 1
        for block in self._blocks_of(block_ids, "touch"):
            if block.block_hash is None:
                raise InvalidBlock(
                    f"touch: block_id={block.block_id} has no hash (ref_cnt={block.ref_cnt}), "
                    "so no request can have hit it; stale block table?"
                )
        self.touch([BlockId(int(b)) for b in block_ids])  # checked: plain ints pass the first loop

    def free_blocks(self, ordered_block_ids: Sequence[BlockId], evict_first: bool = False) -> None:
        """Drop one reference per block, in eviction-priority order (a request's blocks tail first).

        Blocks reaching ref_cnt 0 join the queue: under `vllm-v1`, those without
        a hash at the left end in the given order (nobody can hit them, reuse
        them first), the hashed ones at the right end (LRU); under a keyed
        policy, where their keys put them, every block named stamped in order.
        With `evict_first` (vLLM 0.34.0 on) every block freed goes before every
        other cached block: to the left end with the hashless ones, or into the
        first tier of a keyed policy's key.

        Raises:
            InvalidBlock: an id is out of range or the null block.
            InvalidRequest: an id is named twice, or evict_first is not a bool.
            DoubleFree: a block has ref_cnt 0.

        Cost: O(len(ordered_block_ids)); O(log n) more per block under a keyed policy.
        """
        if evict_first is not True and evict_first is not False:
            raise InvalidRequest(f"free_blocks: evict_first={evict_first!r} is not a bool")
        # Every finished request lands here, so the common case is one pass that
        # checks an id and drops its reference at once; the queue is left alone
        # until every id has passed. Anything the pass does not accept goes to
        # `_free_slowly`, which hands back the references it dropped first.
        n, all_blocks = self.num_gpu_blocks, self.blocks
        unhashed_to_left = self._unhashed_to_left
        left: list[KVCacheBlock] = []  # newly free, reused first
        right: list[KVCacheBlock] = []  # newly free, kept longest (LRU)
        dropped = 0
        for b in ordered_block_ids:
            if type(b) is not int or not 0 < b < n or (block := all_blocks[b]).ref_cnt == 0:
                return self._free_slowly(ordered_block_ids, dropped, evict_first)
            block.ref_cnt -= 1
            dropped += 1
            if block.ref_cnt == 0:
                if evict_first or (unhashed_to_left and block.block_hash is None):
                    left.append(block)
                else:
                    right.append(block)
        if dropped > 1 and len(set(ordered_block_ids)) != dropped:
            return self._free_slowly(ordered_block_ids, dropped, evict_first)
        if self._keyed is not None:
            self._keyed.freed(ordered_block_ids, left + right, evict_first)
            return None
        queue = cast(FreeKVCacheBlockQueue, self.free_block_queue)  # a queue policy's
        queue.prepend_n(left)
        queue.append_n(right)
        return None

    def _free_slowly(self, ordered_block_ids: Sequence[BlockId], dropped: int, evict_first: bool) -> None:
        """`free_blocks` for a call its pass did not accept: usually a mistake, else an int subclass as an id.

        Hands back the references the pass dropped (one per id, for the first
        `dropped` ids), raises the spec's error in the spec's order (ids, then
        duplicates, then double free), and frees only a call with no mistake.
        """
        for b in islice(ordered_block_ids, dropped):
            self.blocks[b].ref_cnt += 1
        for block in self._blocks_of(ordered_block_ids, "free_blocks"):
            if block.ref_cnt == 0:
                raise DoubleFree(
                    f"free_blocks: block_id={block.block_id} has ref_cnt=0, no request holds it (double free?)"
                )
        plain = [BlockId(int(b)) for b in ordered_block_ids]  # checked: plain ints pass the first pass
        self.free_blocks(plain, evict_first)

    def cache_full_blocks(
        self, block_ids: Sequence[BlockId], block_hashes: Sequence[BlockHash], stored: BlockStored | None = None
    ) -> None:
        """Register full, held blocks under their hashes.

        NOTE: a hash already registered gets this block added after the others
        rather than replacing the request's block with the existing one: block
        tables are append-only, so identical full blocks are not merged.

        With events on, publishes `stored` (the request level knows the parent,
        tokens and keys, as vLLM's pool reads them off the request), or else a
        `BlockStored` of the keys alone when any block is registered.

        Raises:
            InvalidRequest: caching is off, lengths differ, an id is named twice, a hash is not bytes.
            InvalidBlock: an id is out of range, the null block, or not held.
            AlreadyCached: a block already has a hash.

        Cost: O(len(block_ids)).
        """
        if not self.enable_caching:
            raise InvalidRequest("cache_full_blocks: prefix caching is off (enable_caching=False), nothing is hashed")
        if len(block_ids) != len(block_hashes):
            raise InvalidRequest(
                f"cache_full_blocks: {len(block_ids)} block_ids but {len(block_hashes)} block_hashes; "
                "one hash per block"
            )
        blocks = self._blocks_of(block_ids, "cache_full_blocks")
        for block, h in zip(blocks, block_hashes):
            if not isinstance(h, bytes):
                raise InvalidRequest(f"cache_full_blocks: block_hash={h!r} for block_id={block.block_id} is not bytes")
            if block.ref_cnt == 0:
                raise InvalidBlock(
                    f"cache_full_blocks: block_id={block.block_id} has ref_cnt=0; only a held, computed block is cached"
                )
            if block.block_hash is not None:
                raise AlreadyCached(
                    f"cache_full_blocks: block_id={block.block_id} is already registered; a block is cached once"
                )
        for block, h in zip(blocks, block_hashes):
            block.block_hash = h
            self.cached_block_hash_to_block.setdefault(h, {})[block.block_id] = block
        if self._keyed is not None:
            self._keyed.registered(blocks)
        if self.kv_event_queue is not None and (stored is not None or blocks):
            self.kv_event_queue.append(stored or BlockStored(block_hashes=tuple(block_hashes), parent_block_hash=None))

    def get_cached_block(self, block_hash: BlockHash) -> BlockId | None:
        """The first block registered under `block_hash`, or None. Cost: O(1).

        Raises:
            InvalidRequest: block_hash is not bytes.
        """
        if not isinstance(block_hash, bytes):
            raise InvalidRequest(f"get_cached_block: block_hash={block_hash!r} is not bytes")
        entry = self.cached_block_hash_to_block.get(block_hash)
        if not entry:
            return None
        return BlockId(next(iter(entry)))

    def evict_blocks(self, block_ids: Sequence[BlockId]) -> None:
        """Drop the cached hash of each block; holders keep their blocks.

        Raises:
            InvalidBlock: an id is out of range or the null block.
            InvalidRequest: an id is named twice.

        Cost: O(len(block_ids)).
        """
        for block in self._blocks_of(block_ids, "evict_blocks"):
            if block.block_hash is not None:
                self._evict(block)
                if self._keyed is not None and block.ref_cnt == 0:
                    self._keyed.lost_hash(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash, if no block is held; refuse (False) otherwise.

        Cost: O(num_gpu_blocks).
        """
        if self.free_block_queue.num_free_blocks != self.num_gpu_blocks - 1:
            return False
        self.cached_block_hash_to_block = {}
        for block in self.blocks:
            block.block_hash = None
        if self._keyed is not None:
            self._keyed.rebuild()
        if self.kv_event_queue is not None:
            self.kv_event_queue.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVCacheEvent]:
        """The events published since the last call, and none kept (none at all with events off). Cost: O(events)."""
        if not self.kv_event_queue:
            return []
        events, self.kv_event_queue = self.kv_event_queue, []
        return events

    def is_block_writable(self, block_id: BlockId) -> bool:
        """Whether a request may write into `block_id`: not null, held once, not hashed.

        Raises:
            InvalidBlock: block_id is not a block of this pool.

        Cost: O(1).
        """
        if not is_int(block_id) or not 0 <= block_id < self.num_gpu_blocks:
            raise InvalidBlock(
                f"is_block_writable: block_id={block_id!r} is not a block of this pool "
                f"(ids 0..{self.num_gpu_blocks - 1})"
            )
        block = self.blocks[block_id]
        return not block.is_null and block.ref_cnt == 1 and block.block_hash is None

    # --- observation ----------------------------------------------------------------------

    def snapshot(
        self, block_tables: tuple[tuple[str, tuple[BlockId, ...]], ...] | None = None, kv_groups: tuple[str, ...] = ()
    ) -> Snapshot:
        """The state in the spec's normal form (with the request level's tables and groups). Cost: O(num_gpu_blocks)."""
        table = tuple((h, tuple(BlockId(b) for b in entry)) for h, entry in self.cached_block_hash_to_block.items())
        return Snapshot(
            num_gpu_blocks=self.num_gpu_blocks,
            enable_caching=self.enable_caching,
            ref_cnt=tuple(block.ref_cnt for block in self.blocks),
            block_hash=tuple(block.block_hash for block in self.blocks),
            free_queue=tuple(BlockId(block.block_id) for block in self.free_block_queue),
            hash_to_blocks=canonical_hash_to_blocks(table),
            block_tables=block_tables,
            kv_groups=kv_groups,
        )

    def check_invariants(self) -> None:
        """Check every state invariant, plus the queue's own count, via the spec's predicates.

        Raises:
            InvariantViolation: naming the first invariant that fails.
        """
        snap = self.snapshot()
        check_all(snap)
        assert self.free_block_queue.num_free_blocks == len(snap.free_queue), (
            f"free queue count {self.free_block_queue.num_free_blocks} != {len(snap.free_queue)} linked blocks"
        )
