"""The reference KVCacheManager: request block tables over the reference BlockPool.

Mirrors vLLM's `kv_cache_manager.py` for one full-attention KV-cache group:
`get_computed_blocks` finds a new request's cached prefix (capped at
len - 1 tokens), `allocate_slots` touches the hit, takes new blocks and
registers the blocks a step fills, `free` releases a request tail first.
Requests are described by the spec's `Request` value; hashes come from the
spec's chain (`kvspec.spec.hashing`), which is part of the contract, not of
the implementation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvspec.reference.block_pool import BlockPool
from kvspec.spec.errors import InvalidBlock, InvalidRequest
from kvspec.spec.hashing import DEFAULT_HASH_FN, DEFAULT_SEED, MultiModalInput, hash_request_blocks
from kvspec.spec.invariants import check_all
from kvspec.spec.manager import Request
from kvspec.spec.state import BlockHash, BlockId, Snapshot

__all__ = ["KVCacheManager"]


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


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


def _check_step_counts(num_new_tokens: int, num_new_computed_tokens: int, num_external_computed_tokens: int) -> None:
    """Every count of a step is a non-negative integer, and the step schedules at least one token."""
    for name, value in (
        ("num_new_tokens", num_new_tokens),
        ("num_new_computed_tokens", num_new_computed_tokens),
        ("num_external_computed_tokens", num_external_computed_tokens),
    ):
        if not _is_count(value):
            raise InvalidRequest(f"allocate_slots: {name} must be a non-negative integer; got {name}={value!r}")
    if num_new_tokens == 0:
        raise InvalidRequest("allocate_slots: num_new_tokens=0; a step must schedule at least one token")


@dataclass(frozen=True, slots=True)
class _AllocationStep:
    """A validated `allocate_slots` call, as the phases after validation read it."""

    request: Request  # the request being scheduled
    table: list[BlockId]  # its block table before the step (empty on its first step); not changed in place
    hits: Sequence[BlockId]  # its prefix hit, first step only: registered blocks it starts to share
    hashes: tuple[BlockHash, ...]  # the hash chain of its full blocks
    num_tokens: int  # tokens computed once the step has run: hit, external and new included


class KVCacheManager:
    """Block tables of running requests over one `BlockPool`."""

    def __init__(
        self,
        num_gpu_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        profile: str = "vllm-v1",
        hash_fn: str = DEFAULT_HASH_FN,
        seed: str = DEFAULT_SEED,
    ) -> None:
        """Build a manager over a fresh pool.

        Raises:
            InvalidRequest: a size is not a positive integer, or the profile or hash function is unknown.

        Cost: O(num_gpu_blocks).
        """
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            raise InvalidRequest(f"block_size must be a positive integer; got block_size={block_size!r}")
        hash_request_blocks((), block_size, hash_fn=hash_fn, seed=seed)  # validates hash_fn
        self.block_pool = BlockPool(num_gpu_blocks, enable_caching, profile)  # owns every block
        self.block_size = block_size  # fixed
        self.enable_caching = self.block_pool.enable_caching  # fixed
        self.hash_fn = hash_fn  # fixed
        self.seed = seed  # fixed
        self.req_to_blocks: dict[str, list[BlockId]] = {}  # request id -> block table (append-only)
        self.num_cached_block: dict[str, int] = {}  # request id -> leading blocks registered
        self.num_computed_tokens: dict[str, int] = {}  # request id -> tokens computed so far

    def _block_hashes(self, request: Request) -> tuple[BlockHash, ...]:
        return hash_request_blocks(
            request.token_ids, self.block_size, request.lora_name, request.mm_inputs,
            request.cache_salt, self.hash_fn, self.seed,
        )

    def get_computed_blocks(self, request: Request) -> tuple[list[BlockId], int]:
        """The longest cached prefix of a new request, at most len - 1 tokens, in whole blocks.

        Raises:
            InvalidRequest: the request has no tokens, misplaced mm_inputs, or is already running.

        Cost: O(tokens) for the hashes, O(1) per hit block.
        """
        _check_request(request, "get_computed_blocks")
        if request.request_id in self.req_to_blocks:
            raise InvalidRequest(f"get_computed_blocks: request_id={request.request_id!r} is already running")
        if not self.enable_caching:
            return [], 0
        max_hit_blocks = (len(request.token_ids) - 1) // self.block_size
        hits: list[BlockId] = []
        for h in self._block_hashes(request)[:max_hit_blocks]:
            b = self.block_pool.get_cached_block(h)
            if b is None:
                break
            hits.append(b)
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Sequence[BlockId] = (),
        num_external_computed_tokens: int = 0,
    ) -> list[BlockId] | None:
        """Give a request slots for its next tokens; None (and no change) when too few blocks are free.

        Five phases, one method each: validate, plan, touch the hits, take new
        blocks, register full blocks. Only validation looks at the whole
        request; the other four work on one pool and one block table, so
        several KV cache groups become a loop over them.

        Raises:
            InvalidRequest: a bad count, a hit on a running request, more tokens than the request has,
                or misplaced mm_inputs.
            InvalidBlock: a hit block is not registered under the request's chain.

        Cost: O(new blocks + hit blocks), plus hashing of new full blocks.
        """
        step = self._validate_allocation(
            request, num_new_tokens, num_new_computed_tokens, new_computed_blocks, num_external_computed_tokens
        )
        num_to_allocate = self._plan_allocation(step)
        if num_to_allocate is None:
            return None
        self._touch_hits(step)
        new_blocks = self._take_new_blocks(step, num_to_allocate)
        self._register_full_blocks(step)
        self.num_computed_tokens[request.request_id] = step.num_tokens
        return new_blocks

    def _validate_allocation(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int,
        new_computed_blocks: Sequence[BlockId],
        num_external_computed_tokens: int,
    ) -> _AllocationStep:
        """Phase 1: refuse a caller's mistake before anything changes, in the spec's order.

        The order is part of the contract: the first mistake found is the one
        the spec names, and a refused call leaves the manager as it was.

        Raises:
            InvalidRequest, InvalidBlock: as `allocate_slots`.

        Cost: O(tokens) to hash the request, O(1) per hit block.
        """
        _check_request(request, "allocate_slots")
        _check_step_counts(num_new_tokens, num_new_computed_tokens, num_external_computed_tokens)
        rid = request.request_id
        running = rid in self.req_to_blocks
        if running and (new_computed_blocks or num_new_computed_tokens or num_external_computed_tokens):
            raise InvalidRequest(
                f"allocate_slots: request_id={rid!r} is running; prefix hits are only for its first step"
            )
        hashes = self._check_hit_blocks(request, num_new_computed_tokens, new_computed_blocks)
        table = self.req_to_blocks.get(rid, [])
        num_computed = self.num_computed_tokens.get(rid, 0)
        total = num_computed + num_new_computed_tokens + num_external_computed_tokens + num_new_tokens
        if total > len(request.token_ids):
            raise InvalidRequest(
                f"allocate_slots: {total} tokens would be computed but request_id={rid!r} has {len(request.token_ids)}"
            )
        return _AllocationStep(request, table, new_computed_blocks, hashes, total)

    def _check_hit_blocks(
        self, request: Request, num_new_computed_tokens: int, new_computed_blocks: Sequence[BlockId]
    ) -> tuple[BlockHash, ...]:
        """The hit covers its tokens in whole blocks, each registered under the request's own chain.

        Returns:
            The request's hash chain (registration needs it too).

        Cost: O(tokens) to hash the request, O(1) per hit block.
        """
        if len(new_computed_blocks) * self.block_size != num_new_computed_tokens:
            raise InvalidRequest(
                f"allocate_slots: num_new_computed_tokens={num_new_computed_tokens} but "
                f"{len(new_computed_blocks)} hit blocks of block_size={self.block_size}"
            )
        if new_computed_blocks and not self.enable_caching:
            raise InvalidRequest("allocate_slots: prefix caching is off, so there can be no hit blocks")
        pool = self.block_pool
        hashes = self._block_hashes(request)
        if len(new_computed_blocks) > len(hashes):
            raise InvalidRequest(
                f"allocate_slots: {len(new_computed_blocks)} hit blocks but request_id={request.request_id!r} "
                f"has only {len(hashes)} full blocks"
            )
        for i, b in enumerate(new_computed_blocks):
            in_range = isinstance(b, int) and not isinstance(b, bool) and 0 <= b < pool.num_gpu_blocks
            if not in_range or pool.blocks[b].block_hash != hashes[i]:
                raise InvalidBlock(f"allocate_slots: hit block_id={b!r} is not registered under the request's hash {i}")
        return hashes

    def _plan_allocation(self, step: _AllocationStep) -> int | None:
        """Phase 2: how many new blocks the step needs, or None when they do not fit.

        Planned before anything changes, so a step that cannot be served is
        refused whole rather than failing halfway with its hits touched.

        Cost: O(hit blocks).
        """
        num_required = -(-step.num_tokens // self.block_size)
        num_to_allocate = max(num_required - len(step.table) - len(step.hits), 0)
        # Hit blocks in the free queue leave it when touched: they use up free blocks too.
        num_evictable_hits = sum(1 for b in step.hits if self.block_pool.blocks[b].ref_cnt == 0)
        if num_to_allocate + num_evictable_hits > self.block_pool.get_num_free_blocks():
            return None
        return num_to_allocate

    def _touch_hits(self, step: _AllocationStep) -> None:
        """Phase 3: take a reference on each hit block, so none is evicted while the request runs.

        Before new blocks are taken: a hit block still in the free queue could
        otherwise be the one they take. Cost: O(hit blocks).
        """
        if step.hits:
            self.block_pool.touch(step.hits)

    def _take_new_blocks(self, step: _AllocationStep, num_to_allocate: int) -> list[BlockId]:
        """Phase 4: take the planned blocks and append them, after the hits, to the block table.

        The table only grows while the request runs (append-only, as vLLM's),
        so tokens already scheduled keep their slots. Cost: O(new blocks).
        """
        new_blocks = self.block_pool.get_new_blocks(num_to_allocate)
        self.req_to_blocks[step.request.request_id] = step.table + list(step.hits) + new_blocks
        return new_blocks

    def _register_full_blocks(self, step: _AllocationStep) -> None:
        """Phase 5: register (cache_full_blocks) every block the step fills, so later requests can hit it.

        Cost: O(newly full blocks); their hashes were computed in validation.
        """
        rid = step.request.request_id
        # The hit blocks are registered already (that is why they hit).
        num_cached = self.num_cached_block.get(rid, 0) + len(step.hits)
        if self.enable_caching:
            # Only a full block is registered: a partial one's tokens are still to come.
            num_full = min(step.num_tokens, len(step.request.token_ids)) // self.block_size
            if num_full > num_cached:
                table = self.req_to_blocks[rid]
                self.block_pool.cache_full_blocks(table[num_cached:num_full], step.hashes[num_cached:num_full])
                num_cached = num_full
        self.num_cached_block[rid] = num_cached

    def free(self, request_id: str) -> None:
        """Release a finished or preempted request; its blocks are freed tail first.

        Raises:
            InvalidRequest: request_id is not running.

        Cost: O(blocks of the request).
        """
        table = self.req_to_blocks.get(request_id)
        if table is None:
            raise InvalidRequest(f"free: request_id={request_id!r} is not running (freed twice?)")
        # Tail first: a request's last blocks are the least likely to be shared,
        # so they are evicted before its common leading blocks.
        self.block_pool.free_blocks(table[::-1])
        del self.req_to_blocks[request_id]
        del self.num_cached_block[request_id]
        del self.num_computed_tokens[request_id]

    def snapshot(self) -> Snapshot:
        """The pool's snapshot with every running request's block table. Cost: O(blocks)."""
        tables = tuple(sorted((rid, tuple(blocks)) for rid, blocks in self.req_to_blocks.items()))
        return self.block_pool.snapshot(block_tables=tables)

    def check_invariants(self) -> None:
        """Check every state invariant via the spec's predicates.

        Raises:
            InvariantViolation: naming the first invariant that fails.
        """
        check_all(self.snapshot())
        self.block_pool.check_invariants()
