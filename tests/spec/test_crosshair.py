"""CrossHair on the spec's contracts: every planted wrong operation is caught, the spec is not.

Each bug in crosshair_bugs.py carries the contracts of the spec operation it
imitates; the search of the postcondition it breaks must find a
counterexample, and the same search, with the same inputs, finds none in the
spec operation itself. A run that finds nothing means something only because
the same run finds these. The full, unhinted searches are behind `slow`.
"""

from __future__ import annotations

import json

import pytest

from kvspec.conformance.tools import contracts
from kvspec.conformance.tools.cli import main
from kvspec.spec import manager as spec_manager
from kvspec.spec import ops
from tests.spec.crosshair_bugs import BUGS, Bug

pytestmark = [
    pytest.mark.crosshair,
    pytest.mark.timeout(240),
    # CrossHair walks the members of `typing` while it builds inputs, touching its deprecated aliases, and
    # `inspect` meets torch's deprecated `torch.distributed.reduce_op` while it walks the loaded modules.
    pytest.mark.filterwarnings(r"ignore:typing\.(io|re) is deprecated:DeprecationWarning"),
    pytest.mark.filterwarnings(r"ignore:`torch\.distributed\.reduce_op` is deprecated:FutureWarning"),
]

# A planted bug must be found within FIND_PATHS paths (the most any needs is 62, CrossHair 0.0.114;
# its path order is seeded, so that count is the same on every machine). FIND_BUDGET_S only stops a
# search that runs away: a machine several times slower than the ones measured still reaches FIND_PATHS.
FIND_PATHS = 600
FIND_BUDGET_S = 120.0
# The same search on the spec operation explores SPEC_PATHS paths (or all there are): more than any
# planted bug needs, and in paths, not seconds, so that a busy machine searches the same inputs.
SPEC_PATHS = 64
# The short search of every contract is budgeted in paths, for the same reason: in seconds (0.3 s
# a condition, once) a busy machine explored 2 paths of get_computed_blocks, neither past its
# preconditions. Each condition's second path gets past them here (measured: every condition's
# first path does not); SURVEY_PATHS gives that a wide margin, ~15 s in all on the machines measured.
SURVEY_PATHS = 10
SURVEY_RUNAWAY_S = 30.0


@pytest.mark.parametrize("bug", BUGS, ids=lambda b: b.name)
def test_crosshair_catches_planted_bug(bug: Bug):
    report = contracts.check_function(
        bug.fn, FIND_BUDGET_S, condition=bug.caught_by, stop_at_first=True, max_paths=FIND_PATHS
    )
    assert report.conditions, f"no postcondition of {bug.spec_fn.__name__} contains {bug.caught_by!r}"
    assert not report.ok, f"{bug.name}: {report.summary} after {report.num_paths} paths"
    assert report.num_paths <= FIND_PATHS
    (found,) = report.failures
    assert found.status in ("post_fail", "post_err", "exec_err") and "when calling" in found.message


@pytest.mark.parametrize("bug", BUGS, ids=lambda b: b.spec_fn.__name__ + "-" + b.name)
def test_same_search_finds_nothing_in_the_spec_operation(bug: Bug):
    report = contracts.check_function(bug.spec_fn, FIND_BUDGET_S, condition=bug.caught_by, max_paths=SPEC_PATHS)
    assert report.conditions and report.ok, report.summary
    assert all(c.num_paths == SPEC_PATHS or c.exhausted for c in report.conditions)
    assert report.summary.startswith("no counterexample found within budget")
    assert "verified" not in report.summary


@pytest.mark.heavy
def test_every_spec_function_is_searched_and_nothing_is_found():
    """A short search of every contract in the spec: each one runs paths, none fails."""
    report = contracts.check_modules(
        per_condition_timeout=SURVEY_RUNAWAY_S, per_path_timeout=SURVEY_RUNAWAY_S, max_paths=SURVEY_PATHS
    )
    assert len(report.functions) == len(contracts.contract_functions())
    for f in report.functions:
        assert f.conditions and all(c.num_paths == SURVEY_PATHS for c in f.conditions), f.name
        assert f.ok, f"{f.name}: {f.summary}"  # every condition searched, none with a counterexample
    assert report.ok and not report.could_not_run


def test_a_search_that_meets_no_precondition_says_so_and_is_no_verdict(capsys):
    """A budget too small for any input to pass the preconditions searched nothing: exit 2, never ok, never found."""
    code = main(["contracts", "--function", "get_computed_blocks", "--per-condition-timeout", "1e-6"])
    out = capsys.readouterr().out
    assert code == 2
    assert "NOT SEARCHED" in out and "no generated input met the preconditions" in out
    assert "no counterexample found" not in out and "COUNTEREXAMPLE" not in out
    report = contracts.check_function(spec_manager.get_computed_blocks, 1e-6)
    assert report.conditions and not report.ok and not report.failures
    assert {c.status for c in report.not_searched} == {contracts.SEARCHED_NOTHING}


def test_every_spec_operation_has_a_postcondition():
    names = {f.__name__ for f in contracts.contract_functions()}
    for op in ops.__all__:
        fn = getattr(ops, op)
        assert getattr(fn, "__postconditions__", None), f"spec.ops.{op} has no postcondition"
        assert op in names
    assert {"get_computed_blocks", "allocate_slots", "free", "place_freed"} <= names


def test_declared_errors_are_readable_by_crosshair():
    from crosshair.condition_parser import parse_sphinx_raises

    from kvspec.spec.errors import DoubleFree, InvalidBlock, InvalidRequest

    assert parse_sphinx_raises(ops.free_blocks) == {InvalidBlock, InvalidRequest, DoubleFree}
    for bug in BUGS:  # the bugs declare what their spec operation declares
        assert parse_sphinx_raises(bug.fn) == parse_sphinx_raises(bug.spec_fn), bug.name


def test_state_corpora_are_reachable_and_varied():
    from kvspec.spec.invariants import all_hold

    pools = contracts.pool_state_corpus()
    assert all(all_hold(st.snapshot()) for st in pools)
    assert any(st.free_queue and st.block_hash[st.free_queue[0]] is not None for st in pools)
    assert any(max(st.ref_cnt) > 1 for st in pools)
    assert any(not st.config.enable_caching for st in pools)
    assert {st.config.profile for st in pools} == set(contracts.CORPUS_PROFILES)  # the keyed policies too
    managers = contracts.manager_state_corpus()
    assert all(all_hold(m.snapshot()) for m in managers)
    assert any(m.requests for m in managers) and any(not m.requests for m in managers)


def test_contracts_cli_json_on_one_function(capsys):
    assert main(["contracts", "--function", "get_usage", "--max-paths", "5", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    (fn,) = data["functions"]
    assert fn["function"] == "kvspec.spec.ops.get_usage" and fn["ok"] is True
    assert fn["result"].startswith("no counterexample found within budget")
    assert data["max_paths"] == 5 and [c["paths"] for c in fn["conditions"]] == [5] * len(fn["conditions"])
    assert main(["contracts", "--function", "no_such_op"]) == 2
    assert main(["contracts", "--max-paths", "0"]) == 2
    assert "--max-paths" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("bug", BUGS, ids=lambda b: b.name)
def test_full_search_catches_planted_bug(bug: Bug):
    report = contracts.check_function(bug.fn, 15.0, stop_at_first=True)
    assert not report.ok, f"{bug.name}: {report.summary}"


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_full_search_finds_nothing_in_the_spec():
    report = contracts.check_modules(per_condition_timeout=5.0)
    assert report.ok, [f.summary for f in report.functions if not f.ok]
