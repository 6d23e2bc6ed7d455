"""Lemma 2, `lemma_hashed_free_is_lru`: a block freed with a hash is evicted after every block
that was free when it was freed, unless one of them is touched in between.

Three obligations make it a statement about eviction, not only about one step:

- placement: `free_blocks` puts a block whose ref_cnt reaches 0 with a hash
  after every block already free;
- stability: no operation reorders two blocks it leaves in the free queue, so
  "x before y" lasts as long as both stay free (any operation sequence, by
  induction on its length);
- in order: `get_new_blocks` takes blocks left to right, so of two free blocks
  the one in front is taken first (or in the same call, earlier in the list).

Stability and in-order are stated for every operation here and cited by
lemmas 1, 3 and 4. The false twin drops "unless touched": a block that was
free when b was freed, then touched and freed again, is now behind b.
"""

from __future__ import annotations

import z3

from kvspec.spec.lemmas import pool_model as pm
from kvspec.spec.lemmas.backend import Universe
from kvspec.spec.lemmas.prover import Formula, Obligation
from kvspec.spec.ordering import ProfileRule

__all__ = ["NAME", "eviction_in_order", "obligations", "order_stability", "twin_obligations"]

NAME = "lemma_hashed_free_is_lru"


def _placement(rule: ProfileRule) -> Obligation:
    def build(u: Universe) -> Formula:
        s = pm.fresh_state(u, "before")
        batch = pm.fresh_batch(u, "freed")
        step = pm.free_blocks(u, s, batch, rule.unhashed_to_left)
        b, y = z3.Ints("b y")
        after = step.post
        label = pm.hash_labeller()
        return Formula(
            hypotheses=[
                pm.all_invariants(u, s),
                step.guard,
                step.axioms,
                pm.in_batch(batch, b),
                s.ref_cnt[b] == 1,
                s.has_hash[b],
                pm.in_queue(s, y),
            ],
            claim=z3.And(pm.in_queue(after, b), pm.in_queue(after, y), after.queue_pos[y] < after.queue_pos[b]),
            render=lambda m: "\n".join(
                [
                    pm.render_state(m, s, "before", label),
                    f"  free_blocks(block_ids={pm.render_batch(m, batch)}) [profile {rule.name}]",
                    pm.render_state(m, after, "after", label),
                    f"  block {pm.model_int(m, b)} was freed with a hash, but block {pm.model_int(m, y)}, "
                    "free before the call, is not in front of it",
                ]
            ),
        )

    return Obligation("free_blocks puts a block freed with a hash behind every block already free", build)


def order_stability(rule: ProfileRule) -> list[Obligation]:
    """For each operation: two blocks it leaves in the free queue keep their order."""

    def for_op(op: str) -> Obligation:
        def build(u: Universe) -> Formula:
            s = pm.fresh_state(u, "before")
            call = pm.any_call(u, s, op, rule.unhashed_to_left, "call")
            after = call.step.post
            x, y = z3.Ints("x y")
            label = pm.hash_labeller()
            return Formula(
                hypotheses=[
                    pm.all_invariants(u, s),
                    call.step.guard,
                    call.step.axioms,
                    pm.in_queue(s, x),
                    pm.in_queue(s, y),
                    s.queue_pos[x] < s.queue_pos[y],
                    pm.in_queue(after, x),
                    pm.in_queue(after, y),
                ],
                claim=after.queue_pos[x] < after.queue_pos[y],
                render=lambda m: "\n".join(
                    [
                        pm.render_state(m, s, "before", label),
                        f"  {call.describe(m, label)}",
                        pm.render_state(m, after, "after", label),
                        f"  blocks {pm.model_int(m, x)} and {pm.model_int(m, y)} changed order",
                    ]
                ),
            )

        return Obligation(f"{op} keeps the order of the blocks it leaves free", build)

    return [for_op(op) for op in pm.OPERATIONS]


def eviction_in_order() -> Obligation:
    """get_new_blocks takes a free block only with every free block in front of it."""

    def build(u: Universe) -> Formula:
        s = pm.fresh_state(u, "before")
        n = z3.Int("num_blocks")
        step = pm.get_new_blocks(u, s, n)
        assert step.taken is not None, "get_new_blocks names the blocks it takes"
        x, y = z3.Ints("x y")
        label = pm.hash_labeller()
        return Formula(
            hypotheses=[
                pm.all_invariants(u, s),
                step.guard,
                pm.in_queue(s, x),
                pm.in_queue(s, y),
                s.queue_pos[x] < s.queue_pos[y],
                step.taken(y),
            ],
            claim=step.taken(x),
            render=lambda m: "\n".join(
                [
                    pm.render_state(m, s, "before", label),
                    f"  get_new_blocks(num_blocks={pm.model_int(m, n)}) takes block {pm.model_int(m, y)} "
                    f"but not block {pm.model_int(m, x)} in front of it",
                ]
            ),
        )

    return Obligation("get_new_blocks takes free blocks from the left end, in order", build)


def obligations(rule: ProfileRule) -> list[Obligation]:
    """Everything lemma 2 needs, for one profile."""
    return [_placement(rule), *order_stability(rule), eviction_in_order()]


def twin_obligations(rule: ProfileRule) -> list[Obligation]:
    """The false twin: the order holds even when the earlier block is touched and freed again."""

    def build(u: Universe) -> Formula:
        s0 = pm.fresh_state(u, "s0")
        freed = pm.fresh_batch(u, "freed")
        first = pm.free_blocks(u, s0, freed, rule.unhashed_to_left)
        s1 = first.post
        touched = pm.fresh_batch(u, "touched")
        hit = pm.touch(u, s1, touched)
        s2 = hit.post
        again = pm.fresh_batch(u, "freed_again")
        second = pm.free_blocks(u, s2, again, rule.unhashed_to_left)
        s3 = second.post
        b, y = z3.Ints("b y")
        label = pm.hash_labeller()
        return Formula(
            hypotheses=[
                pm.all_invariants(u, s0),
                first.guard,
                first.axioms,
                pm.in_batch(freed, b),
                s0.ref_cnt[b] == 1,
                s0.has_hash[b],
                pm.in_queue(s0, y),
                hit.guard,
                hit.axioms,
                second.guard,
                second.axioms,
                pm.in_queue(s3, b),
                pm.in_queue(s3, y),
            ],
            claim=s3.queue_pos[y] < s3.queue_pos[b],
            render=lambda m: "\n".join(
                [
                    pm.render_state(m, s0, "start", label),
                    f"  free_blocks(block_ids={pm.render_batch(m, freed)})",
                    f"  touch(block_ids={pm.render_batch(m, touched)})",
                    f"  free_blocks(block_ids={pm.render_batch(m, again)})",
                    pm.render_state(m, s3, "end", label),
                    f"  block {pm.model_int(m, y)} was free when block {pm.model_int(m, b)} was freed, "
                    "yet it is now behind it: it was touched in between",
                ]
            ),
        )

    return [Obligation("a block free when b was freed stays in front of b, touched or not", build)]
