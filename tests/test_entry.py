"""The `kvspec` command's own process: its exit code is the one the command reported, whatever ends the
process that runs the command (kvspec._entry's design note).

Each test runs the command as a user does, `python -m kvspec` in a subprocess, with an implementation whose
module ends the process as it loads: the exit code it chose was the command's, 0 (a conforming run's) among
them, with nothing said.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvspec import _entry
from kvspec.conformance.core.results import EXIT_COULD_NOT_RUN

KVSPEC = [sys.executable, "-m", "kvspec"]
POOL = Path(__file__).resolve().parents[1] / "examples" / "pool_example.py"


def _check(module: Path, *more: str) -> list[str]:
    return [*KVSPEC, "check", "--impl", f"{module}:factory", "--level", "pool", "--max-examples", "10", *more]


def _pool_that_first_runs(tmp_path: Path, line: str) -> Path:
    """The example pool, with `line` run at the top of its module (after its __future__ import)."""
    text = POOL.read_text(encoding="utf-8").replace("import os\n", f"import os\n{line}\n", 1)
    module = tmp_path / "ending_pool.py"
    module.write_text(text, encoding="utf-8")
    return module


def test_the_entry_point_s_exit_codes_are_the_results_module_s() -> None:
    assert _entry.EXIT_COULD_NOT_RUN == EXIT_COULD_NOT_RUN


@pytest.mark.parametrize(
    ("line", "how"),
    [
        ("os._exit(0)", "exited with status 0"),
        ("os._exit(1)", "exited with status 1"),
        ("os.kill(os.getpid(), 9)", "was killed by SIGKILL"),
        ("import ctypes; ctypes.string_at(0)", "was killed by SIGSEGV"),
    ],
    ids=["exit-0", "exit-1", "sigkill", "segfault"],
)
def test_an_implementation_that_ends_the_process_as_it_loads_gets_no_verdict(tmp_path: Path, line, how) -> None:
    r = subprocess.run(_check(_pool_that_first_runs(tmp_path, line)), cwd=tmp_path, capture_output=True, text=True,
                       timeout=120)  # fmt: skip
    assert r.returncode == EXIT_COULD_NOT_RUN, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvspec check: no verdict: its process ") and how in lines[0], lines
    assert "Traceback" not in r.stdout + r.stderr


def test_the_command_s_own_exit_codes_pass_through(tmp_path: Path) -> None:
    conforms = subprocess.run(_check(POOL), cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert conforms.returncode == 0 and "result: 2 conforms (exit 0)" in conforms.stdout, conforms.stdout
    broken = subprocess.run(_check(POOL, "--caching", "on"), cwd=tmp_path, capture_output=True, text=True,
                            timeout=300, env={**os.environ, "KVSPEC_EXAMPLE_BUG": "pool"})  # fmt: skip
    assert broken.returncode == 1, broken.stdout + broken.stderr
    usage = subprocess.run([*KVSPEC, "check", "--bogus"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert usage.returncode == 2 and "unrecognized arguments: --bogus" in usage.stderr
    assert subprocess.run([*KVSPEC, "--version"], capture_output=True, timeout=60).returncode == 0


def _running(marker: str) -> list[int]:
    """The pids of processes whose command line holds `marker`."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker.encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:  # it ended meanwhile
            continue
    return found


def _long_check(tmp_path: Path) -> tuple[subprocess.Popen[str], str]:
    """A check that runs for minutes, started; the marker its processes' command lines hold."""
    marker = str(tmp_path / "long-check-traces")
    proc = subprocess.Popen([*KVSPEC, "check", "--impl", "reference", "--max-examples", "100000",
                             "--trace-dir", marker], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip
    deadline = time.monotonic() + 60
    while len(_running(marker)) < 2 and time.monotonic() < deadline:  # the kvspec process and its command's
        time.sleep(0.1)
    assert len(_running(marker)) >= 2, "the command's process did not start"
    return proc, marker


def _gone(marker: str) -> bool:
    deadline = time.monotonic() + 30
    while _running(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not _running(marker)


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="finds the command's process in /proc")
def test_a_sigterm_to_kvspec_ends_the_command_and_kvspec_by_it(tmp_path: Path) -> None:
    proc, marker = _long_check(tmp_path)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGTERM
    assert _gone(marker), "the command's process outlived kvspec"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a killed parent takes its child along on Linux")
def test_a_killed_kvspec_takes_the_command_s_process_along(tmp_path: Path) -> None:
    proc, marker = _long_check(tmp_path)
    proc.kill()  # a runner's timeout: nothing is passed on
    proc.communicate(timeout=60)
    assert _gone(marker), "the command's process outlived kvspec"
