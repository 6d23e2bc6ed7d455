"""The harness kills every mutant, and the mutant runner and `kvspec mutants` report it.

Two sweeps over the same machine:

- the default suite runs each mutant through the conformance state machine
  in this process with a fixed seed and without shrinking: it asserts the
  kill, on every run, in about a second per mutant (shrinking, not finding,
  is what takes the runner's time);
- the `slow` sweep runs each mutant through `run_check`, the full runner
  (child process, shrinking, trace file), and asserts that the shrunk story
  is short; then again under other seeds.

The unmutated bases some mutants are built on are checked too: a kill must
come from the mutant's one change.
"""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import seed as hypothesis_seed
from hypothesis.stateful import run_state_machine_as_test

from kvspec.conformance.core.adapter import AdapterConfig, BlockManagerAdapter, KVCacheManagerAdapter
from kvspec.conformance.core.lockstep import ConformanceFailure, StepTimeout, StepWatch
from kvspec.conformance.core.machine import conformance_machine
from kvspec.conformance.runner.run import replay, run_check
from kvspec.conformance.targets.builtin import make_reference
from kvspec.conformance.tools.cli import main
from kvspec.conformance.tools.mutants import (
    KILLING_VERDICTS,
    MEDIAN_TRACE_TARGET,
    Mutant,
    factory_name,
    run_control,
    run_mutants,
    summarize,
)
from kvspec.mutants import REQUIRED_KINDS, all_mutants
from kvspec.mutants._base import ListQueuePool

MUTANTS = all_mutants()
# The default sweep's example budget: a kill usually comes within a few dozen
# examples; the budget is what a mutant that is hard to reach may use.
FAST_EXAMPLES = 300
# A shrunk counterexample longer than this is not a story a person reads: the
# machine is then too weak at reaching the bug directly.
MAX_SHRUNK_STEPS = 16


def _first_failure(
    factory,
    level: str,
    enable_caching: bool,
    max_examples: int,
    seed: int = 0,
    profile: str = "vllm-v1",
    groups: str = "full",
    events: bool = False,
) -> str | None:
    """Run the conformance machine in this process, unshrunk; what it caught first, or None."""
    watch = StepWatch(step_timeout_s=10.0)
    machine = conformance_machine(factory, level, enable_caching, profile, watch=watch, groups=groups, events=events)
    hypothesis_seed(seed)(machine)
    undo = watch.install_alarm()
    try:
        run_state_machine_as_test(
            machine,
            settings=settings(
                max_examples=max_examples,
                deadline=None,
                database=None,
                phases=[Phase.explicit, Phase.generate],
                suppress_health_check=list(HealthCheck),
                report_multiple_bugs=False,
            ),
        )
    except ConformanceFailure as e:
        return f"{e.failure.kind}: {e}"
    except StepTimeout:
        return "hung"
    finally:
        undo()
    return None


def test_the_mutant_set_covers_every_required_kind():
    kinds = {m.kind for m in MUTANTS}
    assert not set(REQUIRED_KINDS) - kinds, f"no mutant of kind {sorted(set(REQUIRED_KINDS) - kinds)}"
    assert len(MUTANTS) >= len(REQUIRED_KINDS)


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_every_mutant_builds_an_adapter_of_its_level(mutant: Mutant):
    adapter = mutant.factory(AdapterConfig(mutant.level, 8, mutant.enable_caching, mutant.profile))
    protocol = BlockManagerAdapter if mutant.level == "pool" else KVCacheManagerAdapter
    assert isinstance(adapter, protocol)


def test_mutant_rejects_a_malformed_declaration():
    with pytest.raises(ValueError, match=r"^mutant x: level must be 'pool' or 'manager'; got level='device'$"):
        Mutant("x", "bad level", "device", make_reference, "none")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^a mutant name is snake_case"):
        Mutant("Not A Name", "bad name", "pool", make_reference, "none")


@pytest.mark.parametrize(
    ("factory", "level", "enable_caching"),
    [(ListQueuePool, "pool", True), (ListQueuePool, "pool", False)],
    ids=["list-queue-pool", "list-queue-pool-no-caching"],
)
def test_unmutated_bases_conform(factory, level, enable_caching):
    assert _first_failure(factory, level, enable_caching, max_examples=60) is None


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_the_harness_kills_the_mutant(mutant: Mutant):
    caught = _first_failure(
        mutant.factory, mutant.level, mutant.enable_caching, FAST_EXAMPLES, 0, mutant.profile, mutant.groups,
        mutant.events,
    )  # fmt: skip
    assert caught is not None, f"{mutant.name} survived {FAST_EXAMPLES} examples: {mutant.description}"


@pytest.mark.slow
@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_the_runner_kills_the_mutant_with_a_short_story(mutant: Mutant, tmp_path):
    result = run_check(
        mutant.factory,
        level=mutant.level,
        enable_caching=mutant.enable_caching,
        profile=mutant.profile,
        max_examples=200,
        seed=0,
        time_budget_s=60.0,
        trace_dir=tmp_path,
        groups=mutant.groups,
        events=mutant.events,
    )
    assert result.verdict in KILLING_VERDICTS, f"{mutant.name} survived: {result.message}"
    assert result.failure is not None and result.failure.trace_path is not None
    assert result.failure.num_steps <= MAX_SHRUNK_STEPS, result.failure.story


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_the_harness_kills_the_mutant_under_other_seeds(mutant: Mutant, seed: int):
    caught = _first_failure(
        mutant.factory, mutant.level, mutant.enable_caching, FAST_EXAMPLES, seed, mutant.profile, mutant.groups,
        mutant.events,
    )  # fmt: skip
    assert caught is not None, f"{mutant.name} survived {FAST_EXAMPLES} examples with seed={seed}"


def test_run_mutants_reports_kills_and_a_survivor(tmp_path):
    killed = next(m for m in MUTANTS if m.name == "allocate_from_right")
    # The reference itself, declared as a mutant: it must survive, or "killed" would be the only answer.
    survivor = Mutant("unchanged_reference", "the reference, unchanged", "pool", make_reference, "none")
    seen: list[str] = []
    results = run_mutants(
        [killed, survivor], max_examples=100, seed=0, trace_dir=tmp_path, on_result=lambda r: seen.append(r.name)
    )
    assert seen == ["allocate_from_right", "unchanged_reference"]
    first, second = results
    assert first.killed and first.seconds_to_kill is not None and first.shrunk_steps is not None
    assert first.verdict in KILLING_VERDICTS and first.failure_kind
    assert not second.killed and second.seconds_to_kill is None and second.shrunk_steps is None
    assert second.verdict == "conforms" and re.match(r"survived \d+ examples \(\d+ steps\) in ", second.message)
    # The saved trace names a loadable factory: `kvspec replay` gives the same verdict.
    assert first.trace_path is not None and first.trace_path.startswith(str(tmp_path / "allocate_from_right"))
    again = replay(first.trace_path, factory_name(killed))
    assert again.verdict == first.verdict
    summary = summarize(results)
    assert (summary.num_mutants, summary.num_killed, summary.survivors) == (2, 1, ("unchanged_reference",))
    assert not summary.all_killed_within_target
    assert summary.median_shrunk_steps == first.shrunk_steps
    assert summary.median_within_target == (first.shrunk_steps <= MEDIAN_TRACE_TARGET)


@pytest.mark.heavy
def test_the_control_runs_the_reference_under_each_configuration_the_mutants_use():
    chosen = [m for m in MUTANTS if m.name in ("allocate_from_right", "unhashed_freed_to_right", "free_head_first")]
    controls = run_control(chosen, max_examples=100, seed=0)
    assert [(c.level, c.enable_caching) for c in controls] == [("pool", True), ("pool", False), ("manager", True)]
    assert all(c.verdict == "conforms" for c in controls)
    # a policy mutant's control runs under the profile it claims
    policy = [m for m in MUTANTS if m.profile != "vllm-v1"][:1]
    assert policy, "no policy mutant"
    (control,) = run_control(policy, max_examples=100, seed=0)
    assert control.profile == policy[0].profile and control.verdict == "conforms"


def test_cli_prints_the_table_and_the_benchmark(capsys):
    code = main(
        ["mutants", "--only", "null_block_queued", "--only", "num_free_counts_null_block", "--max-examples", "100"]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    control = r"^control: reference at pool level, caching on, profile vllm-v1: conforms \(\d+ examples"
    assert re.search(control, out, re.M)
    assert re.search(r"^null_block_queued +pool +killed +\d+\.\d\d +0  invariant: ", out, re.M), out
    assert re.search(r"^num_free_counts_null_block +pool +killed +\d+\.\d\d +1  diverges: ", out, re.M), out
    assert "killed 2 of 2 mutants" in out
    assert re.search(r"^benchmark: every mutant killed within 60 s: yes \(slowest kill: ", out, re.M)
    assert "benchmark: median shrunk trace 0.5 steps (target <= 8): yes" in out


def test_cli_json_output(capsys):
    code = main(["mutants", "--only", "double_free_ignored", "--max-examples", "100", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0
    [row] = report["mutants"]
    assert row["name"] == "double_free_ignored" and row["killed"] and row["level"] == "pool"
    assert report["summary"]["num_killed"] == 1


def test_cli_refuses_an_unknown_mutant(capsys):
    assert main(["mutants", "--only", "no_such_mutant"]) == 2
    assert "unknown mutant no_such_mutant; known:" in capsys.readouterr().err


def test_cli_lists_the_mutants(capsys):
    assert main(["mutants", "--list"]) == 0
    out = capsys.readouterr().out
    assert all(m.name in out for m in MUTANTS)
