"""Wrong operations CrossHair must catch, each under the contracts of the spec operation it mimics.

A CrossHair run that finds nothing in the spec means something only if the
same run finds these. Each is one plausible bug; each carries, unchanged, the
icontract conditions (and the declared errors) of the spec function it
replaces (`with_contracts_of`), so the contracts under test are the spec's own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TypeVar

import icontract

from kvspec.spec import ops

# Every error a spec docstring declares (`raises: ...`) must be a name here too: CrossHair
# resolves the declaration in the module of the function it analyses.
from kvspec.spec.errors import AlreadyCached, DoubleFree, InvalidBlock, InvalidRequest, PoolExhausted
from kvspec.spec.ordering import place_freed, profile_rule
from kvspec.spec.state import BlockHash, BlockId, PoolState, canonical_hash_to_blocks
from kvspec.spec.step import Step

__all__ = ["BUGS", "AlreadyCached", "Bug", "InvalidRequest", "PoolExhausted"]

F = TypeVar("F", bound=Callable[..., object])


def with_contracts_of(spec_fn: Callable[..., object]) -> Callable[[F], F]:
    """Decorate a function with every precondition and postcondition of `spec_fn`, and its docstring."""

    def decorate(fn: F) -> F:
        decorated: Callable[..., object] = fn
        for contract in reversed(getattr(spec_fn, "__postconditions__", [])):
            decorated = icontract.ensure(contract.condition, description=contract.description)(decorated)
        for group in getattr(spec_fn, "__preconditions__", []):
            for contract in reversed(group):
                decorated = icontract.require(contract.condition, description=contract.description)(decorated)
        decorated.__doc__ = spec_fn.__doc__
        return decorated  # type: ignore[return-value]

    return decorate


def _freed(state: PoolState, ref_cnt: Sequence[int], block_ids: Sequence[BlockId]) -> tuple[BlockId, ...]:
    return place_freed(
        state.free_queue,
        [b for b in block_ids if ref_cnt[b] == 0],
        state.block_hash,
        profile_rule(state.config.profile),
    )


@with_contracts_of(ops.free_blocks)
def free_blocks_without_ref_cnt_check(state: PoolState, block_ids: Sequence[BlockId]) -> Step[PoolState, None]:
    """A double free goes unnoticed: ref_cnt drops below 0 and the block is queued twice."""
    ops._check_block_ids(state, block_ids, "free_blocks")
    ref_cnt = list(state.ref_cnt)
    for b in block_ids:
        ref_cnt[b] -= 1
    return Step(replace(state, ref_cnt=tuple(ref_cnt), free_queue=_freed(state, ref_cnt, block_ids)), None)


@with_contracts_of(ops.free_blocks)
def free_blocks_hashed_to_the_left(state: PoolState, block_ids: Sequence[BlockId]) -> Step[PoolState, None]:
    """Every freed block goes to the left end: cached blocks are evicted first, not last."""
    ops._check_block_ids(state, block_ids, "free_blocks")
    for b in block_ids:
        if state.ref_cnt[b] == 0:
            raise DoubleFree(f"free_blocks: block_id={b} has ref_cnt=0")
    ref_cnt = list(state.ref_cnt)
    for b in block_ids:
        ref_cnt[b] -= 1
    newly_free = tuple(b for b in block_ids if ref_cnt[b] == 0)
    return Step(replace(state, ref_cnt=tuple(ref_cnt), free_queue=newly_free + state.free_queue), None)


@with_contracts_of(ops.free_blocks)
def free_blocks_keeps_the_timestamp(state: PoolState, block_ids: Sequence[BlockId]) -> Step[PoolState, None]:
    """Under a keyed policy the free stamps nothing: a request's last step is forgotten (seed 002's LRU)."""
    freed = ops.free_blocks(state, block_ids).state
    if not profile_rule(state.config.profile).keyed:
        return Step(freed, None)
    return Step(ops._reordered(replace(freed, last_access=state.last_access, clock=state.clock)), None)


@with_contracts_of(ops.touch)
def touch_forgets_the_queue(state: PoolState, block_ids: Sequence[BlockId]) -> Step[PoolState, None]:
    """A hit raises ref_cnt but leaves the block in the free queue, where it can be reallocated."""
    ops._check_block_ids(state, block_ids, "touch")
    for b in block_ids:
        if state.block_hash[b] is None:
            raise InvalidBlock(f"touch: block_id={b} has no hash")
    ref_cnt = list(state.ref_cnt)
    for b in block_ids:
        ref_cnt[b] += 1
    return Step(replace(state, ref_cnt=tuple(ref_cnt)), None)


@with_contracts_of(ops.get_new_blocks)
def get_new_blocks_keeps_the_hash(state: PoolState, num_blocks: int) -> Step[PoolState, tuple[BlockId, ...]]:
    """Reallocating a cached block keeps its hash: a later request would hit someone else's KV."""
    taken = ops.get_new_blocks(state, num_blocks)
    kept = replace(taken.state, block_hash=state.block_hash, hash_to_blocks=state.hash_to_blocks)
    return Step(kept, taken.result)


@with_contracts_of(ops.get_new_blocks)
def get_new_blocks_from_the_right(state: PoolState, num_blocks: int) -> Step[PoolState, tuple[BlockId, ...]]:
    """Blocks are taken from the wrong end: the most recently used go first."""
    mirrored = replace(state, free_queue=state.free_queue[::-1])
    taken = ops.get_new_blocks(mirrored, num_blocks)
    return Step(replace(taken.state, free_queue=taken.state.free_queue[::-1]), taken.result)


@with_contracts_of(ops.cache_full_blocks)
def cache_full_blocks_skips_the_table(
    state: PoolState, block_ids: Sequence[BlockId], block_hashes: Sequence[BlockHash]
) -> Step[PoolState, None]:
    """Blocks get their hash but are never entered in hash_to_blocks: nothing can hit them."""
    registered = ops.cache_full_blocks(state, block_ids, block_hashes).state
    return Step(replace(registered, hash_to_blocks=canonical_hash_to_blocks(state.hash_to_blocks)), None)


@with_contracts_of(ops.reset_prefix_cache)
def reset_prefix_cache_while_held(state: PoolState) -> Step[PoolState, bool]:
    """The cache is reset even while requests hold registered blocks."""
    return Step(replace(state, block_hash=(None,) * state.num_gpu_blocks, hash_to_blocks=()), True)


class Bug:
    """A planted wrong operation, the spec operation it imitates, and the postcondition it breaks."""

    def __init__(self, fn: Callable[..., object], spec_fn: Callable[..., object], caught_by: str) -> None:
        self.fn = fn  # the wrong operation, under the spec's contracts
        self.spec_fn = spec_fn  # the spec operation it replaces
        self.caught_by = caught_by  # text of the spec postcondition whose search must find it

    @property
    def name(self) -> str:
        """The wrong operation's name."""
        return self.fn.__name__


BUGS: tuple[Bug, ...] = (
    Bug(free_blocks_without_ref_cnt_check, ops.free_blocks, "_holds(result.state)"),
    Bug(free_blocks_hashed_to_the_left, ops.free_blocks, "_freed_as_the_policy_says("),
    Bug(free_blocks_keeps_the_timestamp, ops.free_blocks, "_freed_as_the_policy_says("),
    Bug(touch_forgets_the_queue, ops.touch, "not set(block_ids) & set(result.state.free_queue)"),
    Bug(get_new_blocks_keeps_the_hash, ops.get_new_blocks, "result.state.block_hash[b] is None"),
    Bug(get_new_blocks_from_the_right, ops.get_new_blocks, "result.result == state.free_queue[: len(result.result)]"),
    Bug(cache_full_blocks_skips_the_table, ops.cache_full_blocks, "_holds(result.state)"),
    Bug(reset_prefix_cache_while_held, ops.reset_prefix_cache, "result.result == (len(state.free_queue)"),
)
