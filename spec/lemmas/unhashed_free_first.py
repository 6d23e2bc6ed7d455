"""Lemma 3, `lemma_unhashed_free_evicted_first`: a block freed without a hash is evicted before
every block that was free when it was freed.

Nobody can hit a block without a hash, so keeping it buys nothing: `vllm-v1`
sends it to the left end, to be reused first. The obligation is the placement
by `free_blocks`; that it is then *evicted* first follows from lemma 2's
stability and in-order obligations (no operation reorders free blocks, and
`get_new_blocks` takes from the left).

It holds exactly for the profiles whose rule sends unhashed blocks left.
Under `vllm-v1-tail` (every freed block to the right end) it is false, and
that profile is this lemma's false twin. The free's `evict_first` is left
unknown: with it every freed block goes left, so the claim holds either way.
"""

from __future__ import annotations

import z3

from kvspec.spec.lemmas import pool_model as pm
from kvspec.spec.lemmas.backend import Universe
from kvspec.spec.lemmas.prover import Formula, Obligation
from kvspec.spec.ordering import PROFILES, ProfileRule

__all__ = ["NAME", "TWIN_PROFILE", "holds_for", "obligations", "twin_obligations"]

NAME = "lemma_unhashed_free_evicted_first"
TWIN_PROFILE = "vllm-v1-tail"  # the profile whose rule makes this lemma false


def holds_for(rule: ProfileRule) -> bool:
    """The lemma holds for a profile iff its rule sends unhashed blocks to the left end."""
    return rule.unhashed_to_left


def obligations(rule: ProfileRule) -> list[Obligation]:
    """The placement by free_blocks, under one profile's rule."""

    def build(u: Universe) -> Formula:
        s = pm.fresh_state(u, "before")
        batch = pm.fresh_batch(u, "freed")
        evict_first = z3.Bool("evict_first")  # either: a hashless block goes left with or without it
        step = pm.free_blocks(u, s, batch, rule.unhashed_to_left, evict_first=evict_first)
        after = step.post
        b, y = z3.Ints("b y")
        label = pm.hash_labeller()
        return Formula(
            hypotheses=[
                pm.all_invariants(u, s),
                step.guard,
                step.axioms,
                pm.in_batch(batch, b),
                s.ref_cnt[b] == 1,
                z3.Not(s.has_hash[b]),
                pm.in_queue(s, y),
            ],
            claim=z3.And(pm.in_queue(after, b), pm.in_queue(after, y), after.queue_pos[b] < after.queue_pos[y]),
            render=lambda m: "\n".join(
                [
                    pm.render_state(m, s, "before", label),
                    f"  free_blocks(block_ids={pm.render_batch(m, batch)}, evict_first={pm.model_bool(m, evict_first)})"
                    f" [profile {rule.name}]",
                    pm.render_state(m, after, "after", label),
                    f"  block {pm.model_int(m, b)} was freed without a hash, but block "
                    f"{pm.model_int(m, y)}, free before the call, is in front of it",
                ]
            ),
        )

    return [Obligation("free_blocks puts a block freed without a hash in front of every block already free", build)]


def twin_obligations(rule: ProfileRule) -> list[Obligation]:
    """The false twin: the same placement under the profile that sends every freed block right."""
    return obligations(PROFILES[TWIN_PROFILE])
