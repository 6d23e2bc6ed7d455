"""The gate never says "ok" for work it did not do, and a user's mistake gets one line.

Each case runs the real command line in a subprocess, as a CI job would, and
checks the exit code (0 conforms, 1 the implementation is wrong, 2 no
verdict), that stderr holds one line and no traceback, and that nothing is
created outside the paths named.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import unittest
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from kvspec.conformance.core.results import Verdict
from kvspec.conformance.runner.run import run_check
from kvspec.conformance.runner.testcase import make_conformance_test
from tests.conformance import adapters

ROOT = Path(__file__).resolve().parents[2]
ADAPTERS = "tests.conformance.adapters"


def kvspec(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "kvspec", *args], cwd=cwd, env=environment, capture_output=True, text=True, timeout=300
    )


def assert_refused(result: subprocess.CompletedProcess[str], *words: str) -> None:
    """Exit 2, one line on stderr naming the problem, no traceback anywhere."""
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    for word in words:
        assert word in lines[0], lines[0]


# --- every argument checked before any work -------------------------------------------------------

REFUSALS = [
    (("check", "--time-budget", "-5"), "--time-budget"),
    (("check", "--time-budget", "0"), "--time-budget"),
    (("check", "--step-timeout", "-1"), "--step-timeout"),
    (("check", "--max-examples", "0"), "--max-examples"),
    (("check", "--steps", "0"), "--steps"),
    (("check", "--cover-rounds", "-1"), "--cover-rounds"),
    (("check", "--seed", "-1"), "--seed"),
    (("check", "--level", "rack"), "--level"),
    (("check", "--profile", "lfu-maybe"), "lfu-maybe"),
    (("check", "--junit", "/proc/x"), "/proc/x"),
    (("check", "--junit", "/nonexistent/dir/out.xml"), "does not exist"),
    (("check", "--json", "/nonexistent/dir/out.json"), "does not exist"),
    (("check", "--trace-dir", "/nonexistent/dir/traces"), "does not exist"),
    (("check", "--trace-dir", "/proc/kvspec-traces"), "cannot be created"),
    (("check", "--impl", "no_such_module_here:factory"), "does not import"),
    (("replay", "t.jsonl", "--step-timeout", "0"), "--step-timeout"),
    (("mutants", "--max-examples", "0"), "--max-examples"),
    (("mutants", "--time-budget", "-1"), "--time-budget"),
    (("prove", "--timeout", "-1"), "--timeout"),
    (("contracts", "--per-condition-timeout", "-1"), "--per-condition-timeout"),
    (("contracts", "--per-path-timeout", "0"), "--per-path-timeout"),
    (("capacity", "--gpu-mem", "141", "--layers", "2", "--kv-heads", "2", "--head-dim", "8"), "GiB"),
    (("capacity", "--gpu-mem=-5GiB", "--layers", "2", "--kv-heads", "2", "--head-dim", "8"), "negative"),
    (("capacity", "--gpu-mem", "8GiB", "--layers", "-2", "--kv-heads", "2", "--head-dim", "8"), "--layers"),
    (
        ("capacity", "--gpu-mem", "8GiB", "--layers", "2", "--kv-heads", "2", "--head-dim", "8", "--margin", "1"),
        "--margin",
    ),
    (("oracle", "--vllm", "9.9.9"), "cannot download vllm==9.9.9 from the package registry"),
    (("oracle", "--vllm", "0.33.0", "--time-budget", "-1"), "--time-budget"),
    (("view", "t.jsonl", "--port", "70000"), "--port"),
]


@pytest.mark.parametrize(("args", "word"), REFUSALS, ids=lambda a: " ".join(a) if isinstance(a, tuple) else a)
def test_a_bad_argument_is_refused_in_one_line_before_any_work(tmp_path, args, word):
    result = kvspec(*args, cwd=tmp_path)
    assert_refused(result, word)
    assert list(tmp_path.iterdir()) == []  # no trace folder, no report: nothing ran
    assert not Path("/nonexistent").exists()


def test_a_trace_with_a_malformed_header_is_refused_in_one_line(tmp_path):
    header = {"kvspec_trace": 1, "level": "pool", "impl": "reference", "config": {
        "num_gpu_blocks": -4, "enable_caching": True, "profile": "vllm-v1", "block_size": 4,
        "hash_fn": "sha256", "seed": "", "device": None}}  # fmt: skip
    trace = tmp_path / "bad.trace.jsonl"
    trace.write_text(json.dumps(header) + "\n")
    assert_refused(kvspec("replay", str(trace), cwd=tmp_path), "num_gpu_blocks")


def test_a_missing_optional_dependency_names_the_extra_to_install(tmp_path):
    # A stand-in module that refuses to import, as a machine without the extra has none.
    blocker = tmp_path / "block"
    for name in ("crosshair", "msgspec"):
        (blocker / name).mkdir(parents=True)
        (blocker / name / "__init__.py").write_text(f'raise ImportError("No module named {name}")\n')
    env = {"PYTHONPATH": f"{blocker}{os.pathsep}{ROOT}"}
    assert_refused(kvspec("contracts", "--function", "touch", cwd=tmp_path, env=env), "kvspec[proofs]")
    assert_refused(kvspec("hashes", "--version", "0.33.0", cwd=tmp_path, env=env), "kvspec[vllm]")


# --- no verdict without work -------------------------------------------------------------------------


def test_a_campaign_that_ran_no_example_is_inconclusive_not_conforming():
    r = run_check("reference", time_budget_s=1e-9, isolate=False)
    assert r.verdict is Verdict.INCONCLUSIVE and r.exit_code == 2
    assert "no example ran" in r.message and r.examples_run == 0


def test_fewer_examples_than_the_floor_is_inconclusive_unless_that_many_were_asked_for():
    # Three asked for is a floor of three; three examples still leave branches unreached: named, and how to reach them.
    asked = run_check("reference", max_examples=3, cover_rounds=0, isolate=False)
    assert asked.verdict is Verdict.INCONCLUSIVE and "fewer than the floor" not in asked.message
    assert "not reached" in asked.message and "--max-examples" in asked.message
    r = run_check("reference", max_examples=100, time_budget_s=0.02, isolate=False)
    assert r.verdict in (Verdict.INCONCLUSIVE, Verdict.CONFORMS)
    if r.verdict is Verdict.INCONCLUSIVE:
        assert any(why in r.message for why in ("fewer than the floor", "no example ran", "not reached"))
    else:
        assert r.examples_run >= 10


def test_a_wrong_error_type_is_the_implementation_being_wrong_exit_1(tmp_path):
    result = kvspec(
        "check", "--impl", f"{ADAPTERS}:make_asserts_on_overallocation", "--level", "pool", "--caching", "on",
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 1, result.stdout
    assert "crashed" in result.stdout and "AssertionError" in result.stdout


# --- levels declared, not failed -------------------------------------------------------------------------


def test_a_pool_only_factory_conforms_and_its_request_level_is_n_a(tmp_path):
    junit, report = tmp_path / "out.xml", tmp_path / "out.json"
    result = kvspec(
        "check", "--impl", f"{ADAPTERS}:make_pool_only", "--max-examples", "100", "--junit", str(junit),
        "--json", str(report), cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [line.split() for line in result.stdout.splitlines() if line.startswith(f"{ADAPTERS}:make_pool_only")]
    assert [(r[1], r[3]) for r in rows] == [("pool", "conforms")] * 2 + [("manager", "n/a")] * 2
    assert "could-not-run" not in result.stdout
    assert "preemptions" not in result.stdout  # no request-level counters for a pool-only run
    skipped = ET.parse(junit).getroot().findall(".//skipped")
    assert len(skipped) == 2 and "manager level not provided" in skipped[0].get("message", "")
    data = json.loads(report.read_text())
    assert data["exit_code"] == 0 and [r["verdict"] for r in data["results"]] == ["conforms"] * 2 + ["n/a"] * 2
    assert all(r["steps"] > 0 for r in data["results"][:2])


def test_make_conformance_test_skips_a_level_the_factory_does_not_provide():
    case = make_conformance_test(adapters.make_pool_only, level="manager", enable_caching=True, max_examples=5)
    with open(os.devnull, "w") as quiet:
        outcome = unittest.TextTestRunner(stream=quiet).run(unittest.defaultTestLoader.loadTestsFromTestCase(case))
    assert len(outcome.skipped) == 1 and "manager level not provided" in outcome.skipped[0][1]


def test_a_missing_optional_operation_is_reported_against_the_whole_spec(tmp_path):
    result = kvspec(
        "check", "--impl", f"{ADAPTERS}:make_no_evict_blocks", "--level", "pool", "--caching", "on",
        "--max-examples", "30", "--no-events", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout
    (row,) = [line for line in result.stdout.splitlines() if line.startswith(ADAPTERS)]
    reached, total = row.split()[-1].split("/")
    assert total == "37" and int(reached) < 37
    assert "not provided" in result.stdout and "evict_blocks" in result.stdout


# --- output for people and for tools -----------------------------------------------------------------


def test_a_run_leaves_nothing_in_the_temporary_directory_and_traces_go_to_kvspec_traces(tmp_path):
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    work = tmp_path / "work"
    work.mkdir()
    result = kvspec(
        "check", "--impl", f"{ADAPTERS}:make_free_head_first", "--level", "pool", "--caching", "on",
        cwd=work, env={"TMPDIR": str(scratch)},
    )  # fmt: skip
    assert result.returncode == 1
    assert list(scratch.iterdir()) == []
    assert [p.name for p in work.iterdir()] == ["kvspec-traces"]
    assert list((work / "kvspec-traces").glob("failure-pool-*.trace.jsonl"))


def test_the_implementation_column_never_truncates_a_name(tmp_path):
    name = f"{ADAPTERS}:make_pool_only"
    result = kvspec("check", "--impl", name, "--level", "pool", "--caching", "on", "--max-examples", "10", cwd=tmp_path)
    assert any(line.startswith(name + " ") for line in result.stdout.splitlines()), result.stdout


def test_capacity_bench_and_replay_write_json_for_tools(tmp_path):
    plan = tmp_path / "plan.json"
    args = ("capacity", "--gpu-mem", "80GB", "--layers", "32", "--kv-heads", "8", "--head-dim", "128")
    assert kvspec(*args, "--json", str(plan), cwd=tmp_path).returncode == 0
    assert json.loads(plan.read_text())["num_gpu_blocks"] == 30517
    bench = kvspec("bench", "reference", "--sizes", "2000", "4000", "--repeat", "3", "--json", "-", cwd=tmp_path)
    assert bench.returncode == 0, bench.stderr
    document = json.loads(bench.stdout[bench.stdout.index("{") :])
    assert {m["num_gpu_blocks"] for m in document["measurements"]} == {2000, 4000}
    assert_refused(kvspec("bench", "reference", "--json", "/nonexistent/b.json", cwd=tmp_path), "does not exist")
    gpu = tmp_path / "gpu.json"
    tiny = ("--pools", "100", "--batches", "1", "--seconds", "0.01", "--no-content", "--no-hash-map")
    assert kvspec("bench", "gpu", *tiny, "--json", str(gpu), cwd=tmp_path).returncode == 0
    measured = json.loads(gpu.read_text())
    assert measured["kvspec"] == "bench gpu" and {m["num_gpu_blocks"] for m in measured["measurements"]} == {100}
    assert all(m["ratio"] > 0 for m in measured["measurements"])
    assert_refused(kvspec("bench", "gpu", "--json", "/nonexistent/g.json", cwd=tmp_path), "does not exist")
    failing = kvspec(
        "check", "--impl", f"{ADAPTERS}:make_free_head_first", "--level", "pool", "--caching", "on",
        "--trace-dir", str(tmp_path), cwd=tmp_path,
    )  # fmt: skip
    (trace,) = tmp_path.glob("failure-pool-*.trace.jsonl")
    assert failing.returncode == 1
    report = tmp_path / "replay.json"
    again = kvspec("replay", str(trace), "--json", str(report), cwd=tmp_path)
    assert again.returncode == 1
    (result,) = json.loads(report.read_text())["results"]
    assert result["verdict"] == Verdict.DIVERGES and result["failure"]["op"] == "free_blocks"
