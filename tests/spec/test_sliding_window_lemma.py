"""Lemma 9, `lemma_sliding_window_frees_only_unread`: proved for every c, W, B and L; its twin
refuted with a concrete case that really breaks; and the obligations fail when a rule is off by one."""

from __future__ import annotations

import json
import re

import pytest
import z3

from kvspec.conformance.tools.cli import main
from kvspec.spec import attention
from kvspec.spec.lemmas import lemma_by_name, sliding_window
from kvspec.spec.lemmas.backend import Z3
from kvspec.spec.lemmas.prover import decide_false, decide_true
from kvspec.spec.lemmas.report import prove
from kvspec.spec.ordering import PY

pytestmark = [pytest.mark.z3, pytest.mark.timeout(120)]

LEMMA = lemma_by_name(sliding_window.NAME)


def test_registered_as_lemma_9_for_every_profile_checked_once():
    assert LEMMA.number == 9
    assert not LEMMA.profile_sensitive and not LEMMA.twin_profile_sensitive
    assert LEMMA.holds_for_text == LEMMA.applies_to_text == "every profile"
    report = prove(None, [LEMMA])
    assert report.ok
    assert [(r.profile, r.kind, r.verdict.status) for r in report.results] == [
        (None, "lemma", "proved"),
        (None, "twin", "refuted"),
    ]


def test_every_obligation_is_proved_unbounded_and_fast():
    obligations = sliding_window.obligations()
    assert len(obligations) == 6 and all(ob.bound is None for ob in obligations)
    for ob in obligations:
        verdict = decide_true([ob])
        assert verdict.status == "proved", (ob.name, verdict)
        assert verdict.seconds < 5, (ob.name, verdict.seconds)


def test_twin_counterexample_is_a_real_case_the_floor_misses():
    verdict = decide_false(sliding_window.twin_obligations())
    assert verdict.status == "refuted"
    text = verdict.counterexample or ""
    found = {k: int(v) for k, v in re.findall(r"(num_tokens|window|block_size|hit_blocks)=(\d+)", text)}
    assert set(found) == {"num_tokens", "window", "block_size", "hit_blocks"}, text
    num_tokens, window, block_size, hit = found["num_tokens"], found["window"], found["block_size"], found["hit_blocks"]
    assert window >= 2 and block_size >= 1 and 0 <= hit <= (num_tokens - 1) // block_size
    floor = (window - 1) // block_size
    first_real = max(0, hit - floor)
    first_read = attention.num_skipped_tokens(attention.KVGroup("sliding", window), hit * block_size)
    assert first_real * block_size > first_read, text  # a token the first computed one reads is in a null block
    # The ceiling the lemma uses holds that same case.
    need = attention.window_hit_blocks(window, block_size)
    assert max(0, hit - need) * block_size <= first_read


@pytest.mark.parametrize(
    ("rule", "wrong", "claim"),
    [
        # a window one token shorter: the window start rule and the blocks kept disagree
        ("window_start_rule", lambda c, w, s, logic: attention.window_start_rule(c, w - 1, s, logic), 0),
        # one block too many skipped: a freed block holds a token read
        ("window_skip_rule", lambda c, w, b, q, logic: attention.window_skip_rule(c, w, b, q - 1, logic), 1),
        # one real block fewer than cdiv(W - 1, B): the hit misses a token read
        ("window_hit_blocks_rule", lambda w, b, k, logic: attention.window_hit_blocks_rule(w, b, k + 1, logic), 2),
    ],
)
def test_an_off_by_one_rule_is_refuted(monkeypatch, rule, wrong, claim):
    """Each of obligations 1-3 (after the three uniqueness ones) fails when its rule is off by one."""
    monkeypatch.setattr(sliding_window, rule, wrong)
    verdict = decide_true([sliding_window.obligations()[3 + claim]])
    assert verdict.status == "refuted" and verdict.counterexample, verdict


def _value(term: z3.ExprRef) -> object:
    v = z3.simplify(term)
    return z3.is_true(v) if z3.is_bool(v) else v.as_long()  # type: ignore[attr-defined]


def test_rules_on_z3_integers_agree_with_python():
    for c in range(0, 13):
        for w in range(2, 7):
            for b in range(1, 5):
                for q in range(-1, 5):
                    args = (c, w, b, q)
                    zs = [z3.IntVal(v) for v in args]
                    assert _value(attention.window_skip_rule(*zs, Z3)) == attention.window_skip_rule(*args, PY)
                    assert _value(attention.window_start_rule(zs[0], zs[1], zs[3], Z3)) == attention.window_start_rule(
                        c, w, q, PY
                    )
                    assert _value(attention.window_hit_blocks_rule(zs[1], zs[2], zs[3], Z3)) == (
                        attention.window_hit_blocks_rule(w, b, q, PY)
                    )


def test_prove_cli_json_for_lemma_9(capsys):
    assert main(["prove", "--lemma", "9", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [(r["lemma"], r["kind"], r["status"], r["obligations"]) for r in data["results"]] == [
        (sliding_window.NAME, "lemma", "proved", 6),
        (sliding_window.NAME, "twin", "refuted", 1),
    ]
    assert "reads from position" in data["results"][1]["counterexample"]
