"""`kvspec check --events`: the KV cache events and hit statistics checked like the state.

Real campaigns (a child process, Hypothesis, the spec) against the built-in
implementations, which must conform with every event kind and counter
reached, and against adapters that publish no events, publish garbage or
take no hit cap, which must be reported as such, never passed quietly.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvspec.conformance.core.coverage import EVENT_BRANCHES, MANAGER_EVENT_BRANCHES
from kvspec.conformance.core.trace import read_trace
from kvspec.conformance.runner.run import replay, run_check
from kvspec.conformance.targets.builtin import ReferencePoolAdapter, make_reference, make_spec
from kvspec.mutants.events import EvictionWithoutBlockRemoved

N = 60


def check(factory, tmp_path, **kw):
    kw.setdefault("max_examples", N)
    # More rounds while a branch is unreached (they stop once every branch is reached): a branch left
    # unreached makes the verdict inconclusive.
    return run_check(factory, trace_dir=tmp_path, impl="under-test", events=True, cover_rounds=10, **kw)


@pytest.mark.heavy
@pytest.mark.parametrize("factory", [make_reference, make_spec], ids=["reference", "spec"])
@pytest.mark.parametrize("level", ["pool", "manager"])
def test_the_built_in_implementations_conform_with_every_event_and_counter_reached(factory, level, tmp_path):
    r = check(factory, tmp_path, level=level)
    assert r.verdict == "conforms", r.failure.story if r.failure else r.message
    expected = EVENT_BRANCHES + (MANAGER_EVENT_BRANCHES if level == "manager" else ())
    assert set(expected) <= set(r.branches)
    assert [b for b in expected if not r.coverage.get(b)] == []
    assert r.events and "take_events" not in r.absent_ops


@pytest.mark.heavy
def test_without_caching_only_the_clear_and_the_reset_count_are_expected(tmp_path):
    r = check(make_reference, tmp_path, level="manager", enable_caching=False)
    assert r.verdict == "conforms"
    assert {b for b in r.branches if b.startswith(("events", "stats"))} == {
        "events: AllBlocksCleared", "stats: external tokens counted apart", "stats: preempted request counted apart",
        "stats: reset recorded",
    }  # fmt: skip


class NoEvents(ReferencePoolAdapter):
    """A pool that publishes nothing: it has no take_events."""

    take_events = None  # type: ignore[assignment]


def test_an_adapter_without_events_is_checked_on_its_state_and_the_summary_says_so(tmp_path):
    r = check(NoEvents, tmp_path, level="pool")
    assert r.verdict == "conforms"
    assert "take_events" in r.absent_ops
    assert [b for b in r.unreached if b.startswith("events")] == []  # not expected of it, so not unreached


class GarbageEvents(ReferencePoolAdapter):
    def take_events(self):  # type: ignore[override]
        return "BlockStored"


def test_events_that_are_not_the_specs_types_are_a_crash_that_names_them(tmp_path):
    r = check(GarbageEvents, tmp_path, level="pool")
    assert r.verdict == "crashed"
    assert "take_events() returned str, not a list of events" in r.failure.message


def test_an_event_failure_is_saved_with_both_streams_and_replays(tmp_path):
    r = check(EvictionWithoutBlockRemoved, tmp_path, level="pool")
    assert r.verdict == "diverges" and r.failure.invariant == "event_mirror_exact"
    trace = read_trace(r.failure.trace_path)
    assert trace.config.events
    last = trace.steps[-1]
    assert any(type(e).__name__ == "BlockRemoved" for e in last.spec.events) and last.impl.events == ()
    again = replay(r.failure.trace_path, EvictionWithoutBlockRemoved)
    assert (again.verdict, again.failure.step, again.failure.message) == ("diverges", r.failure.step,
                                                                          r.failure.message)  # fmt: skip
    assert replay(r.failure.trace_path, make_reference).verdict == "conforms"


class OldManager:
    """A manager adapter written before the hit cap existed: get_computed_blocks takes the request alone."""

    def __init__(self, config):
        self._inner = make_reference(config)

    def get_computed_blocks(self, request):
        return self._inner.get_computed_blocks(request)

    def __getattr__(self, name):
        return getattr(self._inner, name)


@pytest.mark.heavy
def test_an_adapter_without_the_hit_cap_is_called_as_before_and_the_summary_says_so(tmp_path):
    r = run_check(OldManager, level="manager", max_examples=200, trace_dir=tmp_path)
    assert r.verdict == "conforms", r.failure.story if r.failure else r.message
    assert any(n.startswith("connector hit cap: not applicable") for n in r.not_exercised)


def test_the_command_line_checks_events_unless_told_not_to_and_then_says_so(tmp_path):
    cmd = [sys.executable, "-m", "kvspec", "check", "--impl", "reference", "--level", "pool", "--caching", "on",
           "--max-examples", "100", "--trace-dir", str(tmp_path), "--json", str(tmp_path / "r.json")]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    (row,) = json.loads((tmp_path / "r.json").read_text(encoding="utf-8"))["results"]
    assert row["events"] is True and "events: BlockStored" in row["branches_reached"]
    assert "result: 1 conforms (exit 0)" in out.stdout and "left out" not in out.stdout
    out = subprocess.run([*cmd, "--no-events"], capture_output=True, text=True, timeout=300)
    lines = out.stdout.splitlines()
    assert "KV cache events not checked" in lines[0], out.stdout
    result = lines.index("result: 1 conforms (exit 0)")
    assert lines[result + 1] == "left out of this verdict: KV cache events (--events)"  # no statistics in a pool
