"""What an implementation's own code does to kvspec's process, through the command line.

An implementation's module runs its top level in the command's own process (it is loaded there, before any
campaign), and its calls run in a campaign's child. Each test is a module that changes what the process
shares with kvspec (the current folder, the output, threads, signal handlers, the recursion limit) or
answers with a value of megabytes: the verdict must still be given, true, and replay.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
KVSPEC = [sys.executable, "-m", "kvspec"]
PRELUDE = f"import os, sys\nsys.path.insert(0, {str(EXAMPLES)!r})\nfrom pool_example import ExamplePool, factory\n"
# A pool that raises on its first touch: a failure that leaves a trace.
FAILING = """
class Failing(ExamplePool):
    def touch(self, block_ids):
        raise RuntimeError("touch boom")
def factory(config):
    return Failing(config.num_gpu_blocks, config.enable_caching)
"""


def kvspec(*args: str, cwd: Path, timeout: int = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*KVSPEC, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)


def module(folder: Path, body: str, name: str = "hostile_pool") -> str:
    (folder / f"{name}.py").write_text(PRELUDE + textwrap.dedent(body))
    return f"{name}.py:factory"


def check(impl: str, cwd: Path, *more: str, timeout: int = 120) -> subprocess.CompletedProcess[str]:
    return kvspec("check", "--impl", impl, "--level", "pool", "--caching", "on", "--max-examples", "20",
                  "--cover-rounds", "0", *more, cwd=cwd, timeout=timeout)  # fmt: skip


def conforms(r: subprocess.CompletedProcess[str]) -> None:
    assert r.returncode == 0 and "result: 1 conforms (exit 0)" in r.stdout, r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr, r.stderr


def test_a_module_that_changes_folder_as_it_loads_moves_none_of_the_runs_names(tmp_path):
    # The name was loaded again after the import's chdir, relative to the new folder ("no such file"), and
    # a relative --trace-dir, --json or second --impl meant a path in the implementation's folder.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    moves = f"os.chdir({str(elsewhere)!r})\n"
    conforms(check(module(tmp_path, moves), tmp_path, "--json", "out.json"))
    assert (tmp_path / "out.json").is_file() and not (elsewhere / "out.json").exists()
    r = check(module(tmp_path, moves), tmp_path, "--impl", module(tmp_path, "", name="second_pool"))
    assert r.returncode == 0 and "result: 2 conforms (exit 0)" in r.stdout, r.stdout + r.stderr
    impl = module(tmp_path, moves + FAILING)
    r = check(impl, tmp_path, "--trace-dir", "traces")
    assert r.returncode == 1 and "touch boom" in r.stdout, r.stdout + r.stderr
    (trace,) = (tmp_path / "traces").glob("crashed-pool-*.trace.jsonl")
    assert not (elsewhere / "traces").exists()
    again = kvspec("replay", "traces/" + trace.name, "--impl", impl, "--trace-dir", "again", cwd=tmp_path)
    assert again.returncode == 1 and "verdict: crashed (same as recorded)" in again.stdout, again.stdout + again.stderr
    assert list((tmp_path / "again").glob("*.trace.jsonl")) and not (elsewhere / "again").exists()


@pytest.mark.parametrize(
    "body",
    [
        "sys.stdout.close()\nsys.stderr.close()\n",
        "import io\nsys.stdout, sys.stderr = io.StringIO(), io.StringIO()\n",
        "os.close(1)\nos.close(2)\n",
        "os.dup2(os.open(os.devnull, os.O_WRONLY), 1)\n",
    ],
    ids=["streams-closed", "streams-replaced", "descriptors-closed", "stdout-to-devnull"],
)
def test_a_module_that_takes_the_output_as_it_loads_still_gets_its_verdict_said(tmp_path, body):
    # Closed streams were a traceback and "no verdict"; replaced ones or stdout sent to /dev/null an exit 0
    # with nothing printed; closed descriptors "cannot write stdout". The command's output is its own.
    impl = module(tmp_path, body)
    conforms(check(impl, tmp_path))
    trace = ROOT / "docs" / "traces" / "inv_ref_cnt_nonnegative.trace.jsonl"
    r = kvspec("replay", str(trace), "--impl", impl, cwd=tmp_path)
    assert r.returncode == 0 and "verdict: conforms" in r.stdout, r.stdout + r.stderr


def test_a_thread_the_module_starts_and_never_ends_does_not_hold_the_command(tmp_path):
    # The verdict was printed, then the command waited for the thread for ever, and so did its caller.
    body = "import threading, time\nthreading.Thread(target=time.sleep, args=(10**6,)).start()\n"
    conforms(check(module(tmp_path, body), tmp_path, timeout=60))


def test_a_lowered_recursion_limit_is_not_kvspec_failing(tmp_path):
    # It was "kvspec itself failed (a bug in kvspec ...): RecursionError": the import lowered the limit
    # kvspec's own work runs under.
    conforms(check(module(tmp_path, "sys.setrecursionlimit(60)\n"), tmp_path))


def test_a_module_that_ignores_the_stopping_signals_as_it_loads_can_still_be_stopped(tmp_path):
    # The module ignored SIGTERM in the command's process: a kill passed on to the command did nothing. And a
    # killed command left its campaign's child running on, holding the caller's output open for ever.
    ready = tmp_path / "ready"
    body = f"""
        import signal
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        built = factory
        def factory(config):
            open({str(ready)!r}, "w").close()  # a campaign is running: the loading is over
            return built(config)
        """
    command = [*KVSPEC, "check", "--impl", module(tmp_path, body), "--level", "pool", "--max-examples", "100000"]
    proc = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGTERM)
        proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == -signal.SIGTERM


@pytest.mark.parametrize(
    "body, says",
    [
        ("def get_new_blocks(self, num_blocks):\n    return list(range(200_000))\n",
         "a list of 200,000 block ids: more than any pool kvspec checks holds (100,000)"),
        ("def get_cached_block(self, block_hash):\n    return 'x' * 10_000_000\n",
         "xxx...xxx"),
    ],
    ids=["ids", "string"],
)  # fmt: skip
def test_a_result_of_megabytes_is_said_and_recorded_short_and_replays(tmp_path, body, says):
    # Ten million ids returned were a story of 177 MB on stdout and a trace of as much; twenty million a trace
    # larger than a trace may be, so the failure did not replay.
    impl = module(tmp_path, "class Huge(ExamplePool):\n" + textwrap.indent(body, "    ") + _BUILD_HUGE)
    r = check(impl, tmp_path, "--trace-dir", "traces")
    assert r.returncode == 1 and "returned a malformed value" in r.stdout and says in r.stdout, r.stderr
    assert len(r.stdout) < 20_000, len(r.stdout)
    (trace,) = (tmp_path / "traces").glob("failure-pool-*.trace.jsonl")
    assert trace.stat().st_size < 20_000
    again = kvspec("replay", str(trace), "--impl", impl, cwd=tmp_path)
    assert again.returncode == 1 and "verdict: diverges (same as recorded)" in again.stdout, again.stderr


_BUILD_HUGE = "\ndef factory(config):\n    return Huge(config.num_gpu_blocks, config.enable_caching)\n"
