"""The request level: vLLM's KVCacheManager over one BlockPool, as pure functions.

A request's blocks form its block table, append-only while it runs. The
manager finds a new request's prefix hit (`get_computed_blocks`), gives it
slots for the tokens of a step (`allocate_slots`, which touches the hit blocks,
takes new ones, and registers every block that the step fills), and frees it
when it finishes or is preempted (`free`, tail first).

Design choice: blocks are registered when the step that fills them is
scheduled (as vLLM does), not after it ran; the alternative (register after
the forward pass) would need a second call per step and would let two
requests scheduled in one step both miss on the same prefix more often. A
failed allocation (not enough free blocks) returns None and changes nothing:
no block touched, none taken.

Full attention with one KV-cache group only; the null block never appears in
a block table here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import icontract

from kvspec.spec import ops
from kvspec.spec.errors import InvalidBlock, InvalidRequest
from kvspec.spec.hashing import DEFAULT_HASH_FN, DEFAULT_SEED, MultiModalInput, hash_request_blocks
from kvspec.spec.invariants import all_hold, check_hit
from kvspec.spec.state import BlockHash, BlockId, PoolState, Snapshot
from kvspec.spec.step import Step

__all__ = [
    "ManagerConfig",
    "ManagerState",
    "Request",
    "RequestBlocks",
    "allocate_slots",
    "free",
    "get_computed_blocks",
    "new_manager",
    "request_block_hashes",
]


@dataclass(frozen=True, slots=True)
class Request:
    """What the manager is told about a request: its tokens so far and what else keys its KV."""

    request_id: str  # unique among running requests
    token_ids: tuple[int, ...]  # the prompt, then every output token so far
    lora_name: str | None = None  # the LoRA adapter, if any: part of every block's hash
    cache_salt: str | None = None  # a tenant's salt: part of the first block's hash
    mm_inputs: tuple[MultiModalInput, ...] = ()  # multimodal inputs: part of the blocks they overlap


@dataclass(frozen=True, slots=True)
class ManagerConfig:
    """How the manager hashes and sizes blocks; fixed at construction."""

    block_size: int  # tokens per block
    hash_fn: str = DEFAULT_HASH_FN  # spec.hashing.HASH_FUNCTIONS
    seed: str = DEFAULT_SEED  # NONE_HASH is derived from it


@dataclass(frozen=True, slots=True)
class RequestBlocks:
    """The manager's record of one running request."""

    block_ids: tuple[BlockId, ...]  # its block table, append-only
    num_cached_blocks: int  # how many leading blocks are registered in the hash table
    num_computed_tokens: int  # tokens whose KV is (being) computed


@dataclass(frozen=True, slots=True)
class ManagerState:
    """The spec's KVCacheManager: one pool and the running requests."""

    config: ManagerConfig  # fixed at construction
    pool: PoolState  # the block pool underneath
    requests: tuple[tuple[str, RequestBlocks], ...]  # running requests, sorted by id

    def request(self, request_id: str) -> RequestBlocks | None:
        """The record of a running request, or None."""
        for rid, entry in self.requests:
            if rid == request_id:
                return entry
        return None

    def snapshot(self) -> Snapshot:
        """The pool's snapshot with every running request's block table."""
        return self.pool.snapshot(block_tables=tuple((rid, e.block_ids) for rid, e in self.requests))


def _holds(state: ManagerState) -> bool:
    return all_hold(state.snapshot())


def _with_request(state: ManagerState, request_id: str, entry: RequestBlocks | None) -> ManagerState:
    others = tuple((rid, e) for rid, e in state.requests if rid != request_id)
    if entry is not None:
        others = tuple(sorted(others + ((request_id, entry),)))
    return replace(state, requests=others)


def _check_request(request: Request, op: str) -> None:
    if not isinstance(request.request_id, str) or not request.request_id:
        raise InvalidRequest(f"{op}: request_id={request.request_id!r} must be a non-empty string")
    if len(request.token_ids) == 0:
        raise InvalidRequest(f"{op}: request_id={request.request_id!r} has no tokens; a request needs a prompt")
    end = 0  # where the previous multimodal input ends
    for mm in request.mm_inputs:
        if not (
            isinstance(mm, MultiModalInput)
            and _is_count(mm.offset)
            and _is_count(mm.length)
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


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def new_manager(
    num_gpu_blocks: int,
    block_size: int,
    enable_caching: bool = True,
    profile: str = "vllm-v1",
    hash_fn: str = DEFAULT_HASH_FN,
    seed: str = DEFAULT_SEED,
) -> ManagerState:
    """A manager over a fresh pool.

    Raises:
        InvalidRequest: a size is not a positive integer, or the profile or hash function is unknown.
    """
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise InvalidRequest(f"block_size must be a positive integer; got block_size={block_size!r}")
    hash_request_blocks((), block_size, hash_fn=hash_fn, seed=seed)  # validates hash_fn
    pool = ops.new_pool(num_gpu_blocks, enable_caching, profile)
    return ManagerState(ManagerConfig(block_size, hash_fn, seed), pool, ())


def request_block_hashes(state: ManagerState, request: Request) -> tuple[BlockHash, ...]:
    """The hash chain of the request's full blocks under this manager's hash function and seed."""
    cfg = state.config
    return hash_request_blocks(
        request.token_ids,
        cfg.block_size,
        request.lora_name,
        request.mm_inputs,
        request.cache_salt,
        cfg.hash_fn,
        cfg.seed,
    )


def _computed_ok(
    state: ManagerState, request: Request, result: Step[ManagerState, tuple[tuple[BlockId, ...], int]]
) -> bool:
    blocks, num_tokens = result.result
    check_hit(
        state.snapshot(), len(request.token_ids), state.config.block_size,
        request_block_hashes(state, request), blocks, num_tokens,
    )
    return True


@icontract.require(lambda state: _holds(state))
@icontract.ensure(lambda state, request, result: _computed_ok(state, request, result))
@icontract.ensure(lambda state, result: result.state is state)
def get_computed_blocks(state: ManagerState, request: Request) -> Step[ManagerState, tuple[tuple[BlockId, ...], int]]:
    """The longest cached prefix of a new request, capped so its last token is computed.

    Reads only; the hit blocks are touched by `allocate_slots`.

    Returns:
        The state, unchanged, and as the result the hit blocks (a prefix of the
        request's hash chain) and the tokens they cover.

    Raises:
        InvalidRequest: the request has no tokens, misplaced mm_inputs, or is already running.

    raises: InvalidRequest  # the errors above, as CrossHair reads them
    """
    _check_request(request, "get_computed_blocks")
    if state.request(request.request_id) is not None:
        raise InvalidRequest(f"get_computed_blocks: request_id={request.request_id!r} is already running")
    if not state.pool.config.enable_caching:
        return Step(state, ((), 0))
    block_size = state.config.block_size
    # NOTE: at most len - 1 tokens: the last prompt token must be computed to get
    # the logits that sample the first output token.
    max_hit_blocks = (len(request.token_ids) - 1) // block_size
    hits: list[BlockId] = []
    for h in request_block_hashes(state, request)[:max_hit_blocks]:
        b = ops.get_cached_block(state.pool, h).result
        if b is None:
            break
        hits.append(b)
    return Step(state, (tuple(hits), len(hits) * block_size))


def _alloc_ok(state: ManagerState, request: Request, result: Step[ManagerState, tuple[BlockId, ...] | None]) -> bool:
    new_state, new_blocks = result.state, result.result
    return _holds(new_state) and (new_blocks is not None or new_state == state)


@icontract.require(lambda state: _holds(state))
@icontract.ensure(lambda state, request, result: _alloc_ok(state, request, result))
def allocate_slots(
    state: ManagerState,
    request: Request,
    num_new_tokens: int,
    num_new_computed_tokens: int = 0,
    new_computed_blocks: Sequence[BlockId] = (),
    num_external_computed_tokens: int = 0,
) -> Step[ManagerState, tuple[BlockId, ...] | None]:
    """Give a request slots for its next `num_new_tokens` tokens, and register the blocks they fill.

    On a request's first call, `new_computed_blocks` is its prefix hit (from
    `get_computed_blocks`) and `num_external_computed_tokens` what an external
    KV cache loads after it; both count as computed.

    Five phases, one function each: validate, plan, touch the hits, take new
    blocks, register full blocks. Only validation looks at the whole request;
    the other four work on one pool and one block table, so several KV cache
    groups become a loop over them (plan every group, then touch, take and
    register in each).

    Returns:
        The new state and the newly taken blocks, or (state unchanged, None) when
        too few blocks are free: nothing is touched and nothing taken.

    Raises:
        InvalidRequest: a count is negative or not an integer, num_new_tokens is 0, the
            tokens exceed the request's, the hit does not match its block count, or the
            request's mm_inputs are misplaced (outside its tokens, out of order, overlapping).
        InvalidBlock: a hit block is not registered under the request's chain.

    raises: InvalidRequest, InvalidBlock  # the errors above, as CrossHair reads them
    """
    step = _validate_allocation(
        state, request, num_new_tokens, num_new_computed_tokens, new_computed_blocks, num_external_computed_tokens
    )
    block_size = state.config.block_size
    num_to_allocate = _plan_allocation(state.pool, step, block_size)
    if num_to_allocate is None:
        return Step(state, None)
    pool = _touch_hits(state.pool, step.hits)
    pool, new_blocks, block_ids = _take_new_blocks(pool, step, num_to_allocate)
    pool, num_cached = _register_full_blocks(pool, step, block_ids, block_size)
    new_entry = RequestBlocks(block_ids, num_cached, step.num_tokens)
    return Step(_with_request(replace(state, pool=pool), request.request_id, new_entry), new_blocks)


@dataclass(frozen=True, slots=True)
class _AllocationStep:
    """A validated `allocate_slots` call, as the phases after validation read it."""

    request: Request  # the request being scheduled
    entry: RequestBlocks  # its record before the step (empty on its first step)
    hits: tuple[BlockId, ...]  # its prefix hit, first step only: registered blocks it starts to share
    hashes: tuple[BlockHash, ...]  # the hash chain of its full blocks
    num_tokens: int  # tokens computed once the step has run: hit, external and new included


def _validate_allocation(
    state: ManagerState,
    request: Request,
    num_new_tokens: int,
    num_new_computed_tokens: int,
    new_computed_blocks: Sequence[BlockId],
    num_external_computed_tokens: int,
) -> _AllocationStep:
    """Phase 1: refuse a caller's mistake before anything changes, in one fixed order.

    The order is part of the contract: every implementation names the same
    mistake first, and a refused call leaves the state as it was.

    Raises:
        InvalidRequest, InvalidBlock: as `allocate_slots`.
    """
    _check_request(request, "allocate_slots")
    _check_step_counts(num_new_tokens, num_new_computed_tokens, num_external_computed_tokens)
    entry = state.request(request.request_id)
    if entry is not None and (new_computed_blocks or num_new_computed_tokens or num_external_computed_tokens):
        raise InvalidRequest(
            f"allocate_slots: request_id={request.request_id!r} is running; prefix hits are only for its first step"
        )
    if entry is None:
        entry = RequestBlocks((), 0, 0)
    hashes = _check_hit_blocks(state, request, num_new_computed_tokens, new_computed_blocks)
    total = entry.num_computed_tokens + num_new_computed_tokens + num_external_computed_tokens + num_new_tokens
    if total > len(request.token_ids):
        raise InvalidRequest(
            f"allocate_slots: {total} tokens would be computed but request_id={request.request_id!r} "
            f"has {len(request.token_ids)}"
        )
    return _AllocationStep(request, entry, tuple(new_computed_blocks), hashes, total)


def _check_step_counts(num_new_tokens: int, num_new_computed_tokens: int, num_external_computed_tokens: int) -> None:
    """Every count is a non-negative integer, and the step schedules at least one token."""
    for name, value in (
        ("num_new_tokens", num_new_tokens),
        ("num_new_computed_tokens", num_new_computed_tokens),
        ("num_external_computed_tokens", num_external_computed_tokens),
    ):
        if not _is_count(value):
            raise InvalidRequest(f"allocate_slots: {name} must be a non-negative integer; got {name}={value!r}")
    if num_new_tokens == 0:
        raise InvalidRequest("allocate_slots: num_new_tokens=0; a step must schedule at least one token")


def _check_hit_blocks(
    state: ManagerState, request: Request, num_new_computed_tokens: int, new_computed_blocks: Sequence[BlockId]
) -> tuple[BlockHash, ...]:
    """The hit covers its tokens in whole blocks, each registered under the request's own chain.

    Returns:
        The request's hash chain (the registration phase needs it too).
    """
    cfg, pool = state.config, state.pool
    if len(new_computed_blocks) * cfg.block_size != num_new_computed_tokens:
        raise InvalidRequest(
            f"allocate_slots: num_new_computed_tokens={num_new_computed_tokens} but "
            f"{len(new_computed_blocks)} hit blocks of block_size={cfg.block_size}"
        )
    if new_computed_blocks and not pool.config.enable_caching:
        raise InvalidRequest("allocate_slots: prefix caching is off, so there can be no hit blocks")
    hashes = request_block_hashes(state, request)
    if len(new_computed_blocks) > len(hashes):
        raise InvalidRequest(
            f"allocate_slots: {len(new_computed_blocks)} hit blocks but request_id={request.request_id!r} "
            f"has only {len(hashes)} full blocks"
        )
    for i, b in enumerate(new_computed_blocks):
        in_range = isinstance(b, int) and not isinstance(b, bool) and 0 <= b < pool.num_gpu_blocks
        if not in_range or pool.block_hash[b] != hashes[i]:
            raise InvalidBlock(f"allocate_slots: hit block_id={b!r} is not registered under the request's hash {i}")
    return hashes


def _plan_allocation(pool: PoolState, step: _AllocationStep, block_size: int) -> int | None:
    """Phase 2: how many new blocks the step needs, or None when they do not fit.

    Planned before anything changes, so a step that cannot be served is
    refused whole (the scheduler then waits or preempts) rather than failing
    halfway with its hits touched.
    """
    num_required = -(-step.num_tokens // block_size)
    num_to_allocate = max(num_required - len(step.entry.block_ids) - len(step.hits), 0)
    # Hit blocks sitting in the free queue leave it when touched: they count
    # against the free blocks just like new ones.
    num_evictable_hits = sum(1 for b in step.hits if pool.ref_cnt[b] == 0)
    if num_to_allocate + num_evictable_hits > len(pool.free_queue):
        return None
    return num_to_allocate


def _touch_hits(pool: PoolState, hits: tuple[BlockId, ...]) -> PoolState:
    """Phase 3: the request takes a reference on each hit block, so none is evicted while it runs.

    A hit block nobody held leaves the free queue here (the plan counted it).
    Touched before new blocks are taken, so taking them cannot evict a hit.
    """
    return ops.touch(pool, hits).state if hits else pool


def _take_new_blocks(
    pool: PoolState, step: _AllocationStep, num_to_allocate: int
) -> tuple[PoolState, tuple[BlockId, ...], tuple[BlockId, ...]]:
    """Phase 4: take the planned blocks and append them to the block table, after the hits.

    The table only grows while the request runs (vLLM's block tables are
    append-only), so tokens already scheduled keep their slots.

    Returns:
        The pool, the new blocks, and the request's whole block table.
    """
    taken = ops.get_new_blocks(pool, num_to_allocate)
    return taken.state, taken.result, step.entry.block_ids + step.hits + taken.result


def _register_full_blocks(
    pool: PoolState, step: _AllocationStep, block_ids: tuple[BlockId, ...], block_size: int
) -> tuple[PoolState, int]:
    """Phase 5: register (cache_full_blocks) every block the step fills, so later requests can hit it.

    Only full blocks: a partial block's tokens are still to come. The hit
    blocks are registered already (that is why they hit), so the count starts
    after them. Registered when scheduled, not after the step ran (the
    module's design note).

    Returns:
        The pool and how many leading blocks of the table are now registered.
    """
    num_cached = step.entry.num_cached_blocks + len(step.hits)
    if not pool.config.enable_caching:
        return pool, num_cached
    num_full = min(step.num_tokens, len(step.request.token_ids)) // block_size
    if num_full <= num_cached:
        return pool, num_cached
    pool = ops.cache_full_blocks(pool, block_ids[num_cached:num_full], step.hashes[num_cached:num_full]).state
    return pool, num_full


@icontract.require(lambda state: _holds(state))
@icontract.ensure(lambda result: _holds(result.state))
@icontract.ensure(lambda request_id, result: result.state.request(request_id) is None)
def free(state: ManagerState, request_id: str) -> Step[ManagerState, None]:
    """Release a finished or preempted request: its blocks are freed tail first.

    Tail first, because a request's last blocks are the least likely to be
    shared (the longer a prefix, the more specific): freed in reverse, they sit
    further left and are evicted before the common leading blocks. A block that
    another request still holds only loses one reference.

    Raises:
        InvalidRequest: request_id is not running.

    raises: InvalidRequest  # the errors above, as CrossHair reads them
    """
    entry = state.request(request_id)
    if entry is None:
        raise InvalidRequest(f"free: request_id={request_id!r} is not running (freed twice?)")
    pool = ops.free_blocks(state.pool, tuple(reversed(entry.block_ids))).state
    return Step(_with_request(replace(state, pool=pool), request_id, None), None)
