"""The harness's public entry points: a campaign against one implementation, a replay, and the test-suite hook.

`run_check` runs the state machine of one level against one implementation
and returns a `CheckResult`: the verdict, how much was run, what the run
reached, and for a failure the shrunk trace (saved as a file) and its story.
`replay` re-runs a saved trace; `make_conformance_test` wraps `run_check` as
a unittest class. The work itself runs in parts, each in its module:

- kvspec.conformance.runner.registry: from an implementation's name to its factory;
- kvspec.conformance.runner.isolation: the forked child that survives any crash or hang;
- kvspec.conformance.runner.campaign: the Hypothesis runs of one configuration, in chunks;
- kvspec.conformance.runner.replaying: a trace's steps fed to the lock-step core;
- kvspec.conformance.runner.minimize: cutting down what a dead or hung child left;
- this module: checking arguments, and turning a campaign's report into a result.

Exit codes (the CLI's, `Verdict.exit_code`): 0 conforms; 1 the implementation
is wrong (diverged, crashed or hung, with its trace); 2 no verdict (it could
not be built or loaded, the arguments were wrong, or the run was inconclusive).
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
import unittest
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hypothesis import settings

from kvspec.conformance.core.coverage import expected_branches, reachable_branches
from kvspec.conformance.core.report import render_story
from kvspec.conformance.core.results import CampaignReport, CheckResult, Failure, Verdict, inconclusive_why
from kvspec.conformance.core.trace import Trace, dumps_trace, read_trace
from kvspec.conformance.runner.campaign import CampaignPlan, layout_name, plan_problem, run_campaign
from kvspec.conformance.runner.isolation import Death, Progress, run_isolated, run_isolated_jobs
from kvspec.conformance.runner.jobs import decides, job_plans, merged
from kvspec.conformance.runner.minimize import shrink_by_replay, trace_from_death
from kvspec.conformance.runner.registry import Factory, FactoryError, factory_name, load_factory
from kvspec.conformance.runner.replaying import replay_example

__all__ = [
    "DEFAULT_TRACE_DIR",
    "CheckResult",
    "Failure",
    "FactoryError",
    "Verdict",
    "load_factory",
    "make_conformance_test",
    "replay",
    "run_check",
]


# Where failure traces go unless the caller says: a folder in the current one, created only
# when a trace is written (never the temporary directory, where no one looks for them).
DEFAULT_TRACE_DIR = Path("kvspec-traces")


@dataclass(frozen=True)
class _Where:
    """The configuration a result is about, and how its failure is to be reported."""

    level: str
    enable_caching: bool
    profile: str
    impl: str | None
    seed: int = 0
    device: str | None = None
    trace_dir: str | Path | None = None
    step_timeout_s: float | None = None
    minimize_s: float = 0.0
    max_examples: int | None = None  # what a campaign was asked for; None for a replay
    groups: str = "full"  # the KV cache groups at the manager level, or "drawn"
    events: bool = False  # the KV cache events and hit statistics were checked too
    jobs: int = 1  # processes the campaign was shared among


# --- results ------------------------------------------------------------------------------


def _save(text: str, trace_dir: str | Path | None, stem: str) -> str:
    digest = hashlib.sha256(text.encode()).hexdigest()[:6]
    directory = Path(trace_dir) if trace_dir is not None else DEFAULT_TRACE_DIR
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{stem}-{digest}.trace.jsonl"
    path.write_text(text, encoding="utf-8")
    return str(path)


def _reported(trace: Trace, where: _Where, is_shrunk: bool) -> Failure:
    """The trace's failure with its trace saved and its story told."""
    assert trace.failure is not None and trace.verdict is not None, "only a failing trace is reported"
    verdict = trace.verdict
    stem = f"{verdict}-{where.level}" if verdict in (Verdict.CRASHED, Verdict.HUNG) else f"failure-{where.level}"
    path = _save(dumps_trace(trace), where.trace_dir, stem)
    story = render_story(trace, path, where.impl)
    if not is_shrunk:
        story += "\n(not shrunk: the process died or hung, and no shorter trace reproduced it in time)"
    return dataclasses.replace(
        trace.failure, trace_path=path, num_steps=len(trace.steps), story=story, is_shrunk=is_shrunk
    )


def _check_result(report: CampaignReport, where: _Where, failure: Failure | None, seconds: float) -> CheckResult:
    branches = expected_branches(where.level, where.enable_caching, where.profile, where.groups, where.events)
    coverage = {b: 0 for b in branches}
    coverage.update(report.coverage)
    expected = reachable_branches(where.level, branches, coverage, report.not_exercised, report.absent_ops)
    verdict, message = report.verdict, report.message
    # No verdict without work: a run that checked (almost) nothing says so instead of "conforms".
    why = inconclusive_why(report.examples, report.steps, where.max_examples) if verdict is Verdict.CONFORMS else None
    if why is not None:
        verdict, message = Verdict.INCONCLUSIVE, why + (f" ({message})" if message else "")
    return CheckResult(
        verdict=verdict,
        level=where.level,
        enable_caching=where.enable_caching,
        profile=where.profile,
        examples_run=report.examples,
        steps_run=report.steps,
        seconds=seconds,
        failure=failure,
        coverage=coverage,
        impl=where.impl or "",
        states_reached=report.states,
        invariants_checked=report.invariants_checked,
        branches=expected,
        groups=where.groups,
        events=where.events,
        message=message,
        seed=where.seed,
        not_exercised=report.not_exercised,
        mistakes_checked=dict(report.mistakes_checked),
        reactions=dict(report.reactions),
        not_expressed=dict(report.not_expressed),
        device=where.device,
        extra_rounds=report.extra_rounds,
        spec_branches=branches,
        absent_ops=report.absent_ops,
        examples_asked=where.max_examples,
        jobs=where.jobs,
    )


def _result(raw: CampaignReport | Death, factory: Factory, where: _Where, started: float) -> CheckResult:
    """The result of a campaign or replay: its failure shrunk (where Hypothesis could not), saved and told."""
    died = isinstance(raw, Death)
    if isinstance(raw, Death):
        verdict = Verdict.HUNG if raw.hung else Verdict.CRASHED
        rebuilt = trace_from_death(raw, where.impl, where.step_timeout_s)
        if rebuilt is None:
            report = CampaignReport(verdict, "the process died before its first step was written")
            return _check_result(report, where, None, time.monotonic() - started)
        raw = CampaignReport(verdict, trace=rebuilt, failure=rebuilt.failure)
    report, is_shrunk = raw, True
    trace: Trace | None = report.trace if report.failure is not None else None
    # Hypothesis shrinks what raises; a death or a hang it never saw (or must not
    # retry at a full time limit per attempt) is cut down here by replaying.
    must_shrink = report.verdict is Verdict.HUNG or (died and report.verdict is Verdict.CRASHED)
    if trace is not None and must_shrink:
        trace, is_shrunk = shrink_by_replay(trace, factory, where.impl, where.step_timeout_s, where.minimize_s)
    failure = _reported(trace, where, is_shrunk) if trace is not None else None
    seconds = time.monotonic() - started if died or (trace is not None and must_shrink) else report.seconds
    result = _check_result(report, where, failure, seconds)
    if report.deepest is not None:
        caching = "on" if where.enable_caching else "off"
        text = dumps_trace(dataclasses.replace(report.deepest, verdict=Verdict.CONFORMS))
        result.deepest_trace_path = _save(text, where.trace_dir, f"deepest-{where.level}-caching-{caching}")
    return result


def _could_not_run(message: str, where: _Where) -> CheckResult:
    branches = (
        expected_branches(where.level, where.enable_caching, where.profile, where.groups, where.events)
        if where.level in ("pool", "manager")
        else ()
    )
    return CheckResult(
        verdict=Verdict.COULD_NOT_RUN,
        level=where.level,
        enable_caching=where.enable_caching,
        profile=where.profile,
        examples_run=0,
        steps_run=0,
        seconds=0.0,
        failure=None,
        coverage={b: 0 for b in branches},
        impl=where.impl or "",
        branches=branches,
        message=message,
        seed=where.seed,
        groups=where.groups,
        events=where.events,
    )


# --- the entry points ---------------------------------------------------------------------


def run_check(
    factory: Factory | str,
    *,
    level: str = "pool",
    enable_caching: bool = True,
    profile: str = "vllm-v1",
    max_examples: int = 200,
    seed: int = 0,
    time_budget_s: float | None = None,
    step_timeout_s: float | None = 10.0,
    trace_dir: str | Path | None = None,
    impl: str | None = None,
    steps_per_example: int = 50,
    keep_deepest: bool = False,
    isolate: bool = True,
    database: Any = None,
    minimize_s: float = 30.0,
    device: str | None = None,
    shrink: bool = True,
    cover_rounds: int = 0,
    progress: Progress | None = None,
    groups: str = "full",
    events: bool = False,
    jobs: int = 1,
) -> CheckResult:
    """Check one implementation at one level against the spec.

    Args:
        factory: builds an adapter from an `AdapterConfig`; or a name for `load_factory`.
        level: "pool" (BlockPool) or "manager" (KVCacheManager).
        enable_caching: prefix caching on or off.
        profile: the ordering profile the implementation claims (spec.ordering.PROFILES).
        max_examples: Hypothesis examples (each up to `steps_per_example` rules).
        seed: the random seed; the same seed (and jobs) gives the same campaign with the same Hypothesis,
            whatever else the program has imported and however kvspec is installed (the campaign draws
            without the constants Hypothesis collects from loaded modules; campaign.py).
        time_budget_s: stop starting new examples after this long (a failure is still shrunk).
        step_timeout_s: the most one implementation call may take; None: no limit.
        trace_dir: where failure traces go (default ./kvspec-traces, created when a trace is written).
        impl: the implementation's name, for reports and trace headers.
        steps_per_example: Hypothesis's stateful_step_count.
        keep_deepest: also save the example that reached the most events (it replays to conforms).
        isolate: run in a child process (crash- and hang-proof); False runs in this process.
        database: a Hypothesis example database (e.g. a shared directory for long campaigns).
        minimize_s: time allowed for cutting down a trace that a dead or hung process left.
        device: `AdapterConfig.device` for every adapter built ("cpu", "cuda:0"; None: the adapter picks).
            The device is first used inside the campaign's child process.
        shrink: shrink a failure found by Hypothesis (False: report the first failing example as found).
        cover_rounds: while an expected branch is unreached after `max_examples`, up to this many
            more rounds of `max_examples` each, on the next seeds (within the time budget).
        progress: called every few seconds with (examples started, steps checked) while the campaign
            runs in its child process.
        groups: the KV cache groups of the manager level ("full", "full,sliding:8", ...; spec.attention),
            or "drawn": one to three groups drawn per example. The pool level has no groups.
        events: check what the pool tells the world too: the KV cache events every call publishes
            (`take_events`, the router's mirror rules) and, at the request level, the hit statistics.
        jobs: processes the campaign's examples are shared among, each in its own forked child and on its own
            seeds (kvspec.conformance.runner.jobs); 1 runs them all in one. The same seed and jobs give the same
            campaign.

    Returns:
        The verdict, what ran and was reached, and the failure with its saved trace and story.
    """
    started = time.monotonic()
    if isinstance(factory, str):
        impl = impl or factory
    shrink_s = minimize_s if shrink else 0.0
    asked = max_examples if isinstance(max_examples, int) else None
    layout = layout_name(groups) if level == "manager" else "full"
    where = _Where(
        level, enable_caching, profile, impl, seed, device, trace_dir, step_timeout_s, shrink_s, asked, layout,
        bool(events),
    )  # fmt: skip
    if isinstance(factory, str):
        try:
            factory = load_factory(factory)
        except FactoryError as e:
            return _could_not_run(str(e), where)
    problem = plan_problem(level, profile, max_examples, cover_rounds, groups, jobs)
    if problem is not None:
        return _could_not_run(problem, where)
    chosen: Factory = factory
    plan = CampaignPlan(level, enable_caching, profile, max_examples, seed, time_budget_s, step_timeout_s,
                        steps_per_example, keep_deepest, impl, database, device, shrink, cover_rounds,
                        layout, bool(events))  # fmt: skip
    plans = job_plans(plan, jobs)
    works = [lambda fd, hb, p=p: run_campaign(chosen, p, fd, hb) for p in plans]
    outcomes = run_isolated_jobs(works, step_timeout_s, isolate, progress, stops_later_jobs=decides)
    where = dataclasses.replace(where, jobs=len(plans))
    return _result(merged(outcomes, time.monotonic() - started), chosen, where, started)


def replay(
    trace: Trace | str | Path,
    factory: Factory | str,
    *,
    impl: str | None = None,
    step_timeout_s: float | None = 10.0,
    trace_dir: str | Path | None = None,
    isolate: bool = True,
    device: str | None = None,
) -> CheckResult:
    """Re-run a recorded trace on an implementation, checking every step as the machine does.

    `device`, when given, replaces the device the trace was recorded on.

    Raises:
        MalformedTrace: the trace file cannot be read.
    """
    started = time.monotonic()
    t = trace if isinstance(trace, Trace) else read_trace(trace)
    if device is not None:
        t = dataclasses.replace(t, config=dataclasses.replace(t.config, device=device))
    if isinstance(factory, str):
        impl = impl or factory
    c = t.config
    where = _Where(
        c.level, c.enable_caching, c.profile, impl, 0, c.device, trace_dir, step_timeout_s, groups=c.groups,
        events=c.events,
    )  # fmt: skip
    if isinstance(factory, str):
        try:
            factory = load_factory(factory)
        except FactoryError as e:
            return _could_not_run(str(e), where)
    chosen: Factory = factory
    raw = run_isolated(lambda fd, hb: replay_example(t, chosen, impl, step_timeout_s, fd, hb), step_timeout_s, isolate)
    return _result(raw, chosen, where, started)


def make_conformance_test(
    factory: Factory,
    level: str = "both",
    enable_caching: bool | None = None,
    profile: str = "vllm-v1",
    max_examples: int | None = None,
    seed: int = 0,
    step_timeout_s: float | None = 10.0,
    trace_dir: str | Path | None = None,
    events: bool = False,
) -> type[unittest.TestCase]:
    """A `unittest.TestCase` class that checks `factory`'s adapters against the spec.

    One test per level and caching mode (`test_pool_caching_on`, ...). Each runs
    `run_check` in a child process; a failure fails the test with the short
    story, and the trace is saved (in `trace_dir`, default ./kvspec-traces).
    A level the adapter does not provide is a skipped test; a run that checked
    too little to conclude fails with the reason. The story's replay line names
    the factory (`registry.factory_name`: "file.py:function" for a top-level
    module's function), so pasted in the folder the tests ran in, it replays.

    Args:
        factory: builds an adapter from an `AdapterConfig`.
        level: "pool", "manager" or "both".
        enable_caching: True or False for one mode; None for both.
        profile: the ordering profile the implementation claims.
        max_examples: per test; None takes the active Hypothesis profile's.
        seed: the campaign's seed.
        step_timeout_s: the most one implementation call may take.
        trace_dir: where failure traces are saved.
        events: check the KV cache events and hit statistics too (`kvspec check --events`).

    Raises:
        ValueError: level is not "pool", "manager" or "both".
    """
    if level not in ("pool", "manager", "both"):
        raise ValueError(f"level must be 'pool', 'manager' or 'both'; got level={level!r}")
    levels = ("pool", "manager") if level == "both" else (level,)
    modes = (True, False) if enable_caching is None else (enable_caching,)
    impl = factory_name(factory)

    def make_test(lv: str, caching: bool) -> Callable[[unittest.TestCase], None]:
        def test(self: unittest.TestCase) -> None:
            n = max_examples if max_examples is not None else settings().max_examples
            result = run_check(factory, level=lv, enable_caching=caching, profile=profile, max_examples=n,
                               seed=seed, step_timeout_s=step_timeout_s, trace_dir=trace_dir, impl=impl,
                               events=events)  # fmt: skip
            if result.verdict is Verdict.NOT_APPLICABLE:
                self.skipTest(f"{lv} level not provided: {result.message}")
            if result.verdict is not Verdict.CONFORMS:
                self.fail(result.failure.story if result.failure is not None else f"{result.verdict}: {result.message}")

        test.__name__ = f"test_{lv}_caching_{'on' if caching else 'off'}"
        test.__doc__ = f"The {lv} level conforms to the spec (profile {profile}, caching {'on' if caching else 'off'})."
        return test

    attrs: dict[str, Any] = {make_test(lv, c).__name__: make_test(lv, c) for lv in levels for c in modes}
    name = getattr(factory, "__name__", type(factory).__name__)
    return type(f"Conformance_{name}", (unittest.TestCase,), attrs)
