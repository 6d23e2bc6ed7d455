"""What a command writes when the file or stdout cannot take it: one line on stderr, exit 2, nothing half-written.

Every `--json PATH`, `--junit PATH`, `--html PATH`, `-o PATH` and `--plot PNG`,
and every trace and page a run saves, is written whole or not at all
(kvspec.conformance.core.files.write_whole): a full disk leaves the file that was
there as it was, and a run's verdict stands where its trace or page could not be saved. A stdout that cannot be
written is said in one line too, and `--json -` puts the JSON alone on stdout.
Each case runs the real command line in a process of its own, as a user does.
"""

from __future__ import annotations

import importlib.util
import json
import os
import resource
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvspec.conformance.core.trace import read_trace
from kvspec.conformance.tools.commands._arguments import write_output

ROOT = Path(__file__).resolve().parents[2]
TRACE = ROOT / "docs" / "traces" / "inv_hash_table_consistent.trace.jsonl"
CAPACITY = ["capacity", "--gpu-mem", "141GiB", "--layers", "32", "--kv-heads", "8", "--head-dim", "128"]
CHECK = ["check", "--impl", "spec", "--level", "pool", "--caching", "on", "--max-examples", "3", "--cover-rounds", "0"]
SIMULATE = ["simulate", "--workload", "chat", "--pool", "64", "--jobs", "1"]
BENCH_GPU = ["bench", "gpu", "--pools", "100", "--batches", "1", "--seconds", "0.01", "--no-content", "--no-hash-map",
             "--device", "cpu"]  # fmt: skip
BENCH_REFERENCE = ["bench", "reference", "--sizes", "2000", "--repeat", "3"]
NO_TORCH = importlib.util.find_spec("torch") is None
NO_MATPLOTLIB = importlib.util.find_spec("matplotlib") is None
needs_dev_full = pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full on this system")


def kvspec(argv: list[str], cwd: Path, stdout: Any = subprocess.PIPE, preexec_fn: Any = None) -> Any:
    argv = [a.replace("TRACE", str(TRACE)) for a in argv]
    return subprocess.run(
        [sys.executable, "-m", "kvspec", *argv], cwd=cwd, stdout=stdout, stderr=subprocess.PIPE, text=True,
        timeout=120, preexec_fn=preexec_fn,
    )  # fmt: skip


def assert_one_line(done: subprocess.CompletedProcess[str], says: str) -> None:
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "Traceback" not in (done.stdout or "") + done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and says in lines[0], done.stderr


def _command(argv: list[str]) -> str:
    return " ".join(argv[:2]) if argv[0] == "bench" else argv[0]


def _state(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@needs_dev_full
@pytest.mark.parametrize(
    "argv",
    [
        [*CHECK, "--json", "/dev/full"],
        [*CHECK, "--junit", "/dev/full"],
        ["replay", "TRACE", "--impl", "reference", "--json", "/dev/full"],
        [*CAPACITY, "--json", "/dev/full"],
        [*SIMULATE, "--json", "/dev/full"],
        pytest.param([*SIMULATE, "--plot", "/dev/full"], marks=pytest.mark.skipif(NO_MATPLOTLIB, reason="no plot")),
        pytest.param([*BENCH_GPU, "--json", "/dev/full"], marks=pytest.mark.skipif(NO_TORCH, reason="no torch")),
        [*BENCH_REFERENCE, "--json", "/dev/full"],
        ["errors", "--json", "/dev/full"],
        ["demo", "--html", "/dev/full"],
        ["view", "TRACE", "-o", "/dev/full"],
    ],
    ids=lambda argv: f"{_command(argv)} {argv[-2]}",
)
def test_a_report_on_a_full_device_is_one_line_and_exit_2(tmp_path: Path, argv: list[str]) -> None:
    done = kvspec(argv, tmp_path)
    assert_one_line(done, f"kvspec {_command(argv)}: cannot write /dev/full: No space left on device")


def _small_files() -> None:
    # A disk that fills up after 4 KiB: a write past it fails (EFBIG), as a full disk's does (ENOSPC).
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))


@pytest.mark.parametrize(
    "argv",
    [["errors", "--json", "report"], ["demo", "--html", "report"], ["view", "TRACE", "-o", "report"]],
    ids=lambda argv: argv[0],
)
def test_a_write_that_fails_leaves_the_old_report_as_it_was(tmp_path: Path, argv: list[str]) -> None:
    # It was replaced by the first 4 KiB of the new report: invalid JSON (or HTML) where a good report stood.
    (tmp_path / "report").write_bytes(b'{"an earlier report": "kept byte for byte"}\n')
    before = _state(tmp_path)
    done = kvspec(argv, tmp_path, preexec_fn=_small_files)
    assert_one_line(done, f"kvspec {argv[0]}: cannot write report: File too large")
    assert _state(tmp_path) == before  # the old report, and no temporary file left beside it


def test_a_report_replaces_the_file_a_link_names_and_keeps_its_mode(tmp_path: Path) -> None:
    real = tmp_path / "real.json"
    real.write_text("old")
    real.chmod(0o640)
    (tmp_path / "link.json").symlink_to(real)
    assert write_output("kvspec test", tmp_path / "link.json", "new") == 0
    assert (tmp_path / "link.json").is_symlink() and real.read_text() == "new"
    assert real.stat().st_mode & 0o777 == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.json", "real.json"]


@needs_dev_full
@pytest.mark.parametrize(
    "argv",
    [
        ["invariants"],
        ["errors"],
        ["demo"],
        ["mutants", "--list"],
        ["replay", "TRACE", "--impl", "reference"],
        CAPACITY,
        ["--help"],
    ],
    ids=lambda argv: _command(argv),
)
def test_a_full_stdout_is_one_line_and_exit_2(tmp_path: Path, argv: list[str]) -> None:
    with open("/dev/full", "w") as full:
        done = kvspec(argv, tmp_path, stdout=full)
    prog = "kvspec" if argv[0].startswith("-") else f"kvspec {argv[0]}"
    assert_one_line(done, f"{prog}: cannot write stdout: No space left on device")


@pytest.mark.parametrize(
    ("argv", "text"),
    [
        (CHECK, "result:"),
        (CAPACITY, "num_gpu_blocks"),
        (["replay", "TRACE", "--impl", "reference"], "verdict:"),
        (["errors"], "get_new_blocks(num_blocks)"),
        (SIMULATE, "hit rate"),
        (BENCH_REFERENCE, "reference model"),
        pytest.param(BENCH_GPU, "gpu_impl", marks=pytest.mark.skipif(NO_TORCH, reason="no torch")),
    ],
    ids=["check", "capacity", "replay", "errors", "simulate", "bench reference", "bench gpu"],
)
def test_json_to_stdout_is_the_json_alone(tmp_path: Path, argv: list[str], text: str) -> None:
    done = kvspec([*argv, "--json", "-"], tmp_path)
    assert done.returncode in (0, 1, 2) and "Traceback" not in done.stderr, done.stderr
    assert isinstance(json.loads(done.stdout), (dict, list)), done.stdout  # the whole of stdout, nothing else
    assert text in done.stderr  # the text for people, where it does not mix with the JSON


def test_replay_refusing_its_implementation_writes_nothing(tmp_path: Path) -> None:
    # It said no in one line, then replaced the report with one of a run that never started; check writes none.
    (tmp_path / "precious.json").write_text('{"kept": true}\n')
    before = _state(tmp_path)
    for command in (["replay", "TRACE"], ["check", "--level", "pool"]):
        done = kvspec([*command, "--impl", "nonexistent:f", "--json", "precious.json"], tmp_path)
        said = f"kvspec {command[0]}: implementation 'nonexistent:f': module nonexistent does not import"
        assert_one_line(done, said)
        assert done.stdout == ""
        assert _state(tmp_path) == before
    assert os.listdir(tmp_path) == ["precious.json"]


# --- traces and pages: a run's own files -------------------------------------------------------------

BUGGY_POOL = ["check", "--impl", str(ROOT / "examples" / "pool_example.py") + ":factory", "--level", "pool",
              "--caching", "on", "--max-examples", "50", "--cover-rounds", "0"]  # fmt: skip


def _no_half_files(folder: Path) -> None:
    assert not [p for p in folder.rglob("*") if p.name.endswith(".tmp")]
    for trace in folder.rglob("*.trace.jsonl"):
        read_trace(trace)  # whole: it reads


def test_a_trace_or_page_that_cannot_be_written_is_said_and_the_verdict_stands(tmp_path: Path, monkeypatch) -> None:
    # Within 4 KiB the shrunk failure's trace fits; the deepest example's trace and the page do not. They
    # were a traceback (and half a file) where the verdict should have been.
    monkeypatch.setenv("KVSPEC_EXAMPLE_BUG", "pool")
    argv = [*BUGGY_POOL, "--trace-dir", "traces", "--html-dir", "pages", "--keep-deepest"]
    done = kvspec(argv, tmp_path, preexec_fn=_small_files)
    assert done.returncode == 1 and "Traceback" not in done.stdout + done.stderr, done.stdout + done.stderr
    assert "result: 1 diverges (exit 1)" in done.stdout
    assert "the deepest example's trace was not saved in traces (File too large)" in done.stdout
    assert "page: not written (OSError: [Errno 27] File too large)" in done.stdout
    assert "replay: kvspec replay traces/failure-pool-" in done.stdout
    _no_half_files(tmp_path)
    assert list((tmp_path / "pages").iterdir()) == []


def test_a_trace_that_cannot_be_saved_leaves_its_story_and_says_so(tmp_path: Path, monkeypatch) -> None:
    # The implementation's long name (a path of 1.4 KB) is in every trace's header: with examples of at most
    # 10 steps the campaign's stream of steps stays within 4 KiB, and the shrunk trace does not.
    monkeypatch.setenv("KVSPEC_EXAMPLE_BUG", "pool")
    folder = tmp_path.joinpath(*["d" * 200] * 7)
    folder.mkdir(parents=True)
    (folder / "pool_example.py").write_text((ROOT / "examples" / "pool_example.py").read_text())
    argv = [*BUGGY_POOL[:2], f"{folder}/pool_example.py:factory", *BUGGY_POOL[3:], "--steps", "10", "--trace-dir",
            "traces"]  # fmt: skip
    done = kvspec(argv, tmp_path, preexec_fn=_small_files)
    assert done.returncode == 1 and "Traceback" not in done.stdout + done.stderr, done.stdout + done.stderr
    assert "trace: not saved in traces (File too large)" in done.stdout
    assert "DIVERGES: invariant at step" in done.stdout and "replay:" not in done.stdout
    _no_half_files(tmp_path)


def test_a_refusal_of_the_system_that_no_handler_meets_is_one_line(tmp_path: Path, monkeypatch) -> None:
    # 2 KiB is too small for the shared memory a campaign's child reports through: no campaign can start.
    def tinier_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (2048, 2048))

    monkeypatch.setenv("KVSPEC_EXAMPLE_BUG", "pool")
    done = kvspec([*BUGGY_POOL, "--trace-dir", "traces"], tmp_path, preexec_fn=tinier_files)
    assert_one_line(done, "kvspec check: the system refused an operation (File too large")


def test_a_refusal_of_the_system_in_a_campaign_is_no_fault_of_kvspec(tmp_path: Path) -> None:
    # Within 4 KiB a request-level campaign's stream of steps (written before each step runs) overflows.
    argv = ["check", "--impl", "spec", "--level", "manager", "--caching", "on", "--max-examples", "20",
            "--cover-rounds", "0", "--trace-dir", "traces"]  # fmt: skip
    done = kvspec(argv, tmp_path, preexec_fn=_small_files)
    assert done.returncode == 2 and "Traceback" not in done.stdout + done.stderr, done.stdout + done.stderr
    assert "could-not-run" in done.stdout and "kvspec itself failed" not in done.stdout
    assert "the system refused an operation (File too large" in done.stdout
