"""Lemma 8, `lemma_fewer_accesses_evicted_first`: of two free cached blocks, the one with fewer
accesses is evicted first (LFU, seed 002).

Seed 002's answer to a hit rate that stays low under LRU: keep what is used
often, not what was used last. Under `lfu` the key of a free hashed block
starts with its access count (the allocation and every hit since), so the
claim is the key's first term, for any stamps the clock could have written.
Every other keyed policy breaks it: `lru-timestamp` and `block-age` never read
the count, and `lru-lfu:W` lets enough recency outweigh any count. The false
twin says "at most as many accesses", which equal counts refute: `lfu` then
orders by last access. Queue policies keep no counts, so the lemma is about
keyed policies only. It compares blocks of one tier: a block freed with
`evict_first` goes before every cached block freed without it, whatever the
counts (lemma 10).
"""

from __future__ import annotations

import z3

from kvspec.spec.lemmas import pool_model as pm
from kvspec.spec.lemmas import stamps
from kvspec.spec.lemmas.backend import Universe
from kvspec.spec.lemmas.prover import Formula, Obligation
from kvspec.spec.ordering import ProfileRule

__all__ = ["NAME", "holds_for", "obligations", "twin_obligations"]

NAME = "lemma_fewer_accesses_evicted_first"


def holds_for(rule: ProfileRule) -> bool:
    """Only `lfu`, whose key leads with the access count."""
    return rule.key == "accesses"


def _fewer_first(rule: ProfileRule, strictly: bool) -> Obligation:
    def build(u: Universe) -> Formula:
        s, st = pm.fresh_state(u, "pool"), stamps.fresh_stamps("pool")
        a, b = z3.Ints("fewer more")
        fewer = st.num_accesses[a] < st.num_accesses[b] if strictly else st.num_accesses[a] <= st.num_accesses[b]
        return Formula(
            hypotheses=[
                stamps.keyed_state(u, rule, s, st),
                pm.in_queue(s, a),
                pm.in_queue(s, b),
                a != b,
                s.has_hash[a],
                s.has_hash[b],
                st.is_evict_first[a] == st.is_evict_first[b],  # one tier (lemma 10 orders the tiers)
                fewer,
            ],
            claim=stamps.before(rule, s, st, a, b),
            render=lambda m: "\n".join(
                [
                    pm.render_state(m, s, "pool", pm.hash_labeller()),
                    stamps.render_stamps(m, st, {"fewer": a, "more": b}, f"[profile {rule.name}]"),
                    f"  block {pm.model_int(m, a)} is evicted after block {pm.model_int(m, b)}",
                ]
            ),
        )

    how = "fewer" if strictly else "at most as many"
    return Obligation(f"a free cached block with {how} accesses than another is evicted before it", build)


def obligations(rule: ProfileRule) -> list[Obligation]:
    """The order of two free hashed blocks with different access counts."""
    return [_fewer_first(rule, strictly=True)]


def twin_obligations(rule: ProfileRule) -> list[Obligation]:
    """The false twin: the same for at most as many accesses (equal counts included)."""
    return [_fewer_first(rule, strictly=False)]
