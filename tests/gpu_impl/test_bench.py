"""`kvspec bench gpu` runs end to end on a small grid: both implementations measured, pools kept equal.

The ratios are measured, never asserted: timing belongs to the benchmark run,
not to the suite. What is asserted is that every cell is measured for both
implementations, that the two pools end in the same state, and that the
verdict lines name the targets.
"""

from __future__ import annotations

from kvspec.benchmarks.gpu_bench import OPERATIONS, main, measure, measure_hash_map, render
from kvspec.gpu_impl.device import pick_device


def test_a_small_grid_measures_every_cell_for_both_implementations():
    results = measure(pools=(64, 300), batches=(1, 16, 100, 1000), seconds_per_cell=0.001, max_rounds=3)
    cells = {(m.num_gpu_blocks, m.batch, m.operation) for m in results}
    expected = {(p, b, op) for p in (64, 300) for b in (1, 16, 100) if b < p for op in OPERATIONS}
    assert cells == expected  # a batch larger than the pool's free blocks is skipped
    assert all(m.reference > 0 and m.gpu > 0 and m.gpu_tensor > 0 and m.num_calls >= 3 for m in results)
    table = render(results, str(pick_device()))
    assert "ratio = reference / gpu_impl" in table
    assert ("CUDA target" in table) if pick_device().type == "cuda" else ("CPU target, batch     1" in table)


def test_the_hash_map_comparison_agrees_on_the_answers():
    timing = measure_hash_map(num_entries=1000, chain_length=50)
    assert timing.dict_lookup > 0 and timing.table_lookup > 0 and timing.chain_length == 50


def test_main_prints_the_table_and_refuses_bad_arguments(capsys):
    assert main(["--pools", "40", "--batches", "1", "8", "--seconds", "0.001", "--no-hash-map"]) == 0
    out = capsys.readouterr().out
    assert "get_new_blocks" in out and "free_blocks" in out and "touch" in out
    assert main(["--pools", "1"]) == 2
    assert "pools must be >= 2" in capsys.readouterr().err
    assert main(["--device", "tpu"]) == 2
    assert "is not a device name torch knows" in capsys.readouterr().err
