"""KV cache groups in the harness: `--groups`, the group branches, traces, the demo and the benchmark."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvspec.benchmarks import harness_bench
from kvspec.conformance.core.adapter import AdapterConfig
from kvspec.conformance.core.coverage import expected_branches
from kvspec.conformance.core.results import Verdict
from kvspec.conformance.core.trace import dumps_trace, parse_trace, read_trace
from kvspec.conformance.runner.run import replay, run_check
from kvspec.conformance.targets.builtin import make_reference
from kvspec.conformance.tools.cli import main
from kvspec.conformance.tools.groups_demo import run_groups_demo
from kvspec.conformance.tools.view import build_view, trace_to_page_data
from kvspec.mutants.groups import KeyWithoutGroupId
from kvspec.reference.kv_cache_manager import KVCacheManager
from kvspec.spec.manager import Request
from tests.conformance.adapters import NoChunkedGroups

GROUP_BRANCHES = (
    "allocate_slots: skipped blocks freed",
    "allocate_slots: admitted with skipped positions",
    "allocate_slots: refused after freeing skipped blocks",
    "get_computed_blocks: sliding-window hit",
    "get_computed_blocks: hit cut by the coordinator",
)


@pytest.mark.heavy
@pytest.mark.parametrize("impl", ["reference", "spec"])
def test_two_groups_conform_and_reach_every_group_branch(impl: str) -> None:
    r = run_check(impl, level="manager", max_examples=50, isolate=False, groups="full,sliding:8", cover_rounds=6)
    assert r.verdict is Verdict.CONFORMS, r.message
    assert r.groups == "full,sliding:8"
    for branch in GROUP_BRANCHES:
        assert branch in r.branches and r.coverage[branch] > 0, branch
    assert not r.unreached


@pytest.mark.heavy
def test_chunked_local_attention_reaches_its_hit() -> None:
    # A caller mistake on an asynchronous load needs a load in flight: the rarest branch, hence the rounds.
    r = run_check("reference", level="manager", max_examples=100, isolate=False, groups="full,chunked:8",
                  cover_rounds=6)  # fmt: skip
    assert r.verdict is Verdict.CONFORMS and r.coverage["get_computed_blocks: chunked-local hit"] > 0
    assert not r.unreached


@pytest.mark.heavy
def test_drawn_layouts_conform() -> None:
    r = run_check("reference", level="manager", max_examples=60, isolate=False, groups="drawn")
    assert r.verdict is Verdict.CONFORMS, r.message


def test_a_layout_expects_only_its_own_branches() -> None:
    full = expected_branches("manager", True, "vllm-v1")
    assert not set(GROUP_BRANCHES) & set(full)  # one full-attention group: exactly the branches of before
    window = expected_branches("manager", True, "vllm-v1", "sliding:4")
    assert "get_computed_blocks: sliding-window hit" in window
    assert "get_computed_blocks: hit cut by the coordinator" not in window  # one attention type: nothing to cut
    assert "get_computed_blocks: chunked-local hit" not in window


def test_a_bad_layout_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    for layout in ("full,sliding:1", "full,window:8", "full,full,full,full", ""):
        assert main(["check", "--impl", "reference", "--groups", layout]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    r = run_check("reference", level="manager", groups="sliding:x", isolate=False)
    assert r.verdict is Verdict.COULD_NOT_RUN and "sliding:x" in r.message


def test_a_chunk_not_a_multiple_of_the_block_size_is_refused_and_changes_nothing() -> None:
    with pytest.raises(ValueError, match=r"chunk of 6 tokens is not a multiple of block_size=4"):
        make_reference(AdapterConfig("manager", 9, block_size=4, groups="full,chunked:6"))


def _undeclared(config: AdapterConfig) -> KVCacheManager:
    """The reference manager without the adapter's declarations: it never says it builds groups."""
    return KVCacheManager(config.num_gpu_blocks, config.block_size, config.enable_caching)


@pytest.mark.heavy
def test_an_adapter_that_does_not_declare_groups_is_not_applicable() -> None:
    r = run_check(_undeclared, level="manager", max_examples=10, isolate=False, groups="full,sliding:8")
    assert r.verdict is Verdict.NOT_APPLICABLE and "kv_cache_groups = True" in r.message
    assert run_check(_undeclared, level="manager", max_examples=100, isolate=False).verdict is Verdict.CONFORMS


@pytest.mark.heavy
def test_groups_auto_draws_the_attention_types_an_adapter_builds() -> None:
    # The default of `kvspec check`: every layout where the adapter declares groups, but only the
    # attention types its probe built; the others are named, their branches not expected.
    r = run_check(NoChunkedGroups, level="manager", max_examples=60, isolate=False, groups="auto")
    assert r.verdict is Verdict.CONFORMS, r.message
    assert r.groups == "drawn" and r.left_out == ("KV cache events and hit statistics (--events)",), r.left_out
    assert r.coverage["get_computed_blocks: sliding-window hit"] > 0
    assert "get_computed_blocks: chunked-local hit" not in r.branches
    not_built = "KV cache groups: not applicable, builds no layout like chunked:8"
    assert any(n.startswith(not_built) for n in r.not_exercised)
    undeclared = run_check(_undeclared, level="manager", max_examples=60, isolate=False, groups="auto")
    assert undeclared.verdict is Verdict.CONFORMS and undeclared.groups == "full", undeclared.message


@pytest.mark.heavy
def test_check_by_default_checks_what_the_implementation_provides_and_names_what_a_narrow_run_left_out(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    report = tmp_path / "r.json"
    main(["check", "--impl", "reference", "--level", "manager", "--caching", "off", "--max-examples", "20",
          "--json", str(report)])  # fmt: skip
    out = capsys.readouterr().out
    # The defaults go unsaid in the header: what a run checks beyond them, or leaves out, is said.
    header = "kvspec check: profile vllm-v1, seed 0, 20 examples x up to 50 steps per configuration"
    assert out.splitlines()[0] == header
    (row,) = json.loads(report.read_text(encoding="utf-8"))["results"]
    assert (row["groups"], row["events"], row["left_out"]) == ("drawn", True, [])
    assert "left out of this verdict" not in out
    main(["check", "--impl", "reference", "--level", "manager", "--caching", "off", "--max-examples", "20",
          "--groups", "full", "--no-events"])  # fmt: skip
    narrow = capsys.readouterr().out.strip().splitlines()
    assert "KV cache groups full only, KV cache events not checked" in narrow[0]
    assert narrow[-1] == (
        "left out of this verdict: KV cache group layouts other than full (--groups drawn); "
        "KV cache events and hit statistics (--events)"
    )


def test_a_trace_records_its_groups_and_replays_with_them(tmp_path) -> None:
    r = run_check(KeyWithoutGroupId, level="manager", max_examples=100, isolate=False, groups="full,sliding:8",
                  trace_dir=tmp_path)  # fmt: skip
    assert r.verdict is Verdict.DIVERGES and r.failure is not None and r.failure.trace_path is not None
    text = Path(r.failure.trace_path).read_text(encoding="utf-8")
    assert '"groups": "full,sliding:8"' in text.splitlines()[0]
    trace = read_trace(r.failure.trace_path)
    assert trace.config.groups == "full,sliding:8"
    assert parse_trace(dumps_trace(trace).splitlines()) == trace
    assert replay(trace, KeyWithoutGroupId, isolate=False).verdict is Verdict.DIVERGES
    assert replay(trace, make_reference, isolate=False).verdict is Verdict.CONFORMS
    page = build_view(trace_to_page_data(trace))  # the step-through page names the layout
    assert "KV cache groups full,sliding:8" in page["config_line"]


def test_the_demo_nulls_what_the_window_left_and_agrees_with_the_spec(capsys: pytest.CaptureFixture[str]) -> None:
    steps = run_groups_demo(make_reference, "full,sliding:8")
    assert all(not s.broken and s.agrees for s in steps)
    tables = dict(steps[-1].snapshot.block_tables or ())
    assert tables["B#1"][:3] == (0, 0, 0) and 0 not in tables["B"]
    assert main(["demo", "--groups", "full,sliding:8"]) == 0
    out = capsys.readouterr().out
    assert "sliding:8 [null null" in out and "every state holds every invariant and equals the spec's" in out


@pytest.mark.heavy
def test_the_harness_benchmark_prints_a_row_per_layout(capsys: pytest.CaptureFixture[str]) -> None:
    # A benchmark's rates stand at any budget: a short campaign may be inconclusive, never wrong.
    assert harness_bench.main(["--groups", "full", "full,sliding:8", "--max-examples", "20", "--seed", "3"]) == 0
    out = capsys.readouterr().out
    assert "full,sliding:8" in out and "steps/s" in out and "target: at least 1000" in out
    assert all(("conforms" in line or "inconclusive" in line) for line in out.splitlines() if line.startswith("full"))


def test_the_spec_request_ids_of_several_groups_may_not_name_a_table() -> None:
    from kvspec.spec import manager as spec_manager
    from kvspec.spec.errors import InvalidRequest

    state = spec_manager.new_manager(9, 4, groups="full,sliding:8")
    with pytest.raises(InvalidRequest, match="contains '#'"):
        spec_manager.allocate_slots(state, Request("a#1", (1, 2, 3)), 3)
