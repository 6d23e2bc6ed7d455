"""The keyed policies' stamps as z3 terms, beside the pool model's state (seed 002).

A keyed policy (spec.ordering) derives the free queue from per-block stamps:
the free blocks without a hash by id, then the hashed ones by `eviction_key`.
So a lemma about a keyed order is a claim about `keyed_rank`, the spec's own
function evaluated on z3 terms (`before`), over stamps that the operations
write as spec.ops does: one tick per block named, in the order named
(`stamped`). Ref counts, hashes and guards stay the pool model's
(spec.lemmas.pool_model); its queue array, which a keyed policy re-derives
after every operation, is not read.

The stamps are unconstrained but for the clock's invariant, `below_clock`
(every stamp is the initial 0 or was given by the clock, which only
advances), and the spec's
order contract, `in_policy_order` (the queue array is the keyed order, so a
counterexample prints the free queue the spec would). A proof therefore holds
for any history that could have written them. tests/spec/test_policies.py
shows each break z3 reports on a concrete run of the spec.
"""

from __future__ import annotations

from dataclasses import dataclass

import z3

from kvspec.spec.lemmas import pool_model as pm
from kvspec.spec.lemmas.backend import Z3, Index, Universe
from kvspec.spec.ordering import ProfileRule, keyed_rank

__all__ = [
    "Stamps",
    "after_free",
    "after_touch",
    "before",
    "below_clock",
    "fresh_stamps",
    "in_policy_order",
    "keyed_state",
    "render_stamps",
]


@dataclass(frozen=True)
class Stamps:
    """A keyed policy's stamps (spec.state.PoolState's clock, last_access, num_accesses, registered_at,
    is_evict_first)."""

    clock: z3.ArithRef  # the next stamp
    last_access: z3.ArrayRef  # block -> its last allocation, hit or free
    num_accesses: z3.ArrayRef  # block -> its allocation and hits since it was allocated
    registered_at: z3.ArrayRef  # block -> when its content was registered
    is_evict_first: z3.ArrayRef  # block -> whether its last free asked to evict it first (a Bool)


def fresh_stamps(name: str) -> Stamps:
    """Stamps of unknown values."""
    return Stamps(
        z3.Int(f"{name}.clock"),
        z3.Array(f"{name}.last", z3.IntSort(), z3.IntSort()),
        z3.Array(f"{name}.acc", z3.IntSort(), z3.IntSort()),
        z3.Array(f"{name}.reg", z3.IntSort(), z3.IntSort()),
        z3.Array(f"{name}.first", z3.IntSort(), z3.BoolSort()),
    )


def below_clock(u: Universe, s: pm.PoolVars, st: Stamps) -> z3.BoolRef:
    """The clock's invariant: every stamp is the initial 0 or lies in [0, clock); every count in [0, clock]."""

    def given(stamp: z3.ArithRef) -> z3.BoolRef:
        return z3.And(stamp >= 0, z3.Or(stamp < st.clock, stamp == 0))

    return u.forall(
        0,
        s.num_gpu_blocks,
        lambda b: z3.And(
            given(st.last_access[b]),
            given(st.registered_at[b]),
            st.num_accesses[b] >= 0,
            st.num_accesses[b] <= st.clock,
        ),
    )


def in_policy_order(u: Universe, rule: ProfileRule, s: pm.PoolVars, st: Stamps) -> z3.BoolRef:
    """The spec's `in_keyed_order` (part of every operation's contract): the queue array is the keyed order."""
    return u.forall_pairs(0, s.num_free, lambda i, j: before(rule, s, st, s.free_queue[i], s.free_queue[j]))


def keyed_state(u: Universe, rule: ProfileRule, s: pm.PoolVars, st: Stamps) -> z3.BoolRef:
    """A state a keyed policy's pool can be in: the invariants, the clock's, and the free queue in order."""
    return z3.And(pm.all_invariants(u, s), below_clock(u, s, st), in_policy_order(u, rule, s, st))


def _stamped(stamps: z3.ArrayRef, batch: pm.Batch, clock: z3.ArithRef, name: str) -> z3.ArrayRef:
    """`stamps` with the i-th block of the batch stamped clock + i (spec.ops._stamp)."""
    b = z3.Int(f"{name}.b")
    return z3.Lambda([b], z3.If(pm.in_batch(batch, b), clock + batch.pos[b], stamps[b]))


def after_free(st: Stamps, batch: pm.Batch, evict_first: z3.BoolRef | bool = False) -> Stamps:
    """spec.ops.free_blocks under a keyed policy: every block named is stamped, in order, and tiered."""
    b = z3.Int("free.first.b")
    tier = z3.Lambda([b], z3.If(pm.in_batch(batch, b), evict_first, st.is_evict_first[b]))
    return Stamps(
        st.clock + batch.length, _stamped(st.last_access, batch, st.clock, "free.last"), st.num_accesses,
        st.registered_at, tier,
    )  # fmt: skip


def after_touch(st: Stamps, batch: pm.Batch) -> Stamps:
    """spec.ops.touch under a keyed policy: every block hit is stamped and counts one access."""
    b = z3.Int("touch.acc.b")
    accesses = z3.Lambda([b], st.num_accesses[b] + z3.If(pm.in_batch(batch, b), 1, 0))
    return Stamps(
        st.clock + batch.length,
        _stamped(st.last_access, batch, st.clock, "touch.last"),
        accesses,
        st.registered_at,
        st.is_evict_first,
    )


def before(rule: ProfileRule, s: pm.PoolVars, st: Stamps, a: Index, b: Index) -> z3.BoolRef:
    """Free block a goes before free block b in the keyed order (spec.ordering.keyed_rank, on z3 terms)."""

    def rank(x: Index) -> tuple[object, ...]:
        stamp = st.last_access[x], st.num_accesses[x], st.registered_at[x], st.is_evict_first[x]
        return keyed_rank(rule, x, s.has_hash[x], *stamp, Z3)

    return Z3.lex_lt(rank(a), rank(b))


def render_stamps(model: z3.ModelRef, st: Stamps, blocks: dict[str, Index], label: str) -> str:
    """One line: the clock and the named blocks' stamps in a counterexample."""
    parts = [
        f"{name} (block {pm.model_int(model, b)}): last access {pm.model_int(model, st.last_access[b])}, "
        f"{pm.model_int(model, st.num_accesses[b])} accesses, registered {pm.model_int(model, st.registered_at[b])}"
        f"{', freed to be evicted first' if z3.is_true(model.eval(st.is_evict_first[b], True)) else ''}"
        for name, b in blocks.items()
    ]
    return f"  stamps {label}: clock {pm.model_int(model, st.clock)}; " + "; ".join(parts)
