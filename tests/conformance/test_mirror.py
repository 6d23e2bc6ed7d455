"""`kvspec mirror TRACE`: a trace's events replayed into a counting and a naive router mirror.

Traces are recorded by the lock-step core itself (LockStep driven by hand,
events on), so what is replayed is what `kvspec check --events` writes.
"""

from __future__ import annotations

import json

import pytest

from kvspec.conformance.core.adapter import AdapterConfig
from kvspec.conformance.core.lockstep import LockStep
from kvspec.conformance.core.trace import read_trace, write_trace
from kvspec.conformance.targets.builtin import make_reference
from kvspec.conformance.tools.cli import main
from kvspec.conformance.tools.router_mirror import replay_mirrors
from kvspec.mutants.events import EvictionWithoutBlockRemoved
from kvspec.spec.state import BlockHash

H = BlockHash(b"same-prefix")


def _record(tmp_path, factory, *, events=True, duplicate=True):
    """Two blocks registered under one hash, freed, then one of them taken: a removal of a key still held."""
    lock = LockStep(factory, AdapterConfig("pool", 4, events=events))
    lock.check()
    steps = [
        ("get_new_blocks", 2),
        ("cache_full_blocks", [1, 2], [H, H] if duplicate else [H, BlockHash(b"other")]),
        ("free_blocks", [2, 1]),  # the free queue is now 3, 2, 1
        ("get_new_blocks", 2),  # takes 3 and 2: h1 leaves block 2, block 1 still holds it
    ]
    try:
        for op, *args in steps:
            lock.call(op, *args)
            lock.check()
    except AssertionError:
        pass  # a wrong implementation's failure ends the example; its trace is what we want
    return write_trace(tmp_path / "t.trace.jsonl", lock.trace("under-test"))


def test_a_key_two_blocks_hold_drifts_the_naive_mirror_only(tmp_path, capsys):
    path = _record(tmp_path, make_reference)
    report = replay_mirrors(read_trace(path))
    assert report.counting is None and report.num_events == 2
    assert report.naive is not None and report.naive.step == 4 and report.naive.lacks == ("h1",)
    assert report.misreads == [(4, "h1")]
    assert main(["mirror", str(path)]) == 0
    out = capsys.readouterr().out
    assert "counting mirror (a count per key): holds the pool's keys after every step" in out
    assert "naive mirror (forgets a key on its first removal): drifts at step 4 (get_new_blocks)" in out
    assert "events: removed h1" in out and "  step 4: h1" in out


def test_distinct_keys_keep_both_mirrors_exact(tmp_path, capsys):
    assert main(["mirror", str(_record(tmp_path, make_reference, duplicate=False)), "--side", "spec"]) == 0
    assert "naive mirror (forgets a key on its first removal): holds the pool's keys" in capsys.readouterr().out


def test_a_stream_that_misses_a_removal_drifts_the_counting_mirror_and_exits_1(tmp_path, capsys):
    path = _record(tmp_path, EvictionWithoutBlockRemoved)
    assert main(["mirror", str(path), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["counting"]["step"] == 4 and report["counting"]["holds_extra"] == ["h1 x2"]
    assert report["counting"]["lacks"] == ["h1 x1"]
    assert main(["mirror", str(path), "--side", "spec"]) == 0  # the spec's own stream is right


def test_a_trace_without_events_is_refused_in_one_line(tmp_path, capsys):
    assert main(["mirror", str(_record(tmp_path, make_reference, events=False))]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvspec mirror: the trace was recorded without KV cache events") and err.count("\n") == 1


@pytest.mark.parametrize("text", ["", "not json\n", '{"kvspec_trace": 99}\n'])
def test_an_unreadable_trace_is_refused_in_one_line(tmp_path, capsys, text):
    path = tmp_path / "bad.trace.jsonl"
    path.write_text(text)
    assert main(["mirror", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvspec mirror: cannot read the trace:") and "Traceback" not in err
    assert main(["mirror", str(tmp_path / "missing.trace.jsonl")]) == 2
