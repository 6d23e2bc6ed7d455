"""Traces saved before the harness was split into its parts replay to the verdict they recorded.

The files under tests/data/traces_before_the_split/ were written by `kvspec
mutants` at the commit before the operations table, the Step shape and the
runner's parts (trace format 1, unchanged since); they name their mutants by
the tests package they lived in then (kvspec.tests.mutants.*), which the
registry maps to kvspec.mutants.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvspec.conformance.core.trace import read_trace
from kvspec.conformance.runner.run import replay

TRACES = sorted((Path(__file__).resolve().parents[1] / "data" / "traces_before_the_split").glob("*.trace.jsonl"))


@pytest.mark.parametrize("path", TRACES, ids=lambda p: p.name.split(".")[0])
def test_a_trace_saved_before_the_split_replays_to_its_recorded_verdict(path, tmp_path):
    recorded = read_trace(path)
    assert recorded.impl is not None and recorded.impl.startswith("kvspec.tests.mutants.")
    again = replay(path, recorded.impl, trace_dir=tmp_path)
    assert again.verdict is recorded.verdict
    assert again.failure is not None and recorded.failure is not None
    assert (again.failure.kind, again.failure.step, again.failure.op) == (
        recorded.failure.kind,
        recorded.failure.step,
        recorded.failure.op,
    )


def test_there_are_traces_of_both_levels():
    assert {read_trace(p).config.level for p in TRACES} == {"pool", "manager"}
