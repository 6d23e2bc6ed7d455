"""Every z3 encoding of spec/lemmas, checked against the spec on sampled concrete states.

A lemma is only as good as its encoding: a formula that drifted from the spec
would prove something about another system. So each encoding is evaluated on
concrete values and compared with what the spec computes:

- the Z3 backend against PY, connective by connective;
- spec.ordering's predicates run on z3 integers against the same on ints;
- each state invariant's encoding against spec.invariants, on thousands of
  reachable and deliberately broken states;
- each operation's encoding against spec.ops: it rejects exactly the calls
  the spec rejects, and its relations force exactly the spec's next state;
- the key encoding against a direct simulation of it.

Samples come from a seeded generator, so a failure reproduces.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator, Sequence
from dataclasses import replace

import pytest
import z3

from kvspec.spec import ops
from kvspec.spec.errors import BlockManagerError
from kvspec.spec.invariants import INVARIANTS, is_block_writable
from kvspec.spec.lemmas import pool_model as pm
from kvspec.spec.lemmas import stamps
from kvspec.spec.lemmas.backend import Z3, Universe, z3_lex_lt
from kvspec.spec.lemmas.key_encoding import keys_match_queue
from kvspec.spec.manager import Request, allocate_slots, get_computed_blocks, new_manager
from kvspec.spec.ordering import (
    PY,
    QUEUE_PROFILES,
    freed_goes_left,
    hit_tokens_within_cap,
    initial_free_key,
    initial_key_counters,
    left_batch_key,
    max_hit_blocks_rule,
    num_hit_tokens,
    place_freed,
    profile_rule,
    right_batch_key,
)
from kvspec.spec.state import BlockHash, BlockId, PoolState, Snapshot

pytestmark = [pytest.mark.z3, pytest.mark.timeout(120)]

OPS = ("get_new_blocks", "touch", "free_blocks", "cache_full_blocks", "evict_blocks", "reset_prefix_cache")


def _value(term: object) -> object:
    """A closed z3 term as a Python value."""
    v = z3.simplify(term)
    if z3.is_true(v):
        return True
    if z3.is_false(v):
        return False
    assert isinstance(v, z3.IntNumRef), f"not a closed value: {v}"
    return v.as_long()


# --- the backend and spec.ordering's predicates ---------------------------------------------------


def test_z3_backend_connectives_agree_with_py():
    rng = random.Random(0)
    for _ in range(2000):
        xs = [rng.random() < 0.5 for _ in range(rng.randint(0, 4))]
        zs = [z3.BoolVal(x) for x in xs]
        assert _value(Z3.and_(*zs)) == PY.and_(*xs)
        assert _value(Z3.or_(*zs)) == PY.or_(*xs)
        a, b = rng.random() < 0.5, rng.random() < 0.5
        assert _value(Z3.not_(z3.BoolVal(a))) == PY.not_(a)
        assert _value(Z3.implies(z3.BoolVal(a), z3.BoolVal(b))) == PY.implies(a, b)
        x, y = rng.randint(-5, 5), rng.randint(-5, 5)
        assert _value(Z3.ite(z3.BoolVal(a), z3.IntVal(x), z3.IntVal(y))) == PY.ite(a, x, y)


def test_z3_lex_lt_agrees_with_python_tuple_order():
    rng = random.Random(1)
    for _ in range(3000):
        a = tuple(rng.randint(0, 2) for _ in range(rng.randint(0, 3)))
        b = tuple(rng.randint(0, 2) for _ in range(rng.randint(0, 3)))
        assert _value(z3_lex_lt([z3.IntVal(x) for x in a], [z3.IntVal(x) for x in b])) == (a < b), (a, b)
        assert PY.lex_lt(a, b) == (a < b)


def test_ordering_predicates_agree_on_z3_and_py():
    rng = random.Random(2)
    for _ in range(2000):
        to_left, has_hash, first = rng.random() < 0.5, rng.random() < 0.5, rng.random() < 0.5
        encoded = freed_goes_left(z3.BoolVal(to_left), z3.BoolVal(has_hash), z3.BoolVal(first), Z3)
        assert _value(encoded) == freed_goes_left(to_left, has_hash, first, PY)
        lo, hi, k = rng.randint(-50, 50), rng.randint(-50, 50), rng.randint(0, 6)
        i = rng.randint(0, 6)
        assert _value(left_batch_key(z3.IntVal(lo), z3.IntVal(k), z3.IntVal(i))) == left_batch_key(lo, k, i)
        assert _value(right_batch_key(z3.IntVal(hi), z3.IntVal(i))) == right_batch_key(hi, i)
        n = rng.randint(1, 50)
        z_lo, z_hi = initial_key_counters(z3.IntVal(n))
        assert (z_lo, _value(z_hi)) == initial_key_counters(n)
        assert _value(initial_free_key(z3.IntVal(n))) == initial_free_key(n)


def test_division_rule_names_exactly_the_python_quotient():
    rng = random.Random(3)
    for i in range(3000):
        num_tokens, block_size = rng.randint(1, 200), rng.randint(1, 40)
        quotient = (num_tokens - 1) // block_size
        for q in range(quotient - 2, quotient + 3):
            expected = q == quotient
            assert max_hit_blocks_rule(num_tokens, block_size, q, PY) == expected
            if i % 4 == 0:  # the z3 side is slower to build; a quarter of the samples suffice
                z_rule = max_hit_blocks_rule(z3.IntVal(num_tokens), z3.IntVal(block_size), z3.IntVal(q), Z3)
                assert _value(z_rule) == expected


def test_hit_cap_formulas_agree_with_spec_manager():
    """num_hit_tokens is what spec.manager.get_computed_blocks reuses, for the chain length cached."""
    rng = random.Random(4)
    for _ in range(300):
        block_size = rng.randint(1, 4)
        prompt = tuple(rng.randint(0, 3) for _ in range(rng.randint(1, 12)))
        num_cached = rng.randint(0, len(prompt) // block_size)
        state = new_manager(num_gpu_blocks=16, block_size=block_size)
        if num_cached:
            # A request that shares the first num_cached full blocks registers them.
            donor = Request("donor", prompt[: num_cached * block_size])
            state = allocate_slots(state, donor, len(donor.token_ids)).state
        blocks, num_tokens = get_computed_blocks(state, Request("r", prompt)).result
        max_hit = (len(prompt) - 1) // block_size
        assert num_tokens == num_hit_tokens(block_size, num_cached, max_hit, PY), (prompt, block_size, num_cached)
        assert hit_tokens_within_cap(len(prompt), num_tokens, PY)
        z_reused = num_hit_tokens(z3.IntVal(block_size), z3.IntVal(num_cached), z3.IntVal(max_hit), Z3)
        assert _value(z_reused) == num_tokens
        assert _value(hit_tokens_within_cap(z3.IntVal(len(prompt)), z_reused, Z3)) is True
    assert not hit_tokens_within_cap(4, 4, PY) and not _value(hit_tokens_within_cap(z3.IntVal(4), z3.IntVal(4), Z3))


# --- sampled states ------------------------------------------------------------------------------


def _random_call(rng: random.Random, st: PoolState) -> tuple[str, tuple[object, ...]]:
    """An operation and arguments, valid or not (about half the calls are caller mistakes)."""
    n = st.num_gpu_blocks
    op = rng.choice(OPS)

    def ids() -> list[BlockId]:
        k = rng.randint(0, min(n, 4))
        if rng.random() < 0.25:  # duplicates, the null block, out of range
            return [BlockId(rng.randint(-1, n)) for _ in range(k)]
        pool = list(range(1, n))
        return [BlockId(b) for b in rng.sample(pool, min(k, len(pool)))]

    if op == "get_new_blocks":
        return op, (rng.randint(-1, len(st.free_queue) + 1),)
    if op == "reset_prefix_cache":
        return op, ()
    if op == "cache_full_blocks":
        block_ids = ids()
        return op, (block_ids, [BlockHash(bytes([rng.randint(0, 3)])) for _ in block_ids])
    if op == "free_blocks":  # now and then with evict_first (vLLM 0.34.0 on)
        return op, (ids(), rng.random() < 0.3)
    return op, (ids(),)


def _apply(st: PoolState, op: str, args: tuple[object, ...]) -> PoolState:
    return getattr(ops, op)(st, *args).state


def _reachable_states(seed: int, count: int, profiles: Sequence[str] = QUEUE_PROFILES) -> Iterator[PoolState]:
    """States reached from fresh pools by random calls (rejected calls change nothing)."""
    rng = random.Random(seed)
    produced = 0
    while produced < count:
        st = ops.new_pool(rng.randint(1, 7), rng.random() < 0.85, rng.choice(list(profiles)))
        for _ in range(rng.randint(0, 12)):
            op, args = _random_call(rng, st)
            try:
                st = _apply(st, op, args)
            except BlockManagerError:
                continue
        produced += 1
        yield st


def _broken(rng: random.Random, s: Snapshot) -> Snapshot:
    """The snapshot with one plausible corruption (it may still satisfy every invariant)."""
    n = s.num_gpu_blocks
    kind = rng.randrange(8)
    ref = list(s.ref_cnt)
    queue = list(s.free_queue)
    hashes = list(s.block_hash)
    table = [(h, list(bs)) for h, bs in s.hash_to_blocks]
    b = rng.randrange(n)
    if kind == 0:
        ref[b] += rng.choice((-1, 1, 2))
    elif kind == 1 and queue:
        queue.insert(rng.randrange(len(queue) + 1), rng.choice(queue))  # a duplicate
    elif kind == 2 and queue:
        queue.pop(rng.randrange(len(queue)))
    elif kind == 3:
        queue.insert(rng.randrange(len(queue) + 1), BlockId(b))
    elif kind == 4:
        hashes[b] = None if hashes[b] is not None else BlockHash(b"\x07")
    elif kind == 5 and table:
        table[rng.randrange(len(table))][1].append(BlockId(b))  # listed again, maybe twice
    elif kind == 6 and table:
        entry = rng.randrange(len(table))
        table[entry] = (BlockHash(b"\x09"), table[entry][1])  # listed under the wrong hash
    else:
        return replace(s, enable_caching=not s.enable_caching)
    return replace(
        s,
        ref_cnt=tuple(ref),
        free_queue=tuple(queue),
        block_hash=tuple(hashes),
        hash_to_blocks=tuple((h, tuple(bs)) for h, bs in table),
    )


def _python_truth(name: str, s: Snapshot) -> bool:
    """What spec.invariants says about `s` for the encoded invariant `name`."""
    if name == "writable":
        listed = {b for _, bs in s.hash_to_blocks for b in bs}
        return all(
            not is_block_writable(s, b) or (b not in s.free_queue and b not in listed) for b in range(s.num_gpu_blocks)
        )
    check = next(inv.check for inv in INVARIANTS if inv.name == name)
    return check(s)


_ARRAY_FIELDS = ("ref_cnt", "has_hash", "block_hash", "free_queue", "queue_pos", "table_count", "table_hash")


class _SymbolicEncodings:
    """Each invariant's encoding built once per (pool size, queue length) over unknown arrays.

    A concrete state is then substituted for the unknowns: the formula checked
    is the very one the proofs use, only with the sizes fixed.
    """

    def __init__(self) -> None:
        self._built: dict[tuple[int, int], tuple[pm.PoolVars, dict[str, z3.BoolRef]]] = {}

    def evaluate(self, snap: Snapshot) -> dict[str, bool]:
        key = (snap.num_gpu_blocks, len(snap.free_queue))
        if key not in self._built:
            u = Universe()
            sym = replace(pm.fresh_state(u, f"sampled{key}"), num_gpu_blocks=key[0], num_free=key[1])
            self._built[key] = (sym, {name: enc(u, sym) for name, enc in pm.ENCODED_INVARIANTS.items()})
        sym, formulas = self._built[key]
        concrete = pm.encode_snapshot(snap)
        pairs = [(getattr(sym, f), getattr(concrete, f)) for f in _ARRAY_FIELDS]
        pairs.append((sym.enable_caching, concrete.enable_caching))
        return {name: _value(z3.substitute(f, *pairs)) for name, f in formulas.items()}


def test_invariant_encodings_agree_with_spec_invariants_on_sampled_states():
    rng = random.Random(5)
    encodings = _SymbolicEncodings()
    seen = {name: {True: 0, False: 0} for name in pm.ENCODED_INVARIANTS}
    num_states = 0
    for st in _reachable_states(seed=6, count=1200):
        for snap in (st.snapshot(), _broken(rng, st.snapshot())):
            if not INVARIANTS[0].check(snap):  # inv_pool_shape: the arrays presuppose it
                continue
            num_states += 1
            for name, got in encodings.evaluate(snap).items():
                expected = _python_truth(name, snap)
                if name == "inv_hash_table_consistent":
                    # The one part of the table's shape arrays cannot hold is checked in Python.
                    got = got and pm.table_entries_well_formed(snap)
                assert got == expected, f"{name} encoding says {got}, spec says {expected} on {snap}"
                seen[name][expected] += 1
    assert num_states > 2000
    # Both answers came up often, so every comparison could have failed.
    for name, counts in seen.items():
        assert counts[True] > 300 and counts[False] > 20, (name, counts)


def test_block_writable_encoding_agrees_with_is_block_writable():
    rng = random.Random(12)
    for st in _reachable_states(seed=13, count=300):
        for snap in (st.snapshot(), _broken(rng, st.snapshot())):
            pv = pm.encode_snapshot(snap)
            for b in range(-1, snap.num_gpu_blocks + 1):
                assert _value(pm.block_writable(pv, b)) == is_block_writable(snap, b), (snap, b)


def test_num_held_counts_like_python():
    rng = random.Random(7)
    for _ in range(1000):
        ref = [rng.randint(0, 2) for _ in range(rng.randint(1, 9))]
        arr = z3.K(z3.IntSort(), z3.IntVal(0))
        for b, r in enumerate(ref):
            arr = z3.Store(arr, b, r)
        assert _value(pm.num_held(arr, len(ref))) == sum(1 for r in ref[1:] if r > 0)


# --- operations ----------------------------------------------------------------------------------


def _encode_call(u: Universe, pre: pm.PoolVars, names: pm.HashNames, op: str, args: tuple[object, ...], st: PoolState):
    rule = profile_rule(st.config.profile)
    if op == "get_new_blocks":
        return pm.get_new_blocks(u, pre, args[0])
    if op == "reset_prefix_cache":
        return pm.reset_prefix_cache(u, pre)
    batch = pm.encode_batch(args[0])
    if op == "touch":
        return pm.touch(u, pre, batch)
    if op == "free_blocks":
        return pm.free_blocks(u, pre, batch, rule.unhashed_to_left, evict_first=bool(args[1]))
    if op == "evict_blocks":
        return pm.evict_blocks(u, pre, batch)
    return pm.cache_full_blocks(u, pre, batch, pm.encode_hashes(args[1], names))


def _differs(post: pm.PoolVars, expected: pm.PoolVars, n: int) -> z3.BoolRef:
    """Some observable field of `post` differs from `expected` (a concrete state of n blocks)."""
    diffs = [post.num_free != expected.num_free]
    diffs += [post.free_queue[i] != expected.free_queue[i] for i in range(expected.num_free)]
    for b in range(n):
        diffs += [
            post.ref_cnt[b] != expected.ref_cnt[b],
            post.has_hash[b] != expected.has_hash[b],
            z3.And(expected.has_hash[b], post.block_hash[b] != expected.block_hash[b]),
            post.table_count[b] != expected.table_count[b],
            z3.And(expected.table_count[b] > 0, post.table_hash[b] != expected.table_hash[b]),
            pm.in_queue(post, b) != pm.in_queue(expected, b),
        ]
    return z3.Or(*diffs)


@pytest.mark.parametrize(
    "num_pools", [pytest.param(180, id="default"), pytest.param(2500, id="campaign", marks=pytest.mark.slow)]
)
def test_operation_encodings_agree_with_spec_ops_on_sampled_calls(num_pools: int):
    rng = random.Random(8)
    counts = {op: {"applied": 0, "rejected": 0} for op in OPS}
    solver = z3.Solver()
    for st in _reachable_states(seed=9, count=num_pools):
        for _ in range(4):
            op, args = _random_call(rng, st)
            names = pm.HashNames()
            pre = pm.encode_snapshot(st, names)
            u = Universe(bound=st.num_gpu_blocks)
            step = _encode_call(u, pre, names, op, args, st)
            try:
                after = _apply(st, op, args)
            except BlockManagerError:
                assert z3.is_false(z3.simplify(step.guard)), f"{op}{args} is rejected by the spec, not the encoding"
                counts[op]["rejected"] += 1
                continue
            assert z3.is_true(z3.simplify(step.guard)), f"{op}{args} succeeds in the spec, the encoding rejects it"
            solver.push()
            solver.add(*u.assumptions, step.axioms)
            assert solver.check() == z3.sat, f"{op}: the relations defining the result are contradictory"
            solver.add(_differs(step.post, pm.encode_snapshot(after, names), st.num_gpu_blocks))
            assert solver.check() == z3.unsat, f"{op}{args} on {st}: the encoding allows another next state"
            solver.pop()
            counts[op]["applied"] += 1
            st = after
    for op, c in counts.items():
        assert c["applied"] >= 15 and (op == "reset_prefix_cache" or c["rejected"] >= 10), (op, c)


def test_filter_relation_forces_exactly_the_python_filter():
    rng = random.Random(10)
    for _ in range(200):
        src = [rng.randint(0, 5) for _ in range(rng.randint(0, 6))]
        mask = [rng.random() < 0.5 for _ in src]
        u = Universe(bound=len(src))
        arr = pm.encode_batch(src).ids
        f = pm.filter_list(u, arr, len(src), lambda i, mask=mask: _mask_term(mask, i), "f")
        kept = [x for x, k in zip(src, mask) if k]
        s = z3.Solver()
        s.add(*u.assumptions, f.axioms)
        assert s.check() == z3.sat
        s.add(z3.Or(f.length != len(kept), *(f.items[j] != kept[j] for j in range(len(kept)))))
        assert s.check() == z3.unsat, (src, mask)


def _mask_term(mask: list[bool], i: object) -> z3.BoolRef:
    """mask[i] for a z3 index i ranging over the mask's positions."""
    return z3.Or(*(z3.And(i == k, z3.BoolVal(m)) for k, m in enumerate(mask))) if mask else z3.BoolVal(False)


# --- the key encoding ----------------------------------------------------------------------------


class _KeyedPool:
    """A direct simulation of the key encoding beside a spec pool: keys, lo, hi."""

    def __init__(self, st: PoolState) -> None:
        self.key = {b: initial_free_key(b) for b in st.free_queue}
        self.lo, self.hi = initial_key_counters(st.num_gpu_blocks)

    def queue(self) -> tuple[int, ...]:
        return tuple(sorted(self.key, key=self.key.__getitem__))

    def apply(self, before: PoolState, after: PoolState, op: str, args: tuple[object, ...]) -> None:
        if op == "get_new_blocks":
            taken = sorted(self.key, key=self.key.__getitem__)[: args[0]]
            for b in taken:
                del self.key[b]
        elif op == "touch":
            for b in args[0]:
                self.key.pop(b, None)
        elif op == "free_blocks":
            newly = [b for b in args[0] if after.ref_cnt[b] == 0]
            rule = profile_rule(before.config.profile)
            evict_first = bool(args[1])
            hashed = [before.block_hash[b] is not None for b in newly]
            left = [b for b, h in zip(newly, hashed) if freed_goes_left(rule.unhashed_to_left, h, evict_first, PY)]
            right = [b for b in newly if b not in left]
            for i, b in enumerate(left):
                self.key[b] = left_batch_key(self.lo, len(left), i)
            for i, b in enumerate(right):
                self.key[b] = right_batch_key(self.hi, i)
            self.lo -= len(left)
            self.hi += len(right)

    def encode(self, pv: pm.PoolVars, n: int) -> z3.BoolRef:
        """Constraints binding pv's key fields to this simulation's values."""
        return z3.And(
            pv.lo == self.lo,
            pv.hi == self.hi,
            *(pv.key_free[b] == (b in self.key) for b in range(n)),
            *(pv.key[b] == k for b, k in self.key.items()),
        )


def test_key_encoding_simulation_orders_like_the_free_queue_and_satisfies_the_encoded_relation():
    rng = random.Random(11)
    solver = z3.Solver()
    checked = 0
    for seed in range(160):
        st = ops.new_pool(rng.randint(1, 7), rng.random() < 0.85, rng.choice(list(QUEUE_PROFILES)))
        keyed = _KeyedPool(st)
        for _ in range(10):
            op, args = _random_call(rng, st)
            try:
                after = _apply(st, op, args)
            except BlockManagerError:
                continue
            keyed.apply(st, after, op, args)
            st = after
            assert keyed.queue() == st.free_queue, f"seed {seed}: keys give {keyed.queue()}, queue is {st.free_queue}"
            pv = pm.encode_snapshot(st)
            solver.push()
            solver.add(keyed.encode(pv, st.num_gpu_blocks), z3.Not(keys_match_queue(Universe(), pv)))
            assert solver.check() == z3.unsat, f"seed {seed}: the encoded relation rejects a consistent key state"
            solver.pop()
            checked += 1
    assert checked > 600


def test_key_relation_encoding_rejects_keys_out_of_queue_order():
    st = ops.free_blocks(ops.get_new_blocks(ops.new_pool(5), 4).state, [BlockId(2), BlockId(1), BlockId(3)]).state
    pv = pm.encode_snapshot(st)
    keys_in_order = {b: i for i, b in enumerate(st.free_queue)}
    for swap in ((0, 1), (1, 2), (0, 2)):
        keys = dict(keys_in_order)
        a, b = st.free_queue[swap[0]], st.free_queue[swap[1]]
        keys[a], keys[b] = keys[b], keys[a]
        s = z3.Solver()
        s.add(pv.lo == -1, pv.hi == 10, *(pv.key[blk] == k for blk, k in keys.items()))
        s.add(*(pv.key_free[blk] == (blk in keys) for blk in range(5)))
        s.add(keys_match_queue(Universe(), pv))
        assert s.check() == z3.unsat, swap


def test_place_freed_agrees_with_the_free_blocks_encoding_on_every_small_batch():
    """Exhaustive over small pools: place_freed (the spec's rule) and the encoding's queue agree."""
    for profile in QUEUE_PROFILES:
        rule = profile_rule(profile)
        for num_held in range(0, 4):
            for hashed_mask in range(1 << num_held):
                st = ops.get_new_blocks(ops.new_pool(6, profile=profile), num_held).state
                held = [BlockId(b) for b in range(1, num_held + 1)]
                hashed = [b for i, b in enumerate(held) if hashed_mask >> i & 1]
                if hashed:
                    st = ops.cache_full_blocks(st, hashed, [BlockHash(bytes([b])) for b in hashed]).state
                for order, evict_first in itertools.product((held, held[::-1]), (False, True)):
                    expected = place_freed(st.free_queue, order, st.block_hash, rule, evict_first)
                    names = pm.HashNames()
                    u = Universe(bound=6)
                    step = pm.free_blocks(
                        u,
                        pm.encode_snapshot(st, names),
                        pm.encode_batch(order),
                        rule.unhashed_to_left,
                        evict_first=evict_first,
                    )
                    s = z3.Solver()
                    s.add(*u.assumptions, step.axioms)
                    s.add(
                        z3.Or(
                            step.post.num_free != len(expected),
                            *(step.post.free_queue[i] != b for i, b in enumerate(expected)),
                        )
                    )
                    assert s.check() == z3.unsat, (profile, order, hashed, evict_first)


# --- the keyed order on z3 terms (spec.lemmas.stamps) ---------------------------------------------


def _encoded_stamps(state: PoolState) -> stamps.Stamps:
    def array(values: tuple[int, ...]) -> z3.ArrayRef:
        a = z3.K(z3.IntSort(), z3.IntVal(0))
        for b, v in enumerate(values):
            a = z3.Store(a, b, v)
        return a

    first = z3.K(z3.IntSort(), z3.BoolVal(False))
    for b, v in enumerate(state.is_evict_first):
        first = z3.Store(first, b, z3.BoolVal(v))
    return stamps.Stamps(
        z3.IntVal(state.clock),
        array(state.last_access),
        array(state.num_accesses),
        array(state.registered_at),
        first,
    )


@pytest.mark.parametrize("profile", ["lru-timestamp", "block-age", "lfu", "lru-lfu:0.5"])
def test_the_keyed_order_on_z3_terms_is_the_spec_free_queue_on_reachable_states(profile):
    u = Universe()
    for st in _reachable_states(7, 60, [profile]):
        s, encoded = pm.encode_snapshot(st), _encoded_stamps(st)
        assert z3.is_true(z3.simplify(stamps.below_clock(u, s, encoded)))
        assert z3.is_true(z3.simplify(stamps.in_policy_order(u, profile_rule(profile), s, encoded)))
        queue = st.free_queue
        for i, a in enumerate(queue):
            for b in queue[i + 1 :]:
                assert z3.is_true(z3.simplify(stamps.before(profile_rule(profile), s, encoded, a, b)))
                assert z3.is_false(z3.simplify(stamps.before(profile_rule(profile), s, encoded, b, a)))
