"""The mechanics around a campaign's implementation calls: the step time limit, the heartbeat, the step stream.

The harness must survive an implementation that hangs or kills its process.
`StepWatch` is what makes that possible from inside the campaign's process:
it arms a per-call alarm (SIGALRM, where this thread can use it) so that a
call hung in Python code stops with `StepTimeout` at once; it keeps a
heartbeat (when the running call started) that the parent process watches,
to kill a child hung in C code; and it writes every step to a stream before
the implementation runs it, so a process that dies still leaves the steps
that led there. It also knows which example is running and which one failed
last, which is what the campaign reports.

Statistics (what a campaign reached) are the `Observer`'s
(kvspec.conformance.core.lockstep), not this object's.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any

from kvspec.conformance.core.adapter import AdapterConfig
from kvspec.conformance.core.results import Outcome
from kvspec.conformance.core.trace import TraceStep, header_line, step_line

__all__ = [
    "IMPLEMENTATION_FAULTS",
    "StepTimeout",
    "StepWatch",
    "command_kept",
    "ctrl_c_held_back",
    "ctrl_c_pressed",
    "ignore_ctrl_c",
    "raise_if_ctrl_c",
    "said",
    "telling_ctrl_c_apart",
    "time_limit_met",
]

# What an implementation's code may raise that is its own to answer for: anything, sys.exit(), a GeneratorExit
# or a BaseException of its own included. kvspec's own are raised through the same calls: a Ctrl-C arrives as a
# KeyboardInterrupt, the step time limit as a StepTimeout; so every handler of these calls `raise_if_ctrl_c`
# first, which raises those again: the user's Ctrl-C stops the run, a hang is the hang's story, no crash's.
IMPLEMENTATION_FAULTS = (BaseException,)

_ctrl_c_pressed = False  # set by `_on_ctrl_c`: a SIGINT reached this process
_ctrl_c_ignored = False  # set by `ignore_ctrl_c`: no Ctrl-C can reach this process (a campaign's child)


def _on_ctrl_c(signum: int, frame: object) -> None:
    global _ctrl_c_pressed
    _ctrl_c_pressed = True
    raise KeyboardInterrupt


@contextlib.contextmanager
def telling_ctrl_c_apart() -> Iterator[None]:
    """Within the block a Ctrl-C (SIGINT) is remembered as it raises KeyboardInterrupt, so one that no Ctrl-C
    raised is told apart: `raise_if_ctrl_c` lets the first through and leaves the second to its handler.

    Only the main thread can set a signal handler; elsewhere the block runs as it is. A process started with
    Ctrl-C ignored (in the background, under nohup) keeps ignoring it.
    """
    global _ctrl_c_pressed
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        yield
        return
    _ctrl_c_pressed = False
    old = signal.signal(signal.SIGINT, _on_ctrl_c)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


def ctrl_c_pressed() -> bool:
    """Whether a Ctrl-C reached this process while `telling_ctrl_c_apart` was last in force."""
    return _ctrl_c_pressed


@contextlib.contextmanager
def ctrl_c_held_back() -> Iterator[None]:
    """Hold a Ctrl-C back while a child is forked: the child starts with it blocked (and none pending), so
    it cannot arrive there before `ignore_ctrl_c`; here it is delivered when the block ends."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def ignore_ctrl_c() -> None:
    """For a campaign's child process (forked under `ctrl_c_held_back`): a Ctrl-C is its parent's to act on
    (it stops the children); any KeyboardInterrupt in the child is then raised by the code it runs."""
    global _ctrl_c_ignored
    _ctrl_c_ignored = True  # remembered, not read back: the implementation may set a SIGINT handler of its own
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def raise_if_ctrl_c(e: BaseException) -> None:
    """Raise `e` again if it is kvspec's own, no implementation's fault: a KeyboardInterrupt that a Ctrl-C may
    have raised, or the step time limit's StepTimeout.

    Told apart where `telling_ctrl_c_apart` is in force or Ctrl-C is ignored; under any other SIGINT
    handler (Python's default, a test runner's) kvspec cannot tell, and takes it for the user's.
    """
    if isinstance(e, StepTimeout):
        raise e
    if not isinstance(e, KeyboardInterrupt) or _ctrl_c_ignored:
        return
    handler = signal.getsignal(signal.SIGINT)
    if handler is _on_ctrl_c:
        if _ctrl_c_pressed:
            raise e
    elif handler not in (signal.SIG_IGN, signal.SIG_DFL):  # SIG_DFL: a Ctrl-C would end the process, not raise
        raise e


# The signals that stop a command: an implementation's module that ignores them as it loads would leave a
# command no Ctrl-C or kill stops (kvspec's entry point passes them on to the command's process).
_STOPPING_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT") if hasattr(signal, name)
)


class _Unclosable:
    """A stream lent to an implementation's top level: everything passed on but `close`, so a module that
    closes sys.stdout as it loads does not close the command's output."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def close(self) -> None:
        return None

    def __enter__(self) -> _Unclosable:  # `with sys.stdout:` closes it when the block ends: not this one
        return self

    def __exit__(self, *exc_info: object) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


@contextlib.contextmanager
def command_kept() -> Iterator[None]:
    """For the block that runs an implementation module's top level in the command's own process (it is loaded
    there): what the command's own work needs of the process is kept through it. Its output (sys.stdout and
    sys.stderr, descriptors 1 and 2), the recursion limit it runs under, and the handlers of the signals that
    stop it (Ctrl-C, a kill).

    What the module changes for itself (the current folder, the environment, a recursion limit raised) is
    left as it set it: its calls may need it, and the run's names were resolved before (`RunConfig.folder`).
    """
    streams, limit = (sys.stdout, sys.stderr), sys.getrecursionlimit()
    kept_fds = {fd: (os.dup(fd), _identity(fd)) for fd in (1, 2) if _identity(fd) is not None}
    is_main = threading.current_thread() is threading.main_thread()
    handlers = {signum: signal.getsignal(signum) for signum in _STOPPING_SIGNALS} if is_main else {}
    sys.stdout, sys.stderr = _Unclosable(sys.stdout), _Unclosable(sys.stderr)
    try:
        yield
    finally:
        sys.stdout, sys.stderr = streams
        for fd, (copy, identity) in kept_fds.items():
            if _identity(fd) != identity:  # closed, or pointed elsewhere (os.dup2 onto it)
                os.dup2(copy, fd)
            os.close(copy)
        sys.setrecursionlimit(max(limit, sys.getrecursionlimit()))
        for signum, handler in handlers.items():
            if handler is not None:  # None: set outside Python; nothing to set back
                signal.signal(signum, handler)


def _identity(fd: int) -> tuple[int, int] | None:
    """What descriptor ``fd`` is open on (device and inode), or None where it is closed."""
    try:
        status = os.fstat(fd)
    except OSError:
        return None
    return status.st_dev, status.st_ino


# The most of an implementation's exception message kvspec copies into a story, a trace or a note: enough
# for any message written for a person; a message of megabytes would otherwise fill the terminal and every trace.
SAID_AT_MOST = 4000


def said(e: BaseException) -> str:
    """`str(e)`, or what its `__str__` raised instead: an implementation's exception may fail to say itself.

    A message longer than `SAID_AT_MOST` characters is cut there, saying how much was left out. Every message
    taken from an implementation's exception goes through here, so a replay cuts it where the trace did.

    >>> said(ValueError("x" * 4010)).endswith("x... [10 more characters]")
    True
    """
    try:
        text = str(e)
    except IMPLEMENTATION_FAULTS as failed:
        raise_if_ctrl_c(failed)
        return f"<its str() raised {type(failed).__name__}>"
    if len(text) <= SAID_AT_MOST:
        return text
    return f"{text[:SAID_AT_MOST]}... [{len(text) - SAID_AT_MOST:,} more characters]"


def time_limit_met(limit_s: float | None, building: bool) -> str:
    """A call that did not answer within `limit_s`, in words: the step limit, or building's own limit.

    >>> time_limit_met(10.0, building=False)
    'no answer within the step time limit of 10 s'
    >>> time_limit_met(300.0, building=True)[:64]
    'building the adapter (importing and constructing the implementat'
    """
    if building:
        within = f" within the build time limit of {limit_s:g} s (--build-timeout)" if limit_s else ""
        return f"building the adapter (importing and constructing the implementation) did not finish{within}"
    return f"no answer within the step time limit of {limit_s:g} s" if limit_s else "no answer"


class StepTimeout(BaseException):
    """One implementation call ran past the step time limit.

    A BaseException on purpose: Hypothesis lets it through at once instead of
    shrinking it, since every shrink attempt of a hang would cost a full time
    limit.
    """


class StepWatch:
    """Times each implementation call, beats a heartbeat, streams the steps, and remembers the failing example."""

    def __init__(
        self,
        step_timeout_s: float | None = None,
        stream_fd: int | None = None,
        heartbeat: Any = None,
        impl_name: str | None = None,
        build_timeout_s: float | None = None,
    ) -> None:
        self.step_timeout_s = step_timeout_s  # per implementation call; None: no limit
        # Per adapter built (importing and constructing the implementation): its own limit, so that a slow
        # import is not taken for a hung call. None: the step limit.
        self.build_timeout_s = build_timeout_s if build_timeout_s is not None else step_timeout_s
        self.building = False  # the running implementation call builds the adapter
        self.stream_fd = stream_fd  # where each step is written before it runs (a crash leaves it)
        # Shared doubles the parent reads: [0] when the running call started (0 when none), [1] examples
        # started, [2] steps checked (the parent's progress line), [3] the running call's time limit
        # (-1: none), which the parent enforces on a call hung in C.
        self.heartbeat = heartbeat
        self.impl_name = impl_name  # written into the stream's trace header
        self.current: Any = None  # the LockStep of the example running now
        self.failed: Any = None  # the LockStep of the latest example that failed (the shrunk one, last)
        self._alarm_ready = False
        self._streamed: tuple[int, TraceStep] | None = None  # the last step written: where it starts, and it

    def start_example(self, lock: Any, config: AdapterConfig) -> None:
        """A new example begins: it is the current one, and its stream starts afresh."""
        self.current = lock
        if self.stream_fd is not None:
            os.ftruncate(self.stream_fd, 0)
            os.lseek(self.stream_fd, 0, os.SEEK_SET)
            os.write(self.stream_fd, (header_line(config, self.impl_name) + "\n").encode())

    def stream_step(
        self, index: int, op: str, args: Sequence[Any], mistake: str | None = None, without: Sequence[Any] | None = None
    ) -> None:
        """Write the step about to run, so a crash or hang of the process still shows it.

        A caller mistake is written with its name and good part, as a trace records them: a replay of the
        steps must send it as the mistake it is, not as a valid call.
        """
        if self.stream_fd is not None:
            good = None if without is None else tuple(without)
            step = TraceStep(index, op, tuple(args), mistake=mistake, without=good)
            self._streamed = (os.lseek(self.stream_fd, 0, os.SEEK_CUR), step)
            os.write(self.stream_fd, (step_line(step) + "\n").encode())

    def stream_answer(self, impl: Outcome) -> None:
        """Write the implementation's outcome into the step just written, in place of its line.

        Called for a caller mistake: whether the implementation ignored it decides the spec's state after it
        (its good part's), which the stream of a process that died must still tell. A valid call's outcome
        is the spec's up to the last step, so it is not written again.
        """
        if self.stream_fd is not None and self._streamed is not None:
            at, step = self._streamed
            os.ftruncate(self.stream_fd, at)
            os.lseek(self.stream_fd, at, os.SEEK_SET)
            os.write(self.stream_fd, (step_line(replace(step, impl=impl)) + "\n").encode())

    def install_alarm(self) -> Callable[[], None]:
        """Arm the per-step time limit with SIGALRM, if this thread can; returns the undo."""
        if (self.step_timeout_s is None and self.build_timeout_s is None) or not hasattr(signal, "setitimer"):
            return lambda: None
        if threading.current_thread() is not threading.main_thread():
            return lambda: None

        def on_alarm(signum: int, frame: object) -> None:
            raise StepTimeout()

        old = signal.signal(signal.SIGALRM, on_alarm)
        self._alarm_ready = True

        def undo() -> None:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
            self._alarm_ready = False

        return undo

    def impl_started(self, building: bool = False) -> None:
        """An implementation call begins (`building`: the call builds an adapter): start its clock."""
        self.building = building
        limit = self.build_timeout_s if building else self.step_timeout_s
        if self._alarm_ready and limit is not None:
            signal.setitimer(signal.ITIMER_REAL, limit)
        if self.heartbeat is not None:
            self.heartbeat[3] = limit if limit is not None else -1.0
            self.heartbeat[0] = time.monotonic()

    def limit_met(self) -> str:
        """What a call that did not answer in time ran past, in words (the step limit, or the build limit)."""
        if self.building:
            return time_limit_met(self.build_timeout_s, building=True)
        return time_limit_met(self.step_timeout_s, building=False)

    def impl_finished(self) -> None:
        """The implementation call returned (or raised): stop its clock."""
        if self._alarm_ready:
            signal.setitimer(signal.ITIMER_REAL, 0)
        if self.heartbeat is not None:
            self.heartbeat[0] = 0.0

    def progress(self, examples: int, steps: int) -> None:
        """How far the campaign has got, for the parent's progress line."""
        if self.heartbeat is not None:
            self.heartbeat[1] = examples
            self.heartbeat[2] = steps
