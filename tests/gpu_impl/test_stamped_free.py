"""gpu_impl under seed 002's keyed policies: named scenarios with exact ids, the exact fallback, its own checks.

The lock-step machines (test_pool_lockstep, test_manager_lockstep) compare it
with the reference on random operations under every policy; these state the
order outright and check what only the stamped free blocks have.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvspec.gpu_impl.block_pool import TensorBlockPool
from kvspec.gpu_impl.device import pick_device
from kvspec.gpu_impl.stamped_free import (
    StampedFreeBlocks,
    _ascending,
    field_offsets,
    field_widths,
    join_int64_groups,
    pack,
)
from kvspec.spec import ops
from kvspec.spec.ordering import PY, eviction_key, profile_rule
from kvspec.spec.state import BlockHash

H = [BlockHash(bytes([i]) * 8) for i in range(8)]


def _both(
    profile: str,
    calls: list[tuple[str, tuple]],
    n: int = 8,
    prepare: Callable[[TensorBlockPool], None] | None = None,
    **kwargs: object,
) -> TensorBlockPool:
    """Apply calls to gpu_impl (after `prepare`, if given) and the spec; gpu_impl after checking, at every
    step, the same result, the same snapshot and gpu_impl's own invariants."""
    gpu = TensorBlockPool(n, profile=profile, device=pick_device(), **kwargs)  # type: ignore[arg-type]
    if prepare is not None:
        prepare(gpu)
    state = ops.new_pool(n, True, profile)
    for op, args in calls:
        got = getattr(gpu, op)(*args)
        step = getattr(ops, op)(state, *args)
        state = step.state
        assert got == (list(step.result) if isinstance(step.result, tuple) else step.result), (op, args)
        assert gpu.snapshot() == state.snapshot(), (op, args)
        gpu.check_invariants()
    return gpu


# One request of three blocks, two of them cached, freed tail first; then another
# request hits the first block and frees it: every policy orders the free blocks.
LIFE = [
    ("get_new_blocks", (3,)),
    ("cache_full_blocks", ([1, 2], H[:2])),
    ("free_blocks", ([3, 2, 1],)),
    ("touch", ([1],)),
    ("free_blocks", ([1],)),
]


@pytest.mark.parametrize(
    ("profile", "free_queue"),
    [
        # first fit: 3 (no hash) then 4..7 by id; then the hashed blocks by key
        ("lru-timestamp", (3, 4, 5, 6, 7, 2, 1)),  # 2 was last read by the free, 1 by the later hit's free
        ("block-age", (3, 4, 5, 6, 7, 1, 2)),  # 1 was registered before 2
        ("lfu", (3, 4, 5, 6, 7, 2, 1)),  # 2 was accessed once, 1 twice
        ("lru-lfu:0.5", (3, 4, 5, 6, 7, 2, 1)),
    ],
)
def test_a_request_life_leaves_the_free_blocks_in_the_policy_order(profile, free_queue):
    gpu = _both(profile, LIFE)
    assert gpu.snapshot().free_queue == free_queue


@pytest.mark.parametrize("python_path_max", [None, 0])
def test_a_take_uses_first_fit_before_it_evicts_and_evicts_by_key(python_path_max):
    gpu = _both("lfu", LIFE, python_path_max=python_path_max)
    # the five free blocks without a hash by id, then 2 (one access) before 1 (two)
    assert gpu.get_new_blocks(6) == [3, 4, 5, 6, 7, 2]
    assert gpu.get_cached_block(H[0]) == 1 and gpu.get_cached_block(H[1]) is None
    gpu.free_blocks([2, 7, 6, 5, 4, 3])
    gpu.evict_blocks([1])  # a free block losing its hash joins first fit
    assert gpu.snapshot().free_queue == (1, 2, 3, 4, 5, 6, 7)
    gpu.check_invariants()


@pytest.mark.parametrize("python_path_max", [None, 0])
def test_a_weight_finer_than_int64_is_exact(python_path_max):
    # W = 10^-19: q = 10^19 is beyond int64; the heaps compare the spec's keys as Python ints, and a
    # long batch, whose keys are otherwise computed on int64 tensors, computes them as ints too
    fine = "lru-lfu:0.0000000000000000001"
    calls = [*LIFE, ("get_new_blocks", (7,))]
    gpu = _both(fine, calls, python_path_max=python_path_max)
    assert gpu.get_num_free_blocks() == 0


@pytest.mark.parametrize("profile", ["lru-timestamp", "block-age", "lfu", "lru-lfu:0.5"])
@pytest.mark.parametrize("evict_first", [False, True])
def test_a_long_free_places_its_blocks_by_the_specs_keys(profile, evict_first):
    # Every batch through the tensor path: the stamps in scatters, the keys computed by column. Blocks
    # 1 and 2 are freed first with two accesses each, the rest later with one: recency and frequency
    # disagree, so a hit that stamps or counts wrong changes the order.
    n = 12
    calls = [
        ("get_new_blocks", (10,)),
        ("cache_full_blocks", ([1, 2, 3, 4, 5, 6], [BlockHash(bytes([i]) * 8) for i in range(1, 7)])),
        ("touch", ([1, 2],)),
        ("free_blocks", ([1, 2], False)),
        ("free_blocks", ([2, 1], evict_first)),
        ("free_blocks", ([6, 5, 4, 3, 10, 9], False)),
        ("touch", ([3, 5],)),  # hits on free blocks: they leave the free blocks
        ("free_blocks", ([5, 3, 8, 7], True)),
        ("get_new_blocks", (n - 2,)),
    ]
    _both(profile, calls, n=n, python_path_max=0)


def test_two_faces_stay_equal_under_a_keyed_policy():
    _both("block-age", [*LIFE, ("get_new_blocks", (6,))], share_host_memory=False)


def test_check_invariants_notices_a_miscounted_free_block():
    gpu = _both("lru-timestamp", LIFE)
    gpu.free_block_queue.num_free_blocks += 1
    with pytest.raises(AssertionError, match=r"free queue: 7 blocks are flagged free but num_free_blocks=8"):
        gpu.check_invariants()


@settings(max_examples=300, deadline=None)
@given(
    weight=st.sampled_from(
        ["lfu", "lru-timestamp", "block-age", "lru-lfu:0.5", "lru-lfu:123456789.000000000000000000001"]
    ),
    stamps=st.lists(st.tuples(*[st.integers(0, 2**63 - 1)] * 3, st.booleans()), min_size=2, max_size=2),
    ids=st.lists(st.integers(1, 2**63 - 1), min_size=2, max_size=2, unique=True),
)
def test_packed_keys_order_as_the_specs_keys(weight, stamps, ids):
    """The order compares packed ints; they must order exactly as eviction_key's tuples, at int64's bounds too."""
    rule = profile_rule(weight)
    widths = field_widths(rule, 2**63 - 1, 2**63 - 1, 2**63 - 1)
    keys = [eviction_key(rule, b, *s, PY) for b, s in zip(ids, stamps)]
    packed = [pack(k, field_offsets(widths)) for k in keys]
    assert (keys[0] < keys[1]) == (packed[0] < packed[1])
    assert [p & ((1 << widths[-1]) - 1) for p in packed] == ids  # the block id is the packed key's last field


@given(
    widths=st.lists(st.integers(1, 63), min_size=1, max_size=4),
    data=st.data(),
)
def test_joined_groups_are_the_ints_the_groups_pack(widths, data):
    """`join_int64_groups` writes pickle's bytes by hand: every group width and offset (a byte's edge or not,
    the sign bit's neighbour, int64's last bit), no key at all, and groups at their largest give the ints
    the shifts and ors give."""
    offsets = field_offsets(widths)
    k = data.draw(st.integers(0, 5))
    columns = [data.draw(st.lists(st.integers(0, 2**w - 1), min_size=k, max_size=k)) for w in widths]
    parts = [torch.tensor(c, dtype=torch.int64) for c in columns]
    expected = [sum(c[i] << o for c, o in zip(columns, offsets)) for i in range(k)]
    assert join_int64_groups(parts, offsets, sum(widths)) == expected


@given(
    groups=st.lists(
        st.tuples(st.integers(0, 2), st.integers(0, 2), st.integers(0, 2**62)), min_size=0, max_size=300, unique=True
    )
)
def test_groups_come_out_in_the_order_of_their_keys(groups):
    """`_ascending`: keys given by groups (many ties in the higher ones) come out sorted as the joined ints
    would be, the lowest group's order among equal higher ones included."""
    parts = [torch.tensor([g[i] for g in groups], dtype=torch.int64) for i in range(3)]
    offsets = field_offsets((2, 2, 63))
    assert join_int64_groups(_ascending(parts), offsets, 67) == sorted(join_int64_groups(parts, offsets, 67))


@pytest.mark.parametrize("widths", [(63, 63, 1), (63, 2), (1, 63), (8, 8), (63,)])
def test_joined_groups_at_their_largest(widths):
    """Each group all ones, and each alone: every bit of int64 a group can hold, wherever the group starts
    (a group's bit 62 can be the lowest bit of a byte), and a key that fills whole bytes (its sign byte 0)."""
    offsets = field_offsets(widths)
    for ones in range(len(widths) + 1):  # group `ones` all ones, the others 0; last, every group all ones
        columns = [2**w - 1 if ones in (g, len(widths)) else 0 for g, w in enumerate(widths)]
        parts = [torch.tensor([c]) for c in columns]
        assert join_int64_groups(parts, offsets, sum(widths)) == [sum(c << o for c, o in zip(columns, offsets))]


@pytest.mark.parametrize("profile", ["lru-timestamp", "block-age", "lfu", "lru-lfu:0.5"])
@pytest.mark.parametrize("python_path_max", [None, 0])
def test_keys_are_repacked_when_the_clock_or_a_count_passes_their_fields(profile, python_path_max):
    """Stamp and access fields one bit wide, widened a bit at a time: every free crosses the stamps', the
    hits on block 3 cross the counts' (lfu and lru-lfu read them), and the order must hold."""
    widenings: list[tuple[int, int]] = []

    def narrow(gpu: TensorBlockPool) -> None:
        stamped = gpu._stamped
        assert stamped is not None
        stamped._set_widths(1, 1)
        widen = stamped._widen

        def counted(accesses: int = 0) -> None:
            widenings.append((stamped.clock, accesses))
            widen(accesses)

        stamped._widen = counted  # type: ignore[method-assign]

    calls = [
        ("get_new_blocks", (8,)),
        ("cache_full_blocks", ([1, 2, 3, 4, 5], [BlockHash(bytes([i]) * 8) for i in range(1, 6)])),
        ("free_blocks", ([5, 4, 3], False)),
        ("touch", ([4],)),
        ("free_blocks", ([4, 2, 1], True)),
        ("free_blocks", ([8, 7, 6], False)),
        *[("touch", ([3],)), ("free_blocks", ([3],))] * 40,  # the clock passes 31 and 63 with cached blocks free
        ("get_new_blocks", (9,)),
    ]
    _both(profile, calls, n=12, prepare=narrow, python_path_max=python_path_max)
    assert len([clock for clock, accesses in widenings if not accesses]) >= 3
    if profile in ("lfu", "lru-lfu:0.5"):  # block 3's count passes 1, 3, 7, 15 and 31
        assert [accesses for clock, accesses in widenings if accesses] == [2, 4, 8, 16, 32]


def _entries(stamped: StampedFreeBlocks) -> int:
    """The entries of the cached order, stale ones included."""
    return len(stamped._run) - stamped._run_head + len(stamped._heap)


def test_the_cached_heap_stays_bounded_when_a_free_block_comes_back_under_the_same_key():
    """block-age keys a block by its registration: a hit on a free block and its free again give the block the
    same key as its stale entry, so the compaction must keep one entry per live key, not every matching one."""
    p = TensorBlockPool(4, profile="block-age", device=pick_device())
    (b,) = p.get_new_blocks(1)
    p.cache_full_blocks([b], [BlockHash(b"a")])
    p.free_blocks([b])
    for _ in range(500):
        p.touch([b])
        p.free_blocks([b])
    stamped = p._stamped
    assert stamped is not None
    assert _entries(stamped) <= 2 * stamped._num_live + 64
    p.check_invariants()
    assert p.get_new_blocks(3)[-1] == b  # first fit first, then the one cached block


def test_a_rebuild_keeps_one_entry_per_live_key_across_the_run_and_the_heap():
    """block-age: a block hit and freed again comes back under its old key, below the run's last, so into the
    heap while its old entry is still on the run. A rebuild must keep one of the two, or the stale entries
    left after it soon pass the bound again and every few pushes rebuild the whole order."""
    p = TensorBlockPool(70, profile="block-age", device=pick_device())
    blocks = p.get_new_blocks(60)
    p.cache_full_blocks(blocks, [BlockHash(b.to_bytes(8, "little")) for b in blocks])
    p.free_blocks(blocks)  # registration order: every key the largest yet, all on the run
    stamped = p._stamped
    assert stamped is not None
    rebuilds = 0
    for _ in range(20):
        for b in blocks[:30]:
            p.touch([b])
            before = _entries(stamped)
            p.free_blocks([b])
            if _entries(stamped) < before:
                rebuilds += 1
                assert _entries(stamped) == stamped._num_live == 60
    assert rebuilds > 0
    p.check_invariants()


@pytest.mark.parametrize("python_path_max", [None, 0])
def test_a_clock_past_32_bits_widens_the_stamp_field_by_what_it_needs_and_keeps_int64_keys(python_path_max):
    """lru-timestamp's keys stay int64 (one scatter a long free) until the stamps need more than 63 - 1 - id bits."""
    p = TensorBlockPool(8, profile="lru-timestamp", device=pick_device(), python_path_max=python_path_max)
    stamped = p._stamped
    assert stamped is not None
    blocks = p.get_new_blocks(4)
    p.cache_full_blocks(blocks, [BlockHash(bytes([b]) * 8) for b in blocks])
    p.free_blocks(blocks[:2])
    assert stamped._widths == (1, 32, 3) and stamped._live_t is not None
    stamped.clock = 2**40 + 3  # as after a long life: the free below widens the field and repacks the two above
    p.free_blocks(blocks[2:])
    assert stamped._widths == (1, 41, 3) and stamped._live_t is not None
    p.check_invariants()
    assert p.get_new_blocks(7)[-4:] == blocks  # first fit, then the cached blocks, least recently used first


@pytest.mark.parametrize("python_path_max", [None, 0])
def test_keys_wider_than_int64_are_recorded_by_their_lowest_group(python_path_max):
    """lru-lfu:0.5's keys span two int64 groups (tier and score; last access and id): `_live` records the lowest,
    which holds the last access, an int64 (one scatter a long free). The clock starts just below 2**32, so the
    stamps use the field's top bit, then pass it (a widening); block 2 is hit 260 times, so its count passes
    its field's 255 (another): every step against the spec (stamps shifted alike order alike)."""

    def late(gpu: TensorBlockPool) -> None:
        assert gpu._stamped is not None
        gpu._stamped.clock = 2**32 - 6

    calls = [
        ("get_new_blocks", (6,)),
        ("cache_full_blocks", ([1, 2, 3, 4], H[:4])),
        ("free_blocks", ([4, 3, 2, 1],)),
        *[("touch", ([2],)), ("free_blocks", ([2],))] * 260,
        ("free_blocks", ([6, 5],)),
        ("get_new_blocks", (7,)),
    ]
    gpu = _both("lru-lfu:0.5", calls, prepare=late, python_path_max=python_path_max)
    stamped = gpu._stamped
    assert stamped is not None and stamped._live_t is not None
    assert (stamped._stamp_bits, stamped._access_bits) == (33, 9)
    assert len(stamped._groups or ()) == 2 and stamped._tag_mask == (1 << (33 + 3)) - 1  # last access, id


def _hashes_of(blocks: list[int]) -> list[BlockHash]:
    return [BlockHash(b.to_bytes(8, "little")) for b in blocks]


def test_a_long_free_below_the_runs_last_goes_in_by_slices_or_into_the_heap():
    """block-age: blocks hit and freed again come back under their registration keys, one into each gap of
    the run: the gaps far from its end go into the heap, those near it into the run, and past `_MAX_SLICES`
    gaps the rest into the heap. lfu: blocks counted once, freed after blocks counted twice, fall together
    into one gap (after every other block counted once), one slice into the run."""
    n = 200
    blocks = list(range(1, n))
    hit = blocks[::2]
    calls = [
        ("get_new_blocks", (n - 1,)),
        ("cache_full_blocks", (blocks, _hashes_of(blocks))),
        ("free_blocks", (blocks,)),  # registration order, then the same ids: every key extends the run
        ("touch", (hit,)),
        ("free_blocks", (hit,)),
    ]
    gpu = _both("block-age", calls, n=n, python_path_max=0)
    stamped = gpu._stamped
    assert stamped is not None and len(stamped._heap) > 0
    assert len(stamped._run) - stamped._run_head > n - 1 - len(hit)  # some went into the run
    _both("block-age", [*calls, ("get_new_blocks", (n - 1,))], n=n, python_path_max=0)

    once = [b for b in blocks if b not in hit]
    calls = [
        *calls[:2],
        ("touch", (hit,)),  # held twice, counted twice
        ("free_blocks", (hit,)),
        ("free_blocks", (hit,)),  # free now, at the run's end
        ("free_blocks", (once,)),  # counted once: every key below the run's first
    ]
    gpu = _both("lfu", calls, n=n, python_path_max=0)
    stamped = gpu._stamped
    assert stamped is not None and stamped._heap == [] and len(stamped._run) - stamped._run_head == n - 1
    _both("lfu", [*calls, ("get_new_blocks", (n - 1,))], n=n, python_path_max=0)
