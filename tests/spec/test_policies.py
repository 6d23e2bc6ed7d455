"""Seed 002's keyed policies: first fit, then the key; the spec's order by hand, the reference's against it."""

from __future__ import annotations

import random
from fractions import Fraction

import pytest

from kvspec.conformance.runner.run import run_check
from kvspec.conformance.targets.builtin import make_reference
from kvspec.conformance.tools.cli import main
from kvspec.reference.block_pool import BlockPool
from kvspec.spec import ops
from kvspec.spec.errors import InvalidRequest
from kvspec.spec.ordering import PROFILES, QUEUE_PROFILES, is_profile, profile_rule
from kvspec.spec.state import BlockHash, BlockId

KEYED = [name for name, rule in PROFILES.items() if rule.keyed] + ["lru-lfu:0.5", "lru-lfu:64"]
H = [BlockHash(b"h%d" % i) for i in range(8)]


def _ids(*ids: int) -> list[BlockId]:
    return [BlockId(b) for b in ids]


def _run(profile: str, calls: list[tuple[str, tuple]]) -> tuple[int, ...]:
    """Apply calls to a fresh 8-block spec pool; its free queue."""
    state = ops.new_pool(8, True, profile)
    for op, args in calls:
        state = getattr(ops, op)(state, *args).state
    return state.free_queue


def test_profile_names_parse_and_bad_ones_are_refused_with_the_known_list():
    assert profile_rule("lru-lfu:0.25").weight == Fraction(1, 4)
    assert set(QUEUE_PROFILES) == {"vllm-v1", "vllm-v1-tail"}
    # "lru-lfu:\u0b66" (an Oriya zero) is what CrossHair found: str.isdigit() accepts it
    for bad in ("lru-lfu:", "lru-lfu:-1", "lru-lfu:1e3", "lru-lfu:x", "lru-lfu:\u0b66", "lru-lfu:1.2.3", "mru", ""):
        assert not is_profile(bad)
        with pytest.raises(ValueError, match="profile"):
            profile_rule(bad)
    with pytest.raises(InvalidRequest, match="lru-lfu:W"):
        ops.new_pool(4, True, "lru-lfu:abc")
    with pytest.raises(InvalidRequest, match="lru-lfu:W"):
        BlockPool(4, True, "fifo")


# A request of three blocks, registered and freed tail first, then a second of two that is hit once.
_REQUESTS = [
    ("get_new_blocks", (3,)),
    ("cache_full_blocks", (_ids(1, 2, 3), H[:3])),
    ("free_blocks", (_ids(3, 2, 1),)),
    ("get_new_blocks", (2,)),  # first fit: 4 and 5, no cached block evicted
    ("cache_full_blocks", (_ids(4, 5), H[3:5])),
    ("free_blocks", (_ids(5, 4),)),
    ("touch", (_ids(1),)),  # a hit on request one's head
    ("free_blocks", (_ids(1),)),
]


@pytest.mark.parametrize(
    ("profile", "expected"),
    [
        # the oldest last access first: the tail-first frees put each request deepest first
        ("lru-timestamp", (6, 7, 3, 2, 5, 4, 1)),
        # the oldest registration first, the newest content kept: a request's head goes before its tail
        ("block-age", (6, 7, 1, 2, 3, 4, 5)),
        # fewest accesses first (block 1 has two), ties by last access
        ("lfu", (6, 7, 3, 2, 5, 4, 1)),
        # lru-lfu:64: an access is worth 64 ticks, so block 1 outlives everything as under lfu
        ("lru-lfu:64", (6, 7, 3, 2, 5, 4, 1)),
        # vLLM v1 for comparison: hashed blocks in free order, at the right end
        ("vllm-v1", (6, 7, 3, 2, 5, 4, 1)),
    ],
)
def test_each_policy_orders_the_free_blocks_as_documented(profile, expected):
    assert _run(profile, _REQUESTS) == expected


# Request one's three blocks cached and freed; then request two's two, freed with evict_first (vLLM 0.34.0 on).
_EVICT_FIRST = [
    *_REQUESTS[:3],
    ("get_new_blocks", (2,)),
    ("cache_full_blocks", (_ids(4, 5), H[3:5])),
    ("free_blocks", (_ids(5, 4), True)),
]


@pytest.mark.parametrize(
    ("profile", "expected"),
    [
        # vLLM v1: to the left end, in the order given, ahead of the blocks free before
        ("vllm-v1", (5, 4, 6, 7, 3, 2, 1)),
        ("vllm-v1-tail", (5, 4, 6, 7, 3, 2, 1)),
        # keyed: after first fit (6, 7), before every cached block freed without it, by the policy's own key
        ("lru-timestamp", (6, 7, 5, 4, 3, 2, 1)),
        ("block-age", (6, 7, 4, 5, 1, 2, 3)),
        ("lfu", (6, 7, 5, 4, 3, 2, 1)),
    ],
)
def test_blocks_freed_with_evict_first_go_before_every_other_cached_block(profile, expected):
    assert _run(profile, _EVICT_FIRST) == expected
    reference = BlockPool(8, True, profile)
    for op, args in _EVICT_FIRST:
        getattr(reference, op)(*args)
    assert tuple(b.block_id for b in reference.free_block_queue) == expected


def test_lfu_keeps_a_frequently_hit_block_that_lru_evicts():
    calls = [
        ("get_new_blocks", (2,)),
        ("cache_full_blocks", (_ids(1, 2), H[:2])),
        ("free_blocks", (_ids(2, 1),)),
        ("touch", (_ids(1),)),
        ("free_blocks", (_ids(1),)),
        ("touch", (_ids(1),)),
        ("free_blocks", (_ids(1),)),
        ("touch", (_ids(2),)),
        ("free_blocks", (_ids(2),)),
    ]
    assert _run("lru-timestamp", calls)[-2:] == (1, 2)  # 2 was used last
    assert _run("lfu", calls)[-2:] == (2, 1)  # 1 was used three times, 2 twice
    assert _run("lru-lfu:0", calls)[-2:] == (1, 2)  # weight 0 is LRU
    assert _run("lru-lfu:64", calls)[-2:] == (2, 1)


def test_first_fit_reuses_the_lowest_free_id_before_evicting_and_evict_blocks_returns_a_block_to_it():
    state = ops.new_pool(6, True, "lru-timestamp")
    taken = ops.get_new_blocks(state, 3)
    state = ops.cache_full_blocks(taken.state, _ids(2), H[:1]).state
    state = ops.free_blocks(state, _ids(3, 2, 1)).state
    assert state.free_queue == (1, 3, 4, 5, 2)  # unhashed by id, then the cached block
    state = ops.evict_blocks(state, _ids(2)).state
    assert state.free_queue == (1, 2, 3, 4, 5)
    assert ops.get_new_blocks(state, 2).result == (1, 2)


def _random_calls(rng: random.Random, steps: int, profile: str) -> list[tuple[str, tuple]]:
    held: list[int] = []  # one entry per reference
    hashed: set[int] = set()
    calls: list[tuple[str, tuple]] = []
    pool = ops.new_pool(10, True, profile)
    for _ in range(steps):
        kind = rng.random()
        if kind < 0.35 and len(pool.free_queue):
            call = ("get_new_blocks", (rng.randint(1, min(3, len(pool.free_queue))),))
        elif kind < 0.55 and held:
            unhashed = [b for b in set(held) if b not in hashed]
            if not unhashed:
                continue
            block = rng.choice(unhashed)
            call = ("cache_full_blocks", ([BlockId(block)], [BlockHash(b"x%d" % rng.randint(0, 99))]))
        elif kind < 0.7 and hashed:
            call = ("touch", ([BlockId(rng.choice(sorted(hashed)))],))
        elif kind < 0.95 and held:
            chosen = rng.sample(sorted(set(held)), rng.randint(1, len(set(held))))
            call = ("free_blocks", ([BlockId(b) for b in chosen],))
        else:
            call = ("evict_blocks", ([BlockId(rng.randint(1, 9))],))
        step = getattr(ops, call[0])(pool, *call[1])
        if call[0] == "get_new_blocks":
            held += list(step.result)
        elif call[0] == "touch":
            held += list(call[1][0])
        elif call[0] == "free_blocks":
            for b in call[1][0]:
                held.remove(b)
        pool = step.state
        hashed = {b for b, h in enumerate(pool.block_hash) if h is not None}
        calls.append(call)
    return calls


@pytest.mark.parametrize("profile", KEYED)
def test_the_reference_keeps_the_spec_order_through_many_lazy_deletions(profile):
    # Far more hits on free blocks than live entries, so the heap is rebuilt many times.
    rng = random.Random(profile)
    calls = _random_calls(rng, 3000, profile)
    state, pool = ops.new_pool(10, True, profile), BlockPool(10, True, profile)
    for i, (op, args) in enumerate(calls):
        state = getattr(ops, op)(state, *args).state
        getattr(pool, op)(*args)
        assert pool.snapshot().free_queue == state.free_queue, f"after call {i}: {op}{args}"
    pool.check_invariants()


# The spec run as an implementation only passes the profile through to itself: its campaigns are the heavy
# run's (KVSPEC_SLOW=1); the reference and gpu_impl, the implementations of the keyed policies, run by default.
@pytest.mark.heavy
@pytest.mark.parametrize("impl", ["reference", "gpu", pytest.param("spec", marks=pytest.mark.slow)])
@pytest.mark.parametrize("profile", ["lru-timestamp", "block-age", "lfu", "lru-lfu:0.5"])
def test_kvspec_check_conforms_for_every_builtin_implementation(profile, impl, tmp_path):
    if impl == "gpu":
        gpu = pytest.importorskip("kvspec.gpu_impl.adapter", reason="gpu_impl needs torch (the gpu extra)")
        impl = gpu.make_adapter
    for level in ("pool", "manager"):
        # Rounds while a branch is unreached: a delayed external load that registers a block is rare.
        result = run_check(impl, level=level, profile=profile, max_examples=100, cover_rounds=10, seed=0,
                           trace_dir=tmp_path)  # fmt: skip
        assert result.verdict == "conforms", (impl, level, result.message)
        assert result.steps_run > 0


def _queue_policies_only(config):
    return make_reference(config)


_queue_policies_only.profiles = QUEUE_PROFILES  # a declared fact: the other profiles are not built


@pytest.mark.heavy
def test_a_profile_an_implementation_does_not_declare_is_na_never_run():
    result = run_check(_queue_policies_only, level="pool", profile="lfu", max_examples=5, seed=0)
    assert result.verdict == "n/a" and "profiles=('vllm-v1', 'vllm-v1-tail')" in result.message
    assert result.steps_run == 0
    assert run_check(_queue_policies_only, level="pool", profile="vllm-v1", max_examples=100, seed=0).verdict == (
        "conforms"
    )


def test_the_cli_names_the_weighted_form_for_a_bad_profile(capsys):
    assert main(["check", "--impl", "reference", "--profile", "lru-lfu:fast"]) == 2
    err = capsys.readouterr().err
    assert "lru-lfu:W" in err and "Traceback" not in err


# --- each break `kvspec prove` reports, on a concrete run of the spec ------------------------------
# A request's blocks 1 (the ancestor) and 2 (the deeper one), registered in table order.
CHAIN = [("get_new_blocks", (2,)), ("cache_full_blocks", (_ids(1, 2), H[:2]))]


def _hits(block: int, times: int) -> list[tuple[str, tuple]]:
    """`times` more requests hit the block and finish."""
    return [call for _ in range(times) for call in (("touch", (_ids(block),)), ("free_blocks", (_ids(block),)))]


def _evicted_first(profile: str, calls: list[tuple[str, tuple]], a: int, b: int) -> bool:
    queue = _run(profile, calls)
    return queue.index(a) < queue.index(b)


@pytest.mark.parametrize(("profile", "deeper_first"), [("lru-timestamp", True), ("block-age", False)])
def test_lemma_1_a_tail_first_free_under_block_age_keeps_the_deeper_block(profile, deeper_first):
    calls = [*CHAIN, ("free_blocks", (_ids(2, 1),))]
    assert _evicted_first(profile, calls, 2, 1) == deeper_first


@pytest.mark.parametrize(("profile", "deeper_first"), [("lru-timestamp", True), ("lfu", False), ("lru-lfu:0.5", False)])
def test_lemma_1_under_lfu_a_deeper_block_hit_more_often_outlives_its_ancestor(profile, deeper_first):
    # the deeper block is hit three more times while the request holds both (a pool-level caller may)
    calls = [*CHAIN, *_hits(2, 3), ("free_blocks", (_ids(2, 1),))]
    assert _evicted_first(profile, calls, 2, 1) == deeper_first


@pytest.mark.parametrize(("profile", "touched_last"), [("lru-timestamp", True), ("lfu", False), ("block-age", False)])
def test_lemma_4_a_touched_block_freed_again_is_not_the_last_to_go_under_lfu_or_block_age(profile, touched_last):
    # block 2 is registered last and hit often; then block 1 is hit and freed again
    calls = [*CHAIN, *_hits(2, 3), ("free_blocks", (_ids(2, 1),)), *_hits(1, 1)]
    assert _evicted_first(profile, calls, 2, 1) == touched_last


@pytest.mark.parametrize(("profile", "fewer_first"), [("lfu", True), ("lru-timestamp", False), ("lru-lfu:0.5", False)])
def test_lemma_8_fewer_accesses_go_first_only_under_lfu(profile, fewer_first):
    # block 2 is hit twice (three accesses) and freed; then block 1 (one access) is freed, more recently
    calls = [*CHAIN, ("touch", (_ids(2),)), ("touch", (_ids(2),)), *[("free_blocks", (_ids(2),))] * 3]
    calls.append(("free_blocks", (_ids(1),)))
    assert _evicted_first(profile, calls, 1, 2) == fewer_first
