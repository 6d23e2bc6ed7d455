"""TensorBlockPool: named scenarios with exact block ids, every error pinned, and its own representation.

The lock-step machines (test_pool_lockstep) compare gpu_impl with the
reference on random operations; the scenarios here state the expected block
ids outright (the order checks the eviction order), pin each error's type and
message, and check what only gpu_impl has: tensor arguments, long batches
checked on the device, the lazily kept hash map, and the key index.
"""

from __future__ import annotations

import random
from collections import deque

import pytest
import torch

from kvspec.gpu_impl.block_pool import TensorBlockPool, ids_as_tensor
from kvspec.gpu_impl.device import pick_device
from kvspec.gpu_impl.sizing import KVLayout
from kvspec.reference import BlockPool
from kvspec.spec.errors import (
    AlreadyCached,
    BlockManagerError,
    DoubleFree,
    InvalidBlock,
    InvalidRequest,
    InvariantViolation,
    PoolExhausted,
)
from kvspec.spec.invariants import is_block_writable
from kvspec.spec.state import BlockHash

H = [BlockHash(bytes([i]) * 8) for i in range(8)]


def pool(n: int = 8, profile: str = "vllm-v1", **kwargs: object) -> TensorBlockPool:
    return TensorBlockPool(n, profile=profile, device=pick_device(), **kwargs)  # type: ignore[arg-type]


# --- scenarios: exact block ids ---------------------------------------------------------------


def test_request_life_under_vllm_v1_frees_unhashed_left_and_hashed_right():
    p = pool(8)
    assert p.get_new_blocks(3) == [1, 2, 3]
    p.cache_full_blocks([1, 2], H[:2])
    p.free_blocks([3, 2, 1])  # tail first
    # 3 has no hash: reused first; 2 then 1 keep their hashes and go right, deepest first.
    assert p.snapshot().free_queue == (3, 4, 5, 6, 7, 2, 1)
    assert p.get_cached_block(H[0]) == 1 and p.get_cached_block(H[1]) == 2
    p.touch([1, 2])  # a hit takes them out of the middle and the end of the queue
    assert p.snapshot().free_queue == (3, 4, 5, 6, 7)
    assert p.get_new_blocks(5) == [3, 4, 5, 6, 7]
    with pytest.raises(PoolExhausted):
        p.get_new_blocks(1)
    p.free_blocks([7, 6, 5, 4, 3, 2, 1])
    assert p.snapshot().free_queue == (7, 6, 5, 4, 3, 2, 1)
    # Taking the cached blocks again is what evicts them.
    assert p.get_new_blocks(7) == [7, 6, 5, 4, 3, 2, 1]
    assert p.get_cached_block(H[0]) is None and p.snapshot().hash_to_blocks == ()
    p.check_invariants()


def test_request_life_under_vllm_v1_tail_sends_every_freed_block_right():
    p = pool(6, "vllm-v1-tail")
    assert p.get_new_blocks(3) == [1, 2, 3]
    p.cache_full_blocks([1], H[:1])
    p.free_blocks([3, 2, 1])
    assert p.snapshot().free_queue == (4, 5, 3, 2, 1)
    p.check_invariants()


def test_duplicate_hashes_are_kept_in_registration_order():
    p = pool(6)
    p.get_new_blocks(3)
    p.cache_full_blocks([2, 1], [H[0], H[0]])  # the same content computed twice
    assert p.get_cached_block(H[0]) == 2
    assert p.snapshot().hash_to_blocks == ((H[0], (2, 1)),)
    p.evict_blocks([2])
    assert p.get_cached_block(H[0]) == 1
    p.check_invariants()


def test_many_gaps_then_a_take_skips_them_in_order():
    # Hits on blocks scattered through the queue leave gaps; a take must skip
    # them and still return the smallest keys in order.
    p = pool(64, key_capacity=128)
    everything = p.get_new_blocks(63)
    p.cache_full_blocks(everything, [BlockHash(b.to_bytes(2, "big")) for b in everything])
    p.free_blocks(everything)  # all hashed: the queue is 1..63 again
    hit = list(range(1, 60, 2))
    p.touch(hit)
    assert p.free_block_queue.num_gaps == len(hit)
    assert p.get_new_blocks(10) == list(range(2, 21, 2))
    p.free_blocks(hit[::-1])
    assert p.snapshot().free_queue[:3] == (22, 24, 26)
    assert p.snapshot().free_queue[-3:] == (5, 3, 1)
    p.check_invariants()


# --- errors: the spec's type, a message naming the values, state unchanged ------------------------


@pytest.mark.parametrize(
    ("op", "args", "error", "message"),
    [
        (
            "get_new_blocks",
            (-1,),
            InvalidRequest,
            r"^get_new_blocks: num_blocks must be a non-negative integer; got num_blocks=-1$",
        ),
        (
            "get_new_blocks",
            (True,),
            InvalidRequest,
            r"^get_new_blocks: num_blocks must be a non-negative integer; got num_blocks=True$",
        ),
        (
            "get_new_blocks",
            (5,),
            PoolExhausted,
            r"^cannot allocate num_blocks=5: 4 free of num_gpu_blocks=8, one is the null block$",
        ),
        ("touch", ([4],), InvalidBlock, r"^touch: block_id=4 has no hash \(ref_cnt=0\), so no request can have hit it"),
        ("touch", ([1, 1],), InvalidRequest, r"^touch: block_ids=\[1, 1\] names a block twice$"),
        ("touch", ([0],), InvalidBlock, r"^touch: block_id=0 is the null block"),
        ("touch", ([8],), InvalidBlock, r"^touch: block_id=8 is not a block of this pool \(ids 0\.\.7\)$"),
        (
            "free_blocks",
            ([3, 4],),
            DoubleFree,
            r"^free_blocks: block_id=4 has ref_cnt=0, no request holds it \(double free\?\)$",
        ),
        ("free_blocks", ([2.0],), InvalidBlock, r"^free_blocks: block_id=2\.0 is not a block of this pool"),
        (
            "cache_full_blocks",
            ([3], [H[3], H[4]]),
            InvalidRequest,
            r"^cache_full_blocks: 1 block_ids but 2 block_hashes",
        ),
        (
            "cache_full_blocks",
            ([3], ["h"]),
            InvalidRequest,
            r"^cache_full_blocks: block_hash='h' for block_id=3 is not bytes$",
        ),
        ("cache_full_blocks", ([5], [H[5]]), InvalidBlock, r"^cache_full_blocks: block_id=5 has ref_cnt=0"),
        ("cache_full_blocks", ([1], [H[5]]), AlreadyCached, r"^cache_full_blocks: block_id=1 is already registered"),
        ("get_cached_block", ("h",), InvalidRequest, r"^get_cached_block: block_hash='h' is not bytes$"),
        ("is_block_writable", (9,), InvalidBlock, r"^is_block_writable: block_id=9 is not a block of this pool"),
    ],
)
def test_bad_input_raises_the_spec_error_and_changes_nothing(op, args, error, message):
    p, ref = pool(8), BlockPool(8)
    for impl in (p, ref):
        impl.get_new_blocks(3)
        impl.cache_full_blocks([1, 2], H[:2])
    before = p.snapshot()
    with pytest.raises(error, match=message):
        getattr(p, op)(*args)
    with pytest.raises(error):
        getattr(ref, op)(*args)
    assert p.snapshot() == before == ref.snapshot()
    p.check_invariants()


def test_cache_full_blocks_with_caching_off_is_refused():
    p = TensorBlockPool(4, enable_caching=False, device=pick_device())
    p.get_new_blocks(1)
    with pytest.raises(InvalidRequest, match=r"^cache_full_blocks: prefix caching is off"):
        p.cache_full_blocks([1], H[:1])


def test_bad_constructor_arguments():
    with pytest.raises(InvalidRequest, match=r"^num_gpu_blocks must be an integer >= 1 .*got num_gpu_blocks=0$"):
        TensorBlockPool(0)
    with pytest.raises(InvalidRequest, match=r"^unknown profile='mru'"):
        TensorBlockPool(4, profile="mru")
    with pytest.raises(InvalidRequest, match=r"^key_capacity=7 is below the minimum 2 \* num_gpu_blocks=8$"):
        TensorBlockPool(4, key_capacity=7)


LONG = 400  # more ids than the host checks take: the device checks run


MISTAKES = ["duplicate at the end", "out of range", "null block", "a bool", "negative", "double free"]


@pytest.mark.parametrize(
    ("mistake", "as_tensor"),
    # A tensor cannot hold a bool among ints, so that mistake only exists in a list.
    [(m, False) for m in MISTAKES] + [(m, True) for m in MISTAKES if m != "a bool"],
    ids=lambda v: ("tensor" if v else "list") if isinstance(v, bool) else v,
)
def test_long_batches_are_checked_on_the_device_with_the_spec_errors(mistake, as_tensor):
    n = LONG + 10
    p, ref = pool(n), BlockPool(n)
    held = p.get_new_blocks(LONG)
    assert ref.get_new_blocks(LONG) == held
    bad = list(held)
    if mistake == "duplicate at the end":
        bad[-1] = bad[0]
    elif mistake == "out of range":
        bad[200] = n
    elif mistake == "null block":
        bad[300] = 0
    elif mistake == "a bool":
        bad[1] = True
    elif mistake == "negative":
        bad[5] = -3
    else:
        bad[-1] = n - 1  # a free block
    argument = torch.tensor(bad, device=p.device) if as_tensor else bad
    before = p.snapshot()
    with pytest.raises(BlockManagerError) as ref_error:
        ref.free_blocks(bad)
    with pytest.raises(ref_error.type):
        p.free_blocks(argument)
    assert p.snapshot() == before == ref.snapshot()


class _Id(int):
    """An int subclass: the spec accepts it as a block id, the fast conversion does not."""


@pytest.mark.parametrize("length", [1, 1023, 1024, 1025, 3000])
@pytest.mark.parametrize("kind", [list, tuple, deque])
def test_ids_as_tensor_reads_every_chunk(length, kind):
    ids = list(range(7, 7 + length))
    converted = ids_as_tensor(kind(ids))
    assert converted is not None and converted.dtype == torch.int64 and converted.tolist() == ids
    for at in sorted({0, length // 2, length - 1, min(1024, length - 1)}):  # first, middle, last, chunk edge
        for odd in (True, 7.0, _Id(7)):
            assert ids_as_tensor(kind(ids[:at] + [odd] + ids[at + 1 :])) is None, (at, odd)


def test_a_bad_id_past_the_first_chunk_is_the_spec_error_with_nothing_changed():
    n = 3000
    p, ref = pool(n), BlockPool(n)
    held = p.get_new_blocks(2500)
    assert ref.get_new_blocks(2500) == held
    before = p.snapshot()
    for bad_id in (True, 2.0, n):
        bad = list(held)
        bad[2100] = bad_id
        with pytest.raises(BlockManagerError) as ref_error:
            ref.free_blocks(bad)
        with pytest.raises(ref_error.type, match="block_id="):
            p.free_blocks(bad)
        assert p.snapshot() == before == ref.snapshot()
    subclassed = [_Id(b) if i == 2100 else b for i, b in enumerate(held)]  # valid ids, one an int subclass
    ref.free_blocks(subclassed)
    p.free_blocks(subclassed)
    assert p.snapshot() == ref.snapshot()


@pytest.mark.parametrize("op", ["touch", "free_blocks", "evict_blocks"])
def test_a_long_batch_longer_than_the_pool_is_refused_as_a_repeat(op):
    # Found by the manager lock-step (evict_blocks([1, 1, 1]) in a 2-block pool, every batch on the
    # device face): the duplicate check scatters one position per block and raised IndexError.
    p = pool(2, python_path_max=0)
    before = p.snapshot()
    with pytest.raises(InvalidRequest, match=rf"^{op}: block_ids=\[1, 1, 1\] names a block twice$"):
        getattr(p, op)([1, 1, 1])
    assert p.snapshot() == before


def test_tensor_arguments_behave_like_lists():
    rng = random.Random(3)
    n = 300
    p, ref = pool(n), BlockPool(n)
    for _ in range(40):
        k = rng.randint(1, 120)
        if k > ref.get_num_free_blocks():
            continue
        taken = p.get_new_blocks_tensor(k)
        assert taken.tolist() == ref.get_new_blocks(k)
        hashes = [BlockHash(rng.randrange(30).to_bytes(1, "big")) for _ in range(k)]
        ref.cache_full_blocks(taken.tolist(), hashes)
        p.cache_full_blocks(taken, hashes)
        ref.free_blocks(taken.tolist()[::-1])
        p.free_blocks(taken.flip(0))
        hashed = [b for b in range(1, n) if ref.blocks[b].block_hash is not None]
        hit = rng.sample(hashed, min(len(hashed), rng.randint(1, 60)))
        ref.touch(hit)
        p.touch(torch.tensor(hit, device=p.device))
        ref.free_blocks(hit[::-1])
        p.free_blocks(torch.tensor(hit[::-1], device=p.device))
        assert p.snapshot() == ref.snapshot()
    with pytest.raises(InvalidRequest, match=r"^touch: block_ids must be a 1-D integer tensor; got dtype=torch.float"):
        p.touch(torch.tensor([1.0], device=p.device))
    p.check_invariants()


def test_writable_mask_agrees_with_the_spec_rule_on_reachable_states():
    rng = random.Random(5)
    n = 40
    p = pool(n)
    held: list[list[int]] = []
    for _ in range(200):
        if rng.random() < 0.5 and p.get_num_free_blocks():
            blocks = p.get_new_blocks(rng.randint(1, min(6, p.get_num_free_blocks())))
            full = blocks[: rng.randint(0, len(blocks))]
            p.cache_full_blocks(full, [H[rng.randrange(8)] for _ in full])
            held.append(blocks)
        elif held:
            p.free_blocks(held.pop(rng.randrange(len(held)))[::-1])
        snap = p.snapshot()
        every = torch.arange(n, device=p.device)
        assert p.writable_mask(every).tolist() == [is_block_writable(snap, b) for b in range(n)]
        assert [p.is_block_writable(b) for b in range(n)] == [is_block_writable(snap, b) for b in range(n)]


# --- the lazily kept hash map ------------------------------------------------------------------------


def test_an_evicted_blocks_entry_goes_stale_and_is_dropped_when_met():
    p = pool(4)
    p.get_new_blocks(3)
    p.cache_full_blocks([1, 2], [H[0], H[1]])
    p.free_blocks([3, 2, 1])  # queue: 3, 2, 1
    assert p.get_new_blocks(2) == [3, 2]  # 2 is evicted: only its flag is cleared
    assert 2 in p.cached_block_hash_to_block[H[1]]  # the stale entry is still there ...
    assert p.snapshot().hash_to_blocks == ((H[0], (1,)),)  # ... and invisible
    assert p.get_cached_block(H[1]) is None  # a lookup drops it
    assert H[1] not in p.cached_block_hash_to_block
    p.evict_blocks([1])
    p.cache_full_blocks([2], [H[0]])  # re-registration drops nothing stale of 2, and 1's entry stays stale
    assert p.get_cached_block(H[0]) == 2
    assert list(p.cached_block_hash_to_block[H[0]]) == [2]
    p.check_invariants()


def test_a_block_re_registered_under_the_same_hash_moves_to_the_end_of_its_entry():
    p = pool(5)
    p.get_new_blocks(2)
    p.cache_full_blocks([1, 2], [H[0], H[0]])
    p.evict_blocks([1])
    p.cache_full_blocks([1], [H[0]])
    assert p.snapshot().hash_to_blocks == ((H[0], (2, 1)),)
    assert p.get_cached_block(H[0]) == 2
    p.check_invariants()


# --- the representation checks can fail ---------------------------------------------------------------


def test_check_invariants_notices_a_flag_without_a_map_entry():
    p = pool(4)
    p.get_new_blocks(1)
    p.has_hash[1] = 1  # both faces (on the CPU they are one memory)
    p._has_hash_host[1] = 1
    with pytest.raises((InvariantViolation, AssertionError)):
        p.check_invariants()


def test_check_invariants_notices_a_miscounted_key_index():
    p = pool(6)
    p.free_block_queue.num_gaps += 1
    with pytest.raises(AssertionError, match=r"free queue: hi - lo \+ 1 = 5 but num_free_blocks=5 \+ num_gaps=1"):
        p.check_invariants()


def test_relabels_keep_the_order():
    p = pool(10, key_capacity=20)
    for _ in range(30):
        blocks = p.get_new_blocks(4)
        p.cache_full_blocks(blocks[:2], [BlockHash(bytes([b])) for b in blocks[:2]])
        before = p.snapshot().free_queue
        p.free_blocks(blocks[::-1])
        after = p.snapshot().free_queue
        assert after == tuple(b for b in blocks[::-1] if b not in blocks[:2]) + before + (blocks[1], blocks[0])
        p.evict_blocks(blocks[:2])
    assert p.free_block_queue.num_relabels > 0
    p.check_invariants()


def test_a_pool_sized_from_memory_has_the_planned_block_count():
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)  # 512 B per block
    p = TensorBlockPool.from_memory(layout, gpu_mem=100 * 512, weights=10 * 512, margin=0.1, device=pick_device())
    assert p.num_gpu_blocks == 81  # (100 - 10) blocks' worth x 0.9
    assert p.capacity_plan is not None and p.capacity_plan.num_gpu_blocks == 81
    assert p.get_num_free_blocks() == 80
