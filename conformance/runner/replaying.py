"""Replay: a recorded trace's steps fed to `LockStep`, checked as the machine checks them, inside the child process.

A trace records each operation with literal arguments, so a replay needs
neither Hypothesis nor this version of the machine: it builds the adapter
from the trace's header and runs the steps in order. Outcomes and snapshots
stored in the trace are for people and are recomputed here, never trusted.
"""

from __future__ import annotations

import time
from typing import Any

from kvspec.conformance.core.lockstep import ConformanceFailure, Factory, LockStep, Observer, SpecFailure, StepTimeout
from kvspec.conformance.core.results import CampaignReport, Failure, FailureKind, Verdict
from kvspec.conformance.core.trace import Trace
from kvspec.conformance.core.watch import StepWatch

__all__ = ["replay_example"]


def replay_example(
    trace: Trace,
    factory: Factory,
    impl: str | None,
    step_timeout_s: float | None,
    stream_fd: int | None,
    heartbeat: Any,
) -> CampaignReport:
    """Run `trace`'s steps on a fresh adapter; the verdict, and the example as it went this time."""
    start = time.monotonic()
    observer = Observer()
    watch = StepWatch(step_timeout_s, stream_fd, heartbeat, impl)
    undo = watch.install_alarm()
    lock: LockStep | None = None
    failure: Failure | None = None
    try:
        try:
            lock = LockStep(factory, trace.config, observer, watch)
            lock.check()
            for step in trace.steps:
                lock.call(step.op, *step.args, mistake=step.mistake, without=step.without)
                lock.check()
        except (ConformanceFailure, SpecFailure) as e:
            failure = e.failure
        except StepTimeout:
            failure = (
                lock.hung()
                if lock is not None
                else ConformanceFailure(Failure(FailureKind.HUNG, 0, "init", "no answer"))
            ).failure
    finally:
        undo()
    replayed = lock.trace(impl) if lock is not None else None
    if replayed is not None and replayed.failure is not None:
        failure = replayed.failure
    return CampaignReport(
        verdict=failure.kind.verdict if failure is not None else Verdict.CONFORMS,
        examples=1,
        steps=observer.steps,
        coverage=dict(observer.coverage),
        state_hashes=frozenset(observer.states),
        invariants_checked=observer.invariants_checked,
        seconds=time.monotonic() - start,
        failure=failure,
        trace=replayed,
    )
