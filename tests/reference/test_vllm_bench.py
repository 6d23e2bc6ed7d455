"""The reference-against-vLLM benchmark: its trace and its "no checks" row mean what they say (not timing tests)."""

from __future__ import annotations

from typing import Any

import pytest

from kvspec.benchmarks import vllm_bench
from kvspec.reference import BlockPool


def _replay(num_blocks: int, checked_touch: bool) -> BlockPool:
    pool = BlockPool(num_blocks, True)
    vllm_bench._run(vllm_bench.reference_ops(pool, checked_touch), vllm_bench.make_trace(400, seed=3), num_blocks)
    return pool


def test_the_trace_hits_shared_prefixes_and_evicts() -> None:
    calls: dict[str, list[Any]] = {"touch": [], "evicted": []}
    pool = BlockPool(200, True)
    get_new_blocks = pool.get_new_blocks

    def take(n: int) -> list[int]:
        before = len(pool.cached_block_hash_to_block)
        out = get_new_blocks(n)
        calls["evicted"].append(before - len(pool.cached_block_hash_to_block))
        return list(out)

    ops = vllm_bench.reference_ops(pool)
    ops["touch"] = lambda ids: (calls["touch"].append(list(ids)), pool.touch(ids))
    ops["get_new_blocks"] = take
    spent = vllm_bench._run(ops, vllm_bench.make_trace(400, seed=3), 200)
    assert set(spent) == set(vllm_bench.OPS) - {"construct"}
    assert sum(len(ids) for ids in calls["touch"]) > 400  # prefix hits, several blocks a request
    assert sum(calls["evicted"]) > 0  # allocation evicted cached blocks
    pool.check_invariants()
    assert pool.get_num_free_blocks() == 199  # every request was freed at the end


@pytest.mark.parametrize("num_blocks", [120, 1000])
def test_touch_without_checks_does_the_references_work(num_blocks: int) -> None:
    checked, unchecked = _replay(num_blocks, True), _replay(num_blocks, False)
    assert unchecked.snapshot() == checked.snapshot()
    unchecked.check_invariants()


@pytest.mark.vllm
def test_vllm_bench_runs_against_the_newest_release() -> None:
    trace = vllm_bench.make_trace(300)
    reference, vllm = vllm_bench.bench_reference(2000, trace), vllm_bench.bench_vllm("0.33.0", 2000, trace)
    assert set(reference) == set(vllm) == set(vllm_bench.OPS)
    assert all(v > 0 for v in (*reference.values(), *vllm.values()))
    reference_rate, vllm_rate = vllm_bench.harness_speed("0.33.0", max_examples=10)
    assert reference_rate > 0 and vllm_rate > 0
