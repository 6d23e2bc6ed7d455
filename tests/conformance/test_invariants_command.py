"""`kvspec invariants`: every rule once, in plain words, with what enforces it read from the code."""

from __future__ import annotations

import json

from kvspec.conformance.cli import main
from kvspec.conformance.commands.invariants import render_text, rows
from kvspec.spec.invariants import HIT_RULES, INVARIANTS, STEP_RULES


def _by_name():
    return {row.name: row for row in rows()}


def test_every_rule_appears_once_with_its_docstring():
    table = rows()
    names = [row.name for row in table]
    expected = [i.name for i in INVARIANTS] + [h.name for h in HIT_RULES] + [s.name for s in STEP_RULES]
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
    assert fhzr.lemmas == ("7 lemma_invariants_inductive",)
    # The hit cap: the manager's postcondition, the machine on every hit, lemma 5.
    cap = by_name["hit_within_cap"]
    assert cap.contracts == ("manager.get_computed_blocks",) and cap.machine
    assert cap.lemmas == ("5 lemma_hit_cap_within_prompt",)
    # A step rule sharing the null-block id is covered by the lemma on inv_null_block_isolated.
    assert by_name["step_null_block_never_freed"].lemmas == ("7 lemma_invariants_inductive",)
    # Content integrity has no contract or lemma (the spec has no memory); the machine reads hits back.
    content = by_name["hit_content_intact"]
    assert content.contracts == () and content.machine and content.lemmas == ()
    writable = by_name["is_block_writable"]
    assert writable.contracts == ("ops.is_block_writable",) and writable.lemmas == ("7 lemma_invariants_inductive",)


def test_table_text_and_json(capsys):
    text = render_text(rows())
    assert "free-has-zero-ref" in text and "lemma: 7 lemma_invariants_inductive" in text
    assert "state machine: after every step" in text and "state machine: on every hit" in text
    assert main(["invariants", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {row["name"] for row in data} == set(_by_name())
