"""`kvspec facts` on real vLLM pools (light mode; KVSPEC_VLLM=1): every release measures as the table declares it.

The table (releases.py) says it was measured; here it is measured again, every
fact that can be, for every release it declares, so a wrong row fails here
with the fact and the release named. The command's output is checked on the
release where the table last changed.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from kvspec.conformance.targets.vllm import releases
from kvspec.conformance.targets.vllm.adapter import light_release
from kvspec.conformance.targets.vllm.hashes import measure_releases
from kvspec.conformance.targets.vllm.lightmode import fetch_release
from kvspec.conformance.targets.vllm.measure import measure_facts
from kvspec.conformance.targets.vllm.releases import RELEASES, facts_for
from kvspec.conformance.tools.cli import main

pytestmark = pytest.mark.vllm
logging.disable(logging.WARNING)

# What light mode cannot measure: the config's hash names, how NONE_HASH is derived, the request level.
NOT_MEASURED_IN_LIGHT_MODE = {"hash_algos", "none_hash", "request_hit_limit"}


@pytest.fixture(scope="module")
def _hash_chains_measured_at_once() -> None:
    measure_releases(RELEASES)  # four interpreters for every release, kept for the process, not four per release


@pytest.mark.parametrize("version", RELEASES)
@pytest.mark.usefixtures("_hash_chains_measured_at_once")
def test_every_measured_fact_of_every_release_is_the_one_the_table_declares(version: str) -> None:
    measured = measure_facts(light_release(version))
    assert set(measured.not_measured) == NOT_MEASURED_IN_LIGHT_MODE, measured.not_measured
    declared = facts_for(version)
    wrong = {name: (value, getattr(declared, name)) for name, value in measured.values.items()
             if value != getattr(declared, name)}  # fmt: skip
    assert not wrong, f"vllm=={version}: fact: (measured, declared): {wrong}"


def _facts(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(["facts", *argv])
    out, err = capsys.readouterr()
    assert err == "", err
    return code, out


def test_0_34_beside_0_33_marks_exactly_the_facts_that_changed(capsys) -> None:
    code, out = _facts(capsys, "vllm@0.34.0", "--beside", "0.33.0")
    assert code == 1, out
    marked = {line.split()[1] for line in out.splitlines() if line.startswith("* ") and not line.startswith("* 2 ")}
    # 0.34.0's request-level change (request_hit_limit) is not measured in light mode: it is not marked
    assert marked == {"free_has_evict_first_kwarg", "hash_map_holds_block_ids"}, out
    assert "request_hit_limit            not measured" in out
    assert out.rstrip().endswith("2 measured fact(s) differ from 0.33.0's: free_has_evict_first_kwarg, "
                                 "hash_map_holds_block_ids")  # fmt: skip


def test_0_34_beside_itself_by_default_exits_0_and_says_the_same_in_json(capsys) -> None:
    code, out = _facts(capsys, "vllm@0.34.0")
    assert code == 0 and "every measured fact equals 0.34.0's" in out, out
    code, out = _facts(capsys, "vllm@0.34.0", "--beside", "0.33.0", "--json")
    found = json.loads(out)
    assert code == 1 and found["beside"] == "0.33.0" and found["version"] == "0.34.0"
    assert found["differing"] == ["free_has_evict_first_kwarg", "hash_map_holds_block_ids"]
    unmeasured = {f["fact"]: f for f in found["facts"] if not f["measured"]}
    assert set(unmeasured) == NOT_MEASURED_IN_LIGHT_MODE
    assert all(f["value"] is None and f["why_not"] and not f["differs"] for f in unmeasured.values())


def test_the_entry_evaluates_to_the_tables_0_34_row_and_marks_what_it_did_not_measure(capsys) -> None:
    code, out = _facts(capsys, "vllm@0.34.0", "--entry", "--beside", "0.33.0")
    assert code == 1
    entry = eval(out, vars(releases))  # noqa: S307 - the literal a maintainer pastes into releases.py
    declared = facts_for("0.34.0")
    measured_fields = [f for f in releases.ReleaseFacts.__slots__ if f not in NOT_MEASURED_IN_LIGHT_MODE]
    assert {f: getattr(entry, f) for f in measured_fields} == {f: getattr(declared, f) for f in measured_fields}
    commented = {line.strip().split("=")[0] for line in out.splitlines() if "# not measured: from 0.33.0" in line}
    assert commented == NOT_MEASURED_IN_LIGHT_MODE
    # beside itself, the entry is the table's row
    code, out = _facts(capsys, "vllm@0.34.0", "--entry")
    assert code == 0 and eval(out, vars(releases)) == declared  # noqa: S307


def test_a_source_tree_is_set_beside_the_release_it_started_from(tmp_path: Path, capsys) -> None:
    # A pull request's checkout (the newest release's files): version 0.34.0.dev0+tree, beside 0.34.0.
    tree = tmp_path / "checkout"
    shutil.copytree(fetch_release(RELEASES[-1]) / "vllm", tree / "vllm")
    code, out = _facts(capsys, f"vllm@{tree}", "--json")
    found = json.loads(out)
    assert code == 0 and found["beside"] == RELEASES[-1] and found["version"] == f"{RELEASES[-1]}.dev0+tree"
    unmeasured = {f["fact"] for f in found["facts"] if not f["measured"]}
    # the hash chain is measured for a release of the table only (its default hash function picks it)
    assert unmeasured == NOT_MEASURED_IN_LIGHT_MODE | {"hash_chain_differs"}
