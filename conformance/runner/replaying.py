"""Replay: a recorded trace's steps fed to `LockStep`, checked as the machine checks them, inside the child process.

A trace records each operation with literal arguments, so a replay needs
neither Hypothesis nor this version of the machine: it builds the adapter
from the trace's header and runs the steps in order. Outcomes and snapshots
stored in the trace are for people and are recomputed here, never trusted.

What a replay sends is checked before anything is sent (`unsendable_step`):
every step is a call its campaign could have sent, a legal call on the spec
or a caller mistake the trace records as one (its `mistake`, or, in a trace
written before mistakes were named, the spec's error recorded beside it),
and no integer is wider than 64 bits. A trace edited by hand, or written by
something else, is refused in one line instead of blaming the implementation
for a crash on `num_blocks="abc"` or an id of 10**30.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

from kvspec.conformance.core.adapter import AdapterConfig
from kvspec.conformance.core.lockstep import (
    ConformanceFailure,
    Factory,
    LockStep,
    Observer,
    SpecFailure,
    StepTimeout,
    run_spec,
)
from kvspec.conformance.core.results import CampaignReport, Failure, FailureKind, Outcome, Verdict
from kvspec.conformance.core.trace import MalformedTrace, Trace, TraceStep, args_dict, read_trace
from kvspec.conformance.core.watch import StepWatch
from kvspec.conformance.runner.campaign import probe_factory
from kvspec.spec.state import Snapshot

__all__ = ["ignored_mistakes", "load_sendable", "replay_example", "spec_side", "unsendable_step"]

# The widest integer a step may carry: what a C or CUDA implementation's API can take at all.
MAX_INT = 2**63 - 1


def load_sendable(path: str | Path) -> Trace:
    """A trace file, read and checked before anything is sent: every step one its campaign could have sent.

    Raises:
        MalformedTrace: it cannot be read, or a step is not sendable (one line naming the step).
    """
    trace = read_trace(path)
    why = unsendable_step(trace)
    if why is not None:
        raise MalformedTrace(f"{path}: {why}")
    return trace


def unsendable_step(trace: Trace) -> str | None:
    """Why a step of `trace` is not one its campaign could have sent, in one line; None when every step is.

    A step is sendable when its integers fit in 64 bits and the spec accepts it
    where it stands, or rejects it as the caller mistake the step records.
    """
    for step in trace.steps:
        wide = _wide_int(step.args)
        if wide is not None:
            return f"step {step.index} ({step.op}): {wide} is wider than 64 bits, more than any implementation takes"
    for step, (outcome, _) in zip(trace.steps, spec_side(trace)):
        why = _unrecorded(step, outcome)
        if why is not None:
            call = ", ".join(f"{k}={v!r}" for k, v in args_dict(step.op, step.args).items())
            return f"step {step.index} {step.op}({call}) {why}"
    return None


def spec_side(trace: Trace) -> list[tuple[Outcome, Snapshot]]:
    """The spec's outcome and state after each step of `trace`, computed as a check computes them.

    A caller mistake the implementation ignored leaves the state its good part
    alone leaves (`run_spec`'s good parts): the adapter declared so, or the
    check would have failed at that very step. Nothing else recorded in the
    trace is read.
    """
    return run_spec(trace.config, [(s.op, s.args) for s in trace.steps], ignored_mistakes(trace))


def ignored_mistakes(trace: Trace) -> dict[int, tuple[Any, ...] | None]:
    """The caller mistakes of `trace` its implementation ignored: position in its steps -> the good part.

    Args:
        trace: a trace, its implementation's outcomes recorded where a step makes a caller mistake.

    Returns:
        What `run_spec` takes as `good_parts` (None where the mistaken call has no good part).
    """
    return {i: s.without for i, s in enumerate(trace.steps) if _is_ignored(s, trace.failure)}


def _is_ignored(step: TraceStep, failure: Failure | None) -> bool:
    """Whether the implementation ignored the step's caller mistake: it returned normally, on its own adapter.

    Only a mistake declared ignored (`IGNORES`) passes a check so; one that is not fails at that step with
    the declaration named (`reaction_problem`), and there the spec's state stays its own.
    """
    impl = step.impl
    if step.mistake is None or impl is None or impl.error is not None or impl.not_sent is not None:
        return False
    if impl.crashed or impl.hung or impl.replica:
        return False
    return failure is None or failure.step != step.index or "; the adapter declares it " not in failure.message


def _unrecorded(step: TraceStep, outcome: Outcome) -> str | None:
    """Why the spec's `outcome` of `step` is not what the step says it is, or None."""
    if outcome.crashed and not (step.spec is not None and step.spec.crashed):
        return f"is not a call of this operation: the spec cannot take it ({outcome.message})"
    if outcome.error is not None and step.mistake is None and (step.spec is None or step.spec.error != outcome.error):
        return (
            f"is a caller mistake ({outcome.error}: {outcome.message}) that the trace does not record as one "
            "(a step's mistake); only a recorded mistake is sent"
        )
    if outcome.error is None and not outcome.crashed and step.mistake is not None:
        return f"records the mistake {step.mistake!r}, but the spec accepts the call"
    return None


def _wide_int(value: Any) -> int | None:
    """The first integer in `value` (lists, tuples, a request's fields) wider than 64 bits, or None."""
    if isinstance(value, int):
        return value if abs(value) > MAX_INT else None
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = [getattr(value, f.name) for f in dataclasses.fields(value)]
    if isinstance(value, (list, tuple)):
        return next((w for v in value if (w := _wide_int(v)) is not None), None)
    return None


def _records_a_build_crash(trace: Trace) -> bool:
    """Whether the trace's recorded failure is the adapter's build: the replay then reproduces it as it was."""
    return trace.failure is not None and trace.failure.step == 0


class _BuildOnce:
    """A factory that gives the steps the adapter the probe built, so a replay builds the implementation once.

    The probe (`probe_factory`) builds an adapter to learn whether this one can run at all, before any step
    and before anything is written; the steps then run on that same adapter. The rejected alternative, a
    second build for the steps, paid an implementation's whole set-up twice (a device pool, a vLLM engine),
    held two of them at once, and ran the steps on an adapter other than the one the probe judged. Only the
    first build, for the trace's own configuration, is kept, and handed out once: a later build (a replica
    for a caller mistake) is a new adapter, as in a campaign.
    """

    def __init__(self, factory: Factory, config: AdapterConfig) -> None:
        self._factory = factory  # the implementation's factory
        self._config = config  # the trace's configuration: only an adapter built for it is kept
        self._kept: list[object] = []  # the probe's adapter, until the steps take it
        self._is_first = True  # no build asked for yet: the next one is the probe's

    def __getattr__(self, name: str) -> Any:
        # The factory's declarations (levels, profiles), read by the probe as a campaign reads them.
        if name.startswith("_"):  # this object's own fields, before they are set: never the factory's
            raise AttributeError(name)
        return getattr(self._factory, name)

    def __call__(self, config: AdapterConfig) -> object:
        if self._kept and config == self._config:
            return self._kept.pop()
        is_first, self._is_first = self._is_first, False
        adapter = self._factory(config)  # one that raises keeps nothing: the steps build it again and say so
        if is_first and config == self._config:
            self._kept.append(adapter)
        return adapter


def _build_refused(factory: Factory, trace: Trace, watch: StepWatch) -> CampaignReport | None:
    """What `kvspec check` says of a factory that cannot build this adapter (could not run, or n/a for what it
    does not provide), before any step; None when it builds. A build that does not finish in time raises
    StepTimeout: the implementation hung at building, as in a campaign.
    """
    watch.impl_started(building=True)
    try:
        probe = probe_factory(factory, trace.config, trace.config.groups)
    finally:
        watch.impl_finished()
    return CampaignReport(*probe.refused) if probe.refused is not None else None


def replay_example(
    trace: Trace,
    factory: Factory,
    impl: str | None,
    step_timeout_s: float | None,
    stream_fd: int | None,
    heartbeat: Any,
    build_timeout_s: float | None = None,
) -> CampaignReport:
    """Run `trace`'s steps on a fresh adapter; the verdict, and the example as it went this time.

    `build_timeout_s`: the most building the adapter may take (None: the step limit).
    """
    start = time.monotonic()
    observer = Observer()
    watch = StepWatch(step_timeout_s, stream_fd, heartbeat, impl, build_timeout_s)
    undo = watch.install_alarm()
    lock: LockStep | None = None
    failure: Failure | None = None
    try:
        try:
            if not _records_a_build_crash(trace):
                factory = _BuildOnce(factory, trace.config)
                refused = _build_refused(factory, trace, watch)
                if refused is not None:
                    return refused
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
