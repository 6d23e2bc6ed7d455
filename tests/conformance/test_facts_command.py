"""`kvspec facts` without a vLLM wheel: its refusals (one line on stderr, exit 2, nothing loaded) and how measured
facts are set beside declared ones (a measurement made by hand from the table, no pool)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvspec.conformance.targets.vllm import releases
from kvspec.conformance.targets.vllm.measure import FACT_FIELDS, MeasuredFacts
from kvspec.conformance.targets.vllm.releases import RELEASES, facts_for
from kvspec.conformance.tools.cli import main
from kvspec.conformance.tools.vllm_facts import beside_release, compare, entry_literal, format_table


def _refused(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    code = main(["facts", *argv])
    out, err = capsys.readouterr()
    assert (code, out) == (2, ""), (code, out, err)
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_a_name_that_is_not_a_vllm_is_refused_in_one_line(capsys) -> None:
    err = _refused(capsys, "reference")
    assert err == "kvspec facts: 'reference' names no vLLM BlockPool: name vllm@<release>, vllm@<dir> or vllm\n"
    assert _refused(capsys, "vllm-v0@0.6.6").startswith("kvspec facts: 'vllm-v0@0.6.6' names no vLLM BlockPool")


def test_a_folder_that_is_not_a_vllm_tree_is_refused_in_one_line(tmp_path: Path, capsys) -> None:
    err = _refused(capsys, f"vllm@{tmp_path}")
    assert err == f"kvspec facts: {tmp_path} is not a vLLM source tree: it has no vllm/v1/core/block_pool.py\n"


def test_a_beside_the_table_does_not_declare_is_refused_before_anything_loads(tmp_path: Path, capsys) -> None:
    # the folder is no vLLM tree either: the --beside refusal comes first, so nothing was loaded
    err = _refused(capsys, f"vllm@{tmp_path}", "--beside", "0.7.9")
    covered = f"{RELEASES[0]}..{RELEASES[-1]}"
    assert err == f"kvspec facts: --beside 0.7.9: not a release kvspec's table declares ({covered})\n"


def test_a_missing_name_is_refused_by_the_parser_in_one_line(capsys) -> None:
    assert _refused(capsys).startswith("kvspec facts: the following arguments are required: IMPL")


def test_the_release_beside_is_the_newest_declared_at_or_below_the_version() -> None:
    assert beside_release("0.8.5.post2") == "0.8.5.post1"
    assert beside_release("0.7.3") == RELEASES[0]  # below the table: its oldest


def _measured_like(version: str, changed: dict[str, object], unmeasured: set[str]) -> MeasuredFacts:
    """What a measurement of ``version`` gives with ``changed`` values and ``unmeasured`` facts not measured."""
    values = {f: changed.get(f, getattr(facts_for(version), f)) for f in FACT_FIELDS if f not in unmeasured}
    return MeasuredFacts(version, f"vllm=={version} (light)", values, dict.fromkeys(unmeasured, "no way here"))


def test_only_a_measured_fact_that_differs_is_marked_and_the_entry_says_what_was_not_measured() -> None:
    measured = _measured_like("0.33.0", {"free_order": "all_right"}, {"hash_algos", "touch_skips_null"})
    # 0.33.0 added a pool parameter and skips the null block; touch_skips_null, not measured, is not marked
    rows = compare(measured, "0.32.0")
    table = format_table(measured, "0.32.0", rows)
    assert [line.split()[1] for line in table.splitlines() if line.startswith("* ") and "differ" not in line] == [
        "pool_init_params", "free_order", "null_on_free"]  # fmt: skip
    assert "  touch_skips_null             not measured" in table
    assert "not measured: touch_skips_null: no way here" in table
    entry = entry_literal(measured, "0.32.0", rows)
    assert "    touch_skips_null=False,  # not measured: from 0.32.0" in entry.splitlines()
    made = eval(entry, vars(releases))  # noqa: S307 - the literal a maintainer pastes into releases.py
    assert (made.version, made.free_order, made.hash_algos) == ("0.33.0", "all_right", facts_for("0.32.0").hash_algos)
