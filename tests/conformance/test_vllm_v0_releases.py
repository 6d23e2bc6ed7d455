"""vLLM v0's real allocator and evictor from release wheels (downloaded once into the light-mode cache).

Three releases stand for the v0 generations the adapter speaks: 0.5.5
(evictor_v2.py, computed marks incremental),
0.6.6 (evictor.py, a deque, no reset_prefix_cache) and 0.7.3
(reset_prefix_cache); 0.4.2, an older allocator API, is refused by name.
"""

from __future__ import annotations

import pytest

from kvspec.conformance.core.adapter import AdapterConfig, capabilities
from kvspec.conformance.core.lockstep import ConformanceFailure, LockStep
from kvspec.conformance.core.results import Verdict
from kvspec.conformance.runner.run import run_check
from kvspec.conformance.targets.vllm import lightmode
from kvspec.conformance.targets.vllm.v0 import V0_RELEASES, load_lru_evictor, make_v0_light_adapter
from kvspec.spec.state import BlockHash, BlockId

pytestmark = pytest.mark.vllm

SAMPLE = ("0.5.5", "0.6.6", "0.7.3")


@pytest.mark.parametrize("version", SAMPLE)
def test_the_allocator_loads_from_the_wheel_with_only_the_sequence_type_a_placeholder(version: str) -> None:
    release = lightmode.load_release(version, layout=lightmode.V0)
    assert "vllm.core.block.prefix_caching_block" in release.modules
    assert release.placeholders_at_load <= {"vllm.sequence:Sequence"}
    assert load_lru_evictor(version).__name__ == "LRUEvictor"
    assert version in V0_RELEASES


@pytest.mark.parametrize("version", SAMPLE)
def test_v0_swaps_in_the_cached_block_when_a_full_block_repeats_a_cached_hash(version: str) -> None:
    # v0 keeps one block per hash: promoting block 2 under h1 frees it and takes a
    # second reference on block 1; the spec keeps both (block tables stay append-only)
    lock = LockStep(
        make_v0_light_adapter(version), AdapterConfig(level="pool", num_gpu_blocks=4, profile="lru-timestamp")
    )
    lock.check()
    lock.call("get_new_blocks", 2)
    lock.check()
    lock.call("cache_full_blocks", [BlockId(1), BlockId(2)], [BlockHash(b"\xa1" * 4)] * 2)
    with pytest.raises(ConformanceFailure) as caught:
        lock.check()
    message = caught.value.failure.message
    assert "ref_cnt: spec (0, 1, 1, 0) vs implementation (0, 2, 0, 0)" in message


@pytest.mark.parametrize("version", ["0.6.6", "0.7.3"])
def test_v0_reuses_the_last_freed_block_without_content_first_not_the_lowest_id(version: str) -> None:
    # lru-timestamp (seed 002) takes first fit: after freeing 1 then 2 the spec
    # hands out 1; v0's hashless free list is a deque used as a stack: 2 first
    adapter = make_v0_light_adapter(version)(AdapterConfig(level="pool", num_gpu_blocks=5, profile="lru-timestamp"))
    assert adapter.get_new_blocks(2) == [1, 2]
    adapter.free_blocks([BlockId(1), BlockId(2)])
    assert adapter.snapshot().free_queue == (2, 1, 3, 4)


def test_reset_prefix_cache_exists_from_0_7_0() -> None:
    config = AdapterConfig(level="pool", num_gpu_blocks=4)
    assert "reset_prefix_cache" not in capabilities(make_v0_light_adapter("0.6.6")(config))
    assert "reset_prefix_cache" in capabilities(make_v0_light_adapter("0.7.3")(config))


# The two differences the tests above pin down, as the check reports them. Which
# one a campaign shrinks to depends on the order Hypothesis draws in, so the
# check may report either, never a third.
V0_KNOWN_DIFFERENCES = {
    "cache_full_blocks": "ref_cnt: spec",  # the swap: one block per hash
    "free_blocks": "free_queue: spec",  # a block without content freed to the front
}


def test_the_oracle_s_check_diverges_under_every_profile_at_one_of_v0_s_known_differences(tmp_path: object) -> None:
    for profile in ("lru-timestamp", "vllm-v1", "vllm-v1-tail"):
        result = run_check("vllm-v0@0.6.6", level="pool", profile=profile, max_examples=50, trace_dir=str(tmp_path))
        assert result.verdict is Verdict.DIVERGES, profile
        failure = result.failure
        assert failure is not None and failure.op in V0_KNOWN_DIFFERENCES, (profile, failure)
        assert V0_KNOWN_DIFFERENCES[failure.op] in failure.message, (profile, failure.message)


def test_a_release_before_the_0_5_allocator_api_could_not_run_with_why() -> None:
    with pytest.raises(ValueError, match=r"^vllm==0\.4\.2 \(v0\): its allocator has no allocate_mutable_block"):
        make_v0_light_adapter("0.4.2")(AdapterConfig(level="pool", num_gpu_blocks=4))


@pytest.mark.parametrize("version", ["0.6.6", "0.7.3"])
def test_update_on_a_free_block_leaves_its_heap_entry_stale_so_it_is_never_evicted(version: str) -> None:
    # LRUEvictor.update changes last_accessed in free_table and pushes no heap entry;
    # evict drops an entry whose timestamp differs, so block 1 stays counted (num_blocks)
    # but is never handed out until a cleanup rebuilds the heap (heap > 50 x free_table)
    evictor = load_lru_evictor(version)()
    evictor.add(1, 101, 1, 1.0)
    evictor.add(2, 102, 1, 2.0)
    evictor.update(1, 3.0)
    assert evictor.evict() == (2, 102)
    assert evictor.num_blocks == 1
    with pytest.raises(ValueError, match="^No usable cache memory left$"):
        evictor.evict()


def test_before_0_6_5_update_on_a_free_block_does_not_move_it_in_the_eviction_order() -> None:
    # to 0.6.4.post1 the LRUEvictor is an OrderedDict scanned from its oldest insertion:
    # update changes the timestamp in place, so block 1, now the most recent, still goes first
    evictor = load_lru_evictor("0.5.5")()
    evictor.add(1, 101, 1, 1.0)
    evictor.add(2, 102, 1, 2.0)
    evictor.update(1, 3.0)
    assert evictor.evict() == (1, 101)


def test_the_evictor_benchmark_agrees_with_v0_s_real_lru_evictor_on_every_eviction() -> None:
    from kvspec.benchmarks.reference_bench import measure_v0_evictor

    # each replay asserts that every evicted block is the one LRU names
    (m,) = measure_v0_evictor(load_lru_evictor("0.7.3"), sizes=(50,), rounds=200, repeat=1)
    assert m.reference_seconds > 0 and m.v0_seconds > 0


def test_the_oracle_runs_a_v0_release_in_its_own_process_and_names_each_difference(tmp_path: object) -> None:
    from kvspec.conformance.tools.oracle import run_oracle
    from kvspec.conformance.tools.oracle_matrix import format_matrix

    (row,) = run_oracle(["0.6.6"], caching="both", max_examples=20, time_budget=30.0, trace_dir=str(tmp_path))
    on, off = row.cells["pool/on"], row.cells["pool/off"]
    assert on.status == "ran" and set(on.profiles) == {"lru-timestamp", "vllm-v1", "vllm-v1-tail"}
    assert on.conforms_to() == []
    assert off.status == "not run" and "NaiveBlockAllocator" in off.why  # no verdict: the exit code is 2
    verdicts = {p.name: p.verdict for p in row.probes}
    assert verdicts == {
        "full block of a cached hash swapped for the cached block": "diverges",
        "block without content reused last freed first not lowest id first": "diverges",
        "cached blocks not evicted oldest last access first": "conforms",
    }
    assert all(p.trace_path for p in row.probes if p.verdict == "diverges")
    assert "lru-timestamp diverges[1]" in format_matrix([row], ["pool"], ["on", "off"])


@pytest.mark.parametrize("version", ["0.6.6", "0.7.3"])
def test_in_one_scheduler_step_v0_evicts_every_sequence_s_deeper_blocks_before_any_parent(version: str) -> None:
    # v0's block manager records one `now` per sequence per scheduler step and, when the
    # sequence is freed, marks all its blocks with it (LastAccessBlocksTracker), so the evictor's
    # tie-break (more hashed tokens first) orders two sequences freed in that step by
    # depth across both: 2, 4, then 1, 3. The spec stamps per block in call order, so
    # freeing a tail first, then b, gives 2, 1, 4, 3 (docs/design.md, Profiles).
    module = lightmode.load_release(version, layout=lightmode.V0).module("vllm.core.block.prefix_caching_block")
    allocator = module.PrefixCachingBlockAllocator(num_blocks=4, block_size=1, block_ids=range(1, 5))

    def sequence(tokens: list[int]) -> list[object]:
        blocks, prev = [], None
        for token in tokens:
            prev = allocator.allocate_mutable_block(prev_block=prev)
            prev.append_token_ids([token])
            blocks.append(prev)
        return blocks

    a, b = sequence([10, 11]), sequence([20, 21])
    allocator.mark_blocks_as_accessed([1, 2, 3, 4], 5.0)
    allocator.mark_blocks_as_computed([])
    for block in a + b:  # v0's BlockTable.free frees a sequence's blocks head first
        allocator.free(block)
    assert [allocator.evictor.evict()[0] for _ in range(4)] == [2, 4, 1, 3]
