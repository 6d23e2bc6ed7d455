"""Campaign scheduling: the Hypothesis runs of one configuration, in chunks, inside the child process.

A campaign checks one implementation at one level, caching mode and profile.
It first builds one adapter to see that the level can run at all, then runs
the state machine in chunks: a time budget sizes each chunk to the time
left (Hypothesis has no time limit of its own, and an exception raised
inside a test to stop it would be taken for flaky data generation), and
while an expected branch is still unreached after the examples asked for,
up to `cover_rounds` more rounds run on the next seeds, so the coverage
reported is the campaign's rather than one seed's luck. It hands back a
`CampaignReport`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from hypothesis import HealthCheck, Phase, Verbosity, settings
from hypothesis import seed as hypothesis_seed
from hypothesis.errors import Flaky
from hypothesis.stateful import run_state_machine_as_test

from kvspec.conformance.core.adapter import AdapterConfig, LevelNotProvided, provides_profile
from kvspec.conformance.core.coverage import expected_branches, reachable_branches
from kvspec.conformance.core.lockstep import ConformanceFailure, Factory, LockStep, Observer, SpecFailure, StepTimeout
from kvspec.conformance.core.machine import conformance_machine
from kvspec.conformance.core.operations import required_methods
from kvspec.conformance.core.results import CampaignReport, Failure, FailureKind, Verdict
from kvspec.conformance.core.watch import StepWatch
from kvspec.spec.attention import format_groups, parse_groups
from kvspec.spec.errors import InvalidRequest
from kvspec.spec.ordering import is_profile, known_profiles

__all__ = ["DRAWN", "CampaignPlan", "layout_name", "plan_problem", "run_campaign"]


@dataclass(frozen=True)
class CampaignPlan:
    """Everything one campaign is asked to do."""

    level: str
    enable_caching: bool
    profile: str
    max_examples: int
    seed: int
    time_budget_s: float | None
    step_timeout_s: float | None
    steps_per_example: int
    keep_deepest: bool
    impl: str | None
    database: Any
    device: str | None = None
    shrink: bool = True
    cover_rounds: int = 0
    groups: str = "full"  # the KV cache groups at the manager level, or "drawn"
    events: bool = False  # check the KV cache events and hit statistics too (AdapterConfig.events)
    # The step between the seeds of the campaign's chunks: a campaign spread over N jobs (jobs.py) runs
    # job j on the seeds seed + j, seed + j + N, ..., so no two jobs run the same examples.
    seed_stride: int = 1


DRAWN = "drawn"  # `groups`: one layout drawn per example


def layout_name(groups: object) -> str:
    """`groups` in normal form ("full, sliding:8" -> "full,sliding:8"), as given when it names no layout."""
    if groups == DRAWN or not isinstance(groups, str):
        return str(groups)
    try:
        return format_groups(parse_groups(groups))
    except InvalidRequest:
        return groups


def plan_problem(
    level: str, profile: str, max_examples: object, cover_rounds: object, groups: object, jobs: object = 1
) -> str | None:
    """Why these campaign arguments cannot run, or None."""
    if level not in ("pool", "manager"):
        return f"level must be 'pool' or 'manager'; got level={level!r}"
    if groups != DRAWN:
        try:
            parse_groups(groups if isinstance(groups, str) else repr(groups))
        except InvalidRequest as e:
            return f"{e}, or {DRAWN!r} for a layout drawn per example"
    if not is_profile(profile):
        return f"unknown profile={profile!r}; known profiles: {known_profiles()}"
    if isinstance(max_examples, bool) or not isinstance(max_examples, int) or max_examples < 1:
        return f"max_examples must be a positive integer; got max_examples={max_examples!r}"
    if isinstance(cover_rounds, bool) or not isinstance(cover_rounds, int) or cover_rounds < 0:
        return f"cover_rounds must be a non-negative integer; got cover_rounds={cover_rounds!r}"
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        return f"jobs must be a positive integer; got jobs={jobs!r}"
    return None


def _probe(factory: Factory, config: AdapterConfig, groups: str = "full") -> tuple[Verdict, str] | None:
    """Why no campaign runs on this factory at this level (n/a: a level, profile or layout it does not
    provide), or None. `groups`: the campaign's KV cache groups ("drawn": any)."""
    level, declared = config.level, getattr(factory, "levels", None)
    if declared is not None and level not in declared:
        return Verdict.NOT_APPLICABLE, f"the factory declares levels={tuple(declared)}"
    policies = getattr(factory, "profiles", None)
    if policies is not None and not provides_profile(policies, config.profile):
        return Verdict.NOT_APPLICABLE, f"the factory declares profiles={tuple(policies)}, not {config.profile}"
    try:
        adapter = factory(config)
    except LevelNotProvided as e:
        return Verdict.NOT_APPLICABLE, str(e)
    except Exception as e:
        return Verdict.COULD_NOT_RUN, f"building the adapter failed for {config}: {type(e).__name__}: {e}"
    declared = getattr(adapter, "levels", None)
    if declared is not None and level not in declared:
        return Verdict.NOT_APPLICABLE, f"{type(adapter).__name__} declares levels={tuple(declared)}"
    if level == "manager" and groups != "full" and not getattr(adapter, "kv_cache_groups", False):
        return Verdict.NOT_APPLICABLE, (
            f"{type(adapter).__name__} does not declare kv_cache_groups = True: it is checked with one "
            f"full-attention KV cache group only, not groups={groups}"
        )
    missing = [m for m in required_methods(level) if not callable(getattr(adapter, m, None))]
    if not missing:
        return None
    other = "pool" if level == "manager" else "manager"
    if set(missing) >= set(required_methods(level)) - {"snapshot"} and all(
        callable(getattr(adapter, m, None)) for m in required_methods(other)
    ):
        return Verdict.NOT_APPLICABLE, (
            f"the factory builds a {other}-level adapter ({type(adapter).__name__}) when asked for the {level} "
            f"level: it provides the {other} level only"
        )
    return Verdict.COULD_NOT_RUN, f"the {level}-level adapter {type(adapter).__name__} lacks " + ", ".join(
        m + "()" for m in missing
    )


def run_campaign(factory: Factory, plan: CampaignPlan, stream_fd: int | None, heartbeat: Any) -> CampaignReport:
    """Run one campaign; what it ran, reached and found."""
    start = time.monotonic()
    observer = Observer(keep_deepest=plan.keep_deepest)
    watch = StepWatch(plan.step_timeout_s, stream_fd, heartbeat, plan.impl)
    undo = watch.install_alarm()
    try:
        watch.impl_started()
        try:
            config = AdapterConfig(plan.level, 8, plan.enable_caching, plan.profile, device=plan.device,  # type: ignore[arg-type]
                                   groups="full" if plan.groups == "drawn" else plan.groups, events=plan.events)
            why = _probe(factory, config, plan.groups)
        finally:
            watch.impl_finished()
        if why is not None:
            return CampaignReport(why[0], why[1], seconds=time.monotonic() - start)
        found, message, extra_rounds = _chunks(factory, plan, observer, watch, start)
    finally:
        undo()
    return _report(plan, observer, found, message, extra_rounds, time.monotonic() - start)


def _chunks(
    factory: Factory, plan: CampaignPlan, observer: Observer, watch: StepWatch, start: float
) -> tuple[tuple[Failure, LockStep | None] | None, str, int]:
    """Run chunks until the examples (and cover rounds) are done, the budget is spent, or a failure is found."""
    deadline = start + plan.time_budget_s if plan.time_budget_s is not None else None
    branches = expected_branches(plan.level, plan.enable_caching, plan.profile, plan.groups, plan.events)
    remaining, chunk_seed, extra_rounds, message = plan.max_examples, plan.seed, 0, ""
    found: tuple[Failure, LockStep | None] | None = None
    while found is None:
        if remaining <= 0:
            reachable = reachable_branches(
                plan.level, branches, observer.coverage, observer.not_exercised, observer.absent_ops
            )
            if extra_rounds == plan.cover_rounds or all(observer.coverage.get(b) for b in reachable):
                break
            remaining, extra_rounds = plan.max_examples, extra_rounds + 1
        n = remaining
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                message = f"time budget of {plan.time_budget_s:g} s spent"
                break
            per_example = (time.monotonic() - start) / observer.examples if observer.examples else None
            n = min(remaining, 20 if per_example is None else max(10, int(left / per_example)))
        found, message = _run_chunk(factory, plan, observer, watch, n, chunk_seed)
        remaining -= n
        chunk_seed += plan.seed_stride
    return found, message, extra_rounds


def _report(
    plan: CampaignPlan,
    observer: Observer,
    found: tuple[Failure, LockStep | None] | None,
    message: str,
    extra_rounds: int,
    seconds: float,
) -> CampaignReport:
    failure, lock = found if found is not None else (None, None)
    verdict = failure.kind.verdict if failure is not None else Verdict.CONFORMS
    trace = None
    if failure is not None and lock is not None:
        trace = lock.trace(plan.impl)
        failure = trace.failure or failure
    deepest = observer.deepest[1].trace(plan.impl) if observer.deepest is not None else None
    return CampaignReport(
        verdict=verdict,
        message=message,
        examples=observer.examples,
        steps=observer.steps,
        coverage=dict(observer.coverage),
        state_hashes=frozenset(observer.states),
        invariants_checked=observer.invariants_checked,
        seconds=seconds,
        not_exercised=tuple(sorted(observer.not_exercised)),
        mistakes_checked=dict(observer.mistakes_sent),
        reactions=dict(observer.reactions),
        not_expressed=dict(observer.not_expressed),
        absent_ops=tuple(sorted(observer.absent_ops)),
        extra_rounds=extra_rounds,
        failure=failure,
        trace=trace,
        deepest=deepest,
        deepest_score=observer.deepest[0] if observer.deepest is not None else (0, 0),
    )


def _run_chunk(
    factory: Factory, plan: CampaignPlan, observer: Observer, watch: StepWatch, max_examples: int, seed: int
) -> tuple[tuple[Failure, LockStep | None] | None, str]:
    """One Hypothesis run of the machine; the failure it found (shrunk unless the plan says not) and a note."""
    machine = conformance_machine(
        factory, plan.level, plan.enable_caching, plan.profile, observer, device=plan.device, watch=watch,
        groups=plan.groups, events=plan.events,
    )
    hypothesis_seed(seed)(machine)
    try:
        with _draws_independent_of_loaded_modules():
            run_state_machine_as_test(machine, settings=_settings(plan, max_examples))
    except StepTimeout:
        lock = watch.current
        hung = lock.hung() if lock is not None else ConformanceFailure(Failure(FailureKind.HUNG, 0, "?", "no answer"))
        return (hung.failure, lock), ""
    except (ConformanceFailure, SpecFailure, Flaky) as e:
        failed: LockStep | None = watch.failed
        if failed is None or failed.failure is None:
            raise
        found = failed.failure
        message = ""
        if isinstance(e, Flaky):
            message = "the failure did not reproduce every time (the implementation is not deterministic?)"
        if isinstance(found, SpecFailure):
            message = f"the spec itself failed; a bug in kvspec: {found}"
        return (found.failure, failed), message
    return None, ""


@contextmanager
def _draws_independent_of_loaded_modules() -> Iterator[None]:
    """Run Hypothesis without the constants it finds in the first-party modules this process has loaded.

    Hypothesis (6.131 and later) now and then draws an integer or a byte
    string from the literals of the non-library modules a process has
    imported. Which modules those are depends on how kvspec is installed
    (editable or not), on the factory's module and on whatever else the
    program imported, so one seed would draw another campaign in a test
    suite, in CI or on a user's machine. A campaign therefore draws without
    them (Hypothesis's own constants, the same in every program, stay); the
    process's own Hypothesis tests get them back afterwards.
    """
    # NOTE: Hypothesis offers no setting for this, so the module function it
    # calls for them is swapped while the campaign runs. A release without it
    # draws no such constants: there is nothing to swap.
    try:
        # NOTE: Hypothesis's internals move between releases: imported where used, and their absence handled there
        from hypothesis.internal.conjecture import providers
    except ImportError:  # pragma: no cover - a layout of Hypothesis without the module
        yield
        return
    local_constants = getattr(providers, "_get_local_constants", None)
    cache = getattr(providers, "CONSTANTS_CACHE", None)
    if local_constants is None or cache is None:
        yield
        return
    # NOTE: Hypothesis's internals move between releases: imported where used, and their absence handled there
    from hypothesis.internal.constants_ast import Constants

    none = Constants()
    providers._get_local_constants = lambda: none
    cache.cache.clear()  # the permitted constants per draw kind, computed with the modules' constants
    try:
        yield
    finally:
        providers._get_local_constants = local_constants
        cache.cache.clear()


def _settings(plan: CampaignPlan, max_examples: int) -> settings:
    # Targeting (hill-climbing on the reuse of cached blocks) pays off only in
    # long runs; in a short one it spends the examples on one example's neighbours.
    phases = [Phase.explicit, Phase.reuse, Phase.generate] + ([Phase.shrink] if plan.shrink else [])
    if max_examples >= 1000:
        phases.append(Phase.target)
    return settings(
        max_examples=max_examples,
        stateful_step_count=plan.steps_per_example,
        deadline=None,
        database=plan.database,
        derandomize=False,
        suppress_health_check=list(HealthCheck),
        verbosity=Verbosity.quiet,
        report_multiple_bugs=False,
        phases=phases,
        print_blob=False,
    )
