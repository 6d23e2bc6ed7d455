"""The `kvspec` command's entry point, and `python -m kvspec`'s.

kvspec's modules take a second or so to load; a Ctrl-C meanwhile ends the command as one during its work
does (one line, exit 130), not with the traceback of whatever module was loading.

Design choice: the command runs in a child process, and the `kvspec` process exits with the exit code the
command reported, never with the status its process happened to end with. A command's exit code is its
verdict (0: conforms), and the implementations it checks are loaded inside it: a module that ends the
process as it loads (`os._exit(0)`, `sys.exit` escaping a loader, a signal, a crash in C) would otherwise
hand a CI gate the status it chose, 0 among them. The child writes its exit code to a pipe as it returns;
a child that ends without writing one gave no verdict, and that is said in one line, exit 2. The rejected
alternative, loading each implementation first in a throw-away process, would import vLLM twice in every
run and still leave the campaign's own process unguarded.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
from collections.abc import Sequence
from types import FrameType
from typing import NoReturn

from kvspec._process import end_with_parent

# kvspec.conformance.core.results.EXIT_INTERRUPTED and EXIT_COULD_NOT_RUN, which cannot be imported before
# the modules load (tests/conformance/test_ctrl_c.py and tests/test_entry.py hold them equal).
EXIT_INTERRUPTED = 130
EXIT_COULD_NOT_RUN = 2

# Signals sent to the `kvspec` process that are meant for the command: passed on to it.
PASSED_ON = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


def main(argv: Sequence[str] | None = None) -> int:
    """Load the command line and run it on `argv` (None: the process's arguments) in this process; its exit
    code."""
    try:
        from kvspec.conformance.tools.cli import main as run_command
    except KeyboardInterrupt:
        print("kvspec: interrupted (Ctrl-C): no verdict", file=sys.stderr)
        return EXIT_INTERRUPTED
    return run_command(argv)


def console_main() -> int:
    """`main` on the process's arguments in a child process; the exit code it reported (see the module's
    design note), or 2 with one line where it ended without one. Where processes cannot be forked, `main`
    here."""
    if not hasattr(os, "fork"):
        return main()
    read_end, write_end = os.pipe()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        end_with_parent(parent, EXIT_COULD_NOT_RUN)  # a runner that kills kvspec takes the command along
        _run_and_report(write_end)
    os.close(write_end)
    passed_on = _pass_signals_on(pid)
    _, status = os.waitpid(pid, 0)  # a signal passed on meanwhile does not end the wait (PEP 475)
    os.set_blocking(read_end, False)
    try:
        said = os.read(read_end, 64)
    except BlockingIOError:  # nothing written: the child ended before it reported
        said = b""
    os.close(read_end)
    if said.strip().lstrip(b"-").isdigit():
        return int(said)
    return _no_verdict(status, passed_on)


def _run_and_report(write_end: int) -> NoReturn:
    """In the child: run the command, flush what it printed, write its exit code to `write_end`, and end."""
    # Not caught: a SystemExit that leaves `main` is raised by code it loaded (argparse's is caught there),
    # and ends this process without a report, as any other way such code ends it.
    code = main()
    _flush()
    os.write(write_end, str(code).encode())
    os.close(write_end)
    # The command is done, and its exit code said: the process ends here, its exit handlers run, without
    # Python's wait for every thread that is not a daemon. A thread that an implementation's module started
    # and never ends (a worker pool's) would otherwise hold the `kvspec` process, and whatever waits on it
    # (a CI gate), for ever after the verdict.
    atexit._run_exitfuncs()
    _flush()
    os._exit(code)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed or full stdout: the command said so already
            stream.flush()


def _pass_signals_on(pid: int) -> set[int]:
    """Pass the signals of `PASSED_ON` on to the child; the set fills with those passed on. A signal this
    process ignores (SIGINT under nohup or in the background) stays ignored."""
    passed_on: set[int] = set()

    def pass_on(signum: int, frame: FrameType | None) -> None:
        passed_on.add(signum)
        with contextlib.suppress(ProcessLookupError):  # it has just ended
            os.kill(pid, signum)

    for signum in PASSED_ON:
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, pass_on)
    return passed_on


def _no_verdict(status: int, passed_on: set[int]) -> int:
    """The child ended without reporting an exit code. Ended by a signal sent to `kvspec` and passed on: end
    this process by it too, as the command would have ended without a parent. Otherwise one line, exit 2."""
    if os.WIFSIGNALED(status) and os.WTERMSIG(status) in passed_on:
        signum = os.WTERMSIG(status)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
    if os.WIFSIGNALED(status):
        how = f"was killed by {signal.Signals(os.WTERMSIG(status)).name}"
    else:
        how = f"exited with status {os.waitstatus_to_exitcode(status)}"
    args = sys.argv[1:]
    command = f"kvspec {args[0]}" if args and not args[0].startswith("-") else "kvspec"
    print(
        f"{command}: no verdict: its process {how} before kvspec gave one (code it loaded, such as an "
        "implementation's module, ended the process)",
        file=sys.stderr,
    )
    return EXIT_COULD_NOT_RUN
