"""The run's record: one frozen RunConfig, checked when made, and every refusal one line through the CLI.

Each refusal through `kvspec check` or `kvspec replay` exits 2 with one line
on stderr naming the flag, the value and the limit, and creates nothing (no
trace folder, no report) in the folder it ran in.
"""

from __future__ import annotations

import dataclasses

import pytest

from kvspec.conformance.core.adapter import AdapterConfig
from kvspec.conformance.core.run_config import LIMITS, ConfigError, RunConfig, adapter_config
from kvspec.conformance.runner.run import run_check
from kvspec.conformance.targets.builtin import make_reference
from kvspec.conformance.tools.cli import main

# --- the record ------------------------------------------------------------------------------------


def test_the_defaults_make_a_valid_record_and_the_configurations_come_in_order():
    run = RunConfig(impls=("reference", "spec"))
    assert (run.max_examples, run.steps, run.cover_rounds, run.jobs, run.step_timeout_s) == (100, 50, 6, 1, 10.0)
    assert [(c.impl, c.level, c.enable_caching) for c in run.configurations()] == [
        (impl, level, caching)
        for impl in ("reference", "spec")
        for level in ("pool", "manager")
        for caching in (True, False)
    ]
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.jobs = 2  # type: ignore[misc]


def test_groups_are_normalized_once_and_the_pool_level_has_one_full_group():
    run = RunConfig(groups="full, sliding:8", caching=(True,))
    assert run.groups == "full,sliding:8"
    pool, manager = run.configurations()
    assert (pool.groups, manager.groups) == ("full", "full,sliding:8")


def test_the_adapter_config_is_the_records_view():
    run = RunConfig(levels=("manager",), caching=(False,), profile="lfu", device="cpu", groups="drawn", events=True)
    (c,) = run.configurations()
    assert adapter_config(c, 9, 2) == AdapterConfig(
        "manager", 9, False, "lfu", block_size=2, device="cpu", groups="full", events=True
    )
    assert adapter_config(c, 9, 2, "full,sliding:4", ("sha256", "s")).groups == "full,sliding:4"
    assert adapter_config(c, 9, 2, hashing=("sha256", "s")).hash_fn == "sha256"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"jobs": 0}, "jobs must be a positive integer; got jobs=0"),
        ({"jobs": 65}, "jobs must be at most 64 (each job is a forked process; one per core is fastest); got jobs=65"),
        ({"max_examples": 10**9 + 1}, "max_examples must be at most 1000000000 "),
        ({"steps": 10_001}, "steps must be at most 10000 "),
        ({"seed": -1}, "seed must be a non-negative integer; got seed=-1"),
        ({"time_budget_s": float("nan")}, "time_budget_s must be a finite number of seconds, or None; got"),
        ({"step_timeout_s": 10**7}, "step_timeout_s must be at most 604800 seconds (a week); got"),
        ({"levels": ("request",)}, "level must be 'pool' or 'manager'; got level='request'"),
        ({"caching": (1,)}, "caching must be a non-empty tuple of True and False; got caching=(1,)"),
        ({"events": "yes"}, "events must be True or False; got events='yes'"),
        ({"trace_dir": "traces"}, "trace_dir must be a Path or None; got trace_dir='traces'"),
        ({"database": "db"}, "database must be a Hypothesis ExampleDatabase or None; got database='db'"),
        ({"levels": ("pool",), "groups": "full,sliding:8"}, "groups='full,sliding:8' does nothing at the pool level"),
    ],
)
def test_the_record_refuses_a_bad_field_in_one_line(fields, message):
    with pytest.raises(ConfigError) as caught:
        RunConfig(**fields)
    assert str(caught.value).startswith(message) and "\n" not in str(caught.value)
    assert caught.value.name in RunConfig.__dataclass_fields__


def test_every_limit_admits_its_bounds():
    for name, limit in LIMITS.items():
        RunConfig(**{name: limit.least})
        if limit.most is not None:
            RunConfig(**{name: limit.most})


def test_run_check_returns_a_refused_record_as_could_not_run(tmp_path):
    r = run_check(make_reference, jobs=65, trace_dir=tmp_path)
    assert r.verdict == "could-not-run" and r.message.startswith("jobs must be at most 64")
    r = run_check(make_reference, level="pool", groups="full,sliding:8", trace_dir=tmp_path)
    assert r.verdict == "could-not-run" and "does nothing at the pool level" in r.message
    r = run_check(make_reference, profile="auto", trace_dir=tmp_path)
    assert r.verdict == "could-not-run" and r.message.startswith("profile='auto' names no one profile")
    assert list(tmp_path.iterdir()) == []


# --- through the command line: one line, exit 2, nothing created ---------------------------------------

CLI_REFUSALS = [
    (["check", "--jobs", "65"], "kvspec check: --jobs: must be at most 64 (each job is a forked process; one per core "
     "is fastest); got 65"),
    (["check", "--max-examples", "1000000001"], "kvspec check: --max-examples: must be at most 1000000000 "),
    (["check", "--steps", "10001"], "kvspec check: --steps: must be at most 10000 "),
    (["check", "--cover-rounds", "1000001"], "kvspec check: --cover-rounds: must be at most 1000000 "),
    (["check", "--time-budget", "1e9"], "kvspec check: --time-budget: must be at most 604800 seconds (a week); "
     "got 1e+09"),
    (["check", "--step-timeout", "0"], "kvspec check: --step-timeout: must be at least 0.1 seconds"),
    (["check", "--step-timeout", "1e-9"], "kvspec check: --step-timeout: must be at least 0.1 seconds"),
    (["check", "--build-timeout", "0.01"], "kvspec check: --build-timeout: must be at least 0.1 seconds"),
    (["check", "--groups", "sliding:353"], "kvspec check: --groups: KV cache group 'sliding:353': a window or chunk "
     "of at most 352 tokens"),
    (["check", "--groups", "full,chunked:99999999999999999999"], "kvspec check: --groups: KV cache group "
     "'chunked:99999999999999999999': a window or chunk of at most 352 tokens"),
    (["check", "--device", "cuda:99"], "kvspec check: --device: device='cuda:99' but this machine has "),
    (["check", "--level", "pool", "--groups", "full,sliding:8"],
     "kvspec check: --groups: full,sliding:8 does nothing at the pool level"),
    (["check", "--groups", "sliding:0"], "kvspec check: --groups: "),
    (["replay", "missing.trace.jsonl", "--device", "cuda:99"], "kvspec replay: --device: device='cuda:99' but "),
]  # fmt: skip


@pytest.mark.parametrize(("args", "line"), CLI_REFUSALS, ids=lambda a: " ".join(a) if isinstance(a, list) else "")
def test_a_refused_flag_is_one_line_exit_2_and_nothing_created(args, line, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main([*args, "--impl", "reference"] if args[0] == "check" else args) == 2
    out, err = capsys.readouterr()
    assert err.startswith(line) and err.count("\n") == 1, err
    assert "Traceback" not in out + err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.heavy
def test_a_device_this_machine_has_is_taken(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code = main(["check", "--impl", "reference", "--level", "pool", "--caching", "on", "--max-examples", "100",
                 "--device", "cpu"])  # fmt: skip
    assert code == 0, capsys.readouterr()
