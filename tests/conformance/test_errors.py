"""The error contract (`kvspec errors`) is what the spec does, and the command prints it.

Every row is driven through the spec again here: the valid call of each
operation succeeds, each mistake's case raises the row's error type (one the
operations table lists for the operation) and leaves the state as it was;
every mistake of the operations table has a row and every row names one; the
JSON the command writes is the contract rebuilt from the spec.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from kvspec.conformance.core import error_contract as ec
from kvspec.conformance.core.operations import OPERATIONS
from kvspec.spec.errors import BlockManagerError

ROOT = Path(__file__).resolve().parents[2]
CONTRACT = ec.build_contract()
ROWS = [(oc.operation, row) for oc in CONTRACT.operations for row in oc.rows]


def kvspec(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvspec", *args], cwd=cwd, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("operation", list(ec.CASES))
def test_the_valid_call_of_each_operation_is_accepted(operation: str) -> None:
    _, _, error = ec.call(operation, ec.CASES[operation].valid)
    assert error is None


@pytest.mark.parametrize(("operation", "row"), ROWS, ids=[f"{op}: {row.mistake}" for op, row in ROWS])
def test_each_row_is_what_the_spec_raises_and_the_state_is_unchanged(operation: str, row: ec.Row) -> None:
    fields = ec.CASES[operation].fields(row.mistake)
    state, args, _ = ec.call(operation, fields)
    before = state.snapshot() if hasattr(state, "snapshot") else state
    with pytest.raises(BlockManagerError) as caught:
        OPERATIONS[operation].spec(state, *args)
    assert type(caught.value).__name__ == row.error
    assert row.error in OPERATIONS[operation].errors
    assert str(caught.value) == row.message
    assert state.snapshot() == before  # nothing changed in place
    assert state == ec.CASES[operation].build(OPERATIONS[operation].params, fields)[0]


def test_every_mistake_of_the_operations_table_has_a_row_and_every_row_names_one() -> None:
    listed = {(op.name, m) for op in OPERATIONS.values() for m in op.mistakes}
    rows = {(op, row.mistake) for op, row in ROWS}
    assert rows == listed


def test_the_order_is_the_spec_s_known_order() -> None:
    """Spot checks read from the spec's source: the first check of each kind wins."""
    order = {(op, row.mistake): row.order for op, row in ROWS}
    assert order["touch", "bad id"] < order["touch", "named twice"] < order["touch", "no hash"]
    assert order["get_new_blocks", "bad count"] == "1"
    assert order["cache_full_blocks", "caching off"] == "1"
    # one pass over the blocks: the earlier block is reported; at one block, bytes, then held, then cached
    assert [order["cache_full_blocks", m] for m in ("hash not bytes", "not held", "already cached")] == [
        "5.1",
        "5.2",
        "5.3",
    ]
    assert order["allocate_slots", "no id"] == "1"
    assert order["allocate_slots", "more tokens than the request has"] == str(
        max(int(o.split(".")[0]) for (op, _), o in order.items() if op == "allocate_slots")
    )


def test_two_mistakes_that_are_one_check_are_refused() -> None:
    cases = ec.CASES["touch"]
    doubled = replace(cases, mistakes={**cases.mistakes, "again": cases.mistakes["bad id"]})
    with pytest.raises(ValueError, match=r"^touch: 'bad id' and 'again' are one check"):
        ec._operation_contract(OPERATIONS["touch"], doubled)


def test_kvspec_errors_prints_each_operation(tmp_path: Path) -> None:
    result = kvspec("errors", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    for op in OPERATIONS:
        assert f"\n{op}(" in result.stdout
    assert max(len(line) for line in result.stdout.splitlines()) <= 120
    assert list(tmp_path.iterdir()) == []


def test_kvspec_errors_json_round_trips(tmp_path: Path) -> None:
    out = tmp_path / "errors.json"
    result = kvspec("errors", "--json", str(out), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert json.loads(out.read_text()) == ec.contract_json(ec.build_contract())
    stdout = kvspec("errors", "--json", "-", cwd=tmp_path)
    assert stdout.returncode == 0 and json.loads(stdout.stdout) == ec.contract_json(CONTRACT)


def test_a_bad_json_path_is_refused_in_one_line(tmp_path: Path) -> None:
    result = kvspec("errors", "--json", "/nonexistent/dir/x.json", cwd=tmp_path)
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "does not exist" in lines[0]
    assert "Traceback" not in result.stdout + result.stderr


def test_the_error_types_of_the_rows_are_those_the_operations_table_lists() -> None:
    for oc in CONTRACT.operations:
        assert {row.error for row in oc.rows} == set(OPERATIONS[oc.operation].errors), oc.operation
