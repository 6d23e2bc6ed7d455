"""The CI recipe for vLLM pull requests (examples/ci/vllm-pull-request.yml), end to end on source trees built
from two releases' files (KVSPEC_VLLM=1): kvspec gate fails on a behaviour change and passes once it is accepted."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from kvspec.conformance.targets.vllm.lightmode import fetch_release
from kvspec.conformance.tools.cli import main

pytestmark = pytest.mark.vllm
WORKFLOW = Path(__file__).resolve().parents[2] / "examples" / "ci" / "vllm-pull-request.yml"


def _checkout(root: Path, version: str) -> Path:
    """A vLLM checkout as a build leaves it: the release's pool modules and the _version.py the build writes."""
    tree = root / version
    shutil.copytree(fetch_release(version) / "vllm", tree / "vllm")
    (tree / "vllm" / "_version.py").write_text(f"__version__ = version = '{version}'\n")
    return tree


def test_the_workflow_runs_the_gate_on_the_pull_request_and_its_merge_base() -> None:
    steps = yaml.safe_load(WORKFLOW.read_text())["jobs"]["gate"]["steps"]
    runs = [s["run"] for s in steps if "run" in s]
    assert any(r.startswith("kvspec gate pr base --out kvspec-out") for r in runs), runs
    assert any("merge-base" in r and "../base" in r for r in runs), runs


def test_the_gate_fails_on_a_behaviour_change_and_passes_when_the_change_is_accepted(tmp_path, capsys) -> None:
    # 0.24.0's pull request to 0.23.0: the free order it changed (seed 000's order) conforms to the spec,
    # and changes the behaviour of its merge base: a finding until the pull request accepts it.
    base, pr = _checkout(tmp_path, "0.23.0"), _checkout(tmp_path, "0.24.0")
    out = tmp_path / "out"
    assert main(["gate", str(pr), str(base), "--out", str(out)]) == 1
    text = capsys.readouterr().out
    assert "kvspec gate: check exit 0, diff exit 1" in text, text
    assert (out / "kvspec.xml").is_file() and (out / "changes.json").is_file()
    accepted = tmp_path / "accepted.json"
    shutil.copy(out / "changes.json", accepted)
    assert main(["gate", str(pr), str(base), "--out", str(tmp_path / "again"), "--accept", str(accepted)]) == 0
    assert "kvspec gate: check exit 0, diff exit 0" in capsys.readouterr().out
