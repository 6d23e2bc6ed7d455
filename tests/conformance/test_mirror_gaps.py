"""`kvspec mirror` passes only on a stream it replayed to the last step: a trace with gaps or no events is refused.

Each case runs the real command in a process of its own. The traces are the
shape `kvspec check --events` writes (a pool of one block that stores a key
and evicts it), with the parts a hand edit, a crash or another tool leaves out.
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
        "num_gpu_blocks": 2,
        "enable_caching": True,
        "profile": "vllm-v1",
        "block_size": 4,
        "hash_fn": "sha256_cbor",
        "seed": "kvspec",
        "device": None,
        "events": True,
    },  # fmt: skip
    "impl": "reference",
}
KEY = "686173682d30"
STORED = {"type": "BlockStored", "block_hashes": [KEY], "parent_block_hash": None, "token_ids": None,
          "block_size": None, "lora_name": None, "extra_keys": None, "group_idx": 0, "medium": "GPU"}  # fmt: skip
REMOVED = {"type": "BlockRemoved", "block_hashes": [KEY], "medium": "GPU"}


def _snapshot(ref_cnt: list[int], free_queue: list[int], hashed: bool) -> dict[str, Any]:
    return {
        "num_gpu_blocks": 2, "enable_caching": True, "ref_cnt": ref_cnt,
        "block_hash": [None, KEY if hashed else None], "free_queue": free_queue,
        "hash_to_blocks": [[KEY, [1]]] if hashed else [], "block_tables": None, "quarantined": [],
    }  # fmt: skip


def _steps(removal_published: bool = True) -> list[dict[str, Any]]:
    """get_new_blocks(1), cache_full_blocks([1], [key]), evict_blocks([1]), both sides recorded at every step."""
    removed = [REMOVED] if removal_published else []
    rows = [
        ("get_new_blocks", [1], {"result": [1]}, {"result": [1]}, _snapshot([0, 1], [], False)),
        ("cache_full_blocks", [[1], [{"bytes": KEY}]], {"result": None, "events": [STORED]},
         {"result": None, "events": [STORED]}, _snapshot([0, 1], [], True)),
        ("evict_blocks", [[1]], {"result": None, "events": [REMOVED]}, {"result": None, "events": removed},
         _snapshot([0, 1], [], False)),
    ]  # fmt: skip
    return [
        {"step": i, "op": op, "args": args, "spec": spec, "impl": impl, "spec_snapshot": snap, "impl_snapshot": snap}
        for i, (op, args, spec, impl, snap) in enumerate(rows, start=1)
    ]


def _mirror(tmp_path: Path, lines: list[dict[str, Any]], *more: str) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "t.trace.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    argv = [sys.executable, "-m", "kvspec", "mirror", str(path), *more]
    return subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True)


def _refused(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout == "" and done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith("kvspec mirror: ")
    return done.stderr


def test_a_whole_stream_replayed_to_the_last_step_passes(tmp_path: Path) -> None:
    done = _mirror(tmp_path, [HEADER, *_steps()])
    assert done.returncode == 0, done.stdout + done.stderr
    assert "the implementation's stream: 2 events in 3 steps" in done.stdout


@pytest.mark.parametrize("side", ["implementation", "spec"])
@pytest.mark.parametrize("gap", ["null", "missing"])
def test_steps_without_snapshots_are_refused_not_passed(tmp_path: Path, side: str, gap: str) -> None:
    steps = _steps()
    for step in steps:
        for key in ("spec_snapshot", "impl_snapshot"):
            if gap == "null":
                step[key] = None
            else:
                del step[key]
    err = _refused(_mirror(tmp_path, [HEADER, *steps], "--side", side))
    assert f"step 1 (get_new_blocks) of 3 lacks the {side}'s state (snapshot)" in err


def test_a_gap_at_the_last_step_is_refused_not_passed(tmp_path: Path) -> None:
    steps = _steps()
    steps[2]["impl_snapshot"] = None
    err = _refused(_mirror(tmp_path, [HEADER, *steps]))
    assert "step 3 (evict_blocks) of 3 lacks the implementation's state (snapshot)" in err


def test_a_step_without_the_sides_outcome_is_refused(tmp_path: Path) -> None:
    steps = _steps()
    steps[1]["impl"] = None
    err = _refused(_mirror(tmp_path, [HEADER, *steps]))
    assert "step 2 (cache_full_blocks) of 3 lacks the implementation's outcome" in err


def test_a_trace_with_no_steps_is_refused(tmp_path: Path) -> None:
    assert "the trace has no steps" in _refused(_mirror(tmp_path, [HEADER]))


def test_a_stream_with_no_events_is_refused(tmp_path: Path) -> None:
    err = _refused(_mirror(tmp_path, [HEADER, *_steps()[:1]]))
    assert "the implementation's stream has no events in 1 step" in err


def test_a_drift_before_a_gap_still_exits_1_and_says_where_it_stopped(tmp_path: Path) -> None:
    steps = _steps(removal_published=False)  # the implementation evicts without a BlockRemoved: step 3 drifts
    steps.append({"step": 4, "op": "get_new_blocks", "args": [1], "spec": {"result": [1]}, "impl": None,
                  "spec_snapshot": None, "impl_snapshot": None})  # fmt: skip
    done = _mirror(tmp_path, [HEADER, *steps])
    assert done.returncode == 1, done.stdout + done.stderr
    assert "counting mirror (a count per key): drifts at step 3 (evict_blocks)" in done.stdout
    assert "replayed up to step 4, which lacks the implementation's outcome or state" in done.stdout
    done = _mirror(tmp_path, [HEADER, *steps], "--json")
    assert done.returncode == 1 and json.loads(done.stdout)["stopped_at"] == 4
