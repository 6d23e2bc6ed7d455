"""What a call costs in torch calls: a short one none, a long one a fixed number whatever its length, and
none of them on the device.

gpu_impl.block_pool's docstring tabulates these counts; this module keeps
the table true. Every decision is made on the host face (gpu_impl.mirror);
where the faces are two memories (`share_host_memory=False` on the CPU runs
the path CUDA takes) a call's writes wait on the host and go to the device
face in one copy when it is next read.

The counts come from kvspec.benchmarks.torch_calls (which `kvspec bench gpu`
prints beside its timings): torch calls on the host, on the device, and the
waits for the device. No time is measured here: `kvspec bench gpu` does that.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kvspec.benchmarks.torch_calls import Costs, calls_of, on_the_device
from kvspec.gpu_impl.block_pool import TensorBlockPool
from kvspec.gpu_impl.device import cuda_available
from kvspec.gpu_impl.mirror import MirroredState
from kvspec.spec.state import BlockHash

# The device face brought up to date: the entries Python wrote, staged (a few from a list, `tensor`; more
# gathered: the marked blocks' rows expanded to their entries, `__getitem__`, `mul`, `add`, `view`, joined to
# the single entries marked, `cat`, their values gathered, `__getitem__` and `stack`), copied host to device
# (`to`), split and scattered.
SYNC_FEW = ["tensor", "to", "unbind", "index_copy_"]
SYNC = ["__getitem__", "mul", "add", "view", "cat", "__getitem__", "stack", "to", "unbind", "index_copy_"]


def torch_calls(call: Callable[[], object], pool: TensorBlockPool | None = None) -> list[str]:
    return calls_of(call, pool).names


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


def test_with_two_faces_a_short_call_makes_no_torch_call_and_the_next_read_of_the_device_face_one_copy():
    p, cached, held = warm_pool("cpu", share_host_memory=False)
    assert torch_calls(lambda: p.ref_cnt) == SYNC  # the set-up's writes go across when the device face is read
    for name, call in short_calls(p, cached, held).items():
        assert torch_calls(call) == [], name
    assert torch_calls(lambda: p.get_cached_block(BlockHash(bytes([cached[0]])))) == []
    assert torch_calls(lambda: p.is_block_writable(held[-1])) == []
    state = p._state
    snapshot = p.snapshot()  # the host face: current, and reading it sends nothing across
    assert not torch.equal(state.tensor, state.host_tensor), "the device face should still wait"
    assert torch_calls(lambda: p.has_hash) == SYNC  # eight calls' writes, one copy
    assert torch.equal(state.tensor, state.host_tensor) and p.snapshot() == snapshot
    assert torch_calls(lambda: p.ref_cnt) == []  # nothing left to copy
    p.free_blocks(p.get_new_blocks(1))  # a few entries: staged from a list
    assert torch_calls(p.sync_device) == SYNC_FEW
    p.check_invariants()


def test_the_writes_waiting_on_the_host_stay_bounded():
    from kvspec.gpu_impl import mirror

    p = TensorBlockPool(64, device="cpu", share_host_memory=False)
    p.sync_device()
    most = 0
    for _ in range(mirror._LAZY_HOST_MAX // 4 + 10):  # a take and a free write 4 entries or more each
        p.free_blocks(p.get_new_blocks(1))
        most = max(most, len(p._state._host_marks) + p._state.row_width * len(p._state._row_marks))
    assert most <= mirror._LAZY_HOST_MAX + 16, most
    p.check_invariants()


# Per long operation, faces in two memories, nothing waiting on the host: torch calls on the host, on the
# device, and waits for the device; the same for 1,000 and 100,000 blocks. With ids in a list nothing runs
# on the device. With ids on the device, one wait (`cpu`: the ids are read before anything changes, so a bad
# id raises at the call that passed it, with nothing changed); ids handed back on the device, one upload
# (`to`) and no wait. A change here is a change of gpu_impl.block_pool's cost table (issue 29).
LONG_CALL_COSTS = {
    "get_new_blocks": Costs(6, 0, 0),
    "cache_full_blocks": Costs(16, 0, 0),
    "free_blocks": Costs(20, 0, 0),
    "touch": Costs(18, 0, 0),
    "get_new_blocks_tensor": Costs(11, 1, 0),  # the queue has gaps (the hits): the taken slots found
    "free_blocks, ids on the device": Costs(19, 1, 1),
    "touch, ids on the device": Costs(18, 1, 1),
}
# The kernels each long call leaves for the device face's next read: its tensor writes, replayed there.
LONG_CALL_KERNELS = {
    "get_new_blocks": 3,  # ref counts, hash flags, the queue's slots
    "cache_full_blocks": 1,  # hash flags
    "free_blocks": 3,  # ref counts, the queue's keys and slots
    "touch": 2,  # ref counts, the queue's slots
    "get_new_blocks_tensor": 3,
    "free_blocks, ids on the device": 3,
    "touch, ids on the device": 2,
}
# The device face brought up to date (SYNC) after short calls: staged on the host, copied, scattered.
PUSH = Costs(7, 3, 0)


def replayed(p: TensorBlockPool) -> int:
    return len(p._state._replays)


@pytest.mark.parametrize("batch", [1, 16, 1000, 100_000])
def test_each_operation_costs_the_torch_calls_and_waits_its_batch_length_says(batch: int):
    p = TensorBlockPool(4 * batch + 10, device="cpu", share_host_memory=False)
    p.sync_device()
    blocks: list[int] = []
    taken: list[torch.Tensor] = []
    kernels: dict[str, int] = {}

    def counted(op: str, call: Callable[[], object]) -> Costs:
        before = replayed(p)
        costs = calls_of(call, p)
        kernels[op] = replayed(p) - before
        return costs

    calls = {
        "get_new_blocks": counted("get_new_blocks", lambda: blocks.extend(p.get_new_blocks(batch))),
        "cache_full_blocks": counted(
            "cache_full_blocks",
            lambda: p.cache_full_blocks(blocks, [BlockHash(b.to_bytes(4, "little")) for b in blocks]),
        ),
        "free_blocks": counted("free_blocks", lambda: p.free_blocks(blocks[::-1])),
        "touch": counted("touch", lambda: p.touch(blocks)),
    }
    p.free_blocks(blocks[::-1])  # cached and free again, for the same touch with the ids on the device
    hits = on_the_device(p, blocks)
    calls["touch, ids on the device"] = counted("touch, ids on the device", lambda: p.touch(hits))
    calls["get_new_blocks_tensor"] = counted(
        "get_new_blocks_tensor", lambda: taken.append(p.get_new_blocks_tensor(batch))
    )
    reversed_taken = on_the_device(p, taken[0].tolist()[::-1])
    calls["free_blocks, ids on the device"] = counted(
        "free_blocks, ids on the device", lambda: p.free_blocks(reversed_taken)
    )
    costs = {op: c.costs() for op, c in calls.items()}
    names = {op: (c.names, c.on_device) for op, c in calls.items()}
    if batch <= p.python_path_max:
        short = dict.fromkeys(calls, Costs(0, 0, 0))
        short["get_new_blocks_tensor"] = Costs(1, 1, 0)  # the ids staged and uploaded (`tensor`, `to`)
        for op in ("touch, ids on the device", "free_blocks, ids on the device"):
            short[op] = Costs(0, 1, 1)  # one `tolist` (a wait)
        assert costs == short, names
        assert kernels == dict.fromkeys(calls, 0)  # Python's writes: marks, not kernels
        assert calls_of(p.sync_device, p).costs() == PUSH
    else:
        assert costs == LONG_CALL_COSTS, names
        assert kernels == LONG_CALL_KERNELS
        # The push: the replayed writes' arguments in one upload (`to`, then `split`), one kernel each, no wait.
        waiting = replayed(p)
        push = calls_of(p.sync_device, p)
        assert (push.costs().device, push.costs().waits) == (2 + waiting, 0), push.names
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


def keyed_round_costs(profile: str, k: int) -> dict[str, Costs]:
    """The costs of one round of k-block calls under a keyed policy, the faces in two memories; the evicting
    take meets a stale entry for every block hit since its free (half of the cached ones)."""
    p = TensorBlockPool(3 * k + 10, profile=profile, device="cpu", share_host_memory=False)
    p.sync_device()
    blocks: list[int] = []
    hashes = [BlockHash(b.to_bytes(4, "little")) for b in range(1, k + 1)]
    calls = {
        "get_new_blocks": lambda: blocks.extend(p.get_new_blocks(k)),
        "cache_full_blocks": lambda: p.cache_full_blocks(blocks, hashes),
        "free_blocks": lambda: p.free_blocks(blocks[::-1]),
        "touch": lambda: p.touch(blocks[::2]),
        "free_blocks of hit blocks": lambda: p.free_blocks(blocks[::2][::-1]),
        "get_new_blocks that evicts": lambda: p.get_new_blocks(2 * k + 9 + k // 2),
    }
    costs = {op: calls_of(call, p).costs() for op, call in calls.items()}
    p.check_invariants()
    return costs


@pytest.mark.parametrize("profile", ["lru-timestamp", "block-age", "lfu", "lru-lfu:0.5"])
def test_under_a_keyed_policy_a_long_call_costs_the_same_at_any_length_and_nothing_on_the_device(profile):
    """A keyed order is host metadata (gpu_impl.stamped_free): a long call's stamps, keys and selection are
    torch calls on the host, as many at 1,000 blocks as at 10,000, none on the device and no wait. The
    evicting take's first slice counts the stale entries it meets and sizes the next by them: two slices at
    any length, not one a halving of the need."""
    short, long = keyed_round_costs(profile, 1000), keyed_round_costs(profile, 10_000)
    assert short == long
    assert all((c.device, c.waits) == (0, 0) for c in short.values()), short


def test_two_faces_are_only_for_a_device_with_its_own_memory():
    with pytest.raises(ValueError, match=r"^share_host_memory=True but device=meta has its own memory"):
        MirroredState(4, torch.device("meta"), share_host_memory=True)


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs a CUDA device; this machine has none")
def test_on_cuda_a_short_call_makes_no_torch_call_and_a_long_one_waits_only_to_read_ids_on_the_device():
    p, cached, held = warm_pool("cuda")
    p.sync_device()
    for name, call in short_calls(p, cached, held).items():
        assert torch_calls(call) == [], name
    assert torch_calls(lambda: p.get_new_blocks_tensor(1)) == ["tensor", "to"]
    assert torch_calls(p.sync_device) == SYNC  # their writes, in one copy, when asked (or the device face read)
    p = TensorBlockPool(5000, device="cuda")
    blocks = p.get_new_blocks(2000)  # long batches: nothing on the device but the ids handed back, no wait
    taken: list[torch.Tensor] = []
    calls = {
        "free_blocks": calls_of(lambda: p.free_blocks(blocks[::-1]), p),
        "get_new_blocks_tensor": calls_of(lambda: taken.append(p.get_new_blocks_tensor(2000)), p),
    }
    calls["free_blocks, ids on the device"] = calls_of(lambda: p.free_blocks(taken[0]), p)
    costs = {op: c.costs()[1:] for op, c in calls.items()}  # on the device (the host's calls add pinning)
    assert costs == {op: LONG_CALL_COSTS[op][1:] for op in costs}, {op: c.names for op, c in calls.items()}
    waiting = replayed(p)
    assert calls_of(p.sync_device, p).costs()[1:] == (2 + waiting, 0)  # one upload, one kernel a write, no wait
    p.check_invariants()
