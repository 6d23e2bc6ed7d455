"""spec.events and spec.stats: what each operation publishes and counts, and the router's mirror rules.

Scenario tests with explicit steps and the exact events expected (as vLLM
0.33's BlockPool and KVCacheManager publish them), then the rules of
spec.invariants' EVENT_RULES on streams that keep and that break them.
"""

from __future__ import annotations

import pytest

from kvspec.spec import manager as m
from kvspec.spec import ops
from kvspec.spec.errors import InvalidRequest, InvariantViolation
from kvspec.spec.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventMirror,
    event_extra_keys,
    naive_misreads,
    orphaned_stores,
    table_counts,
)
from kvspec.spec.hashing import MultiModalInput
from kvspec.spec.invariants import check_events, event_mirror_exact, event_parent_known
from kvspec.spec.manager import Request
from kvspec.spec.state import BlockHash, BlockId, group_key
from kvspec.spec.stats import CacheCounters

H1, H2 = BlockHash(b"h1"), BlockHash(b"h2")


def _ids(*ids: int) -> list[BlockId]:
    return [BlockId(b) for b in ids]


# --- the pool level ---------------------------------------------------------------------------


def test_registration_publishes_the_keys_and_a_duplicate_is_stored_again():
    pool = ops.get_new_blocks(ops.new_pool(4), 2).state
    step = ops.cache_full_blocks(pool, _ids(1, 2), [H1, H1])
    assert step.events == (BlockStored((H1, H1), None),)  # the pool is told no request: no parent, no tokens
    assert ops.cache_full_blocks(pool, [], []).events == ()


def test_an_eviction_publishes_one_removal_per_key_and_a_router_that_forgets_misreads_the_first():
    pool = ops.get_new_blocks(ops.new_pool(4), 2).state
    pool = ops.cache_full_blocks(pool, _ids(1, 2), [H1, H1]).state
    pool = ops.free_blocks(pool, _ids(2, 1)).state  # hashed: to the right end, 2 then 1
    mirror = EventMirror(table_counts(pool.hash_to_blocks))
    step = ops.get_new_blocks(pool, 3)
    assert step.result == (3, 2, 1)
    assert step.events == (BlockRemoved((H1,)), BlockRemoved((H1,)))
    # After the first removal block 1 still holds h1: a set-based mirror would have dropped it.
    assert naive_misreads(mirror, step.events) == [H1]
    assert mirror.apply(step.events).matches(step.state.hash_to_blocks)


def test_free_touch_and_lookups_publish_nothing():
    pool = ops.get_new_blocks(ops.new_pool(4), 2).state
    pool = ops.cache_full_blocks(pool, _ids(1), [H1]).state
    assert ops.free_blocks(pool, _ids(1)).events == ()  # a freed block stays cached
    freed = ops.free_blocks(pool, _ids(1)).state
    assert ops.touch(freed, _ids(1)).events == ()
    assert ops.get_cached_block(freed, H1).events == ()
    assert ops.get_num_free_blocks(freed).events == ()


def test_evict_blocks_publishes_for_hashed_blocks_in_the_order_named():
    pool = ops.get_new_blocks(ops.new_pool(5), 3).state
    pool = ops.cache_full_blocks(pool, _ids(1, 3), [H1, H2]).state
    step = ops.evict_blocks(pool, _ids(3, 2, 1))
    assert step.events == (BlockRemoved((H2,)), BlockRemoved((H1,)))


def test_a_reset_publishes_all_blocks_cleared_only_when_it_happens():
    pool = ops.get_new_blocks(ops.new_pool(3), 1).state
    pool = ops.cache_full_blocks(pool, _ids(1), [H1]).state
    assert ops.reset_prefix_cache(pool).events == ()  # refused: block 1 is held
    done = ops.reset_prefix_cache(ops.free_blocks(pool, _ids(1)).state)
    assert done.result is True and done.events == (AllBlocksCleared(),)


# --- the request level ------------------------------------------------------------------------


def _chain(state: m.ManagerState, request: Request) -> tuple[BlockHash, ...]:
    return m.request_block_hashes(state, request)


def test_a_registration_names_its_parent_tokens_and_block_size():
    state = m.new_manager(8, 2)
    r = Request("a", (1, 2, 3, 4, 5, 6, 7))
    h = _chain(state, r)
    first = m.allocate_slots(state, r, 3)  # tokens 0-2: block 0 full
    assert first.events == (BlockStored((h[0],), None, (1, 2), 2, None, (None,), 0),)
    second = m.allocate_slots(first.state, r, 4)  # tokens 3-6: blocks 1 and 2 full
    assert second.events == (BlockStored((h[1], h[2]), h[0], (3, 4, 5, 6), 2, None, (None, None), 0),)
    assert second.state.stats.local.requests == 1  # counted once, at admission


def test_a_hit_publishes_nothing_and_registration_starts_after_it():
    state = m.new_manager(8, 2)
    a = Request("a", (1, 2, 3, 4, 9))
    state = m.free(m.allocate_slots(state, a, 5).state, "a").state
    b = Request("b", (1, 2, 3, 4, 5, 6, 7))
    hit, num = m.get_computed_blocks(state, b).result
    assert num == 4
    step = m.allocate_slots(state, b, 3, num, hit)
    h = _chain(state, b)
    assert step.events == (BlockStored((h[2],), h[1], (5, 6), 2, None, (None,), 0),)


def test_an_allocation_publishes_its_evictions_before_its_registrations():
    state = m.new_manager(3, 2)  # two usable blocks
    state = m.free(m.allocate_slots(state, Request("a", (1, 2, 3, 4)), 4).state, "a").state
    cached = state.pool.hash_to_blocks
    step = m.allocate_slots(state, Request("b", (7, 7, 7, 7)), 4)
    removed = [e for e in step.events if isinstance(e, BlockRemoved)]
    assert step.events[: len(removed)] == tuple(removed) and len(removed) == 2
    assert {k for e in removed for k in e.block_hashes} == {h for h, _ in cached}
    assert isinstance(step.events[-1], BlockStored)


def test_every_group_publishes_its_own_registration_under_its_own_keys():
    state = m.new_manager(12, 2, groups="full,sliding:4")
    r = Request("a", (1, 2, 3, 4, 5))
    h = _chain(state, r)
    step = m.allocate_slots(state, r, 5)
    assert [e.group_idx for e in step.events] == [0, 1]
    assert step.events[1] == BlockStored((group_key(h[0], 1), group_key(h[1], 1)), None, (1, 2, 3, 4), 2,
                                         None, (None, None), 1)  # fmt: skip
    more = m.allocate_slots(step.state, Request("a", (1, 2, 3, 4, 5, 6)), 1)
    assert more.events[1].parent_block_hash == group_key(h[1], 1)


def test_a_registration_publishes_the_extra_keys_untagged():
    image = MultiModalInput("img", 3, 2)
    r = Request("a", (1, 2, 3, 4, 5, 6), lora_name="l", cache_salt="s", mm_inputs=(image,))
    step = m.allocate_slots(m.new_manager(8, 2), r, 6)
    (stored,) = step.events
    assert stored.lora_name == "l"
    # An image's offset is counted from each block's start: negative in a block it began before (as vLLM's).
    assert stored.extra_keys == (("l", "s"), ("l", ("img", 1)), ("l", ("img", -1)))
    assert event_extra_keys([0, 1, 2], 2, "l", [image], "s") == stored.extra_keys


def test_eviction_by_id_at_the_request_level_leaves_a_hole_the_hit_stops_at():
    state = m.new_manager(8, 2)
    a = Request("a", (1, 2, 3, 4, 5, 6, 9))
    state = m.free(m.allocate_slots(state, a, 7).state, "a").state
    hole = state.pool.hash_to_blocks[1][1][0]  # the second block of a's chain
    step = m.evict_blocks(state, [hole])
    assert step.events == (BlockRemoved((_chain(state, a)[1],)),)
    hit, num = m.get_computed_blocks(step.state, Request("b", a.token_ids)).result
    assert num == 2 and len(hit) == 1  # the first block only: the chain has a hole at the second


def test_a_parent_evicted_by_id_while_held_is_an_orphan_but_not_a_broken_rule():
    state = m.new_manager(8, 2)
    r = Request("a", (1, 2, 3, 4, 5))
    state = m.allocate_slots(state, r, 2).state  # block 0 registered and held
    before = EventMirror().apply([BlockStored((_chain(state, r)[0],), None)])
    evicted = m.evict_blocks(state, [state.request("a").tables[0][0]])
    mirror = before.apply(evicted.events)
    step = m.allocate_slots(evicted.state, r, 2)  # block 1 registers, its parent gone
    assert orphaned_stores(mirror, step.events) == list(step.events)
    assert event_parent_known(mirror, step.events, step.state.snapshot())
    check_events(mirror, step.events, step.state.snapshot())


def test_a_cap_on_the_hit_and_a_bad_cap():
    state = m.new_manager(8, 2)
    a = Request("a", (1, 2, 3, 4, 5, 6, 9))
    state = m.free(m.allocate_slots(state, a, 7).state, "a").state
    b = Request("b", a.token_ids)
    assert m.get_computed_blocks(state, b).result[1] == 6
    assert m.get_computed_blocks(state, b, 3).result[1] == 2
    assert m.get_computed_blocks(state, b, 0).result == ((), 0)
    assert m.get_computed_blocks(state, b, 100).result[1] == 6  # never past the last token
    with pytest.raises(InvalidRequest, match=r"^get_computed_blocks: max_cache_hit_length=-1 must be None"):
        m.get_computed_blocks(state, b, -1)


# --- statistics -------------------------------------------------------------------------------


def test_a_request_is_counted_at_admission_with_local_and_external_tokens_apart():
    state = m.new_manager(8, 2)
    state = m.free(m.allocate_slots(state, Request("a", (1, 2, 3, 4, 9)), 5).state, "a").state
    b = Request("b", (1, 2, 3, 4, 5, 6, 7, 8, 9, 10))
    hit, num = m.get_computed_blocks(state, b).result
    assert m.get_computed_blocks(state, b).state.stats == state.stats  # a lookup counts nothing
    step = m.allocate_slots(state, b, 2, num, hit, 2)  # 4 local, 2 external, 2 new
    stats = step.state.stats
    assert stats.local == CacheCounters(requests=2, queries=5 + 10, hits=4)
    assert stats.connector == CacheCounters(requests=2, queries=5 + 6, hits=2)  # asked for what followed the hit
    later = m.allocate_slots(step.state, b, 2)  # a running request's step: not counted again
    assert later.state.stats == stats


def test_a_refused_admission_counts_nothing_and_a_preempted_one_counts_apart():
    state = m.new_manager(3, 2)
    big = Request("big", tuple(range(10)))
    refused = m.allocate_slots(state, big, 10)
    assert refused.result is None and refused.state.stats == state.stats
    state = m.free(m.allocate_slots(state, Request("a", (1, 2, 3)), 3).state, "a").state
    again = Request("a", (1, 2, 3), num_preemptions=1)
    hit, num = m.get_computed_blocks(state, again).result
    stats = m.allocate_slots(state, again, 1, num, hit).state.stats
    assert stats.local == CacheCounters(1, 3, 0, preempted_requests=1, preempted_queries=3, preempted_hits=2)
    with pytest.raises(InvalidRequest, match=r"num_preemptions=-1; it counts the times the scheduler preempted"):
        m.get_computed_blocks(state, Request("c", (1,), num_preemptions=-1))


def test_a_reset_is_recorded_only_when_it_happens():
    state = m.allocate_slots(m.new_manager(4, 2), Request("a", (1, 2, 3)), 3).state
    refused = m.reset_prefix_cache(state)
    assert refused.result is False and refused.state.stats.num_resets == 0 and refused.events == ()
    done = m.reset_prefix_cache(m.free(state, "a").state)
    assert done.result is True and done.state.stats.num_resets == 1 and done.events == (AllBlocksCleared(),)


# --- the rules ----------------------------------------------------------------------------------


def test_the_mirror_rule_catches_a_missing_removal_and_an_extra_store():
    pool = ops.get_new_blocks(ops.new_pool(3), 1).state
    stored = ops.cache_full_blocks(pool, _ids(1), [H1])
    snap = stored.state.snapshot()
    assert event_mirror_exact(EventMirror(), stored.events, snap)
    assert not event_mirror_exact(EventMirror(), stored.events * 2, snap)
    evicted = ops.evict_blocks(stored.state, _ids(1))
    mirror = EventMirror().apply(stored.events)
    assert event_mirror_exact(mirror, evicted.events, evicted.state.snapshot())
    with pytest.raises(InvariantViolation, match="event_mirror_exact"):
        check_events(mirror, (), evicted.state.snapshot())


def test_the_parent_rule_needs_a_full_attention_parent_to_have_been_announced():
    state = m.new_manager(8, 2)
    snap = state.snapshot()
    orphan = BlockStored((H2,), H1, (3, 4), 2, None, (None,), 0)
    assert not event_parent_known(EventMirror(), [orphan], snap)
    announced_then_removed = EventMirror().apply([BlockStored((H1,), None), BlockRemoved((H1,))])
    assert event_parent_known(announced_then_removed, [orphan], snap)
    assert not event_parent_known(announced_then_removed.apply([AllBlocksCleared()]), [orphan], snap)
    # A sliding window's parent is the position before, which that group may never have registered.
    hybrid = m.new_manager(8, 2, groups="full,sliding:4").snapshot()
    assert event_parent_known(EventMirror(), [BlockStored((H2,), H1, group_idx=1)], hybrid)


# --- an asynchronous external load ---------------------------------------------------------------


def test_an_asynchronous_load_takes_blocks_that_no_request_hits_until_it_is_done():
    state = m.new_manager(8, 2)
    r = Request("a", (1, 2, 3, 4, 5, 6, 7))
    h = _chain(state, r)
    loading = m.allocate_slots(state, r, 0, 0, (), 6, True)  # six tokens loaded in the background, none computed
    assert loading.result == (1, 2, 3) and loading.events == () and loading.state.pool.hash_to_blocks == ()
    assert loading.state.stats.connector.hits == 6  # counted at admission, as vLLM's scheduler does
    assert m.get_computed_blocks(loading.state, Request("b", r.token_ids)).result == ((), 0)
    done = m.cache_blocks(loading.state, r, 6)
    assert done.events == (BlockStored((h[0], h[1], h[2]), None, (1, 2, 3, 4, 5, 6), 2, None, (None,) * 3, 0),)
    assert m.get_computed_blocks(done.state, Request("b", r.token_ids)).result[1] == 6
    # A load that failed after 2 tokens: its first block is registered, and the request recomputes from there.
    failed = m.cache_blocks(loading.state, r, 2)
    assert failed.state.request("a").num_computed_tokens == 2
    assert [e.block_hashes for e in failed.events] == [(h[0],)]
    assert m.allocate_slots(failed.state, r, 5).state.request("a").num_computed_tokens == 7


def test_a_delay_needs_an_external_load_and_cache_blocks_a_running_request():
    state = m.new_manager(8, 2)
    r = Request("a", (1, 2, 3, 4, 5))
    with pytest.raises(InvalidRequest, match=r"^allocate_slots: delay_cache_blocks=True but num_external_computed_"):
        m.allocate_slots(state, r, 1, 0, (), 0, True)
    with pytest.raises(InvalidRequest, match=r"^allocate_slots: num_new_tokens=0; a step must schedule"):
        m.allocate_slots(state, r, 0, 0, (), 2, False)
    with pytest.raises(InvalidRequest, match=r"^cache_blocks: request_id='a' is not running"):
        m.cache_blocks(state, r, 0)
    running = m.allocate_slots(state, r, 4).state  # two blocks registered
    with pytest.raises(InvalidRequest, match=r"^cache_blocks: num_computed_tokens=2 but request_id='a' has 4 comp"):
        m.cache_blocks(running, r, 2)  # below what is registered
    with pytest.raises(InvalidRequest, match=r"^cache_blocks: num_computed_tokens=5 but"):
        m.cache_blocks(running, r, 5)  # more than computed
    assert m.cache_blocks(running, r, 4).events == ()  # every full block is registered already
