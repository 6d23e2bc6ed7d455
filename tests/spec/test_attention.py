"""spec.attention: the plain functions and the backend-generic rules z3 reads say the same, on a grid.

Lemma 9 is proved about the rules (`window_start_rule`, `window_skip_rule`,
`window_hit_blocks_rule`); the spec and the implementations' tests call the
plain functions. Each rule must hold for the plain function's value and for
no other, for every small computed count, window, chunk and block size.
"""

from __future__ import annotations

from kvspec.spec.attention import (
    KVGroup,
    chunk_start_rule,
    num_skipped_blocks,
    num_skipped_tokens,
    window_hit_blocks,
    window_hit_blocks_rule,
    window_skip_rule,
    window_start_rule,
)
from kvspec.spec.ordering import PY

COMPUTED = range(0, 41)
WINDOWS = range(2, 13)
BLOCK_SIZES = range(1, 9)


def _solutions(rule, args: tuple[int, ...], candidates: range) -> list[int]:
    """The candidates v for which `rule(*args, v, PY)` holds."""
    return [v for v in candidates if rule(*args, v, PY)]


def test_window_start_rule_is_num_skipped_tokens():
    for c in COMPUTED:
        for w in WINDOWS:
            expected = num_skipped_tokens(KVGroup("sliding", w), c)
            assert expected == max(0, c - w + 1)
            assert _solutions(window_start_rule, (c, w), range(-3, c + 4)) == [expected], (c, w)


def test_window_skip_rule_is_num_skipped_blocks():
    for c in COMPUTED:
        for w in WINDOWS:
            for b in BLOCK_SIZES:
                expected = num_skipped_blocks(KVGroup("sliding", w), c, b)
                found = _solutions(window_skip_rule, (c, w, b), range(-3, c + 4))
                assert found == [expected], (c, w, b)


def test_window_hit_blocks_rule_is_window_hit_blocks():
    for w in range(2, 40):
        for b in BLOCK_SIZES:
            expected = window_hit_blocks(w, b)
            assert expected == -(-(w - 1) // b) and expected * b >= w - 1 > (expected - 1) * b
            assert _solutions(window_hit_blocks_rule, (w, b), range(-3, w + 4)) == [expected], (w, b)


def test_chunk_start_rule_is_num_skipped_tokens():
    for n in COMPUTED:
        for size in range(1, 13):
            expected = num_skipped_tokens(KVGroup("chunked", size), n)
            found = _solutions(chunk_start_rule, (n, size), range(-3, n + size + 4))
            assert found == [expected], (n, size)


def test_full_attention_skips_nothing():
    full = KVGroup("full")
    assert not full.skips
    assert all(num_skipped_tokens(full, c) == 0 and num_skipped_blocks(full, c, 4) == 0 for c in COMPUTED)
