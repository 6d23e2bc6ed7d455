"""A campaign spread over processes: its examples shared among jobs, each on its own seeds, the reports added up.

A campaign's time goes to Hypothesis (choosing rules, drawing arguments) and
to the checks, all Python in one process, so one campaign uses one core.
With `jobs` N > 1 its examples run in N forked children at once
(isolation.run_isolated_jobs), never more children than give each its floor
of examples (results.EXAMPLE_FLOOR): Hypothesis's first example of a seed is
its simplest, so ten jobs of one example each check ten trivial examples and
nothing else. Job j runs its share of the examples on the
seeds seed + j, seed + j + N, ... (CampaignPlan.seed_stride), so no two jobs
run the same example and one seed with one job count gives one campaign. A
job runs its own cover rounds (while a branch is unreached in that job).

The reports add up: examples, steps, coverage and the other counters are
summed, the distinct states are the union of the jobs' sets, and the deepest
example is the deepest of any job. The first job in order whose campaign did
not conform decides the verdict and carries the failure: the jobs after it are
stopped as soon as it ends, the jobs before it run on to their end, so which
job's failure is reported does not depend on which job was quicker. A job that
conformed on fewer examples than its floor (a time budget cut it short) makes
the campaign inconclusive, however many examples the others ran.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

from kvspec.conformance.core.results import EXAMPLE_FLOOR, CampaignReport, Verdict, inconclusive_why
from kvspec.conformance.core.run_config import Configuration
from kvspec.conformance.runner.campaign import CampaignPlan
from kvspec.conformance.runner.isolation import Death

__all__ = ["decides", "job_plans", "merged"]


def job_plans(configuration: Configuration) -> list[CampaignPlan]:
    """The plan of each job: its share of the examples and its seeds (one job: all of them, on the run's seed).

    As many jobs as asked for, but no more than give each job at least the floor of examples.

    >>> from kvspec.conformance.core.run_config import RunConfig
    >>> (c,) = RunConfig(levels=("manager",), caching=(True,), max_examples=25, seed=10, jobs=3).configurations()
    >>> [(p.max_examples, p.seed, p.seed_stride) for p in job_plans(c)]
    [(13, 10, 2), (12, 11, 2)]
    >>> (c,) = RunConfig(levels=("pool",), caching=(False,), max_examples=10, jobs=10).configurations()
    >>> len(job_plans(c))
    1
    """
    run = configuration.run
    jobs = max(1, min(run.jobs, run.max_examples // EXAMPLE_FLOOR))
    shares = [run.max_examples // jobs + (1 if j < run.max_examples % jobs else 0) for j in range(jobs)]
    return [CampaignPlan(configuration, n, run.seed + j, seed_stride=jobs) for j, n in enumerate(shares)]


def decides(outcome: CampaignReport | Death) -> bool:
    """Whether a job's outcome decides the campaign's verdict: a death, or a report that does not conform."""
    return isinstance(outcome, Death) or outcome.verdict is not Verdict.CONFORMS


def merged(
    outcomes: Sequence[CampaignReport | Death | None], seconds: float, asked: Sequence[int] = ()
) -> CampaignReport | Death:
    """The campaign's report from its jobs' outcomes in job order (None: a job stopped); `seconds`: its wall time.

    One job's outcome is the campaign's as it is. `asked`: each job's share of the examples (its
    plan's max_examples); a job that conformed on fewer than its floor makes the campaign inconclusive.
    """
    finished = [o for o in outcomes if o is not None]
    assert finished, "the first job is never stopped"
    if len(outcomes) == 1:
        return finished[0]
    deciding = next((o for o in finished if decides(o)), None)
    if isinstance(deciding, Death):
        return deciding  # the parent rebuilds its trace from the steps it streamed
    reports = [o for o in finished if isinstance(o, CampaignReport)]
    first = deciding if deciding is not None else reports[0]
    deepest = max(reports, key=lambda r: r.deepest_score)
    messages = [first.message] if deciding is not None else list(dict.fromkeys(r.message for r in reports if r.message))
    verdict = first.verdict
    short = _short_job(outcomes, asked) if deciding is None else None
    if short is not None:
        verdict, messages = Verdict.INCONCLUSIVE, [short, *messages]
    return CampaignReport(
        verdict=verdict,
        message="; ".join(messages),
        examples=sum(r.examples for r in reports),
        steps=sum(r.steps for r in reports),
        coverage=_summed(r.coverage for r in reports),
        state_hashes=frozenset().union(*(r.state_hashes for r in reports)),
        invariants_checked=sum(r.invariants_checked for r in reports),
        seconds=seconds,
        not_exercised=tuple(sorted(set().union(*(r.not_exercised for r in reports)))),
        mistakes_checked=_summed(r.mistakes_checked for r in reports),
        reactions={k: v for r in reports for k, v in r.reactions.items()},
        not_expressed=_summed(r.not_expressed for r in reports),
        absent_ops=tuple(sorted(set().union(*(r.absent_ops for r in reports)))),
        extra_rounds=max(r.extra_rounds for r in reports),
        groups=first.groups,  # every job builds the same adapter: the same declaration
        declares_groups=first.declares_groups,
        group_kinds=first.group_kinds,
        failure=first.failure,
        trace=first.trace,
        deepest=deepest.deepest,
        deepest_score=deepest.deepest_score,
    )


def _short_job(outcomes: Sequence[CampaignReport | Death | None], asked: Sequence[int]) -> str | None:
    """Why one job's work is below its floor (the first such job), or None: a floor holds per job too."""
    for j, (outcome, n) in enumerate(zip(outcomes, asked)):
        if isinstance(outcome, CampaignReport):
            why = inconclusive_why(outcome.examples, outcome.steps, n)
            if why is not None:
                return f"job {j + 1} of {len(outcomes)}: {why}"
    return None


def _summed(counts: Iterable[Mapping[str, int]]) -> dict[str, int]:
    total: Counter[str] = Counter()
    for c in counts:
        total.update(c)
    return dict(total)
