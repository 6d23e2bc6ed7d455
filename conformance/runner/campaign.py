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

import dataclasses
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NamedTuple

from hypothesis import HealthCheck, Phase, Verbosity, settings
from hypothesis import seed as hypothesis_seed
from hypothesis.errors import Flaky
from hypothesis.stateful import run_state_machine_as_test

from kvspec.conformance.core.adapter import AdapterConfig, LevelNotProvided, provides_profile
from kvspec.conformance.core.coverage import expected_branches, reachable_branches
from kvspec.conformance.core.lockstep import ConformanceFailure, Factory, LockStep, Observer, SpecFailure, StepTimeout
from kvspec.conformance.core.machine import machine_for
from kvspec.conformance.core.operations import required_methods
from kvspec.conformance.core.results import CampaignReport, Failure, FailureKind, Verdict
from kvspec.conformance.core.run_config import AUTO, DRAWN, Configuration, adapter_config, with_groups_resolved
from kvspec.conformance.core.strategies import KIND_COMBINATIONS
from kvspec.conformance.core.trace import Trace
from kvspec.conformance.core.watch import IMPLEMENTATION_FAULTS, StepWatch, raise_if_ctrl_c, said

__all__ = ["PROBE_NUM_GPU_BLOCKS", "CampaignPlan", "probe_factory", "run_campaign"]

PROBE_NUM_GPU_BLOCKS = 8  # the pool the probe builds, before any example: the first build of a campaign


@dataclass(frozen=True, slots=True)
class CampaignPlan:
    """One job's share of a configuration's campaign (kvspec.conformance.runner.jobs): its examples and seeds.

    Everything else a campaign does is the configuration's record (`Configuration.run`).
    """

    configuration: Configuration
    max_examples: int  # this job's share of the run's max_examples
    seed: int  # the seed of its first chunk
    # The step between the seeds of the campaign's chunks: a campaign spread over N jobs (jobs.py) runs
    # job j on the seeds seed + j, seed + j + N, ..., so no two jobs run the same examples.
    seed_stride: int = 1


class _Probe(NamedTuple):
    """What building one adapter before any example tells: whether a campaign runs, and what it declares."""

    refused: tuple[Verdict, str] | None  # why no campaign runs (verdict, message), or None
    declares_groups: bool = False  # the adapter declares kv_cache_groups = True (several KV cache groups)
    # With groups drawn: the sets of attention types it builds (None: every one), and why not the others.
    group_kinds: frozenset[frozenset[str]] | None = None
    kinds_refused: str = ""


class _Malformed(Exception):
    """A factory's or adapter's declaration that cannot be read, or is not what the harness reads."""


def _read(owner: object, name: str) -> object:
    """A declaration (an attribute), None when absent.

    Raises:
        _Malformed: reading it raised (an adapter's own __getattr__, a property).
    """
    try:
        return getattr(owner, name, None)
    except IMPLEMENTATION_FAULTS as e:  # the implementation's code: it can fail any way
        raise_if_ctrl_c(e)
        raise _Malformed(f"reading {name} raised {type(e).__name__}: {said(e)}") from None


def _names(owner: object, name: str) -> tuple[str, ...] | None:
    """A declaration that lists names (levels, profiles), None when absent.

    Raises:
        _Malformed: it cannot be read, or is not a tuple, list or set of strings.
    """
    value = _read(owner, name)
    if value is None:
        return None
    if not isinstance(value, (tuple, list, set, frozenset)) or not all(isinstance(v, str) for v in value):
        raise _Malformed(f"{name}={value!r:.100}, where a tuple of names is read")
    return tuple(value)


def probe_factory(factory: Factory, config: AdapterConfig, groups: str = "full") -> _Probe:
    """Why no campaign runs on this factory at this level (n/a: a level, profile or layout it does not
    provide; could not run: it cannot be built here, a device it does not have say, or the adapter lacks
    a method), or None; and whether it declares KV cache groups. `groups`: the campaign's KV cache groups
    ("drawn": any; "auto": what the adapter declares, so never n/a for its layout).

    A factory that ends the process (sys.exit) is not judged here: the campaign's first example builds
    it again and reports the crash as the implementation's, with its story (`LockStep`).
    """
    try:
        declared, policies = _names(factory, "levels"), _names(factory, "profiles")
    except _Malformed as e:
        return _Probe((Verdict.COULD_NOT_RUN, f"the factory's declarations are wrong: {e}"))
    level = config.level
    if declared is not None and level not in declared:
        return _Probe((Verdict.NOT_APPLICABLE, f"the factory declares levels={tuple(declared)}"))
    if policies is not None and not provides_profile(policies, config.profile):
        why = f"the factory declares profiles={tuple(policies)}, not {config.profile}"
        return _Probe((Verdict.NOT_APPLICABLE, why))
    try:
        adapter = factory(config)
    except LevelNotProvided as e:
        return _Probe((Verdict.NOT_APPLICABLE, str(e)))
    except Exception as e:
        why = f"building the adapter failed for {config}: {type(e).__name__}: {said(e)}"
        return _Probe((Verdict.COULD_NOT_RUN, why))
    except IMPLEMENTATION_FAULTS as e:  # an exit, an interrupt or a BaseException of its own: its first example says it
        raise_if_ctrl_c(e)
        return _Probe(None)
    try:
        declared, declares_groups = _names(adapter, "levels"), _read(adapter, "kv_cache_groups") is True
    except _Malformed as e:
        return _Probe((Verdict.COULD_NOT_RUN, f"the adapter's declarations are wrong: {e}"))
    if declared is not None and level not in declared:
        return _Probe((Verdict.NOT_APPLICABLE, f"{type(adapter).__name__} declares levels={tuple(declared)}"))
    if level == "manager" and groups not in ("full", AUTO) and not declares_groups:
        return _Probe((Verdict.NOT_APPLICABLE, (
            f"{type(adapter).__name__} does not declare kv_cache_groups = True: it is checked with one "
            f"full-attention KV cache group only, not groups={groups}"
        )))  # fmt: skip
    missing = [m for m in required_methods(level) if not callable(getattr(adapter, m, None))]
    if not missing:
        if level == "manager" and declares_groups and groups in (DRAWN, AUTO):
            return _Probe(None, declares_groups, *_kinds_built(factory, config))
        return _Probe(None, declares_groups)
    other = "pool" if level == "manager" else "manager"
    if set(missing) >= set(required_methods(level)) - {"snapshot"} and all(
        callable(getattr(adapter, m, None)) for m in required_methods(other)
    ):
        return _Probe((Verdict.NOT_APPLICABLE, (
            f"the factory builds a {other}-level adapter ({type(adapter).__name__}) when asked for the {level} "
            f"level: it provides the {other} level only"
        )))  # fmt: skip
    lacks = ", ".join(m + "()" for m in missing)
    return _Probe((Verdict.COULD_NOT_RUN, f"the {level}-level adapter {type(adapter).__name__} lacks {lacks}"))


def _kinds_built(factory: Factory, config: AdapterConfig) -> tuple[frozenset[frozenset[str]] | None, str]:
    """Which combinations of attention types the factory builds (one layout of each, `KIND_COMBINATIONS`):
    None when every one, else those it builds and why not the others, from its `LevelNotProvided`.

    Only `LevelNotProvided` says a layout is not provided; any other error (or an exit) builds nothing
    either, but it is the implementation's to answer for, so that layout is drawn and its first example
    reports the crash.
    """
    built, refused = set(), []
    for kinds, layout in KIND_COMBINATIONS.items():
        try:
            factory(dataclasses.replace(config, groups=layout, num_gpu_blocks=1 + 8 * len(kinds)))
        except LevelNotProvided as e:
            refused.append((layout, str(e)))
            continue
        except IMPLEMENTATION_FAULTS as e:  # the implementation's to answer for: its first example reports it
            raise_if_ctrl_c(e)
        built.add(kinds)
    if not refused:
        return None, ""
    layouts = ", ".join(layout for layout, _ in refused)
    return frozenset(built), f"builds no layout like {layouts} (the first refused: {refused[0][1]})"


def run_campaign(factory: Factory, plan: CampaignPlan, stream_fd: int | None, heartbeat: Any) -> CampaignReport:
    """Run one campaign; what it ran, reached and found."""
    start = time.monotonic()
    configuration, run = plan.configuration, plan.configuration.run
    observer = Observer(keep_deepest=run.keep_deepest)
    watch = StepWatch(run.step_timeout_s, stream_fd, heartbeat, configuration.impl, run.build_timeout_s)
    undo = watch.install_alarm()
    try:
        probed = _probed(factory, configuration, watch)
        if isinstance(probed, CampaignReport):
            return dataclasses.replace(probed, seconds=time.monotonic() - start)
        resolved = with_groups_resolved(configuration, probed.declares_groups, probed.group_kinds)
        plan = dataclasses.replace(plan, configuration=resolved)
        if probed.kinds_refused:
            observer.not_exercised.add(f"KV cache groups: not applicable, {probed.kinds_refused}")
        found, message, extra_rounds = _chunks(factory, plan, observer, watch, start)
    finally:
        undo()
    report = _report(plan, observer, found, message, extra_rounds, time.monotonic() - start)
    return dataclasses.replace(
        report, groups=resolved.groups, declares_groups=probed.declares_groups, group_kinds=resolved.group_kinds
    )


def _probed(factory: Factory, configuration: Configuration, watch: StepWatch) -> CampaignReport | _Probe:
    """The probe under the build time limit: the report of a campaign that does not run, or what the probe
    found (`_Probe`).

    A build that does not finish in time is the implementation hanging (a story at "building the
    adapter"), not kvspec failing.
    """
    config = adapter_config(configuration, PROBE_NUM_GPU_BLOCKS)
    watch.impl_started(building=True)
    try:
        probe = probe_factory(factory, config, configuration.groups)
    except StepTimeout:
        failure = Failure(FailureKind.HUNG, 0, "init", watch.limit_met())
        trace = Trace(config, (), configuration.impl, Verdict.HUNG, failure)
        return CampaignReport(Verdict.HUNG, failure=failure, trace=trace)
    finally:
        watch.impl_finished()
    return CampaignReport(*probe.refused) if probe.refused is not None else probe


def _chunks(
    factory: Factory, plan: CampaignPlan, observer: Observer, watch: StepWatch, start: float
) -> tuple[tuple[Failure, LockStep | None] | None, str, int]:
    """Run chunks until the examples (and cover rounds) are done, the budget is spent, or a failure is found."""
    c, run = plan.configuration, plan.configuration.run
    deadline = start + c.time_budget_s if c.time_budget_s is not None else None
    branches = expected_branches(c.level, c.enable_caching, run.profile, c.groups, run.events)
    remaining, chunk_seed, extra_rounds, message = plan.max_examples, plan.seed, 0, ""
    found: tuple[Failure, LockStep | None] | None = None
    while found is None:
        if remaining <= 0:
            reachable = reachable_branches(
                c.level, branches, observer.coverage, observer.not_exercised, observer.absent_ops
            )
            if extra_rounds == run.cover_rounds or all(observer.coverage.get(b) for b in reachable):
                break
            remaining, extra_rounds = plan.max_examples, extra_rounds + 1
        n = remaining
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                message = f"time budget of {c.time_budget_s:g} s spent"
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
        trace = lock.trace(plan.configuration.impl)
        failure = trace.failure or failure
    deepest = observer.deepest[1].trace(plan.configuration.impl) if observer.deepest is not None else None
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
    machine = machine_for(factory, plan.configuration, observer, watch)
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
            limit = found.failure.kind is FailureKind.LIMIT
            message = str(found) if limit else f"the spec itself failed; a bug in kvspec: {found}"
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
    run = plan.configuration.run
    # Targeting (hill-climbing on the reuse of cached blocks) pays off only in
    # long runs; in a short one it spends the examples on one example's neighbours.
    phases = [Phase.explicit, Phase.reuse, Phase.generate] + ([Phase.shrink] if run.shrink else [])
    if max_examples >= 1000:
        phases.append(Phase.target)
    return settings(
        max_examples=max_examples,
        stateful_step_count=run.steps,
        deadline=None,
        database=run.database,
        derandomize=False,
        suppress_health_check=list(HealthCheck),
        verbosity=Verbosity.quiet,
        report_multiple_bugs=False,
        phases=phases,
        print_blob=False,
    )
