"""One explicit scenario per mutant: the spec and the reference pass it, the mutant does not.

Each scenario is a few steps with the block ids written out, in the style
of vLLM's own block-pool tests (the expected free-queue order checks the
eviction order). They do not depend on the harness: they prove by hand that
every mutant is really wrong, so when the harness kills one it has found a
bug, not a difference that does not matter.

`Steps` drives one adapter. Every step checks the return value written in
the scenario and every state invariant; a refused step must raise the
spec's error type and leave the snapshot as it was. Anything else raises
`Deviation`, which is what a mutant must do somewhere in its scenario.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from kvspec.conformance.core.adapter import AdapterConfig
from kvspec.conformance.targets.builtin import ReferenceManagerAdapter, make_reference, make_spec
from kvspec.mutants import Mutant, all_mutants
from kvspec.mutants._base import ListQueuePool
from kvspec.spec.errors import AlreadyCached, BlockManagerError, DoubleFree, InvalidBlock, InvalidRequest, PoolExhausted
from kvspec.spec.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvspec.spec.hashing import MultiModalInput, hash_request_blocks
from kvspec.spec.invariants import failing
from kvspec.spec.manager import Request
from kvspec.spec.state import BlockHash, BlockId
from kvspec.spec.stats import CacheCounters, PrefixCacheStats

H1, H2, H3 = BlockHash(b"h1"), BlockHash(b"h2"), BlockHash(b"h3")
_ANY: Any = object()


class Deviation(AssertionError):
    """The adapter departed from a scenario step."""


class Steps:
    """One adapter, driven step by step; a departure from the scenario raises `Deviation`."""

    def __init__(
        self,
        factory: Callable[[AdapterConfig], Any],
        level: str = "pool",
        *,
        num_gpu_blocks: int = 6,
        enable_caching: bool = True,
        block_size: int = 4,
        profile: str = "vllm-v1",
        groups: str = "full",
        events: bool = False,
    ) -> None:
        config = AdapterConfig(
            level, num_gpu_blocks, enable_caching, profile, block_size=block_size, groups=groups, events=events
        )
        self.adapter = factory(config)
        self.num_steps = 0
        self._check_invariants("construction")

    def _check_invariants(self, where: str) -> None:
        broken = failing(self.adapter.snapshot())
        if broken:
            raise Deviation(f"after {where}: invariants broken: {', '.join(broken)}")

    def do(self, op: str, *args: Any, expect: Any = _ANY, publishes: Any = _ANY) -> Any:
        """Run one operation that must succeed (and return `expect`, and publish the events `publishes`, if given)."""
        self.num_steps += 1
        where = f"step {self.num_steps} {op}{args!r}"
        try:
            result = getattr(self.adapter, op)(*args)
        except Exception as e:  # noqa: BLE001 - any exception is a departure here
            raise Deviation(f"{where} raised {type(e).__name__}: {e}") from e
        if expect is not _ANY and result != expect:
            raise Deviation(f"{where} returned {result!r}, expected {expect!r}")
        if publishes is not _ANY:
            events = list(self.adapter.take_events())
            if events != list(publishes):
                raise Deviation(f"{where} published {events!r}, expected {list(publishes)!r}")
        self._check_invariants(where)
        return result

    def counted(self, stats: PrefixCacheStats) -> None:
        """Check the hit statistics since the manager was built."""
        got = self.adapter.prefix_cache_stats()
        if got != stats:
            raise Deviation(f"statistics after step {self.num_steps}: {got}, expected {stats}")

    def refused(self, error: type[BlockManagerError], op: str, *args: Any) -> None:
        """Run one operation that must raise `error` and change nothing."""
        self.num_steps += 1
        where = f"step {self.num_steps} {op}{args!r}"
        before = self.adapter.snapshot()
        try:
            getattr(self.adapter, op)(*args)
        except error:
            pass
        except Exception as e:  # noqa: BLE001 - the wrong error type is a departure
            raise Deviation(f"{where} raised {type(e).__name__}: {e}; expected {error.__name__}") from e
        else:
            raise Deviation(f"{where} was accepted; expected {error.__name__}")
        after = self.adapter.snapshot()
        if after != before:
            raise Deviation(f"{where} was refused but changed the state:\nbefore: {before}\nafter:  {after}")
        self._check_invariants(where)

    def state(
        self,
        *,
        free_queue: Sequence[int] | None = None,
        ref_cnt: dict[int, int] | None = None,
        hash_groups: Sequence[Sequence[int]] | None = None,
        block_hashes: dict[int, bytes] | None = None,
        tables: dict[str, Sequence[int]] | None = None,
    ) -> None:
        """Check the parts of the snapshot given.

        Args:
            free_queue: the whole queue, left end first.
            ref_cnt: block id -> ref_cnt, for the blocks named.
            hash_groups: the hashed blocks, grouped by equal hash (each group in block-id order).
            block_hashes: block id -> its exact hash, for the blocks named.
            tables: request id -> block table, for every running request.
        """
        s = self.adapter.snapshot()
        where = f"state after step {self.num_steps}"
        if free_queue is not None and s.free_queue != tuple(free_queue):
            raise Deviation(f"{where}: free_queue={list(s.free_queue)}, expected {list(free_queue)}")
        if ref_cnt is not None:
            got = {b: s.ref_cnt[b] for b in ref_cnt}
            if got != ref_cnt:
                raise Deviation(f"{where}: ref_cnt={got}, expected {ref_cnt}")
        if hash_groups is not None:
            groups: dict[bytes, list[int]] = {}
            for b, h in enumerate(s.block_hash):
                if h is not None:
                    groups.setdefault(h, []).append(b)
            got_groups = sorted(groups.values())
            if got_groups != sorted(list(g) for g in hash_groups):
                raise Deviation(
                    f"{where}: blocks by hash {got_groups}, expected {sorted(list(g) for g in hash_groups)}"
                )
        if block_hashes is not None:
            for b, h in block_hashes.items():
                if s.block_hash[b] != h:
                    raise Deviation(f"{where}: block_hash[{b}]={s.block_hash[b]!r}, expected {h!r}")
        if tables is not None:
            got_tables = {rid: list(blocks) for rid, blocks in (s.block_tables or ())}
            if got_tables != {rid: list(blocks) for rid, blocks in tables.items()}:
                raise Deviation(f"{where}: block tables {got_tables}, expected {dict(tables)}")


def _ids(*ids: int) -> list[BlockId]:
    return [BlockId(b) for b in ids]


def _tokens(start: int, num: int) -> tuple[int, ...]:
    return tuple(range(start, start + num))


Factory = Callable[[AdapterConfig], Any]


# --- ordering -------------------------------------------------------------------------------


def allocate_from_right(factory: Factory) -> None:
    s = Steps(factory)
    s.do("get_new_blocks", 2, expect=_ids(1, 2))  # the left end: the blocks free longest
    s.do("cache_full_blocks", _ids(1, 2), [H1, H2])
    s.do("free_blocks", _ids(2, 1))
    s.state(free_queue=[3, 4, 5, 2, 1])
    s.do("get_new_blocks", 1, expect=_ids(3))  # not the cached blocks just freed


def hashed_freed_to_left(factory: Factory) -> None:
    s = Steps(factory)
    s.do("get_new_blocks", 3, expect=_ids(1, 2, 3))
    s.do("cache_full_blocks", _ids(1, 2), [H1, H2])  # block 3 is the partial tail
    s.do("free_blocks", _ids(3, 2, 1))  # tail first
    # No hash: left, reused first. Cached: right, tail first, so 2 is evicted before its parent 1.
    s.state(free_queue=[3, 4, 5, 2, 1])


def unhashed_freed_to_right(factory: Factory) -> None:
    s = Steps(factory, enable_caching=False)
    s.do("get_new_blocks", 2, expect=_ids(1, 2))
    s.do("free_blocks", _ids(2, 1))
    s.state(free_queue=[2, 1, 3, 4, 5])  # nothing is hashed: both go left, in the order given
    s.do("get_new_blocks", 1, expect=_ids(2))


def free_ignores_evict_first(factory: Factory) -> None:
    s = Steps(factory)
    s.do("get_new_blocks", 3, expect=_ids(1, 2, 3))
    s.do("cache_full_blocks", _ids(1, 2), [H1, H2])  # block 3 is the partial tail
    s.do("free_blocks", _ids(3, 2, 1), True)  # evict_first: another tier holds the content
    # Every freed block goes left in the order given, the cached ones with the tail: they go first.
    s.state(free_queue=[3, 2, 1, 4, 5])
    s.do("get_new_blocks", 2, expect=_ids(3, 2))  # block 2's hash is evicted before any other


def left_batch_reversed(factory: Factory) -> None:
    s = Steps(factory, enable_caching=False)
    s.do("get_new_blocks", 3, expect=_ids(1, 2, 3))
    s.do("free_blocks", _ids(3, 2, 1))
    s.state(free_queue=[3, 2, 1, 4, 5])
    s.do("get_new_blocks", 2, expect=_ids(3, 2))


def free_head_first(factory: Factory) -> None:
    s = Steps(factory, "manager")
    a = Request("a", _tokens(0, 10))  # two full blocks and a partial tail
    s.do("get_computed_blocks", a, expect=([], 0))
    s.do("allocate_slots", a, 10, expect=_ids(1, 2, 3))
    s.do("free", "a")
    # Tail first: the partial block 3 to the left, then 2 before its parent 1 on the right.
    s.state(free_queue=[3, 4, 5, 2, 1], tables={})


# --- the hash table -------------------------------------------------------------------------


def eviction_keeps_hash_entry(factory: Factory) -> None:
    s = Steps(factory, num_gpu_blocks=3)
    s.do("get_new_blocks", 1, expect=_ids(1))
    s.do("cache_full_blocks", _ids(1), [H1])
    s.do("free_blocks", _ids(1))
    s.state(free_queue=[2, 1])
    s.do("get_cached_block", H1, expect=1)  # free, but still hittable
    s.do("get_new_blocks", 2, expect=_ids(2, 1))  # block 1 is reallocated: evicted
    s.do("get_cached_block", H1, expect=None)
    s.state(hash_groups=[])


def stale_hash_after_eviction(factory: Factory) -> None:
    s = Steps(factory, num_gpu_blocks=3)
    s.do("get_new_blocks", 1, expect=_ids(1))
    s.do("cache_full_blocks", _ids(1), [H1])
    s.do("free_blocks", _ids(1))
    s.do("get_new_blocks", 2, expect=_ids(2, 1))
    s.state(hash_groups=[])
    s.do("cache_full_blocks", _ids(1), [H2])  # refilled by its new owner: registered anew


def duplicate_hash_overwrites(factory: Factory) -> None:
    s = Steps(factory)
    s.do("get_new_blocks", 2, expect=_ids(1, 2))
    s.do("cache_full_blocks", _ids(1), [H1])
    s.do("cache_full_blocks", _ids(2), [H1])  # an identical full block of another request: kept, not merged
    s.state(hash_groups=[[1, 2]])
    s.do("get_cached_block", H1, expect=1)  # the first registered


def cached_block_reregistered(factory: Factory) -> None:
    s = Steps(factory)
    s.do("get_new_blocks", 1, expect=_ids(1))
    s.do("cache_full_blocks", _ids(1), [H1])
    s.refused(AlreadyCached, "cache_full_blocks", _ids(1), [H2])
    s.do("get_cached_block", H2, expect=None)


def evict_blocks_spares_held(factory: Factory) -> None:
    s = Steps(factory)
    s.do("get_new_blocks", 2, expect=_ids(1, 2))
    s.do("cache_full_blocks", _ids(1, 2), [H1, H2])
    s.do("evict_blocks", _ids(1))  # its content is bad: never hit it again, the holder keeps it
    s.do("get_cached_block", H1, expect=None)
    s.state(hash_groups=[[2]], ref_cnt={1: 1, 2: 1})


def reset_while_held(factory: Factory) -> None:
    s = Steps(factory)
    s.do("get_new_blocks", 2, expect=_ids(1, 2))
    s.do("cache_full_blocks", _ids(1, 2), [H1, H2])
    s.do("reset_prefix_cache", expect=False)  # two blocks held
    s.do("free_blocks", _ids(2))
    s.do("reset_prefix_cache", expect=False)  # one block still held
    s.do("get_cached_block", H1, expect=1)
    s.do("free_blocks", _ids(1))
    s.do("reset_prefix_cache", expect=True)
    s.state(hash_groups=[], free_queue=[3, 4, 5, 2, 1])


# --- guards ---------------------------------------------------------------------------------


def double_free_ignored(factory: Factory) -> None:
    s = Steps(factory)
    s.do("get_new_blocks", 1, expect=_ids(1))
    s.do("cache_full_blocks", _ids(1), [H1])
    s.do("touch", _ids(1))  # a second request hits it
    s.do("free_blocks", _ids(1))
    s.do("free_blocks", _ids(1))
    s.state(free_queue=[2, 3, 4, 5, 1], ref_cnt={1: 0})
    s.refused(DoubleFree, "free_blocks", _ids(1))


def ref_cnt_underflow(factory: Factory) -> None:
    s = Steps(factory)
    s.do("get_new_blocks", 2, expect=_ids(1, 2))
    s.do("free_blocks", _ids(2, 1))
    s.refused(DoubleFree, "free_blocks", _ids(1))
    s.state(ref_cnt={1: 0, 2: 0})


def double_free_requeues(factory: Factory) -> None:
    s = Steps(factory)
    s.do("get_new_blocks", 1, expect=_ids(1))
    s.do("free_blocks", _ids(1))
    s.state(free_queue=[1, 2, 3, 4, 5])
    s.refused(DoubleFree, "free_blocks", _ids(1))
    s.do("get_new_blocks", 5, expect=_ids(1, 2, 3, 4, 5))


def null_block_accepted(factory: Factory) -> None:
    s = Steps(factory)
    s.refused(InvalidBlock, "free_blocks", _ids(0))
    s.refused(InvalidBlock, "evict_blocks", _ids(0))
    s.refused(InvalidBlock, "touch", _ids(0))


def null_block_queued(factory: Factory) -> None:
    s = Steps(factory)
    s.state(free_queue=[1, 2, 3, 4, 5])
    s.do("get_new_blocks", 5, expect=_ids(1, 2, 3, 4, 5))


# --- taking blocks --------------------------------------------------------------------------


def touch_leaves_block_queued(factory: Factory) -> None:
    s = Steps(factory)
    s.do("get_new_blocks", 1, expect=_ids(1))
    s.do("cache_full_blocks", _ids(1), [H1])
    s.do("free_blocks", _ids(1))
    s.do("get_cached_block", H1, expect=1)
    s.do("touch", _ids(1))  # a hit on a free block takes it out of the queue
    s.state(free_queue=[2, 3, 4, 5], ref_cnt={1: 1})
    s.do("get_new_blocks", 4, expect=_ids(2, 3, 4, 5))


def touch_unlinks_held_block(factory: Factory) -> None:
    s = Steps(factory)
    s.do("get_new_blocks", 1, expect=_ids(1))
    s.do("cache_full_blocks", _ids(1), [H1])
    s.do("touch", _ids(1))  # a second request hits a block that is not free
    s.state(free_queue=[2, 3, 4, 5], ref_cnt={1: 2})


def partial_allocation_on_exhaustion(factory: Factory) -> None:
    s = Steps(factory)
    s.do("get_new_blocks", 3, expect=_ids(1, 2, 3))
    s.refused(PoolExhausted, "get_new_blocks", 3)  # two free
    s.state(free_queue=[4, 5])


def num_free_misses_left_frees(factory: Factory) -> None:
    s = Steps(factory)
    s.do("get_new_blocks", 5, expect=_ids(1, 2, 3, 4, 5))
    s.do("free_blocks", _ids(5, 4, 3, 2, 1))
    s.do("get_num_free_blocks", expect=5)
    s.do("get_new_blocks", 5, expect=_ids(5, 4, 3, 2, 1))


def num_free_counts_null_block(factory: Factory) -> None:
    s = Steps(factory)
    s.do("get_num_free_blocks", expect=5)  # six blocks, one of them the null block
    s.do("get_new_blocks", 2, expect=_ids(1, 2))
    s.do("get_num_free_blocks", expect=3)


def usage_counts_null_block(factory: Factory) -> None:
    s = Steps(factory)
    s.do("get_usage", expect=0.0)
    s.do("get_new_blocks", 1, expect=_ids(1))
    s.do("get_usage", expect=pytest.approx(0.2))  # one of five allocatable blocks


def manager_over_null_counting_pool(factory: Factory) -> None:
    s = Steps(factory, "manager")
    a, b = Request("a", _tokens(0, 16)), Request("b", _tokens(100, 8))
    s.do("allocate_slots", a, 16, expect=_ids(1, 2, 3, 4))
    s.do("get_computed_blocks", b, expect=([], 0))
    s.do("allocate_slots", b, 8, expect=None)  # needs two blocks, one is free: refused, nothing changes
    s.state(free_queue=[5], tables={"a": [1, 2, 3, 4]})


# --- the request level ----------------------------------------------------------------------


def hit_cap_off_by_one(factory: Factory) -> None:
    s = Steps(factory, "manager")
    a, b = Request("a", _tokens(0, 8)), Request("b", _tokens(0, 8))
    s.do("allocate_slots", a, 8, expect=_ids(1, 2))
    s.state(hash_groups=[[1], [2]])
    # b's whole prompt is cached, but its last token must be computed: one block hit, not two.
    s.do("get_computed_blocks", b, expect=(_ids(1), 4))
    s.do("allocate_slots", b, 4, 4, _ids(1), expect=_ids(3))


def ignores_hit_limit(factory: Factory) -> None:
    s = Steps(factory, "manager")
    s.do("allocate_slots", Request("a", _tokens(0, 9)), 9, expect=_ids(1, 2, 3))
    # b's limit of 6 tokens (prompt scoring from row 6) lets one block of the two cached be hit; 0 lets none.
    s.do("get_computed_blocks", Request("b", _tokens(0, 9), prefix_cache_hit_limit=6), expect=(_ids(1), 4))
    s.do("get_computed_blocks", Request("c", _tokens(0, 9), prefix_cache_hit_limit=0), expect=([], 0))


def partial_block_hashed(factory: Factory) -> None:
    s = Steps(factory, "manager")
    a = Request("a", _tokens(0, 10))
    s.do("allocate_slots", a, 6, expect=_ids(1, 2))  # chunked prefill: block 2 is half computed
    s.state(hash_groups=[[1]])
    s.do("allocate_slots", a, 4, expect=_ids(3))  # block 2 full now; block 3 holds 2 of 4 tokens
    s.state(hash_groups=[[1], [2]])


def failed_allocation_leaves_touched(factory: Factory) -> None:
    s = Steps(factory, "manager")
    a = Request("a", _tokens(0, 9))
    b = Request("b", _tokens(0, 8) + _tokens(50, 9))  # shares a's two full blocks
    d = Request("d", _tokens(100, 8))
    s.do("allocate_slots", a, 9, expect=_ids(1, 2, 3))
    s.do("free", "a")
    s.do("allocate_slots", d, 8, expect=_ids(3, 4))
    s.state(free_queue=[5, 2, 1])
    s.do("get_computed_blocks", b, expect=(_ids(1, 2), 8))
    # b needs 3 new blocks plus its 2 hits, which are free too: 5 > 3 free, refused, nothing touched.
    s.do("allocate_slots", b, 9, 8, _ids(1, 2), expect=None)
    s.state(free_queue=[5, 2, 1], ref_cnt={1: 0, 2: 0}, tables={"d": [3, 4]})


def hit_blocks_reregistered(factory: Factory) -> None:
    s = Steps(factory, "manager")
    a = Request("a", _tokens(0, 9))
    b = Request("b", _tokens(0, 8) + (77,))
    s.do("allocate_slots", a, 9, expect=_ids(1, 2, 3))
    s.do("get_computed_blocks", b, expect=(_ids(1, 2), 8))
    s.do("allocate_slots", b, 1, 8, _ids(1, 2), expect=_ids(4))
    s.state(ref_cnt={1: 2, 2: 2, 3: 1, 4: 1}, hash_groups=[[1], [2]])


def preemption_drops_shared_block(factory: Factory) -> None:
    s = Steps(factory, "manager")
    a = Request("a", _tokens(0, 9))
    b = Request("b", _tokens(0, 8) + (77,))
    s.do("allocate_slots", a, 9, expect=_ids(1, 2, 3))
    s.do("get_computed_blocks", b, expect=(_ids(1, 2), 8))
    s.do("allocate_slots", b, 1, 8, _ids(1, 2), expect=_ids(4))
    s.do("free", "b")  # b is preempted; a still runs on blocks 1 and 2
    s.state(free_queue=[4, 5], ref_cnt={1: 1, 2: 1}, tables={"a": [1, 2, 3]})


# --- the hash chain -------------------------------------------------------------------------


def chain_ignores_parent(factory: Factory) -> None:
    s = Steps(factory, "manager", num_gpu_blocks=8)
    a = Request("a", (1, 2, 3, 4, 5, 6, 7, 8, 0))
    c = Request("c", (5, 6, 7, 8, 9))  # starts with a's second block, under another prefix
    s.do("allocate_slots", a, 9, expect=_ids(1, 2, 3))
    s.do("get_computed_blocks", c, expect=([], 0))


def cache_salt_ignored(factory: Factory) -> None:
    s = Steps(factory, "manager", num_gpu_blocks=8)
    a = Request("a", _tokens(0, 9), cache_salt="tenant-1")
    b = Request("b", _tokens(0, 9), cache_salt="tenant-2")
    s.do("allocate_slots", a, 9, expect=_ids(1, 2, 3))
    s.do("get_computed_blocks", b, expect=([], 0))  # another tenant: no hit on the same tokens
    s.do("allocate_slots", b, 9, expect=_ids(4, 5, 6))
    s.state(hash_groups=[[1], [2], [4], [5]])


def cache_salt_on_every_block(factory: Factory) -> None:
    s = Steps(factory, "manager")
    a = Request("a", _tokens(0, 9), cache_salt="tenant-1")
    s.do("allocate_slots", a, 9, expect=_ids(1, 2, 3))
    # The salt keys the first block only: exact hashes, as an external KV store keyed by vLLM's would see them.
    h = hash_request_blocks(a.token_ids, 4, cache_salt="tenant-1")
    s.state(block_hashes={1: h[0], 2: h[1]})


def lora_ignored(factory: Factory) -> None:
    s = Steps(factory, "manager", num_gpu_blocks=8)
    a = Request("a", _tokens(0, 9), lora_name="sql-lora")
    b = Request("b", _tokens(0, 9), lora_name="chat-lora")
    s.do("allocate_slots", a, 9, expect=_ids(1, 2, 3))
    s.do("get_computed_blocks", b, expect=([], 0))
    s.do("allocate_slots", b, 9, expect=_ids(4, 5, 6))
    s.state(hash_groups=[[1], [2], [4], [5]])


def multimodal_ignored(factory: Factory) -> None:
    s = Steps(factory, "manager", num_gpu_blocks=8)
    # The same placeholder tokens for an image in positions 0..5, but two different images.
    a = Request("a", (7,) * 6 + (1, 2, 3), mm_inputs=(MultiModalInput("img-cat", 0, 6),))
    b = Request("b", (7,) * 6 + (1, 2, 3), mm_inputs=(MultiModalInput("img-dog", 0, 6),))
    s.do("allocate_slots", a, 9, expect=_ids(1, 2, 3))
    s.do("get_computed_blocks", b, expect=([], 0))
    s.do("allocate_slots", b, 9, expect=_ids(4, 5, 6))
    s.state(hash_groups=[[1], [2], [4], [5]])


# --- seed 002's keyed policies: the free queue is first fit (ids), then the cached blocks by key ---


def _two_cached_blocks_freed(s: Steps) -> None:
    """Blocks 1 and 2 taken, registered and freed tail first: both cached, free, one access each."""
    s.do("get_new_blocks", 2, expect=_ids(1, 2))
    s.do("cache_full_blocks", _ids(1, 2), [H1, H2])
    s.do("free_blocks", _ids(2, 1))  # stamped in this order: 2 older than 1


def lfu_ties_newest_first(factory: Factory) -> None:
    s = Steps(factory, profile="lfu")
    _two_cached_blocks_freed(s)
    s.state(free_queue=[3, 4, 5, 2, 1])  # one access each: the older last access goes first


def hit_not_counted(factory: Factory) -> None:
    s = Steps(factory, profile="lfu")
    _two_cached_blocks_freed(s)
    for _ in range(2):  # block 1 hit twice
        s.do("touch", _ids(1))
        s.do("free_blocks", _ids(1))
    s.do("touch", _ids(2))  # block 2 hit once, and freed last
    s.do("free_blocks", _ids(2))
    s.state(free_queue=[3, 4, 5, 2, 1])  # 2 accesses against 3: block 2 goes first though used last


def free_keeps_timestamp(factory: Factory) -> None:
    s = Steps(factory, profile="lru-timestamp")
    s.do("get_new_blocks", 3, expect=_ids(1, 2, 3))
    s.do("cache_full_blocks", _ids(1, 2, 3), [H1, H2, H3])
    s.do("free_blocks", _ids(3, 2, 1))
    s.state(free_queue=[4, 5, 3, 2, 1])  # the deepest block goes first, the head last


def first_fit_highest_id(factory: Factory) -> None:
    s = Steps(factory, profile="lru-timestamp")
    s.do("get_new_blocks", 2, expect=_ids(1, 2))


# --- KV cache groups: full attention and a sliding window of 8 tokens over one pool ---

_LAYOUT = "full,sliding:8"


def _window_steps(factory: Factory) -> Steps:
    """A's 14 tokens scheduled whole: each group takes 4 blocks (full 1-4, the window 5-8), 3 registered each."""
    s = Steps(factory, "manager", num_gpu_blocks=13, groups=_LAYOUT)
    s.do("allocate_slots", Request("a", _tokens(0, 14)), 14, expect=_ids(*range(1, 9)))
    s.state(tables={"a": [1, 2, 3, 4], "a#1": [5, 6, 7, 8]})
    return s


def skipped_block_not_freed(factory: Factory) -> None:
    s = _window_steps(factory)
    # 14 computed: the next token reads 7..14, so the window's block 0 (tokens 0..3) is freed and nulled.
    s.do("allocate_slots", Request("a", _tokens(0, 15)), 1, expect=[])
    s.state(tables={"a": [1, 2, 3, 4], "a#1": [0, 6, 7, 8]}, free_queue=[9, 10, 11, 12, 5])


def skipped_freed_head_first(factory: Factory) -> None:
    s = Steps(factory, "manager", num_gpu_blocks=13, groups=_LAYOUT)
    a = Request("a", _tokens(0, 17))
    s.do("allocate_slots", a, 4, expect=_ids(1, 2))
    s.do("allocate_slots", a, 12, expect=_ids(3, 4, 5, 6, 7, 8))
    s.state(tables={"a": [1, 3, 4, 5], "a#1": [2, 6, 7, 8]})
    # 16 computed: the window's blocks 1 and 0 go, last first, to the right end; then one block per group.
    s.do("allocate_slots", a, 1, expect=_ids(9, 10))
    s.state(tables={"a": [1, 3, 4, 5, 9], "a#1": [0, 0, 7, 8, 10]}, free_queue=[11, 12, 6, 2])


def hit_longer_than_window_allows(factory: Factory) -> None:
    s = _window_steps(factory)
    s.do("free", "a")
    # B's first token to compute is 12: it reads 5..12, so the window's hit needs blocks 1 and 2 (cdiv(7, 4)).
    s.do("get_computed_blocks", Request("b", _tokens(0, 13)), expect=(_ids(1, 2, 3, 0, 6, 7), 12))


def key_without_group_id(factory: Factory) -> None:
    _window_steps(factory).state(hash_groups=[[1], [2], [3], [5], [6], [7]])  # one key per group and hash


# --- events and statistics ------------------------------------------------------------------


def _one_cached_free_block(factory: Factory) -> Steps:
    """Block 1 registered under h1 and freed: it is free and still cached, at the right end."""
    s = Steps(factory, events=True)
    s.do("get_new_blocks", 1, expect=_ids(1), publishes=[])
    s.do("cache_full_blocks", _ids(1), [H1], publishes=[BlockStored((H1,), None)])
    s.do("free_blocks", _ids(1), publishes=[])
    return s


def eviction_without_block_removed(factory: Factory) -> None:
    s = _one_cached_free_block(factory)
    s.do("get_new_blocks", 5, expect=_ids(2, 3, 4, 5, 1), publishes=[BlockRemoved((H1,))])


def reset_without_all_blocks_cleared(factory: Factory) -> None:
    _one_cached_free_block(factory).do("reset_prefix_cache", expect=True, publishes=[AllBlocksCleared()])


def hit_announced_again(factory: Factory) -> None:
    _one_cached_free_block(factory).do("touch", _ids(1), publishes=[])  # a hit announces nothing: h1 is cached


def stored_with_wrong_parent(factory: Factory) -> None:
    s = Steps(factory, "manager", events=True)
    a = Request("a", _tokens(0, 9))
    h = hash_request_blocks(a.token_ids, 4)
    first = BlockStored((h[0],), None, _tokens(0, 4), 4, None, (None,))
    s.do("allocate_slots", a, 4, expect=_ids(1), publishes=[first])
    second = BlockStored((h[1],), h[0], _tokens(4, 4), 4, None, (None,))  # chained on the block before
    s.do("allocate_slots", a, 4, expect=_ids(2), publishes=[second])


def preempted_counted_as_new(factory: Factory) -> None:
    s = Steps(factory, "manager", events=True)
    a = Request("a", _tokens(0, 9))
    s.do("allocate_slots", a, 9, expect=_ids(1, 2, 3))
    s.do("free", "a")  # preempted: it comes back with its tokens, counted apart
    again = Request("a", a.token_ids, num_preemptions=1)
    s.do("get_computed_blocks", again, expect=(_ids(1, 2), 8))
    s.do("allocate_slots", again, 1, 8, _ids(1, 2), 0, expect=_ids(3))
    local = CacheCounters(requests=1, queries=9, preempted_requests=1, preempted_queries=9, preempted_hits=8)
    s.counted(PrefixCacheStats(local, CacheCounters(1, 9, 0, 1, 1, 0)))


def external_counted_as_local(factory: Factory) -> None:
    s = Steps(factory, "manager", events=True)
    s.do("allocate_slots", Request("a", _tokens(0, 9)), 1, 0, [], 4, expect=_ids(1, 2))  # 4 tokens loaded
    s.counted(PrefixCacheStats(CacheCounters(1, 9, 0), CacheCounters(1, 9, 4)))


def skipped_lookup_counted(factory: Factory) -> None:
    s = Steps(factory, "manager", enable_caching=False, events=True)
    s.do("allocate_slots", Request("a", _tokens(0, 9)), 9, expect=_ids(1, 2, 3))
    # No lookup ran without caching: the local cache was asked nothing; the connector counts the admission.
    s.counted(PrefixCacheStats(CacheCounters(), CacheCounters(1, 9, 0)))


def free_evicts_cached_blocks(factory: Factory) -> None:
    s = Steps(factory)
    s.do("get_new_blocks", 2, expect=_ids(1, 2))
    s.do("cache_full_blocks", _ids(1, 2), [H1, H2])
    s.do("free_blocks", _ids(2, 1))
    s.state(hash_groups=[[1], [2]])  # freed, still cached: evicted only when taken again
    s.do("get_cached_block", H1, expect=1)


def caches_with_caching_off(factory: Factory) -> None:
    s = Steps(factory, enable_caching=False)
    s.do("get_new_blocks", 1, expect=_ids(1))
    s.refused(InvalidRequest, "cache_full_blocks", _ids(1), [H1])


def free_loses_last_block(factory: Factory) -> None:
    s = Steps(factory)
    s.do("get_new_blocks", 2, expect=_ids(1, 2))
    s.do("free_blocks", _ids(2, 1))
    s.state(free_queue=[2, 1, 3, 4, 5])


# Mutant name -> its scenario, and where (a regex on the Deviation's first line) the mutant must
# depart: the step its bug first shows, so a mutant that fails for another reason fails the test.
SCENARIOS: dict[str, tuple[Callable[[Factory], None], str]] = {
    "allocate_from_right": (allocate_from_right, r"step 1 get_new_blocks\(2,\) returned \[5, 4\]"),
    "hashed_freed_to_left": (hashed_freed_to_left, r"state after step 3: free_queue=\[2, 1, 4, 5, 3\]"),
    "unhashed_freed_to_right": (unhashed_freed_to_right, r"state after step 2: free_queue=\[3, 4, 5, 2, 1\]"),
    "free_ignores_evict_first": (free_ignores_evict_first, r"state after step 3: free_queue=\[3, 4, 5, 2, 1\]"),
    "left_batch_reversed": (left_batch_reversed, r"state after step 2: free_queue=\[1, 2, 3, 4, 5\]"),
    "free_head_first": (free_head_first, r"state after step 3: free_queue=\[3, 4, 5, 1, 2\]"),
    "eviction_keeps_hash_entry": (eviction_keeps_hash_entry, r"after step 5 get_new_blocks.*inv_hash_table_consistent"),
    "stale_hash_after_eviction": (stale_hash_after_eviction, r"after step 4 get_new_blocks.*inv_hash_table_consistent"),
    "duplicate_hash_overwrites": (
        duplicate_hash_overwrites,
        r"after step 3 cache_full_blocks.*inv_hash_table_consistent",
    ),
    "cached_block_reregistered": (
        cached_block_reregistered,
        r"step 3 cache_full_blocks.* was accepted; expected AlreadyCached",
    ),
    "evict_blocks_spares_held": (evict_blocks_spares_held, r"step 4 get_cached_block.* returned 1, expected None"),
    "reset_while_held": (reset_while_held, r"step 3 reset_prefix_cache\(\) returned True"),
    "reset_counts_null_twice": (reset_while_held, r"step 5 reset_prefix_cache\(\) returned True"),
    "double_free_ignored": (double_free_ignored, r"step 6 free_blocks.* was accepted; expected DoubleFree"),
    "ref_cnt_underflow": (ref_cnt_underflow, r"step 3 free_blocks.* was accepted; expected DoubleFree"),
    "double_free_requeues": (double_free_requeues, r"step 3 free_blocks.* was accepted; expected DoubleFree"),
    "null_block_accepted": (null_block_accepted, r"step 1 free_blocks\(\[0\],\) raised DoubleFree"),
    "null_block_queued": (null_block_queued, r"after construction: invariants broken: inv_null_block_isolated"),
    "touch_leaves_block_queued": (touch_leaves_block_queued, r"after step 5 touch.*inv_free_queue_has_zero_ref"),
    "touch_unlinks_held_block": (touch_unlinks_held_block, r"step 3 touch\(\[1\],\) raised"),
    "partial_allocation_on_exhaustion": (
        partial_allocation_on_exhaustion,
        r"step 2 get_new_blocks\(3,\) was refused but changed",
    ),
    "num_free_misses_left_frees": (num_free_misses_left_frees, r"step 3 get_num_free_blocks\(\) returned 0"),
    "num_free_counts_null_block": (num_free_counts_null_block, r"step 1 get_num_free_blocks\(\) returned 6"),
    "usage_counts_null_block": (usage_counts_null_block, r"step 1 get_usage\(\) returned 0\.1666"),
    "manager_over_null_counting_pool": (
        manager_over_null_counting_pool,
        r"step 3 allocate_slots.* raised PoolExhausted",
    ),
    "hit_cap_off_by_one": (hit_cap_off_by_one, r"step 2 get_computed_blocks.* returned \(\[1, 2\], 8\)"),
    "partial_block_hashed": (partial_block_hashed, r"state after step 1: blocks by hash \[\[1\], \[2\]\]"),
    "failed_allocation_leaves_touched": (
        failed_allocation_leaves_touched,
        r"after step 5 allocate_slots.*inv_block_tables_hold_refs",
    ),
    "capacity_ignores_evictable_hits": (
        failed_allocation_leaves_touched,
        r"step 5 allocate_slots.* raised PoolExhausted",
    ),
    "hit_blocks_reregistered": (hit_blocks_reregistered, r"step 3 allocate_slots.* raised AlreadyCached"),
    "preemption_drops_shared_block": (
        preemption_drops_shared_block,
        r"after step 4 free\('b',\).*inv_block_tables_hold_refs",
    ),
    "chain_ignores_parent": (chain_ignores_parent, r"step 2 get_computed_blocks.* returned \(\[2\], 4\)"),
    "cache_salt_ignored": (cache_salt_ignored, r"step 2 get_computed_blocks.* returned \(\[1, 2\], 8\)"),
    "cache_salt_on_every_block": (cache_salt_on_every_block, r"state after step 1: block_hash\[2\]="),
    "lora_ignored": (lora_ignored, r"step 2 get_computed_blocks.* returned \(\[1, 2\], 8\)"),
    "multimodal_ignored": (multimodal_ignored, r"step 2 get_computed_blocks.* returned \(\[1, 2\], 8\)"),
    "lfu_ties_newest_first": (lfu_ties_newest_first, r"state after step 3: free_queue=\[3, 4, 5, 1, 2\]"),
    "hit_not_counted": (hit_not_counted, r"state after step 9: free_queue=\[3, 4, 5, 1, 2\]"),
    "free_keeps_timestamp": (free_keeps_timestamp, r"state after step 3: free_queue=\[4, 5, 1, 2, 3\]"),
    "first_fit_highest_id": (first_fit_highest_id, r"step 1 get_new_blocks\(2,\) returned \[5, 4\]"),
    "skipped_block_not_freed": (skipped_block_not_freed, r"state after step 2: free_queue=\[9, 10, 11, 12\], "),
    "skipped_freed_head_first": (skipped_freed_head_first, r"state after step 3: free_queue=\[11, 12, 2, 6\]"),
    "window_off_by_one_block": (skipped_block_not_freed, r"state after step 2: free_queue=\[9, 10, 11, 12, 6, 5\]"),
    "hit_longer_than_window_allows": (
        hit_longer_than_window_allows,
        r"step 3 get_computed_blocks.* returned \(\[1, 2, 3, 0, 0, 7\], 12\)",
    ),
    "key_without_group_id": (key_without_group_id, r"state after step 1: blocks by hash \[\[1, 5\]"),
    "eviction_without_block_removed": (eviction_without_block_removed, r"step 4 get_new_blocks\(5,\) published \[\]"),
    "reset_without_all_blocks_cleared": (
        reset_without_all_blocks_cleared,
        r"step 4 reset_prefix_cache\(\) published \[\]",
    ),
    "hit_announced_again": (hit_announced_again, r"step 4 touch\(\[1\],\) published \[BlockStored"),
    "stored_with_wrong_parent": (stored_with_wrong_parent, r"step 2 allocate_slots.* published \[BlockStored"),
    "preempted_counted_as_new": (preempted_counted_as_new, r"statistics after step 4: .*requests=2"),
    "external_counted_as_local": (external_counted_as_local, r"statistics after step 1: .*hits=4"),
    "skipped_lookup_counted": (
        skipped_lookup_counted,
        r"statistics after step 1: PrefixCacheStats\(local=CacheCounters\(requests=1, ",
    ),
    "ignores_hit_limit": (ignores_hit_limit, r"step 2 get_computed_blocks.* returned \(\[1, 2\], 8\)"),
    "free_evicts_cached_blocks": (free_evicts_cached_blocks, r"state after step 3: blocks by hash \[\], "),
    "caches_with_caching_off": (
        caches_with_caching_off,
        r"step 2 cache_full_blocks.* was accepted; expected InvalidRequest",
    ),
    "free_loses_last_block": (free_loses_last_block, r"after step 2 free_blocks.*inv_free_queue_has_zero_ref"),
}

# Mutant modules of other packages' implementations (gpu_*) bring their own scenarios.
OWN_MUTANTS: list[Mutant] = [m for m in all_mutants() if not m.factory.__module__.rsplit(".", 1)[-1].startswith("gpu_")]
# The unmutated bases some mutants are built on: they must pass every scenario of their level. The
# request-level mutants override one phase of the reference's allocate_slots: the reference is their base.
BASES: dict[str, list[Factory]] = {"pool": [ListQueuePool], "manager": [ReferenceManagerAdapter]}


def test_every_mutant_has_a_scenario():
    assert sorted(SCENARIOS) == sorted(m.name for m in OWN_MUTANTS)


@pytest.mark.parametrize("mutant", OWN_MUTANTS, ids=lambda m: m.name)
@pytest.mark.parametrize("factory", [make_spec, make_reference], ids=["spec", "reference"])
def test_correct_implementations_pass_the_scenario(mutant: Mutant, factory: Factory) -> None:
    SCENARIOS[mutant.name][0](factory)


# A policy mutant's base is the reference itself (its keyed free blocks), which the test above runs.
@pytest.mark.parametrize("mutant", [m for m in OWN_MUTANTS if m.profile == "vllm-v1"], ids=lambda m: m.name)
def test_unmutated_bases_pass_the_scenario(mutant: Mutant) -> None:
    for base in BASES[mutant.level]:
        SCENARIOS[mutant.name][0](base)


@pytest.mark.parametrize("mutant", OWN_MUTANTS, ids=lambda m: m.name)
def test_mutant_deviates_where_its_bug_shows(mutant: Mutant) -> None:
    scenario, where = SCENARIOS[mutant.name]
    with pytest.raises(Deviation) as caught:
        scenario(mutant.factory)
    first_line = str(caught.value).splitlines()[0]
    assert re.match(where, first_line), f"{mutant.name} deviated elsewhere: {first_line}"
