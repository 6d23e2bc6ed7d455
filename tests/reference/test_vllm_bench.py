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


def test_the_trace_hits_held_and_free_cached_blocks_and_evicts() -> None:
    calls: dict[str, list[Any]] = {"free hits": [], "held hits": [], "evicted": []}
    pool = BlockPool(600, True)
    get_new_blocks = pool.get_new_blocks

    def take(n: int) -> list[int]:
        before = len(pool.cached_block_hash_to_block)
        out = get_new_blocks(n)
        calls["evicted"].append(before - len(pool.cached_block_hash_to_block))
        return list(out)

    def touch(ids: list[int]) -> None:
        free = sum(pool.blocks[b].ref_cnt == 0 for b in ids)
        calls["free hits"].append(free)
        calls["held hits"].append(len(ids) - free)
        pool.touch(ids)

    ops = vllm_bench.reference_ops(pool)
    ops.update(touch=touch, get_new_blocks=take)
    spent = vllm_bench._run(ops, vllm_bench.make_trace(3000, seed=3), 600)
    assert set(spent) == set(vllm_bench.OPS) - {"construct"}
    assert sum(calls["held hits"]) > 1000  # shared system prompts held by running requests
    assert sum(calls["free hits"]) > 1000  # a next turn takes its conversation's cached blocks out of the queue
    assert sum(calls["evicted"]) > 0  # allocation evicted cached blocks
    pool.check_invariants()
    assert pool.get_num_free_blocks() == 599  # every request was freed at the end


def test_at_most_max_num_seqs_requests_run_at_once() -> None:
    pool, running, most = BlockPool(100_000, True), [0], [0]
    ops = vllm_bench.reference_ops(pool)

    def take(n: int) -> list[int]:
        running[0] += 1
        most[0] = max(most[0], running[0])
        return list(pool.get_new_blocks(n))

    def free(ids: list[int]) -> None:
        running[0] -= 1
        pool.free_blocks(ids)

    ops.update(get_new_blocks=take, free_blocks=free)
    vllm_bench._run(ops, vllm_bench.make_trace(1000), 100_000)
    assert most[0] == vllm_bench.MAX_RUNNING  # the batch limit binds in a pool this large, and holds


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


def test_the_whole_trace_row_sums_every_operation_but_construction() -> None:
    trace = vllm_bench.make_trace(200)
    spent = vllm_bench.bench_reference(2000, trace)
    total = vllm_bench.whole_trace(spent)
    assert total == pytest.approx(sum(spent[op] for op in vllm_bench.OPS if op != "construct"))
    assert total > 0 and spent["construct"] > 0
