"""What only a CUDA device can show: the same pool on the GPU, bit flips in GPU memory, its free memory.

Every other gpu_impl test runs on CUDA too when it is present (the device is
picked, CUDA first); these need CUDA itself and skip without it.
"""

from __future__ import annotations

import random

import pytest
import torch

from kvspec.gpu_impl.block_pool import TensorBlockPool
from kvspec.gpu_impl.device import cuda_available
from kvspec.gpu_impl.kv_cache_manager import TensorKVCacheManager
from kvspec.gpu_impl.sizing import KVLayout, device_free_memory
from kvspec.reference import BlockPool
from kvspec.spec.manager import Request
from kvspec.spec.state import BlockHash

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cuda_available(), reason="needs a CUDA device; this machine has none"),
]


@pytest.mark.parametrize("python_path_max", [None, 0, 64], ids=["default", "tensor-path-only", "both-paths"])
def test_the_pool_on_cuda_matches_the_reference_on_long_batches(python_path_max):
    rng = random.Random(11)
    n = 5000
    gpu, ref = TensorBlockPool(n, device="cuda", python_path_max=python_path_max), BlockPool(n)
    assert gpu.ref_cnt.is_cuda and gpu.free_block_queue.key_to_block.is_cuda
    held: list[list[int]] = []
    for _ in range(200):
        if held and rng.random() < 0.45:
            blocks = held.pop(rng.randrange(len(held)))
            gpu.free_blocks(torch.tensor(blocks[::-1], device="cuda"))
            ref.free_blocks(blocks[::-1])
        elif rng.random() < 0.3:
            hashed = [b for b in range(1, n) if ref.blocks[b].block_hash is not None]
            hit = rng.sample(hashed, min(len(hashed), rng.randint(1, 400)))
            gpu.touch(hit)
            ref.touch(hit)
            held.append(hit)
        else:
            k = min(rng.randint(1, 700), ref.get_num_free_blocks())
            taken = gpu.get_new_blocks(k)
            assert taken == ref.get_new_blocks(k)
            full = taken[: rng.randint(0, k)]
            hashes = [BlockHash(rng.randrange(500).to_bytes(2, "big")) for _ in full]
            gpu.cache_full_blocks(full, hashes)
            ref.cache_full_blocks(full, hashes)
            held.append(taken)
    assert gpu.snapshot() == ref.snapshot()
    gpu.check_invariants()


def test_a_bit_flipped_in_gpu_memory_is_caught_on_hit():
    m = TensorKVCacheManager(16, 4, device="cuda")
    assert m.kv_cache.kv.is_cuda
    prompt = tuple(range(13))
    assert m.get_computed_blocks(Request("a", prompt)) == ([], 0)
    m.allocate_slots(Request("a", prompt), len(prompt))
    m.free("a")
    m.kv_cache.inject_bit_flip(2, byte_offset=17, bit=4)
    assert m.get_computed_blocks(Request("b", prompt)) == ([1], 4)
    assert m.snapshot().quarantined == (2,)
    m.check_invariants()


def test_a_pool_sized_from_the_devices_free_memory():
    free, _ = device_free_memory("cuda")
    layout = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16)
    pool = TensorBlockPool.from_memory(layout, margin=0.99, device="cuda")  # 1% of what is free
    plan = pool.capacity_plan
    assert plan is not None and plan.memory_source.startswith("free memory of cuda")
    assert abs(plan.memory_bytes - free) < 2**30  # read moments apart
    assert pool.num_gpu_blocks == plan.memory_bytes // 100 // layout.block_bytes
