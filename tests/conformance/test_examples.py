"""The "Write an adapter" guide (docs/guides/adapter.md), end to end: examples/ checked as a user checks them.

Every check runs the command line a user types, in a subprocess: `kvspec check`
on the example pool by file path and by module name, with its documented bug
off (conforms) and on (diverges, a short story), names that cannot load, and
the pytest one-liner, whose failure's replay line replays when pasted.
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvspec.conformance.runner.registry import factory_name, load_factory

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
KVSPEC = [sys.executable, "-m", "kvspec"]
# A story's steps: "    1. get_new_blocks(...)", the bad one marked ">   4. ...".
STEP_LINE = re.compile(r"^[> ]\s+\d+\. ", re.MULTILINE)


def run(args, cwd, bug=None, timeout=120):
    env = {k: v for k, v in os.environ.items() if k != "KVSPEC_EXAMPLE_BUG"}
    if bug is not None:
        env["KVSPEC_EXAMPLE_BUG"] = bug
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def check(impl, tmp_path, cwd=ROOT, bug=None):
    args = ["check", "--impl", impl, "--level", "pool", "--time-budget", "3", "--trace-dir", str(tmp_path)]
    return run([*KVSPEC, *args], cwd, bug)


def test_the_example_pool_conforms_by_path(tmp_path):
    r = check("examples/pool_example.py:factory", tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "result: 2 conforms (exit 0)" in r.stdout


def test_the_example_pool_with_its_bug_diverges_in_a_short_story(tmp_path):
    r = check("examples/pool_example.py:factory", tmp_path, bug="pool")
    assert r.returncode == 1, r.stdout + r.stderr
    story = r.stdout[r.stdout.index("DIVERGES") :]
    assert 1 <= len(STEP_LINE.findall(story)) <= 5, story
    assert "inv_free_queue_has_zero_ref" in story  # the touched block stayed in the free queue
    assert "--impl examples/pool_example.py:factory" in story


def test_the_example_pool_by_module_name_from_its_folder(tmp_path):
    r = check("pool_example:factory", tmp_path, cwd=EXAMPLES)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize(
    "impl, says",
    [
        ("examples/no_such_pool.py:factory", "no such file examples/no_such_pool.py"),
        ("examples/pool_example.py:no_such_factory", "has no attribute 'no_such_factory'"),
    ],
)
def test_a_file_that_cannot_give_a_factory_is_refused_in_one_line(tmp_path, impl, says):
    r = check(impl, tmp_path)
    assert r.returncode == 2
    assert says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "Traceback" not in r.stderr


def test_a_factory_loaded_from_a_file_is_named_by_that_file(monkeypatch):
    monkeypatch.chdir(ROOT)
    factory = load_factory("examples/pool_example.py:factory")
    assert factory_name(factory) == "examples/pool_example.py:factory"
    assert load_factory("pool_example:factory") is factory  # one module, whichever way it is named
    assert factory_name(load_factory("kvspec.conformance.targets.builtin:make_reference")) == "reference"


def _pytest_examples(tmp_path, bug=None, only=None):
    """The one-liner run as a user runs it, from a folder holding a copy of examples/."""
    shutil.copytree(EXAMPLES, tmp_path / "examples", ignore=shutil.ignore_patterns("__pycache__"))
    args = [sys.executable, "-m", "pytest", "examples/test_examples.py", "-q", "-p", "no:cacheprovider"]
    args += ["--import-mode=importlib", "--rootdir", str(tmp_path)] + (["-k", only] if only else [])
    return run(args, tmp_path, bug, timeout=300)


@pytest.mark.heavy
def test_the_pytest_one_liner_passes(tmp_path):
    r = _pytest_examples(tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "4 passed" in r.stdout


def test_the_pytest_one_liner_fails_with_a_replay_line_that_replays(tmp_path):
    r = _pytest_examples(tmp_path, bug="pool", only="test_pool_caching_on")
    assert r.returncode == 1, r.stdout + r.stderr
    replay = re.search(r"replay: (kvspec replay \S+ --impl \S+)", r.stdout)
    assert replay is not None, r.stdout
    assert replay.group(1).endswith("--impl examples/manager_example.py:factory")
    pasted = run([*KVSPEC, *replay.group(1).split()[1:]], tmp_path, bug="pool")
    assert pasted.returncode == 1, pasted.stdout + pasted.stderr
    assert "DIVERGES" in pasted.stdout


@pytest.mark.parametrize(
    "declared, verdict, says",
    [
        # an optional operation: not called, and the summary says so
        ("get_usage", 0, "get_usage: not compared, the test says so"),
        # one compared on every implementation, and a misspelt name: the summary would have said so falsely
        ("free_blocks", 1, "known_deviations names 'free_blocks', not an operation the harness can leave uncalled"),
        ("get_usge", 1, "known_deviations names 'get_usge', not an operation the harness can leave uncalled"),
    ],
)
def test_a_known_deviation_leaves_uncalled_only_what_can_be(tmp_path, declared, verdict, says):
    (tmp_path / "deviating_pool.py").write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(EXAMPLES)!r})\n"
        "from pool_example import ExamplePool\n"
        "class DeviatingPool(ExamplePool):\n"
        f"    known_deviations = {{{declared!r}: 'the test says so'}}\n"
        "def factory(config):\n"
        "    return DeviatingPool(config.num_gpu_blocks, config.enable_caching)\n"
    )
    r = check("deviating_pool.py:factory", tmp_path, cwd=tmp_path)
    assert r.returncode == verdict, r.stdout + r.stderr
    assert says in r.stdout, r.stdout
    assert "Traceback" not in r.stdout + r.stderr
