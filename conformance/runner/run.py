"""The harness's public entry points: a campaign against one implementation, a replay, and the test-suite hook.

`run_check` runs the state machine of one level against one implementation
and returns a `CheckResult`: the verdict, how much was run, what the run
reached, and for a failure the shrunk trace (saved as a file) and its story.
`replay` re-runs a saved trace (`make_conformance_test`, in
kvspec.conformance.runner.testcase, wraps `run_check` as a unittest class).
The work itself runs in parts, each in its module:

- kvspec.conformance.runner.registry: from an implementation's name to its factory;
- kvspec.conformance.runner.isolation: the forked child that survives any crash or hang;
- kvspec.conformance.runner.campaign: the Hypothesis runs of one configuration, in chunks;
- kvspec.conformance.runner.replaying: a trace's steps fed to the lock-step core;
- kvspec.conformance.runner.minimize: cutting down what a dead or hung child left;
- this module: the record of the run (kvspec.conformance.core.run_config.RunConfig) built from the
  arguments, and a campaign's report turned into a result.

Exit codes (the CLI's, `Verdict.exit_code`): 0 conforms; 1 the implementation
is wrong (diverged, crashed or hung, with its trace); 2 no verdict (it could
not be built or loaded, the arguments were wrong, or the run was inconclusive).
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from pathlib import Path
from typing import Any

from kvspec.conformance.core.coverage import expected_branches, reachable_branches
from kvspec.conformance.core.files import shown, write_whole
from kvspec.conformance.core.report import render_story
from kvspec.conformance.core.results import (
    CampaignReport,
    CheckResult,
    Failure,
    Verdict,
    inconclusive_why,
    unreached_why,
)
from kvspec.conformance.core.run_config import (
    AUTO,
    DEFAULT_BUILD_TIMEOUT_S,
    DEFAULT_COVER_ROUNDS,
    DEFAULT_TRACE_DIR,
    DRAWN,
    ConfigError,
    Configuration,
    RunConfig,
    adapter_config,
    with_groups_resolved,
)
from kvspec.conformance.core.trace import Trace, dumps_trace
from kvspec.conformance.runner.campaign import PROBE_NUM_GPU_BLOCKS, run_campaign
from kvspec.conformance.runner.isolation import Death, Progress, run_isolated, run_isolated_jobs
from kvspec.conformance.runner.jobs import decides, job_plans, merged
from kvspec.conformance.runner.minimize import shrink_by_replay, trace_from_death
from kvspec.conformance.runner.registry import Factory, FactoryError, load_factory
from kvspec.conformance.runner.replaying import load_sendable, replay_example

__all__ = [
    "DEFAULT_TRACE_DIR",
    "CheckResult",
    "Failure",
    "FactoryError",
    "Verdict",
    "check_configuration",
    "load_factory",
    "replay",
    "replay_configured",
    "run_check",
]


# --- results ------------------------------------------------------------------------------


def _save(text: str, trace_dir: Path, stem: str) -> str:
    """Save a trace in `trace_dir`, named by its content; returns its path.

    Raises:
        OSError: it cannot be written (a full disk): nothing is left of it.
    """
    digest = hashlib.sha256(text.encode()).hexdigest()[:6]
    return str(write_whole(trace_dir / f"{stem}-{digest}.trace.jsonl", text))


def _not_saved(run: RunConfig, e: OSError) -> str:
    assert run.trace_dir is not None, "a trace is saved only where the run saves traces"
    return f"not saved in {shown(run.trace_dir, run.folder)} ({e.strerror or e})"


def _reported(trace: Trace, c: Configuration, is_shrunk: bool) -> Failure:
    """The trace's failure with its story told, and its trace saved where the run saves traces (if it does)."""
    assert trace.failure is not None and trace.verdict is not None, "only a failing trace is reported"
    verdict = trace.verdict
    stem = f"{verdict}-{c.level}" if verdict in (Verdict.CRASHED, Verdict.HUNG) else f"failure-{c.level}"
    trace_dir = c.run.trace_dir
    path, unsaved = None, ""
    if trace_dir is not None:
        try:
            path = _save(dumps_trace(trace), trace_dir, stem)
        except OSError as e:  # the verdict stands; the story says what is missing
            unsaved = f"\n\ntrace: {_not_saved(c.run, e)}"
    # The story names the trace as the user would (relative to the folder the run started in); the failure
    # keeps the whole path, which holds wherever the implementation moves the current folder.
    story = render_story(trace, None if path is None else shown(path, c.run.folder), c.impl) + unsaved
    if not is_shrunk:
        story += "\n(not shrunk: the process died or hung, and no shorter trace reproduced it in time)"
    return dataclasses.replace(
        trace.failure, trace_path=path, num_steps=len(trace.steps), story=story, is_shrunk=is_shrunk
    )


def _check_result(report: CampaignReport, c: Configuration, failure: Failure | None, seconds: float) -> CheckResult:
    run = c.run
    if report.groups is not None:  # the layouts the campaign's probe resolved for this implementation
        c = with_groups_resolved(c, report.declares_groups, report.group_kinds)
    branches = expected_branches(c.level, c.enable_caching, run.profile, c.groups, run.events, c.group_kinds)
    coverage = {b: 0 for b in branches}
    coverage.update(report.coverage)
    expected = reachable_branches(c.level, branches, coverage, report.not_exercised, report.absent_ops)
    verdict, message = report.verdict, report.message
    asked = None if c.is_replay else run.max_examples
    # No verdict without work: a run that checked (almost) nothing, or left a branch the implementation
    # can reach unreached, says so instead of "conforms". A replay reaches what its one trace reaches.
    why = None
    if verdict is Verdict.CONFORMS:
        why = inconclusive_why(report.examples, report.steps, asked) or (
            None if c.is_replay else unreached_why(expected, coverage)
        )
    if why is not None:
        verdict, message = Verdict.INCONCLUSIVE, why + (f" ({message})" if message else "")
    return CheckResult(
        verdict=verdict,
        level=c.level,
        enable_caching=c.enable_caching,
        profile=run.profile,
        examples_run=report.examples,
        steps_run=report.steps,
        seconds=seconds,
        failure=failure,
        coverage=coverage,
        impl=c.impl or "",
        states_reached=report.states,
        invariants_checked=report.invariants_checked,
        branches=expected,
        groups=c.groups,
        events=run.events,
        message=message,
        seed=run.seed,
        not_exercised=report.not_exercised,
        mistakes_checked=dict(report.mistakes_checked),
        reactions=dict(report.reactions),
        not_expressed=dict(report.not_expressed),
        device=run.device,
        extra_rounds=report.extra_rounds,
        spec_branches=branches,
        absent_ops=report.absent_ops,
        examples_asked=asked,
        jobs=1 if asked is None else len(job_plans(c)),
        left_out=_left_out(c, report) if verdict is not Verdict.NOT_APPLICABLE else (),
    )


def _left_out(c: Configuration, report: CampaignReport) -> tuple[str, ...]:
    """What the implementation provides that this run did not check, each with the flag that checks it.

    Why in the verdict: a gate run with a narrow flag set would otherwise say `conforms` for code it never
    called (a sliding-window group, the event queue). Groups are left out only of an adapter that declares
    them; events of every run without them, since an adapter builds its event queue only when asked (one
    asked that has none is listed as not providing `take_events`).
    """
    left = []
    if c.level == "manager" and report.declares_groups and c.groups != DRAWN:
        left.append(f"KV cache group layouts other than {c.groups} (--groups drawn)")
    if not c.run.events:
        left.append("KV cache events" + (" and hit statistics" if c.level == "manager" else "") + " (--events)")
    return tuple(left)


def _result(raw: CampaignReport | Death, factory: Factory, c: Configuration, started: float) -> CheckResult:
    """The result of a campaign or replay: its failure shrunk (where Hypothesis could not), saved and told."""
    died, run = isinstance(raw, Death), c.run
    if isinstance(raw, Death):
        verdict = Verdict.HUNG if raw.hung else Verdict.CRASHED
        built_with = adapter_config(c, PROBE_NUM_GPU_BLOCKS) if not c.is_replay else None  # what the probe built
        rebuilt = trace_from_death(raw, c.impl, run.step_timeout_s, built_with, run.build_timeout_s)
        if rebuilt is None:
            report = CampaignReport(verdict, "the process died before its first step was written")
            return _check_result(report, c, None, time.monotonic() - started)
        raw = CampaignReport(verdict, trace=rebuilt, failure=rebuilt.failure)
    report, is_shrunk = raw, True
    trace: Trace | None = report.trace if report.failure is not None else None
    # Hypothesis shrinks what raises; a death or a hang it never saw (or must not
    # retry at a full time limit per attempt) is cut down here by replaying.
    must_shrink = report.verdict is Verdict.HUNG or (died and report.verdict is Verdict.CRASHED)
    if trace is not None and must_shrink:
        shrink_s = run.minimize_s if run.shrink else 0.0
        trace, is_shrunk = shrink_by_replay(trace, factory, c.impl, run.step_timeout_s, shrink_s)
    failure = _reported(trace, c, is_shrunk) if trace is not None else None
    seconds = time.monotonic() - started if died or (trace is not None and must_shrink) else report.seconds
    result = _check_result(report, c, failure, seconds)
    if report.deepest is not None and run.trace_dir is not None:
        caching = "on" if c.enable_caching else "off"
        text = dumps_trace(dataclasses.replace(report.deepest, verdict=Verdict.CONFORMS))
        try:
            result.deepest_trace_path = _save(text, run.trace_dir, f"deepest-{c.level}-caching-{caching}")
        except OSError as e:
            unsaved = f"the deepest example's trace was {_not_saved(run, e)}"
            result.message = f"{result.message}; {unsaved}" if result.message else unsaved
    return result


def _could_not_run(message: str, c: Configuration) -> CheckResult:
    """The result of a configuration whose implementation could not be loaded."""
    branches = expected_branches(c.level, c.enable_caching, c.run.profile, c.groups, c.run.events)
    return _refused(message, c.level, c.enable_caching, c.run.profile, c.impl, c.run.seed, c.groups, c.run.events,
                    branches)  # fmt: skip


def _refused(
    message: str, level: object, caching: object, profile: object, impl: str | None, seed: object, groups: object,
    events: object, branches: tuple[str, ...] = (),
) -> CheckResult:  # fmt: skip
    """A could-not-run result, from the arguments as given (a refused record has no configuration to read)."""
    return CheckResult(
        verdict=Verdict.COULD_NOT_RUN,
        level=str(level),
        enable_caching=bool(caching),
        profile=str(profile),
        examples_run=0,
        steps_run=0,
        seconds=0.0,
        failure=None,
        coverage={b: 0 for b in branches},
        impl=impl or "",
        branches=branches,
        message=message,
        seed=seed if isinstance(seed, int) else 0,
        groups=str(groups),
        events=bool(events),
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
    build_timeout_s: float | None = DEFAULT_BUILD_TIMEOUT_S,
    keep_deepest: bool = False,
    isolate: bool = True,
    database: Any = None,
    minimize_s: float = 30.0,
    device: str | None = None,
    shrink: bool = True,
    cover_rounds: int = DEFAULT_COVER_ROUNDS,
    progress: Progress | None = None,
    groups: str = "full",
    events: bool = False,
    jobs: int = 1,
) -> CheckResult:
    """Check one implementation at one level against the spec: the Python form of `kvspec check`.

    The arguments make one `RunConfig` (kvspec.conformance.core.run_config: each field's meaning, default
    and limit), checked once: `level` and `enable_caching` are its one level and caching mode,
    `steps_per_example` its `steps`, `trace_dir` None its default ./kvspec-traces; `impl` names `factory`
    in reports and trace headers (a name given as `factory` names itself). `factory` builds an adapter
    from an `AdapterConfig`, or is a name for `load_factory`. `progress` is called every few seconds with
    (examples started, steps checked) while the campaign runs in its child process.

    Returns:
        The verdict, what ran and was reached, and the failure with its saved trace and story; a
        configuration the record refuses, or a factory that cannot be loaded, could not run (the message
        says why in one line).
    """
    name = impl or (factory if isinstance(factory, str) else None)
    if profile == AUTO:  # the command line's search over profiles, not a profile one campaign can check
        message = f"profile={AUTO!r} names no one profile: runner.profiles.check_each_profile tries each vLLM profile"
        return _refused(message, level, enable_caching, profile, name, seed, groups, events)
    try:
        run = RunConfig(
            impls=(name,) if name else (), levels=(level,), caching=(enable_caching,), profile=profile,  # type: ignore[arg-type]
            groups=groups, events=events, device=device, max_examples=max_examples, steps=steps_per_example,
            cover_rounds=cover_rounds, time_budget_s=time_budget_s, step_timeout_s=step_timeout_s,
            build_timeout_s=build_timeout_s, seed=seed,
            jobs=jobs, shrink=shrink, minimize_s=minimize_s, isolate=isolate, keep_deepest=keep_deepest,
            trace_dir=Path(trace_dir) if trace_dir is not None else DEFAULT_TRACE_DIR, database=database,
        )  # fmt: skip
    except ConfigError as e:
        return _refused(str(e), level, enable_caching, profile, name, seed, groups, events)
    (configuration,) = run.configurations()
    return check_configuration(factory, configuration, progress)


def check_configuration(
    factory: Factory | str, configuration: Configuration, progress: Progress | None = None
) -> CheckResult:
    """Check one configuration of a run (`run_check`'s work, from the record): its campaign, shared among jobs.

    Args:
        factory: builds an adapter from an `AdapterConfig`; or a name for `load_factory`.
        configuration: what to check and how (`RunConfig.configurations`), under one profile (not AUTO).
        progress: called every few seconds with (examples started, steps checked) while the campaign runs.
    """
    started = time.monotonic()
    run = configuration.run
    if isinstance(factory, str):
        try:
            factory = load_factory(factory, folder=run.folder)
        except FactoryError as e:
            return _could_not_run(str(e), configuration)
    chosen: Factory = factory
    plans = job_plans(configuration)
    works = [lambda fd, hb, p=p: run_campaign(chosen, p, fd, hb) for p in plans]
    outcomes = run_isolated_jobs(works, run.step_timeout_s, run.isolate, progress, stops_later_jobs=decides)
    report = merged(outcomes, time.monotonic() - started, [p.max_examples for p in plans])
    return _result(report, chosen, configuration, started)


def replay(
    trace: Trace | str | Path,
    factory: Factory | str,
    *,
    impl: str | None = None,
    step_timeout_s: float | None = 10.0,
    trace_dir: str | Path | None = None,
    isolate: bool = True,
    device: str | None = None,
    build_timeout_s: float | None = DEFAULT_BUILD_TIMEOUT_S,
) -> CheckResult:
    """Re-run a recorded trace on an implementation, checking every step as the machine does.

    `device`, when given, replaces the device the trace was recorded on. The replay's own trace (its
    failure, as it went this time) is saved only in `trace_dir`, when given: the caller has the trace.

    Raises:
        MalformedTrace: the trace file cannot be read.
        ConfigError: a setting the run's record refuses (a step timeout of 0, ...).
    """
    name = impl or (factory if isinstance(factory, str) else None)
    run = replay_record(
        impls=(name,) if name else (), step_timeout_s=step_timeout_s, isolate=isolate, device=device,
        build_timeout_s=build_timeout_s, trace_dir=Path(trace_dir) if trace_dir is not None else None,
    )  # fmt: skip
    return replay_configured(trace, factory, run)


def replay_record(**fields: Any) -> RunConfig:
    """The record of a replay: the fields given (by keyword), and no time to cut a trace down (it is one).

    Raises:
        ConfigError: a field the record refuses.
    """
    return RunConfig(shrink=False, minimize_s=0.0, cover_rounds=0, **fields)


def replay_configured(trace: Trace | str | Path, factory: Factory | str, run: RunConfig) -> CheckResult:
    """`replay` from the run's record (`replay_record`); the level, caching mode, profile, groups and events
    are the trace's, and its device unless the record names one.

    Raises:
        MalformedTrace: the trace file cannot be read, or one of its steps is not one a campaign could
            have sent (`replaying.load_sendable`; a `Trace` built in Python is the caller's to vouch for).
    """
    started = time.monotonic()
    t = trace if isinstance(trace, Trace) else load_sendable(trace)
    if run.device is not None:
        t = dataclasses.replace(t, config=dataclasses.replace(t.config, device=run.device))
    c = t.config
    run = dataclasses.replace(
        run, levels=(c.level,), caching=(c.enable_caching,), profile=c.profile, groups=c.groups, events=c.events,
        device=c.device,
    )  # fmt: skip
    configuration = dataclasses.replace(next(run.configurations()), is_replay=True)
    if isinstance(factory, str):
        try:
            factory = load_factory(factory, folder=run.folder)
        except FactoryError as e:
            return _could_not_run(str(e), configuration)
    chosen: Factory = factory
    impl, timeout, build = configuration.impl, run.step_timeout_s, run.build_timeout_s
    raw = run_isolated(lambda fd, hb: replay_example(t, chosen, impl, timeout, fd, hb, build), timeout, run.isolate)
    return _result(raw, chosen, configuration, started)
