"""`kvspec check` and `kvspec replay` as a CI job runs them: the summary, the exit codes, JUnit XML."""

import dataclasses
import json
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from kvspec.conformance.core.trace import read_trace
from kvspec.conformance.targets.builtin import make_reference
from kvspec.conformance.tools.cli import main
from kvspec.conformance.tools.commands.check import _default_impls

ADAPTERS = "tests.conformance.adapters"


def test_check_on_the_reference_prints_one_screen_and_exits_0(tmp_path, capsys):
    junit = tmp_path / "out.xml"
    code = main(
        [
            "check",
            "--impl",
            "reference",
            "--level",
            "pool",
            "--caching",
            "on",
            "--max-examples",
            "100",
            "--junit",
            str(junit),
            "--trace-dir",
            str(tmp_path),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    lines = out.splitlines()
    assert lines[0] == "kvspec check: profile vllm-v1, seed 0, 100 examples x up to 50 steps per configuration"
    assert lines[1].split() == [
        "implementation",
        "level",
        "caching",
        "verdict",
        "examples",
        "steps",
        "steps/s",
        "states",
        "invariants",
        "branches",
    ]
    assert lines[2].split()[:4] == ["reference", "pool", "on", "conforms"]
    assert any(line.startswith("total: 1 configurations,") and "steps/s" in line for line in lines)
    assert any(line.startswith("reached: cached blocks evicted") for line in lines)
    assert lines[-2] == "result: 1 conforms (exit 0)"
    suite = ET.parse(junit).getroot()
    assert (suite.get("tests"), suite.get("failures"), suite.get("errors")) == ("1", "0", "0")
    assert suite.find("testsuite/testcase").get("name") == "pool-caching-on-vllm-v1"


def test_check_on_a_diverging_implementation_exits_1_with_story_trace_and_junit_failure(tmp_path, capsys):
    junit = tmp_path / "out.xml"
    impl = f"{ADAPTERS}:make_free_head_first"
    code = main(
        [
            "check",
            "--impl",
            impl,
            "--level",
            "pool",
            "--caching",
            "on",
            "--max-examples",
            "100",
            "--junit",
            str(junit),
            "--trace-dir",
            str(tmp_path),
        ]
    )
    out = capsys.readouterr().out
    assert code == 1, out
    assert "DIVERGES: diverges at step 2 of 2 (free_blocks)" in out
    traces = list(tmp_path.glob("failure-pool-*.trace.jsonl"))
    assert len(traces) == 1
    failure = ET.parse(junit).getroot().find("testsuite/testcase/failure")
    assert failure.get("type") == "diverges" and "free_queue" in failure.get("message")
    # The trace replays to the same verdict on the same implementation, and conforms on the reference.
    assert main(["replay", str(traces[0]), "--impl", impl]) == 1
    out = capsys.readouterr().out
    assert "verdict: diverges (same as recorded)" in out
    assert main(["replay", str(traces[0]), "--impl", "reference"]) == 0
    assert "verdict: conforms (recorded: diverges)" in capsys.readouterr().out


def test_check_on_a_segfaulting_implementation_exits_1_with_its_trace(tmp_path, capsys):
    impl = f"{ADAPTERS}:make_segfault_on_touch"
    code = main(
        [
            "check",
            "--impl",
            impl,
            "--level",
            "pool",
            "--caching",
            "on",
            "--max-examples",
            "100",
            "--trace-dir",
            str(tmp_path),
        ]
    )
    out = capsys.readouterr().out
    assert code == 1, out  # the implementation is wrong (it crashed): exit 1, not "could not run"
    assert "crashed" in out and "SIGSEGV" in out
    (trace,) = tmp_path.glob("crashed-pool-*.trace.jsonl")
    steps = read_trace(trace).steps
    assert steps[-1].op == "touch" and steps[-1].impl.crashed
    assert len(steps) <= 3  # cut down by replaying shorter traces in fresh processes
    assert main(["replay", str(trace), "--impl", impl]) == 1
    assert "verdict: crashed (same as recorded)" in capsys.readouterr().out


def test_check_with_an_implementation_that_cannot_be_loaded_exits_2(tmp_path, capsys):
    junit = tmp_path / "out.xml"
    code = main(
        [
            "check",
            "--impl",
            "no_such_package.pool:make",
            "--level",
            "pool",
            "--caching",
            "on",
            "--junit",
            str(junit),
            "--trace-dir",
            str(tmp_path),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2
    # Said once, before any configuration runs, and nothing is written: no verdict was reached.
    assert err.count("module no_such_package.pool does not import") == 1
    assert not junit.exists()


def test_check_with_bad_arguments_exits_2(capsys):
    assert main(["check", "--profile", "lfu-maybe"]) == 2
    assert "unknown profile 'lfu-maybe'" in capsys.readouterr().err
    assert main(["check", "--max-examples", "0"]) == 2
    assert main(["check", "--cover-rounds", "-1"]) == 2
    assert "--cover-rounds: must be at least 0; got -1" in capsys.readouterr().err
    assert main(["check", "--level", "rack"]) == 2  # argparse's own refusal


def test_default_implementations_skip_a_registered_one_whose_module_is_missing(register_target):
    # A distribution registers a target checked by default whose factory's module is not there.
    register_target(
        "later-pool",
        "later",
        "later_targets:LATER",
        "from kvspec.conformance import Target\n"
        "LATER = Target(name='later', summary='not written yet', factory='later_pool.adapter:make_adapter', "
        "default_order=4)\n",
    )
    chosen, notes = _default_impls(None)
    assert chosen[:2] == ["reference", "spec"] and "later" not in chosen
    assert notes == [
        "later: not checked (implementation 'later': module later_pool.adapter does not import "
        "(ModuleNotFoundError: No module named 'later_pool'))"
    ]


def test_replay_needs_an_implementation_when_the_trace_names_none(tmp_path, capsys):
    path = tmp_path / "t.trace.jsonl"
    path.write_text(
        '{"kvspec_trace": 1, "level": "pool", "config": {"num_gpu_blocks": 2, "enable_caching": true, '
        '"profile": "vllm-v1", "block_size": 4, "hash_fn": "sha256_cbor", "seed": "kvspec", "device": null}, '
        '"impl": null}\n{"step": 1, "op": "get_new_blocks", "args": [1]}\n'
    )
    assert main(["replay", str(path)]) == 2
    assert "the trace names no implementation" in capsys.readouterr().err
    assert main(["replay", str(path), "--impl", "spec"]) == 0


def v1_whatever_asked(config):
    """The reference pool, always under vllm-v1, whatever profile the harness asks for."""
    return make_reference(dataclasses.replace(config, profile="vllm-v1"))


@pytest.mark.heavy
def test_check_profile_auto_reports_each_profile_and_exits_0_when_one_conforms(tmp_path, capsys):
    code = main(
        ["check", "--impl", "tests.conformance.test_cli:v1_whatever_asked", "--level", "pool",
         "--caching", "on", "--profile", "auto", "--max-examples", "100", "--trace-dir", str(tmp_path)]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    assert "test_cli:v1_whatever_asked pool caching on: conforms to vllm-v1\n" in out
    assert any(line.split()[:2] == ["vllm-v1", "conforms"] for line in out.splitlines())
    tail = next(line for line in out.splitlines() if line.split()[:1] == ["vllm-v1-tail"])
    assert "diverges: shortest trace 2 steps" in tail
    trace = read_trace(next(tmp_path.glob("failure-pool-*.trace.jsonl")))
    assert trace.impl == "tests.conformance.test_cli:v1_whatever_asked"
    assert trace.config.profile == "vllm-v1-tail"


def test_check_profile_auto_exits_1_when_no_profile_conforms(tmp_path, capsys):
    code = main(
        ["check", "--impl", f"{ADAPTERS}:make_accepts_double_free", "--level", "pool", "--caching", "on",
         "--profile", "auto", "--max-examples", "100", "--trace-dir", str(tmp_path),
         "--junit", str(tmp_path / "auto.xml"), "--json", str(tmp_path / "auto.json")]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 1, out
    assert "conforms to no profile" in out
    (case,) = ET.parse(tmp_path / "auto.xml").getroot().iter("testcase")
    assert case.get("name") == "pool-caching-on-auto"
    failure = case.find("failure")
    assert failure is not None and failure.get("message", "").startswith("conforms to no profile (vllm-v1: diverges")
    document = json.loads((tmp_path / "auto.json").read_text())
    assert document["exit_code"] == 1 and document["profiles"][0]["conforms_to"] == []


def test_check_profile_auto_reports_for_tools_and_runs_with_every_setting(tmp_path, capsys):
    # --profile auto is `check` once per profile: the run's settings reach each campaign (here --steps and
    # --events), and --json and --junit say which profiles each configuration conforms to.
    code = main(
        ["check", "--impl", "tests.conformance.test_cli:v1_whatever_asked", "--level", "pool", "--caching", "on",
         "--profile", "auto", "--max-examples", "100", "--steps", "20", "--no-events", "--trace-dir", str(tmp_path),
         "--junit", str(tmp_path / "auto.xml"), "--json", str(tmp_path / "auto.json")]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    document = json.loads((tmp_path / "auto.json").read_text())
    assert document["exit_code"] == 0
    assert document["profiles"] == [{
        "impl": "tests.conformance.test_cli:v1_whatever_asked", "level": "pool", "enable_caching": True,
        "profiles_tried": ["vllm-v1", "vllm-v1-tail"], "conforms_to": ["vllm-v1"], "exit_code": 0,
    }]  # fmt: skip
    v1, tail = document["results"]
    assert (v1["profile"], v1["verdict"], tail["profile"], tail["verdict"]) == (
        "vllm-v1",
        "conforms",
        "vllm-v1-tail",
        "diverges",
    )
    assert v1["events"] is False and v1["left_out"] == ["KV cache events (--events)"]
    # The same campaign as `check --profile vllm-v1` with the same settings: the same examples and steps.
    assert main(
        ["check", "--impl", "tests.conformance.test_cli:v1_whatever_asked", "--level", "pool", "--caching", "on",
         "--profile", "vllm-v1", "--max-examples", "100", "--steps", "20", "--no-events", "--trace-dir",
         str(tmp_path), "--json", str(tmp_path / "v1.json")]
    ) == 0  # fmt: skip
    (alone,) = json.loads((tmp_path / "v1.json").read_text())["results"]
    assert (alone["examples"], alone["steps"], alone["states"]) == (v1["examples"], v1["steps"], v1["states"])
    (case,) = ET.parse(tmp_path / "auto.xml").getroot().iter("testcase")
    assert case.get("name") == "pool-caching-on-auto" and case.find("failure") is None
    assert case.findtext("system-out", "").startswith("conforms to: vllm-v1 (vllm-v1: conforms; vllm-v1-tail: diverges")


def test_vllm_logs_are_silenced_whatever_the_implementation_is_called(tmp_path) -> None:
    # A user's module that runs vLLM's code (here: logs as vLLM's pool does on every refused reset),
    # run as a user runs kvspec: in a process of its own, whose logging nothing has touched.
    (tmp_path / "chatty_pool.py").write_text(
        "import logging\n"
        "from kvspec.conformance.targets.builtin import make_reference\n"
        "def factory(config):\n"
        "    adapter = make_reference(config)\n"
        "    reset = adapter.reset_prefix_cache\n"
        "    def logged_reset():\n"
        "        logging.getLogger('vllm.v1.core.block_pool').warning('Failed to reset prefix cache')\n"
        "        return reset()\n"
        "    adapter.reset_prefix_cache = logged_reset\n"
        "    return adapter\n"
    )
    argv = ["check", "--impl", f"{tmp_path / 'chatty_pool.py'}:factory", "--level", "pool", "--caching", "on",
            "--max-examples", "100"]  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "kvspec", *argv], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Failed to reset prefix cache" not in done.stdout + done.stderr
