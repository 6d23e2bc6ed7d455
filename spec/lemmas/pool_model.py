"""The pool as z3 terms: its state, its invariants and its operations, for any pool size.

Design choice: the state is a set of arrays indexed by block id (`ref_cnt`,
`has_hash`, `block_hash`, and the hash table as `table_count` / `table_hash`,
how often and under which hash it lists each block), and the free queue is an
array of positions with a length, exactly the spec's tuple. A ghost array
`queue_pos` maps a block to its position, so "b is free" and "b is before c"
need no existential. Operations that drop items from a list (a touch, or the
part of a batch that goes to one end) are stated as a filter relation: an
order-preserving bijection between the kept source positions and the result
(`filter_list`), which pins the result down uniquely. The rejected
alternative, z3 sequences with a recursive filter, needs induction for every
step and leaves z3 answering unknown.

Every encoding here is checked against the spec on sampled concrete states
(tests/spec/test_z3_encoding.py): an invariant's encoding against the Python
predicate of spec.invariants, an operation's encoding against spec.ops, so an
encoding cannot drift from the spec.

The key encoding of lemma 6 rides along: `key` gives each free block its key,
`key_free` is the key model's own free set, `lo` / `hi` its counters. Other
lemmas leave them unconstrained.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import z3

from kvspec.spec.lemmas.backend import Z3, Index, Universe
from kvspec.spec.ordering import (
    freed_goes_left,
    initial_free_key,
    initial_key_counters,
    left_batch_key,
    right_batch_key,
)
from kvspec.spec.state import NULL_BLOCK_ID, BlockHash, PoolState, Snapshot

__all__ = [
    "ENCODED_INVARIANTS",
    "OPERATIONS",
    "Batch",
    "Call",
    "Filtered",
    "HashNames",
    "PoolVars",
    "Step",
    "all_invariants",
    "any_call",
    "block_writable",
    "cache_full_blocks",
    "encode_batch",
    "encode_hashes",
    "encode_snapshot",
    "evict_blocks",
    "filter_list",
    "free_blocks",
    "fresh_batch",
    "fresh_state",
    "get_new_blocks",
    "hash_labeller",
    "in_batch",
    "in_queue",
    "model_bool",
    "model_int",
    "new_pool",
    "num_held",
    "render_batch",
    "render_state",
    "rearranged",
    "reset_prefix_cache",
    "table_entries_well_formed",
    "touch",
]

_INT = z3.IntSort()
_BOOL = z3.BoolSort()
_uid = itertools.count()


def _name(prefix: str) -> str:
    return f"{prefix}!{next(_uid)}"


def _int_array(name: str) -> z3.ArrayRef:
    return z3.Array(name, _INT, _INT)


def _bool_array(name: str) -> z3.ArrayRef:
    return z3.Array(name, _INT, _BOOL)


def _lam(body: Callable[[z3.ArithRef], z3.ExprRef], name: str) -> z3.ArrayRef:
    x = z3.Int(_name(name))
    return z3.Lambda([x], body(x))


# --- state ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class PoolVars:
    """One pool state as z3 terms (or concrete values for a sampled state)."""

    num_gpu_blocks: Index  # pool size, the null block included
    enable_caching: z3.BoolRef  # prefix caching on or off
    ref_cnt: z3.ArrayRef  # block -> ref_cnt
    has_hash: z3.ArrayRef  # block -> whether block_hash[b] is set
    block_hash: z3.ArrayRef  # block -> its hash, an int naming the bytes; meaningful when has_hash
    free_queue: z3.ArrayRef  # position -> block, for positions [0, num_free)
    num_free: Index  # length of the free queue
    queue_pos: z3.ArrayRef  # ghost: block -> its position in free_queue (any value when not free)
    table_count: z3.ArrayRef  # block -> how many times hash_to_blocks lists it
    table_hash: z3.ArrayRef  # block -> the hash of the entry that lists it
    key: z3.ArrayRef  # key encoding: block -> its key while free
    key_free: z3.ArrayRef  # key encoding: block -> whether the key model counts it free
    lo: Index  # key encoding: at most every free block's key
    hi: Index  # key encoding: at least every free block's key


def fresh_state(u: Universe, name: str) -> PoolVars:
    """A pool state with every field unknown (pool size at least 1)."""
    return PoolVars(
        num_gpu_blocks=u.size(f"{name}.num_gpu_blocks", lo=1),
        enable_caching=z3.Bool(f"{name}.enable_caching"),
        ref_cnt=_int_array(f"{name}.ref_cnt"),
        has_hash=_bool_array(f"{name}.has_hash"),
        block_hash=_int_array(f"{name}.block_hash"),
        free_queue=_int_array(f"{name}.free_queue"),
        num_free=u.size(f"{name}.num_free"),
        queue_pos=_int_array(f"{name}.queue_pos"),
        table_count=_int_array(f"{name}.table_count"),
        table_hash=_int_array(f"{name}.table_hash"),
        key=_int_array(f"{name}.key"),
        key_free=_bool_array(f"{name}.key_free"),
        lo=z3.Int(f"{name}.lo"),
        hi=z3.Int(f"{name}.hi"),
    )


def in_queue(s: PoolVars, b: Index) -> z3.BoolRef:
    """Block b is in the free queue (its ghost position points at it)."""
    p = s.queue_pos[b]
    return z3.And(p >= 0, p < s.num_free, s.free_queue[p] == b)


def block_writable(s: PoolVars, b: Index) -> z3.BoolRef:
    """The encoding of spec.invariants.is_block_writable."""
    return z3.And(b >= 0, b < s.num_gpu_blocks, b != NULL_BLOCK_ID, s.ref_cnt[b] == 1, z3.Not(s.has_hash[b]))


_REF_ARRAY = z3.Array("held.ref_cnt", _INT, _INT)
_UPTO = z3.Int("held.upto")
num_held = z3.RecFunction("num_held", z3.ArraySort(_INT, _INT), _INT, _INT)
"""num_held(ref_cnt, k): how many of blocks 1..k-1 have ref_cnt > 0 (block 0 is never counted)."""
z3.RecAddDefinition(
    num_held,
    [_REF_ARRAY, _UPTO],
    z3.If(_UPTO <= 1, 0, num_held(_REF_ARRAY, _UPTO - 1) + z3.If(_REF_ARRAY[_UPTO - 1] > 0, 1, 0)),
)


# --- invariants -------------------------------------------------------------------------------
# Each mirrors the predicate of spec.invariants named in ENCODED_INVARIANTS, on a state whose
# per-block tuples have one entry per block and whose hash table has one non-empty entry per
# hash (the shape the arrays can express; `inv_pool_shape` and `table_entries_well_formed`
# check that part in Python).


def ref_cnt_nonnegative(u: Universe, s: PoolVars) -> z3.BoolRef:
    """inv_ref_cnt_nonnegative."""
    return u.forall(0, s.num_gpu_blocks, lambda b: s.ref_cnt[b] >= 0)


def null_block_isolated(u: Universe, s: PoolVars) -> z3.BoolRef:
    """inv_null_block_isolated, at the pool level (no block tables)."""
    null = NULL_BLOCK_ID
    return z3.And(
        z3.Not(in_queue(s, null)),
        z3.Not(s.has_hash[null]),
        s.ref_cnt[null] == 0,
        s.table_count[null] == 0,
    )


def free_queue_has_zero_ref(u: Universe, s: PoolVars) -> z3.BoolRef:
    """inv_free_queue_has_zero_ref: the queue lists each non-null ref-0 block once, and nothing else."""
    n = s.num_gpu_blocks
    listed_once = u.forall(
        0,
        s.num_free,
        lambda i: z3.And(s.free_queue[i] >= 0, s.free_queue[i] < n, s.queue_pos[s.free_queue[i]] == i),
    )
    exactly_zero_ref = u.forall(0, n, lambda b: in_queue(s, b) == z3.And(b != NULL_BLOCK_ID, s.ref_cnt[b] == 0))
    return z3.And(listed_once, exactly_zero_ref)


def conservation(u: Universe, s: PoolVars) -> z3.BoolRef:
    """inv_conservation, at the pool level (nothing quarantined)."""
    return s.num_free + num_held(s.ref_cnt, s.num_gpu_blocks) == s.num_gpu_blocks - 1


def hash_table_consistent(u: Universe, s: PoolVars) -> z3.BoolRef:
    """inv_hash_table_consistent: each hashed block listed once under its own hash, nothing else listed."""
    return u.forall(
        0,
        s.num_gpu_blocks,
        lambda b: z3.And(
            s.table_count[b] == z3.If(s.has_hash[b], 1, 0),
            z3.Implies(s.has_hash[b], s.table_hash[b] == s.block_hash[b]),
        ),
    )


def caching_off_no_hash(u: Universe, s: PoolVars) -> z3.BoolRef:
    """inv_caching_off_no_hash."""
    return z3.Or(
        s.enable_caching,
        u.forall(0, s.num_gpu_blocks, lambda b: z3.And(z3.Not(s.has_hash[b]), s.table_count[b] == 0)),
    )


def writable_is_private(u: Universe, s: PoolVars) -> z3.BoolRef:
    """The writable rule: a block is_block_writable names is neither free nor hittable."""
    return u.forall(
        0,
        s.num_gpu_blocks,
        lambda b: z3.Implies(block_writable(s, b), z3.And(z3.Not(in_queue(s, b)), s.table_count[b] == 0)),
    )


Encoder = Callable[[Universe, PoolVars], z3.BoolRef]

# spec.invariants name (or the design id of docs/design.md, for the writable rule) -> its encoding.
ENCODED_INVARIANTS: Mapping[str, Encoder] = {
    "inv_ref_cnt_nonnegative": ref_cnt_nonnegative,
    "inv_null_block_isolated": null_block_isolated,
    "inv_free_queue_has_zero_ref": free_queue_has_zero_ref,
    "inv_conservation": conservation,
    "inv_hash_table_consistent": hash_table_consistent,
    "inv_caching_off_no_hash": caching_off_no_hash,
    "writable": writable_is_private,
}


def all_invariants(u: Universe, s: PoolVars) -> z3.BoolRef:
    """Every encoded invariant."""
    return z3.And(*(enc(u, s) for enc in ENCODED_INVARIANTS.values()))


# --- lists and batches ------------------------------------------------------------------------


@dataclass(frozen=True)
class Filtered:
    """`items[:length]` is `[src[i] for i in range(src_len) if keep(i)]`, with the maps that prove it."""

    items: z3.ArrayRef  # the kept items, in source order
    length: Index  # how many were kept
    src_index: z3.ArrayRef  # result position -> source position
    dst_index: z3.ArrayRef  # kept source position -> result position
    axioms: z3.BoolRef  # the filter relation


def filter_list(
    u: Universe, src: z3.ArrayRef, src_len: Index, keep: Callable[[Index], z3.BoolRef], name: str
) -> Filtered:
    """The order-preserving filter of a list, as a relation that determines it.

    `dst_index` maps the kept source positions onto [0, length), strictly
    increasing, and `src_index` is its inverse: so the result is the kept
    items in their source order, each once, and nothing else.
    """
    sigma, rho = _int_array(_name(f"{name}.src")), _int_array(_name(f"{name}.dst"))
    length = u.size(_name(f"{name}.len"))
    axioms = z3.And(
        length <= src_len,
        u.forall(
            0,
            length,
            lambda j: z3.And(sigma[j] >= 0, sigma[j] < src_len, keep(sigma[j]), rho[sigma[j]] == j),
            limit=src_len,
            trigger=lambda j: sigma[j],
        ),
        u.forall(
            0,
            src_len,
            lambda i: z3.Implies(keep(i), z3.And(rho[i] >= 0, rho[i] < length, sigma[rho[i]] == i)),
            trigger=lambda i: rho[i],
        ),
        u.forall_pairs(0, src_len, lambda i, j: z3.Implies(z3.And(keep(i), keep(j)), rho[i] < rho[j])),
    )
    items = _lam(lambda j: src[sigma[j]], f"{name}.items")
    return Filtered(items, length, sigma, rho, axioms)


@dataclass(frozen=True)
class Batch:
    """The block ids an operation is given, in order, with a ghost inverse."""

    ids: z3.ArrayRef  # position -> block id, positions [0, length)
    length: Index  # how many ids
    pos: z3.ArrayRef  # ghost: block id -> its position in ids


def fresh_batch(u: Universe, name: str) -> Batch:
    """A batch of unknown length and contents."""
    return Batch(_int_array(f"{name}.ids"), u.size(f"{name}.len"), _int_array(f"{name}.pos"))


def in_batch(batch: Batch, b: Index) -> z3.BoolRef:
    """Block b is named by the batch."""
    p = batch.pos[b]
    return z3.And(p >= 0, p < batch.length, batch.ids[p] == b)


def _valid_block_ids(u: Universe, s: PoolVars, batch: Batch) -> z3.BoolRef:
    """spec.ops._check_block_ids passes: every id in range, not the null block, named once."""
    return u.forall(
        0,
        batch.length,
        lambda t: z3.And(
            batch.ids[t] > NULL_BLOCK_ID,
            batch.ids[t] < s.num_gpu_blocks,
            batch.pos[batch.ids[t]] == t,
        ),
        trigger=lambda t: batch.ids[t],
    )


# --- operations -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    """One operation: when it succeeds, what defines its helpers, and the state after it."""

    guard: z3.BoolRef  # the arguments pass the operation's checks (it raises otherwise)
    axioms: z3.BoolRef  # the relations defining the filters it uses
    post: PoolVars  # the state after it
    taken: Callable[[Index], z3.BoolRef] | None = None  # get_new_blocks: whether a block was taken


def new_pool(u: Universe, num_gpu_blocks: Index, enable_caching: z3.BoolRef, name: str) -> PoolVars:
    """spec.ops.new_pool: blocks 1..n-1 free in id order, keys from spec.ordering's initial ones."""
    lo, hi = initial_key_counters(num_gpu_blocks)
    return PoolVars(
        num_gpu_blocks=num_gpu_blocks,
        enable_caching=enable_caching,
        ref_cnt=z3.K(_INT, z3.IntVal(0)),
        has_hash=z3.K(_INT, z3.BoolVal(False)),
        block_hash=z3.K(_INT, z3.IntVal(0)),
        free_queue=_lam(lambda i: i + 1, f"{name}.q"),
        num_free=num_gpu_blocks - 1,
        queue_pos=_lam(lambda b: b - 1, f"{name}.pos"),
        table_count=z3.K(_INT, z3.IntVal(0)),
        table_hash=z3.K(_INT, z3.IntVal(0)),
        key=_lam(lambda b: initial_free_key(b), f"{name}.key"),
        key_free=_lam(lambda b: z3.And(b > NULL_BLOCK_ID, b < num_gpu_blocks), f"{name}.key_free"),
        lo=lo,
        hi=hi,
    )


def get_new_blocks(u: Universe, s: PoolVars, num_blocks: Index) -> Step:
    """spec.ops.get_new_blocks: take the first num_blocks of the queue, evicting their hashes."""

    def taken(b: Index) -> z3.BoolRef:
        return z3.And(in_queue(s, b), s.queue_pos[b] < num_blocks)

    post = replace(
        s,
        ref_cnt=_lam(lambda b: z3.If(taken(b), 1, s.ref_cnt[b]), "take.ref"),
        has_hash=_lam(lambda b: z3.And(z3.Not(taken(b)), s.has_hash[b]), "take.hh"),
        free_queue=_lam(lambda i: s.free_queue[i + num_blocks], "take.q"),
        num_free=s.num_free - num_blocks,
        queue_pos=_lam(lambda b: s.queue_pos[b] - num_blocks, "take.pos"),
        table_count=_lam(lambda b: z3.If(taken(b), 0, s.table_count[b]), "take.tc"),
        # The key model takes the blocks with the smallest keys; lemma 6 shows they are these.
        key_free=_lam(lambda b: z3.And(s.key_free[b], z3.Not(taken(b))), "take.kf"),
    )
    guard = z3.And(num_blocks >= 0, num_blocks <= s.num_free)
    return Step(guard, z3.BoolVal(True), post, taken)


def touch(u: Universe, s: PoolVars, batch: Batch) -> Step:
    """spec.ops.touch: each block leaves the free queue if it is there, and gains a reference."""
    guard = z3.And(_valid_block_ids(u, s, batch), u.forall(0, batch.length, lambda t: s.has_hash[batch.ids[t]]))
    kept = filter_list(u, s.free_queue, s.num_free, lambda i: z3.Not(in_batch(batch, s.free_queue[i])), "touch.kept")

    def stays_free(b: Index) -> z3.BoolRef:
        return z3.And(in_queue(s, b), z3.Not(in_batch(batch, b)))

    post = replace(
        s,
        ref_cnt=_lam(lambda b: s.ref_cnt[b] + z3.If(in_batch(batch, b), 1, 0), "touch.ref"),
        free_queue=kept.items,
        num_free=kept.length,
        queue_pos=_lam(lambda b: z3.If(stays_free(b), kept.dst_index[s.queue_pos[b]], -1), "touch.pos"),
        key_free=_lam(lambda b: z3.And(s.key_free[b], z3.Not(in_batch(batch, b))), "touch.kf"),
    )
    return Step(guard, kept.axioms, post)


LeftKey = Callable[[Index, Index, Index], Index]  # (lo, batch_len, index) -> key
RightKey = Callable[[Index, Index], Index]  # (hi, index) -> key


@dataclass(frozen=True)
class _Release:
    """What one free_blocks call does to the queue: its newly free blocks, split by the end they join.

    The batch's blocks that reach ref_cnt 0 go left or right as
    spec.ordering.freed_goes_left says; each side keeps its batch order, the
    left ones before every free block, the right ones after.
    """

    s: PoolVars  # the state before the call
    batch: Batch  # the blocks freed, in order
    unhashed_to_left: bool  # the profile's rule for blocks freed without a hash
    evict_first: z3.BoolRef  # the call's evict_first: every block it frees goes left
    left: Filtered  # the newly free blocks that go left, in batch order
    right: Filtered  # the newly free blocks that go right, in batch order

    @staticmethod
    def split(u: Universe, s: PoolVars, batch: Batch, unhashed_to_left: bool, evict_first: z3.BoolRef) -> _Release:
        """The two sides of a free of `batch` from `s`, left first (the filters' names are drawn in that order)."""

        def joins(i: Index, end_is_left: bool) -> z3.BoolRef:
            b = batch.ids[i]
            goes_left = _goes_left(s, unhashed_to_left, evict_first, b)
            return z3.And(_newly_free(s, batch, b), goes_left if end_is_left else z3.Not(goes_left))

        left = filter_list(u, batch.ids, batch.length, lambda i: joins(i, True), "free.left")
        right = filter_list(u, batch.ids, batch.length, lambda i: joins(i, False), "free.right")
        return _Release(
            s=s, batch=batch, unhashed_to_left=unhashed_to_left, evict_first=evict_first, left=left, right=right
        )

    def joins(self, b: Index) -> tuple[z3.BoolRef, z3.BoolRef]:
        """Whether block b is newly free and joins the left end; whether it is newly free and joins the right."""
        newly_free = _newly_free(self.s, self.batch, b)
        goes_left = _goes_left(self.s, self.unhashed_to_left, self.evict_first, b)
        return z3.And(newly_free, goes_left), z3.And(newly_free, z3.Not(goes_left))

    def queue(self, i: z3.ArithRef) -> z3.ExprRef:
        """Position i of the queue after the call: the left side, the queue before, then the right side."""
        left, right, num_old = self.left, self.right, self.s.num_free
        num_left = left.length
        return z3.If(
            i < num_left,
            left.items[i],
            z3.If(i < num_left + num_old, self.s.free_queue[i - num_left], right.items[i - num_left - num_old]),
        )

    def position(self, b: z3.ArithRef) -> z3.ExprRef:
        """Block b's position in the queue after the call (-1 when not free)."""
        s, batch, left, right = self.s, self.batch, self.left, self.right
        num_left, num_old = left.length, s.num_free
        new_left, new_right = self.joins(b)
        return z3.If(
            new_left,
            left.dst_index[batch.pos[b]],
            z3.If(
                in_queue(s, b),
                s.queue_pos[b] + num_left,
                z3.If(new_right, num_left + num_old + right.dst_index[batch.pos[b]], -1),
            ),
        )

    def key(self, b: z3.ArithRef, left_key: LeftKey, right_key: RightKey) -> z3.ExprRef:
        """Block b's key after the call: a newly free block's from its side's batch keys, else unchanged."""
        s, batch, left, right = self.s, self.batch, self.left, self.right
        new_left, new_right = self.joins(b)
        return z3.If(
            new_left,
            left_key(s.lo, left.length, left.dst_index[batch.pos[b]]),
            z3.If(new_right, right_key(s.hi, right.dst_index[batch.pos[b]]), s.key[b]),
        )


def _newly_free(s: PoolVars, batch: Batch, b: Index) -> z3.BoolRef:
    """Block b is named by the batch and loses its last reference."""
    return z3.And(in_batch(batch, b), s.ref_cnt[b] == 1)


def _goes_left(s: PoolVars, unhashed_to_left: bool, evict_first: z3.BoolRef, b: Index) -> z3.BoolRef:
    """Block b, freed, joins the left end of the queue (spec.ordering.freed_goes_left)."""
    return freed_goes_left(z3.BoolVal(unhashed_to_left), s.has_hash[b], evict_first, Z3)


def free_blocks(
    u: Universe,
    s: PoolVars,
    batch: Batch,
    unhashed_to_left: bool,
    *,
    evict_first: z3.BoolRef | bool = False,
    check_ref_cnt: bool = True,
    left_key: LeftKey = left_batch_key,
    right_key: RightKey = right_batch_key,
) -> Step:
    """spec.ops.free_blocks: drop a reference from each block; those reaching 0 join the queue.

    Blocks that go left (spec.ordering.freed_goes_left: without a hash under
    `vllm-v1`, every one with `evict_first`) keep their batch order before
    every free block; the others keep theirs after every free block.
    `evict_first` may be a z3 boolean, so that one proof covers both calls.
    `check_ref_cnt=False`, `left_key` and `right_key` exist for the false twins
    only: a free that skips the double-free check, batches keyed the wrong way.
    """
    guard = _valid_block_ids(u, s, batch)
    if check_ref_cnt:
        guard = z3.And(guard, u.forall(0, batch.length, lambda t: s.ref_cnt[batch.ids[t]] > 0))
    first = z3.BoolVal(evict_first) if isinstance(evict_first, bool) else evict_first
    freed = _Release.split(u, s, batch, unhashed_to_left, first)
    left, right = freed.left, freed.right
    post = replace(
        s,
        ref_cnt=_lam(lambda b: s.ref_cnt[b] - z3.If(in_batch(batch, b), 1, 0), "free.ref"),
        free_queue=_lam(freed.queue, "free.q"),
        num_free=left.length + s.num_free + right.length,
        queue_pos=_lam(freed.position, "free.pos"),
        key=_lam(lambda b: freed.key(b, left_key, right_key), "free.key"),
        key_free=_lam(lambda b: z3.Or(s.key_free[b], _newly_free(s, batch, b)), "free.kf"),
        # The new keys span [lo - num_left, hi + num_right]: the smallest and largest given.
        lo=left_batch_key(s.lo, left.length, 0),
        hi=right_batch_key(s.hi, right.length - 1),
    )
    return Step(guard, z3.And(left.axioms, right.axioms), post)


def cache_full_blocks(u: Universe, s: PoolVars, batch: Batch, hashes: z3.ArrayRef) -> Step:
    """spec.ops.cache_full_blocks: register held, unhashed blocks; `hashes[t]` is batch item t's hash."""
    guard = z3.And(
        s.enable_caching,
        _valid_block_ids(u, s, batch),
        u.forall(
            0,
            batch.length,
            lambda t: z3.And(s.ref_cnt[batch.ids[t]] > 0, z3.Not(s.has_hash[batch.ids[t]])),
        ),
    )

    def new_hash(b: z3.ArithRef) -> z3.ExprRef:
        return hashes[batch.pos[b]]

    post = replace(
        s,
        has_hash=_lam(lambda b: z3.Or(s.has_hash[b], in_batch(batch, b)), "cache.hh"),
        block_hash=_lam(lambda b: z3.If(in_batch(batch, b), new_hash(b), s.block_hash[b]), "cache.h"),
        table_count=_lam(lambda b: s.table_count[b] + z3.If(in_batch(batch, b), 1, 0), "cache.tc"),
        table_hash=_lam(lambda b: z3.If(in_batch(batch, b), new_hash(b), s.table_hash[b]), "cache.th"),
    )
    return Step(guard, z3.BoolVal(True), post)


def evict_blocks(u: Universe, s: PoolVars, batch: Batch) -> Step:
    """spec.ops.evict_blocks: drop each named block's hash; queue and ref_cnt unchanged."""
    post = replace(
        s,
        has_hash=_lam(lambda b: z3.And(s.has_hash[b], z3.Not(in_batch(batch, b))), "evict.hh"),
        table_count=_lam(lambda b: z3.If(in_batch(batch, b), 0, s.table_count[b]), "evict.tc"),
    )
    return Step(_valid_block_ids(u, s, batch), z3.BoolVal(True), post)


def rearranged(u: Universe, s: PoolVars, name: str) -> tuple[PoolVars, z3.BoolRef]:
    """`s` with its free blocks in some other order, and the relation that defines it.

    A keyed policy (seed 002) re-derives the free queue after an operation: the
    same free blocks as the queue's operation leaves, in the policy's order. A
    claim proved for every order of them holds for every policy.
    """
    moved = replace(s, free_queue=_int_array(f"{name}.q"), queue_pos=_int_array(f"{name}.pos"))
    axioms = z3.And(
        u.forall(
            0,
            s.num_free,
            lambda i: z3.And(moved.queue_pos[moved.free_queue[i]] == i, in_queue(s, moved.free_queue[i])),
            trigger=lambda i: moved.free_queue[i],
        ),
        u.forall(0, s.num_gpu_blocks, lambda b: z3.Implies(in_queue(s, b), in_queue(moved, b))),
    )
    return moved, axioms


def reset_prefix_cache(u: Universe, s: PoolVars) -> Step:
    """spec.ops.reset_prefix_cache: forget every hash, only when every block but the null one is free."""
    done = s.num_free == s.num_gpu_blocks - 1
    post = replace(
        s,
        has_hash=_lam(lambda b: z3.And(z3.Not(done), s.has_hash[b]), "reset.hh"),
        table_count=_lam(lambda b: z3.If(done, 0, s.table_count[b]), "reset.tc"),
    )
    return Step(z3.BoolVal(True), z3.BoolVal(True), post)


# --- concrete states (the abstraction function) ---------------------------------------------------


def table_entries_well_formed(s: Snapshot) -> bool:
    """The part of the hash table's shape the arrays cannot express: one non-empty entry per hash."""
    hashes = [h for h, _ in s.hash_to_blocks]
    return len(set(hashes)) == len(hashes) and all(blocks for _, blocks in s.hash_to_blocks)


class HashNames:
    """Names hash bytes by small positive ints, by first appearance, consistently across states."""

    def __init__(self) -> None:
        self._ids: dict[bytes, int] = {}

    def __call__(self, h: bytes) -> int:
        """The int naming `h`."""
        return self._ids.setdefault(h, len(self._ids) + 1)


def _store(default: z3.ExprRef, items: Mapping[int, z3.ExprRef | int | bool]) -> z3.ArrayRef:
    arr: z3.ArrayRef = z3.K(_INT, default)
    for k, v in items.items():
        arr = z3.Store(arr, k, v)
    return arr


def encode_snapshot(state: PoolState | Snapshot, names: HashNames | None = None) -> PoolVars:
    """The arrays of a concrete pool-level state (key fields left unknown; exact everywhere else).

    Raises:
        ValueError: the snapshot has quarantined blocks or request block tables,
            which the pool model does not hold.
    """
    names = names or HashNames()
    snap = state.snapshot() if isinstance(state, PoolState) else state
    if snap.quarantined or snap.block_tables is not None:
        raise ValueError(
            f"encode_snapshot takes a pool-level state; got quarantined={list(snap.quarantined)} "
            f"block_tables={snap.block_tables!r}"
        )
    n = snap.num_gpu_blocks
    first_pos: dict[int, int] = {}
    for i, b in enumerate(snap.free_queue):
        first_pos.setdefault(b, i)
    count: dict[int, int] = {}
    listed_under: dict[int, int] = {}
    for h, blocks in snap.hash_to_blocks:
        for b in blocks:
            count[b] = count.get(b, 0) + 1
            listed_under.setdefault(b, names(h))
    hashed = {b: names(h) for b, h in enumerate(snap.block_hash) if h is not None}
    tag = _name("concrete")
    return PoolVars(
        num_gpu_blocks=n,
        enable_caching=z3.BoolVal(snap.enable_caching),
        ref_cnt=_store(z3.IntVal(0), dict(enumerate(snap.ref_cnt))),
        has_hash=_store(z3.BoolVal(False), dict.fromkeys(hashed, True)),
        block_hash=_store(z3.IntVal(0), hashed),
        free_queue=_store(z3.IntVal(-1), dict(enumerate(snap.free_queue))),
        num_free=len(snap.free_queue),
        queue_pos=_store(z3.IntVal(-1), first_pos),
        table_count=_store(z3.IntVal(0), count),
        table_hash=_store(z3.IntVal(0), listed_under),
        key=_int_array(f"{tag}.key"),
        key_free=_bool_array(f"{tag}.key_free"),
        lo=z3.Int(f"{tag}.lo"),
        hi=z3.Int(f"{tag}.hi"),
    )


def encode_batch(block_ids: Sequence[int]) -> Batch:
    """The arrays of a concrete list of block ids."""
    first: dict[int, int] = {}
    for i, b in enumerate(block_ids):
        first.setdefault(b, i)
    return Batch(_store(z3.IntVal(-1), dict(enumerate(block_ids))), len(block_ids), _store(z3.IntVal(-1), first))


def encode_hashes(hashes: Sequence[BlockHash], names: HashNames) -> z3.ArrayRef:
    """The array of a concrete list of hashes, named consistently with a state's."""
    return _store(z3.IntVal(0), {i: names(h) for i, h in enumerate(hashes)})


# --- counterexamples --------------------------------------------------------------------------

_SHOW_AT_MOST = 16  # blocks or positions printed before a counterexample is cut short


def model_bool(model: z3.ModelRef, value: z3.BoolRef) -> bool:
    """A boolean's value in a counterexample (an unconstrained one reads False)."""
    return bool(z3.is_true(model.eval(value, model_completion=True)))


def model_int(model: z3.ModelRef, term: object) -> int:
    """The value of an integer term under a model."""
    value = model.eval(term, model_completion=True)
    return value.as_long() if isinstance(value, z3.IntNumRef) else int(str(value))


_int = model_int


def _bool(model: z3.ModelRef, term: object) -> bool:
    return bool(z3.is_true(model.eval(term, model_completion=True)))


def _ids(model: z3.ModelRef, arr: z3.ArrayRef, length: Index) -> list[int]:
    n = _int(model, length)
    shown = [_int(model, arr[i]) for i in range(max(0, min(n, _SHOW_AT_MOST)))]
    return shown if n <= _SHOW_AT_MOST else [*shown, -1]


def _fmt_ids(ids: list[int]) -> str:
    return "[" + ", ".join("..." if b == -1 else str(b) for b in ids) + "]"


def render_state(model: z3.ModelRef, s: PoolVars, label: str, hash_label: Callable[[int], str]) -> str:
    """A state of a counterexample as the lines a student reads: ref_cnt, hashes, queue, table."""
    n = _int(model, s.num_gpu_blocks)
    shown = range(min(n, _SHOW_AT_MOST))
    ref = [_int(model, s.ref_cnt[b]) for b in shown]
    hashes = [hash_label(_int(model, s.block_hash[b])) if _bool(model, s.has_hash[b]) else "-" for b in shown]
    table: dict[str, list[int]] = {}
    for b in shown:
        for _ in range(max(0, _int(model, s.table_count[b]))):
            table.setdefault(hash_label(_int(model, s.table_hash[b])), []).append(b)
    more = "" if n <= _SHOW_AT_MOST else f" (first {_SHOW_AT_MOST} blocks shown)"
    caching = "" if _bool(model, s.enable_caching) else ", prefix caching off"
    table_text = ", ".join(f"{h} -> {bs}" for h, bs in table.items()) or "(empty)"
    return (
        f"  {label}: num_gpu_blocks={n}{caching}{more}\n"
        f"    ref_cnt      {ref}\n"
        f"    block_hash   [{', '.join(hashes)}]\n"
        f"    free_queue   {_fmt_ids(_ids(model, s.free_queue, s.num_free))}  (left is taken first)\n"
        f"    hash table   {table_text}"
    )


def render_batch(model: z3.ModelRef, batch: Batch) -> str:
    """A batch of block ids of a counterexample."""
    return _fmt_ids(_ids(model, batch.ids, batch.length))


def hash_labeller() -> Callable[[int], str]:
    """Names hash ints h1, h2, ... by first use within one counterexample."""
    seen: dict[int, str] = {}

    def label(h: int) -> str:
        return seen.setdefault(h, f"h{len(seen) + 1}")

    return label


# --- any call of any operation ------------------------------------------------------------------

OPERATIONS = (
    "get_new_blocks",
    "touch",
    "free_blocks",
    "cache_full_blocks",
    "evict_blocks",
    "reset_prefix_cache",
)
"""Every operation that can change a pool's state (the others only read it)."""


@dataclass(frozen=True)
class Call:
    """One call of an operation with unknown arguments."""

    op: str  # the operation's name in spec.ops
    step: Step  # its encoding
    describe: Callable[[z3.ModelRef, Callable[[int], str]], str]  # the call as text, under a model


def any_call(u: Universe, s: PoolVars, op: str, unhashed_to_left: bool, name: str) -> Call:
    """A call of `op` on `s` whose arguments are all unknown."""
    if op == "get_new_blocks":
        n = z3.Int(f"{name}.num_blocks")
        return Call(op, get_new_blocks(u, s, n), lambda m, h: f"get_new_blocks(num_blocks={_int(m, n)})")
    if op == "reset_prefix_cache":
        return Call(op, reset_prefix_cache(u, s), lambda m, h: "reset_prefix_cache()")
    batch = fresh_batch(u, f"{name}.block_ids")
    if op == "touch":
        step = touch(u, s, batch)
    elif op == "free_blocks":  # with evict_first or without: one proof covers both
        evict_first = z3.Bool(f"{name}.evict_first")
        step = free_blocks(u, s, batch, unhashed_to_left, evict_first=evict_first)

        def describe_free(m: z3.ModelRef, h: Callable[[int], str]) -> str:
            first = model_bool(m, evict_first)
            return f"free_blocks(block_ids={render_batch(m, batch)}{', evict_first=True' if first else ''})"

        return Call(op, step, describe_free)
    elif op == "evict_blocks":
        step = evict_blocks(u, s, batch)
    elif op == "cache_full_blocks":
        hashes = _int_array(f"{name}.block_hashes")
        step = cache_full_blocks(u, s, batch, hashes)

        def describe_cache(m: z3.ModelRef, h: Callable[[int], str]) -> str:
            n = _int(m, batch.length)
            named = ", ".join(h(_int(m, hashes[i])) for i in range(min(n, _SHOW_AT_MOST)))
            return f"cache_full_blocks(block_ids={render_batch(m, batch)}, block_hashes=[{named}])"

        return Call(op, step, describe_cache)
    else:
        raise ValueError(f"unknown operation op={op!r}; known: {', '.join(OPERATIONS)}")
    return Call(op, step, lambda m, h: f"{op}(block_ids={render_batch(m, batch)})")
