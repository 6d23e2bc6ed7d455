"""`kvspec invariants`: every rule once, in plain words, with what enforces it read from the code."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvspec.conformance.core.adapter import AdapterConfig
from kvspec.conformance.core.lockstep import ConformanceFailure, LockStep
from kvspec.conformance.tools.cli import main
from kvspec.conformance.tools.commands.invariants import INDIRECT, lemma_claims_from_source, render_text, rows
from kvspec.mutants import all_mutants
from kvspec.spec.hashing import MultiModalInput
from kvspec.spec.invariants import EVENT_RULES, HIT_RULES, INVARIANTS, STEP_RULES
from kvspec.spec.manager import Request

ROOT = Path(__file__).resolve().parents[2]
LEMMA_5 = "5 lemma_hit_cap_within_prompt"
LEMMA_7 = "7 lemma_invariants_inductive"


def _by_name():
    return {row.name: row for row in rows()}


def test_every_rule_appears_once_with_its_docstring():
    table = rows()
    names = [row.name for row in table]
    expected = [i.name for i in INVARIANTS] + [h.name for h in HIT_RULES] + [s.name for s in STEP_RULES]
    expected += [e.name for e in EVENT_RULES]
    assert names == [*expected, "is_block_writable"]
    by_name = _by_name()
    for inv in INVARIANTS:
        assert by_name[inv.name].rule == " ".join(inv.rule.split())
        assert by_name[inv.name].design_id == inv.design_id


def test_enforcement_is_read_from_the_code():
    by_name = _by_name()
    # Every state invariant is in all_hold, which the spec operations require and ensure.
    fhzr = by_name["inv_free_queue_has_zero_ref"]
    assert {"ops.get_new_blocks", "ops.free_blocks", "manager.allocate_slots"} <= set(fhzr.contracts)
    assert "ops.get_usage" not in fhzr.contracts  # its only postcondition is the range of the result
    assert fhzr.machine
    # The hit cap: the manager's postcondition, the machine on every hit.
    cap = by_name["hit_within_cap"]
    assert cap.contracts == ("manager.get_computed_blocks",) and cap.machine
    # Content integrity has no contract (the spec has no memory); the machine reads hits back.
    content = by_name["hit_content_intact"]
    assert content.contracts == () and content.machine
    # The write rule: is_block_writable's postcondition, and the machine compares every
    # implementation's answer with the spec's (through the operations table).
    writable = by_name["is_block_writable"]
    assert writable.contracts == ("ops.is_block_writable",) and writable.machine
    # The router's mirror: every state-changing operation's contract (its events explain its change), and
    # the machine on the implementation's stream; the parent rule has no contract (the spec's parents are
    # its own chain), only the machine.
    exact = by_name["event_mirror_exact"]
    assert {"ops.get_new_blocks", "ops.evict_blocks", "manager.allocate_slots", "manager.evict_blocks"} <= set(
        exact.contracts
    )
    assert exact.machine and "ops.get_usage" not in exact.contracts
    parent = by_name["event_parent_known"]
    assert parent.contracts == () and parent.machine


def test_the_lemma_column_names_what_lemmas_5_and_7_prove():
    lemmas = {row.name: row.lemmas for row in rows()}
    proved_by_7 = {
        "inv_ref_cnt_nonnegative",
        "inv_null_block_isolated",
        "inv_free_queue_has_zero_ref",
        "inv_conservation",
        "inv_hash_table_consistent",
        "inv_caching_off_no_hash",
        "step_null_block_never_freed",  # shares the null-block id with inv_null_block_isolated
        "is_block_writable",  # lemma 7 names the writable rule by its design id
    }
    assert {name for name, by in lemmas.items() if by == (LEMMA_7,)} == proved_by_7
    assert {name for name, by in lemmas.items() if by == (LEMMA_5,)} == {"hit_within_cap"}
    # Not pool state (lemma 7 leaves them to the machine), or rules no lemma states.
    assert {name for name, by in lemmas.items() if not by} == set(lemmas) - proved_by_7 - {"hit_within_cap"}


def test_the_lemma_column_is_read_from_source_as_the_registry_says():
    lemmas = pytest.importorskip("kvspec.spec.lemmas", reason="needs z3 (the proofs extra) to import the registry")
    expected = [(f"{lem.number} {lem.name}", tuple(lem.invariants)) for lem in lemmas.LEMMAS if lem.invariants]
    assert lemma_claims_from_source() == expected
    assert [label for label, _ in expected] == [LEMMA_5, LEMMA_7]


def test_without_z3_the_table_is_the_same(tmp_path):
    # A `z3` module that cannot be imported, first on the path: as if the proofs extra were missing.
    (tmp_path / "z3.py").write_text('raise ImportError("z3 is not installed (test stub)")\n')
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    code = "import kvspec.spec.lemmas"
    assert subprocess.run([sys.executable, "-c", code], env=env, capture_output=True).returncode != 0
    out = subprocess.run(
        [sys.executable, "-m", "kvspec", "invariants", "--json"], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    without = {row["name"]: row["lemmas"] for row in json.loads(out.stdout)}
    assert without == {row.name: list(row.lemmas) for row in rows()}


def test_salt_isolation_is_shown_through_prefix_closure():
    salt = _by_name()["hit_salt_isolated"]
    closed = _by_name()["hit_prefix_closed"]
    assert salt.through == ("hit_prefix_closed",) and "block_extra_keys" in salt.how
    assert (
        (salt.contracts, salt.machine)
        == (closed.contracts, closed.machine)
        == (
            ("manager.get_computed_blocks",),
            True,
        )
    )
    assert salt.lemmas == ()  # no lemma states it: it is not inherited from the rule it goes through
    assert set(salt.mutants) <= {m.name for m in all_mutants()}
    text = render_text(rows())
    assert "through hit_prefix_closed:" in text and "mutants it catches: cache_salt_ignored" in text


def _other_key(name: str) -> tuple[Request, Request]:
    tokens = tuple(range(9))
    if name == "cache_salt_ignored":
        return Request("a", tokens, cache_salt="t1"), Request("b", tokens, cache_salt="t2")
    if name == "lora_ignored":
        return Request("a", tokens, lora_name="x"), Request("b", tokens, lora_name="y")
    image = (MultiModalInput("img-1", 0, 4),), (MultiModalInput("img-2", 0, 4),)
    return Request("a", tokens, mm_inputs=image[0]), Request("b", tokens, mm_inputs=image[1])


@pytest.mark.parametrize("name", INDIRECT["hit_salt_isolated"].mutants)
def test_each_named_mutant_breaks_the_rule_it_goes_through(name):
    # With hash values compared as names only (exact values off, as for an adapter with
    # its own hash function), the other tenant's hit is named as not prefix-closed.
    mutant = next(m for m in all_mutants() if m.name == name)
    factory = type(f"{name}_own_hashes", (mutant.factory,), {"uses_kvspec_hash_chain": False})
    lock = LockStep(factory, AdapterConfig("manager", 8, block_size=4))
    lock.check()
    first, second = _other_key(name)
    lock.call("allocate_slots", first, 9, 0, [], 0)
    lock.check()
    lock.call("get_computed_blocks", second)
    with pytest.raises(ConformanceFailure) as caught:
        lock.check()
    assert caught.value.failure.invariant == "hit_prefix_closed"


def test_every_design_id_is_one_of_docs_design_md():
    # The design ids the code prints are those of docs/design.md's invariant table, which names the code.
    design = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    table = design[design.index("| id | code | invariant |") :].split("\n\n")[0]
    ids = set(re.findall(r"^\| ([a-z-]+) \|", table, flags=re.MULTILINE)) - {"id"}
    assert {row.design_id for row in rows() if row.design_id} <= ids
    # Each id's row of the table names, in its code column, every rule that carries the id.
    for row in rows():
        if row.design_id:
            line = next(x for x in table.splitlines() if x.startswith(f"| {row.design_id} |"))
            assert f"`{row.name}`" in line.split("|")[2], (row.name, line)


def test_table_text_and_json(capsys):
    text = render_text(rows())
    assert "free-has-zero-ref" in text and f"lemma: {LEMMA_7}" in text and f"lemma: {LEMMA_5}" in text
    assert "state machine: after every step" in text and "state machine: on every hit" in text
    assert "docs/design.md" in text
    assert main(["invariants", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {row["name"] for row in data} == set(_by_name())
    assert next(row for row in data if row["name"] == "hit_salt_isolated")["through"] == ["hit_prefix_closed"]
