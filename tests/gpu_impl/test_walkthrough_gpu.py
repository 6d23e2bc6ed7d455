"""Seed 000's six-block walkthrough on gpu_impl: every golden state, through the built-in adapter."""

from kvspec.conformance.tools.walkthrough import load_golden, run_walkthrough
from kvspec.gpu_impl.adapter import make_adapter
from kvspec.spec.invariants import check_all


def test_walkthrough_matches_every_golden_state_on_gpu_impl():
    golden = load_golden()["steps"]
    steps = run_walkthrough(make_adapter)
    assert [s.step for s in steps] == [g["step"] for g in golden]
    for got, want in zip(steps, golden):
        expected = {k: want[k] for k in ("ref_cnt", "free_queue", "hash_table", "block_tables")}
        if "num_computed_tokens" in want:
            expected["num_computed_tokens"] = want["num_computed_tokens"]
        assert got.as_golden() == expected, f"step {got.step}: {got.action}"
        check_all(got.snapshot)
