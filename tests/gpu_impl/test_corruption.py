"""Corrupt blocks (seed 002): a flipped bit in device memory is caught on hit, and the block is retired.

A registered block is sealed with a checksum of its KV; a hit re-computes it.
A block that fails is removed from the hash table (never a hit again) and
quarantined (never reallocated): at once if it is free, when its last holder
frees it otherwise. The faults are real: one bit of the KV tensor is flipped
in place, on whatever device the pool runs.

The spec has no quarantine, so what it publishes is gpu_impl's decision: a
key that leaves the hash table is announced then, as a `BlockRemoved`, even
during a lookup, and the later retirement announces nothing. Under random
faults a router's mirror of the stream must hold exactly the hash table's
keys after every step.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvspec.gpu_impl.block_pool import TensorBlockPool
from kvspec.gpu_impl.device import pick_device
from kvspec.gpu_impl.kv_cache import PagedKVCache
from kvspec.gpu_impl.kv_cache_manager import TensorKVCacheManager, prefix_kv_source
from kvspec.spec.errors import InvalidBlock, InvalidRequest
from kvspec.spec.events import BlockRemoved, BlockStored, EventMirror
from kvspec.spec.invariants import check_events, hit_content_intact
from kvspec.spec.manager import Request
from kvspec.spec.state import BlockHash

BLOCK_SIZE = 4


def manager(num_gpu_blocks: int = 8) -> TensorKVCacheManager:
    return TensorKVCacheManager(num_gpu_blocks, BLOCK_SIZE, device=pick_device())


def run(m: TensorKVCacheManager, request: Request) -> list[int]:
    """Schedule a new request's whole prompt (with its prefix hit); return its block table."""
    hit, num_hit_tokens = m.get_computed_blocks(request)
    new = m.allocate_slots(request, len(request.token_ids) - num_hit_tokens, num_hit_tokens, hit)
    assert new is not None
    return m.req_to_blocks[request.request_id]


PROMPT = tuple(range(10))  # two full blocks and a partial one


def test_flip_in_a_free_cached_block_is_caught_on_hit_and_the_block_quarantined():
    m = manager()
    table = run(m, Request("a", PROMPT))
    assert table == [1, 2, 3]
    m.free("a")
    m.kv_cache.inject_bit_flip(1, byte_offset=5, bit=3)
    hit, num_hit_tokens = m.get_computed_blocks(Request("b", PROMPT))
    # The first block is corrupt, so nothing after it can be a hit either (prefix-closed).
    assert (hit, num_hit_tokens) == ([], 0)
    snap = m.snapshot()
    assert snap.quarantined == (1,)
    assert 1 not in snap.free_queue and snap.block_hash[1] is None
    m.check_invariants()
    # Never a hit again, never reallocated: the other 6 blocks are all there is.
    assert m.get_computed_blocks(Request("c", PROMPT)) == ([], 0)
    assert m.block_pool.get_num_free_blocks() == 6
    taken = m.allocate_slots(Request("big", tuple(range(100, 124))), 24)
    assert taken is not None and 1 not in taken and len(taken) == 6
    assert m.allocate_slots(Request("more", (7,)), 1) is None  # capacity counts the quarantined block out
    m.check_invariants()


def test_flip_in_a_later_block_shortens_the_hit_to_the_intact_prefix():
    m = manager()
    run(m, Request("a", PROMPT))
    m.free("a")
    m.kv_cache.inject_bit_flip(2, byte_offset=31, bit=7)
    hit, num_hit_tokens = m.get_computed_blocks(Request("b", PROMPT))
    assert (hit, num_hit_tokens) == ([1], 4)
    assert hit_content_intact(prefix_kv_source(Request("b", PROMPT), 0, 4), m.read_kv(hit)[0])
    assert m.snapshot().quarantined == (2,)
    m.check_invariants()


def test_corrupt_block_still_held_loses_its_hash_now_and_is_quarantined_when_freed():
    m = manager()
    run(m, Request("a", PROMPT))  # a keeps running: blocks 1, 2 registered and held
    m.kv_cache.inject_bit_flip(1, byte_offset=0, bit=0)
    assert m.get_computed_blocks(Request("b", PROMPT)) == ([], 0)
    snap = m.snapshot()
    assert snap.block_hash[1] is None and snap.ref_cnt[1] == 1 and snap.quarantined == ()
    m.check_invariants()
    m.free("a")
    snap = m.snapshot()
    assert snap.quarantined == (1,) and 1 not in snap.free_queue
    assert snap.free_queue[-1] == 2  # the intact hashed block went right as usual
    m.check_invariants()


def test_a_quarantined_key_is_announced_removed_at_once_and_its_retirement_publishes_nothing():
    m = TensorKVCacheManager(8, BLOCK_SIZE, device=pick_device(), enable_kv_cache_events=True)
    run(m, Request("a", PROMPT))  # a keeps running: blocks 1, 2 registered and held
    stored = m.take_events()
    assert [type(e) for e in stored] == [BlockStored]
    h1, h2 = stored[0].block_hashes
    m.kv_cache.inject_bit_flip(2, byte_offset=3, bit=1)
    assert m.get_computed_blocks(Request("b", PROMPT)) == ([1], 4)
    # A lookup publishes nothing, but this one took block 2's key out of the table.
    assert m.take_events() == [BlockRemoved((h2,))]
    m.free("a")
    assert m.snapshot().quarantined == (2,) and m.take_events() == []
    m.block_pool.quarantine_blocks([2, 1])  # 2 again: no key left; 1 is free and hashed
    assert m.take_events() == [BlockRemoved((h1,))]
    check_events(EventMirror().apply(stored), [BlockRemoved((h2,)), BlockRemoved((h1,))], m.snapshot())


def test_a_duplicate_block_under_the_same_hash_still_serves_the_hit():
    m = manager(12)
    a, b = Request("a", PROMPT), Request("b", PROMPT)
    # Both look up before either is scheduled: both miss and compute the same prefix.
    assert m.get_computed_blocks(a) == ([], 0) and m.get_computed_blocks(b) == ([], 0)
    table_a = m.allocate_slots(a, len(PROMPT))
    table_b = m.allocate_slots(b, len(PROMPT))
    assert table_a == [1, 2, 3] and table_b == [4, 5, 6]
    m.kv_cache.inject_bit_flip(1, byte_offset=9, bit=2)
    hit, num_hit_tokens = m.get_computed_blocks(Request("c", PROMPT))
    assert (hit, num_hit_tokens) == ([4, 2], 8)  # block 1 retired, its twin 4 takes over
    assert hit_content_intact(prefix_kv_source(Request("c", PROMPT), 0, 8), [v for p in m.read_kv(hit) for v in p])
    m.check_invariants()


def test_every_single_bit_flip_of_a_block_is_detected():
    pool = TensorBlockPool(3, device=pick_device())
    kv = PagedKVCache(pool, block_size=2)
    block = pool.get_new_blocks_tensor(1)
    kv.write_tokens(block, 0, torch.tensor([123456789, -987654321], device=pool.device))
    kv.seal(block)
    num_bytes = kv.kv[0].numel() * kv.kv.element_size()
    for byte in range(num_bytes):
        for bit in range(8):
            kv.inject_bit_flip(int(block), byte, bit)
            assert not bool(kv.intact(block)), f"flip of byte {byte} bit {bit} went unnoticed"
            kv.inject_bit_flip(int(block), byte, bit)
            assert bool(kv.intact(block))


def test_values_swapped_between_slots_are_detected():
    pool = TensorBlockPool(3, device=pick_device())
    kv = PagedKVCache(pool, block_size=2)
    block = pool.get_new_blocks_tensor(1)
    kv.write_tokens(block, 0, torch.tensor([5, 9], device=pool.device))
    kv.seal(block)
    kv.kv[int(block)] = kv.kv[int(block)].flip(0)
    assert not bool(kv.intact(block))


def test_bit_flip_arguments_are_checked():
    m = manager()
    with pytest.raises(InvalidBlock, match=r"^inject_bit_flip: block_id=8 is not a block"):
        m.kv_cache.inject_bit_flip(8, 0, 0)
    with pytest.raises(InvalidRequest, match=r"^inject_bit_flip: byte_offset=32 not in 0\.\.31"):
        m.kv_cache.inject_bit_flip(1, 32, 0)
    with pytest.raises(InvalidRequest, match=r"^inject_bit_flip: bit=8 not in 0\.\.7"):
        m.kv_cache.inject_bit_flip(1, 0, 8)


# --- the pool-level quarantine operation ------------------------------------------------------------


POOL_PATHS = pytest.mark.parametrize(
    ("python_path_max", "share_host_memory"),
    [(None, None), (0, None), (None, False), (0, False)],
    ids=["default", "tensor-path-only", "two-faces", "tensor-path-two-faces"],
)


@POOL_PATHS
def test_quarantine_of_free_and_held_blocks_at_the_pool_level(python_path_max, share_host_memory):
    pool = TensorBlockPool(
        6, device=pick_device(), python_path_max=python_path_max, share_host_memory=share_host_memory
    )
    held = pool.get_new_blocks(3)  # [1, 2, 3]
    pool.cache_full_blocks(held[:2], [BlockHash(b"x"), BlockHash(b"y")])
    pool.quarantine_blocks([2, 4])  # 2 is held and hashed, 4 is free
    snap = pool.snapshot()
    assert snap.quarantined == (4,) and snap.free_queue == (5,)
    assert snap.block_hash[2] is None and pool.get_cached_block(BlockHash(b"y")) is None
    with pytest.raises(InvalidBlock, match=r"block_id=2 failed its checksum"):
        pool.cache_full_blocks([2], [BlockHash(b"z")])
    pool.quarantine_blocks([2, 4])  # again: nothing changes
    assert pool.snapshot() == snap
    pool.free_blocks([3, 2, 1])
    snap = pool.snapshot()
    assert snap.quarantined == (4, 2)
    assert snap.free_queue == (3, 5, 1)  # 3 unhashed to the left, 1 hashed to the right, 2 retired
    assert pool.get_usage() == 0.0 and pool.reset_prefix_cache()
    with pytest.raises(InvalidBlock, match=r"^quarantine_blocks: block_id=0 is the null block"):
        pool.quarantine_blocks([0])
    pool.check_invariants()


@POOL_PATHS
def test_quarantine_of_every_block_leaves_an_empty_pool(python_path_max, share_host_memory):
    pool = TensorBlockPool(
        4, device=pick_device(), python_path_max=python_path_max, share_host_memory=share_host_memory
    )
    pool.quarantine_blocks([1, 2, 3])
    assert pool.get_num_free_blocks() == 0 and pool.get_usage() == 0.0
    assert pool.snapshot().quarantined == (1, 2, 3)
    pool.check_invariants()


# --- random faults under random traffic ---------------------------------------------------------------


class CorruptionMachine(RuleBasedStateMachine):
    """Requests run, finish and share prefixes while bits flip in registered blocks.

    Whatever happens, a hit never serves KV other than its own prefix's,
    a quarantined block is never handed out, and every invariant holds.
    """

    @initialize(num_gpu_blocks=st.integers(2, 12), on_the_tensor_path=st.booleans())
    def build(self, num_gpu_blocks: int, on_the_tensor_path: bool) -> None:
        self.m = TensorKVCacheManager(num_gpu_blocks, 2, device=pick_device(), enable_kv_cache_events=True)
        self.mirror = EventMirror()  # what a router holds from the stream so far
        if on_the_tensor_path:
            self.m.block_pool.python_path_max = 0  # every batch through the tensor path: its quarantine
        self.running: dict[str, Request] = {}
        self.prompts: list[tuple[int, ...]] = []
        self.num_requests = 0

    @rule(tokens=st.lists(st.integers(0, 1), min_size=1, max_size=9), data=st.data())
    def add_request(self, tokens: list[int], data: st.DataObject) -> None:
        if self.prompts and data.draw(st.booleans()):
            tokens = list(data.draw(st.sampled_from(self.prompts))) + tokens[:1]
        self.prompts.append(tuple(tokens))
        self.num_requests += 1
        request = Request(f"r{self.num_requests}", tuple(tokens))
        quarantined = set(self.m.block_pool.quarantined)
        hit, num_hit_tokens = self.m.get_computed_blocks(request)
        actual = [v for page in self.m.read_kv(hit) for v in page]
        assert hit_content_intact(prefix_kv_source(request, 0, num_hit_tokens), actual)
        new = self.m.allocate_slots(request, len(tokens) - num_hit_tokens, num_hit_tokens, hit)
        if new is not None:
            assert not (set(new) & quarantined), f"quarantined blocks {quarantined} were reallocated: {new}"
            self.running[request.request_id] = request

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.running)))
        self.m.free(rid)
        del self.running[rid]

    def _registered(self) -> list[int]:
        return [b for b, h in enumerate(self.m.snapshot().block_hash) if h is not None]

    @precondition(lambda self: self._registered())
    @rule(data=st.data(), bit=st.integers(0, 7))
    def flip_a_bit(self, data: st.DataObject, bit: int) -> None:
        block = data.draw(st.sampled_from(self._registered()))
        byte = data.draw(st.integers(0, 2 * 8 - 1))  # two int64 slots per block
        self.m.kv_cache.inject_bit_flip(block, byte, bit)

    @invariant()
    def invariants_hold(self) -> None:
        self.m.check_invariants()

    @invariant()
    def router_mirror_exact(self) -> None:
        events = self.m.take_events()
        check_events(self.mirror, events, self.m.snapshot())
        self.mirror = self.mirror.apply(events)


CorruptionMachine.TestCase.settings = settings(max_examples=80, stateful_step_count=30, deadline=None)
test_corruption_machine = CorruptionMachine.TestCase
