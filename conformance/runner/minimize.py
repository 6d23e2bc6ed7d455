"""Minimisation of what Hypothesis cannot shrink: a trace left by a child that died or hung, cut down by replaying.

Hypothesis shrinks a failure that raises. A child process that died (a
segfault, `os._exit`) leaves only the steps it had streamed, and a hang must
not be retried by Hypothesis at a full time limit per attempt. Here the
stream becomes a trace (each step checked on the spec: up to its last step
the implementation matched it), and the trace is cut down by delta
debugging: drop chunks of steps while a replay still crashes or hangs the
same way, within a time budget.

A shorter trace is one the campaign could have sent, or it is not tried:
dropping a step can make a later call a caller mistake (a free of a block
that was never taken is a double free in the spec's eyes), which the
campaign sends only to an implementation declared to handle it. So a call
that was legal on the spec when the campaign sent it stays legal in every
shorter trace tried. The rejected alternative, keeping any candidate that
still crashes, blamed an implementation that trusts its caller for a call it
was never meant to get; the cost is a longer trace where a shorter one would
have turned a legal call into a mistake the implementation does handle.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Sequence
from dataclasses import replace

from kvspec.conformance.core.adapter import AdapterConfig
from kvspec.conformance.core.lockstep import Factory, run_spec
from kvspec.conformance.core.results import CampaignReport, Failure, FailureKind, Outcome
from kvspec.conformance.core.trace import MalformedTrace, Trace, TraceStep, parse_trace
from kvspec.conformance.core.watch import time_limit_met
from kvspec.conformance.runner.isolation import Death, run_isolated
from kvspec.conformance.runner.replaying import ignored_mistakes, replay_example, spec_side

__all__ = ["shrink_by_replay", "trace_from_death"]


def trace_from_death(
    death: Death, impl: str | None, step_timeout_s: float | None, config: AdapterConfig | None = None,
    build_timeout_s: float | None = None,
) -> Trace | None:  # fmt: skip
    """The steps a dead child had started, checked on the spec, with the last one marked crashed or hung.

    A child that died before it streamed an example died building the adapter (the only implementation
    call before one): given the `config` it was built with, that is a trace of no steps failing at step 0.
    """
    if not death.stream:
        if config is None:
            return None
        partial = Trace(config=config, steps=(), impl=impl)
    else:
        try:
            partial = parse_trace(death.stream, "<steps of the dead process>")
        except MalformedTrace:
            return None
    building = not partial.steps
    if death.hung:
        what = time_limit_met(build_timeout_s if building else step_timeout_s, building) + "; the process was killed"
        kind = FailureKind.HUNG
    else:
        code = death.exitcode
        sig = f"signal {-code} ({signal.Signals(-code).name})" if code is not None and code < 0 else f"exit code {code}"
        what = f"the process died ({sig}) " + ("while building the adapter" if building else "during this step")
        kind = FailureKind.CRASHED
    outcome = Outcome(hung=True, message=what) if kind is FailureKind.HUNG else Outcome(crashed=True, message=what)
    steps = _with_spec_side(partial)
    op = steps[-1].op if steps else "init"
    if steps:
        steps[-1] = replace(steps[-1], impl=outcome)
    failure = Failure(kind, len(steps), op, what)
    return Trace(config=partial.config, steps=tuple(steps), impl=impl, verdict=kind.verdict, failure=failure)


def _with_spec_side(trace: Trace) -> list[TraceStep]:
    """Each step with the spec's outcome and state (the implementation matched them up to its last step).

    They are computed as a replay computes them (`spec_side`): after a caller mistake the stream says the
    implementation ignored, the state is its good part's. What the stream recorded of the implementation
    (its outcome of a mistake) is kept; a valid call's is the spec's, so none is written.
    """
    return [replace(s, spec=o, spec_snapshot=snap) for s, (o, snap) in zip(trace.steps, spec_side(trace))]


def _replay(trace: Trace, factory: Factory, step_timeout_s: float | None) -> CampaignReport | Death:
    return run_isolated(
        lambda fd, hb: replay_example(trace, factory, trace.impl, step_timeout_s, fd, hb), step_timeout_s, True
    )


def _minimize(
    trace: Trace, factory: Factory, kind: FailureKind, step_timeout_s: float | None, budget_s: float
) -> tuple[Trace, bool]:
    """Cut steps from a crash or hang trace while it still crashes or hangs (delta debugging by replay).

    Returns the shortest trace found and whether the search finished within `budget_s`.
    """
    deadline = time.monotonic() + budget_s
    steps = list(trace.steps)
    was_legal = _legal_steps(trace.config, steps)

    def still_fails(candidate: list[TraceStep]) -> bool:
        if not _still_legal(trace, candidate, was_legal):
            return False
        outcome = _replay(
            Trace(config=trace.config, steps=tuple(_renumber(candidate)), impl=trace.impl), factory, step_timeout_s
        )
        if isinstance(outcome, Death):
            return (kind is FailureKind.HUNG) == outcome.hung
        return outcome.verdict is kind.verdict

    chunk = max(len(steps) // 2, 1)
    while chunk >= 1 and len(steps) > 1:
        i, changed = 0, False
        while i < len(steps) - 1:
            if time.monotonic() > deadline:
                return Trace(config=trace.config, steps=tuple(_renumber(steps)), impl=trace.impl), False
            # The failing step is the last one; it always stays.
            candidate = steps[:i] + steps[i + chunk :]
            if candidate and candidate[-1] is steps[-1] and still_fails(candidate):
                steps, changed = candidate, True
            else:
                i += chunk
        if not changed:
            chunk //= 2
    return Trace(config=trace.config, steps=tuple(_renumber(steps)), impl=trace.impl), True


def _legal_steps(config: AdapterConfig, steps: Sequence[TraceStep]) -> set[int]:
    """The steps (by identity) that are legal calls on the spec: no caller mistake, in their place in ``steps``.

    The spec runs them as a replay checks them (`spec_side`): a mistake the implementation ignored leaves its
    good part's state, so a call that was legal only after it stays judged legal.
    """
    outcomes = spec_side(Trace(config=config, steps=tuple(steps)))
    return {id(step) for step, (outcome, _) in zip(steps, outcomes) if outcome.error is None and not outcome.crashed}


def _still_legal(trace: Trace, candidate: Sequence[TraceStep], was_legal: set[int]) -> bool:
    """Whether every step of ``candidate`` that was legal in ``trace`` is still legal in its new place, and
    every caller mistake still one the campaign could send (see `_mistakes_still_sendable`)."""
    legal = _legal_steps(trace.config, candidate)
    return was_legal & {id(s) for s in candidate} <= legal and _mistakes_still_sendable(trace.config, candidate, legal)


def _mistakes_still_sendable(config: AdapterConfig, steps: Sequence[TraceStep], legal: set[int]) -> bool:
    """Whether each caller mistake of ``steps`` is still rejected by the spec and, where the implementation
    ignored it, its good part still accepted: a replay sends nothing else (it stops on either, as kvspec's
    own fault, not the implementation's)."""
    if any(s.mistake is not None and id(s) in legal for s in steps):
        return False
    ignored = ignored_mistakes(Trace(config=config, steps=tuple(steps)))
    applied = [(s.op, ignored.get(i) or s.args) for i, s in enumerate(steps)]
    outcomes = run_spec(config, applied, {i: good for i, good in ignored.items() if good is None})
    return all(outcomes[i][0].error is None for i, good in ignored.items() if good is not None)


def _renumber(steps: Sequence[TraceStep]) -> list[TraceStep]:
    return [TraceStep(i + 1, s.op, s.args, mistake=s.mistake, without=s.without) for i, s in enumerate(steps)]


def shrink_by_replay(
    trace: Trace, factory: Factory, impl: str | None, step_timeout_s: float | None, budget_s: float
) -> tuple[Trace, bool]:
    """The shortest trace that still crashes or hangs the same way, replayed for its outcomes.

    `trace` carries its failure. Returns the trace (with its failure) and
    whether the search finished within the budget.
    """
    assert trace.failure is not None, "only a failing trace is shrunk"
    kind = trace.failure.kind
    if budget_s <= 0:
        return trace, len(trace.steps) <= 1
    shorter, finished = _minimize(trace, factory, kind, step_timeout_s, budget_s)
    if len(shorter.steps) == len(trace.steps):
        return trace, finished
    again = _replay(shorter, factory, step_timeout_s)
    if isinstance(again, Death):
        rebuilt = trace_from_death(again, impl, step_timeout_s)
        if rebuilt is not None:
            return rebuilt, finished
    elif again.verdict is kind.verdict and again.failure is not None and again.trace is not None:
        return again.trace, finished
    return trace, False  # the shorter trace did not fail again: keep the one that did
