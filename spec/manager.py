"""The request level: vLLM's KVCacheManager over one BlockPool, as pure functions.

A request has one block table per KV cache group (spec.attention: full
attention, a sliding window, chunked local attention), all allocating from one
pool; a table is append-only while the request runs, except that a group's
blocks it no longer reads are freed and replaced by the null block. The
manager finds a new request's prefix hit (`get_computed_blocks`), gives it
slots for the tokens of a step (`allocate_slots`, which frees skipped blocks,
touches the hit blocks, takes new ones, and registers every block that the
step fills), and frees it when it finishes or is preempted (`free`, tail
first, group by group).

Design choices:
- Blocks are registered when the step that fills them is scheduled (as vLLM
  does), not after it ran; the alternative (register after the forward pass)
  would need a second call per step and would let two requests scheduled in
  one step both miss on the same prefix more often.
- A failed allocation (not enough free blocks) returns None and takes and
  touches nothing. It does free a running request's skipped blocks first, as
  vLLM's `allocate_slots` runs `remove_skipped_blocks` before it counts the
  free blocks: the request no longer reads them whatever the allocation does,
  and freeing them first is what lets a sliding-window request go on in a
  nearly full pool. The harness counts that branch ("refused after freeing
  skipped blocks").
- Every group has the manager's block size (vLLM's hybrid managers allow a
  multiple per group, and a hash block size below; not modelled), and a
  chunk is a multiple of it (vLLM's chunked local attention backend asserts
  it; the manager's chunked hit search relies on it).
- The hit is vLLM's: each attention type's own search (spec.attention) and,
  with several groups, the coordinator's fixed point over attention types,
  full attention first: a length every group can serve.

Several groups are loops over the same phases; with one full-attention group
(the default) everything reduces to the single-table manager, state for state.
Hit blocks and new blocks cross the API as one flat list, group by group:
every group's hit has the same number of positions (the null block at the
skipped ones), so the list splits evenly.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Container, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TypeVar, cast

import icontract

from kvspec.spec import ops
from kvspec.spec.attention import FULL, KVGroup, format_groups, num_skipped_blocks, parse_groups, window_hit_blocks
from kvspec.spec.errors import InvalidBlock, InvalidRequest, is_count, is_int
from kvspec.spec.events import BlockStored, EventMirror, KVCacheEvent, event_extra_keys, table_counts
from kvspec.spec.hashing import DEFAULT_HASH_FN, DEFAULT_SEED, MultiModalInput, hash_request_blocks
from kvspec.spec.invariants import all_hold, check_hit, event_mirror_exact
from kvspec.spec.state import (
    NULL_BLOCK_ID,
    TABLE_GROUP_MARK,
    BlockHash,
    BlockId,
    PoolState,
    Snapshot,
    group_key,
    table_name,
)
from kvspec.spec.stats import PrefixCacheStats
from kvspec.spec.step import Step

__all__ = [
    "AllocationStep",
    "ManagerConfig",
    "ManagerState",
    "Request",
    "ManagerView",
    "RequestBlocks",
    "allocate_slots",
    "cache_blocks",
    "check_allocation",
    "check_cache_count",
    "check_lookup",
    "check_request",
    "check_step_counts",
    "evict_blocks",
    "free",
    "get_computed_blocks",
    "get_num_cached_tokens",
    "lookup_enabled",
    "manager_config",
    "new_manager",
    "request_block_hashes",
    "reset_prefix_cache",
]

# Inside a manager operation the pool operations run without their own
# contracts: the manager's contracts check every invariant of the whole state
# (the pool's included) before and after each operation, and each pool
# operation's contracts are checked where it is called alone (the pool level,
# CrossHair). Checking them again for every pool call inside one request step
# was most of a request-level campaign's time.
F = TypeVar("F", bound=Callable[..., object])


def _unchecked(operation: F) -> F:
    """The pool operation without icontract's checks (the function its decorators wrap)."""
    return cast(F, inspect.unwrap(operation))


_get_cached_block = _unchecked(ops.get_cached_block)
_get_new_blocks = _unchecked(ops.get_new_blocks)
_touch = _unchecked(ops.touch)
_free_blocks = _unchecked(ops.free_blocks)
_cache_full_blocks = _unchecked(ops.cache_full_blocks)
_evict_blocks = _unchecked(ops.evict_blocks)
_reset_prefix_cache = _unchecked(ops.reset_prefix_cache)


@dataclass(frozen=True, slots=True)
class Request:
    """What the manager is told about a request: its tokens so far and what else keys its KV."""

    request_id: str  # unique among running requests
    token_ids: tuple[int, ...]  # the prompt, then every output token so far
    lora_name: str | None = None  # the LoRA adapter, if any: part of every block's hash
    cache_salt: str | None = None  # a tenant's salt: part of the first block's hash
    mm_inputs: tuple[MultiModalInput, ...] = ()  # multimodal inputs: part of the blocks they overlap
    # Times the scheduler preempted it: a re-admission's hits are counted apart (spec.stats).
    num_preemptions: int = 0
    # Leading tokens the prefix cache may serve it (vLLM 0.34's): 0 for a request that must not read the
    # cache (its lookup does not run, so its hit statistics are not counted), the first scored prompt row
    # for prompt scoring, None: no bound but the last token.
    prefix_cache_hit_limit: int | None = None


@dataclass(frozen=True, slots=True)
class ManagerConfig:
    """How the manager hashes and sizes blocks, and its KV cache groups; fixed at construction."""

    block_size: int  # tokens per block, in every group
    hash_fn: str = DEFAULT_HASH_FN  # spec.hashing.HASH_FUNCTIONS
    seed: str = DEFAULT_SEED  # NONE_HASH is derived from it
    groups: tuple[KVGroup, ...] = (FULL,)  # the KV cache groups, in vLLM's group order

    def block_hashes(self, request: Request) -> tuple[BlockHash, ...]:
        """The hash chain of the request's full blocks under this hash function and seed."""
        return hash_request_blocks(
            request.token_ids,
            self.block_size,
            request.lora_name,
            request.mm_inputs,
            request.cache_salt,
            self.hash_fn,
            self.seed,
        )


@dataclass(frozen=True, slots=True)
class RequestBlocks:
    """The manager's record of one running request."""

    tables: tuple[tuple[BlockId, ...], ...]  # one block table per group; the null block at skipped positions
    num_cached_blocks: tuple[int, ...]  # per group: leading positions registered in the hash table (or null)
    num_computed_tokens: int  # tokens whose KV is (being) computed


@dataclass(frozen=True, slots=True)
class ManagerState:
    """The spec's KVCacheManager: one pool and the running requests."""

    config: ManagerConfig  # fixed at construction
    pool: PoolState  # the block pool underneath, shared by every group
    requests: tuple[tuple[str, RequestBlocks], ...]  # running requests, sorted by id
    stats: PrefixCacheStats = PrefixCacheStats()  # hit statistics since construction; grown by admissions and resets

    def request(self, request_id: str) -> RequestBlocks | None:
        """The record of a running request, or None."""
        for rid, entry in self.requests:
            if rid == request_id:
                return entry
        return None

    def snapshot(self) -> Snapshot:
        """The pool's snapshot with every running request's block tables (one per group) and the groups."""
        tables = tuple(
            sorted((table_name(rid, g), table) for rid, e in self.requests for g, table in enumerate(e.tables))
        )
        return self.pool.snapshot(block_tables=tables, kv_groups=snapshot_groups(self.config.groups))


def snapshot_groups(groups: tuple[KVGroup, ...]) -> tuple[str, ...]:
    """How a snapshot names the groups: () for the default single full-attention group."""
    return () if groups == (FULL,) else tuple(str(g) for g in groups)


# The last state found to hold every invariant. States are values, never changed
# in place, so the same object holds them still: one operation's postcondition
# and the next one's precondition are one check, not two.
_last_held: list[ManagerState | None] = [None]


def _holds(state: ManagerState) -> bool:
    if state is _last_held[0]:
        return True
    if not all_hold(state.snapshot()):
        return False
    _last_held[0] = state
    return True


def _events_explain(state: ManagerState, step: Step[ManagerState, object]) -> bool:
    """The step's events account for its change to the hash table, key by key (what a router mirrors)."""
    mirror = EventMirror(table_counts(state.pool.hash_to_blocks))
    return event_mirror_exact(mirror, step.events, step.state.pool.snapshot())


def _with_request(state: ManagerState, request_id: str, entry: RequestBlocks | None) -> ManagerState:
    others = tuple((rid, e) for rid, e in state.requests if rid != request_id)
    if entry is not None:
        others = tuple(sorted(others + ((request_id, entry),)))
    return replace(state, requests=others)


def check_request(request: Request, op: str, num_groups: int = 1) -> None:
    """A request is well formed: a non-empty id and prompt, counts that are counts, multimodal inputs over
    its tokens in order; with several KV cache groups, an id that cannot be mistaken for a group's block
    table in snapshots. The one definition: the reference's and gpu_impl's managers run it too.

    Raises:
        InvalidRequest: the first of these that does not hold, named with `op`.
    """
    if not isinstance(request.request_id, str) or not request.request_id:
        raise InvalidRequest(f"{op}: request_id={request.request_id!r} must be a non-empty string")
    if len(request.token_ids) == 0:
        raise InvalidRequest(f"{op}: request_id={request.request_id!r} has no tokens; a request needs a prompt")
    if not is_count(request.num_preemptions):
        raise InvalidRequest(
            f"{op}: request_id={request.request_id!r} has num_preemptions={request.num_preemptions!r}; "
            "it counts the times the scheduler preempted it, a non-negative integer"
        )
    if request.prefix_cache_hit_limit is not None and not is_count(request.prefix_cache_hit_limit):
        raise InvalidRequest(
            f"{op}: request_id={request.request_id!r} has prefix_cache_hit_limit={request.prefix_cache_hit_limit!r}; "
            "it is None or the tokens the prefix cache may serve, a non-negative integer"
        )
    end = 0  # where the previous multimodal input ends
    for mm in request.mm_inputs:
        if not (
            isinstance(mm, MultiModalInput)
            and is_count(mm.offset)
            and is_count(mm.length)
            and mm.length > 0
            and end <= mm.offset
            and mm.offset + mm.length <= len(request.token_ids)
        ):
            raise InvalidRequest(
                f"{op}: request_id={request.request_id!r} has mm_inputs={list(request.mm_inputs)!r}; each must "
                f"cover one or more of its {len(request.token_ids)} token positions, in offset order, without "
                "overlapping another (as vLLM's input processor places them)"
            )
        end = mm.offset + mm.length
    if num_groups > 1 and TABLE_GROUP_MARK in request.request_id:
        raise InvalidRequest(
            f"{op}: request_id={request.request_id!r} contains {TABLE_GROUP_MARK!r}, which names a KV cache "
            "group's block table in snapshots"
        )


def new_manager(
    num_gpu_blocks: int,
    block_size: int,
    enable_caching: bool = True,
    profile: str = "vllm-v1",
    hash_fn: str = DEFAULT_HASH_FN,
    seed: str = DEFAULT_SEED,
    groups: str | Sequence[KVGroup] = (FULL,),
) -> ManagerState:
    """A manager over a fresh pool, with its KV cache groups (`"full,sliding:8"`, or `KVGroup` values).

    Raises:
        InvalidRequest: a size is not a positive integer, the profile or hash function is unknown,
            a group is malformed, or a chunk is not a multiple of the block size.
    """
    config = manager_config(block_size, hash_fn, seed, groups)
    return ManagerState(config, ops.new_pool(num_gpu_blocks, enable_caching, profile), ())


def manager_config(block_size: int, hash_fn: str, seed: str, groups: str | Sequence[KVGroup]) -> ManagerConfig:
    """A manager's layout, checked in the spec's order: the one definition, which the reference's and
    gpu_impl's managers build theirs with too.

    Raises:
        InvalidRequest: the block size is not a positive integer, the hash function is unknown, or a group
            is malformed or a chunk is not a multiple of the block size.
    """
    if not is_int(block_size) or block_size < 1:
        raise InvalidRequest(f"block_size must be a positive integer; got block_size={block_size!r}")
    hash_request_blocks((), block_size, hash_fn=hash_fn, seed=seed)  # validates hash_fn
    return ManagerConfig(block_size, hash_fn, seed, check_groups(groups, block_size))


def check_groups(groups: str | Sequence[KVGroup], block_size: int) -> tuple[KVGroup, ...]:
    """The groups as `KVGroup` values, checked against the block size.

    Raises:
        InvalidRequest: as `new_manager`.
    """
    kv_groups = parse_groups(groups) if isinstance(groups, str) else parse_groups(format_groups(tuple(groups)))
    for g in kv_groups:
        if g.kind == "chunked" and g.size % block_size:
            raise InvalidRequest(
                f"KV cache group {g}: a chunk of {g.size} tokens is not a multiple of block_size={block_size} "
                "(vLLM's chunked local attention asserts it, and its hit search relies on it)"
            )
    return kv_groups


def request_block_hashes(state: ManagerState, request: Request) -> tuple[BlockHash, ...]:
    """The hash chain of the request's full blocks under this manager's hash function and seed."""
    return state.config.block_hashes(request)


def _check_request_id(state: ManagerState, request: Request, op: str) -> None:
    check_request(request, op, len(state.config.groups))


def _computed_ok(
    state: ManagerState, request: Request, result: Step[ManagerState, tuple[tuple[BlockId, ...], int]]
) -> bool:
    blocks, num_tokens = result.result
    check_hit(
        state.snapshot(),
        len(request.token_ids),
        state.config.block_size,
        request_block_hashes(state, request),
        blocks,
        num_tokens,
    )
    return True


@icontract.require(lambda state: _holds(state))
@icontract.ensure(lambda state, request, result: _computed_ok(state, request, result))
@icontract.ensure(
    lambda max_cache_hit_length, result: max_cache_hit_length is None or result.result[1] <= max_cache_hit_length
)
@icontract.ensure(lambda state, result: result.state is state)
def get_computed_blocks(
    state: ManagerState, request: Request, max_cache_hit_length: int | None = None
) -> Step[ManagerState, tuple[tuple[BlockId, ...], int]]:
    """The longest cached prefix of a new request that every group can serve, its last token left to compute.

    Reads only; the hit blocks are touched by `allocate_slots`. The scheduler
    may cap the hit (`max_cache_hit_length`: what an external connector lets
    the local cache serve, 0 included), and so may the request (its
    `prefix_cache_hit_limit`); neither reaches the last token. A request whose
    limit is 0 is not looked up at all (`lookup_enabled`), as with caching off.

    Returns:
        The state, unchanged, and as the result the hit blocks, group by group
        (each group's as many positions, the null block where its attention type
        skips them), and the tokens they cover.

    Raises:
        InvalidRequest: the request has no tokens, misplaced mm_inputs, a bad
            num_preemptions, or is already running; the cap is not None or a
            non-negative integer.

    raises: InvalidRequest  # the errors above, as CrossHair reads them
    """
    running = {rid for rid, _ in state.requests}
    limit = check_lookup(request, max_cache_hit_length, len(state.config.groups), running)
    if not lookup_enabled(state, request):
        return Step(state, ((), 0))
    per_group, num_tokens = longest_cache_hit(state, request_block_hashes(state, request), limit)
    return Step(state, (tuple(b for blocks in per_group for b in blocks), num_tokens))


def check_lookup(request: Request, max_cache_hit_length: int | None, num_groups: int, running: Container[str]) -> int:
    """`get_computed_blocks`' checks, in the spec's order, and the most tokens its hit may cover. The one
    definition: the reference's and gpu_impl's managers run it too.

    Args:
        running: the running requests' ids.

    Raises:
        InvalidRequest: as `get_computed_blocks`.
    """
    check_request(request, "get_computed_blocks", num_groups)
    if max_cache_hit_length is not None and not is_count(max_cache_hit_length):
        raise InvalidRequest(
            f"get_computed_blocks: max_cache_hit_length={max_cache_hit_length!r} must be None or a non-negative "
            "integer (tokens the local cache may serve)"
        )
    if request.request_id in running:
        raise InvalidRequest(f"get_computed_blocks: request_id={request.request_id!r} is already running")
    # NOTE: at most len - 1 tokens: the last prompt token must be computed to get
    # the logits that sample the first output token (vLLM's get_max_cache_hit_length).
    bounds = (len(request.token_ids) - 1, request.prefix_cache_hit_limit, max_cache_hit_length)
    return min(b for b in bounds if b is not None)


def lookup_enabled(state: ManagerState, request: Request) -> bool:
    """Whether the request's prefix-cache lookup runs (vLLM's `prefix_cache_lookup_enabled`): caching is on and
    the request may read the cache (a hit limit of 0 says it may not). Only a request looked up is counted in the
    local hit statistics."""
    return state.pool.config.enable_caching and request.prefix_cache_hit_limit != 0


def _cached_ok(state: ManagerState, request: Request, result: Step[ManagerState, int]) -> bool:
    num_tokens = result.result
    if not 0 <= num_tokens < len(request.token_ids) or num_tokens % state.config.block_size:
        return False
    return num_tokens == 0 or lookup_enabled(state, request)


@icontract.require(lambda state: _holds(state))
@icontract.ensure(lambda state, request, result: _cached_ok(state, request, result))
@icontract.ensure(lambda state, result: result.state is state and not result.events)
def get_num_cached_tokens(state: ManagerState, request: Request) -> Step[ManagerState, int]:
    """How many of a request's tokens the prefix cache holds, without touching anything (vLLM 0.34's).

    A probe, for a request that may never be scheduled (a router's or a
    scheduler's estimate): it takes no reference, takes no block and publishes
    no event, so calling it changes nothing, for a running request too. The
    hit is `get_computed_blocks`'s search with only the last token held back:
    NOTE vLLM bounds it by len - 1 alone, not by the request's hit limit
    (a limit of 0 aside, which skips the lookup) nor by a connector's cap, so
    a request limited to N tokens may be told more are cached than it can use.

    Returns:
        The state, unchanged, and the tokens its longest cached prefix covers
        (0 with caching off or a hit limit of 0).

    Raises:
        InvalidRequest: the request has no id or no tokens, misplaced mm_inputs, a bad num_preemptions
            or a bad hit limit.

    raises: InvalidRequest  # the errors above, as CrossHair reads them
    """
    _check_request_id(state, request, "get_num_cached_tokens")
    if not lookup_enabled(state, request):
        return Step(state, 0)
    return Step(state, longest_cache_hit(state, request_block_hashes(state, request), len(request.token_ids) - 1)[1])


def longest_cache_hit(
    state: ManagerState, hashes: tuple[BlockHash, ...], max_length: int
) -> tuple[tuple[tuple[BlockId, ...], ...], int]:
    """The hit every group agrees on: each attention type's search, to a fixed point (vLLM's coordinators).

    One group: its own search. Several: groups of one attention type are
    searched together (a position hits only if every one of them has it),
    full attention first; each search may only shorten the candidate length,
    and the round repeats until no type shortens it (once, for one full type
    and one other: the second search cannot be cut again). Full attention's
    hit is then cut to the agreed length.

    Returns:
        Each group's hit blocks and the hit length in tokens.
    """
    groups, block_size = state.config.groups, state.config.block_size
    kinds: dict[KVGroup, list[int]] = {}
    for gid, g in enumerate(groups):
        kinds.setdefault(g, []).append(gid)
    order = sorted(kinds.items(), key=lambda item: item[0].kind != "full")  # stable: full attention first
    found: dict[int, tuple[BlockId, ...]] = {}
    length = max_length
    while True:
        candidate = length
        for group, ids in order:
            if group.kind == "full" and ids[0] in found:
                candidate = min(candidate, len(found[ids[0]]) * block_size)
                continue
            hits = _type_hit(state.pool, group, ids, hashes, candidate, block_size)
            candidate = len(hits[0]) * block_size
            found.update(zip(ids, hits))
        if candidate >= length or len(groups) == 1:
            length = candidate
            break
        length = candidate
        if len(order) == 2 and order[0][0].kind == "full":
            break
    num_blocks = length // block_size
    return tuple(found[gid][:num_blocks] for gid in range(len(groups))), length


def hit_lengths_alone(state: ManagerState, hashes: tuple[BlockHash, ...], max_length: int) -> tuple[int, ...]:
    """Each group's hit length searched alone, as if no other group had to agree (vLLM's
    `find_longest_cache_hit_per_group`): where one exceeds the agreed length, the coordinator cut it."""
    groups, block_size = state.config.groups, state.config.block_size
    return tuple(len(_type_hit(state.pool, g, [gid], hashes, max_length, block_size)[0]) * block_size
                 for gid, g in enumerate(groups))  # fmt: skip


def _type_hit(
    pool: PoolState, group: KVGroup, ids: list[int], hashes: tuple[BlockHash, ...], max_length: int, block_size: int
) -> list[tuple[BlockId, ...]]:
    """One attention type's hit within `max_length` tokens, for each of its groups (vLLM's `find_longest_cache_hit`).

    - full: the longest run of cached blocks from the first, left to right;
    - sliding:W: the rightmost run of `window_hit_blocks(W, B)` cached blocks,
      scanned right to left, the null block before it (a hit needs only the
      window before the next token); a shorter run that reaches the first block
      is a hit too;
    - chunked:C: the null block for every block before the chunk that holds
      position max_length, then the run of cached blocks from there.
    """

    def cached(i: int) -> list[BlockId] | None:
        blocks = [_get_cached_block(pool, group_key(hashes[i], gid)).result for gid in ids]
        return None if any(b is None for b in blocks) else [BlockId(b) for b in blocks if b is not None]

    max_blocks = min(max_length // block_size, len(hashes))
    if group.kind == "sliding":
        need = window_hit_blocks(group.size, block_size)
        seen: dict[int, list[BlockId]] = {}
        run_start, run_len = 0, 0
        for i in range(max_blocks - 1, -1, -1):
            blocks = cached(i)
            if blocks is None:
                run_len = 0
                continue
            seen[i], run_start, run_len = blocks, i, run_len + 1
            if run_len >= need:
                break
        else:  # no whole window cached: the run that reaches the first block (if any) is the hit
            run_start = 0
        run = range(run_start, run_start + run_len)
        return [(NULL_BLOCK_ID,) * run_start + tuple(seen[j][k] for j in run) for k in range(len(ids))]
    start = max_length // group.size * group.size // block_size if group.kind == "chunked" and max_length > 0 else 0
    hits: list[list[BlockId]] = []
    for i in range(start, max_blocks):
        blocks = cached(i)
        if blocks is None:
            break
        hits.append(blocks)
    return [(NULL_BLOCK_ID,) * start + tuple(h[k] for h in hits) for k in range(len(ids))]


def _alloc_ok(state: ManagerState, request: Request, result: Step[ManagerState, tuple[BlockId, ...] | None]) -> bool:
    new_state, new_blocks = result.state, result.result
    if not _holds(new_state):
        return False
    if new_blocks is not None:
        return True
    # Refused: nothing touched or taken; only skipped blocks of a running request may have been freed.
    before, after = state.request(request.request_id), new_state.request(request.request_id)
    if before is None or after is None:
        return new_state == state
    return replace(after, tables=before.tables) == before and all(
        a in (b, NULL_BLOCK_ID) for ta, tb in zip(after.tables, before.tables) for a, b in zip(ta, tb)
    )


@icontract.require(lambda state: _holds(state))
@icontract.ensure(lambda state, request, result: _alloc_ok(state, request, result))
@icontract.ensure(lambda state, result: _events_explain(state, result))
@icontract.ensure(lambda state, result: result.result is not None or result.state.stats == state.stats)
def allocate_slots(
    state: ManagerState,
    request: Request,
    num_new_tokens: int,
    num_new_computed_tokens: int = 0,
    new_computed_blocks: Sequence[BlockId] = (),
    num_external_computed_tokens: int = 0,
    delay_cache_blocks: bool = False,
) -> Step[ManagerState, tuple[BlockId, ...] | None]:
    """Give a request slots for its next `num_new_tokens` tokens, and register the blocks they fill.

    On a request's first call, `new_computed_blocks` is its prefix hit (from
    `get_computed_blocks`, group by group) and `num_external_computed_tokens`
    what an external KV cache loads after it; both count as computed. An
    asynchronous load (`delay_cache_blocks`, vLLM's scheduler for a connector
    that loads in the background; `num_new_tokens` may then be 0) takes its
    blocks but registers nothing: the loaded blocks are not hit before the
    load is done, when `cache_blocks` registers them (seed 000, section 5).

    Seven phases, one function each, every one after validation a loop over
    the groups: validate, free skipped blocks, plan, touch the hits, take
    blocks for external tokens, take blocks for new tokens, register full
    blocks. Each phase runs for every group before the next starts, as vLLM's
    coordinator does: taking blocks for one group cannot evict another
    group's hit.

    A request's first step that is served is its admission: the hit
    statistics count it then (spec.stats), local hit and external tokens apart.

    Returns:
        The new state and the newly taken blocks, group by group in table
        order, or None when too few blocks are free: nothing is touched and
        nothing taken (skipped blocks are freed all the same; the module doc).
        Its events: a `BlockRemoved` per cached key a taken block loses, then
        one `BlockStored` per group that registers blocks (spec.events).

    Raises:
        InvalidRequest: a count is negative or not an integer, num_new_tokens is 0 (without a
            delayed load), a delayed registration without an external load, the tokens exceed
            the request's, the hit does not match its block count, or the request's mm_inputs
            are misplaced (outside its tokens, out of order, overlapping).
        InvalidBlock: a hit block is not registered under the request's chain in its group
            (or is the null block at a position its group still reads).

    raises: InvalidRequest, InvalidBlock  # the errors above, as CrossHair reads them
    """
    step = _validate_allocation(
        state, request, num_new_tokens, num_new_computed_tokens, new_computed_blocks, num_external_computed_tokens,
        delay_cache_blocks,
    )  # fmt: skip
    state, tables = _free_skipped_blocks(state, step)
    if not _fits(state.pool, step, tables, state.config):
        return Step(state, None)
    new_state, new_blocks, events = _serve_allocation(state, step, tables)
    return Step(new_state, new_blocks, events)


@dataclass(frozen=True, slots=True)
class _AllocationStep:
    """A validated `allocate_slots` call, as the spec's phases after validation read it: `AllocationStep`
    with the request's record before the step, and its hits as tuples (a state holds only values)."""

    request: Request  # the request being scheduled
    running: bool  # whether it ran before this step (else this is its first step)
    entry: RequestBlocks  # its record before the step (empty tables on its first step)
    hits: tuple[tuple[BlockId, ...], ...]  # per group, its prefix hit (first step only), null where skipped
    num_computed: int  # tokens computed before the new ones: earlier steps, or the hit and external tokens
    num_local_computed: int  # of those, the ones computed here (earlier steps or the hit), not loaded
    hashes: tuple[BlockHash, ...]  # the hash chain of its full blocks
    num_tokens: int  # tokens computed once the step has run: hit, external and new included
    delay_cache_blocks: bool = False  # an asynchronous external load: register nothing yet


def _validate_allocation(
    state: ManagerState,
    request: Request,
    num_new_tokens: int,
    num_new_computed_tokens: int,
    new_computed_blocks: Sequence[BlockId],
    num_external_computed_tokens: int,
    delay_cache_blocks: bool = False,
) -> _AllocationStep:
    """Phase 1: `check_allocation` over this state (the one definition of the checks), and the request's
    record before the step.

    Raises:
        InvalidRequest, InvalidBlock: as `allocate_slots`.
    """
    cfg, pool = state.config, state.pool
    caching = pool.config.enable_caching
    view = ManagerView(cfg, pool.num_gpu_blocks, caching, pool.block_hash.__getitem__, cfg.block_hashes)
    step = check_allocation(
        view, {rid: entry.num_computed_tokens for rid, entry in state.requests},
        request, num_new_tokens, num_new_computed_tokens, new_computed_blocks, num_external_computed_tokens,
        delay_cache_blocks,
    )  # fmt: skip
    entry = state.request(request.request_id)
    if entry is None:
        entry = RequestBlocks(tuple(() for _ in cfg.groups), tuple(0 for _ in cfg.groups), 0)
    return _AllocationStep(
        request=request,
        running=step.running,
        entry=entry,
        hits=tuple(tuple(hits) for hits in step.hits),
        num_computed=step.num_computed,
        num_local_computed=step.num_local_computed,
        hashes=step.hashes,
        num_tokens=step.num_tokens,
        delay_cache_blocks=delay_cache_blocks,
    )


@dataclass(frozen=True, slots=True)
class ManagerView:
    """What `check_allocation` reads of a manager, its running requests aside; fixed at construction."""

    config: ManagerConfig  # its layout: block size and KV cache groups
    num_gpu_blocks: int  # its pool's size
    enable_caching: bool  # whether its pool caches
    block_hash: Callable[[int], BlockHash | None]  # the hash a block is registered under (None: none)
    request_hashes: Callable[[Request], tuple[BlockHash, ...]]  # the request's chain (config.block_hashes)


@dataclass(frozen=True, slots=True)
class AllocationStep:
    """An `allocate_slots` call that phase 1 accepted, as the phases after it read it."""

    request: Request  # the request being scheduled
    running: bool  # whether it ran before this step (else this is its first step)
    hits: tuple[Sequence[BlockId], ...]  # per group, its prefix hit (first step only), null where skipped
    hashes: tuple[BlockHash, ...]  # the hash chain of its full blocks
    num_computed: int  # tokens computed before the new ones: earlier steps, or the hit and external tokens
    num_local_computed: int  # of those, the ones computed here (earlier steps or the hit), not loaded
    num_tokens: int  # tokens computed once the step has run: hit, external and new included
    delay_cache_blocks: bool  # an asynchronous external load: register nothing yet

    @property
    def num_external(self) -> int:
        """The tokens an external KV cache loads in this step (its first; 0 on a running request's)."""
        return self.num_computed - self.num_local_computed


def check_allocation(
    manager: ManagerView,
    computed_tokens: Mapping[str, int],
    request: Request,
    num_new_tokens: int,
    num_new_computed_tokens: int,
    new_computed_blocks: Sequence[BlockId],
    num_external_computed_tokens: int,
    delay_cache_blocks: bool,
) -> AllocationStep:
    """Phase 1 of `allocate_slots`: refuse a caller's mistake before anything changes, in one fixed order.

    The order is part of the contract: every implementation names the same mistake first, and a refused
    call leaves the state as it was. The one definition: the reference's and gpu_impl's managers run it too.

    Args:
        computed_tokens: each running request's computed tokens, by request id.

    Raises:
        InvalidRequest, InvalidBlock: as `allocate_slots`.

    Cost: O(tokens) to hash the request, O(1) per hit block.
    """
    check_request(request, "allocate_slots", len(manager.config.groups))
    check_step_counts(num_new_tokens, num_new_computed_tokens, num_external_computed_tokens, delay_cache_blocks)
    rid = request.request_id
    running = rid in computed_tokens
    if running and (new_computed_blocks or num_new_computed_tokens or num_external_computed_tokens):
        raise InvalidRequest(f"allocate_slots: request_id={rid!r} is running; prefix hits are only for its first step")
    num_local = computed_tokens.get(rid, 0) + num_new_computed_tokens
    num_computed = num_local + num_external_computed_tokens
    hashes, hits = _check_hit_blocks(manager, request, num_new_computed_tokens, new_computed_blocks, num_computed)
    total = num_computed + num_new_tokens
    if total > len(request.token_ids):
        raise InvalidRequest(
            f"allocate_slots: {total} tokens would be computed but request_id={rid!r} has {len(request.token_ids)}"
        )
    return AllocationStep(request, running, hits, hashes, num_computed, num_local, total, delay_cache_blocks)


def check_step_counts(
    num_new_tokens: int, num_new_computed_tokens: int, num_external_computed_tokens: int, delay_cache_blocks: bool
) -> None:
    """Every count is a non-negative integer, and the step schedules at least one token (an asynchronous
    load aside: it schedules none until the load is done); only a step that loads tokens delays their registration.
    The one definition, as `check_request`.

    Raises:
        InvalidRequest: the first of these that does not hold.
    """
    for name, value in (
        ("num_new_tokens", num_new_tokens),
        ("num_new_computed_tokens", num_new_computed_tokens),
        ("num_external_computed_tokens", num_external_computed_tokens),
    ):
        if not is_count(value):
            raise InvalidRequest(f"allocate_slots: {name} must be a non-negative integer; got {name}={value!r}")
    if not isinstance(delay_cache_blocks, bool):
        raise InvalidRequest(f"allocate_slots: delay_cache_blocks must be a bool; got {delay_cache_blocks!r}")
    if delay_cache_blocks and num_external_computed_tokens == 0:
        raise InvalidRequest(
            "allocate_slots: delay_cache_blocks=True but num_external_computed_tokens=0; only a step that loads "
            "external tokens asynchronously delays their registration"
        )
    if num_new_tokens == 0 and not delay_cache_blocks:
        raise InvalidRequest("allocate_slots: num_new_tokens=0; a step must schedule at least one token")


def _check_hit_blocks(
    manager: ManagerView,
    request: Request,
    num_new_computed_tokens: int,
    new_computed_blocks: Sequence[BlockId],
    num_computed: int,
) -> tuple[tuple[BlockHash, ...], tuple[Sequence[BlockId], ...]]:
    """The hit covers its tokens in whole blocks in every group, each registered under the request's chain.

    A group that no longer reads a position (a sliding window's, once
    `num_computed` tokens are computed) may have the null block there.

    Returns:
        The request's hash chain (the registration phase needs it too) and the hit split by group.
    """
    config, num_groups, block_size = manager.config, len(manager.config.groups), manager.config.block_size
    n = num_new_computed_tokens // block_size
    if n * block_size != num_new_computed_tokens or len(new_computed_blocks) != n * num_groups:
        per_group = f" for {num_groups} KV cache groups" if num_groups > 1 else ""
        raise InvalidRequest(
            f"allocate_slots: num_new_computed_tokens={num_new_computed_tokens} but "
            f"{len(new_computed_blocks)} hit blocks of block_size={block_size}{per_group}"
        )
    if new_computed_blocks and not manager.enable_caching:
        raise InvalidRequest("allocate_slots: prefix caching is off, so there can be no hit blocks")
    hashes = manager.request_hashes(request)
    if n > len(hashes):
        raise InvalidRequest(
            f"allocate_slots: {n} hit blocks but request_id={request.request_id!r} has only {len(hashes)} full blocks"
        )
    blocks = list(new_computed_blocks)  # any sequence: one that cannot be sliced (a deque) included
    hits = tuple(blocks[g * n : (g + 1) * n] for g in range(num_groups))
    for g, group in enumerate(config.groups):
        skipped = num_skipped_blocks(group, num_computed, block_size) if hits[g] else 0
        for i, b in enumerate(hits[g]):
            in_range = is_int(b) and 0 <= b < manager.num_gpu_blocks
            if in_range and b == NULL_BLOCK_ID and i < skipped:
                continue
            if not in_range or manager.block_hash(b) != group_key(hashes[i], g):
                where = f" of KV cache group {g}" if num_groups > 1 else ""
                raise InvalidBlock(
                    f"allocate_slots: hit block_id={b!r} is not registered under the request's hash {i}{where}"
                )
    return hashes, hits


def _free_skipped_blocks(
    state: ManagerState, step: _AllocationStep
) -> tuple[ManagerState, tuple[tuple[BlockId, ...], ...]]:
    """Phase 2: a running request frees, in every group, the blocks it no longer reads (`remove_skipped_blocks`).

    Counted from the tokens computed before this step (the window of its
    first new token); each such block is replaced by the null block, and the
    group's freed blocks go to `free_blocks` in one call, last first, as a
    finished request's are: its later blocks are evicted before its earlier
    ones. The walk stops at a null block: everything before it went earlier.
    The request's record keeps the nulled tables even if the step is then
    refused: the freed blocks are gone either way.

    Returns:
        The state (a running request's record with its new tables) and the request's tables,
        skipped positions nulled.
    """
    tables = step.entry.tables
    if not step.running:
        return state, tables
    pool, cfg = state.pool, state.config
    new_tables = []
    for group, table in zip(cfg.groups, tables):
        skipped = min(num_skipped_blocks(group, step.entry.num_computed_tokens, cfg.block_size), len(table))
        freed: list[BlockId] = []
        for i in range(skipped - 1, -1, -1):
            if table[i] == NULL_BLOCK_ID:
                break
            freed.append(table[i])
        if freed:
            pool = _free_blocks(pool, tuple(freed)).state
        new_tables.append((NULL_BLOCK_ID,) * skipped + table[skipped:] if freed else table)
    tables = tuple(new_tables)
    entry = replace(step.entry, tables=tables)
    return _with_request(replace(state, pool=pool), step.request.request_id, entry), tables


def _fits(pool: PoolState, step: _AllocationStep, tables: tuple[tuple[BlockId, ...], ...], cfg: ManagerConfig) -> bool:
    """Phase 3: whether every group's blocks fit in the free blocks (vLLM's `get_num_blocks_to_allocate`).

    Planned before anything is taken or touched, so a step that cannot be
    served is refused whole (the scheduler then waits or preempts) rather than
    failing halfway with its hits touched. A group needs a block for every
    position up to its last token, except those it already has (or, on a
    first step, skips or hits); hit blocks sitting in the free queue leave it
    when touched, so they count against the free blocks like new ones.
    """
    needed = 0
    num_required = -(-step.num_tokens // cfg.block_size)
    for g, group in enumerate(cfg.groups):
        if step.running:
            needed += max(num_required - len(tables[g]), 0)
            continue
        skipped = num_skipped_blocks(group, step.num_computed, cfg.block_size)
        needed += max(num_required - max(skipped, len(step.hits[g])), 0)
        needed += sum(1 for b in step.hits[g][skipped:] if pool.ref_cnt[b] == 0)
    return needed <= len(pool.free_queue)


def _touch_hits(
    pool: PoolState, step: _AllocationStep, tables: tuple[tuple[BlockId, ...], ...], cfg: ManagerConfig
) -> tuple[PoolState, tuple[tuple[BlockId, ...], ...], tuple[int, ...]]:
    """Phase 4: the request takes a reference on each hit block it still reads, so none is evicted while it runs.

    A first step only. A hit block nobody held leaves the free queue here (the
    plan counted it). Every group's hits are touched before any block is
    taken, so taking blocks for one group cannot evict another's hit. The
    positions the request skips from the start become the null block.

    Returns:
        The pool, the tables, and how many leading positions of each are registered (or null).
    """
    if step.running:
        return pool, tables, step.entry.num_cached_blocks
    new_tables = []
    for group, hits in zip(cfg.groups, step.hits):
        skipped = num_skipped_blocks(group, step.num_computed, cfg.block_size)
        kept = hits[skipped:]
        if kept:
            pool = _touch(pool, kept).state
        new_tables.append((NULL_BLOCK_ID,) * skipped + kept)
    return pool, tuple(new_tables), tuple(len(t) for t in new_tables)


def _take_external_blocks(
    pool: PoolState, step: _AllocationStep, tables: tuple[tuple[BlockId, ...], ...], cfg: ManagerConfig
) -> tuple[PoolState, tuple[tuple[BlockId, ...], ...], tuple[KVCacheEvent, ...]]:
    """Phase 5: blocks for the tokens an external KV cache loads, in every group that still reads some of them.

    A first step only, after every group's hits are touched. A group that
    skips every computed token (a chunk boundary) takes none for them.

    Returns:
        The pool, the tables, and the events of the blocks taken (a cached block taken is evicted).
    """
    num_external = step.num_computed - step.num_local_computed
    if step.running or num_external == 0:
        return pool, tables, ()
    new_tables = []
    events: tuple[KVCacheEvent, ...] = ()
    for group, table in zip(cfg.groups, tables):
        skipped_tokens = num_skipped_blocks(group, step.num_computed, 1)
        read = min(step.num_computed - skipped_tokens, num_external) if skipped_tokens else num_external
        count = max(0, -(-step.num_computed // cfg.block_size) - len(table)) if read > 0 else 0
        taken = _get_new_blocks(pool, count)
        pool, events = taken.state, events + taken.events
        new_tables.append(table + taken.result)
    return pool, tuple(new_tables), events


def _take_new_blocks(
    pool: PoolState, step: _AllocationStep, tables: tuple[tuple[BlockId, ...], ...], cfg: ManagerConfig
) -> tuple[PoolState, tuple[tuple[BlockId, ...], ...], tuple[KVCacheEvent, ...]]:
    """Phase 6: take the blocks the step's tokens need and append them, group by group.

    The table only grows while the request runs (vLLM's block tables are
    append-only, the null block standing in for a freed position), so tokens
    already scheduled keep their slots.

    Returns:
        The pool, the tables, and the events of the blocks taken (a cached block taken is evicted).
    """
    num_required = -(-step.num_tokens // cfg.block_size)
    new_tables = []
    events: tuple[KVCacheEvent, ...] = ()
    for table in tables:
        if len(table) < num_required:
            taken = _get_new_blocks(pool, num_required - len(table))
            pool, table, events = taken.state, table + taken.result, events + taken.events
        new_tables.append(table)
    return pool, tuple(new_tables), events


def _register_full_blocks(
    pool: PoolState,
    step: _AllocationStep,
    tables: tuple[tuple[BlockId, ...], ...],
    num_cached: tuple[int, ...],
    cfg: ManagerConfig,
) -> tuple[PoolState, tuple[int, ...], tuple[KVCacheEvent, ...]]:
    """Phase 7: register (cache_full_blocks) every block the step fills, so later requests can hit it.

    Only full blocks: a partial block's tokens are still to come. Group g's
    blocks are keyed by (hash, g) (`group_key`), so groups never share a
    block; a null position is left unregistered (nothing is stored there).
    The hit blocks are registered already (that is why they hit), so each
    count starts after them. Registered when scheduled, not after the step
    ran (the module's design note).

    Each group that registers publishes one `BlockStored` (vLLM's
    `cache_full_blocks` does, even for a group whose new positions are all
    null): its keys, the key of the position before as parent (None from the
    first block), the tokens of every new position, and the request's keys.

    Returns:
        The pool, per group how many leading positions are now registered (or null), and the events.
    """
    if not pool.config.enable_caching:
        return pool, num_cached, ()
    num_full = min(step.num_tokens, len(step.request.token_ids)) // cfg.block_size
    counts = []
    events: list[KVCacheEvent] = []
    for g, (table, cached) in enumerate(zip(tables, num_cached)):
        if num_full <= cached:
            counts.append(cached)
            continue
        positions = [i for i in range(cached, num_full) if table[i] != NULL_BLOCK_ID]
        keys = tuple(group_key(step.hashes[i], g) for i in positions)
        if positions:
            pool = _cache_full_blocks(pool, tuple(table[i] for i in positions), keys).state
        events.append(_stored(step, cfg, g, cached, num_full, positions, keys))
        counts.append(num_full)
    return pool, tuple(counts), tuple(events)


def _stored(
    step: _AllocationStep,
    cfg: ManagerConfig,
    group_id: int,
    num_cached: int,
    num_full: int,
    positions: Sequence[int],
    keys: tuple[BlockHash, ...],
) -> BlockStored:
    """The `BlockStored` of one group's registration of positions [num_cached, num_full) (the non-null `positions`)."""
    request, block_size = step.request, cfg.block_size
    parent = group_key(step.hashes[num_cached - 1], group_id) if num_cached else None
    return BlockStored(
        block_hashes=keys,
        parent_block_hash=parent,
        token_ids=request.token_ids[num_cached * block_size : num_full * block_size],
        block_size=block_size,
        lora_name=request.lora_name,
        extra_keys=event_extra_keys(positions, block_size, request.lora_name, request.mm_inputs, request.cache_salt),
        group_idx=group_id,
    )


def _serve_allocation(
    state: ManagerState, step: _AllocationStep, tables: tuple[tuple[BlockId, ...], ...]
) -> tuple[ManagerState, tuple[BlockId, ...], tuple[KVCacheEvent, ...]]:
    """Phases 4 to 7 of a step that fits, then its record: touch the hits, take blocks, register the full ones.

    Returns:
        The new state (the request's record, and the statistics on a first step), the newly
        taken blocks, and the events of every phase in order.
    """
    cfg = state.config
    pool, tables, num_cached = _touch_hits(state.pool, step, tables, cfg)
    pool, tables, removed_external = _take_external_blocks(pool, step, tables, cfg)
    pool, tables, removed = _take_new_blocks(pool, step, tables, cfg)
    stored: tuple[KVCacheEvent, ...] = ()
    if not step.delay_cache_blocks:  # an asynchronous load's blocks are registered once it is done
        pool, num_cached, stored = _register_full_blocks(pool, step, tables, num_cached, cfg)
    new_entry = RequestBlocks(tables, num_cached, step.num_tokens)
    stats = _admitted(state, step)
    new_state = _with_request(replace(state, pool=pool, stats=stats), step.request.request_id, new_entry)
    return new_state, _new_blocks(step, tables, cfg), removed_external + removed + stored


def _new_blocks(
    step: _AllocationStep, tables: tuple[tuple[BlockId, ...], ...], cfg: ManagerConfig
) -> tuple[BlockId, ...]:
    """The blocks a served step took, group by group in table order: each table past its old blocks and hit.

    Null positions are left out: they were never taken.
    """
    before = step.entry.tables if step.running else tuple(() for _ in cfg.groups)
    return tuple(
        b for g, table in enumerate(tables) for b in table[len(before[g]) + len(step.hits[g]) :] if b != NULL_BLOCK_ID
    )


def _admitted(state: ManagerState, step: _AllocationStep) -> PrefixCacheStats:
    """The statistics after a served step: a first step is the request's admission, counted now.

    Counted when served, not at the lookup: a step refused for want of
    blocks is retried, and not counted again. The local counters count only
    a request whose lookup ran (`lookup_enabled`), as vLLM's scheduler does.
    """
    stats = state.stats
    if step.running:
        return stats
    request = step.request
    num_external = step.num_computed - step.num_local_computed
    preempted = request.num_preemptions > 0
    looked_up = lookup_enabled(state, request)
    return stats.admitted(len(request.token_ids), step.num_local_computed, num_external, preempted, looked_up)


@icontract.require(lambda state: _holds(state))
@icontract.ensure(lambda result: _holds(result.state))
@icontract.ensure(lambda request_id, result: result.state.request(request_id) is None)
@icontract.ensure(lambda state, result: _events_explain(state, result) and result.state.stats == state.stats)
def free(state: ManagerState, request_id: str) -> Step[ManagerState, None]:
    """Release a finished or preempted request: each group's blocks are freed tail first, group by group.

    Tail first, because a request's last blocks are the least likely to be
    shared (the longer a prefix, the more specific): freed in reverse, they sit
    further left and are evicted before the common leading blocks. A block that
    another request still holds only loses one reference. One `free_blocks`
    call per group in group order, as vLLM's coordinator frees its managers;
    null positions hold nothing and are passed over.

    Raises:
        InvalidRequest: request_id is not running.

    raises: InvalidRequest  # the errors above, as CrossHair reads them
    """
    entry = state.request(request_id)
    if entry is None:
        raise InvalidRequest(f"free: request_id={request_id!r} is not running (freed twice?)")
    pool = state.pool
    for table in entry.tables:
        held = tuple(b for b in reversed(table) if b != NULL_BLOCK_ID)
        if held:
            pool = _free_blocks(pool, held).state
    return Step(_with_request(replace(state, pool=pool), request_id, None), None)


@icontract.require(lambda state: _holds(state))
@icontract.ensure(lambda result: _holds(result.state))
@icontract.ensure(lambda state, result: result.state.requests == state.requests and result.state.stats == state.stats)
@icontract.ensure(lambda state, result: _events_explain(state, result))
def evict_blocks(state: ManagerState, block_ids: Sequence[BlockId]) -> Step[ManagerState, None]:
    """Drop the cached hash of each block, held or free (vLLM's `KVCacheManager.evict_blocks`).

    The external connector reports the blocks whose load failed: their
    content is not what their hash says, so no request may hit them again,
    but whoever holds them keeps them. A cached chain can then have a hole,
    and every hit search stops at it (a prefix hit is contiguous). A block
    without a hash is left alone; each key dropped publishes a `BlockRemoved`.

    Raises:
        InvalidBlock: an id is out of range or the null block.
        InvalidRequest: an id is named twice.

    raises: InvalidBlock, InvalidRequest  # the errors above, as CrossHair reads them
    """
    step = _evict_blocks(state.pool, block_ids)
    return Step(replace(state, pool=step.state), None, step.events)


@icontract.require(lambda state: _holds(state))
@icontract.ensure(lambda result: _holds(result.state))
@icontract.ensure(lambda state, result: result.result == (len(state.requests) == 0 or _holds_nothing(state)))
@icontract.ensure(lambda state, result: result.result or result.state == state)
@icontract.ensure(lambda state, result: _events_explain(state, result))
def reset_prefix_cache(state: ManagerState) -> Step[ManagerState, bool]:
    """Forget every cached hash when no block is held, and record the reset (vLLM's `KVCacheManager`).

    Refused (False, nothing changes, nothing recorded) while any block is held,
    as the pool's reset is (spec.ops.reset_prefix_cache).

    Returns:
        The new state, and whether the reset happened.
    """
    step = _reset_prefix_cache(state.pool)
    if not step.result:
        return Step(state, False)
    stats = replace(state.stats, num_resets=state.stats.num_resets + 1)
    return Step(replace(state, pool=step.state, stats=stats), True, step.events)


def _holds_nothing(state: ManagerState) -> bool:
    """Whether no running request holds a block (every table position is the null block)."""
    return all(b == NULL_BLOCK_ID for _, entry in state.requests for table in entry.tables for b in table)


def check_cache_count(request_id: str, num_computed_tokens: int, computed: int, registered: int) -> None:
    """`cache_blocks`' count is an integer from the running request's registered tokens to its computed ones.

    A count below what is registered would take back hits other requests may already have had; one above
    what was computed would register KV never written. The one definition: the reference's and gpu_impl's
    managers run it too.

    Raises:
        InvalidRequest: it is not.
    """
    if not is_count(num_computed_tokens) or not registered <= num_computed_tokens <= computed:
        raise InvalidRequest(
            f"cache_blocks: num_computed_tokens={num_computed_tokens!r} but request_id={request_id!r} has "
            f"{computed} computed tokens, {registered} of them registered"
        )


@icontract.require(lambda state: _holds(state))
@icontract.ensure(lambda result: _holds(result.state))
@icontract.ensure(lambda state, result: _events_explain(state, result))
@icontract.ensure(
    lambda state, result: result.state.stats == state.stats and result.state.pool.free_queue == state.pool.free_queue
)
def cache_blocks(state: ManagerState, request: Request, num_computed_tokens: int) -> Step[ManagerState, None]:
    """Register a running request's blocks full up to `num_computed_tokens` (vLLM's `KVCacheManager.cache_blocks`).

    The scheduler calls it when an asynchronous external load is done: the
    blocks it filled become hittable only now. A load that failed partway
    gives fewer tokens than were computed: those after it are computed
    again, so the request's computed count goes back to `num_computed_tokens`
    (never below what it has registered already).

    Raises:
        InvalidRequest: the request is not running, or the count is not between its
            registered and its computed tokens.

    raises: InvalidRequest  # the errors above, as CrossHair reads them
    """
    _check_request_id(state, request, "cache_blocks")
    entry = state.request(request.request_id)
    if entry is None:
        raise InvalidRequest(f"cache_blocks: request_id={request.request_id!r} is not running")
    cfg = state.config
    registered = max(entry.num_cached_blocks, default=0) * cfg.block_size
    check_cache_count(request.request_id, num_computed_tokens, entry.num_computed_tokens, registered)
    hashes = request_block_hashes(state, request)
    n = num_computed_tokens
    # The registration phase reads these.
    step = _AllocationStep(
        request=request,
        running=True,
        entry=entry,
        hits=(),
        num_computed=n,
        num_local_computed=n,
        hashes=hashes,
        num_tokens=n,
    )
    pool, num_cached, stored = _register_full_blocks(state.pool, step, entry.tables, entry.num_cached_blocks, cfg)
    new_entry = RequestBlocks(entry.tables, num_cached, num_computed_tokens)
    return Step(_with_request(replace(state, pool=pool), request.request_id, new_entry), None, stored)
