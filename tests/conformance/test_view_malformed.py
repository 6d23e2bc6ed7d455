"""`kvspec view` of a trace no campaign could have written: refused in one line (exit 2), as `kvspec replay` refuses it.

Each case runs the real command in a process of its own, as a user runs it,
so a traceback anywhere between reading the trace and writing the page shows.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

HEADER = {
    "kvspec_trace": 1,
    "level": "pool",
    "config": {
        "num_gpu_blocks": 4,
        "enable_caching": True,
        "profile": "vllm-v1",
        "block_size": 4,
        "hash_fn": "sha256_cbor",
        "seed": "kvspec",
        "device": None,
    },  # fmt: skip
    "impl": "reference",
}
MANAGER_HEADER = {**HEADER, "level": "manager", "config": {**HEADER["config"], "num_gpu_blocks": 8}}
H = {"bytes": "686173682d30"}
REQUEST = {"request_id": "r1", "token_ids": [1, 2, 3, 4, 5], "lora_name": None, "cache_salt": None, "mm_inputs": []}


def _kvspec(tmp_path: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvspec", *argv], cwd=tmp_path, capture_output=True, text=True)


def _write(tmp_path: Path, header: dict[str, Any], *steps: tuple[str, list[Any]]) -> Path:
    lines = [header] + [{"step": i, "op": op, "args": args} for i, (op, args) in enumerate(steps, start=1)]
    path = tmp_path / "bad.trace.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _refused_in_one_line(done: subprocess.CompletedProcess[str], command: str) -> str:
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(f"kvspec {command}: cannot read the trace: "), done.stderr
    return done.stderr


def test_view_refuses_an_argument_of_the_wrong_type_in_the_line_replay_refuses_it_in(tmp_path: Path) -> None:
    # cache_full_blocks(block_ids=5): an int where the block ids go.
    path = _write(tmp_path, HEADER, ("get_new_blocks", [1]), ("cache_full_blocks", [5, [H]]))
    view = _refused_in_one_line(_kvspec(tmp_path, "view", str(path)), "view")
    replay = _refused_in_one_line(_kvspec(tmp_path, "replay", str(path)), "replay")
    assert "step 2 cache_full_blocks(block_ids=5" in view
    assert view.removeprefix("kvspec view: ") == replay.removeprefix("kvspec replay: ")
    assert not list(tmp_path.glob("*.html"))


@pytest.mark.parametrize(
    ("header", "steps", "says"),
    [
        (HEADER, [("get_new_blocks", ["2"])], "step 1 get_new_blocks(num_blocks='2')"),
        (HEADER, [("get_new_blocks", [1]), ("free_blocks", [1])], "step 2 free_blocks(block_ids=1,"),
        (HEADER, [("get_new_blocks", [1]), ("free_blocks", [[-1]])], "step 2 free_blocks(block_ids=[-1],"),
        (HEADER, [("get_new_blocks", [1]), ("cache_full_blocks", [[1], "h"])], "step 2 cache_full_blocks("),
        (HEADER, [("get_new_blocks", [1]), ("touch", [[[1]]])], "step 2 touch("),
        (MANAGER_HEADER, [("allocate_slots", [5, 5, 0, [], 0, False])], "step 1 allocate_slots(request=5"),
        (MANAGER_HEADER, [("allocate_slots", [{"request": {**REQUEST, "request_id": 7}}, 5, 0, [], 0, False])],
         "step 1 allocate_slots("),
        (MANAGER_HEADER, [("allocate_slots", [{"request": REQUEST}, -5, 0, [], 0, False])], "step 1 allocate_slots("),
    ],
)  # fmt: skip
def test_view_refuses_a_step_no_campaign_could_have_sent(
    tmp_path: Path, header: dict[str, Any], steps: list[tuple[str, list[Any]]], says: str
) -> None:
    err = _refused_in_one_line(_kvspec(tmp_path, "view", str(_write(tmp_path, header, *steps))), "view")
    assert says in err, err


def test_view_still_draws_a_recorded_caller_mistake(tmp_path: Path) -> None:
    # A double free recorded as the mistake it is: a call a campaign sends, drawn as one.
    lines = [
        HEADER,
        {"step": 1, "op": "get_new_blocks", "args": [1]},
        {"step": 2, "op": "free_blocks", "args": [[1]]},
        {"step": 3, "op": "free_blocks", "args": [[1]], "mistake": "free_blocks: double free"},
    ]
    path = tmp_path / "mistake.trace.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    done = _kvspec(tmp_path, "view", str(path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "mistake.html").is_file() and ", 3 steps)" in done.stdout


def test_view_draws_recorded_results_and_states_of_the_wrong_shape_as_they_are(tmp_path: Path) -> None:
    # Outcomes and states are for people and never trusted: a hit that is no list of blocks, an
    # implementation's state with fewer ref counts than blocks and a pool size far beyond its lists. The
    # spec's side is computed, and the page says the file's differs; the implementation's is drawn as it is.
    snapshot = {
        "num_gpu_blocks": 8, "enable_caching": True, "ref_cnt": [0] * 8, "block_hash": [None] * 8,
        "free_queue": list(range(1, 8)), "hash_to_blocks": [], "block_tables": [], "quarantined": [],
    }  # fmt: skip
    short = {**snapshot, "num_gpu_blocks": 10**12, "ref_cnt": [0, 1], "free_queue": [5, 10**9]}
    lines = [
        MANAGER_HEADER,
        {"step": 1, "op": "get_computed_blocks", "args": [{"request": REQUEST}, None],
         "spec": {"result": [1, "x"]}, "impl": {"result": [[1], "x"]}, "spec_snapshot": snapshot,
         "impl_snapshot": short},
        {"step": 2, "op": "get_computed_blocks", "args": [{"request": REQUEST}, None],
         "spec": {"result": [[], 0]}, "impl": {"result": [[], 0]}, "spec_snapshot": snapshot,
         "impl_snapshot": {**short, "ref_cnt": [0]}},
    ]  # fmt: skip
    path = tmp_path / "shapes.trace.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    done = _kvspec(tmp_path, "view", str(path))
    assert done.returncode == 0 and done.stderr == "", done.stdout + done.stderr
    page = (tmp_path / "shapes.html").read_text()
    assert "[[1], 'x']" in page and "[1, 'x']" not in page.replace("[[1], 'x']", "")
    assert "recorded spec outcome at step 1 differs from what the spec computes" in page
