"""Lemma 6, `lemma_key_encoding_matches_queue`: the key encoding gives the same eviction order
as the linked free queue, for every sequence of operations.

The key encoding (spec.ordering, used by gpu_impl): each free block carries an
integer key, the queue is the free blocks in ascending key order, a batch of k
blocks sent left gets `left_batch_key(lo, k, i) = lo - k + i`, one sent right
`right_batch_key(hi, i) = hi + 1 + i`, and taking n blocks takes the n
smallest keys. The proof is an inductive relation between the two models:

    R: the key model's free set is exactly the blocks in the free queue;
       keys strictly increase along the queue; every free key is in [lo, hi],
       and lo <= hi + 1 (the range may be empty, never inverted).

R holds in a fresh pool and every operation preserves it (the list side as in
spec.ops, the key side as the key encoding updates it), for any queue length
and batch sizes. Under R the blocks `get_new_blocks` takes, the first n of the
queue, are free in the key model with keys below every free block left: the
n smallest keys, returned in ascending order. So after any sequence of
operations both models hold the same blocks in the same order and take the
same blocks. The false twin is off by one at both ends (a left batch keyed
`lo - k + 1 + i`, a right one `hi + i`): a new key ties with the smallest or
largest free key, and a tie does not order the queue.

Under a keyed policy (seed 002) gpu_impl keeps no queue keys: it takes
(gpu_impl.stamped_free) from a heap of the ids of the free blocks without a
hash, then the free hashed ones in the order of the spec's `eviction_key`
(which ends with the id), packed into ints (an ascending run and a heap).
The obligation: that order ranks any two free blocks as the spec's
`keyed_rank` does. The false twin takes first fit by descending id.
"""

from __future__ import annotations

import z3

from kvspec.spec.lemmas import pool_model as pm
from kvspec.spec.lemmas import stamps
from kvspec.spec.lemmas.backend import Z3, Index, Universe
from kvspec.spec.lemmas.prover import Formula, Obligation
from kvspec.spec.ordering import ProfileRule, eviction_key

__all__ = ["NAME", "keys_match_queue", "obligations", "twin_obligations"]

NAME = "lemma_key_encoding_matches_queue"


def keys_match_queue(u: Universe, s: pm.PoolVars) -> z3.BoolRef:
    """R: the key model's free set is the queue, keys increase along it, and lie in [lo, hi]."""
    q, key = s.free_queue, s.key
    return z3.And(
        s.lo <= s.hi + 1,
        u.forall(0, s.num_gpu_blocks, lambda b: s.key_free[b] == pm.in_queue(s, b)),
        u.forall_pairs(0, s.num_free, lambda i, j: key[q[i]] < key[q[j]]),
        u.forall(0, s.num_free, lambda i: z3.And(s.lo <= key[q[i]], key[q[i]] <= s.hi)),
    )


def _render_keys(m: z3.ModelRef, s: pm.PoolVars) -> str:
    n = min(pm.model_int(m, s.num_free), 16)
    pairs = [f"{pm.model_int(m, s.free_queue[i])}:{pm.model_int(m, s.key[s.free_queue[i]])}" for i in range(n)]
    bounds = f"lo={pm.model_int(m, s.lo)} hi={pm.model_int(m, s.hi)}"
    return f"    keys (block:key, queue order)  [{', '.join(pairs)}]  {bounds}"


def _initial() -> Obligation:
    def build(u: Universe) -> Formula:
        n = u.size("num_gpu_blocks", lo=1)
        s = pm.new_pool(u, n, z3.Bool("enable_caching"), "new")
        label = pm.hash_labeller()
        return Formula(
            hypotheses=[],
            claim=keys_match_queue(u, s),
            render=lambda m: pm.render_state(m, s, "new_pool", label) + "\n" + _render_keys(m, s),
        )

    return Obligation("a fresh pool's keys match its queue", build)


def _preserved(rule: ProfileRule, op: str, off_by_one: bool = False) -> Obligation:
    def build(u: Universe) -> Formula:
        s = pm.fresh_state(u, "before")
        if off_by_one:
            batch = pm.fresh_batch(u, "call.block_ids")
            step = pm.free_blocks(
                u, s, batch, rule.unhashed_to_left, left_key=_off_by_one_left_key, right_key=_off_by_one_right_key
            )
            call = pm.Call(op, step, lambda m, h: f"free_blocks(block_ids={pm.render_batch(m, batch)})")
        else:
            call = pm.any_call(u, s, op, rule.unhashed_to_left, "call")
        after = call.step.post
        label = pm.hash_labeller()
        return Formula(
            hypotheses=[pm.all_invariants(u, s), keys_match_queue(u, s), call.step.guard, call.step.axioms],
            claim=keys_match_queue(u, after),
            render=lambda m: "\n".join(
                [
                    pm.render_state(m, s, "before", label),
                    _render_keys(m, s),
                    f"  {call.describe(m, label)} [profile {rule.name}]",
                    pm.render_state(m, after, "after", label),
                    _render_keys(m, after),
                    "  the keys no longer give the queue's order",
                ]
            ),
        )

    return Obligation(f"{op} keeps the keys matching the queue", build)


def _takes_smallest() -> Obligation:
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
                keys_match_queue(u, s),
                step.guard,
                y >= 0,
                y < s.num_gpu_blocks,
            ],
            claim=z3.And(
                z3.Implies(step.taken(x), s.key_free[x]),
                z3.Implies(z3.And(step.taken(x), s.key_free[y], z3.Not(step.taken(y))), s.key[x] < s.key[y]),
            ),
            render=lambda m: "\n".join(
                [
                    pm.render_state(m, s, "before", label),
                    _render_keys(m, s),
                    f"  get_new_blocks(num_blocks={pm.model_int(m, n)}) takes block {pm.model_int(m, x)}, "
                    f"not one of the smallest keys (block {pm.model_int(m, y)} is left)",
                ]
            ),
        )

    return Obligation("get_new_blocks takes the free blocks with the smallest keys", build)


def _off_by_one_left_key(lo: Index, batch_len: Index, index: Index) -> Index:
    """The twin's left key: one too high, so the last of the batch ties with lo."""
    return lo - batch_len + 1 + index


def _off_by_one_right_key(hi: Index, index: Index) -> Index:
    """The twin's right key: one too low, so the first of the batch ties with hi."""
    return hi + index


def _key_terms(rule: ProfileRule, st: stamps.Stamps, b: Index) -> tuple[object, ...]:
    return eviction_key(rule, b, st.last_access[b], st.num_accesses[b], st.registered_at[b], st.is_evict_first[b], Z3)


def _selection_is_the_keyed_order(rule: ProfileRule, first_fit_descending: bool = False) -> Obligation:
    def build(u: Universe) -> Formula:
        s, st = pm.fresh_state(u, "pool"), stamps.fresh_stamps("pool")
        a, b = z3.Ints("a b")
        first_fit = a > b if first_fit_descending else a < b
        hashed_a, hashed_b = s.has_hash[a], s.has_hash[b]
        # gpu_impl's take: unhashed ones first, by id; then hashed ones by eviction_key (the id last).
        selected_first = z3.If(
            hashed_a == hashed_b,
            z3.If(hashed_a, Z3.lex_lt(_key_terms(rule, st, a), _key_terms(rule, st, b)), first_fit),
            z3.Not(hashed_a),
        )
        return Formula(
            hypotheses=[
                stamps.keyed_state(u, rule, s, st),
                pm.in_queue(s, a),
                pm.in_queue(s, b),
                a != b,
            ],
            claim=selected_first == stamps.before(rule, s, st, a, b),
            render=lambda m: "\n".join(
                [
                    pm.render_state(m, s, "pool", pm.hash_labeller()),
                    stamps.render_stamps(m, st, {"a": a, "b": b}, f"[profile {rule.name}]"),
                    f"  the selection and the spec order blocks {pm.model_int(m, a)} and {pm.model_int(m, b)} apart",
                ]
            ),
        )

    how = "descending" if first_fit_descending else "ascending"
    return Obligation(f"first fit by {how} id, then eviction_key, is the spec's keyed order", build)


def obligations(rule: ProfileRule) -> list[Obligation]:
    """R initially, after every operation, and the take rule; under a keyed policy, the selection."""
    if rule.keyed:
        return [_selection_is_the_keyed_order(rule)]
    return [_initial(), *(_preserved(rule, op) for op in pm.OPERATIONS), _takes_smallest()]


def twin_obligations(rule: ProfileRule) -> list[Obligation]:
    """The false twin: batches keyed one off at either end keep R; keyed: first fit by descending id."""
    if rule.keyed:
        return [_selection_is_the_keyed_order(rule, first_fit_descending=True)]
    return [_preserved(rule, "free_blocks", off_by_one=True)]
