"""The BlockPool operations, one pure function each, with contracts.

Each operation takes a `PoolState` and returns a `Step` (kvspec.spec.step): the
new state, its result and its events, the same shape for every operation;
nothing is mutated, so "a failed call leaves the state unchanged" holds by
construction here and is what implementations are held to. Arguments are
validated first and a caller mistake raises a typed `BlockManagerError`
(spec.errors); the contracts (`icontract`, read by CrossHair) state what holds
for every valid call: the invariants before and after (`all_hold`, never
restated inline) plus each operation's own postconditions.

Names and semantics follow vLLM's `vllm/v1/core/block_pool.py`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import icontract

from kvspec.spec.errors import (
    AlreadyCached,
    DoubleFree,
    InvalidBlock,
    InvalidRequest,
    PoolExhausted,
    is_int,
)
from kvspec.spec.events import AllBlocksCleared, BlockRemoved, BlockStored, EventMirror, KVCacheEvent, table_counts
from kvspec.spec.invariants import all_hold, event_mirror_exact
from kvspec.spec.invariants import is_block_writable as _writable
from kvspec.spec.ordering import (
    ProfileRule,
    freed_in_place,
    in_keyed_order,
    keyed_free_order,
    place_freed,
    profile_rule,
)
from kvspec.spec.state import (
    NULL_BLOCK_ID,
    BlockHash,
    BlockId,
    HashTable,
    PoolConfig,
    PoolState,
    canonical_hash_to_blocks,
)
from kvspec.spec.step import Step

__all__ = [
    "cache_full_blocks",
    "evict_blocks",
    "free_blocks",
    "get_cached_block",
    "get_new_blocks",
    "get_num_free_blocks",
    "get_usage",
    "is_block_writable",
    "new_pool",
    "reset_prefix_cache",
    "touch",
]


def _holds(state: PoolState) -> bool:
    return all_hold(state.snapshot()) and _in_policy_order(state)


def _events_explain(state: PoolState, step: Step[PoolState, object]) -> bool:
    """The step's events account for its change to the hash table, key by key (what a router mirrors)."""
    return event_mirror_exact(EventMirror(table_counts(state.hash_to_blocks)), step.events, step.state.snapshot())


def _removed(state: PoolState, block_ids: Sequence[BlockId]) -> tuple[KVCacheEvent, ...]:
    """One `BlockRemoved` per block of `block_ids` that has a hash, in the given order."""
    return tuple(BlockRemoved((h,)) for h in (state.block_hash[b] for b in block_ids) if h is not None)


def _rule(state: PoolState) -> ProfileRule:
    return profile_rule(state.config.profile)


def _in_policy_order(state: PoolState) -> bool:
    """Under a keyed policy, the free queue is in its order; a queue policy's order is the queue itself."""
    rule = _rule(state)
    return not rule.keyed or in_keyed_order(rule, state.free_queue, *_stamps(state))


def _stamps(
    state: PoolState,
) -> tuple[tuple[BlockHash | None, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[bool, ...]]:
    """What a keyed policy's order reads of each block: its hash, then its stamps (spec.ordering.keyed_rank)."""
    return state.block_hash, state.last_access, state.num_accesses, state.registered_at, state.is_evict_first


def _freed_as_the_policy_says(
    state: PoolState, block_ids: Sequence[BlockId], new: PoolState, evict_first: bool = False
) -> bool:
    """A queue policy placed the newly free blocks at its ends; a keyed one stamped every block named.

    Either way `evict_first` decides as well: left with the hashless blocks
    under a queue policy, the first tier of the key under a keyed one.
    """
    rule = _rule(state)
    if rule.keyed:
        return all(new.last_access[b] >= state.clock and new.is_evict_first[b] == evict_first for b in block_ids)
    newly_free = [b for b in block_ids if state.ref_cnt[b] == 1]
    return freed_in_place(state.free_queue, newly_free, state.block_hash, rule, new.free_queue, evict_first)


def _same_free_blocks(state: PoolState, new: PoolState) -> bool:
    """The same free blocks; in the same order under a queue policy (a keyed one may re-sort them)."""
    if _rule(state).keyed:
        return sorted(new.free_queue) == sorted(state.free_queue)
    return new.free_queue == state.free_queue


# --- the keyed policies' clock (spec.ordering) -------------------------------------------


def _stamp(stamps: tuple[int, ...], block_ids: Sequence[BlockId], clock: int) -> tuple[int, ...]:
    """`stamps` with the i-th block of `block_ids` stamped `clock + i`."""
    new = list(stamps)
    for i, b in enumerate(block_ids):
        new[b] = clock + i
    return tuple(new)


def _marked(flags: tuple[bool, ...], block_ids: Sequence[BlockId], value: bool) -> tuple[bool, ...]:
    """`flags` with every block of `block_ids` set to `value`."""
    new = list(flags)
    for b in block_ids:
        new[b] = value
    return tuple(new)


def _reordered(state: PoolState) -> PoolState:
    """Under a keyed policy, the state with its free queue in the policy's order; otherwise the state."""
    rule = _rule(state)
    if not rule.keyed:
        return state
    order = keyed_free_order(rule, state.free_queue, *_stamps(state))
    return replace(state, free_queue=order)


# --- argument checks (shared by every operation) --------------------------------------------


def _check_block_ids(state: PoolState, block_ids: Sequence[BlockId], op: str) -> None:
    """Every id is an int in range, not the null block, and named once.

    Out of range is two checks, below 0 and past the pool, one message: an
    implementation taking plain ids may do a different thing with each (a
    Python list reads -1 as its last block), so the error contract
    (kvspec.conformance.core.error_contract) has a caller mistake for each.
    """
    for b in block_ids:
        out_of_range = f"{op}: block_id={b!r} is not a block of this pool (ids 0..{state.num_gpu_blocks - 1})"
        if not is_int(b):
            raise InvalidBlock(out_of_range)
        if b < 0:
            raise InvalidBlock(out_of_range)
        if b >= state.num_gpu_blocks:
            raise InvalidBlock(out_of_range)
        if b == NULL_BLOCK_ID:
            raise InvalidBlock(f"{op}: block_id=0 is the null block, whose ref_cnt is never maintained")
    if len(set(block_ids)) != len(block_ids):
        raise InvalidRequest(f"{op}: block_ids={list(block_ids)} names a block twice")


def _without_blocks(table: HashTable, dropped: set[BlockId]) -> HashTable:
    """The hash table with `dropped` blocks removed, empty entries deleted."""
    kept = ((h, tuple(b for b in blocks if b not in dropped)) for h, blocks in table)
    return canonical_hash_to_blocks(tuple((h, blocks) for h, blocks in kept if blocks))


# --- construction ---------------------------------------------------------------------------


@icontract.ensure(lambda result: _holds(result))
@icontract.ensure(lambda num_gpu_blocks, result: result.free_queue == tuple(range(1, num_gpu_blocks)))
def new_pool(num_gpu_blocks: int, enable_caching: bool = True, profile: str = "vllm-v1") -> PoolState:
    """A fresh pool: block 0 is the null block, blocks 1..n-1 are free in id order.

    Raises:
        InvalidRequest: num_gpu_blocks is not an integer >= 1, or the profile is unknown.

    raises: InvalidRequest  # the errors above, as CrossHair reads them

    >>> new_pool(4).free_queue
    (1, 2, 3)
    """
    if not is_int(num_gpu_blocks) or num_gpu_blocks < 1:
        raise InvalidRequest(
            f"num_gpu_blocks must be an integer >= 1 (block 0 is the null block); got num_gpu_blocks={num_gpu_blocks!r}"
        )
    try:
        profile_rule(profile)
    except ValueError as e:
        raise InvalidRequest(str(e)) from None
    return PoolState.initial(PoolConfig(num_gpu_blocks, bool(enable_caching), profile))


# --- operations -----------------------------------------------------------------------------


@icontract.require(lambda state: _holds(state))
@icontract.ensure(lambda result: _holds(result.state))
@icontract.ensure(lambda state, result: _events_explain(state, result))
@icontract.ensure(lambda num_blocks, result: len(result.result) == num_blocks)
@icontract.ensure(lambda state, result: result.result == state.free_queue[: len(result.result)])
@icontract.ensure(
    lambda result: all(result.state.ref_cnt[b] == 1 and result.state.block_hash[b] is None for b in result.result)
)
def get_new_blocks(state: PoolState, num_blocks: int) -> Step[PoolState, tuple[BlockId, ...]]:
    """Take `num_blocks` blocks from the left end of the free queue, evicting their cached hashes.

    Under a keyed policy the left end is first fit (the free blocks without a
    hash, lowest id first), then the hashed ones in key order; each block taken
    is stamped and counts one access.

    Args:
        state: the pool.
        num_blocks: how many blocks to take.

    Returns:
        The new state and, as its result, the blocks taken, in queue order, each with ref_cnt 1.

    Raises:
        InvalidRequest: num_blocks is not a non-negative integer.
        PoolExhausted: fewer than num_blocks blocks are free.

    raises: InvalidRequest, PoolExhausted  # the errors above, as CrossHair reads them
    """
    if not is_int(num_blocks) or num_blocks < 0:
        raise InvalidRequest(
            f"get_new_blocks: num_blocks must be a non-negative integer; got num_blocks={num_blocks!r}"
        )
    num_free = len(state.free_queue)
    if num_blocks > num_free:
        raise PoolExhausted(
            f"cannot allocate num_blocks={num_blocks}: {num_free} free of num_gpu_blocks={state.num_gpu_blocks}, "
            "one is the null block"
        )
    taken = state.free_queue[:num_blocks]
    # Taking a block is what evicts it: its hash leaves the table only now, so a
    # freed block stays hittable until someone actually needs the memory.
    ref_cnt = list(state.ref_cnt)
    block_hash = list(state.block_hash)
    for b in taken:
        ref_cnt[b] = 1
        block_hash[b] = None
    new_state = replace(
        state,
        ref_cnt=tuple(ref_cnt),
        block_hash=tuple(block_hash),
        free_queue=state.free_queue[num_blocks:],
        hash_to_blocks=_without_blocks(state.hash_to_blocks, set(taken)),
    )
    if _rule(state).keyed:  # an allocation is an access, the first of the block's new life
        accesses = list(state.num_accesses)
        for b in taken:
            accesses[b] = 1
        new_state = replace(
            new_state,
            clock=state.clock + len(taken),
            last_access=_stamp(state.last_access, taken, state.clock),
            num_accesses=tuple(accesses),
        )
    return Step(new_state, taken, _removed(state, taken))


@icontract.require(lambda state: _holds(state))
@icontract.ensure(lambda result: _holds(result.state))
@icontract.ensure(
    lambda state, block_ids, result: all(result.state.ref_cnt[b] == state.ref_cnt[b] + 1 for b in block_ids)
)
@icontract.ensure(lambda block_ids, result: not set(block_ids) & set(result.state.free_queue))
@icontract.ensure(lambda state, result: _events_explain(state, result))
def touch(state: PoolState, block_ids: Sequence[BlockId]) -> Step[PoolState, None]:
    """Take a hit on cached blocks: each leaves the free queue if it was there, and its ref_cnt grows by one.

    Under a keyed policy each block hit is stamped and counts one access.

    Args:
        state: the pool.
        block_ids: the blocks hit, each registered in the hash table.

    Returns:
        The new state; the result is None.

    Raises:
        InvalidBlock: an id is out of range, the null block, or a block without a hash
            (nothing can hit it).
        InvalidRequest: an id is named twice.

    raises: InvalidBlock, InvalidRequest  # the errors above, as CrossHair reads them
    """
    _check_block_ids(state, block_ids, "touch")
    for b in block_ids:
        if state.block_hash[b] is None:
            raise InvalidBlock(
                f"touch: block_id={b} has no hash (ref_cnt={state.ref_cnt[b]}), so no request can have hit it; "
                "stale block table?"
            )
    touched = set(block_ids)
    ref_cnt = list(state.ref_cnt)
    for b in block_ids:
        ref_cnt[b] += 1
    new_state = replace(
        state,
        ref_cnt=tuple(ref_cnt),
        free_queue=tuple(b for b in state.free_queue if b not in touched),
    )
    if _rule(state).keyed:  # a hit is an access
        accesses = list(state.num_accesses)
        for b in block_ids:
            accesses[b] += 1
        new_state = replace(
            new_state,
            clock=state.clock + len(block_ids),
            last_access=_stamp(state.last_access, block_ids, state.clock),
            num_accesses=tuple(accesses),
        )
    return Step(new_state, None)


@icontract.require(lambda state: _holds(state))
@icontract.ensure(lambda result: _holds(result.state))
@icontract.ensure(
    lambda state, block_ids, result: all(result.state.ref_cnt[b] == state.ref_cnt[b] - 1 for b in block_ids)
)
@icontract.ensure(lambda state, result: result.state.hash_to_blocks == state.hash_to_blocks)
@icontract.ensure(
    lambda state, block_ids, evict_first, result: _freed_as_the_policy_says(state, block_ids, result.state, evict_first)
)
@icontract.ensure(lambda state, result: _events_explain(state, result))
def free_blocks(state: PoolState, block_ids: Sequence[BlockId], evict_first: bool = False) -> Step[PoolState, None]:
    """Drop one reference to each block, in the given (eviction-priority) order.

    A block whose ref_cnt reaches 0 joins the free queue at the end the profile
    names (`vllm-v1`: left without a hash, right with one), or, under a keyed
    policy, where its key puts it, every block named being stamped in the
    given order. It keeps its hash: a free block can still be hit until it is
    reallocated.

    `evict_first` (vLLM 0.34.0's `BlockPool.free_blocks`, for blocks whose
    content another tier already holds) makes every block freed here go
    before every other cached block: under a queue policy it goes left, in
    the same batch as the blocks without a hash (vLLM's `prepend_n`); under a
    keyed policy it is stamped into the key's first tier
    (spec.ordering.eviction_key). No caller inside vLLM passes it, so the
    request level never does either.

    Args:
        state: the pool.
        block_ids: a request's blocks, tail first (the caller reverses its block table).
        evict_first: evict the blocks freed here before every other cached block.

    Returns:
        The new state; the result is None.

    Raises:
        InvalidBlock: an id is out of range or the null block.
        InvalidRequest: an id is named twice, or evict_first is not a bool.
        DoubleFree: a block has ref_cnt 0.

    raises: InvalidBlock, InvalidRequest, DoubleFree  # the errors above, as CrossHair reads them
    """
    if not isinstance(evict_first, bool):
        raise InvalidRequest(f"free_blocks: evict_first={evict_first!r} is not a bool")
    _check_block_ids(state, block_ids, "free_blocks")
    for b in block_ids:
        if state.ref_cnt[b] == 0:
            raise DoubleFree(f"free_blocks: block_id={b} has ref_cnt=0, no request holds it (double free?)")
    ref_cnt = list(state.ref_cnt)
    for b in block_ids:
        ref_cnt[b] -= 1
    newly_free = [b for b in block_ids if ref_cnt[b] == 0]
    rule = _rule(state)
    if rule.keyed:
        # The freeing request's last step read every block it names: stamped in
        # the given order (tail first), and the queue re-derived from the keys.
        stamped = replace(
            state,
            ref_cnt=tuple(ref_cnt),
            free_queue=state.free_queue + tuple(newly_free),
            clock=state.clock + len(block_ids),
            last_access=_stamp(state.last_access, block_ids, state.clock),
            is_evict_first=_marked(state.is_evict_first, block_ids, evict_first),
        )
        return Step(_reordered(stamped), None)
    free_queue = place_freed(state.free_queue, newly_free, state.block_hash, rule, evict_first)
    return Step(replace(state, ref_cnt=tuple(ref_cnt), free_queue=free_queue), None)


@icontract.require(lambda state: _holds(state))
@icontract.ensure(lambda result: _holds(result.state))
@icontract.ensure(
    lambda block_ids, block_hashes, result: all(
        result.state.block_hash[b] == h for b, h in zip(block_ids, block_hashes)
    )
)
@icontract.ensure(
    lambda state, result: result.state.free_queue == state.free_queue and result.state.ref_cnt == state.ref_cnt
)
@icontract.ensure(lambda state, result: _events_explain(state, result))
def cache_full_blocks(
    state: PoolState, block_ids: Sequence[BlockId], block_hashes: Sequence[BlockHash]
) -> Step[PoolState, None]:
    """Register full blocks under their hashes, so later requests can hit them.

    A hash that is already registered gets the block added after the existing
    ones: identical full blocks are not merged, because a request's block table
    is append-only and must not change under it.

    Args:
        state: the pool.
        block_ids: held blocks without a hash, now full.
        block_hashes: their hashes, one per block.

    Returns:
        The new state; the result is None.

    Raises:
        InvalidRequest: caching is off, the lengths differ, an id is named twice, or a hash is not bytes.
        InvalidBlock: an id is out of range, the null block, or not held by any request.
        AlreadyCached: a block already has a hash.

    raises: InvalidRequest, InvalidBlock, AlreadyCached  # the errors above, as CrossHair reads them
    """
    if not state.config.enable_caching:
        raise InvalidRequest("cache_full_blocks: prefix caching is off (enable_caching=False), nothing is hashed")
    if len(block_ids) != len(block_hashes):
        raise InvalidRequest(
            f"cache_full_blocks: {len(block_ids)} block_ids but {len(block_hashes)} block_hashes; one hash per block"
        )
    _check_block_ids(state, block_ids, "cache_full_blocks")
    for b, h in zip(block_ids, block_hashes):
        if not isinstance(h, bytes):
            raise InvalidRequest(f"cache_full_blocks: block_hash={h!r} for block_id={b} is not bytes")
        if state.ref_cnt[b] == 0:
            raise InvalidBlock(f"cache_full_blocks: block_id={b} has ref_cnt=0; only a held, computed block is cached")
        if state.block_hash[b] is not None:
            raise AlreadyCached(f"cache_full_blocks: block_id={b} is already registered; a block is cached once")
    block_hash = list(state.block_hash)
    table = {h: list(blocks) for h, blocks in state.hash_to_blocks}
    for b, h in zip(block_ids, block_hashes):
        block_hash[b] = h
        table.setdefault(h, []).append(b)
    new_table = canonical_hash_to_blocks(tuple((h, tuple(blocks)) for h, blocks in table.items()))
    new_state = replace(state, block_hash=tuple(block_hash), hash_to_blocks=new_table)
    if _rule(state).keyed:  # block-age reads when the content was registered
        new_state = replace(
            new_state,
            clock=state.clock + len(block_ids),
            registered_at=_stamp(state.registered_at, block_ids, state.clock),
        )
    # Told blocks and hashes only, the pool level publishes the keys; the request
    # level (spec.manager) publishes the parent, tokens and keys it knows instead.
    stored = BlockStored(block_hashes=tuple(block_hashes), parent_block_hash=None)
    return Step(new_state, None, (stored,) if block_ids else ())


@icontract.require(lambda state: _holds(state))
@icontract.ensure(
    lambda state, block_hash, result: result.result is None or state.block_hash[result.result] == block_hash
)
@icontract.ensure(lambda state, result: result.state is state)
def get_cached_block(state: PoolState, block_hash: BlockHash) -> Step[PoolState, BlockId | None]:
    """The first block registered under `block_hash`, or None on a miss.

    Returns:
        The state, unchanged, and a block id or None.

    Raises:
        InvalidRequest: block_hash is not bytes.

    raises: InvalidRequest  # the errors above, as CrossHair reads them
    """
    if not isinstance(block_hash, bytes):
        raise InvalidRequest(f"get_cached_block: block_hash={block_hash!r} is not bytes")
    for h, blocks in state.hash_to_blocks:
        if h == block_hash:
            return Step(state, blocks[0])
    return Step(state, None)


@icontract.require(lambda state: _holds(state))
@icontract.ensure(lambda result: _holds(result.state))
@icontract.ensure(lambda block_ids, result: all(result.state.block_hash[b] is None for b in block_ids))
@icontract.ensure(lambda state, result: _same_free_blocks(state, result.state))
@icontract.ensure(lambda state, result: result.state.ref_cnt == state.ref_cnt)
@icontract.ensure(lambda state, result: _events_explain(state, result))
def evict_blocks(state: PoolState, block_ids: Sequence[BlockId]) -> Step[PoolState, None]:
    """Drop the cached hash of each block (held or free); blocks without a hash are left alone.

    Used when a block's content is known to be bad (an external load failed):
    it must never be hit again, but whoever holds it keeps it. Under a keyed
    policy a free block that loses its hash joins the first-fit blocks.

    Raises:
        InvalidBlock: an id is out of range or the null block.
        InvalidRequest: an id is named twice.

    raises: InvalidBlock, InvalidRequest  # the errors above, as CrossHair reads them
    """
    _check_block_ids(state, block_ids, "evict_blocks")
    dropped = set(block_ids)
    block_hash = tuple(None if b in dropped else h for b, h in enumerate(state.block_hash))
    new_state = replace(state, block_hash=block_hash, hash_to_blocks=_without_blocks(state.hash_to_blocks, dropped))
    return Step(_reordered(new_state), None, _removed(state, block_ids))


@icontract.require(lambda state: _holds(state))
@icontract.ensure(lambda result: _holds(result.state))
@icontract.ensure(lambda state, result: result.result == (len(state.free_queue) == state.num_gpu_blocks - 1))
@icontract.ensure(lambda state, result: result.result or result.state == state)
@icontract.ensure(lambda result: not result.result or not result.state.hash_to_blocks)
@icontract.ensure(lambda state, result: _events_explain(state, result))
def reset_prefix_cache(state: PoolState) -> Step[PoolState, bool]:
    """Forget every cached hash, but only when no request holds a block.

    Refused (False, nothing changes) while blocks are held: a running request's
    blocks are registered, and un-registering them under it would let its
    next cache step re-register them out of order. The free queue keeps its
    order (under a keyed policy every block is now first fit: id order).

    Returns:
        The new state, and whether the reset happened.
    """
    if len(state.free_queue) != state.num_gpu_blocks - 1:
        return Step(state, False)
    cleared = replace(state, block_hash=(None,) * state.num_gpu_blocks, hash_to_blocks=())
    return Step(_reordered(cleared), True, (AllBlocksCleared(),))


@icontract.ensure(lambda state, result: result.result == len(state.free_queue) and result.state is state)
def get_num_free_blocks(state: PoolState) -> Step[PoolState, int]:
    """How many blocks `get_new_blocks` could take now (the state, unchanged, and the count)."""
    return Step(state, len(state.free_queue))


@icontract.ensure(lambda result: 0.0 <= result.result <= 1.0)
@icontract.ensure(lambda state, result: result.state is state)
def get_usage(state: PoolState) -> Step[PoolState, float]:
    """The fraction of allocatable blocks (all but the null block) held by requests (the state, unchanged).

    >>> get_usage(new_pool(5)).result
    0.0
    """
    num_allocatable = state.num_gpu_blocks - 1
    if num_allocatable == 0:
        return Step(state, 0.0)
    return Step(state, 1.0 - len(state.free_queue) / num_allocatable)


@icontract.ensure(lambda state, block_id, result: result.result == _writable(state.snapshot(), block_id))
@icontract.ensure(lambda state, result: result.state is state)
def is_block_writable(state: PoolState, block_id: BlockId) -> Step[PoolState, bool]:
    """Whether a request may write KV into `block_id` (spec.invariants.is_block_writable).

    Raises:
        InvalidBlock: block_id is not a block of this pool.

    raises: InvalidBlock  # the errors above, as CrossHair reads them
    """
    if not is_int(block_id) or not 0 <= block_id < state.num_gpu_blocks:
        raise InvalidBlock(
            f"is_block_writable: block_id={block_id!r} is not a block of this pool (ids 0..{state.num_gpu_blocks - 1})"
        )
    return Step(state, _writable(state.snapshot(), block_id))
