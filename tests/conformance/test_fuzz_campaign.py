"""A short HypoFuzz campaign on a planted mutant (KVSPEC_FUZZ=1, the fuzz extra: scripts/test-fuzz.sh).

The campaign must report the failure it finds, not crash in HypoFuzz's own
code (HypoFuzz 25.11.1 on a Hypothesis from 6.157.1 on does, after shrinking:
the pin in pyproject's fuzz extra), and what it saved must replay: the trace
the worker wrote under `kvspec replay`, and the database under pytest.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis.database import DirectoryBasedExampleDatabase

from kvspec.conformance.core.results import Verdict
from kvspec.conformance.runner.run import replay

ROOT = Path(__file__).resolve().parents[2]
TARGETS = "tests/conformance/fuzz_targets.py"
TARGET = "TestPoolCachingOn"
# get_num_free_blocks counts the null block: wrong on the first call, so a campaign finds it in seconds
MUTANT = "kvspec.mutants.allocation:NumFreeCountsNullBlock"
CAMPAIGN_LIMIT_S = 90.0

# NOTE: HypoFuzz prints nothing when it finds a failure (its dashboard shows it).
# It saves the shrunk failure's observation, which the dashboard reads, under a
# key of its own; the directory database lists every key it holds under this one.
_KEYS = b".hypothesis-keys"
_SHRUNK = b".hypofuzz.failures.shrunk."
_FATAL = b".hypofuzz.fatal_failure"


def _keys(db_dir: Path) -> list[bytes]:
    return list(DirectoryBasedExampleDatabase(str(db_dir)).fetch(_KEYS)) if db_dir.exists() else []


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        KVSPEC_FUZZ_IMPL=MUTANT,
        KVSPEC_FUZZ_DB=str(tmp_path / "db"),
        KVSPEC_FUZZ_TRACE_DIR=str(tmp_path / "traces"),
        **extra,
    )
    return env


def _campaign(tmp_path: Path) -> tuple[str, float]:
    """Run `hypothesis fuzz` until HypoFuzz has saved a shrunk failure (or the limit); its output and seconds."""
    hypothesis_cli = Path(sys.executable).with_name("hypothesis")
    command = [str(hypothesis_cli), "fuzz", "--no-dashboard", "-n", "1", "--", TARGETS, "-k", TARGET]
    log = tmp_path / "campaign.log"
    started = time.monotonic()
    with log.open("w") as out:
        # its own session, so the hub, its manager and the worker all stop together
        proc = subprocess.Popen(
            command, cwd=ROOT, env=_env(tmp_path), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            while time.monotonic() - started < CAMPAIGN_LIMIT_S and proc.poll() is None:
                if any(_SHRUNK in key for key in _keys(tmp_path / "db")):
                    # the worker crashes (if it does) right after shrinking: give it a moment to
                    time.sleep(2.0)
                    break
                time.sleep(0.5)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
    return log.read_text(), time.monotonic() - started


@pytest.mark.fuzz
@pytest.mark.timeout(300)
def test_a_campaign_reports_the_failure_it_finds_and_it_replays(tmp_path):
    # inside the test, not at import, so that without KVSPEC_FUZZ=1 it is deselected like any opt-in test
    pytest.importorskip("hypofuzz", reason="HypoFuzz is not installed: the fuzz extra, set up by scripts/test-fuzz.sh")
    output, seconds = _campaign(tmp_path)
    keys = _keys(tmp_path / "db")

    assert "Traceback" not in output, f"the campaign crashed:\n{output}"
    assert "No property-based tests were collected" not in output, f"HypoFuzz refused the target:\n{output}"
    assert not [k for k in keys if _FATAL in k], f"HypoFuzz could not run the target:\n{output}"
    assert any(_SHRUNK in k for k in keys), f"no shrunk failure saved within {seconds:.0f} s:\n{output}"
    assert f"kvspec fuzz: {TARGET} found a failure" in output, output

    traces = sorted((tmp_path / "traces").glob(f"fuzz-{TARGET}-*.trace.jsonl"))
    assert len(traces) == 1, traces  # one worker, one target
    result = replay(traces[0], MUTANT)
    assert result.verdict is Verdict.DIVERGES, result.message
    assert result.failure is not None and result.failure.op == "get_num_free_blocks", result.failure

    # What HypoFuzz saved replays under plain pytest (replaying only: nothing new is generated).
    rerun = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", TARGETS, "-k", TARGET],
        cwd=ROOT,
        env=_env(tmp_path, KVSPEC_FUZZ_REPLAY="1"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert rerun.returncode == 1, rerun.stdout + rerun.stderr
    assert "DIVERGES: " in rerun.stdout and "get_num_free_blocks" in rerun.stdout, rerun.stdout
