"""The plugin targets, fetched from the package registry and checked (KVSPEC_VLLM=1, scripts/test-vllm.sh).

Each target's campaigns must give the verdict recorded here, every failure
a known divergence of that target; each directed probe must fail at the
recorded step with the recorded finding (or conform where recorded). A
plugin release that fixes a divergence, or adds one, changes a line here.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kvspec.conformance.core.adapter import AdapterConfig
from kvspec.conformance.core.results import Verdict
from kvspec.conformance.runner.run import replay, run_check
from kvspec.conformance.targets.plugins import kvcached, tpu_inference, vllm_mlx
from kvspec.conformance.targets.plugins.dist import fetch_dist
from kvspec.conformance.targets.plugins.findings import match_finding, run_probe
from kvspec.conformance.targets.plugins.targets import TARGETS
from kvspec.spec.manager import Request
from kvspec.spec.state import BlockId

pytestmark = pytest.mark.vllm
logging.disable(logging.WARNING)

# (target, vLLM release or None, level, caching) -> the campaign's verdict under the claimed profile
CAMPAIGNS: dict[tuple[str, str | None, str, bool], Verdict | tuple[Verdict, ...]] = {
    ("vllm-mlx", None, "pool", True): Verdict.CONFORMS,
    ("vllm-mlx", None, "pool", False): Verdict.CONFORMS,
    ("vllm-mlx", None, "manager", True): Verdict.DIVERGES,
    ("vllm-mlx", None, "manager", False): Verdict.DIVERGES,
    ("kvcached", None, "pool", True): Verdict.DIVERGES,
    ("kvcached", None, "pool", False): Verdict.DIVERGES,
    ("kvcached", "0.33.0", "pool", True): Verdict.DIVERGES,
    ("kvcached", "0.33.0", "pool", False): Verdict.DIVERGES,
    # Two findings (no-prepend-n crashes a free, single-block-from-the-top diverges at the first one-block
    # allocation): which one a campaign meets first depends on its draws, and either is a described finding.
    ("tpu-inference", None, "pool", True): (Verdict.CRASHED, Verdict.DIVERGES),
    ("tpu-inference", None, "pool", False): Verdict.CRASHED,  # a double free reaches the missing prepend_n
    ("vllm-ascend", None, "pool", True): Verdict.CONFORMS,
    ("vllm-ascend", None, "pool", False): Verdict.CONFORMS,
}

# (target, release) -> probe name -> (step, finding) of its first failing check; None: it conforms
PROBES: dict[tuple[str, str | None], dict[str, tuple[int, str] | None]] = {
    ("vllm-mlx", None): {
        "double free": (3, "double-free-keyerror"),
        "null block touched": (1, "null-touch-counted"),
        "null block freed": (1, "null-free-skipped"),
        "cached block registered again": (3, "registered-again-skipped"),
        "reset refused while a block is held": None,
        "a block reused after another prefix": (4, "block-keyed-by-own-tokens"),
        "a freed block's old key still hits": (5, "stale-key-after-reuse"),
        "a hit across LoRA adapters": (3, "extra-keys-ignored"),
        "a hit covers the whole prompt": (3, "no-hit-cap"),
        "part of an allocation when blocks run out": (2, "partial-allocation"),
        "a request freed head first": (3, "freed-head-first"),
        "hashes registered with caching off": (2, "hashes-with-caching-off"),
    },
    ("kvcached", None): {
        "a block without a hash reused oldest-freed first": (2, "hashless-reused-oldest-first"),
        "usage counts the null block": (2, "usage-counts-null"),
        "cached blocks evicted least recently freed first": None,
        "reset accepted while a block is held": None,
        "reset accepted while a block is held, caching off": (2, "reset-accepted-while-held-caching-off"),
        "a freed block keeps its ref_cnt, caching off": None,
        "cached block registered again": (3, "registered-again-assert"),
    },
    ("kvcached", "0.33.0"): {
        "a block without a hash reused oldest-freed first": (2, "hashless-reused-oldest-first"),
        "usage counts the null block": (2, "usage-counts-null"),
        "cached blocks evicted least recently freed first": None,
        "reset accepted while a block is held": (3, "reset-accepted-while-held"),
        "reset accepted while a block is held, caching off": (2, "reset-accepted-while-held-caching-off"),
        "a freed block keeps its ref_cnt, caching off": (2, "freed-ref-kept-caching-off"),
        "cached block registered again": (3, "registered-again-skipped"),
    },
    ("tpu-inference", None): {
        "free_blocks raises": (2, "no-prepend-n"),
        "one block taken from the top": (1, "single-block-from-the-top"),
        "a run of blocks taken lowest first": None,
    },
    ("vllm-ascend", None): {
        "double free dropped with a warning": (3, "double-free-dropped"),
        "a block named twice in one free dropped with a warning": (2, "named-twice-dropped"),
        "null block freed": (1, "null-free-passed-through"),
        "cached block registered again": (3, "registered-again-assert"),
    },
}


@pytest.mark.parametrize(("target", "base", "level", "caching"), list(CAMPAIGNS))
def test_campaign_verdict_and_a_known_divergence(
    target: str, base: str | None, level: str, caching: bool, tmp_path: Path
) -> None:
    t = TARGETS[target]
    impl = t.impl_name(base)
    result = run_check(impl, level=level, enable_caching=caching, profile=t.profile, max_examples=60,
                       trace_dir=tmp_path, impl=impl)  # fmt: skip
    expected = CAMPAIGNS[(target, base, level, caching)]
    assert result.verdict in (expected if isinstance(expected, tuple) else (expected,)), (
        result.failure or result.message
    )
    if result.failure is not None:
        found = match_finding(t.findings, result.failure, caching)
        assert found is not None, f"a divergence not described yet: {result.failure.story}"
        again = replay(result.failure.trace_path, impl, trace_dir=tmp_path)  # the trace names the target
        assert again.verdict is result.verdict


@pytest.mark.parametrize(("target", "base"), list(PROBES))
def test_probes_fail_at_their_recorded_check(target: str, base: str | None, tmp_path: Path) -> None:
    t = TARGETS[target]
    factory = t.factory(base)
    seen: dict[str, tuple[int, str] | None] = {}
    for probe in t.probes:
        result = run_probe(factory, probe, t.profile, str(tmp_path), t.impl_name(base))
        assert result is not None, f"{probe.name}: the adapter lacks one of its operations"
        if result.verdict == Verdict.CONFORMS.value:  # else the failure's kind
            seen[probe.name] = None
            continue
        found = match_finding(t.findings, result, probe.caching)
        seen[probe.name] = (result.step or 0, found.key if found else f"unknown: {result.message}")
    assert seen == PROBES[(target, base)]


def test_vllm_ascend_declared_ignored_mistakes_change_nothing_but_their_own_part() -> None:
    t = TARGETS["vllm-ascend"]
    for probe in t.probes:
        if probe.ignored_as is not None:
            result = run_probe(t.factory(), probe, t.profile, None, "vllm-ascend")
            assert result is not None and result.message.endswith(
                "declared ignored: the good part of the call applied and the bad part changed nothing"
            )


def test_vllm_ascend_campaigns_send_its_ignored_mistakes_and_check_them(tmp_path: Path) -> None:
    t = TARGETS["vllm-ascend"]
    result = run_check(t.impl_name(None), level="pool", enable_caching=True, profile=t.profile, max_examples=60,
                       trace_dir=tmp_path)  # fmt: skip
    assert result.verdict is Verdict.CONFORMS, result.failure
    for mistake in ("free_blocks: double free", "free_blocks: named twice"):
        assert result.mistakes_checked.get(mistake, 0) > 0 and result.reactions[mistake].startswith("ignores")


def test_tpu_inference_still_injects_the_queue_as_the_overlay_does() -> None:
    source = (fetch_dist(tpu_inference.DIST) / "tpu_inference/core/core_tpu.py").read_text()
    assert all(line in source for line in tpu_inference.INJECTION)


def test_kvcached_hands_out_a_page_s_blocks_in_fifo_order() -> None:
    # one page; blocks freed without a hash go to its end, cached ones wait in the LRU dictionary
    pool = kvcached.factory()(AdapterConfig(level="pool", num_gpu_blocks=6))
    assert pool.get_new_blocks(3) == [1, 2, 3]
    pool.cache_full_blocks([BlockId(1)], [b"\x01"])
    pool.free_blocks([BlockId(3), BlockId(2), BlockId(1)])
    assert pool.snapshot().free_queue == (4, 5, 3, 2, 1)
    assert pool.get_new_blocks(5) == [4, 5, 3, 2, 1]  # the cached block is evicted last


def test_vllm_mlx_hands_a_request_another_request_s_block_under_an_old_key() -> None:
    # the stale-key divergence, end to end: block 1 holds o's KV when g's prompt hits it
    mlx = vllm_mlx.MlxPrefixCacheAdapter(AdapterConfig(level="manager", num_gpu_blocks=3, block_size=4))
    first, other, again = Request("f", (1, 2, 3, 4)), Request("o", tuple(range(5, 13))), Request("g", (1, 2, 3, 4, 99))
    assert mlx.allocate_slots(first, 4) == [1]
    mlx.free("f")
    assert mlx.allocate_slots(other, 8) == [2, 1]
    assert mlx.get_computed_blocks(again) == ([1], 4)
