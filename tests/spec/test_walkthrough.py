"""Seed 000's six-block walkthrough: every golden state, on the spec and on the reference."""

import pytest

from kvspec.conformance.targets.builtin import make_reference, make_spec
from kvspec.conformance.tools.walkthrough import load_golden, render_step, run_walkthrough
from kvspec.spec.invariants import check_all


@pytest.mark.parametrize("factory", [make_spec, make_reference], ids=["spec", "reference"])
def test_walkthrough_matches_every_golden_state(factory):
    golden = load_golden()["steps"]
    steps = run_walkthrough(factory)
    assert [s.step for s in steps] == [g["step"] for g in golden]
    for got, want in zip(steps, golden):
        expected = {k: want[k] for k in ("ref_cnt", "free_queue", "hash_table", "block_tables")}
        if "num_computed_tokens" in want:
            expected["num_computed_tokens"] = want["num_computed_tokens"]
        assert got.as_golden() == expected, f"step {got.step}: {got.action}"
        check_all(got.snapshot)


def test_walkthrough_renders_changed_blocks_marked():
    steps = run_walkthrough(make_reference)
    text = render_step(steps[5], steps[4])
    assert "free queue   (left is taken first)  4 3 5 6 2 1" in text
    assert "[4 ref=0]* " in text  # block 4 was freed in this step
    assert "h1 -> [1]" in text
