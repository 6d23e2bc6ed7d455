"""Lemma 7, `lemma_invariants_inductive`: the pool's state invariants hold in a fresh pool and every
pool operation preserves them, for any pool size and any arguments.

Invariants (spec.invariants, encoded in `pool_model.ENCODED_INVARIANTS` and
checked against the Python predicates on sampled states): ref_cnt >= 0,
null-block, free-has-zero-ref, hash-table-consistent, caching-off-no-hash,
the writable rule (a block is_block_writable names is neither free nor in the
hash table), and conservation. Each is an obligation per operation: from any
state satisfying all of them, a call whose arguments pass the operation's
checks yields a state satisfying it. Calls that fail their checks raise and
change nothing, so they need no proof. The read-only operations
(get_cached_block, get_num_free_blocks, get_usage, is_block_writable) change
nothing either.

Conservation counts, and z3 does not count by itself: it is proved to follow
from free-has-zero-ref and ref_cnt >= 0 in *every* state, by induction on
num_gpu_blocks (two obligations: the base case n = 1, and the step from n to
n + 1, which removes the last block, and its queue entry if it has one, and
applies the hypothesis to the smaller pool). Both premises are inductive, so
conservation is. Quarantine and request block tables are not pool state and
are left to the conformance machine.

The false twin is a free_blocks that skips the double-free check.

Under a keyed policy (seed 002) every operation leaves the free blocks the
queue's operation leaves, and re-derives their order from the stamps. The
obligations then take the queue's result in *any* order of the same free
blocks (`pool_model.rearranged`), so they hold whatever order the policy
gives: none of the invariants reads the order.
"""

from __future__ import annotations

import z3

from kvspec.spec.lemmas import pool_model as pm
from kvspec.spec.lemmas.backend import Universe
from kvspec.spec.lemmas.prover import Formula, Obligation
from kvspec.spec.ordering import ProfileRule

__all__ = ["COUNTED", "NAME", "PRESERVED", "obligations", "twin_obligations"]

NAME = "lemma_invariants_inductive"
COUNTED = "inv_conservation"  # proved by the counting induction, not per operation
PRESERVED = tuple(name for name in pm.ENCODED_INVARIANTS if name != COUNTED)  # proved per operation


def _initial(invariant: str) -> Obligation:
    def build(u: Universe) -> Formula:
        n = u.size("num_gpu_blocks", lo=1)
        caching = z3.Bool("enable_caching")
        s = pm.new_pool(u, n, caching, "new")
        label = pm.hash_labeller()
        return Formula(
            hypotheses=[],
            claim=pm.ENCODED_INVARIANTS[invariant](u, s),
            render=lambda m: pm.render_state(m, s, "new_pool", label) + f"\n  breaks {invariant}",
        )

    return Obligation(f"new_pool satisfies {invariant}", build)


def _preserved(rule: ProfileRule, op: str, invariant: str, check_ref_cnt: bool = True) -> Obligation:
    def build(u: Universe) -> Formula:
        s = pm.fresh_state(u, "before")
        if op == "free_blocks" and not check_ref_cnt:
            batch = pm.fresh_batch(u, "call.block_ids")
            step = pm.free_blocks(u, s, batch, rule.unhashed_to_left, check_ref_cnt=False)
            call = pm.Call(
                op, step, lambda m, h: f"free_blocks(block_ids={pm.render_batch(m, batch)}), no ref_cnt check"
            )
        else:
            call = pm.any_call(u, s, op, rule.unhashed_to_left, "call")
        after, reordered = call.step.post, z3.BoolVal(True)
        if rule.keyed:  # the same free blocks, in whatever order the policy derives
            after, reordered = pm.rearranged(u, after, "keyed")
        label = pm.hash_labeller()
        return Formula(
            hypotheses=[pm.all_invariants(u, s), call.step.guard, call.step.axioms, reordered],
            claim=pm.ENCODED_INVARIANTS[invariant](u, after),
            render=lambda m: "\n".join(
                [
                    pm.render_state(m, s, "before", label),
                    f"  {call.describe(m, label)} [profile {rule.name}]",
                    pm.render_state(m, after, "after", label),
                    f"  breaks {invariant}",
                ]
            ),
        )

    return Obligation(f"{op} preserves {invariant}", build)


def _counting_base() -> Obligation:
    def build(u: Universe) -> Formula:
        s = pm.fresh_state(u, "pool")
        label = pm.hash_labeller()
        return Formula(
            hypotheses=[
                s.num_gpu_blocks == 1,
                pm.free_queue_has_zero_ref(u, s),
                pm.ref_cnt_nonnegative(u, s),
            ],
            claim=pm.conservation(u, s),
            render=lambda m: pm.render_state(m, s, "pool", label) + "\n  breaks inv_conservation",
        )

    return Obligation("conservation follows from free-has-zero-ref and ref_cnt >= 0: one block", build)


def _counting_step() -> Obligation:
    def build(u: Universe) -> Formula:
        s = pm.fresh_state(u, "pool")
        last = s.num_gpu_blocks - 1  # the block removed to get the smaller pool
        held = s.ref_cnt[last] > 0
        p = s.queue_pos[last]  # where the last block sits in the queue when it is free
        i, b = z3.Ints("smaller.i smaller.b")
        smaller = pm.PoolVars(
            num_gpu_blocks=last,
            enable_caching=s.enable_caching,
            ref_cnt=s.ref_cnt,
            has_hash=s.has_hash,
            block_hash=s.block_hash,
            free_queue=z3.Lambda([i], z3.If(z3.Or(held, i < p), s.free_queue[i], s.free_queue[i + 1])),
            num_free=z3.If(held, s.num_free, s.num_free - 1),
            queue_pos=z3.Lambda([b], z3.If(z3.Or(held, s.queue_pos[b] < p), s.queue_pos[b], s.queue_pos[b] - 1)),
            table_count=s.table_count,
            table_hash=s.table_hash,
            key=s.key,
            key_free=s.key_free,
            lo=s.lo,
            hi=s.hi,
        )
        induction_hypothesis = z3.Implies(
            z3.And(pm.free_queue_has_zero_ref(u, smaller), pm.ref_cnt_nonnegative(u, smaller)),
            pm.conservation(u, smaller),
        )
        label = pm.hash_labeller()
        return Formula(
            hypotheses=[
                s.num_gpu_blocks >= 2,
                pm.free_queue_has_zero_ref(u, s),
                pm.ref_cnt_nonnegative(u, s),
                induction_hypothesis,
            ],
            claim=pm.conservation(u, s),
            render=lambda m: pm.render_state(m, s, "pool", label) + "\n  breaks inv_conservation",
        )

    return Obligation("conservation follows from free-has-zero-ref and ref_cnt >= 0: n blocks to n + 1", build)


def obligations(rule: ProfileRule) -> list[Obligation]:
    """Every invariant initially, after every operation, and the counting induction."""
    return [
        *(_initial(inv) for inv in PRESERVED),
        *(_preserved(rule, op, inv) for op in pm.OPERATIONS for inv in PRESERVED),
        _counting_base(),
        _counting_step(),
    ]


def twin_obligations(rule: ProfileRule) -> list[Obligation]:
    """The false twin: free_blocks without the ref_cnt check keeps the invariants."""
    return [_preserved(rule, "free_blocks", inv, check_ref_cnt=False) for inv in PRESERVED]
