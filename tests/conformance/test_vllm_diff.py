"""`kvspec diff A B` on real vLLM pools (light mode; KVSPEC_VLLM=1): changes named, each behaviour change with a
witness that conforms on one side and not on the other."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kvspec.conformance.core.results import Verdict
from kvspec.conformance.runner.run import replay
from kvspec.conformance.targets.vllm.lightmode import fetch_release
from kvspec.conformance.tools.cli import main

pytestmark = pytest.mark.vllm


def _diff(tmp_path: Path, capsys: pytest.CaptureFixture[str], a: str, b: str) -> tuple[int, dict]:
    out = tmp_path / "diff.json"
    code = main(["diff", a, b, "--max-examples", "50", "--trace-dir", str(tmp_path / "traces"), "--json", str(out),
                 "--html-dir", str(tmp_path / "pages")])  # fmt: skip
    capsys.readouterr()
    return code, json.loads(out.read_text())


def _witnessed(tmp_path: Path, change: dict, a: str, b: str) -> None:
    """The witness is short and conforms on exactly the side the change says follows the spec."""
    assert change["steps"] <= 4, change
    verdicts = {name: replay(change["trace"], name, isolate=False, trace_dir=tmp_path).verdict for name in (a, b)}
    following = a if change["a"] == "follows the spec" else b
    assert verdicts[following] is Verdict.CONFORMS and verdicts[b if following == a else a] is not Verdict.CONFORMS
    # Its page shows A beside B, the side that follows the spec in the spec's column.
    page = Path(change["page"]).read_text(encoding="utf-8")
    assert f"<title>kvspec diff: {a} beside {b}</title>" in page
    assert f"{following} (follows the spec" in page


def test_the_free_order_change_of_0_24_is_named_with_witnesses(tmp_path, capsys) -> None:
    a, b = "vllm@0.23.0", "vllm@0.24.0"
    code, found = _diff(tmp_path, capsys, a, b)
    assert code == 1
    behaviour = [c for c in found["changes"] if c["kind"] == "behaviour"]
    # caching on and off, each order: 0.23 follows vllm-v1-tail, 0.24 vllm-v1
    assert sorted(c["what"] for c in behaviour) == [
        f"caching {c}, profile {p}" for c in ("off", "on") for p in ("vllm-v1", "vllm-v1-tail")]  # fmt: skip
    for change in behaviour:
        _witnessed(tmp_path, change, a, b)
    api = {c["what"]: (c["a"], c["b"]) for c in found["changes"] if c["kind"] == "api"}
    assert api["BlockPool.free_blocks"] == ("(ordered_blocks, prepend)", "(ordered_blocks)")


def test_0_34_adds_evict_first_to_free_blocks(tmp_path, capsys) -> None:
    code, found = _diff(tmp_path, capsys, "vllm@0.33.0", "vllm@0.34.0")
    assert code == 1
    api = {c["what"]: (c["a"], c["b"]) for c in found["changes"] if c["kind"] == "api"}
    assert api["BlockPool.free_blocks"] == ("(ordered_blocks)", "(ordered_blocks, evict_first)")


def _tree(tmp_path: Path, version: str, name: str) -> Path:
    tree = tmp_path / name
    shutil.copytree(fetch_release(version) / "vllm", tree / "vllm")
    return tree


def test_a_source_tree_with_one_behaviour_changed_is_caught_and_an_unchanged_one_is_not(tmp_path, capsys) -> None:
    # What a pull request's checkout is to its merge base: the newest release, and a copy of it whose
    # free_blocks puts hashed blocks in front (one line changed).
    release = "0.34.0"
    same = _tree(tmp_path, release, "unchanged")
    assert _diff(tmp_path, capsys, f"vllm@{release}", f"vllm@{same}")[0] == 0
    changed = _tree(tmp_path, release, "changed")
    pool = changed / "vllm" / "v1" / "core" / "block_pool.py"
    text = pool.read_text()
    assert text.count("self.free_block_queue.append_n(blocks_to_evict_last)") == 1
    pool.write_text(text.replace("self.free_block_queue.append_n(blocks_to_evict_last)",
                                 "self.free_block_queue.prepend_n(blocks_to_evict_last)"))  # fmt: skip
    code, found = _diff(tmp_path, capsys, f"vllm@{release}", f"vllm@{changed}")
    assert code == 1
    behaviour = [c for c in found["changes"] if c["kind"] == "behaviour"]
    assert behaviour and all(c["a"] == "follows the spec" for c in behaviour), found
    for change in behaviour:
        _witnessed(tmp_path, change, f"vllm@{release}", f"vllm@{changed}")
