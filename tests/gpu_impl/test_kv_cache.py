"""Paged KV memory: writes and reads through block tables, refused writes, and the manager's step writes."""

from __future__ import annotations

import pytest
import torch

from kvspec.gpu_impl.block_pool import TensorBlockPool
from kvspec.gpu_impl.device import pick_device
from kvspec.gpu_impl.kv_cache import PagedKVCache
from kvspec.gpu_impl.kv_cache_manager import TensorKVCacheManager, prefix_kv_source
from kvspec.gpu_impl.sizing import KVLayout
from kvspec.spec.errors import InvalidBlock, InvalidRequest, NotWritable
from kvspec.spec.manager import Request
from kvspec.spec.state import BlockHash


def kv_pool(n: int = 8, block_size: int = 4) -> tuple[TensorBlockPool, PagedKVCache]:
    pool = TensorBlockPool(n, device=pick_device())
    return pool, PagedKVCache(pool, block_size)


def test_tokens_land_in_their_slots_through_the_block_table():
    pool, kv = kv_pool()
    table = pool.get_new_blocks_tensor(3)  # blocks 1, 2, 3
    kv.write_tokens(table, 2, torch.arange(100, 107, device=pool.device))  # positions 2..8
    assert kv.read_blocks([1, 2, 3]).tolist() == [[0, 0, 100, 101], [102, 103, 104, 105], [106, 0, 0, 0]]
    assert kv.read_tokens(table, 3, 7).tolist() == [101, 102, 103, 104]
    blocks, offsets = kv.slots(table, 7, 9)
    assert blocks.tolist() == [2, 3] and offsets.tolist() == [3, 0]


@pytest.mark.parametrize(
    ("state", "message"),
    [
        ("shared", r"^cannot write KV into block_id=1: ref_cnt=2 has_hash=True"),
        ("hashed", r"^cannot write KV into block_id=1: ref_cnt=1 has_hash=True"),
        ("free", r"^cannot write KV into block_id=1: ref_cnt=0 has_hash=False"),
        ("null", r"^cannot write KV into block_id=0: ref_cnt=0 has_hash=False"),
    ],
)
def test_a_write_into_a_block_that_is_not_writable_is_refused_and_writes_nothing(state, message):
    pool, kv = kv_pool()
    table = pool.get_new_blocks_tensor(2)
    if state in ("shared", "hashed"):
        pool.cache_full_blocks([1], [BlockHash(b"h")])
    if state == "shared":
        pool.touch([1])
    if state == "free":
        pool.free_blocks([1])
    if state == "null":
        table = torch.tensor([0, 2], device=pool.device)
    before = kv.kv.clone()
    with pytest.raises(NotWritable, match=message):
        kv.write_tokens(table, 0, torch.arange(1, 6, device=pool.device))  # spans both blocks
    assert torch.equal(kv.kv, before)


def test_bad_writes_and_reads():
    pool, kv = kv_pool()
    table = pool.get_new_blocks_tensor(1)
    with pytest.raises(InvalidRequest, match=r"^token positions \[2, 6\) are not within the block table of 1 blocks"):
        kv.write_tokens(table, 2, torch.zeros(4, dtype=torch.int64, device=pool.device))
    with pytest.raises(InvalidRequest, match=r"^KV values of shape \(2, 3\) for slot_shape=\(\)"):
        kv.write_tokens(table, 0, torch.zeros((2, 3), dtype=torch.int64, device=pool.device))
    with pytest.raises(InvalidBlock, match=r"^read_kv: block_id=8 is not a block of this pool \(ids 0\.\.7\)$"):
        kv.read_blocks([8])
    with pytest.raises(InvalidRequest, match=r"^block_size must be a positive integer; got block_size=0$"):
        PagedKVCache(pool, 0)


def test_a_model_shaped_cache_detects_a_flip_in_bf16_memory():
    pool = TensorBlockPool(4, device=pick_device())
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="bf16")
    kv = PagedKVCache.for_layout(pool, layout)
    assert tuple(kv.kv.shape) == (4, 4, 2, 2, 2, 8) and kv.kv.dtype == torch.bfloat16
    assert kv.kv[0].numel() * kv.kv.element_size() == layout.block_bytes
    block = pool.get_new_blocks_tensor(1)
    values = torch.randn((4, *layout.slot_shape), generator=torch.Generator().manual_seed(0))
    kv.write_tokens(block, 0, values.to(pool.device))
    kv.seal(block)
    assert bool(kv.intact(block))
    kv.inject_bit_flip(int(block), byte_offset=layout.block_bytes - 1, bit=6)
    assert not bool(kv.intact(block))


def test_checksums_of_many_blocks_are_taken_in_chunks_and_agree_block_by_block(monkeypatch):
    pool, kv = kv_pool(n=40, block_size=4)
    blocks = pool.get_new_blocks_tensor(39)
    kv.write_tokens(blocks, 0, torch.arange(39 * 4, dtype=torch.int64, device=pool.device) * 7919)
    one_by_one = torch.stack([kv.block_checksums(b.reshape(1))[0] for b in blocks])
    monkeypatch.setattr(kv, "_checksum_chunk", 5)
    assert torch.equal(kv.block_checksums(blocks), one_by_one)
    assert torch.unique(one_by_one).numel() == 39


# --- the manager's step writes ----------------------------------------------------------------------


def test_each_step_writes_exactly_the_tokens_it_makes_resident():
    m = TensorKVCacheManager(8, 4, device=pick_device())
    r = Request("a", tuple(range(10)))
    assert m.allocate_slots(r, 6) == [1, 2]  # a chunked prefill: tokens 0..5
    values = prefix_kv_source(r, 0, 10)
    assert [v for page in m.read_kv([1, 2]) for v in page] == values[:6] + [0, 0]
    assert m.allocate_slots(r, 4) == [3]  # the rest: tokens 6..9
    assert [v for page in m.read_kv([1, 2, 3]) for v in page] == values + [0, 0]
    r2 = Request("b", tuple(range(10)) + (5, 5))
    hit, num_hit_tokens = m.get_computed_blocks(r2)
    assert (hit, num_hit_tokens) == ([1, 2], 8)
    # The hit is not rewritten; two tokens are loaded by an external connector, two computed.
    assert m.allocate_slots(r2, 2, num_hit_tokens, hit, num_external_computed_tokens=2) == [4]
    assert m.read_kv([4])[0] == prefix_kv_source(r2, 8, 12)
    m.check_invariants()


def test_a_step_that_would_write_into_a_registered_block_is_refused_before_anything_changes():
    m = TensorKVCacheManager(8, 4, device=pick_device())
    r = Request("a", tuple(range(6)))
    m.allocate_slots(r, 5)  # blocks 1 (full, registered) and 2 (token 4 only)
    # Something outside the manager registers the half-written block 2.
    m.block_pool.cache_full_blocks([2], [BlockHash(b"not-full")])
    before, kv_before = m.snapshot(), m.kv_cache.kv.clone()
    with pytest.raises(NotWritable, match=r"^cannot write KV into block_id=2: ref_cnt=1 has_hash=True"):
        m.allocate_slots(r, 1)
    assert m.snapshot() == before and torch.equal(m.kv_cache.kv, kv_before)


@pytest.mark.parametrize(
    ("source", "message"),
    [
        (lambda req, start, end: [1] * (end - start + 1), r"the KV source gave 4 values for positions \[0, 3\)"),
        (lambda req, start, end: [1.5] * (end - start), r"the KV source must give int64 values .*float"),
        (lambda req, start, end: [1 << 70] * (end - start), r"the KV source must give int64 values"),
    ],
    ids=["too many", "floats", "beyond int64"],
)
def test_a_bad_kv_source_is_refused_before_anything_changes(source, message):
    m = TensorKVCacheManager(8, 4, device=pick_device())
    m.set_kv_source(source)
    before = m.snapshot()
    with pytest.raises(InvalidRequest, match=message):
        m.allocate_slots(Request("a", (1, 2, 3)), 3)
    assert m.snapshot() == before


def test_read_kv_names_a_bad_block():
    m = TensorKVCacheManager(8, 4, device=pick_device())
    with pytest.raises(InvalidBlock, match=r"^read_kv: block_id=-1 is not a block of this pool"):
        m.read_kv([-1])
