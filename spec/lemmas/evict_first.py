"""Lemma 10, `lemma_evict_first_free_evicted_before_cached`: a block freed with `evict_first` is
evicted before every cached block freed without it.

vLLM 0.34.0's `BlockPool.free_blocks(..., evict_first=True)` is for blocks
whose content another tier (a CPU or disk cache behind a connector) already
holds: keeping them in the GPU cache buys little, so they should be the first
cached blocks to go. Under a queue policy the free sends every block it
releases to the left end, in the batch of the blocks without a hash, so the
obligation is the placement: each such block is in front of every cached
block already free. Every cached block freed later without `evict_first`
goes to the right end (lemma 2's placement), and no operation reorders free
blocks (lemma 2's stability, which covers frees with `evict_first` too), so
eviction follows that order.

Under a keyed policy the free stamps every block it names into the first
tier of its key (spec.ordering.eviction_key), and a later free without it
stamps the blocks it names into the second: the obligation is the order
`keyed_rank` gives right after the free, against every free cached block of
the second tier, whatever their stamps.

The false twin is the free that ignores `evict_first` (the mutant
`free_ignores_evict_first` in kvspec.mutants): under every profile a
counterexample puts a cached block already free in front of the freed one.
"""

from __future__ import annotations

import z3

from kvspec.spec.lemmas import pool_model as pm
from kvspec.spec.lemmas import stamps
from kvspec.spec.lemmas.backend import Universe
from kvspec.spec.lemmas.prover import Formula, Obligation
from kvspec.spec.ordering import ProfileRule

__all__ = ["NAME", "obligations", "twin_obligations"]

NAME = "lemma_evict_first_free_evicted_before_cached"


def _before_cached(rule: ProfileRule, evict_first: bool) -> Obligation:
    """A queue policy: the freed block is in front of every cached block already free."""

    def build(u: Universe) -> Formula:
        s = pm.fresh_state(u, "before")
        batch = pm.fresh_batch(u, "freed")
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
                pm.in_queue(s, y),
                s.has_hash[y],
            ],
            claim=z3.And(pm.in_queue(after, b), pm.in_queue(after, y), after.queue_pos[b] < after.queue_pos[y]),
            render=lambda m: "\n".join(
                [
                    pm.render_state(m, s, "before", label),
                    f"  free_blocks(block_ids={pm.render_batch(m, batch)}, evict_first=True) [profile {rule.name}]"
                    + ("" if evict_first else ", by a free that ignores evict_first"),
                    pm.render_state(m, after, "after", label),
                    f"  block {pm.model_int(m, b)} was freed to be evicted first, but cached block "
                    f"{pm.model_int(m, y)}, free before the call, is in front of it",
                ]
            ),
        )

    return Obligation("free_blocks with evict_first puts a freed block in front of every cached free block", build)


def _before_cached_keyed(rule: ProfileRule, evict_first: bool) -> Obligation:
    """A keyed policy: the freed block ranks before every free cached block of the second tier."""

    def build(u: Universe) -> Formula:
        s, st = pm.fresh_state(u, "before"), stamps.fresh_stamps("before")
        batch = pm.fresh_batch(u, "freed")
        step = pm.free_blocks(u, s, batch, rule.unhashed_to_left)
        after, st_after = step.post, stamps.after_free(st, batch, evict_first)
        b, y = z3.Ints("b y")
        return Formula(
            hypotheses=[
                stamps.keyed_state(u, rule, s, st),
                step.guard,
                step.axioms,
                pm.in_batch(batch, b),
                s.ref_cnt[b] == 1,
                pm.in_queue(s, y),
                s.has_hash[y],
                z3.Not(st.is_evict_first[y]),  # freed without evict_first
            ],
            claim=stamps.before(rule, after, st_after, b, y),
            render=lambda m: "\n".join(
                [
                    pm.render_state(m, s, "before", pm.hash_labeller()),
                    stamps.render_stamps(m, st, {"freed": b, "cached": y}, "before"),
                    f"  free_blocks(block_ids={pm.render_batch(m, batch)}, evict_first=True) [profile {rule.name}]"
                    + ("" if evict_first else ", by a free that ignores evict_first"),
                    stamps.render_stamps(m, st_after, {"freed": b, "cached": y}, "after"),
                    f"  block {pm.model_int(m, b)} was freed to be evicted first, but cached block "
                    f"{pm.model_int(m, y)} is evicted before it",
                ]
            ),
        )

    return Obligation("free_blocks with evict_first ranks a freed block before every cached free block", build)


def obligations(rule: ProfileRule) -> list[Obligation]:
    """The placement (queue policy) or rank (keyed policy) of a block freed with evict_first."""
    return [(_before_cached_keyed if rule.keyed else _before_cached)(rule, True)]


def twin_obligations(rule: ProfileRule) -> list[Obligation]:
    """The false twin: the same claim for a free that ignores evict_first."""
    return [(_before_cached_keyed if rule.keyed else _before_cached)(rule, False)]
