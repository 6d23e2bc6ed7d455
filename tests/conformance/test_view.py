"""The step-through page without a browser: the source document, the page model, the files and commands.

What a person sees is tested in a real browser (test_view_browser.py); here
is what the page is built from: a trace's spec side recomputed when its
snapshots are missing, hash names and differences, the broken rule in plain
words, the walkthrough's states and numbering, the page's size, that it
names nothing outside itself, and the commands that write and serve it.
"""

from __future__ import annotations

import dataclasses
import json
import re
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from kvspec.conformance.core.adapter import AdapterConfig
from kvspec.conformance.core.lockstep import LockStep
from kvspec.conformance.core.trace import Trace, TraceStep, read_trace
from kvspec.conformance.runner.replaying import load_sendable
from kvspec.conformance.runner.run import replay
from kvspec.conformance.targets.builtin import make_reference
from kvspec.conformance.tools.cli import main
from kvspec.conformance.tools.view import (
    build_view,
    render_page,
    trace_to_page_data,
    walkthrough_to_page_data,
)
from kvspec.conformance.tools.view.model import RULES
from kvspec.conformance.tools.view.serve import make_server
from kvspec.conformance.tools.walkthrough import load_golden, run_walkthrough
from kvspec.spec.invariants import INVARIANTS
from kvspec.spec.manager import Request
from kvspec.spec.state import BlockHash
from tests.conformance import adapters

ADAPTERS = "tests.conformance.adapters"
POOL8 = AdapterConfig("pool", 8)


def _failing_trace(factory, steps, tmp_path: Path, config: AdapterConfig = POOL8) -> Trace:
    """The stored failure trace of replaying `steps` (op, args) on `factory`."""
    trace = Trace(config=config, steps=tuple(TraceStep(i + 1, op, tuple(a)) for i, (op, a) in enumerate(steps)))
    result = replay(trace, factory, impl="adapter under test", trace_dir=tmp_path, isolate=False)
    assert result.failure is not None and result.failure.trace_path is not None, result.verdict
    return read_trace(result.failure.trace_path)


def _digest(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(4, "big") * 8)


def fifty_step_trace() -> Trace:
    """A conforming 50-step trace of the reference on a 24-block pool, both sides recorded."""
    lock = LockStep(make_reference, AdapterConfig("pool", 24), None)
    lock.check()
    held: list[list[int]] = []
    for k in range(50):
        kind = k % 5
        if kind == 0:
            held.append(lock.call("get_new_blocks", 3).result)
        elif kind == 1:
            lock.call("cache_full_blocks", held[-1][:2], [_digest(k), _digest(k + 1000)])
        elif kind == 2:
            lock.call("get_cached_block", _digest(max(k - 6, 1)))
        elif kind == 3:
            lock.call("get_num_free_blocks")
        else:
            lock.call("free_blocks", held.pop(0)[::-1])
        lock.check()
    return lock.trace("reference")


def content_failure_trace(folder: Path) -> Trace:
    """gpu_impl with a mutant that stores each token one slot along: the second request's hit reads wrong KV."""
    from kvspec.mutants.gpu_memory import MUTANTS

    mutant = next(m for m in MUTANTS if m.name == "gpu_write_wrong_slot")
    a, b = Request("a", tuple(range(9))), Request("b", tuple(range(9)))
    steps = [("get_computed_blocks", (a,)), ("allocate_slots", (a, 9, 0, [], 0)), ("get_computed_blocks", (b,))]
    trace = _failing_trace(mutant.factory, steps, folder, AdapterConfig("manager", 8, block_size=4))
    assert trace.failure is not None and trace.failure.invariant == "hit_content_intact"
    return trace


# --- the source document ------------------------------------------------------------------


def test_a_trace_without_snapshots_gets_its_spec_side_recomputed(tmp_path):
    trace = _failing_trace(
        adapters.make_free_head_first, [("get_new_blocks", [2]), ("free_blocks", [[2, 1]])], tmp_path
    )
    full = trace_to_page_data(trace)
    stripped = (dataclasses.replace(s, spec=None, spec_snapshot=None, impl_snapshot=None) for s in trace.steps)
    bare = dataclasses.replace(trace, steps=tuple(stripped))
    doc = trace_to_page_data(bare)
    assert [s["spec"] for s in doc["steps"]] == [s["spec"] for s in full["steps"]]
    assert [s["spec_outcome"] for s in doc["steps"]] == [s["spec_outcome"] for s in full["steps"]]
    assert [s["spec_recomputed"] for s in doc["steps"]] == [False, True, True]
    assert all(s["impl"] is None for s in doc["steps"])
    # Step 0 is the fresh pool, before the first operation.
    assert full["steps"][0]["spec"]["free_queue"] == [1, 2, 3, 4, 5, 6, 7]


# --- the page model -----------------------------------------------------------------------


def test_a_state_divergence_marks_the_free_queue_and_names_the_rule(tmp_path):
    trace = _failing_trace(
        adapters.make_free_head_first, [("get_new_blocks", [2]), ("free_blocks", [[2, 1]])], tmp_path
    )
    view = build_view(trace_to_page_data(trace))
    assert view["start_step"] == 2 and view["steps"][2]["is_failure"]
    step = view["steps"][2]
    assert step["differences"] == {"blocks": [], "fields": ["free_queue"], "free_queue_positions": [0, 1]}
    # Blocks without a hash go to the left end, tail first: 2 is taken before 1.
    assert step["spec"]["free_queue"][:2] == [2, 1] and step["impl"]["free_queue"][:2] == [1, 2]
    assert step["changed"] == {"spec": [1, 2], "impl": [1, 2]}
    f = view["failure"]
    assert (f["rule_label"], f["rule"]) == RULES["state_equals_spec"]
    assert step["call"] == "free_blocks(block_ids=[2, 1])"
    assert step["spec_result"] == "done" and view["steps"][1]["spec_result"] == "got blocks 1, 2"


def test_a_broken_invariant_is_named_by_its_docstring(tmp_path):
    trace = _failing_trace(adapters.make_taken_blocks_stay_queued, [("get_new_blocks", [2])], tmp_path)
    f = build_view(trace_to_page_data(trace))["failure"]
    inv = next(i for i in INVARIANTS if i.name == f["rule_name"])
    assert f["rule"] == inv.rule and f["step"] == 1


def test_a_different_result_is_named_same_result(tmp_path):
    steps = [("get_new_blocks", [1]), ("free_blocks", [[1]]), ("free_blocks", [[1]])]
    view = build_view(trace_to_page_data(_failing_trace(adapters.make_accepts_double_free, steps, tmp_path)))
    assert view["failure"]["rule_label"] == "same result" and view["start_step"] == 3
    step = view["steps"][3]
    assert step["differences"]["fields"] == ["result"]
    assert step["spec_result"].startswith("raised DoubleFree: ") and step["impl_result"] == "done"


def test_a_rejected_call_that_changes_the_state_is_named(tmp_path):
    steps = [("get_new_blocks", [2]), ("get_new_blocks", [9])]
    view = build_view(trace_to_page_data(_failing_trace(adapters.make_takes_before_refusing, steps, tmp_path)))
    assert view["failure"]["rule_label"] == "a rejected call changes nothing"


def test_a_crash_leaves_the_implementation_side_unknown(tmp_path):
    steps = [("get_new_blocks", [3]), ("free_blocks", [[3, 2, 1]])]
    view = build_view(trace_to_page_data(_failing_trace(adapters.make_crash_on_long_free, steps, tmp_path)))
    step = view["steps"][view["start_step"]]
    assert view["failure"]["rule_label"] == "no crash"
    assert step["impl"] is None and step["spec"] is not None and step["impl_result"].startswith("crashed: ")


def test_hashes_get_one_name_and_colour_each_on_both_sides(tmp_path):
    steps = [
        ("get_new_blocks", [2]),
        ("cache_full_blocks", [[1, 2], [_digest(7), _digest(8)]]),
        ("free_blocks", [[2, 1]]),
    ]
    view = build_view(trace_to_page_data(_failing_trace(adapters.make_free_head_first, steps, tmp_path)))
    step = view["steps"][3]
    assert step["spec"]["hash"][1:3] == step["impl"]["hash"][1:3] == ["h1", "h2"]
    assert step["spec"]["hash_table"] == [["h1", [1]], ["h2", [2]]]
    assert view["steps"][2]["call"] == "cache_full_blocks(block_ids=[1, 2], block_hashes=[h1, h2])"
    assert set(view["hash_colours"]) == {"h1", "h2"}
    assert view["hash_colours"]["h1"] != view["hash_colours"]["h2"]


def test_a_content_integrity_failure_names_the_block_whose_memory_is_wrong(tmp_path):
    view = build_view(trace_to_page_data(content_failure_trace(tmp_path)))
    f = view["failure"]
    assert (f["rule_name"], f["corrupt_blocks"], f["step"]) == ("hit_content_intact", [1], 3)
    assert view["steps"][3]["differences"]["fields"] == []  # the bookkeeping is right; the memory is not


def test_the_walkthrough_keeps_the_golden_numbers_states_and_branch():
    golden = load_golden()
    view = build_view(walkthrough_to_page_data(run_walkthrough(make_reference), "reference", golden))
    assert [s["index"] for s in view["steps"]] == [g["step"] for g in golden["steps"]]
    for step, want in zip(view["steps"], golden["steps"]):
        state = step["spec"]
        assert step["caption"] == want["action"]
        assert {str(b): state["ref_cnt"][b] for b in range(1, 7)} == want["ref_cnt"]
        assert state["free_queue"] == want["free_queue"]
        assert {name: blocks[0] for name, blocks in state["hash_table"]} == want["hash_table"]
        assert dict(state["block_tables"]) == want["block_tables"]
    assert view["steps"][5]["spec"]["free_queue"] == [4, 3, 5, 6, 2, 1]
    d = view["steps"][7]
    assert d["base"] == 5 and d["spec"]["hash_table"] == [] and d["evicted"]["spec"] == ["h1", "h2"]
    assert d["changed"]["spec"] == [1, 2, 3, 4, 5, 6]
    assert view["steps"][3]["computed_tokens"] == {"B": 8}


# --- the page -----------------------------------------------------------------------------


def test_a_50_step_trace_of_a_24_block_pool_is_well_under_a_megabyte():
    trace = fifty_step_trace()
    assert len(trace.steps) == 50 and trace.config.num_gpu_blocks == 24
    assert all(s.impl_snapshot is not None for s in trace.steps)
    size = len(render_page(trace_to_page_data(trace)).encode("utf-8"))
    print(f"page of a 50-step trace of a 24-block pool: {size} bytes")
    assert size < 200_000, size


def test_the_page_names_nothing_outside_itself(tmp_path):
    page = render_page(walkthrough_to_page_data(run_walkthrough(make_reference), "reference"))
    assert not re.search(r"""(?:src|href|url)\s*[=(]\s*["']?\s*(?:https?:)?//""", page, re.I)
    assert "@import" not in page and "@font-face" not in page
    assert not re.search(r"<(?:link|img|iframe|object|embed)\b(?![^>]*data:)", page, re.I)
    assert page.count("<script") == 2  # the data and the player, both inline
    assert "<script src" not in page


def test_the_embedded_data_cannot_close_its_script(tmp_path):
    trace = _failing_trace(
        adapters.make_free_head_first, [("get_new_blocks", [2]), ("free_blocks", [[2, 1]])], tmp_path
    )
    doc = trace_to_page_data(dataclasses.replace(trace, impl="</script><b>x"))
    page = render_page(doc)
    assert "</script><b>x" not in page
    assert "&lt;/script&gt;&lt;b&gt;x" in page  # the title, escaped


def test_without_a_browser_the_reason_names_what_to_install(monkeypatch, tmp_path):
    from tests.conformance.chromium import INSTALL_HINT, find_chromium

    monkeypatch.setenv("PATH", str(tmp_path))  # nothing on it
    reason = find_chromium()
    assert reason == f"no chromium and chromedriver on PATH: {INSTALL_HINT}"


# --- the commands -------------------------------------------------------------------------


@pytest.fixture
def failure_trace(tmp_path) -> Path:
    trace = _failing_trace(
        adapters.make_free_head_first, [("get_new_blocks", [2]), ("free_blocks", [[2, 1]])], tmp_path / "traces"
    )
    (path,) = (tmp_path / "traces").glob("failure-pool-*.trace.jsonl")
    assert read_trace(path) == trace
    return path


def test_view_writes_the_page_where_asked_or_beside_the_trace(failure_trace, tmp_path, capsys):
    out = tmp_path / "pages" / "failure.html"
    # The folder of an output must exist: a typo in it is refused, not created.
    assert main(["view", str(failure_trace), "-o", str(out)]) == 2
    assert "the folder" in capsys.readouterr().err and not out.parent.exists()
    out.parent.mkdir()
    assert main(["view", str(failure_trace), "-o", str(out)]) == 0
    assert out.read_text().startswith("<!doctype html>")
    assert capsys.readouterr().out.startswith(f"page: {out} (")
    assert main(["view", str(failure_trace)]) == 0
    beside = failure_trace.with_name(failure_trace.name.replace(".trace.jsonl", ".html"))
    assert beside.is_file() and f"page: {beside}" in capsys.readouterr().out


def test_view_of_a_malformed_trace_exits_2(tmp_path, capsys):
    bad = tmp_path / "bad.trace.jsonl"
    bad.write_text("not json\n")
    assert main(["view", str(bad)]) == 2
    assert capsys.readouterr().err.startswith(f"kvspec view: cannot read the trace: {bad}:1: not JSON")


def test_demo_html_writes_the_walkthrough_page(tmp_path, capsys):
    out = tmp_path / "walkthrough.html"
    assert main(["demo", "--html", str(out)]) == 0
    assert capsys.readouterr().out.rstrip().endswith(f"page: {out}")
    assert "Seed 000" in out.read_text()


def test_check_html_dir_writes_a_page_per_failure_named_in_the_story_and_junit(tmp_path, capsys):
    junit, pages = tmp_path / "out.xml", tmp_path / "pages"
    code = main(
        [
            "check",
            "--impl",
            f"{ADAPTERS}:make_free_head_first",
            "--level",
            "pool",
            "--caching",
            "on",
            "--max-examples",
            "100",
            "--junit",
            str(junit),
            "--trace-dir",
            str(tmp_path),
            "--html-dir",
            str(pages),
        ]
    )
    out = capsys.readouterr().out
    assert code == 1, out
    (trace,) = tmp_path.glob("failure-pool-*.trace.jsonl")
    page = pages / trace.name.replace(".trace.jsonl", ".html")
    assert page.is_file()
    assert f"page: {page}" in out
    failure = ET.parse(junit).getroot().find("testsuite/testcase/failure")
    assert f"page: {page}" in failure.text


def test_replay_html_dir_writes_the_page_of_the_replayed_failure(failure_trace, tmp_path, capsys):
    pages = tmp_path / "replayed"
    code = main(["replay", str(failure_trace), "--impl", f"{ADAPTERS}:make_free_head_first", "--html-dir", str(pages)])
    out = capsys.readouterr().out
    assert code == 1
    (page,) = pages.glob("failure-pool-*.html")
    assert f"page: {page}" in out


def test_the_server_serves_the_page_at_the_root_only():
    server = make_server("<!doctype html><p>page</p>")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        host, port = server.server_address[:2]
        assert host == "127.0.0.1"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5) as r:
            assert r.status == 200 and r.read() == b"<!doctype html><p>page</p>"
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/other.js", timeout=5)
        assert e.value.code == 404
    finally:
        server.shutdown()
        server.server_close()


def start_serving(trace_path: Path | str) -> subprocess.Popen[str]:
    """`kvspec view TRACE --serve --no-open` in a child process that Ctrl-C (SIGINT) stops.

    A test runner started in the background by a non-interactive shell ignores SIGINT, and a child
    inherits an ignored signal (a handled one goes back to its default at exec): so SIGINT is handled
    here while the child starts, and the child's Python installs its own KeyboardInterrupt handler.
    """
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "kvspec", "view", str(trace_path), "--serve", "--no-open"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
    finally:
        signal.signal(signal.SIGINT, previous)


def test_view_serve_prints_the_url_and_stops_on_ctrl_c(failure_trace):
    proc = start_serving(failure_trace)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        m = re.fullmatch(r"serving the page at (http://127\.0\.0\.1:(\d+)/) \(Ctrl-C stops\)\n", line)
        assert m, line
        with urllib.request.urlopen(m.group(1), timeout=5) as r:
            assert b"kvspec-data" in r.read()
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=10)
        assert proc.returncode == 0 and rest.strip().endswith("stopped")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_an_events_failure_shows_what_each_side_published_and_names_its_rule(tmp_path):
    from kvspec.mutants.events import EvictionWithoutBlockRemoved, ResetWithoutAllBlocksCleared

    steps = [("get_new_blocks", [1]), ("cache_full_blocks", [[1], [_digest(1)]]), ("free_blocks", [[1]]),
             ("get_new_blocks", [7])]  # fmt: skip
    config = AdapterConfig("pool", 8, events=True)
    view = build_view(trace_to_page_data(_failing_trace(EvictionWithoutBlockRemoved, steps, tmp_path, config)))
    last = view["steps"][-1]
    assert last["spec_result"].endswith("; published: removed h1") and "published" not in last["impl_result"]
    assert "result" in last["differences"]["fields"]
    assert view["failure"]["rule_name"] == "event_mirror_exact"
    assert view["steps"][2]["spec_result"] == "done; published: stored h1 under -"
    reset = [*steps[:3], ("reset_prefix_cache", [])]
    view = build_view(trace_to_page_data(_failing_trace(ResetWithoutAllBlocksCleared, reset, tmp_path, config)))
    assert view["failure"]["rule_name"] == "event_mirror_exact"  # the router still holds h1, the pool nothing


# --- what the file records, against what kvspec computes -----------------------------------


def _edited(trace_path: Path, tmp_path: Path, edit) -> Path:
    """A copy of the trace with `edit(lines)` applied to its JSON lines (header first, the verdict line last)."""
    lines = [json.loads(line) for line in trace_path.read_text().splitlines()]
    edit(lines)
    out = tmp_path / "edited.trace.jsonl"
    out.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return out


def _view_of(path: Path) -> dict:
    return build_view(trace_to_page_data(load_sendable(path)))


def test_an_unedited_trace_gets_no_notice_and_says_which_side_is_computed(failure_trace):
    view = _view_of(failure_trace)
    assert view["notices"] == []
    assert view["sides"][0]["label"].startswith("spec (computed")
    assert view["sides"][1]["label"].endswith("(as the trace records it)")


def test_a_hand_edited_spec_state_is_drawn_as_the_spec_computes_it_and_said(failure_trace, tmp_path):
    # The spec's free queue after step 2 made to equal the implementation's: no divergence left to see.
    queue = [1, 2, 3, 4, 5, 6, 7]
    edited = _edited(failure_trace, tmp_path, lambda ls: ls[2]["spec_snapshot"].update(free_queue=queue))
    view = _view_of(edited)
    (notice,) = view["notices"]
    assert notice.startswith("This trace's recorded spec state at step 2 differs from what the spec computes")
    assert view["steps"][2]["spec"]["free_queue"][:2] == [2, 1]  # computed, not the file's
    assert view["steps"][2]["differences"]["fields"] == ["free_queue"]


def test_a_hand_edited_spec_outcome_is_said(failure_trace, tmp_path):
    edited = _edited(failure_trace, tmp_path, lambda ls: ls[1]["spec"].update(result=[3, 4]))
    view = _view_of(edited)
    assert view["notices"][0].startswith("This trace's recorded spec outcome at step 1 differs")
    assert view["steps"][1]["spec_result"] == "got blocks 1, 2"


def test_a_moved_or_removed_divergence_is_said(failure_trace, tmp_path):
    moved = _view_of(_edited(failure_trace, tmp_path, lambda ls: ls[-1]["failure"].update(step=1, op="get_new_blocks")))
    (notice,) = moved["notices"]
    assert notice.startswith("This trace records a divergence at step 1 (state equals spec), but there the ")
    gone = _view_of(_edited(failure_trace, tmp_path, lambda ls: ls[-1].update(verdict="conforms", failure=None)))
    (notice,) = gone["notices"]
    assert notice.startswith("The implementation's side as recorded already differs from the spec's at step 2 "
                             "(free_queue), but this trace records no divergence")  # fmt: skip
    past = _view_of(_edited(failure_trace, tmp_path, lambda ls: ls[-1]["failure"].update(step=9)))
    assert past["notices"][0].startswith("This trace records its first divergence at step 9, a step it does not have")


def test_view_draws_the_notice_on_the_page(failure_trace, tmp_path, capsys):
    ref_cnt = [0, 2, 1, 0, 0, 0, 0, 0]
    edited = _edited(failure_trace, tmp_path, lambda ls: ls[1]["spec_snapshot"].update(ref_cnt=ref_cnt))
    out = tmp_path / "edited.html"
    assert main(["view", str(edited), "-o", str(out)]) == 0
    assert "recorded spec state at step 1 differs from what the spec computes" in out.read_text()


def test_removals_published_in_another_order_the_harness_allows_are_no_difference(tmp_path):
    # Evicting two blocks at once publishes a run of two removals; the lock-step core compares a run as a
    # multiset (kv_events.same_events), so the step passed: the page must not mark its result as differing.
    lock = LockStep(make_reference, AdapterConfig("pool", 4, events=True))
    lock.check()
    for op, args in [("get_new_blocks", [2]), ("cache_full_blocks", [[1, 2], [_digest(1), _digest(2)]]),
                     ("free_blocks", [[1, 2]]), ("get_new_blocks", [3])]:  # fmt: skip
        lock.call(op, *args)
        lock.check()
    trace = lock.trace("reference")
    last = trace.steps[-1]
    assert last.impl is not None and len(last.impl.events) == 2
    swapped = dataclasses.replace(last.impl, events=tuple(reversed(last.impl.events)))
    reordered = dataclasses.replace(trace, steps=(*trace.steps[:-1], dataclasses.replace(last, impl=swapped)))
    view = build_view(trace_to_page_data(reordered))
    assert view["steps"][-1]["differences"]["fields"] == [] and view["notices"] == []
    # A removal the implementation left out still differs.
    dropped = dataclasses.replace(last.impl, events=last.impl.events[:1])
    view = build_view(
        trace_to_page_data(
            dataclasses.replace(trace, steps=(*trace.steps[:-1], dataclasses.replace(last, impl=dropped)))
        )
    )
    assert view["steps"][-1]["differences"]["fields"][0] == "result"
