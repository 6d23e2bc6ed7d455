"""The reference KVCacheManager: request block tables over the reference BlockPool.

Mirrors vLLM's `kv_cache_manager.py`, `kv_cache_coordinator.py` and
`single_type_kv_cache_manager.py`: one `_GroupManager` per KV cache group
(full attention, a sliding window, chunked local attention) keeps that
group's block tables over the one shared pool; the manager runs each phase of
`allocate_slots` over every group before the next. `get_computed_blocks`
finds a new request's cached prefix (capped at len - 1 tokens, agreed by every
group), `allocate_slots` frees blocks a running request no longer reads,
touches the hit, takes new blocks and registers the blocks a step fills,
`free` releases a request tail first, group by group. Requests are described
by the spec's `Request` value; hashes come from the spec's chain
(`kvspec.spec.hashing`) and group keys from `spec.state.group_key`, and the
argument checks are the spec's (`spec.manager.manager_config`,
`check_request`, `check_lookup`, `check_allocation`, `check_cache_count`: which mistake is named
first, and how, is the contract), all part of the contract, not of the
implementation; the window arithmetic and the hit search are this module's
own, so the harness checks them against the spec's. With `enable_kv_cache_events` the pool publishes vLLM's
KV cache events (each group's registration as one `BlockStored` with its
parent, tokens and keys); the hit statistics (`prefix_cache_stats`) count
each request at its admission, local hits and the connector's apart.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvspec.reference.block_pool import BlockPool
from kvspec.spec.attention import FULL, KVGroup
from kvspec.spec.errors import InvalidRequest
from kvspec.spec.events import BlockStored, KVCacheEvent, event_extra_keys
from kvspec.spec.hashing import DEFAULT_HASH_FN, DEFAULT_SEED
from kvspec.spec.invariants import check_all
from kvspec.spec.manager import (
    AllocationStep,
    ManagerView,
    Request,
    check_allocation,
    check_cache_count,
    check_lookup,
    check_request,
    manager_config,
)
from kvspec.spec.state import NULL_BLOCK_ID, BlockHash, BlockId, Snapshot, group_key, table_name
from kvspec.spec.stats import PrefixCacheStats

__all__ = ["KVCacheManager"]


class _GroupManager:
    """One KV cache group's block tables over the shared pool (vLLM's `SingleTypeKVCacheManager`)."""

    def __init__(self, group: KVGroup, group_id: int, pool: BlockPool, block_size: int) -> None:
        self.group = group  # the attention type; fixed
        self.group_id = group_id  # its index, part of every hash-table key of its blocks; fixed
        self.pool = pool  # shared by every group
        self.block_size = block_size  # fixed
        self.req_to_blocks: dict[str, list[BlockId]] = {}  # request id -> table; NULL_BLOCK_ID where skipped
        self.num_cached_block: dict[str, int] = {}  # request id -> leading positions registered (or null)

    def skipped_tokens(self, num_computed_tokens: int) -> int:
        """Leading tokens the group no longer reads once `num_computed_tokens` are computed. Cost: O(1)."""
        kind, size = self.group.kind, self.group.size
        if kind == "sliding":
            return num_computed_tokens - size + 1 if num_computed_tokens >= size else 0
        if kind == "chunked":
            return num_computed_tokens - num_computed_tokens % size
        return 0

    def skipped_blocks(self, num_computed_tokens: int) -> int:
        """Leading blocks holding only skipped tokens: those the group frees. Cost: O(1)."""
        return self.skipped_tokens(num_computed_tokens) // self.block_size

    def key(self, block_hash: BlockHash) -> BlockHash:
        """The hash-table key of this group's block for `block_hash`."""
        return group_key(block_hash, self.group_id)

    def blocks_for_window_hit(self) -> int:
        """How many contiguous cached blocks a sliding-window hit needs: those holding the W - 1 tokens before
        the next (vLLM's `_contiguous_blocks_for_hit`, no EAGLE). Cost: O(1)."""
        return -(-(self.group.size - 1) // self.block_size)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Free, last first, the blocks a running request no longer reads; null them in its table.

        The walk stops at a null position: everything before it went in an
        earlier step. Cost: O(blocks freed).
        """
        blocks = self.req_to_blocks.get(request_id)
        skipped = self.skipped_blocks(num_computed_tokens)
        if not blocks or not skipped:
            return
        freed: list[BlockId] = []
        for i in range(min(skipped, len(blocks)) - 1, -1, -1):
            if blocks[i] == NULL_BLOCK_ID:
                break
            freed.append(blocks[i])
            blocks[i] = NULL_BLOCK_ID
        if freed:
            self.pool.free_blocks(freed)

    def blocks_needed(self, step: AllocationStep, hits: Sequence[BlockId]) -> int:
        """How many free blocks this group's part of the step uses (new ones and evictable hits). Cost: O(hits)."""
        num_required = -(-step.num_tokens // self.block_size)
        table = self.req_to_blocks.get(step.request.request_id)
        if table is not None:
            return max(num_required - len(table), 0)
        skipped = self.skipped_blocks(step.num_computed)
        return max(num_required - max(skipped, len(hits)), 0) + self.evictable_hits(hits[skipped:])

    def evictable_hits(self, hits: Sequence[BlockId]) -> int:
        """Hit blocks the step keeps that sit in the free queue: touching them takes them out. Cost: O(hits)."""
        blocks = self.pool.blocks
        return sum(1 for b in hits if blocks[b].ref_cnt == 0)

    def add_hits(self, request_id: str, hits: Sequence[BlockId], num_computed: int) -> None:
        """A first step's hit: touch the blocks still read; the skipped positions become null. Cost: O(hits)."""
        skipped = self.skipped_blocks(num_computed)
        kept = list(hits[skipped:])
        if kept:
            self.pool.touch(kept)
        table = [NULL_BLOCK_ID] * skipped + kept
        self.req_to_blocks[request_id] = table
        self.num_cached_block[request_id] = len(table)

    def add_external_blocks(self, request_id: str, num_computed: int, num_external: int) -> list[BlockId]:
        """Blocks for externally loaded tokens the group still reads (none at a chunk boundary). Cost: O(new)."""
        skipped_tokens = self.skipped_tokens(num_computed)
        if skipped_tokens and min(num_computed - skipped_tokens, num_external) <= 0:
            return []
        table = self.req_to_blocks.setdefault(request_id, [])
        new = self.pool.get_new_blocks(max(0, -(-num_computed // self.block_size) - len(table)))
        table.extend(new)
        return new

    def add_new_blocks(self, request_id: str, num_tokens: int) -> list[BlockId]:
        """Blocks for every position up to `num_tokens` the table does not have yet. Cost: O(new blocks)."""
        table = self.req_to_blocks.setdefault(request_id, [])
        new = self.pool.get_new_blocks(max(-(-num_tokens // self.block_size) - len(table), 0))
        table.extend(new)
        return new

    def cache_blocks(self, step: AllocationStep, num_full: int) -> None:
        """Register the newly full blocks under this group's keys; null positions stay out. Cost: O(new full).

        With events on, the registration publishes one `BlockStored` (even if
        every new position is null, as vLLM's does): the keys, the key of the
        position before as parent, the tokens of every new position, the keys.
        """
        rid = step.request.request_id
        num_cached = self.num_cached_block.get(rid, 0)
        if num_full > num_cached:
            table = self.req_to_blocks[rid]
            positions = [i for i in range(num_cached, num_full) if table[i] != NULL_BLOCK_ID]
            keys = [self.key(step.hashes[i]) for i in positions]
            publishes = self.pool.kv_event_queue is not None
            stored = self._stored(step, num_cached, num_full, positions, keys) if publishes else None
            if positions or stored is not None:
                self.pool.cache_full_blocks([table[i] for i in positions], keys, stored)
            num_cached = num_full
        self.num_cached_block[rid] = num_cached

    def _stored(
        self, step: AllocationStep, num_cached: int, num_full: int, positions: list[int], keys: list[BlockHash]
    ) -> BlockStored:
        """The event of registering positions [num_cached, num_full) (the non-null `positions`). Cost: O(new full)."""
        request, bs = step.request, self.block_size
        return BlockStored(
            block_hashes=tuple(keys),
            parent_block_hash=self.key(step.hashes[num_cached - 1]) if num_cached else None,
            token_ids=request.token_ids[num_cached * bs : num_full * bs],
            block_size=bs,
            lora_name=request.lora_name,
            extra_keys=event_extra_keys(positions, bs, request.lora_name, request.mm_inputs, request.cache_salt),
            group_idx=self.group_id,
        )

    def free(self, request_id: str) -> None:
        """Release the request's blocks in this group, last first; null positions hold nothing. Cost: O(blocks)."""
        table = self.req_to_blocks.pop(request_id, None)
        self.num_cached_block.pop(request_id, None)
        if table:
            held = [b for b in reversed(table) if b != NULL_BLOCK_ID]
            if held:
                self.pool.free_blocks(held)


class KVCacheManager:
    """Block tables of running requests, one per KV cache group, over one `BlockPool`."""

    group_manager_cls: type[_GroupManager] = _GroupManager  # what keeps each group's tables

    def __init__(
        self,
        num_gpu_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        profile: str = "vllm-v1",
        hash_fn: str = DEFAULT_HASH_FN,
        seed: str = DEFAULT_SEED,
        groups: str | Sequence[KVGroup] = (FULL,),
        enable_kv_cache_events: bool = False,
    ) -> None:
        """Build a manager over a fresh pool, with its KV cache groups (`"full,sliding:8"` or `KVGroup` values);
        with `enable_kv_cache_events` the pool publishes events.

        Raises:
            InvalidRequest: a size is not a positive integer, the profile or hash function is unknown,
                a group is malformed, or a chunk is not a multiple of the block size.

        Cost: O(num_gpu_blocks).
        """
        # What a layout is, and how a request's chain is hashed: part of the contract, so the spec's.
        self.config = manager_config(block_size, hash_fn, seed, groups)  # fixed
        kv_groups = self.config.groups
        self.block_pool = BlockPool(num_gpu_blocks, enable_caching, profile, enable_kv_cache_events)  # owns every block
        self.block_size = block_size  # fixed
        self.enable_caching = self.block_pool.enable_caching  # fixed
        self.hash_fn = hash_fn  # fixed
        self.seed = seed  # fixed
        self.groups = kv_groups  # fixed
        # What allocate_slots' checks read (spec.manager.check_allocation); the chain through _block_hashes,
        # which the hashing mutants replace.
        config, enable_caching = self.config, self.enable_caching
        self._view = ManagerView(config, num_gpu_blocks, enable_caching, self._block_hash, self._block_hashes)
        self.managers = [self.group_manager_cls(g, i, self.block_pool, block_size) for i, g in enumerate(kv_groups)]
        self.num_computed_tokens: dict[str, int] = {}  # request id -> tokens computed so far (running requests)
        self.stats = PrefixCacheStats()  # hit statistics since construction: grown at each admission and reset

    def _block_hash(self, block_id: int) -> BlockHash | None:
        return self.block_pool.blocks[block_id].block_hash

    def _block_hashes(self, request: Request) -> tuple[BlockHash, ...]:
        return self.config.block_hashes(request)

    def _check_request(self, request: Request, op: str) -> None:
        check_request(request, op, len(self.groups))

    def get_computed_blocks(
        self, request: Request, max_cache_hit_length: int | None = None
    ) -> tuple[list[BlockId], int]:
        """The longest cached prefix every group can serve, at most len - 1 tokens (and the scheduler's cap, and
        the request's hit limit; none for a request whose lookup does not run: `_lookup_enabled`).

        Raises:
            InvalidRequest: the request has no tokens, misplaced mm_inputs, a bad hit limit, or is already
                running; the cap is not None or a non-negative integer.

        Cost: O(tokens) for the hashes, O(1) per position looked up.
        """
        max_length = check_lookup(request, max_cache_hit_length, len(self.groups), self.num_computed_tokens)
        if not self._lookup_enabled(request):
            return [], 0
        return self._hit(request, max_length)

    def _lookup_enabled(self, request: Request) -> bool:
        """Whether a request's lookup runs: caching is on and its hit limit is not 0. Cost: O(1)."""
        return self.enable_caching and request.prefix_cache_hit_limit != 0

    def get_num_cached_tokens(self, request: Request) -> int:
        """How many of a request's tokens are cached, touching nothing: the hit within len - 1 tokens.

        As vLLM 0.34's: bounded by len - 1 only (not by the request's hit
        limit, unless that is 0: no lookup, 0 tokens), running or not.

        Raises:
            InvalidRequest: the request has no tokens, misplaced mm_inputs or a bad hit limit.

        Cost: O(tokens) for the hashes, O(1) per position looked up.
        """
        self._check_request(request, "get_num_cached_tokens")
        if not self._lookup_enabled(request):
            return 0
        return self._hit(request, len(request.token_ids) - 1)[1]

    def _hit(self, request: Request, max_length: int) -> tuple[list[BlockId], int]:
        """The hit every group agrees on within max_length tokens, group by group. Cost: O(1) per position."""
        hashes = self._block_hashes(request)
        if len(self.managers) == 1:
            hit = _find_hit(self.managers, hashes, max_length)
            return hit[0], len(hit[0]) * self.block_size
        per_group, length = _agreed_hit(self, hashes, max_length)
        return [b for blocks in per_group for b in blocks], length

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Sequence[BlockId] = (),
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
    ) -> list[BlockId] | None:
        """Give a request slots for its next tokens; None (taking and touching nothing) when too few blocks are free.

        `delay_cache_blocks`: an asynchronous external load; its blocks are
        taken but registered only by `cache_blocks`, once the load is done.

        Seven phases, each over every group before the next: validate, free
        skipped blocks (even when the step is then refused, as vLLM's
        `remove_skipped_blocks`), plan, touch the hits, take blocks for
        external tokens, take blocks for new tokens, register full blocks.

        Returns:
            The newly taken blocks, group by group in table order.

        Raises:
            InvalidRequest: a bad count, a hit on a running request, more tokens than the request has,
                or misplaced mm_inputs.
            InvalidBlock: a hit block is not registered under the request's chain in its group.

        Cost: O(new blocks + hit blocks), plus hashing of new full blocks.
        """
        step = check_allocation(
            self._view, self.num_computed_tokens, request, num_new_tokens, num_new_computed_tokens,
            new_computed_blocks, num_external_computed_tokens, delay_cache_blocks,
        )  # fmt: skip
        self._free_skipped_blocks(step)
        if not self._plan_allocation(step):
            return None
        self._touch_hits(step)
        new_blocks = self._take_external_blocks(step)
        for new, more in zip(new_blocks, self._take_new_blocks(step)):
            new += more
        if not delay_cache_blocks:
            self._register_full_blocks(step)
        self.num_computed_tokens[request.request_id] = step.num_tokens
        if not step.running:
            self._record_admission(request, num_new_computed_tokens, step.num_external)
        return new_blocks[0] if len(new_blocks) == 1 else [b for new in new_blocks for b in new]

    def _record_admission(self, request: Request, num_local_hits: int, num_external: int) -> None:
        """Count an admitted request in the hit statistics: its local hit, then the connector's tokens. Cost: O(1).

        Counted at admission, not at the lookup: a lookup whose step is refused
        is retried by the scheduler, and must not be counted twice.
        """
        preempted = request.num_preemptions > 0
        looked_up = self._lookup_enabled(request)  # a request whose lookup did not run is not counted locally
        self.stats = self.stats.admitted(len(request.token_ids), num_local_hits, num_external, preempted, looked_up)

    def _free_skipped_blocks(self, step: AllocationStep) -> None:
        """Phase 2: a running request frees, in every group, the blocks it no longer reads. Cost: O(blocks freed)."""
        if step.running:
            for manager in self.managers:
                manager.remove_skipped_blocks(step.request.request_id, step.num_computed)

    def _plan_allocation(self, step: AllocationStep) -> bool:
        """Phase 3: whether every group's new blocks and evictable hits fit in the free blocks.

        Planned before anything is taken or touched, so a step that cannot be
        served is refused whole rather than failing halfway with its hits touched.
        Cost: O(hit blocks).
        """
        needed = sum(m.blocks_needed(step, hits) for m, hits in zip(self.managers, step.hits))
        return needed <= self.block_pool.get_num_free_blocks()

    def _touch_hits(self, step: AllocationStep) -> None:
        """Phase 4: a first step takes a reference on every group's hit blocks before any block is taken.

        A hit block still in the free queue could otherwise be the one a group
        takes. Cost: O(hit blocks).
        """
        if not step.running:
            for manager, hits in zip(self.managers, step.hits):
                manager.add_hits(step.request.request_id, hits, step.num_computed)

    def _take_external_blocks(self, step: AllocationStep) -> list[list[BlockId]]:
        """Phase 5: blocks for externally loaded tokens, group by group (a first step only). Cost: O(new blocks).

        Returns:
            Per group, the blocks taken.
        """
        if step.running or not step.num_external:
            return [[] for _ in self.managers]
        rid = step.request.request_id
        return [m.add_external_blocks(rid, step.num_computed, step.num_external) for m in self.managers]

    def _take_new_blocks(self, step: AllocationStep) -> list[list[BlockId]]:
        """Phase 6: blocks for the step's tokens, appended to each group's table (append-only, as vLLM's).

        Returns:
            Per group, the blocks taken. Cost: O(new blocks).
        """
        return [m.add_new_blocks(step.request.request_id, step.num_tokens) for m in self.managers]

    def _register_full_blocks(self, step: AllocationStep) -> None:
        """Phase 7: register (cache_full_blocks) every block the step fills, group by group.

        Only a full block is registered: a partial one's tokens are still to
        come. Cost: O(newly full blocks); their hashes were computed in validation.
        """
        if self.enable_caching:
            num_full = min(step.num_tokens, len(step.request.token_ids)) // self.block_size
            for manager in self.managers:
                manager.cache_blocks(step, num_full)

    @property
    def req_to_blocks(self) -> dict[str, list[BlockId]]:
        """Group 0's block tables (the only ones, with one KV cache group): request id -> table."""
        return self.managers[0].req_to_blocks

    @property
    def num_cached_block(self) -> dict[str, int]:
        """Group 0's count of leading registered (or null) positions, per request."""
        return self.managers[0].num_cached_block

    def free(self, request_id: str) -> None:
        """Release a finished or preempted request: each group's blocks tail first, group by group.

        Raises:
            InvalidRequest: request_id is not running.

        Cost: O(blocks of the request).
        """
        if request_id not in self.num_computed_tokens:
            raise InvalidRequest(f"free: request_id={request_id!r} is not running (freed twice?)")
        # Tail first: a request's last blocks are the least likely to be shared,
        # so they are evicted before its common leading blocks.
        for manager in self.managers:
            manager.free(request_id)
        del self.num_computed_tokens[request_id]

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register a running request's blocks full up to `num_computed_tokens`: an asynchronous load is done.

        A load that failed partway gives fewer tokens than were computed: the
        request's computed count goes back to it (never below what it has
        registered), and the tokens after it are computed again.

        Raises:
            InvalidRequest: the request is not running, or the count is not between its registered and
                its computed tokens.

        Cost: O(tokens) to hash the request, O(1) per block registered.
        """
        self._check_request(request, "cache_blocks")
        rid = request.request_id
        if rid not in self.num_computed_tokens:
            raise InvalidRequest(f"cache_blocks: request_id={rid!r} is not running")
        computed = self.num_computed_tokens[rid]
        registered = max(m.num_cached_block.get(rid, 0) for m in self.managers) * self.block_size
        check_cache_count(rid, num_computed_tokens, computed, registered)
        n = num_computed_tokens
        step = AllocationStep(
            request=request,
            running=True,
            hits=(),
            hashes=self._block_hashes(request),
            num_computed=n,
            num_local_computed=n,
            num_tokens=n,
            delay_cache_blocks=False,
        )
        self._register_full_blocks(step)
        self.num_computed_tokens[rid] = n

    def evict_blocks(self, block_ids: Sequence[BlockId]) -> None:
        """Drop the cached hash of each block (the connector's failed loads); holders keep them. Cost: O(blocks).

        Raises:
            InvalidBlock: an id is out of range or the null block.
            InvalidRequest: an id is named twice.
        """
        self.block_pool.evict_blocks(block_ids)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash if no block is held, and count the reset; False otherwise. Cost: O(blocks)."""
        if not self.block_pool.reset_prefix_cache():
            return False
        self.stats = PrefixCacheStats(self.stats.local, self.stats.connector, self.stats.num_resets + 1)
        return True

    def prefix_cache_stats(self) -> PrefixCacheStats:
        """The hit statistics since the manager was built. Cost: O(1)."""
        return self.stats

    def take_events(self) -> list[KVCacheEvent]:
        """The KV cache events published since the last call. Cost: O(events)."""
        return self.block_pool.take_events()

    def snapshot(self) -> Snapshot:
        """The pool's snapshot with every running request's block tables (one per group). Cost: O(blocks)."""
        tables = tuple(sorted(
            (table_name(rid, m.group_id), tuple(blocks))
            for m in self.managers for rid, blocks in m.req_to_blocks.items()
        ))  # fmt: skip
        groups = () if self.groups == (FULL,) else tuple(str(g) for g in self.groups)
        return self.block_pool.snapshot(block_tables=tables, kv_groups=groups)

    def check_invariants(self) -> None:
        """Check every state invariant via the spec's predicates.

        Raises:
            InvariantViolation: naming the first invariant that fails.
        """
        check_all(self.snapshot())
        self.block_pool.check_invariants()


def _find_hit(managers: list[_GroupManager], hashes: tuple[BlockHash, ...], max_length: int) -> list[list[BlockId]]:
    """One attention type's hit within `max_length` tokens, for each of its groups (vLLM's `find_longest_cache_hit`).

    A position hits only if every one of the groups has it cached. Full
    attention: cached blocks from the first, left to right. A sliding window:
    scanned right to left for a run of `blocks_for_window_hit()` cached blocks
    (or a shorter run that reaches the first block), the null block before
    it. Chunked local attention: the null block before the chunk that holds
    position max_length, then cached blocks left to right. Cost: O(positions scanned).
    """
    first_manager = managers[0]
    pool, block_size, group = first_manager.pool, first_manager.block_size, first_manager.group
    max_blocks = min(max_length // block_size, len(hashes))

    def lookup(i: int) -> list[BlockId] | None:
        found = []
        for m in managers:
            b = pool.get_cached_block(m.key(hashes[i]))
            if b is None:
                return None
            found.append(b)
        return found

    out: list[list[BlockId]] = [[] for _ in managers]
    if group.kind == "sliding":
        need = first_manager.blocks_for_window_hit()
        run: list[list[BlockId]] = []  # the current run, rightmost first
        first = 0
        for i in range(max_blocks - 1, -1, -1):
            found = lookup(i)
            if found is None:
                run = []
                continue
            run.append(found)
            first = i
            if len(run) >= need:
                break
        else:
            first = 0
        for k, blocks in enumerate(out):
            blocks.extend([NULL_BLOCK_ID] * first)
            blocks.extend(r[k] for r in reversed(run))
        return out
    start = 0
    if group.kind == "chunked" and max_length > 0:
        start = (max_length - max_length % group.size) // block_size
    for blocks in out:
        blocks.extend([NULL_BLOCK_ID] * start)
    for i in range(start, max_blocks):
        found = lookup(i)
        if found is None:
            break
        for blocks, b in zip(out, found):
            blocks.append(b)
    return out


def _agreed_hit(mgr: KVCacheManager, hashes: tuple[BlockHash, ...], max_length: int) -> tuple[list[list[BlockId]], int]:
    """The hit every group agrees on (vLLM's `HybridKVCacheCoordinator.find_longest_cache_hit`).

    Groups of one attention type are searched together, full attention
    first; each search may only shorten the candidate, and rounds repeat
    until none does (a single round for one full type and one other).
    Full attention's blocks are cut to the agreed length. Cost: O(positions scanned).
    """
    kinds: dict[KVGroup, list[_GroupManager]] = {}
    for m in mgr.managers:
        kinds.setdefault(m.group, []).append(m)
    order = sorted(kinds.items(), key=lambda item: item[0].kind != "full")
    found: dict[int, list[BlockId]] = {}
    length = max_length
    while True:
        candidate = length
        for group, managers in order:
            if group.kind == "full" and managers[0].group_id in found:
                candidate = min(candidate, len(found[managers[0].group_id]) * mgr.block_size)
                continue
            hits = _find_hit(managers, hashes, candidate)
            candidate = len(hits[0]) * mgr.block_size
            found.update(zip((m.group_id for m in managers), hits))
        done = candidate >= length or (len(order) == 2 and order[0][0].kind == "full")
        length = candidate
        if done:
            break
    num_blocks = length // mgr.block_size
    return [found[m.group_id][:num_blocks] for m in mgr.managers], length
