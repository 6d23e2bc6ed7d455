"""gpu_impl's KV cache events and hit statistics: named scenarios with the exact events and counters.

The lock-step machines (test_pool_lockstep, test_manager_lockstep) compare
gpu_impl's events and counters with the reference's on random traffic, and
`kvspec check --impl gpu --events` with the spec's; the scenarios here state
them outright: a key held by two blocks removed twice (a router that does
not count references drops it too early), a registration's parent, tokens
and request keys, the events of a reset and of an eviction by id, the
counters of admissions, refused steps, external tokens and preemptions, and
the caller mistakes of the new arguments, each refused with the spec's error
and message, the state, the events and the counters unchanged.
"""

from __future__ import annotations

import pytest

from kvspec.conformance.core.adapter import AdapterConfig
from kvspec.conformance.targets.builtin import SpecManagerAdapter
from kvspec.gpu_impl.block_pool import TensorBlockPool
from kvspec.gpu_impl.device import pick_device
from kvspec.gpu_impl.kv_cache_manager import TensorKVCacheManager
from kvspec.spec.errors import BlockManagerError, InvalidBlock, InvalidRequest
from kvspec.spec.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventMirror,
    naive_misreads,
    orphaned_stores,
)
from kvspec.spec.hashing import hash_request_blocks
from kvspec.spec.invariants import check_events
from kvspec.spec.manager import Request
from kvspec.spec.state import BlockHash, group_key
from kvspec.spec.stats import CacheCounters, PrefixCacheStats

H, H2 = BlockHash(b"h" * 8), BlockHash(b"i" * 8)

PATHS = pytest.mark.parametrize(
    ("profile", "python_path_max"),
    [("vllm-v1", None), ("vllm-v1", 0), ("lru-timestamp", None), ("lru-timestamp", 0)],
    ids=["queue-python-path", "queue-tensor-path", "keyed-python-path", "keyed-tensor-path"],
)


def events_pool(n: int, profile: str = "vllm-v1", python_path_max: int | None = None) -> TensorBlockPool:
    return TensorBlockPool(
        n, True, profile, pick_device(), python_path_max=python_path_max, enable_kv_cache_events=True
    )


def events_manager(n: int, block_size: int, groups: str = "full") -> TensorKVCacheManager:
    return TensorKVCacheManager(n, block_size, device=pick_device(), groups=groups, enable_kv_cache_events=True)


# --- the pool ---------------------------------------------------------------------------------------------


@PATHS
def test_a_key_held_by_two_blocks_is_removed_twice_when_both_are_taken(profile, python_path_max):
    pool = events_pool(6, profile, python_path_max)
    assert pool.get_new_blocks(2) == [1, 2]
    assert pool.take_events() == []  # nothing was cached: taking evicts nothing
    pool.cache_full_blocks([1, 2], [H, H])  # identical full blocks are kept apart
    assert pool.take_events() == [BlockStored((H, H), None)]
    pool.free_blocks([2, 1])
    assert pool.take_events() == []  # a freed block stays cached
    mirror = EventMirror().apply([BlockStored((H, H), None)])
    assert pool.get_new_blocks(5)[-2:] in ([2, 1], [1, 2])  # the cached blocks go last, by either policy
    events = pool.take_events()
    assert events == [BlockRemoved((H,)), BlockRemoved((H,))]
    # The first removal leaves the key cached in the other block: a router must count references.
    assert naive_misreads(mirror, events) == [H]
    check_events(mirror, events, pool.snapshot())  # the counting mirror is empty, as the hash table
    pool.check_invariants()


@PATHS
def test_eviction_by_id_removes_each_cached_key_in_the_order_named(profile, python_path_max):
    pool = events_pool(6, profile, python_path_max)
    held = pool.get_new_blocks(4)
    pool.cache_full_blocks(held[:3], [H, H, H2])
    pool.free_blocks([held[1]])  # one of them free, the others held: both kinds lose their key
    pool.take_events()
    pool.evict_blocks([held[2], held[3], held[1]])  # the last one named has no hash: nothing for it
    assert pool.take_events() == [BlockRemoved((H2,)), BlockRemoved((H,))]
    pool.evict_blocks([held[2]])  # nothing cached any more: nothing published
    assert pool.take_events() == []
    assert pool.get_cached_block(H) == held[0]
    pool.check_invariants()


def test_a_reset_clears_all_and_a_refused_one_publishes_nothing():
    pool = events_pool(4)
    held = pool.get_new_blocks(2)
    pool.cache_full_blocks(held, [H, H2])
    pool.take_events()
    assert not pool.reset_prefix_cache()  # blocks held: refused
    assert pool.take_events() == []
    pool.free_blocks(held[::-1])
    assert pool.reset_prefix_cache()
    assert pool.reset_prefix_cache()  # nothing cached, but a reset all the same: vLLM publishes each
    assert pool.take_events() == [AllBlocksCleared(), AllBlocksCleared()]
    assert pool.get_cached_block(H) is None


def test_a_refused_call_publishes_nothing():
    pool = events_pool(4)
    held = pool.get_new_blocks(2)
    pool.cache_full_blocks(held, [H, H2])
    pool.free_blocks(held)
    pool.take_events()
    for op, args, error in [
        ("get_new_blocks", (4,), BlockManagerError),  # more than free: nothing is taken, nothing evicted
        ("evict_blocks", ([held[0], 0],), InvalidBlock),  # the null block: the cached one is not dropped
        ("evict_blocks", ([held[0], held[0]],), InvalidRequest),
        ("cache_full_blocks", ([3], [H]), InvalidBlock),  # not held
    ]:
        with pytest.raises(error):
            getattr(pool, op)(*args)
        assert pool.take_events() == [], op
    assert pool.get_cached_block(H) == held[0]


def test_events_off_keep_no_queue():
    pool = TensorBlockPool(4, device=pick_device())
    held = pool.get_new_blocks(2)
    pool.cache_full_blocks(held, [H, H2])
    pool.free_blocks(held)
    pool.get_new_blocks(3)
    assert pool.kv_event_queue is None and pool.take_events() == []


# --- the request level ------------------------------------------------------------------------------------


def test_a_registration_names_its_parent_tokens_and_the_request_keys():
    m = events_manager(10, 2)
    a = Request("a", (1, 2, 3, 4, 5), lora_name="l", cache_salt="s")
    h0, h1 = hash_request_blocks(a.token_ids, 2, "l", (), "s")
    assert m.get_computed_blocks(a) == ([], 0)
    assert m.allocate_slots(a, 3) == [1, 2]  # tokens 1..3: block 0 full
    assert m.take_events() == [BlockStored((h0,), None, (1, 2), 2, "l", (("l", "s"),), 0)]
    assert m.allocate_slots(a, 2) == [3]  # tokens 4, 5: block 1 full, its parent block 0's key
    assert m.take_events() == [BlockStored((h1,), h0, (3, 4), 2, "l", (("l",),), 0)]
    m.free("a")
    b = Request("b", (1, 2, 3, 4, 9), lora_name="l", cache_salt="s")
    assert m.get_computed_blocks(b) == ([1, 2], 4)
    assert m.allocate_slots(b, 1, 4, [1, 2]) == [3]  # a hit and a block without a hash: nothing published
    assert m.take_events() == []
    assert m.prefix_cache_stats().local == CacheCounters(2, 10, 4)


def test_each_group_that_registers_publishes_its_own_stored_event_as_the_spec():
    groups = "full,sliding:4"
    m = events_manager(12, 2, groups)
    spec = SpecManagerAdapter(AdapterConfig("manager", 12, True, "vllm-v1", 2, groups=groups, events=True))
    a = Request("a", (1, 2, 3, 4, 5))
    h0, h1 = hash_request_blocks(a.token_ids, 2)
    for manager in (m, spec):
        assert manager.get_computed_blocks(a) == ([], 0)
        assert manager.allocate_slots(a, 5) == [1, 2, 3, 4, 5, 6]  # three blocks per group
    events = m.take_events()
    keys_1 = (group_key(h0, 1), group_key(h1, 1))
    assert events == [
        BlockStored((h0, h1), None, (1, 2, 3, 4), 2, None, (None, None), 0),
        BlockStored(keys_1, None, (1, 2, 3, 4), 2, None, (None, None), 1),
    ]
    assert events == spec.take_events()


def test_an_evicted_parent_is_still_named_by_its_childs_registration():
    m = events_manager(10, 2)
    a = Request("a", (1, 2, 3, 4, 5, 6, 7))
    h0, h1, _ = hash_request_blocks(a.token_ids, 2)
    m.allocate_slots(a, 3)
    mirror = EventMirror().apply(m.take_events())
    m.evict_blocks([1])  # the connector's load of block 1 failed: its key goes, its holder keeps it
    removed = m.take_events()
    assert removed == [BlockRemoved((h0,))]
    snap = m.snapshot()
    assert snap.block_hash[1] is None and snap.ref_cnt[1] == 1 and snap.block_tables == (("a", (1, 2)),)
    mirror = mirror.apply(removed)
    m.allocate_slots(a, 2)
    stored = m.take_events()
    assert stored == [BlockStored((h1,), h0, (3, 4), 2, None, (None,), 0)]
    # The router holds no h0 now (an orphan to a tree builder), but heard of it: the spec's rule holds.
    assert orphaned_stores(mirror, stored) == stored
    check_events(mirror, stored, m.snapshot())
    assert m.get_computed_blocks(Request("b", a.token_ids)) == ([], 0)  # the hole ends every hit


def test_a_manager_reset_is_counted_only_when_it_happens():
    m = events_manager(6, 2)
    m.allocate_slots(Request("a", (1, 2, 3)), 3)
    m.take_events()
    assert not m.reset_prefix_cache()  # "a" holds blocks
    assert m.take_events() == [] and m.prefix_cache_stats().num_resets == 0
    m.free("a")
    assert m.reset_prefix_cache()
    assert m.take_events() == [AllBlocksCleared()] and m.prefix_cache_stats().num_resets == 1
    assert m.get_computed_blocks(Request("b", (1, 2, 3))) == ([], 0)


def test_hit_statistics_count_admissions_local_external_and_preempted_apart():
    # Stats are kept with events off too (vLLM's scheduler logs them apart from the event stream).
    m = TensorKVCacheManager(6, 4, device=pick_device())
    spec = SpecManagerAdapter(AdapterConfig("manager", 6, True, "vllm-v1", 4))
    prompt = tuple(range(9))  # two full blocks and a partial one

    def both(op: str, *args: object) -> object:
        got = getattr(m, op)(*args)
        assert got == getattr(spec, op)(*args), f"{op}{args}"
        return got

    a, b, c = Request("a", prompt), Request("b", prompt), Request("c", (*prompt, 9))
    assert both("get_computed_blocks", a) == ([], 0)
    assert both("allocate_slots", a, 9) == [1, 2, 3]
    assert both("get_computed_blocks", b) == ([1, 2], 8)
    assert both("allocate_slots", b, 1, 8, [1, 2]) == [4]
    # c: the scheduler caps the local hit at one block, the connector loads 4 tokens after it.
    assert both("get_computed_blocks", c, 4) == ([1], 4)
    assert both("allocate_slots", c, 2, 4, [1], 4) is None  # two blocks needed, one free: not admitted
    assert m.prefix_cache_stats().local == CacheCounters(2, 18, 8)  # a refused step counts nothing
    both("free", "a")
    assert both("get_computed_blocks", c, 4) == ([1], 4)  # retried next step: counted once, now
    assert both("allocate_slots", c, 2, 4, [1], 4) == [3, 5]
    both("free", "b")  # preempted: its tokens come back as a re-admission, counted apart
    b_again = Request("b", prompt, num_preemptions=1)
    assert both("get_computed_blocks", b_again) == ([1, 2], 8)
    assert both("allocate_slots", b_again, 1, 8, [1, 2]) == [4]
    assert both("reset_prefix_cache") is False
    for rid in ("b", "c"):
        both("free", rid)
    assert both("reset_prefix_cache") is True
    assert m.prefix_cache_stats() == PrefixCacheStats(
        local=CacheCounters(3, 28, 12, 1, 9, 8), connector=CacheCounters(3, 16, 4, 1, 1, 0), num_resets=1
    )
    assert m.prefix_cache_stats() == spec.prefix_cache_stats()
    assert m.take_events() == []  # events off: nothing kept


def test_a_hit_cap_of_zero_serves_nothing_and_a_cap_past_the_prompt_changes_nothing():
    m = events_manager(10, 2)
    m.allocate_slots(Request("a", (1, 2, 3, 4, 5)), 5)
    m.free("a")
    b = Request("b", (1, 2, 3, 4, 5))
    assert m.get_computed_blocks(b, 0) == ([], 0)
    assert m.get_computed_blocks(b, 3) == ([1], 2)  # whole blocks only
    assert m.get_computed_blocks(b, 99) == m.get_computed_blocks(b) == ([1, 2], 4)


# --- caller mistakes of the new arguments ------------------------------------------------------------------


def _refused_as_the_spec(op: str, *args: object) -> None:
    """The call raises the spec's error type and message, and the state, events and counters stay."""
    m = events_manager(8, 2)
    spec = SpecManagerAdapter(AdapterConfig("manager", 8, True, "vllm-v1", 2, events=True))
    for manager in (m, spec):
        manager.allocate_slots(Request("a", (1, 2, 3)), 3)
        manager.take_events()
    before, stats = m.snapshot(), m.prefix_cache_stats()
    with pytest.raises(BlockManagerError) as want:
        getattr(spec, op)(*args)
    with pytest.raises(type(want.value)) as got:
        getattr(m, op)(*args)
    assert str(got.value) == str(want.value)
    assert m.snapshot() == before and m.prefix_cache_stats() == stats and m.take_events() == []


@pytest.mark.parametrize("op", ["get_computed_blocks", "allocate_slots"])
@pytest.mark.parametrize("num_preemptions", [-1, True, 1.5, None])
def test_a_preemption_count_that_is_no_count_is_refused(op, num_preemptions):
    request = Request("r", (1, 2), num_preemptions=num_preemptions)  # type: ignore[arg-type]
    _refused_as_the_spec(op, request, *([1] if op == "allocate_slots" else []))
    m = events_manager(8, 2)
    with pytest.raises(
        InvalidRequest,
        match=rf"^{op}: request_id='r' has num_preemptions={num_preemptions!r}; it counts the times the "
        r"scheduler preempted it, a non-negative integer$",
    ):
        getattr(m, op)(request, *([1] if op == "allocate_slots" else []))


@pytest.mark.parametrize("cap", [-1, True, 2.0, "4"])
def test_a_hit_cap_that_is_no_count_is_refused(cap):
    _refused_as_the_spec("get_computed_blocks", Request("r", (1, 2, 3)), cap)
    with pytest.raises(InvalidRequest, match=rf"^get_computed_blocks: max_cache_hit_length={cap!r} must be None"):
        events_manager(8, 2).get_computed_blocks(Request("r", (1, 2, 3)), cap)


def test_the_request_is_checked_before_the_cap_and_the_cap_before_running():
    _refused_as_the_spec("get_computed_blocks", Request("r", (1, 2), num_preemptions=-1), -1)  # the count
    _refused_as_the_spec("get_computed_blocks", Request("a", (1, 2, 3)), -1)  # the cap, though "a" runs


@pytest.mark.parametrize("block_ids", [[0], [8], [-1], [1, 0], [2, 2], [True]], ids=str)
def test_a_manager_eviction_by_bad_id_is_refused(block_ids):
    _refused_as_the_spec("evict_blocks", block_ids)
