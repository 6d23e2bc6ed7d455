"""Lemma 5, `lemma_hit_cap_within_prompt`: for every prompt length L >= 1, block size B >= 1
and cached chain length c >= 0, the tokens reused, B * min(c, (L - 1) // B), are at most L - 1.

The last prompt token is always computed: its logits sample the first output
token. The formulas are spec.ordering's own (`max_hit_blocks_rule`,
`num_hit_tokens`, `hit_tokens_within_cap`), evaluated on z3 integers with no
bound on L, B or c. `//` of two unknowns is nonlinear and z3 reasons about it
poorly, so the quotient q is a variable pinned by the division rule
`B * q <= L - 1 < B * (q + 1)`; a second obligation shows the rule has one
solution, so q is `(L - 1) // B` and nothing else. The false twin is the
off-by-one cap `L // B`, which reuses the whole prompt when B divides L.
"""

from __future__ import annotations

import z3

from kvspec.spec.lemmas.backend import Z3, Universe
from kvspec.spec.lemmas.prover import Formula, Obligation
from kvspec.spec.ordering import hit_tokens_within_cap, max_hit_blocks_rule, num_hit_tokens

__all__ = ["NAME", "obligations", "twin_obligations"]

NAME = "lemma_hit_cap_within_prompt"


def _within_cap(off_by_one: bool) -> Obligation:
    def build(u: Universe) -> Formula:
        num_tokens, block_size, num_cached, quotient = z3.Ints("num_tokens block_size num_cached_blocks max_hit_blocks")
        # The twin divides L instead of L - 1: the division rule for L + 1 tokens.
        divided = num_tokens + 1 if off_by_one else num_tokens
        reused = num_hit_tokens(block_size, num_cached, quotient, Z3)
        hypotheses = [
            num_tokens >= 1,
            block_size >= 1,
            num_cached >= 0,
            max_hit_blocks_rule(divided, block_size, quotient, Z3),
        ]
        if u.bound is not None:
            hypotheses += [num_tokens <= 4 * u.bound, block_size <= u.bound, num_cached <= u.bound]
        cap = "num_tokens // block_size" if off_by_one else "(num_tokens - 1) // block_size"
        return Formula(
            hypotheses=hypotheses,
            claim=hit_tokens_within_cap(num_tokens, reused, Z3),
            render=lambda m: (
                f"  num_tokens={m.eval(num_tokens, model_completion=True)} "
                f"block_size={m.eval(block_size, model_completion=True)} "
                f"num_cached_blocks={m.eval(num_cached, model_completion=True)}: "
                f"max_hit_blocks = {cap} = {m.eval(quotient, model_completion=True)}, "
                f"reused {m.eval(reused, model_completion=True)} tokens, "
                f"but at most num_tokens - 1 = {m.eval(num_tokens - 1, model_completion=True)} may be"
            ),
        )

    if off_by_one:
        return Obligation("a hit capped at num_tokens // block_size blocks leaves the last token", build)
    return Obligation("a hit capped at (num_tokens - 1) // block_size blocks leaves the last token", build)


def _quotient_unique() -> Obligation:
    def build(u: Universe) -> Formula:
        num_tokens, block_size, q1, q2 = z3.Ints("num_tokens block_size q1 q2")
        return Formula(
            hypotheses=[
                num_tokens >= 1,
                block_size >= 1,
                max_hit_blocks_rule(num_tokens, block_size, q1, Z3),
                max_hit_blocks_rule(num_tokens, block_size, q2, Z3),
            ],
            claim=q1 == q2,
            render=lambda m: (
                f"  num_tokens={m.eval(num_tokens)} block_size={m.eval(block_size)}: "
                f"both {m.eval(q1)} and {m.eval(q2)} satisfy the division rule"
            ),
        )

    return Obligation("the division rule has exactly one solution, (num_tokens - 1) // block_size", build)


def obligations() -> list[Obligation]:
    """The cap, for every L, B and c; and that the division rule names the quotient."""
    return [_quotient_unique(), _within_cap(off_by_one=False)]


def twin_obligations() -> list[Obligation]:
    """The false twin: the cap computed from L instead of L - 1."""
    return [_within_cap(off_by_one=True)]
