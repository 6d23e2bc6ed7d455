"""gpu_impl's asynchronous external load: named scenarios with the exact blocks, events and KV.

A first step with external tokens may load them in the background
(`allocate_slots(..., delay_cache_blocks=True)`): the blocks are taken and
the loaded tokens' KV written, but nothing is registered, so no request hits
them before `cache_blocks` reports the load done. Each scenario runs the
spec beside gpu_impl and requires the same result, events, snapshot and hit
statistics after every call; on top of that it reads the KV memory: a hit
on blocks registered by `cache_blocks` reads back its own prefix, a failed
load's tokens after its valid prefix are cleared and written again when
recomputed, and no null position is ever written. The caller mistakes of the
two new arguments are refused with the spec's error and message, nothing
changed. The lock-step machine (test_manager_lockstep) draws the same on
random traffic.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from kvspec.conformance.core.adapter import AdapterConfig
from kvspec.conformance.targets.builtin import SpecManagerAdapter
from kvspec.gpu_impl.device import pick_device
from kvspec.gpu_impl.kv_cache_manager import TensorKVCacheManager, prefix_kv_source
from kvspec.spec.errors import BlockManagerError, InvalidRequest
from kvspec.spec.events import BlockStored
from kvspec.spec.hashing import hash_request_blocks
from kvspec.spec.invariants import hit_content_intact
from kvspec.spec.manager import Request
from kvspec.spec.state import NULL_BLOCK_ID
from kvspec.spec.stats import CacheCounters


class Both:
    """gpu_impl and the spec built alike (events on), every call made on both and compared."""

    def __init__(self, num_gpu_blocks: int, block_size: int, groups: str = "full", enable_caching: bool = True):
        self.gpu = TensorKVCacheManager(
            num_gpu_blocks, block_size, enable_caching, device=pick_device(), groups=groups,
            enable_kv_cache_events=True,
        )  # fmt: skip
        self.spec = SpecManagerAdapter(
            AdapterConfig("manager", num_gpu_blocks, enable_caching, "vllm-v1", block_size, groups=groups, events=True)
        )
        self.events: list[Any] = []  # what the last call published

    def __call__(self, op: str, *args: Any) -> Any:
        got, want = getattr(self.gpu, op)(*args), getattr(self.spec, op)(*args)
        assert got == want, f"{op}{args}: gpu_impl gave {got}, the spec {want}"
        self.events = self.gpu.take_events()
        assert self.events == self.spec.take_events(), f"{op}{args}: events differ"
        assert self.gpu.snapshot() == self.spec.snapshot(), f"{op}{args}: snapshots differ"
        assert self.gpu.prefix_cache_stats() == self.spec.prefix_cache_stats()
        self.gpu.check_invariants()
        for g, kv in enumerate(self.gpu.kv_caches):
            assert not bool(kv.kv[NULL_BLOCK_ID].any()), f"{op}{args} wrote group {g}'s KV into the null block"
        return got

    def kv(self, request_id: str, start: int, end: int, group_id: int = 0) -> list[int]:
        """A running request's KV of positions [start, end) in one group, read through its block table."""
        table = self.gpu._table(self.gpu.block_table(request_id, group_id))
        values: list[int] = self.gpu.kv_caches[group_id].read_tokens(table, start, end).tolist()
        return values

    def hit_reads_its_own_prefix(self, request: Request) -> tuple[list[int], int]:
        """Look a new request up; every non-null hit block reads back its own prefix's KV (hit_content_intact)."""
        hit, num_tokens = self("get_computed_blocks", request)
        bs, pages = self.gpu.block_size, self.gpu.read_kv(hit)
        n = len(hit) // len(self.gpu.groups) if hit else 0
        for j, (b, page) in enumerate(zip(hit, pages)):
            i = j % n
            expected = [] if b == NULL_BLOCK_ID else prefix_kv_source(request, i * bs, (i + 1) * bs)
            assert hit_content_intact(expected, page), f"hit block {b} of {request} reads other KV"
        return hit, num_tokens


A = Request("a", (1, 2, 3, 4, 5, 6, 7))
H0, H1, H2 = hash_request_blocks(A.token_ids, 2)


def test_a_delayed_load_is_hit_only_after_cache_blocks_and_reads_what_the_load_wrote():
    m = Both(8, 2)
    assert m("allocate_slots", A, 0, 0, [], 6, True) == [1, 2, 3]  # six tokens loaded in the background
    assert m.events == []  # nothing registered, so nothing published
    # Counted at admission, the loaded tokens as the connector's hits (as vLLM's scheduler does).
    assert m.gpu.prefix_cache_stats().connector == CacheCounters(1, 7, 6)
    assert m.kv("a", 0, 6) == prefix_kv_source(A, 0, 6)  # the load's writes are in the slots
    assert m.hit_reads_its_own_prefix(Request("b", A.token_ids)) == ([], 0)  # not before the load is done
    m("cache_blocks", A, 6)
    assert m.events == [BlockStored((H0, H1, H2), None, (1, 2, 3, 4, 5, 6), 2, None, (None,) * 3, 0)]
    assert m.hit_reads_its_own_prefix(Request("b", A.token_ids)) == ([1, 2, 3], 6)
    assert m("allocate_slots", A, 1) == [4]  # the last prompt token: no new full block
    assert m.events == []


def test_the_blocks_are_sealed_when_cache_blocks_registers_them():
    m = Both(8, 2)
    m("allocate_slots", A, 0, 0, [], 6, True)
    m("cache_blocks", A, 6)
    m.gpu.kv_cache.inject_bit_flip(2, 0, 3)  # the second loaded block changes after it was registered
    assert m.gpu.get_computed_blocks(Request("b", A.token_ids)) == ([1], 2)  # caught: the hit stops before it
    assert m.gpu.snapshot().quarantined == ()  # still held by "a": retired when it frees it
    m.gpu.free("a")
    assert m.gpu.snapshot().quarantined == (2,)


def test_a_failed_load_keeps_its_valid_prefix_and_the_rest_is_written_again():
    m = Both(8, 2)
    asked: list[tuple[int, int]] = []  # the positions each write asks the KV source for

    def source(request: Request, start: int, end: int) -> list[int]:
        asked.append((start, end))
        return prefix_kv_source(request, start, end)

    m.gpu.set_kv_source(source)
    m("allocate_slots", A, 0, 0, [], 6, True)
    m("cache_blocks", A, 3)  # the load delivered 3 of its 6 tokens: block 0 is whole
    assert m.events == [BlockStored((H0,), None, (1, 2), 2, None, (None,), 0)]
    assert m.spec.snapshot() == m.gpu.snapshot() and m.gpu.num_computed_tokens["a"] == 3
    # What the load did not deliver reads as no prefix's value; what it did is kept.
    assert m.kv("a", 0, 6) == [*prefix_kv_source(A, 0, 3), 0, 0, 0]
    assert m.hit_reads_its_own_prefix(Request("b", A.token_ids)) == ([1], 2)
    assert m("allocate_slots", A, 4) == [4]  # tokens 4 to 7 computed again, into blocks 2, 3 and a new one
    assert asked[-1] == (3, 7)
    assert m.events == [BlockStored((H1, H2), H0, (3, 4, 5, 6), 2, None, (None, None), 0)]
    assert m.kv("a", 0, 7) == prefix_kv_source(A, 0, 7)
    assert m.hit_reads_its_own_prefix(Request("c", A.token_ids)) == ([1, 2, 3], 6)


def test_a_delayed_load_under_a_sliding_window_registers_and_recomputes_as_the_spec():
    m = Both(16, 2, "full,sliding:4")
    a = Request("a", tuple(range(1, 10)))
    # Eight tokens loaded: the window (3 tokens back from token 8) leaves group 1 two null positions.
    assert m("allocate_slots", a, 0, 0, [], 8, True) == [1, 2, 3, 4, 5, 6]
    assert m.gpu.block_table("a", 1) == [NULL_BLOCK_ID, NULL_BLOCK_ID, 5, 6]
    assert m.events == []
    m("cache_blocks", a, 6)  # failed after 6: registered are what some group counts, at least 4 tokens
    assert [(e.group_idx, len(e.block_hashes)) for e in m.events] == [(0, 3), (1, 1)]
    assert m.kv("a", 4, 8, 1) == [*prefix_kv_source(a, 4, 6), 0, 0]
    assert m("allocate_slots", a, 3) == [7, 8]
    assert [(e.group_idx, len(e.block_hashes)) for e in m.events] == [(0, 1), (1, 1)]
    assert m.kv("a", 4, 9, 1) == prefix_kv_source(a, 4, 9)
    assert m.hit_reads_its_own_prefix(Request("b", a.token_ids)) == ([1, 2, 3, 4, 0, 0, 5, 6], 8)


def test_a_step_after_a_delayed_load_that_computed_tokens_registers_around_the_null_positions():
    # The delayed step computes 5 tokens past the loaded one and registers nothing; the next step's window
    # frees five of group 1's blocks, so the blocks it registers there start after five null positions.
    m = Both(24, 1, "full,sliding:2")
    a = Request("a", tuple(range(1, 11)))
    assert m("allocate_slots", a, 5, 0, [], 1, True) == [1, 3, 4, 5, 6, 7, 2, 8, 9, 10, 11, 12]
    assert m("allocate_slots", a, 1) == [11, 10]
    assert m.gpu.block_table("a", 1) == [NULL_BLOCK_ID] * 5 + [12, 10]
    assert [(e.group_idx, len(e.block_hashes)) for e in m.events] == [(0, 7), (1, 2)]
    assert m.events[1].extra_keys == (None, None)  # the registered positions' keys only, as the spec's
    hit = [1, 3, 4, 5, 6, 7, 11, *[NULL_BLOCK_ID] * 6, 10]
    assert m.hit_reads_its_own_prefix(Request("b", a.token_ids)) == (hit, 7)


def test_a_count_taken_back_past_the_window_never_writes_a_null_position():
    # Caching off registers nothing, so cache_blocks may take a request back to its first token even though
    # its window slid past five positions: recomputing them writes group 0 and nothing of group 1's nulls.
    m = Both(24, 1, "full,sliding:2", enable_caching=False)
    a = Request("a", tuple(range(1, 11)))
    m("allocate_slots", a, 6)
    m("allocate_slots", a, 1)
    m("cache_blocks", a, 0)
    assert m.kv("a", 0, 7) == [0] * 7
    assert m("allocate_slots", a, 3) == []
    assert m.kv("a", 0, 3) == prefix_kv_source(a, 0, 3)
    assert m.gpu.block_table("a", 1) == [NULL_BLOCK_ID] * 5 + [12, 10]
    assert m("allocate_slots", a, 4) == []  # tokens 3 to 7: group 1 writes only past its null positions
    assert m.kv("a", 5, 7, 1) == prefix_kv_source(a, 5, 7)


# --- caller mistakes -------------------------------------------------------------------------------------


def _refused_as_the_spec(op: str, *args: Any, match: str) -> None:
    """The call raises the spec's error type and message, an InvalidRequest matching `match`; nothing changes.

    The state: "a" runs with its 3 tokens (block 0 registered), "l" loads 3 tokens in the background.
    """
    m = Both(8, 2)
    m("allocate_slots", Request("a", (1, 2, 3)), 3)
    m("allocate_slots", Request("l", (7, 8, 9, 9)), 0, 0, [], 3, True)
    before, stats = m.gpu.snapshot(), m.gpu.prefix_cache_stats()
    with pytest.raises(BlockManagerError) as want:
        getattr(m.spec, op)(*args)
    with pytest.raises(InvalidRequest, match=match) as got:
        getattr(m.gpu, op)(*args)
    assert type(got.value) is type(want.value) and str(got.value) == str(want.value)
    assert m.gpu.snapshot() == before and m.gpu.prefix_cache_stats() == stats and m.gpu.take_events() == []
    assert m.gpu.num_computed_tokens == {"a": 3, "l": 3}


R = Request("r", (1, 2, 3))


@pytest.mark.parametrize("delay", [1, 0, None, "yes", 1.0])
def test_a_delay_that_is_no_bool_is_refused(delay):
    message = rf"^allocate_slots: delay_cache_blocks must be a bool; got {re.escape(repr(delay))}$"
    _refused_as_the_spec("allocate_slots", R, 1, 0, [], 1, delay, match=message)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((R, 1, 0, [], 0, True), r"^allocate_slots: delay_cache_blocks=True but num_external_computed_tokens=0; "),
        ((R, 0, 0, [], 0, True), r"^allocate_slots: delay_cache_blocks=True but num_external_computed_tokens=0; "),
        ((R, 0, 0, [], 2, False), r"^allocate_slots: num_new_tokens=0; a step must schedule at least one token$"),
        ((R, -1, 0, [], 0, True), r"^allocate_slots: num_new_tokens must be a non-negative integer"),  # counts first
        ((Request("", (1,)), 1, 0, [], 0, 1), r"^allocate_slots: request_id='' must be a non-empty string$"),
        ((Request("a", (1, 2, 3)), 0, 0, [], 1, True), r"^allocate_slots: request_id='a' is running; prefix hits"),
    ],
    ids=["without-external", "nothing-scheduled", "no-token-no-delay", "bad-count", "no-id", "running"],
)
def test_a_delay_needs_external_tokens_on_a_first_step_and_no_token_needs_a_delay(args, message):
    _refused_as_the_spec("allocate_slots", *args, match=message)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((Request("x", (1,)), 0), r"^cache_blocks: request_id='x' is not running$"),
        ((Request("x", (1,)), -1), r"^cache_blocks: request_id='x' is not running$"),  # the request first
        ((Request("", (1,)), 0), r"^cache_blocks: request_id='' must be a non-empty string$"),
        ((Request("a", ()), 3), r"^cache_blocks: request_id='a' has no tokens; a request needs a prompt$"),
        ((Request("a", (1, 2, 3)), 1), r"^cache_blocks: num_computed_tokens=1 but request_id='a' has 3 computed "
         r"tokens, 2 of them registered$"),
        ((Request("a", (1, 2, 3)), 4), r"^cache_blocks: num_computed_tokens=4 but request_id='a' has 3 computed"),
        ((Request("l", (7, 8, 9, 9)), 4), r"^cache_blocks: num_computed_tokens=4 but request_id='l' has 3 comp"),
        ((Request("l", (7, 8, 9, 9)), -1), r"^cache_blocks: num_computed_tokens=-1 but"),
        ((Request("l", (7, 8, 9, 9)), True), r"^cache_blocks: num_computed_tokens=True but"),
        ((Request("l", (7, 8, 9, 9)), 2.0), r"^cache_blocks: num_computed_tokens=2.0 but"),
        ((Request("l", (7, 8, 9, 9)), None), r"^cache_blocks: num_computed_tokens=None but"),
    ],
    ids=[
        "not-running", "not-running-first", "no-id", "no-tokens", "below-registered", "above-computed",
        "above-loaded", "negative", "bool", "float", "none",
    ],
)  # fmt: skip
def test_cache_blocks_on_a_request_not_running_or_with_a_count_out_of_range_is_refused(args, message):
    _refused_as_the_spec("cache_blocks", *args, match=message)
