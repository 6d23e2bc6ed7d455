"""vLLM v0's allocator behind the pool protocol, on a miniature v0 release written here (no download).

The miniature (v0_fixture/vllm: v0's names and shapes, first fit, one block
per hash) is zipped into a wheel and loaded by light mode's V0 layout as a
real release is; the real releases are in test_vllm_v0_releases.py.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvspec.conformance.core.adapter import AdapterConfig, capabilities
from kvspec.conformance.core.results import Verdict
from kvspec.conformance.runner.run import run_check
from kvspec.conformance.targets.vllm import lightmode
from kvspec.conformance.targets.vllm.v0 import VllmV0PoolAdapter, make_v0_light_adapter
from kvspec.spec.state import BlockHash, BlockId
from tests.conformance.miniature import miniature_release

FIXTURE = Path(__file__).parent / "v0_fixture"
MINI = "0.0.2"


@pytest.fixture(scope="module", autouse=True)
def mini_release(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The miniature in a light-mode cache of its own, named by $KVSPEC_VLLM_CACHE."""
    yield from miniature_release(tmp_path_factory, MINI, FIXTURE, lightmode.V0)


def _adapter(n: int = 5) -> VllmV0PoolAdapter:
    adapter = make_v0_light_adapter(MINI)(AdapterConfig(level="pool", num_gpu_blocks=n, profile="lru-timestamp"))
    assert isinstance(adapter, VllmV0PoolAdapter)
    return adapter


H1, H2 = BlockHash(b"\xa1" * 4), BlockHash(b"\xa2" * 4)


def test_the_v0_layout_runs_the_allocator_whole_and_only_device_from_vllm_utils() -> None:
    release = lightmode.load_release(MINI, layout=lightmode.V0)
    assert {"vllm.core.block.prefix_caching_block", "vllm.core.evictor", "vllm.utils"} <= set(release.modules)
    assert release.module("vllm.utils").Device.GPU.name == "GPU"  # real, from the miniature's source
    assert "torch" not in release.module("vllm.utils").__dict__  # the heavy import beside it did not run
    # the V1 layout of the same wheel is refused by name: it has no BlockPool
    with pytest.raises(lightmode.LightModeError, match=r"^cannot load vllm==0\.0\.2 in light mode \(v1\)"):
        lightmode.fetch_release(MINI, wheel=next(Path(os.environ["KVSPEC_VLLM_CACHE"]).glob("*.whl")))


def test_block_ids_hashes_and_the_clock_reach_v0s_own_structures() -> None:
    adapter = _adapter()
    assert adapter.get_new_blocks(3) == [1, 2, 3]
    adapter.cache_full_blocks([BlockId(1), BlockId(2)], [H1, H2])
    assert adapter.get_cached_block(H2) == 2 and adapter.get_cached_block(BlockHash(b"?")) is None
    adapter.free_blocks([BlockId(2), BlockId(1), BlockId(3)])  # stamped in this order: 2 is the oldest
    snap = adapter.snapshot()
    # unhashed first (the miniature's first fit), then the evictor's own order
    assert snap.free_queue == (3, 4, 2, 1)
    assert snap.ref_cnt == (0, 0, 0, 0, 0)
    adapter.touch([BlockId(1)])  # a hit through v0's hash table
    assert adapter.snapshot().ref_cnt[1] == 1 and adapter.snapshot().free_queue == (3, 4, 2)


def test_a_release_without_reset_prefix_cache_has_no_such_operation() -> None:
    assert "reset_prefix_cache" not in capabilities(_adapter())


def test_a_hash_already_cached_is_reported_as_v0_swaps_it_a_divergence_with_a_short_trace(tmp_path: Path) -> None:
    factory = make_v0_light_adapter(MINI)
    result = run_check(factory, level="pool", profile="lru-timestamp", max_examples=50, trace_dir=str(tmp_path))
    assert result.verdict is Verdict.DIVERGES
    assert result.failure is not None and result.failure.op == "cache_full_blocks"
    assert result.failure.num_steps <= 3
    assert "ref_cnt: spec (0, 1, 1" in result.failure.message  # the spec keeps both blocks; v0 swapped


def test_caching_off_and_the_request_level_are_refused_with_why() -> None:
    with pytest.raises(ValueError, match=r"^vllm==0\.0\.2 \(v0\): the adapter drives the prefix-caching"):
        make_v0_light_adapter(MINI)(AdapterConfig(level="pool", num_gpu_blocks=4, enable_caching=False))
    result = run_check(make_v0_light_adapter(MINI), level="manager", max_examples=5)
    assert result.verdict is Verdict.NOT_APPLICABLE


def test_the_evictor_benchmark_row_replays_one_trace_on_both_and_prints_each_size_s_ratio() -> None:
    from kvspec.benchmarks.reference_bench import measure_v0_evictor, render_v0_evictor
    from kvspec.conformance.targets.vllm.v0 import load_lru_evictor

    results = measure_v0_evictor(load_lru_evictor(MINI), sizes=(20, 40), rounds=30, repeat=1)
    assert [(m.num_blocks, m.num_operations) for m in results] == [(20, 120), (40, 120)]
    row = render_v0_evictor(results, MINI)
    assert row.startswith("keyed free vs v0 LRUEvictor (vllm==0.0.2") and "40 blocks:" in row
