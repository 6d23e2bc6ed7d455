"""A request's prefix-cache hit limit, get_num_cached_tokens, and which admissions the local statistics count.

Scenario tests with explicit steps and exact answers (as vLLM 0.34's
`Request.get_max_cache_hit_length`, `KVCacheManager.get_num_cached_tokens`
and `record_prefix_cache_stats` give them), the same scenario run on the
spec, the reference and gpu_impl.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvspec.gpu_impl.kv_cache_manager import TensorKVCacheManager
from kvspec.reference import KVCacheManager as ReferenceManager
from kvspec.spec import manager as m
from kvspec.spec.errors import InvalidRequest
from kvspec.spec.manager import Request
from kvspec.spec.stats import CacheCounters

A = (1, 2, 3, 4, 5, 6, 9)  # three full blocks of 2, then one token


def _cached(enable_caching: bool = True) -> m.ManagerState:
    """Block size 2, 8 blocks; request a ran `A` and finished, its three full blocks cached and free."""
    state = m.new_manager(8, 2, enable_caching)
    return m.free(m.allocate_slots(state, Request("a", A), len(A)).state, "a").state


def test_the_hit_limit_caps_the_hit_and_a_limit_of_0_skips_the_lookup():
    state = _cached()
    assert m.get_computed_blocks(state, Request("b", A)).result == ((1, 2, 3), 6)
    assert m.get_computed_blocks(state, Request("b", A, prefix_cache_hit_limit=5)).result == ((1, 2), 4)
    assert m.get_computed_blocks(state, Request("b", A, prefix_cache_hit_limit=100)).result[1] == 6  # len - 1
    # the request's limit and the scheduler's cap: the lower one holds
    assert m.get_computed_blocks(state, Request("b", A, prefix_cache_hit_limit=5), 2).result == ((1,), 2)
    assert m.get_computed_blocks(state, Request("b", A, prefix_cache_hit_limit=0)).result == ((), 0)
    assert not m.lookup_enabled(state, Request("b", A, prefix_cache_hit_limit=0))
    assert m.lookup_enabled(state, Request("b", A, prefix_cache_hit_limit=2))


def test_a_bad_hit_limit_is_refused_by_every_request_level_operation():
    state = _cached()
    bad = Request("b", A, prefix_cache_hit_limit=-1)
    for call in (lambda: m.get_computed_blocks(state, bad), lambda: m.get_num_cached_tokens(state, bad),
                 lambda: m.allocate_slots(state, bad, 1)):  # fmt: skip
        with pytest.raises(InvalidRequest, match=r"^\w+: request_id='b' has prefix_cache_hit_limit=-1; it is None"):
            call()


def test_get_num_cached_tokens_probes_without_a_change_and_ignores_a_limit_other_than_0():
    state = _cached()
    step = m.get_num_cached_tokens(state, Request("b", A))
    assert (step.result, step.state, step.events) == (6, state, ())
    # NOTE: vLLM 0.34 bounds the probe by len - 1 alone: a limit of 2 tokens still reads 6 cached
    assert m.get_num_cached_tokens(state, Request("b", A, prefix_cache_hit_limit=2)).result == 6
    assert m.get_num_cached_tokens(state, Request("b", A, prefix_cache_hit_limit=0)).result == 0
    assert m.get_num_cached_tokens(state, Request("b", A[:3])).result == 2  # one token held back: one block
    assert m.get_num_cached_tokens(_cached(enable_caching=False), Request("b", A)).result == 0
    running = m.allocate_slots(state, Request("b", A), len(A)).state
    assert m.get_num_cached_tokens(running, Request("b", A)).result == 6  # a running request may be probed


def test_only_a_request_whose_lookup_ran_is_counted_locally_the_connector_counts_every_admission():
    state = _cached()
    skipping = Request("b", A, prefix_cache_hit_limit=0)
    stats = m.allocate_slots(state, skipping, 5, 0, (), 2).state.stats
    assert stats.local == CacheCounters(requests=1, queries=7)  # a's admission only
    assert stats.connector == CacheCounters(requests=2, queries=7 + 7, hits=2)
    limited = Request("c", A, prefix_cache_hit_limit=4)
    hit, num = m.get_computed_blocks(state, limited).result
    assert m.allocate_slots(state, limited, 3, num, hit).state.stats.local == CacheCounters(2, 14, 4)
    off = m.new_manager(8, 2, enable_caching=False)
    off_stats = m.allocate_slots(off, Request("a", A), len(A)).state.stats
    assert off_stats.local == CacheCounters() and off_stats.connector == CacheCounters(requests=1, queries=7)


def _run(manager: Any) -> list[Any]:
    """The hit-limit scenario on an implementation: every answer and its statistics."""
    manager.allocate_slots(Request("a", A), len(A))
    manager.free("a")
    out: list[Any] = []
    for limit in (None, 5, 0):
        request = Request(f"r{limit}", A, prefix_cache_hit_limit=limit)
        out += [manager.get_computed_blocks(request), manager.get_num_cached_tokens(request)]
    hit, num = manager.get_computed_blocks(Request("c", A, prefix_cache_hit_limit=5))
    manager.allocate_slots(Request("c", A, prefix_cache_hit_limit=5), len(A) - num, num, hit)
    manager.allocate_slots(Request("d", A, prefix_cache_hit_limit=0), 1)
    with pytest.raises(InvalidRequest, match=r"prefix_cache_hit_limit=-1"):
        manager.get_num_cached_tokens(Request("e", A, prefix_cache_hit_limit=-1))
    return [*out, manager.prefix_cache_stats()]


def test_the_reference_and_gpu_impl_give_the_spec_s_answers():
    state = _cached()
    want: list[Any] = []
    for limit in (None, 5, 0):
        request = Request(f"r{limit}", A, prefix_cache_hit_limit=limit)
        blocks, num = m.get_computed_blocks(state, request).result
        want += [(list(blocks), num), m.get_num_cached_tokens(state, request).result]
    c = Request("c", A, prefix_cache_hit_limit=5)
    blocks, num = m.get_computed_blocks(state, c).result
    state = m.allocate_slots(state, c, len(A) - num, num, blocks).state
    state = m.allocate_slots(state, Request("d", A, prefix_cache_hit_limit=0), 1).state
    want.append(state.stats)
    assert want[:6] == [([1, 2, 3], 6), 6, ([1, 2], 4), 6, ([], 0), 0]
    assert _run(ReferenceManager(8, 2)) == want
    assert _run(TensorKVCacheManager(8, 2, device="cpu")) == want
