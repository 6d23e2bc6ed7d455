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

import contextlib
import faulthandler
import multiprocessing
import multiprocessing.connection
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvspec._process import end_with_parent
from kvspec.conformance.core.results import CampaignReport, Verdict
from kvspec.conformance.core.watch import ctrl_c_held_back, ignore_ctrl_c, said

__all__ = ["Death", "Progress", "Work", "kvspec_failed", "run_isolated", "run_isolated_jobs", "system_refused"]

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
    outcome = run_isolated_jobs([work], step_timeout_s, isolate, progress)[0]
    assert outcome is not None, "the first job is never stopped"
    return outcome


def run_isolated_jobs(
    works: Sequence[Work],
    step_timeout_s: float | None,
    isolate: bool,
    progress: Progress | None = None,
    stops_later_jobs: Callable[[CampaignReport | Death], bool] = lambda outcome: False,
) -> list[CampaignReport | Death | None]:
    """Run every work at once, each in its own forked child (in turn, in this process, where a child cannot be
    used); what each handed back, in order.

    When a job's outcome `stops_later_jobs`, the jobs after it are killed
    (their entry is None) and the jobs before it run on, so the first job in
    order to end that way is the same however the jobs' timing falls.
    `progress` is told the jobs' examples and steps, added up.
    """
    # NOTE: CUDA cannot be started again in a child forked from a process that
    # started it. The harness never touches CUDA itself (gpu_impl picks and
    # starts its device inside the child); if the calling process did, the
    # campaign runs here instead, without the child's crash protection.
    if isolate and "fork" in multiprocessing.get_all_start_methods() and not _cuda_started_here():
        return _in_children(works, step_timeout_s, progress, stops_later_jobs)
    outcomes: list[CampaignReport | Death | None] = []
    for work in works:
        outcome = work(None, None)
        outcomes.append(outcome)
        if stops_later_jobs(outcome):
            break
    return outcomes + [None] * (len(works) - len(outcomes))


class _Child:
    """One forked child running a work: its process, the pipe its report comes back on, its heartbeat and
    the file its steps are streamed to.

    The child turns off the traceback dump on a fatal signal that test runners
    enable (faulthandler): the report names the step, and the replays that cut a
    crash trace down would each print one.
    """

    def __init__(self, work: Work) -> None:
        ctx = multiprocessing.get_context("fork")
        self.recv, send = ctx.Pipe(duplex=False)
        # call started, examples, steps, the call's time limit (watch.StepWatch writes them)
        self.heartbeat = ctx.RawArray("d", 4)
        fd, self.stream_path = tempfile.mkstemp(prefix="kvspec-steps-", suffix=".jsonl")
        os.close(fd)
        args = (work, send, self.heartbeat, self.stream_path, os.getpid())
        self.proc = ctx.Process(target=_child_main, args=args, daemon=True)
        with ctrl_c_held_back():  # a Ctrl-C is the parent's: none may reach the child before it ignores them
            self.proc.start()
        send.close()

    def outcome(self, step_timeout_s: float | None) -> CampaignReport | Death | None:
        """Its report, or how it died (killed here for a call that outlived the step limit); None while it runs."""
        if self.recv.poll():
            report = _receive(self.recv)
            return report if report is not None else self._death(hung=False)
        if not self.proc.is_alive():
            report = _receive(self.recv) if self.recv.poll(0.2) else None
            return report if report is not None else self._death(hung=False)
        started, limit = self.heartbeat[0], self.heartbeat[3]
        # The running call's own limit (a build has a longer one than a step); a work that never wrote one: the step's.
        limit_s = (limit if limit > 0 else None) if limit else step_timeout_s
        if limit_s is not None and started and time.monotonic() - started > limit_s + _KILL_GRACE_S:
            self.proc.kill()
            return self._death(hung=True)
        return None

    def _death(self, hung: bool) -> Death:
        self.proc.join(10)
        stream = Path(self.stream_path).read_text(encoding="utf-8", errors="replace").splitlines()
        return Death(hung=hung, exitcode=self.proc.exitcode, stream=stream)

    def close(self) -> None:
        """Wait for it to end (kill it if it does not), and remove its pipe and step file."""
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self.recv.close()
        Path(self.stream_path).unlink(missing_ok=True)

    def stop(self) -> None:
        """Kill it: its outcome is no longer wanted."""
        if self.proc.is_alive():
            self.proc.kill()


def _in_children(
    works: Sequence[Work],
    step_timeout_s: float | None,
    progress: Progress | None,
    stops_later_jobs: Callable[[CampaignReport | Death], bool],
) -> list[CampaignReport | Death | None]:
    """Run each work in a forked child, all at once; each one's report, how it died, or None if stopped."""
    children = [_Child(work) for work in works]
    outcomes: list[CampaignReport | Death | None] = [None] * len(children)
    running = set(range(len(children)))
    told = time.monotonic()
    try:
        while running:
            if progress is not None and time.monotonic() - told >= PROGRESS_EVERY_S:
                progress(sum(int(c.heartbeat[1]) for c in children), sum(int(c.heartbeat[2]) for c in children))
                told = time.monotonic()
            multiprocessing.connection.wait([children[i].recv for i in running], timeout=0.05)
            for i in sorted(running):
                if i not in running:
                    continue  # stopped by an earlier job in this pass
                outcome = children[i].outcome(step_timeout_s)
                if outcome is None:
                    continue
                outcomes[i] = outcome
                running.discard(i)
                if stops_later_jobs(outcome):
                    for later in [j for j in running if j > i]:
                        children[later].stop()
                        running.discard(later)
    finally:
        for child in children:
            child.close()
    return outcomes


def _receive(recv: Any) -> CampaignReport | None:
    try:
        report: CampaignReport = recv.recv()
        return report
    except EOFError:
        return None


def _child_main(work: Work, conn: Any, heartbeat: Any, stream_path: str, parent: int) -> None:
    ignore_ctrl_c()  # the parent's to act on: it stops every child
    end_with_parent(parent, 1)  # a killed command leaves no campaign running on, with no budget
    faulthandler.disable()
    fd = os.open(stream_path, os.O_WRONLY | os.O_TRUNC)
    try:
        report = work(fd, heartbeat)
    except OSError as e:  # the system refused kvspec's own work (a full disk): no fault of kvspec or the implementation
        report = CampaignReport(Verdict.COULD_NOT_RUN, system_refused(e))
    except BaseException as e:  # kvspec itself failed (its faults only: the implementation's are caught per call)
        report = CampaignReport(Verdict.COULD_NOT_RUN, kvspec_failed(e))
    conn.send(report)
    conn.close()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip the exit handlers this child inherited from its parent (a test runner's, say).
    os._exit(0)


def kvspec_failed(e: BaseException) -> str:
    """One line for a fault of kvspec itself, naming the file its full traceback was saved to.

    The traceback is for kvspec's maintainers, not the user's screen: it goes to a file in the
    temporary directory (kept: it is what a bug report needs), and the line says where.
    """
    first = (said(e).splitlines() or [""])[0]
    what = f"{type(e).__name__}: {first}"
    return f"kvspec itself failed (a bug in kvspec, not in the implementation): {what}{_full_log(e)}"


def _full_log(e: BaseException) -> str:
    """`e`'s traceback saved to a file in the temporary directory, as "; full log: PATH" (empty where the
    file cannot be written: a full disk is what some of these failures are)."""
    try:
        fd, path = tempfile.mkstemp(prefix="kvspec-internal-error-", suffix=".log")
    except OSError:
        return ""
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as log:
            log.write("".join(traceback.format_exception(type(e), e, e.__traceback__)))
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(path)
        return ""
    return f"; full log: {path}"


def system_refused(e: OSError) -> str:
    """One line for an operating system's refusal that reached no handler (a full disk, a file size limit,
    too many open files): the environment's, not the implementation's; its traceback saved as for a fault."""
    where = f": {e.filename}" if e.filename else ""
    return f"the system refused an operation ({e.strerror or e}{where}){_full_log(e)}"


def _cuda_started_here() -> bool:
    """Whether this process has started CUDA (through torch): a forked child could then not use it.

    Asks only torch's own flag, which starts nothing; a process that never
    imported torch has not started CUDA through it.
    """
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    is_initialized = getattr(cuda, "is_initialized", None)
    return bool(is_initialized()) if callable(is_initialized) else False
