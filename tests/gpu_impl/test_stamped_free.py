"""gpu_impl under seed 002's keyed policies: named scenarios with exact ids, the exact fallback, its own checks.

The lock-step machines (test_pool_lockstep, test_manager_lockstep) compare it
with the reference on random operations under every policy; these state the
order outright and check what only the stamped free blocks have.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvspec.gpu_impl.block_pool import TensorBlockPool
from kvspec.gpu_impl.device import pick_device
from kvspec.gpu_impl.stamped_free import StampedFreeBlocks
from kvspec.spec import ops
from kvspec.spec.ordering import PY, eviction_key, profile_rule
from kvspec.spec.state import BlockHash

H = [BlockHash(bytes([i]) * 8) for i in range(8)]


def _both(profile: str, calls: list[tuple[str, tuple]], n: int = 8, **kwargs: object) -> TensorBlockPool:
    """Apply calls to gpu_impl and the spec; gpu_impl after checking the two snapshots are equal."""
    gpu = TensorBlockPool(n, profile=profile, device=pick_device(), **kwargs)  # type: ignore[arg-type]
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
    weight=st.sampled_from(["lfu", "lru-timestamp", "lru-lfu:0.5", "lru-lfu:123456789.000000000000000000001"]),
    stamps=st.lists(st.tuples(*[st.integers(0, 2**63 - 1)] * 3, st.booleans()), min_size=2, max_size=2),
    ids=st.lists(st.integers(1, 2**63 - 1), min_size=2, max_size=2, unique=True),
)
def test_packed_keys_order_as_the_specs_keys(weight, stamps, ids):
    """The heaps compare packed ints; they must order exactly as eviction_key's tuples, at int64's bounds too."""
    free = StampedFreeBlocks(
        2, profile_rule(weight), memoryview(bytearray(2)), torch.zeros(2, dtype=torch.uint8), torch.device("cpu")
    )
    keys = [eviction_key(profile_rule(weight), b, *s, PY) for b, s in zip(ids, stamps)]
    packed = [free._pack(k) for k in keys]
    assert (keys[0] < keys[1]) == (packed[0] < packed[1])
    assert [p & free._id_mask for p in packed] == ids  # the block id is the packed key's last field


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
    assert len(stamped._cached) <= 2 * stamped._num_live + 64
    p.check_invariants()
    assert p.get_new_blocks(3)[-1] == b  # first fit first, then the one cached block
