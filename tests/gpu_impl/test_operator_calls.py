"""What a short call costs in torch calls: none on the CPU, one synchronisation where the faces are two memories.

gpu_impl.block_pool's docstring tabulates these counts; this module keeps
the table true. A TorchFunctionMode sees every torch function and tensor
method a call makes (but not `torch.frombuffer`, a constructor outside the
override protocol); metadata reads (`dim`, `numel`, `dtype`) run no operator
and are not counted. No time is measured here: `kvspec bench gpu` does that.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch.overrides import TorchFunctionMode

from kvspec.gpu_impl.block_pool import TensorBlockPool
from kvspec.gpu_impl.device import cuda_available
from kvspec.gpu_impl.mirror import MirroredState
from kvspec.spec.state import BlockHash

_METADATA = {"dim", "numel", "size", "__get__", "is_floating_point"}
SYNC = ["tensor", "to", "unbind", "index_copy_"]  # one synchronisation of the two faces, host to device


class _Calls(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = getattr(func, "__name__", repr(func))
        if name not in _METADATA:
            self.names.append(name)
        return func(*args, **(kwargs or {}))


def torch_calls(call: Callable[[], object]) -> list[str]:
    with _Calls() as calls:
        call()
    return calls.names


def warm_pool(device: str, share_host_memory: bool | None = None) -> tuple[TensorBlockPool, list[int], list[int]]:
    """A pool with cached free blocks (hits to take) and held unhashed blocks (to free)."""
    p = TensorBlockPool(200, device=device, share_host_memory=share_host_memory)
    cached = p.get_new_blocks(20)
    p.cache_full_blocks(cached, [BlockHash(bytes([b])) for b in cached])
    p.free_blocks(cached[::-1])
    return p, cached, p.get_new_blocks(20)


def short_calls(p: TensorBlockPool, cached: list[int], held: list[int]) -> dict[str, Callable[[], object]]:
    """Every short operation, each on blocks in the state it needs."""
    return {
        "get_new_blocks(1)": lambda: p.get_new_blocks(1),
        "get_new_blocks(16)": lambda: p.get_new_blocks(16),
        "touch(1) of a free cached block": lambda: p.touch(cached[:1]),
        "touch(16)": lambda: p.touch(cached[1:17]),
        "cache_full_blocks(1)": lambda: p.cache_full_blocks(held[:1], [BlockHash(b"x")]),
        "free_blocks(1) of a hashed block": lambda: p.free_blocks(held[:1]),
        "free_blocks(16) unhashed": lambda: p.free_blocks(held[1:17][::-1]),
        "evict_blocks(2)": lambda: p.evict_blocks(cached[17:19]),
    }


def test_a_short_call_on_the_cpu_makes_no_torch_call():
    p, cached, held = warm_pool("cpu")
    for name, call in short_calls(p, cached, held).items():
        assert torch_calls(call) == [], name
    for name, call in {
        "get_cached_block": lambda: p.get_cached_block(BlockHash(bytes([cached[0]]))),
        "is_block_writable": lambda: p.is_block_writable(held[-1]),
        "get_num_free_blocks": p.get_num_free_blocks,
        "get_usage": p.get_usage,
        "get_new_blocks_tensor(1)": lambda: p.get_new_blocks_tensor(1),  # torch.frombuffer, not seen
    }.items():
        assert torch_calls(call) == [], name
    assert torch_calls(lambda: p.free_blocks(torch.tensor(held[-2:]))) == ["tensor", "tolist"]  # the test's tensor
    p.check_invariants()


def test_with_two_faces_a_short_call_makes_one_synchronisation_and_no_other_torch_call():
    p, cached, held = warm_pool("cpu", share_host_memory=False)
    for name, call in short_calls(p, cached, held).items():
        assert torch_calls(call) == SYNC, name
    assert torch_calls(lambda: p.get_cached_block(BlockHash(bytes([cached[0]])))) == []
    assert torch_calls(lambda: p.is_block_writable(held[-1])) == []
    p.check_invariants()


def long_batch_counts(p: TensorBlockPool, k: int) -> dict[str, int]:
    blocks = p.get_new_blocks(k)
    hashes = [BlockHash(b.to_bytes(4, "little")) for b in blocks]
    return {
        "cache_full_blocks": len(torch_calls(lambda: p.cache_full_blocks(blocks, hashes))),
        "free_blocks": len(torch_calls(lambda: p.free_blocks(blocks[::-1]))),
        "touch": len(torch_calls(lambda: p.touch(blocks[::2]))),
        "get_new_blocks (gaps)": len(torch_calls(lambda: p.get_new_blocks(k))),
    }


def test_a_long_batch_runs_a_bounded_number_of_torch_calls_whatever_its_length():
    p = TensorBlockPool(3000, device="cpu")
    for k in (300, 1000):
        counts = long_batch_counts(p, k)
        assert max(counts.values()) <= 22, counts


def test_two_faces_are_only_for_a_device_with_its_own_memory():
    with pytest.raises(ValueError, match=r"^share_host_memory=True but device=meta has its own memory"):
        MirroredState(4, torch.device("meta"), share_host_memory=True)


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs a CUDA device; this machine has none")
def test_on_cuda_a_short_call_makes_one_synchronisation_and_never_waits():
    p, cached, held = warm_pool("cuda")
    for name, call in short_calls(p, cached, held).items():
        assert torch_calls(call) == SYNC, name
    assert torch_calls(lambda: p.get_new_blocks_tensor(1)) == SYNC + ["tensor", "to"]
    p.check_invariants()
