"""A Ctrl-C stops a command; a KeyboardInterrupt an implementation raises itself is that implementation's crash.

Both arrive as KeyboardInterrupt. kvspec tells them apart by its SIGINT handler (`watch.telling_ctrl_c_apart`,
in force while a command runs), which notes that a Ctrl-C reached the process before it raises; a campaign's
child ignores SIGINT, so every KeyboardInterrupt there is raised by the code it runs.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kvspec import _entry
from kvspec.conformance.core.results import EXIT_INTERRUPTED
from kvspec.conformance.core.watch import telling_ctrl_c_apart
from kvspec.conformance.runner.run import run_check
from kvspec.conformance.targets.builtin import ReferencePoolAdapter

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


class _RaisesKeyboardInterrupt(ReferencePoolAdapter):
    """Raises KeyboardInterrupt itself from its fourth free on: no Ctrl-C is pressed."""

    frees = 0

    def free_blocks(self, *args):  # type: ignore[no-untyped-def]
        type(self).frees += 1
        if type(self).frees > 3:
            raise KeyboardInterrupt
        return super().free_blocks(*args)


class _PressesCtrlC(ReferencePoolAdapter):
    """Sends its own process a SIGINT from a free, as a Ctrl-C pressed while that call runs would."""

    def free_blocks(self, *args):  # type: ignore[no-untyped-def]
        os.kill(os.getpid(), signal.SIGINT)
        return super().free_blocks(*args)


@pytest.fixture(autouse=True)
def _ctrl_c_as_in_a_terminal():  # type: ignore[no-untyped-def]
    """Python's own SIGINT handler, as a command run in a terminal's foreground has: a test runner started
    in the background (nohup, `&`) inherits Ctrl-C ignored, and so would every command it starts."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


def _in_a_terminal() -> None:
    """For a command a test starts: Ctrl-C not ignored, whatever the test runner inherited."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _build(cls):  # type: ignore[no-untyped-def]
    def factory(config):  # type: ignore[no-untyped-def]
        return cls(config)

    return factory


def test_a_keyboard_interrupt_the_implementation_raises_is_its_crash(tmp_path: Path) -> None:
    with telling_ctrl_c_apart():
        result = run_check(_build(_RaisesKeyboardInterrupt), max_examples=20, isolate=False, trace_dir=tmp_path)
    assert result.verdict == "crashed", result.failure
    assert result.failure is not None
    assert "KeyboardInterrupt: raised by the implementation itself, not by a Ctrl-C" in result.failure.message


def test_a_ctrl_c_during_an_implementation_call_stops_the_run(tmp_path: Path) -> None:
    with telling_ctrl_c_apart(), pytest.raises(KeyboardInterrupt):
        run_check(_build(_PressesCtrlC), max_examples=20, isolate=False, trace_dir=tmp_path)


def test_without_kvspec_s_handler_a_keyboard_interrupt_is_taken_for_the_users(tmp_path: Path) -> None:
    # Under Python's own SIGINT handler (a library caller's, a test runner's) the two cannot be told
    # apart: the run stops rather than blame the implementation for what may be the user's key.
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with pytest.raises(KeyboardInterrupt):
        run_check(_build(_RaisesKeyboardInterrupt), max_examples=20, isolate=False, trace_dir=tmp_path)


def test_the_command_line_blames_an_implementation_for_its_own_keyboard_interrupt(tmp_path: Path) -> None:
    (tmp_path / "interrupting_pool.py").write_text(
        f"import sys\nsys.path.insert(0, {str(EXAMPLES)!r})\nfrom pool_example import ExamplePool\n"
        "class Pool(ExamplePool):\n"
        "    def free_blocks(self, ids):\n"
        "        raise KeyboardInterrupt\n"
        "def factory(config):\n"
        "    return Pool(config.num_gpu_blocks, config.enable_caching)\n"
        "factory.levels = ('pool',)\n"
    )
    r = subprocess.run(
        [sys.executable, "-m", "kvspec", "check", "--impl", "interrupting_pool.py:factory", "--caching", "on",
         "--max-examples", "20", "--cover-rounds", "0", "--trace-dir", str(tmp_path / "traces")],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 1, r.stdout + r.stderr
    assert "crashed" in r.stdout and "kvspec itself failed" not in r.stdout
    assert "KeyboardInterrupt: raised by the implementation itself, not by a Ctrl-C" in r.stdout


def _group_members(pgid: int) -> list[int]:
    """The processes of one process group (Linux's /proc)."""
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:  # it ended while read
                continue
            if int(fields[2]) == pgid:
                members.append(int(entry.name))
    return members


def _parent(pid: int) -> int:
    return int((Path(f"/proc/{pid}") / "stat").read_text().rsplit(")", 1)[1].split()[1])


def _campaign_children(pgid: int) -> list[int]:
    """The group's processes forked to run campaigns (the same command line), not a program a module runs
    while it loads (ctypes runs ldconfig), nor the process the leader runs the command in (its direct child:
    kvspec._entry)."""
    try:
        leader = Path(f"/proc/{pgid}/cmdline").read_bytes()
    except OSError:
        return []
    children = []
    for pid in _group_members(pgid):
        try:
            if pid != pgid and _parent(pid) != pgid and Path(f"/proc/{pid}/cmdline").read_bytes() == leader:
                children.append(pid)
        except OSError:
            continue
    return children


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process table from /proc (Linux)")
def test_ctrl_c_ends_a_check_in_one_line_with_no_verdict_and_no_report(tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    report.write_text("the last run's report\n")
    command = [sys.executable, "-m", "kvspec", "check", "--impl", "reference", "--max-examples", "100000",
               "--json", str(report), "--trace-dir", str(tmp_path / "traces")]  # fmt: skip
    # Its own process group, as a terminal's foreground job is: Ctrl-C sends SIGINT to every process in it.
    proc = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=_in_a_terminal)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not _campaign_children(proc.pid):  # a campaign's child is running: the handler is in force
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, out + err
    assert err == "kvspec check: interrupted (Ctrl-C): no verdict\n", err
    assert "conforms" not in out and "result:" not in out
    assert report.read_text() == "the last run's report\n"  # left as it was
    deadline = time.monotonic() + 10
    while _group_members(proc.pid) and time.monotonic() < deadline:  # the children were stopped
        time.sleep(0.05)
    assert _group_members(proc.pid) == []


def test_ctrl_c_while_kvspec_loads_is_the_same_one_line(tmp_path: Path) -> None:
    # Before the command line has loaded, no handler of kvspec's is in force: the entry point catches it.
    # Here the Ctrl-C comes as the command line's module is looked for.
    program = textwrap.dedent("""
        import os, signal, sys
        class PressesCtrlC:
            def find_spec(self, name, path=None, target=None):
                if name == "kvspec.conformance.tools.cli":
                    os.kill(os.getpid(), signal.SIGINT)
                return None
        sys.meta_path.insert(0, PressesCtrlC())
        from kvspec._entry import main
        raise SystemExit(main())
    """)
    r = subprocess.run([sys.executable, "-c", program], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                       preexec_fn=_in_a_terminal)  # fmt: skip
    assert (r.returncode, r.stderr) == (130, "kvspec: interrupted (Ctrl-C): no verdict\n"), r.stderr
    assert _entry.EXIT_INTERRUPTED == EXIT_INTERRUPTED


def test_a_command_started_with_ctrl_c_ignored_keeps_ignoring_it(tmp_path: Path) -> None:
    # In the background or under nohup a SIGINT is not meant for it: kvspec installs no handler of its own.
    program = textwrap.dedent("""
        import os, signal, sys
        from kvspec.conformance.core.watch import telling_ctrl_c_apart
        with telling_ctrl_c_apart():
            os.kill(os.getpid(), signal.SIGINT)
            print("still running")
    """)
    ignored = lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)  # noqa: E731
    r = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60, preexec_fn=ignored)
    assert (r.returncode, r.stdout) == (0, "still running\n"), r.stderr
