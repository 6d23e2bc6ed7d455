"""The step-through page in a real headless Chromium: what a person checks on it.

One browser session serves the whole module. Every page is opened from
`file://` (and once from `kvspec view --serve`), and after each test the page
must have asked for nothing but itself and logged no error. A screenshot of
each page is saved (in $KVSPEC_SCREENSHOTS, or a temporary folder) to be looked at.

- The walkthrough (`kvspec demo --html`): "next" steps through the seed's
  states as conformance/data/seed_walkthrough.json numbers them (after B frees the
  free queue reads 4 3 5 6 2 1; after D the hash table is empty); captions,
  arrow keys, Home/End and `#step=N` go where they should; autoplay advances.
- A mutant's shrunk failure opens at the step its text story names as the
  first divergence, with the fields the story marks `<<` marked on the page.
- gpu_impl's content-integrity failure marks the block whose memory is wrong.
"""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvspec.conformance.core.adapter import AdapterConfig
from kvspec.conformance.core.trace import Trace, TraceStep, read_trace
from kvspec.conformance.runner.run import replay, run_check
from kvspec.conformance.tools.cli import main
from kvspec.conformance.tools.view import trace_to_page_data, write_page, write_trace_page
from kvspec.conformance.tools.walkthrough import load_golden
from kvspec.mutants import all_mutants
from tests.conformance.chromium import Browser, chromium_session
from tests.conformance.test_view import content_failure_trace, fifty_step_trace, start_serving

FILE = ("file://",)

# What the page shows a side's state as, read from the page itself (text a person reads).
_READ_SIDE = """
var side = document.getElementById("side-" + arguments[0]);
if (!side) { return null; }
function all(sel) { return Array.prototype.slice.call(side.querySelectorAll(sel)); }
function text(e) { return e.textContent; }
return {
  refs: all(".blk").map(function (e) { return [Number(e.dataset.block), e.querySelector(".ref").textContent]; }),
  queue: all("[data-field=free_queue] .q").map(text),
  table: all("[data-field=hash_table] .entry").map(text),
  table_empty: !!side.querySelector("[data-field=hash_table] .empty"),
  tables: all("[data-field=block_tables] .row").map(function (r) {
    return [r.dataset.request, Array.prototype.slice.call(r.querySelectorAll(".chip")).map(text)];
  }),
  changed: all(".blk.changed").map(function (e) { return Number(e.dataset.block); }),
  differs: all(".field.differs").map(function (e) { return e.dataset.field; }),
  corrupt: all(".blk.corrupt").map(function (e) { return [Number(e.dataset.block), e.textContent]; })
};
"""

# The story's side-by-side rows, as the page's field names.
_STORY_ROWS = {
    "ref_cnt": "blocks",
    "block_hash": "blocks",
    "free queue (left first)": "free_queue",
    "hash table": "hash_table",
    "block tables": "block_tables",
    "quarantined": "quarantined",
}


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = os.environ.get("KVSPEC_SCREENSHOTS")
    return Path(folder) if folder else tmp_path_factory.mktemp("page-screenshots")


@pytest.fixture(scope="module")
def browser(shots: Path) -> Iterator[Browser]:
    with chromium_session(shots) as b:
        if isinstance(b, str):
            pytest.skip(f"no headless Chromium: {b}")
        yield b


@pytest.fixture(scope="module")
def walkthrough(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("walkthrough") / "walkthrough.html"
    assert main(["demo", "--html", str(path)]) == 0
    return path.as_uri()


def side(browser: Browser, key: str = "spec") -> dict[str, Any]:
    state: dict[str, Any] = browser.js(_READ_SIDE, key)
    return state


def golden_form(state: dict[str, Any]) -> dict[str, Any]:
    """The page's shown state in the golden file's form."""
    table = {}
    for entry in state["table"]:
        m = re.fullmatch(r"(h\d+)\u2192 block (\d+)", entry)
        assert m, entry
        table[m.group(1)] = int(m.group(2))
    return {
        "ref_cnt": {str(b): int(ref.removeprefix("ref ")) for b, ref in state["refs"] if b > 0},
        "free_queue": [int(b) for b in state["queue"]],
        "hash_table": table,
        "block_tables": {rid: [int(b) for b in blocks] for rid, blocks in state["tables"]},
    }


# --- the walkthrough ----------------------------------------------------------------------


def test_next_steps_through_the_seed_states(browser: Browser, walkthrough: str):
    browser.open(walkthrough)
    golden = load_golden()["steps"]
    assert browser.step() == 0
    for want in golden:
        if want["step"] > 0:
            browser.click("#btn-next")
        assert browser.step() == want["step"]
        assert browser.js("return location.hash") == f"#step={want['step']}"
        shown = side(browser)
        assert golden_form(shown) == {k: want[k] for k in ("ref_cnt", "free_queue", "hash_table", "block_tables")}
        if want["step"] == 5:  # after B frees
            assert " ".join(shown["queue"]) == "4 3 5 6 2 1"
            assert shown["changed"] == [1, 2, 4]
            browser.screenshot("walkthrough-step-5")
    # After D (it branches from step 5): the hash table is empty, both entries dropped.
    assert shown["table"] == [] and shown["table_empty"]
    assert browser.js("return document.querySelector('#side-spec .evicted').textContent") == (
        "dropped in this step: h1, h2"
    )
    assert shown["changed"] == [1, 2, 3, 4, 5, 6]
    assert browser.js("return document.getElementById('btn-next').disabled")
    browser.screenshot("walkthrough-step-7")
    browser.assert_clean(FILE)


def test_a_hash_has_one_colour_on_its_block_and_in_the_table(browser: Browser, walkthrough: str):
    browser.open(walkthrough + "#step=5")
    colour = browser.js(
        "return [getComputedStyle(document.querySelector(arguments[0])).backgroundColor,"
        " getComputedStyle(document.querySelector(arguments[1])).backgroundColor,"
        " getComputedStyle(document.querySelector(arguments[2])).backgroundColor]",
        '#side-spec .blk[data-block="1"] .hsh',
        '#side-spec .entry[data-hash="h1"] .hname',
        '#side-spec .blk[data-block="2"] .hsh',
    )
    assert colour[0] == colour[1] != colour[2]
    browser.assert_clean(FILE)


def test_the_url_fragment_opens_a_step_on_first_load_and_on_change(browser: Browser, walkthrough: str):
    browser.open(walkthrough + "#step=5")
    assert browser.step() == 5
    assert " ".join(side(browser)["queue"]) == "4 3 5 6 2 1"
    browser.js("location.hash = '#step=2'")
    browser.wait_until(lambda b: b.step() == 2)
    assert golden_form(side(browser))["hash_table"] == {"h1": 1, "h2": 2}
    browser.open(walkthrough + "#step=99")  # past the end: the last step
    assert browser.step() == 7
    browser.assert_clean(FILE)


def test_captions_buttons_and_arrow_keys_go_where_they_should(browser: Browser, walkthrough: str):
    from selenium.webdriver.common.keys import Keys

    browser.open(walkthrough)
    browser.click('#step-list li[data-step="3"] button')
    assert browser.step() == 3 and browser.js("return location.hash") == "#step=3"
    assert browser.js("return document.querySelector('#step-list li.current').dataset.step") == "3"
    assert side(browser)["tables"] == [["A", ["1", "2", "3"]], ["B", ["1", "2", "4"]]]
    browser.press(Keys.ARROW_RIGHT)
    assert browser.step() == 4
    browser.press(Keys.ARROW_LEFT, Keys.ARROW_LEFT)
    assert browser.step() == 2
    browser.press(Keys.END)
    assert browser.step() == 7
    browser.press(Keys.ARROW_RIGHT)  # nothing after the last step
    assert browser.step() == 7
    browser.press(Keys.HOME)
    assert browser.step() == 0
    browser.click("#btn-last")
    assert browser.step() == 7
    browser.click("#btn-prev")
    assert browser.step() == 6
    browser.click("#btn-first")
    assert browser.step() == 0 and browser.js("return document.getElementById('btn-prev').disabled")
    browser.assert_clean(FILE)


def test_autoplay_advances_to_the_last_step_and_stops(browser: Browser, walkthrough: str):
    from selenium.webdriver.support.ui import Select

    browser.open(walkthrough)
    Select(browser.driver.find_element("id", "speed")).select_by_value("150")
    browser.click("#btn-play")
    assert "pause" in browser.js("return document.getElementById('btn-play').textContent")
    browser.wait_until(lambda b: b.step() >= 1, timeout_s=3)
    browser.wait_until(lambda b: b.step() == 7, timeout_s=5)
    browser.wait_until(lambda b: "play" in b.js("return document.getElementById('btn-play').textContent"))
    assert golden_form(side(browser))["hash_table"] == {}
    browser.assert_clean(FILE)


# --- failures -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mutant_failure(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """(the page, the story) of a mutant's shrunk failure: one hash registered twice, the table keeps one."""
    mutant = next(m for m in all_mutants() if m.name == "duplicate_hash_overwrites")
    folder = tmp_path_factory.mktemp("mutant")
    result = run_check(
        mutant.factory,
        level=mutant.level,
        enable_caching=mutant.enable_caching,
        max_examples=200,
        seed=0,
        time_budget_s=30.0,
        trace_dir=folder,
    )
    assert result.failure is not None and result.failure.trace_path is not None, result.verdict
    page = write_trace_page(result.failure.trace_path, folder)
    return page.as_uri(), result.failure.story


def test_a_mutant_failure_opens_at_the_first_divergence_the_story_names(
    browser: Browser, mutant_failure: tuple[str, str]
):
    page, story = mutant_failure
    m = re.search(r"^DIVERGES: \w+ at step (\d+) of (\d+) \((\w+)\)$", story, re.M)
    assert m, story
    bad = int(m.group(1))
    browser.open(page)
    assert browser.step() == bad
    assert browser.js("return document.querySelector('#step-list li.current').classList.contains('failure')")
    banner = browser.js("return document.getElementById('failure').innerText")
    assert f"at step {bad} of {m.group(2)} ({m.group(3)})" in banner
    inv = re.search(r"^what failed: invariant (\w+): (.*)$", story, re.M)
    assert inv, story
    assert f"Failed rule: {inv.group(1)}." in banner and inv.group(2).split(" (got ")[0] in banner
    # The fields the story marks as differing are the fields the page marks, on both sides.
    marked = {
        _STORY_ROWS[label]
        for line in story.splitlines()
        if line.endswith("<<")
        for label in _STORY_ROWS
        if line.strip().startswith(label)
    }
    assert marked, story
    assert set(side(browser, "impl")["differs"]) == marked == set(side(browser, "spec")["differs"])
    browser.screenshot("mutant-failure")
    browser.click("#btn-first")
    assert browser.step() == 0 and not side(browser, "impl")["differs"]
    browser.click("#btn-failure")
    assert browser.step() == bad
    browser.assert_clean(FILE)


def test_a_diff_witness_is_a_page_with_a_beside_b(browser: Browser, tmp_path: Path):
    # kvspec diff's witness: the side that follows the spec is the spec's column, named; the other leaves it.
    from kvspec.conformance.tools.vllm_diff import Change, _with_page

    mutant = next(m for m in all_mutants() if m.name == "duplicate_hash_overwrites")
    result = run_check(mutant.factory, level=mutant.level, enable_caching=mutant.enable_caching,
                       max_examples=200, seed=0, time_budget_s=30.0, trace_dir=tmp_path)  # fmt: skip
    assert result.failure is not None and result.failure.trace_path is not None, result.verdict
    witness = Change("behaviour", "caching on, profile vllm-v1", result.failure.message, "follows the spec",
                     result.failure.trace_path, result.failure.step)  # fmt: skip
    paged = _with_page(witness, "vllm@1.0.0", "vllm@1.1.0", tmp_path / "pages", print)
    assert paged.page is not None and Path(paged.page).name.startswith("diff-failure-")
    browser.open(Path(paged.page).as_uri())
    assert browser.js("return document.querySelector('h1').innerText").startswith(
        "kvspec diff: vllm@1.0.0 beside vllm@1.1.0"
    )
    headers = browser.js("return Array.prototype.map.call(document.querySelectorAll('#sides h3'), "
                         "function (h) { return h.innerText; })")  # fmt: skip
    assert [h.lower().split(" (")[0] for h in headers] == ["vllm@1.1.0", "vllm@1.0.0"], headers
    assert "follows the spec" in headers[0].lower() and "leaves the spec" in headers[1].lower()
    results = browser.js("return document.getElementById('operation').innerText")
    assert "vllm@1.1.0:" in results and "vllm@1.0.0:" in results, results
    assert browser.js("return document.getElementById('legend-differs').innerText") == (
        "differs between vllm@1.1.0 and vllm@1.0.0"
    )
    assert set(side(browser, "impl")["differs"]) == set(side(browser, "spec")["differs"]) != set()
    browser.screenshot("diff-witness")
    browser.assert_clean(FILE)


@pytest.fixture(scope="module")
def content_failure(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The page of gpu_impl with a mutant that writes each token one slot along: the hit reads wrong KV."""
    folder = tmp_path_factory.mktemp("content")
    content_failure_trace(folder)
    (trace,) = folder.glob("failure-manager-*.trace.jsonl")
    return write_trace_page(trace, folder).as_uri()


def test_a_content_integrity_failure_marks_the_block_whose_memory_is_wrong(browser: Browser, content_failure: str):
    browser.open(content_failure)
    assert browser.step() == 3
    impl = side(browser, "impl")
    assert [b for b, _ in impl["corrupt"]] == [1] and "memory wrong" in impl["corrupt"][0][1]
    assert side(browser, "spec")["corrupt"] == []
    banner = browser.js("return document.getElementById('failure').innerText")
    assert "Failed rule: hit_content_intact." in banner and "Blocks whose memory is wrong: 1." in banner
    assert impl["tables"] == [["a", ["1", "2", "3"]]]
    browser.screenshot("content-integrity-failure")
    browser.assert_clean(FILE)


def test_a_50_step_trace_of_a_24_block_pool_plays_to_its_end(browser: Browser, tmp_path: Path):
    trace = fifty_step_trace()
    page = write_page(tmp_path / "fifty.html", trace_to_page_data(trace))
    browser.open(page.as_uri() + "#step=41")
    assert browser.step() == 41
    spec, impl = side(browser, "spec"), side(browser, "impl")
    assert len(spec["refs"]) == 24 and spec["queue"] == impl["queue"] and not impl["differs"]
    browser.screenshot("fifty-steps")
    browser.click("#btn-last")
    assert browser.step() == 50
    snap = trace.steps[-1].spec_snapshot
    assert snap is not None and [int(b) for b in side(browser)["queue"]] == list(snap.free_queue)
    browser.assert_clean(FILE)


def test_the_served_page_is_the_same_page_and_asks_only_for_itself(browser: Browser, tmp_path: Path):
    source = tmp_path / "traces"
    steps = [("get_new_blocks", (2,)), ("free_blocks", ([2, 1],))]
    trace = Trace(AdapterConfig("pool", 8), tuple(TraceStep(i + 1, op, a) for i, (op, a) in enumerate(steps)))
    from tests.conformance.adapters import make_free_head_first

    result = replay(trace, make_free_head_first, trace_dir=source, isolate=False)
    assert result.failure is not None and result.failure.trace_path is not None
    assert read_trace(result.failure.trace_path).failure is not None
    proc = start_serving(result.failure.trace_path)
    try:
        assert proc.stdout is not None
        m = re.match(r"serving the page at (http://127\.0\.0\.1:\d+/) ", proc.stdout.readline())
        assert m
        browser.open(m.group(1))
        assert browser.step() == 2
        assert side(browser, "impl")["differs"] == ["free_queue"]
        browser.assert_clean((m.group(1),))
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=10)
        assert proc.returncode == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
