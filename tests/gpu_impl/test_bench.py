"""`kvspec bench gpu` runs end to end on a small grid: both implementations measured, pools kept equal.

The ratios are measured, never asserted: timing belongs to the benchmark run,
not to the suite. What is asserted is that every cell is measured for both
implementations, that the two pools end in the same state, that the verdict
lines name the targets, and that the content check reads every hit back
(and fails the run when a block reads back other KV).
"""

from __future__ import annotations

import re

import pytest

from kvspec.benchmarks.gpu_bench import (
    OPERATIONS,
    Measurement,
    content_layers_that_fit,
    main,
    measure,
    measure_content,
    measure_hash_map,
    render,
)
from kvspec.gpu_impl.device import pick_device
from kvspec.gpu_impl.kv_cache import PagedKVCache
from kvspec.gpu_impl.sizing import KVLayout
from kvspec.spec.errors import InvalidRequest

TINY = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, block_size=2)  # 32 bytes a block


def test_a_small_grid_measures_every_cell_for_both_implementations():
    results = measure(pools=(64, 300), batches=(1, 16, 100, 1000), seconds_per_cell=0.001, max_rounds=3)
    cells = {(m.num_gpu_blocks, m.batch, m.operation) for m in results}
    expected = {(p, b, op) for p in (64, 300) for b in (1, 16, 100) if b < p for op in OPERATIONS}
    assert cells == expected  # a batch larger than the pool's free blocks is skipped
    assert all(m.reference > 0 and m.gpu > 0 and m.gpu_tensor > 0 and m.num_calls >= 3 for m in results)
    table = render(results, str(pick_device()))
    assert "ratio = reference / gpu_impl" in table
    assert ("CUDA target" in table) if pick_device().type == "cuda" else ("CPU target, batch     1" in table)


def test_both_paths_of_gpu_impl_are_measured_against_the_same_reference():
    for python_path_max in (0, 1000):  # every batch through the tensor path; every batch through the Python path
        results = measure(
            pools=(300,), batches=(16, 100), seconds_per_cell=0.001, max_rounds=3, python_path_max=python_path_max
        )
        assert {m.batch for m in results} == {16, 100}


@pytest.mark.parametrize("profile", ["lru-timestamp", "lfu", "lru-lfu:0.5"])
def test_every_keyed_policy_is_measured_with_the_pools_kept_equal(profile, capsys):
    # measure() compares the two pools' snapshots after each pool size (verify=True)
    results = measure(pools=(300,), batches=(1, 16), seconds_per_cell=0.001, max_rounds=3, profile=profile)
    assert {m.operation for m in results} == set(OPERATIONS)
    args = ["--pools", "40", "--batches", "1", "--seconds", "0.001", "--no-hash-map", "--no-content"]
    assert main([*args, "--profile", profile]) == 0
    assert f"profile {profile}:" in capsys.readouterr().out
    assert main([*args, "--profile", "mru"]) == 2
    assert "unknown profile 'mru'" in capsys.readouterr().err


def test_the_hash_map_comparison_agrees_on_the_answers():
    timing = measure_hash_map(num_entries=1000, chain_length=50)
    assert timing.dict_lookup > 0 and timing.table_lookup > 0 and timing.chain_length == 50


def test_the_content_check_reads_every_hit_block_back():
    timing = measure_content(num_blocks=30, layout=TINY, request_blocks=7)
    assert timing.is_intact and timing.num_requests == 5
    assert min(timing.write, timing.touch, timing.verify, timing.read_back) > 0
    table = render([], timing.device, content=timing)
    assert "KV content check" in table and "every hit block read back: intact" in table


def test_a_block_that_reads_back_other_kv_fails_the_run(monkeypatch, capsys):
    sealed = PagedKVCache.seal

    def seal_then_flip(self: PagedKVCache, block_ids):  # type: ignore[no-untyped-def]
        sealed(self, block_ids)
        self.inject_bit_flip(int(block_ids[-1]), byte_offset=3, bit=1)  # after the seal: corrupt on the next hit

    monkeypatch.setattr(PagedKVCache, "seal", seal_then_flip)
    timing = measure_content(num_blocks=6, layout=TINY, request_blocks=3)
    assert not timing.is_intact
    args = ["--pools", "40", "--batches", "1", "--seconds", "0.001", "--no-hash-map", "--content-blocks", "4"]
    assert main(args) == 1
    assert "MISMATCH" in capsys.readouterr().out
    with pytest.raises(InvalidRequest, match=r"not a whole number of 8-byte words"):
        measure_content(num_blocks=2, layout=KVLayout(1, 1, 1, 1))


def test_main_prints_the_tables_and_refuses_bad_arguments(capsys):
    args = ["--pools", "40", "--batches", "1", "8", "--seconds", "0.001", "--no-hash-map", "--content-blocks", "8"]
    assert main([*args, "--python-path-max", "0"]) == 0
    out = capsys.readouterr().out
    assert "get_new_blocks" in out and "free_blocks" in out and "touch" in out
    assert "ratio" in out and "KV content check" in out and "intact" in out
    assert main(["--pools", "1"]) == 2
    assert "pools must be >= 2" in capsys.readouterr().err
    assert main(["--device", "tpu"]) == 2
    assert "is not a device name torch knows" in capsys.readouterr().err
    assert main(["--quick", "--full"]) == 2  # one grid or the other
    assert main(["--content-layers", "0"]) == 2
    assert "content layers must be >= 1" in capsys.readouterr().err
    assert main(["--content-layers", "many"]) == 2


def test_auto_content_layers_fit_the_free_memory():
    assert 1 <= content_layers_that_fit(1000) <= 16


@pytest.mark.parametrize("profile", ["vllm-v1", "lru-timestamp"])
def test_with_events_both_pools_publish_and_their_events_are_compared(profile, capsys):
    # measure() drains and compares both pools' events after every round (and the snapshots at the end)
    results = measure(
        pools=(300,),
        batches=(1, 100),
        seconds_per_cell=0.001,
        max_rounds=3,
        profile=profile,
        python_path_max=16,
        events=True,
    )
    assert {m.batch for m in results} == {1, 100}  # 100 blocks: gpu_impl's long path publishes too
    args = ["--pools", "40", "--batches", "1", "--seconds", "0.001", "--no-hash-map", "--no-content", "--events"]
    assert main([*args, "--profile", profile]) == 0
    assert f"profile {profile}, KV cache events on:" in capsys.readouterr().out


def test_with_two_memories_each_row_carries_the_device_face_and_the_torch_calls(capsys):
    # The path CUDA takes, on the CPU: a long call's writes wait on the host and go across when the device
    # face is read; the table carries that time and the counts of tests/gpu_impl/test_operator_calls.py.
    results = measure(pools=(3000,), batches=(1, 1000), seconds_per_cell=0.001, max_rounds=3, two_memories=True)
    by_cell = {(m.batch, m.operation): m for m in results}
    assert all(m.device_face > 0 for m in results)
    assert by_cell[1, "free_blocks"].calls == (0, 0, 0)  # a short call: Python over the host face
    long_free = by_cell[1000, "free_blocks"]
    assert long_free.calls.device == 0 and long_free.tensor_calls.waits == 1  # lists: none; device ids: read once
    args = ["--pools", "3000", "--batches", "1", "1000", "--seconds", "0.001", "--no-hash-map", "--no-content"]
    assert main([*args, "--two-memories"]) == 0
    out = capsys.readouterr().out
    assert "device face" in out and "calls" in out and "(tensors)" in out
    # CUDA's path is held to CUDA's targets, said to be measured on the CPU; the CPU's own are for one memory
    assert "CUDA's targets against CUDA's path on the CPU" in out and "CUDA target, batch     1:" in out
    assert "CPU target" not in out
    assert "the floor of a long call with lists, 1,000 ids" in out
    assert "the floor of events" not in out  # measured with --events only
    assert main([*args, "--events"]) == 0
    events = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("the floor of events"))
    assert re.fullmatch(
        r"the floor of events, 1,000 BlockRemoved built: .+ from keys side by side in memory, .+ from keys read as "
        r"a pool holds them \(by block id, scattered in memory\), paid by a take of that many .+",
        events,
    )


def test_a_keyed_policy_is_held_to_its_own_1e5_target(capsys):
    # Seed 002's policies: take and free 10x, lists or device ids alike (touch and the 50x are the queue's).
    def row(operation: str, lists: float, ids: float) -> Measurement:
        return Measurement(1_000_000, 100_000, operation, 1.0, 1.0 / lists, 1.0 / ids, 3)

    results = [row("get_new_blocks", 12.0, 4.0), row("free_blocks", 15.0, 20.0), row("touch", 1.0, 1.0)]
    out = render(results, "cpu", None, None, "lru-timestamp", False, None, True)
    assert "CUDA target, keyed policy, 1e5-block take and free >= 10x faster: MISSED" in out
    assert "(worst 4.0x: get_new_blocks with device ids, pool 1,000,000)" in out
    assert "50x" not in out
    results = [row("get_new_blocks", 12.0, 11.0), row("free_blocks", 15.0, 20.0), row("touch", 1.0, 1.0)]
    assert "take and free >= 10x faster: met (worst 11.0x" in render(
        results, "cuda:0", None, None, "lfu", False, None, False
    )
    queue = render(results, "cuda:0", None, None, "vllm-v1", False, None, False)
    assert "keyed" not in queue and "50x faster with device ids: MISSED" in queue
