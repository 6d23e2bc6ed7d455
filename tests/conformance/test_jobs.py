"""A campaign shared among jobs is its jobs' campaigns added up, and its verdict is the first job's in order to fail.

Real campaigns in real forked children (kvspec.conformance.runner.jobs): two jobs
are compared with the one-job campaigns on their seeds, parallel jobs with
the same jobs run in turn, and the stopping rule with children that sleep.
"""

import json
import time

import pytest

from kvspec.conformance.core.results import CampaignReport, Failure, FailureKind, Verdict
from kvspec.conformance.core.trace import read_trace
from kvspec.conformance.runner.isolation import Death, run_isolated_jobs
from kvspec.conformance.runner.jobs import decides, merged
from kvspec.conformance.runner.run import replay, run_check
from kvspec.conformance.targets.builtin import make_reference
from kvspec.conformance.tools.cli import main
from tests.conformance import adapters


def test_two_jobs_are_the_one_job_campaigns_on_their_seeds_added_up(tmp_path):
    # Without extra rounds (each job's would run on its own seeds), 20 examples of the request level leave
    # branches unreached: inconclusive, for the two jobs as for the two one-job campaigns, the work added up.
    def check(n: int, seed: int, jobs: int = 1):
        return run_check(make_reference, level="manager", max_examples=n, seed=seed, jobs=jobs, trace_dir=tmp_path,
                         cover_rounds=0)  # fmt: skip

    both, first, second = check(20, 3, jobs=2), check(10, 3), check(10, 4)
    assert both.verdict == first.verdict == second.verdict == "inconclusive" and "not reached" in both.message
    assert both.jobs == 2 and first.jobs == 1
    assert set(both.unreached) == set(first.unreached) & set(second.unreached)
    assert both.examples_run == first.examples_run + second.examples_run
    assert both.steps_run == first.steps_run + second.steps_run
    assert both.invariants_checked == first.invariants_checked + second.invariants_checked
    assert both.coverage == {b: first.coverage[b] + second.coverage[b] for b in both.coverage}
    # The distinct states are the union of the two jobs' sets: shared states are counted once.
    assert max(first.states_reached, second.states_reached) <= both.states_reached
    assert both.states_reached <= first.states_reached + second.states_reached


@pytest.mark.heavy
def test_jobs_run_at_once_give_what_the_same_jobs_give_in_turn(tmp_path):
    at_once = run_check(make_reference, level="manager", groups="full,sliding:8", max_examples=16, jobs=2,
                        trace_dir=tmp_path)  # fmt: skip
    in_turn = run_check(make_reference, level="manager", groups="full,sliding:8", max_examples=16, jobs=2,
                        isolate=False, trace_dir=tmp_path)  # fmt: skip
    assert at_once.verdict == in_turn.verdict == "conforms"
    assert (at_once.examples_run, at_once.steps_run, at_once.states_reached, at_once.coverage) == (
        in_turn.examples_run, in_turn.steps_run, in_turn.states_reached, in_turn.coverage
    )  # fmt: skip


def test_the_same_seed_and_jobs_give_the_same_failure(tmp_path):
    a = run_check(adapters.make_drifting_hashes, level="pool", seed=5, jobs=2, max_examples=150, trace_dir=tmp_path)
    b = run_check(adapters.make_drifting_hashes, level="pool", seed=5, jobs=2, max_examples=150, trace_dir=tmp_path)
    assert a.verdict == b.verdict == "diverges"
    assert read_trace(a.failure.trace_path).steps == read_trace(b.failure.trace_path).steps
    assert replay(a.failure.trace_path, adapters.make_drifting_hashes).verdict == "diverges"


def test_a_job_that_dies_is_reported_with_the_trace_rebuilt_from_its_steps(tmp_path):
    r = run_check(adapters.make_segfault_on_touch, level="pool", jobs=2, max_examples=100, minimize_s=10,
                  trace_dir=tmp_path)  # fmt: skip
    assert r.verdict == "crashed" and r.failure.op == "touch" and "SIGSEGV" in r.failure.message
    assert replay(r.failure.trace_path, adapters.make_segfault_on_touch).verdict == "crashed"


def test_a_hang_in_c_in_one_of_two_jobs_is_killed_by_the_parent(tmp_path):
    r = run_check(adapters.make_hang_in_c, level="pool", jobs=2, step_timeout_s=0.3, minimize_s=0, trace_dir=tmp_path)
    assert r.verdict == "hung" and r.failure.op == "reset_prefix_cache" and "killed" in r.failure.message


def _report(verdict: Verdict, examples: int, states: frozenset[int] = frozenset(), name: str = "") -> CampaignReport:
    failure = None if verdict is Verdict.CONFORMS else Failure(FailureKind.DIVERGES, 1, name, "differs")
    return CampaignReport(verdict, examples=examples, steps=2 * examples, coverage={"hit": examples},
                          state_hashes=states, failure=failure)  # fmt: skip


def _sleep_then(seconds: float, report: CampaignReport):
    def work(stream_fd, heartbeat):
        time.sleep(seconds)
        return report

    return work


def test_a_deciding_job_stops_the_jobs_after_it_and_waits_for_those_before():
    jobs = [
        _sleep_then(1.0, _report(Verdict.CONFORMS, 3)),
        _sleep_then(0.0, _report(Verdict.DIVERGES, 2, name="second")),
        _sleep_then(60.0, _report(Verdict.CONFORMS, 5)),
    ]
    started = time.monotonic()
    outcomes = run_isolated_jobs(jobs, step_timeout_s=None, isolate=True, stops_later_jobs=decides)
    assert time.monotonic() - started < 30  # the third job was killed, not waited for
    assert [o.examples if o is not None else None for o in outcomes] == [3, 2, None]
    # In turn, in this process: the same outcomes (the third job never starts).
    in_turn = run_isolated_jobs(jobs[:2], step_timeout_s=None, isolate=False, stops_later_jobs=decides)
    assert [o.examples for o in in_turn] == [3, 2]


def test_the_first_job_in_order_that_does_not_conform_decides_and_the_counts_add_up():
    reports = [
        _report(Verdict.CONFORMS, 3, frozenset({1, 2})),
        _report(Verdict.DIVERGES, 2, frozenset({2, 3}), name="second"),
        _report(Verdict.DIVERGES, 4, frozenset({4}), name="third"),
    ]
    r = merged(reports, seconds=1.5)
    assert r.verdict is Verdict.DIVERGES and r.failure.op == "second"
    assert (r.examples, r.steps, r.coverage, r.states, r.seconds) == (9, 18, {"hit": 9}, 4, 1.5)
    assert merged([reports[0], None], seconds=1.0).verdict is Verdict.CONFORMS
    death = Death(hung=False, exitcode=-11)
    assert merged([reports[0], death, reports[1]], seconds=1.0) is death
    assert merged([reports[1]], seconds=9.0) is reports[1]  # one job: its report as it is


def test_jobs_must_be_a_positive_integer(tmp_path, capsys):
    for bad in (0, -1, 1.5, True, "2"):
        r = run_check(make_reference, jobs=bad, trace_dir=tmp_path)
        assert r.verdict == "could-not-run" and f"jobs must be a positive integer; got jobs={bad!r}" in r.message
    assert main(["check", "--impl", "reference", "--jobs", "0"]) == 2
    assert "--jobs: must be at least 1; got 0" in capsys.readouterr().err


def test_check_shares_each_campaign_among_the_jobs_asked_for(capsys, tmp_path):
    code = main(["check", "--impl", "reference", "--level", "pool", "--caching", "on", "--jobs", "2",
                 "--max-examples", "100", "--json", "-", "--trace-dir", str(tmp_path)])  # fmt: skip
    out = capsys.readouterr().out
    document = json.loads(out[out.index("{") :])
    assert code == 0 and document["results"][0]["jobs"] == 2 and document["results"][0]["verdict"] == "conforms"


@pytest.mark.parametrize(("examples", "jobs"), [(1, 1), (2, 1), (19, 1), (20, 2), (45, 4)])
def test_no_more_jobs_than_give_each_its_floor_of_examples(tmp_path, examples, jobs):
    r = run_check(make_reference, level="pool", max_examples=examples, jobs=4, trace_dir=tmp_path, cover_rounds=0)
    assert r.jobs == jobs and r.examples_run >= examples


def test_a_job_short_of_its_floor_makes_the_campaign_inconclusive():
    # Two jobs asked 10 examples each: one conformed on 10, the other a time budget cut at 3.
    outcomes = [_report(Verdict.CONFORMS, 10), _report(Verdict.CONFORMS, 3)]
    r = merged(outcomes, 1.0, [10, 10])
    assert r.verdict is Verdict.INCONCLUSIVE and r.examples == 13
    assert r.message.startswith("job 2 of 2: 3 examples ran, fewer than the floor of 10")
    assert merged([_report(Verdict.CONFORMS, 10), _report(Verdict.CONFORMS, 10)], 1.0, [10, 10]).verdict == "conforms"
