"""Lemma 1, `lemma_tail_first_free_evicts_deeper_first`: a request freed tail-first leaves its
hashed blocks so that a deeper block is evicted before any of its ancestors.

The longer a prefix, the fewer requests share it, so the deepest blocks of a
finished request are the least worth keeping. The manager frees a request's
block table reversed (`spec.manager.free`); blocks that reach ref_cnt 0 with
a hash go right in that order, so the deepest one sits furthest left among
them. The obligation is the placement by `free_blocks` of a reversed block
table; eviction in that order follows from lemma 2's stability and in-order
obligations. Blocks another request still holds are not freed and not
constrained. The false twin frees the block table head-first.
"""

from __future__ import annotations

import z3

from kvspec.spec.lemmas import pool_model as pm
from kvspec.spec.lemmas.backend import Universe
from kvspec.spec.lemmas.prover import Formula, Obligation
from kvspec.spec.ordering import ProfileRule

__all__ = ["NAME", "obligations", "twin_obligations"]

NAME = "lemma_tail_first_free_evicts_deeper_first"


def _deeper_first(rule: ProfileRule, tail_first: bool) -> Obligation:
    def build(u: Universe) -> Formula:
        s = pm.fresh_state(u, "before")
        freed = pm.fresh_batch(u, "freed")
        step = pm.free_blocks(u, s, freed, rule.unhashed_to_left)
        after = step.post
        m = freed.length
        # The request's block table: the batch reversed (spec.manager.free), or the batch
        # itself for the head-first twin. Table index k is batch index m - 1 - k.
        p, q = z3.Ints("first_freed second_freed")
        first, second = freed.ids[p], freed.ids[q]
        deeper, ancestor = (first, second) if tail_first else (second, first)
        deeper_index = m - 1 - p if tail_first else q
        ancestor_index = m - 1 - q if tail_first else p
        label = pm.hash_labeller()
        order = "tail-first (reversed)" if tail_first else "head-first (in block-table order)"

        def table(model: z3.ModelRef) -> str:
            ids = [pm.model_int(model, freed.ids[k]) for k in range(pm.model_int(model, m))]
            return str(ids[::-1] if tail_first else ids)

        return Formula(
            hypotheses=[
                pm.all_invariants(u, s),
                step.guard,
                step.axioms,
                p >= 0,
                p < q,
                q < m,
                s.ref_cnt[first] == 1,
                s.ref_cnt[second] == 1,
                s.has_hash[first],
                s.has_hash[second],
            ],
            claim=z3.And(
                pm.in_queue(after, ancestor),
                pm.in_queue(after, deeper),
                after.queue_pos[deeper] < after.queue_pos[ancestor],
            ),
            render=lambda mdl: "\n".join(
                [
                    pm.render_state(mdl, s, "before", label),
                    f"  the request's block table {table(mdl)}, freed {order}: "
                    f"free_blocks(block_ids={pm.render_batch(mdl, freed)}) [profile {rule.name}]",
                    pm.render_state(mdl, after, "after", label),
                    f"  block {pm.model_int(mdl, deeper)} (table index {pm.model_int(mdl, deeper_index)}) is "
                    f"behind its ancestor {pm.model_int(mdl, ancestor)} (index {pm.model_int(mdl, ancestor_index)})",
                ]
            ),
        )

    how = "tail-first" if tail_first else "head-first"
    return Obligation(f"a block table freed {how} puts deeper hashed blocks in front of their ancestors", build)


def obligations(rule: ProfileRule) -> list[Obligation]:
    """The placement by free_blocks of a reversed block table, under one profile's rule."""
    return [_deeper_first(rule, tail_first=True)]


def twin_obligations(rule: ProfileRule) -> list[Obligation]:
    """The false twin: the same claim for a block table freed head-first."""
    return [_deeper_first(rule, tail_first=False)]
