"""Lemma 1, `lemma_tail_first_free_evicts_deeper_first`: a request freed tail-first leaves its
hashed blocks so that a deeper block is evicted before any of its ancestors.

The longer a prefix, the fewer requests share it, so the deepest blocks of a
finished request are the least worth keeping. The manager frees a request's
block table reversed (`spec.manager.free`); blocks that reach ref_cnt 0 with
a hash go right in that order, so the deepest one sits furthest left among
them. The obligation is the placement by `free_blocks` of a reversed block
table; eviction in that order follows from lemma 2's stability and in-order
obligations. Blocks another request still holds are not freed and not
constrained. The false twin frees the block table head-first. The free's
`evict_first` is left unknown: with it the hashed blocks go left instead,
still in the order freed (vLLM's `prepend_n` keeps a batch's order), or, under
a keyed policy, into one tier together.

Under a keyed policy (seed 002) the free stamps every block it names in the
order named, so the deeper block's last access is the older one. That is the
whole order only where the key is the last access (`lru-timestamp`,
`lru-lfu:0`); `block-age` keeps the block registered last, usually the
deeper one, and under `lfu` or `lru-lfu:W>0` a deeper block hit more often
than its ancestor outlives it: z3 refutes those. The keyed obligations are the
order `keyed_rank` gives right after the free, and that a free leaves the
stamps of every block already free alone (so the order lasts while both stay
free and hashed).
"""

from __future__ import annotations

import z3

from kvspec.spec.lemmas import pool_model as pm
from kvspec.spec.lemmas import stamps
from kvspec.spec.lemmas.backend import Universe
from kvspec.spec.lemmas.prover import Formula, Obligation
from kvspec.spec.ordering import ProfileRule

__all__ = ["NAME", "obligations", "twin_obligations"]

NAME = "lemma_tail_first_free_evicts_deeper_first"


def _deeper_first(rule: ProfileRule, tail_first: bool) -> Obligation:
    def build(u: Universe) -> Formula:
        s = pm.fresh_state(u, "before")
        freed = pm.fresh_batch(u, "freed")
        evict_first = z3.Bool("evict_first")  # either: the freed blocks share an end, kept in batch order
        step = pm.free_blocks(u, s, freed, rule.unhashed_to_left, evict_first=evict_first)
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
                    f"free_blocks(block_ids={pm.render_batch(mdl, freed)}, "
                    f"evict_first={pm.model_bool(mdl, evict_first)}) [profile {rule.name}]",
                    pm.render_state(mdl, after, "after", label),
                    f"  block {pm.model_int(mdl, deeper)} (table index {pm.model_int(mdl, deeper_index)}) is "
                    f"behind its ancestor {pm.model_int(mdl, ancestor)} (index {pm.model_int(mdl, ancestor_index)})",
                ]
            ),
        )

    how = "tail-first" if tail_first else "head-first"
    return Obligation(f"a block table freed {how} puts deeper hashed blocks in front of their ancestors", build)


def _deeper_first_keyed(rule: ProfileRule, tail_first: bool) -> Obligation:
    def build(u: Universe) -> Formula:
        s, st = pm.fresh_state(u, "before"), stamps.fresh_stamps("before")
        freed = pm.fresh_batch(u, "freed")
        evict_first = z3.Bool("evict_first")  # either: both blocks land in one tier, ordered by their stamps
        step = pm.free_blocks(u, s, freed, rule.unhashed_to_left)
        after, st_after = step.post, stamps.after_free(st, freed, evict_first)
        p, q = z3.Ints("first_freed second_freed")
        first, second = freed.ids[p], freed.ids[q]
        deeper, ancestor = (first, second) if tail_first else (second, first)
        order = "tail-first (reversed)" if tail_first else "head-first (in block-table order)"
        return Formula(
            hypotheses=[
                stamps.keyed_state(u, rule, s, st),
                step.guard,
                step.axioms,
                p >= 0,
                p < q,
                q < freed.length,
                s.ref_cnt[first] == 1,
                s.ref_cnt[second] == 1,
                s.has_hash[first],
                s.has_hash[second],
            ],
            claim=stamps.before(rule, after, st_after, deeper, ancestor),
            render=lambda mdl: "\n".join(
                [
                    pm.render_state(mdl, s, "before", pm.hash_labeller()),
                    stamps.render_stamps(mdl, st, {"deeper": deeper, "ancestor": ancestor}, "before"),
                    f"  the request's blocks freed {order}: free_blocks(block_ids={pm.render_batch(mdl, freed)}, "
                    f"evict_first={pm.model_bool(mdl, evict_first)}) [profile {rule.name}]",
                    stamps.render_stamps(mdl, st_after, {"deeper": deeper, "ancestor": ancestor}, "after"),
                    f"  the deeper block {pm.model_int(mdl, deeper)} is evicted after its ancestor "
                    f"{pm.model_int(mdl, ancestor)}",
                ]
            ),
        )

    how = "tail-first" if tail_first else "head-first"
    return Obligation(f"a block table freed {how} orders deeper hashed blocks before their ancestors by key", build)


def _free_keeps_free_stamps(rule: ProfileRule) -> Obligation:
    def build(u: Universe) -> Formula:
        s, st = pm.fresh_state(u, "before"), stamps.fresh_stamps("before")
        freed = pm.fresh_batch(u, "freed")
        step = pm.free_blocks(u, s, freed, rule.unhashed_to_left)
        after = stamps.after_free(st, freed)
        b = z3.Int("free_block")
        return Formula(
            hypotheses=[pm.all_invariants(u, s), step.guard, step.axioms, pm.in_queue(s, b)],
            claim=z3.And(
                after.last_access[b] == st.last_access[b],
                after.num_accesses[b] == st.num_accesses[b],
                after.registered_at[b] == st.registered_at[b],
                after.is_evict_first[b] == st.is_evict_first[b],
            ),
            render=lambda mdl: pm.render_state(mdl, s, "before", pm.hash_labeller()),
        )

    return Obligation("free_blocks leaves the stamps of every block already free alone", build)


def obligations(rule: ProfileRule) -> list[Obligation]:
    """The placement by free_blocks of a reversed block table, under one profile's rule."""
    if rule.keyed:
        return [_deeper_first_keyed(rule, tail_first=True), _free_keeps_free_stamps(rule)]
    return [_deeper_first(rule, tail_first=True)]


def twin_obligations(rule: ProfileRule) -> list[Obligation]:
    """The false twin: the same claim for a block table freed head-first."""
    if rule.keyed:
        return [_deeper_first_keyed(rule, tail_first=False)]
    return [_deeper_first(rule, tail_first=False)]
