"""Lemma 9, `lemma_sliding_window_frees_only_unread`: a `sliding:W` group frees only blocks no
token reads again, and a sliding-window hit within the cap holds every token the first
computed token reads, for every computed count c >= 0, window W >= 2, block size B >= 1 and
prompt length L >= 1.

Once c tokens are computed, the next token (position c) reads positions
max(0, c - W + 1) .. c; the group frees the leading blocks that hold only
earlier tokens and puts the null block in their place (spec.attention). The
obligations are on z3 integers with no bound, built from spec.attention's
backend-generic rules: `window_start_rule` (the first position read),
`window_skip_rule` (the blocks skipped) and `window_hit_blocks_rule` (the
real blocks a hit needs), and spec.ordering's `max_hit_blocks_rule` and
`hit_tokens_within_cap` for the cap (lemma 5). `//` of two unknowns is
nonlinear, so each quotient is a variable pinned by its rule, and an
obligation per rule shows it has exactly one solution (z3's own integer
division satisfies it, and no other value does):

1. the blocks kept cover the window: with q blocks skipped, the first
   position read s lies in block q, q * B <= s < (q + 1) * B; no freed block
   holds a token read, and no further block could be freed;
2. the blocks freed are never needed again: for every c' >= c, the window
   starts no earlier (s <= s'), the skip count does not decrease (q <= q'),
   and every token of a freed block lies before the window, q * B <= s';
3. a hit of n blocks found within max_length = L - 1 (n <= (L - 1) // B)
   whose last k = cdiv(W - 1, B) blocks are real, or n < k real blocks from
   the start, holds every token the first computed token (position n * B)
   reads: its first real block max(0, n - k) starts at or before that
   token's window, and the hit leaves the last prompt token to compute.

The false twin counts the real blocks a hit needs with the floor
(W - 1) // B instead of the ceiling: one block short whenever B does not
divide W - 1, so the first computed token reads a token of a null block.
"""

from __future__ import annotations

from collections.abc import Callable

import z3

from kvspec.spec.attention import window_hit_blocks_rule, window_skip_rule, window_start_rule
from kvspec.spec.lemmas.backend import Z3, Universe
from kvspec.spec.lemmas.prover import Formula, Obligation
from kvspec.spec.ordering import hit_tokens_within_cap, max_hit_blocks_rule

__all__ = ["NAME", "obligations", "twin_obligations"]

NAME = "lemma_sliding_window_frees_only_unread"


def _value(m: z3.ModelRef, term: z3.ArithRef) -> str:
    return str(m.eval(term, model_completion=True))


def _bounded(u: Universe, small: list[z3.ArithRef], tokens: list[z3.ArithRef]) -> list[z3.BoolRef]:
    """Bounded (the search for a small counterexample): blocks up to n, tokens up to 4n."""
    if u.bound is None:
        return []
    return [v <= u.bound for v in small] + [v <= 4 * u.bound for v in tokens]


def _window_kept() -> Obligation:
    def build(u: Universe) -> Formula:
        computed, window, block_size, start, skipped = z3.Ints("num_computed window block_size start skipped_blocks")
        return Formula(
            hypotheses=[
                computed >= 0,
                window >= 2,
                block_size >= 1,
                window_start_rule(computed, window, start, Z3),
                window_skip_rule(computed, window, block_size, skipped, Z3),
                *_bounded(u, [block_size], [computed, window]),
            ],
            claim=z3.And(skipped >= 0, block_size * skipped <= start, start < block_size * (skipped + 1)),
            render=lambda m: (
                f"  num_computed={_value(m, computed)} window={_value(m, window)} "
                f"block_size={_value(m, block_size)}: {_value(m, skipped)} blocks skipped, "
                f"but the next token reads from position {_value(m, start)}"
            ),
        )

    return Obligation("the first position the next token reads lies in the first block kept", build)


def _never_needed_again() -> Obligation:
    def build(u: Universe) -> Formula:
        computed, later, window, block_size = z3.Ints("num_computed later_computed window block_size")
        start, later_start, skipped, later_skipped = z3.Ints("start later_start skipped_blocks later_skipped_blocks")
        return Formula(
            hypotheses=[
                computed >= 0,
                later >= computed,
                window >= 2,
                block_size >= 1,
                window_skip_rule(computed, window, block_size, skipped, Z3),
                window_start_rule(later, window, later_start, Z3),
                window_skip_rule(later, window, block_size, later_skipped, Z3),
                window_start_rule(computed, window, start, Z3),
                *_bounded(u, [block_size], [computed, later, window]),
            ],
            claim=z3.And(start <= later_start, skipped <= later_skipped, block_size * skipped <= later_start),
            render=lambda m: (
                f"  window={_value(m, window)} block_size={_value(m, block_size)}: after "
                f"{_value(m, computed)} tokens {_value(m, skipped)} blocks are freed, but after "
                f"{_value(m, later)} the next token reads from position {_value(m, later_start)}"
            ),
        )

    return Obligation("a freed block holds only tokens before the window of every later token", build)


def _hit_covers_window(floor: bool) -> Obligation:
    how = "(window - 1) // block_size" if floor else "cdiv(window - 1, block_size)"

    def build(u: Universe) -> Formula:
        num_tokens, window, block_size = z3.Ints("num_tokens window block_size")
        max_blocks, hit, need, start = z3.Ints("max_hit_blocks hit_blocks need start")
        # The twin needs (W - 1) // B real blocks: spec.ordering's cap rule for W tokens is that floor.
        rule = max_hit_blocks_rule if floor else window_hit_blocks_rule
        first_real = z3.If(hit >= need, hit - need, 0)  # fewer than k blocks: a run from block 0
        return Formula(
            hypotheses=[
                num_tokens >= 1,
                window >= 2,
                block_size >= 1,
                max_hit_blocks_rule(num_tokens, block_size, max_blocks, Z3),
                hit >= 0,
                hit <= max_blocks,
                rule(window, block_size, need, Z3),
                window_start_rule(block_size * hit, window, start, Z3),
                *_bounded(u, [block_size, hit], [num_tokens, window]),
            ],
            claim=z3.And(block_size * first_real <= start, hit_tokens_within_cap(num_tokens, block_size * hit, Z3)),
            render=lambda m: (
                f"  num_tokens={_value(m, num_tokens)} window={_value(m, window)} "
                f"block_size={_value(m, block_size)} hit_blocks={_value(m, hit)}: need = {how} = "
                f"{_value(m, need)} real blocks, from position {_value(m, block_size * first_real)}, "
                f"but the first computed token, position {_value(m, block_size * hit)}, "
                f"reads from position {_value(m, start)} (hit cap (num_tokens - 1) // block_size = "
                f"{_value(m, max_blocks)})"
            ),
        )

    return Obligation(f"a hit whose last {how} blocks are real holds the first computed token's window", build)


def _unique(
    name: str,
    params: str,
    rule: Callable[[list[z3.ArithRef], z3.ArithRef], z3.BoolRef],
    witness: Callable[[list[z3.ArithRef]], z3.ArithRef],
    ranges: Callable[[list[z3.ArithRef]], list[z3.BoolRef]],
) -> Obligation:
    """The rule holds for `witness` (z3's own integer division) and for no other value."""

    def build(u: Universe) -> Formula:
        args = list(z3.Ints(params))
        q1, q2 = z3.Ints("q1 q2")
        w = witness(args)

        def render(m: z3.ModelRef) -> str:
            given = " ".join(f"{a}={_value(m, a)}" for a in args)
            if _value(m, q1) != _value(m, q2):
                return f"  {given}: both {_value(m, q1)} and {_value(m, q2)} satisfy the rule"
            return f"  {given}: the rule does not hold for {_value(m, w)}"

        return Formula(
            hypotheses=[*ranges(args), rule(args, q1), rule(args, q2), *_bounded(u, [], args)],
            claim=z3.And(q1 == q2, rule(args, w)),
            render=render,
        )

    return Obligation(name, build)


def _rules_unique() -> list[Obligation]:
    def first_read(c: z3.ArithRef, w: z3.ArithRef) -> z3.ArithRef:
        return z3.If(c - w + 1 > 0, c - w + 1, 0)

    return [
        _unique(
            "the window start rule has exactly one solution, max(0, num_computed - window + 1)",
            "num_computed window",
            lambda a, s: window_start_rule(a[0], a[1], s, Z3),
            lambda a: first_read(a[0], a[1]),
            lambda a: [a[0] >= 0, a[1] >= 2],
        ),
        _unique(
            "the skip rule has exactly one solution, max(0, num_computed - window + 1) // block_size",
            "num_computed window block_size",
            lambda a, q: window_skip_rule(a[0], a[1], a[2], q, Z3),
            lambda a: first_read(a[0], a[1]) / a[2],
            lambda a: [a[0] >= 0, a[1] >= 2, a[2] >= 1],
        ),
        _unique(
            "the hit rule has exactly one solution, cdiv(window - 1, block_size)",
            "window block_size",
            lambda a, k: window_hit_blocks_rule(a[0], a[1], k, Z3),
            lambda a: (a[0] - 2) / a[1] + 1,  # cdiv(W - 1, B) = (W - 2) // B + 1 for W >= 2
            lambda a: [a[0] >= 2, a[1] >= 1],
        ),
    ]


def obligations() -> list[Obligation]:
    """The rules name their values; the window is kept; freed blocks stay unread; a hit holds its window."""
    return [*_rules_unique(), _window_kept(), _never_needed_again(), _hit_covers_window(floor=False)]


def twin_obligations() -> list[Obligation]:
    """The false twin: a hit that keeps only (window - 1) // block_size real blocks."""
    return [_hit_covers_window(floor=True)]
