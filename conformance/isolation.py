"""Process isolation: a campaign or a replay runs in a forked child, so the implementation cannot take the harness down.

Design choice: the work runs in a child process (forked, so the factory
need not be importable by name) that writes each step to a file before the
implementation runs it, while the parent watches a heartbeat. An
implementation that segfaults, calls `os._exit`, or hangs inside C code
therefore ends only the child; the parent gets back how it died and the
steps it had started (`Death`), and the harness itself never hangs. The
rejected alternative, running in-process with a watchdog thread, cannot stop
a thread stuck in C and dies with a segfaulting implementation; it remains
the fallback where `fork` does not exist.
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvspec.conformance.results import CampaignReport, Verdict

__all__ = ["Death", "Progress", "Work", "run_isolated"]

# The work a child runs: (stream_fd, heartbeat) -> its report. stream_fd and
# heartbeat are None when it runs in this process.
Work = Callable[[int | None, Any], CampaignReport]

# Told, every few seconds while a child runs, how many examples it has started and steps it has checked.
Progress = Callable[[int, int], None]

PROGRESS_EVERY_S = 2.0

# How long past the step limit the parent waits before it kills the child: the
# child's own alarm usually reports first, with a cleaner trace.
_KILL_GRACE_S = 2.0


@dataclass
class Death:
    """How a child process ended without handing back a report."""

    hung: bool  # killed by the parent for not answering
    exitcode: int | None
    stream: list[str] = field(default_factory=list)  # the steps it had started, as written


def run_isolated(
    work: Work, step_timeout_s: float | None, isolate: bool, progress: Progress | None = None
) -> CampaignReport | Death:
    """Run `work` in a forked child when `isolate` and fork can be used; in this process otherwise.

    `progress` is called every `PROGRESS_EVERY_S` seconds while the child runs (not in this process).
    """
    # NOTE: CUDA cannot be started again in a child forked from a process that
    # started it. The harness never touches CUDA itself (gpu_impl picks and
    # starts its device inside the child); if the calling process did, the
    # campaign runs here instead, without the child's crash protection.
    if isolate and "fork" in multiprocessing.get_all_start_methods() and not _cuda_started_here():
        return _in_child(work, step_timeout_s, progress)
    return work(None, None)


def _in_child(work: Work, step_timeout_s: float | None, progress: Progress | None) -> CampaignReport | Death:
    """Run `work(stream_fd, heartbeat)` in a forked child; its report, or how it died.

    The child turns off the traceback dump on a fatal signal that test runners
    enable (faulthandler): the report names the step, and the replays that cut a
    crash trace down would each print one.
    """
    ctx = multiprocessing.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    heartbeat = ctx.RawArray("d", 3)  # call started, examples, steps (watch.StepWatch writes them)
    fd, stream_path = tempfile.mkstemp(prefix="kvspec-steps-", suffix=".jsonl")
    os.close(fd)
    proc = ctx.Process(target=_child_main, args=(work, send, heartbeat, stream_path), daemon=True)
    try:
        proc.start()
        send.close()
        report, hung = _wait(proc, recv, heartbeat, step_timeout_s, progress)
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join()
        if report is not None:
            return report
        stream = Path(stream_path).read_text(encoding="utf-8", errors="replace").splitlines()
        return Death(hung=hung, exitcode=proc.exitcode, stream=stream)
    finally:
        recv.close()
        Path(stream_path).unlink(missing_ok=True)


def _wait(
    proc: Any, recv: Any, heartbeat: Any, step_timeout_s: float | None, progress: Progress | None
) -> tuple[CampaignReport | None, bool]:
    """Wait for the child's report, its death, or a call that outlived the step limit (then kill it)."""
    told = time.monotonic()
    while True:
        if progress is not None and time.monotonic() - told >= PROGRESS_EVERY_S:
            progress(int(heartbeat[1]), int(heartbeat[2]))
            told = time.monotonic()
        if recv.poll(0.05):
            return _receive(recv), False
        if not proc.is_alive():
            return (_receive(recv) if recv.poll(0.2) else None), False
        started = heartbeat[0]
        if step_timeout_s is not None and started and time.monotonic() - started > step_timeout_s + _KILL_GRACE_S:
            proc.kill()
            return None, True


def _receive(recv: Any) -> CampaignReport | None:
    try:
        report: CampaignReport = recv.recv()
        return report
    except EOFError:
        return None


def _child_main(work: Work, conn: Any, heartbeat: Any, stream_path: str) -> None:
    faulthandler.disable()
    fd = os.open(stream_path, os.O_WRONLY | os.O_TRUNC)
    try:
        report = work(fd, heartbeat)
    except BaseException as e:  # the harness itself failed: report it, never hang the parent
        message = f"the harness failed: {type(e).__name__}: {e}\n{traceback.format_exc()}"
        report = CampaignReport(Verdict.COULD_NOT_RUN, message)
    conn.send(report)
    conn.close()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip the exit handlers this child inherited from its parent (a test runner's, say).
    os._exit(0)


def _cuda_started_here() -> bool:
    """Whether this process has started CUDA (through torch): a forked child could then not use it.

    Asks only torch's own flag, which starts nothing; a process that never
    imported torch has not started CUDA through it.
    """
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    is_initialized = getattr(cuda, "is_initialized", None)
    return bool(is_initialized()) if callable(is_initialized) else False
