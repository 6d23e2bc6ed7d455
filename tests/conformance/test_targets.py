"""Targets register themselves through the ``kvspec.targets`` entry points; the registry holds no list.

A third-party pool ships its own target from its own distribution: adding one
touches nothing of kvspec (shown here with a distribution written as pip
leaves one: the fixture `register_target`, tests/conformance/entry_points.py). kvspec's own targets go the
same way (its pyproject.toml, `kvspec.conformance.targets.catalog`).
"""

from __future__ import annotations

import pytest

from kvspec.conformance.runner.registry import (
    FactoryError,
    default_targets,
    factory_name,
    find_target,
    known_targets,
    load_factory,
    target_names,
)
from kvspec.conformance.runner.run import run_check
from kvspec.conformance.tools.cli import main

# A whole third-party distribution: its adapter is the reference's pool behind a name of its own.
THIRD_PARTY = """
from kvspec.conformance import Target
from kvspec.conformance.targets.builtin import make_reference

def make_adapter(config):
    return make_reference(config)

TARGET = Target(name="their-pool", summary="a pool shipped by another distribution",
                factory="their_pool:make_adapter")
"""


def test_kvspec_registers_its_own_targets_through_entry_points() -> None:
    names = [t.name for t in known_targets()]
    assert {"reference", "spec", "gpu", "vllm", "vllm-v0", "kvcached", "overlay"} <= set(names)
    assert [t.name for t in default_targets()] == ["reference", "spec", "gpu"]
    assert "vllm@X.Y.Z" in target_names() and "overlay:vllm@X+module:function" in target_names()
    assert find_target("vllm@0.24.0").name == "vllm"
    assert find_target("overlay:vllm@0.33.0+mod:fn").name == "overlay"
    assert find_target("vllm-v0@0.6.6").name == "vllm-v0"
    assert find_target("vllm-mlx").name == "vllm-mlx"
    assert find_target("my_pool:factory") is None


@pytest.mark.heavy
def test_a_third_party_target_is_found_through_its_entry_point_alone(register_target, tmp_path, capsys) -> None:
    register_target("their-pool", "their-pool", "their_pool:TARGET", THIRD_PARTY)
    factory = load_factory("their-pool")
    assert factory.__name__ == "make_adapter" and factory_name(factory) == "their-pool"
    result = run_check("their-pool", level="pool", max_examples=100, trace_dir=tmp_path)
    assert result.verdict == "conforms" and result.impl == "their-pool" and result.steps_run > 0
    # and on the command line, named like any built-in
    code = main(["check", "--impl", "their-pool", "--level", "pool", "--caching", "on", "--max-examples", "100",
                 "--trace-dir", str(tmp_path)])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0 and "their-pool" in out


@pytest.mark.parametrize(
    ("value", "source", "why"),
    [
        ("broken_pool:TARGET", "raise RuntimeError('no device here')\n",
         r"entry point broken_pool:TARGET of broken-pool does not load \(RuntimeError: no device here\)"),
        ("broken_pool:TARGET", "TARGET = 42\n",
         r"entry point broken_pool:TARGET of broken-pool is a int, not a Target"),
        ("broken_pool:TARGET", "from kvspec.conformance import Target\n"
         "TARGET = Target(name='other', summary='', factory='x:y')\n",
         r"entry point 'broken' of broken-pool names a target called 'other'"),
    ],
)  # fmt: skip
def test_an_entry_point_that_does_not_load_is_one_line_when_named(register_target, value, source, why) -> None:
    register_target("broken-pool", "broken", value, source)
    load_factory("reference")  # every other target still loads
    with pytest.raises(FactoryError, match=rf"^implementation 'broken': {why}$"):
        load_factory("broken")


def test_a_broken_entry_point_is_refused_on_the_command_line_in_one_line(register_target, capsys) -> None:
    register_target("broken-pool", "broken", "broken_pool:TARGET", "raise ImportError('needs a GPU')\n")
    assert main(["check", "--impl", "broken", "--level", "pool"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "kvspec check: implementation 'broken': entry point broken_pool:TARGET of broken-pool does not load "
        "(ImportError: needs a GPU)"
    ]
