"""Mutation testing of the harness: run it against deliberately wrong implementations.

A harness that never fails proves nothing. `mutants/` (kvspec.mutants) holds the
reference model with one plausible bug each; `run_mutants` runs the ordinary
conformance check (`kvspec.conformance.runner.run.run_check`) against every one
and reports whether it was killed, how long that took, and how short the
shrunk counterexample is. Nothing here knows any mutant: a mutant carries only
the run options a real implementation would declare (its level, whether it
runs with prefix caching), and the machine is the one every user gets.

A kill only means something if the unmutated reference passes the same
check, so `run_control` runs it first under every configuration the mutants use.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from kvspec.conformance.core.adapter import AdapterConfig
from kvspec.conformance.core.results import CheckResult, Verdict
from kvspec.conformance.runner.run import run_check
from kvspec.conformance.targets.builtin import make_reference

__all__ = [
    "KILLING_VERDICTS",
    "KILL_TIME_TARGET_S",
    "MEDIAN_TRACE_TARGET",
    "Mutant",
    "MutantResult",
    "MutantSummary",
    "factory_name",
    "run_control",
    "run_mutants",
    "summarize",
]

Level = Literal["pool", "manager"]

# The verdicts that kill a mutant: the harness caught it. "could-not-run" does
# not: a mutant the harness cannot even build has shown nothing about the machine.
KILLING_VERDICTS = frozenset({Verdict.DIVERGES, Verdict.CRASHED, Verdict.HUNG})
# The benchmark `kvspec mutants` reports against (issue: the harness's proof of strength).
KILL_TIME_TARGET_S = 60.0
MEDIAN_TRACE_TARGET = 8


@dataclass(frozen=True)
class Mutant:
    """One deliberately wrong implementation, and how to run the harness on it."""

    name: str  # unique, snake_case: what `--only` selects
    description: str  # the bug in one sentence, as a reviewer would describe it
    level: Level  # the adapter level it implements: "pool" or "manager"
    factory: Callable[[AdapterConfig], object]  # builds the adapter from a config, like a user's factory
    kind: str  # the kind of bug (kvspec.mutants REQUIRED_KINDS, or a further kind)
    enable_caching: bool = True  # run with prefix caching on (False: a bug only visible without it)
    profile: str = "vllm-v1"  # the eviction policy it claims (a policy mutant claims the one it breaks)
    groups: str = "full"  # the KV cache groups it runs with (manager level; a group mutant needs its layout)
    events: bool = False  # checked with the KV cache events and hit statistics (an event mutant's bug is there)

    def __post_init__(self) -> None:
        if not self.name or not self.name.replace("_", "").isalnum() or self.name != self.name.lower():
            raise ValueError(f"a mutant name is snake_case letters and digits; got name={self.name!r}")
        if self.level not in ("pool", "manager"):
            raise ValueError(f"mutant {self.name}: level must be 'pool' or 'manager'; got level={self.level!r}")
        if not callable(self.factory):
            raise ValueError(f"mutant {self.name}: factory={self.factory!r} is not callable")


@dataclass(frozen=True)
class MutantResult:
    """What the harness did with one mutant."""

    name: str  # the mutant's name
    killed: bool  # the harness reported it (diverges, crashed or hung)
    seconds_to_kill: float | None  # wall seconds from start to verdict, shrinking included; None if it survived
    shrunk_steps: int | None  # length of the shrunk counterexample; None if it survived
    failure_kind: str | None  # the failure's kind (what the harness saw), or the verdict when there is no failure
    message: str  # the failure's message, or why it survived / could not run
    verdict: str  # run_check's verdict, or "harness-error" if the harness itself raised
    seconds: float  # wall seconds the check took, killed or not
    examples_run: int  # examples the harness ran
    steps_run: int  # steps the harness ran
    trace_path: str | None = None  # the saved shrunk trace, for `kvspec replay --impl <factory>`


@dataclass(frozen=True)
class MutantSummary:
    """The benchmark lines of a mutant run."""

    num_mutants: int  # mutants run
    num_killed: int  # of them killed
    survivors: tuple[str, ...]  # names of the mutants not killed
    slowest: str | None  # the killed mutant that took longest
    max_seconds_to_kill: float | None  # its time
    all_killed_within_target: bool  # every mutant killed, each within KILL_TIME_TARGET_S
    median_shrunk_steps: float | None  # over the killed mutants
    median_within_target: bool  # median_shrunk_steps <= MEDIAN_TRACE_TARGET


def _result(mutant: Mutant, check: CheckResult, seconds: float) -> MutantResult:
    killed = check.verdict in KILLING_VERDICTS
    failure = check.failure
    if failure is not None:
        kind: str | None = failure.kind.value
        message = failure.message
    else:
        kind = None if check.verdict is Verdict.CONFORMS else check.verdict.value
        survived = f"survived {check.examples_run} examples ({check.steps_run} steps) in {check.seconds:.1f} s"
        if check.verdict is Verdict.INCONCLUSIVE:  # not killed, on a campaign that left branches unreached
            message = f"{survived} (inconclusive: {check.message})"
        elif check.verdict is Verdict.CONFORMS:
            message = survived
        else:
            message = f"verdict {check.verdict} without a failure record"
    return MutantResult(
        name=mutant.name,
        killed=killed,
        seconds_to_kill=seconds if killed else None,
        shrunk_steps=failure.num_steps if killed and failure is not None else None,
        failure_kind=kind,
        message=message,
        verdict=check.verdict.value,
        seconds=seconds,
        examples_run=check.examples_run,
        steps_run=check.steps_run,
        trace_path=failure.trace_path if failure is not None else None,
    )


def factory_name(mutant: Mutant) -> str:
    """The mutant's factory as `module:name`, the form `kvspec check/replay --impl` loads."""
    factory = mutant.factory
    qualname = getattr(factory, "__qualname__", "")
    if qualname and "<" not in qualname:
        return f"{factory.__module__}:{qualname}"
    return f"mutant {mutant.name}"


def run_mutants(
    mutants: Sequence[Mutant],
    max_examples: int = 200,
    seed: int = 0,
    time_budget_per_mutant_s: float | None = KILL_TIME_TARGET_S,
    *,
    trace_dir: Path | None = None,
    on_result: Callable[[MutantResult], None] | None = None,
) -> list[MutantResult]:
    """Run the conformance check against each mutant, one after another.

    Args:
        mutants: the mutants to run.
        max_examples: the example budget of each check.
        seed: the harness seed (a fixed seed makes the run reproducible).
        time_budget_per_mutant_s: the wall-clock budget of each check; None for no limit.
        trace_dir: where the harness writes each failing trace (a subfolder per mutant); None for none.
        on_result: called with each result as soon as it is known (to print progress).

    Returns:
        One result per mutant, in the order given.
    """
    results: list[MutantResult] = []
    for mutant in mutants:
        start = time.perf_counter()
        try:
            check = run_check(
                mutant.factory,
                level=mutant.level,
                enable_caching=mutant.enable_caching,
                profile=mutant.profile,
                max_examples=max_examples,
                seed=seed,
                time_budget_s=time_budget_per_mutant_s,
                trace_dir=None if trace_dir is None else trace_dir / mutant.name,
                impl=factory_name(mutant),
                groups=mutant.groups,
                events=mutant.events,
            )
        except Exception as e:  # noqa: BLE001 - one broken run must not hide the others' results
            seconds = time.perf_counter() - start
            result = MutantResult(
                name=mutant.name,
                killed=False,
                seconds_to_kill=None,
                shrunk_steps=None,
                failure_kind="harness-error",
                message=f"the harness raised {type(e).__name__}: {e}",
                verdict="harness-error",
                seconds=seconds,
                examples_run=0,
                steps_run=0,
            )
        else:
            result = _result(mutant, check, time.perf_counter() - start)
        results.append(result)
        if on_result is not None:
            on_result(result)
    return results


def run_control(
    mutants: Sequence[Mutant], max_examples: int = 200, seed: int = 0, time_budget_s: float | None = None
) -> list[CheckResult]:
    """Check the unmutated reference under every (level, caching, profile, groups, events) the mutants run with.

    Returns:
        One check result per configuration, pool before manager, caching on before off, vllm-v1 first,
        one full-attention group first.
    """
    configurations = sorted(
        {(m.level, m.enable_caching, m.profile, m.groups, m.events) for m in mutants},
        key=lambda c: (c[0] != "pool", not c[1], c[2] != "vllm-v1", c[2], c[3] != "full", c[3], c[4]),
    )
    return [
        run_check(
            make_reference,
            level=level,
            enable_caching=enable_caching,
            profile=profile,
            max_examples=max_examples,
            seed=seed,
            time_budget_s=time_budget_s,
            groups=groups,
            events=events,
        )
        for level, enable_caching, profile, groups, events in configurations
    ]


def summarize(results: Sequence[MutantResult]) -> MutantSummary:
    """The kill count and the benchmark lines (time to kill, median shrunk trace)."""
    killed = [r for r in results if r.killed]
    slowest = max(killed, key=lambda r: r.seconds_to_kill or 0.0, default=None)
    steps = [r.shrunk_steps for r in killed if r.shrunk_steps is not None]
    median = statistics.median(steps) if steps else None
    return MutantSummary(
        num_mutants=len(results),
        num_killed=len(killed),
        survivors=tuple(r.name for r in results if not r.killed),
        slowest=None if slowest is None else slowest.name,
        max_seconds_to_kill=None if slowest is None else slowest.seconds_to_kill,
        all_killed_within_target=len(killed) == len(results)
        and all((r.seconds_to_kill or 0.0) <= KILL_TIME_TARGET_S for r in killed),
        median_shrunk_steps=median,
        median_within_target=median is not None and median <= MEDIAN_TRACE_TARGET,
    )
