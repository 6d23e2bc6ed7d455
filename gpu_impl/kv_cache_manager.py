"""The torch KVCacheManager: request block tables over the tensor pool, with real KV memory.

The request-level behaviour is vLLM's KVCacheManager as the spec states it
(kvspec.spec.manager), KV cache groups included: a request has one block
table per group (full attention, a sliding window, chunked local attention;
spec.attention), all over one pool, the null block (id 0) at the positions
a group no longer reads. `get_computed_blocks` finds a new request's cached
prefix (each attention type's search, and with several groups the length
every group agrees on; at most len - 1 tokens), `allocate_slots` frees the
blocks a running request no longer reads, touches the hit, takes new blocks
and registers the blocks a step fills (an asynchronous external load's only
when `cache_blocks` says the load is done), `free` releases a request tail
first, group by group. Every phase runs over every group before the next, so the
pool sees the spec's calls in the spec's order (the free order and the
keyed policies' stamps depend on it). Hit blocks and new blocks cross the
API as one flat list, group by group. The argument checks are the spec's
(`spec.manager.check_request`, `check_lookup`, `check_allocation`,
`check_cache_count`): which mistake is named first is the contract; the hit
search is this module's own.

What the spec has no notion of is memory. Each group's layers have their own
KV (gpu_impl.kv_cache.GroupedKVCache: one store per group; block b names page
b of each, and only the group holding b uses it). Every step writes, inside
`allocate_slots`, after the blocks are taken and before the full ones are
registered, the KV of every token it makes resident, in every group: the
positions from the end of the prefix hit to the step's last token (tokens an
external connector loads included: they land in the same slots), except
those at a group's null positions, which no group writes. The values come
from a `KVSource`, a function of the request's whole prefix, so two
different prefixes never write the same value and a hit can be checked by
reading the blocks back (`read_kv`, each group's blocks from its own store).
A registered block is sealed with a checksum in its group's store; a hit
re-computes it, and a block whose content changed (a flipped bit) is
quarantined (TensorBlockPool.quarantine_blocks) and the hit stops before it,
so corrupt KV is never served.

An asynchronous external load (`delay_cache_blocks=True`) writes its tokens'
KV in its step as any external tokens are (the load's writes land in the
slots the step takes), but registers and seals nothing: no request can hit
the blocks, and no other request can write them (each is held by the loading
request alone and has no hash). `cache_blocks` seals and registers them when
the load is done, so the checksum is of what the load wrote and a hit reads
the request's own prefix. A load that failed partway keeps only its valid
prefix: the KV after it is cleared (0, which no prefix has) and written again
by the steps that recompute those tokens, never into a registered block.

What the manager tells the world (kvspec.spec.events, kvspec.spec.stats):
with `enable_kv_cache_events` its pool publishes vLLM's KV cache events, and
each group that registers blocks in a step publishes one `BlockStored` with
the request's facts (the key of the position before as parent, the tokens,
the block size, the LoRA name, the untagged extra keys, the group index).
A lookup publishes nothing, except where it quarantines a corrupt block:
that block's key leaves the hash table, so its `BlockRemoved` goes out then
(gpu_impl.block_pool's docstring). The hit statistics are always kept, as
running totals in plain ints (a request admitted costs a few additions;
`prefix_cache_stats` builds the spec's value when asked): a request is
counted at its admission, its first step that gets blocks (locally only if
its lookup ran: caching on, a hit limit other than 0), local hits and
the external connector's tokens apart, a preempted request's re-admission
apart from first admissions; a successful reset is counted.

Design choices:
- The write happens in `allocate_slots`, not in a separate forward pass, so
  that the content a block is registered with is the content it holds; the
  rejected alternative (register, then write later) would let a hit in
  between read a page nobody has written yet.
- Everything that can refuse a step (the request, the counts, the hit, the
  KV source's values, the writability of the blocks already held) is checked
  before anything changes, even before the skipped blocks are freed (which
  the spec does also for a step it then refuses for want of free blocks).
- One full-attention group (the default) keeps the single-table lookup: no
  coordinator, no null positions.
"""

from __future__ import annotations

import array
import hashlib
from collections.abc import Callable, Sequence
from typing import cast

import torch

from kvspec.gpu_impl.block_pool import TensorBlockPool
from kvspec.gpu_impl.kv_cache import GroupedKVCache, PagedKVCache
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
from kvspec.spec.stats import CacheCounters, PrefixCacheStats

__all__ = ["KVSource", "TensorKVCacheManager", "prefix_kv_source"]

# The value of the KV of token positions [start, end) of a request: one int per token.
KVSource = Callable[[Request, int, int], Sequence[int]]

_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


def prefix_kv_source(request: Request, start: int, end: int) -> list[int]:
    """A stand-in for a model's KV: token p's value digests the request's keys and tokens 0..p.

    A rolling blake2b over the LoRA name, cache_salt, multimodal inputs and
    every token up to p, as a signed 64-bit integer. Two requests that differ
    anywhere before p (or in their keys) get different values at p, up to
    64-bit collisions. Cost: O(end) per call.

    >>> r = Request("a", (1, 2, 3))
    >>> prefix_kv_source(r, 1, 3) == prefix_kv_source(r, 0, 3)[1:]
    True
    >>> prefix_kv_source(Request("b", (1, 2, 3), cache_salt="t"), 0, 1) != prefix_kv_source(r, 0, 1)
    True
    """
    keys = repr((request.lora_name, request.cache_salt, request.mm_inputs)).encode()
    state = hashlib.blake2b(keys, digest_size=8).digest()
    values: list[int] = []
    for p in range(end):
        state = hashlib.blake2b(state + request.token_ids[p].to_bytes(8, "little", signed=True), digest_size=8).digest()
        if p >= start:
            values.append(int.from_bytes(state, "little", signed=True))
    return values


class _HitCounters:
    """The hit statistics as running totals: one row of six ints per cache, and the resets.

    A row holds `CacheCounters`' fields in their order (requests, queries,
    hits, then the same three for preempted requests), named again only when
    a reader asks for the spec's value; plain ints rather than the frozen
    value, because every admission adds to them and only a reader needs it.
    """

    __slots__ = ("connector", "local", "num_resets")

    def __init__(self) -> None:
        self.local = [0] * 6  # this pool's prefix cache; grown at each admission
        self.connector = [0] * 6  # the external connector, asked for what the local hit left; grown likewise
        self.num_resets = 0  # successful reset_prefix_cache calls

    def admit(self, num_tokens: int, num_local_hits: int, num_external: int, preempted: bool, looked_up: bool) -> None:
        """Count one admitted request: its tokens asked of the local cache (only if its lookup ran: a request
        that skipped it asked the local cache nothing), then the rest asked of the connector."""
        row = 3 if preempted else 0  # a re-admission after preemption recomputes its own blocks: counted apart
        local, connector = self.local, self.connector
        if looked_up:
            local[row] += 1
            local[row + 1] += num_tokens
            local[row + 2] += num_local_hits
        connector[row] += 1
        connector[row + 1] += num_tokens - num_local_hits
        connector[row + 2] += num_external

    def value(self) -> PrefixCacheStats:
        """The totals as the spec's value."""
        return PrefixCacheStats(_as_counters(self.local), _as_counters(self.connector), self.num_resets)


def _as_counters(row: list[int]) -> CacheCounters:
    """A row of `_HitCounters` as the spec's value, each count under its field's name."""
    requests, queries, hits, preempted_requests, preempted_queries, preempted_hits = row
    return CacheCounters(
        requests=requests,
        queries=queries,
        hits=hits,
        preempted_requests=preempted_requests,
        preempted_queries=preempted_queries,
        preempted_hits=preempted_hits,
    )


class _Group:
    """One KV cache group: its attention type, its KV store and its block tables over the shared pool."""

    __slots__ = ("block_size", "group", "group_id", "kv", "num_cached", "skips", "tables")

    def __init__(self, group: KVGroup, group_id: int, kv: PagedKVCache, block_size: int) -> None:
        self.group = group  # the attention type; fixed
        self.group_id = group_id  # its index: part of every hash-table key of its blocks; fixed
        self.kv = kv  # its KV store: page b holds block b's KV while this group holds b
        self.block_size = block_size  # fixed
        self.skips = group.skips  # fixed: whether it ever stops reading a token
        self.tables: dict[str, list[BlockId]] = {}  # request id -> block table; NULL_BLOCK_ID where skipped
        self.num_cached: dict[str, int] = {}  # request id -> leading positions registered (or null)

    def skipped_tokens(self, num_computed: int) -> int:
        """Leading tokens the group no longer reads once `num_computed` tokens are computed. Cost: O(1)."""
        kind, size = self.group.kind, self.group.size
        if kind == "sliding":
            # The next token (position num_computed) reads the W positions ending at itself.
            return num_computed - size + 1 if num_computed >= size else 0
        if kind == "chunked":
            return num_computed - num_computed % size  # the start of the chunk the next token is in
        return 0

    def skipped_blocks(self, num_computed: int) -> int:
        """Leading blocks holding only skipped tokens: the ones the group frees and nulls. Cost: O(1)."""
        return self.skipped_tokens(num_computed) // self.block_size if self.skips else 0

    def key(self, block_hash: BlockHash) -> BlockHash:
        """The hash-table key of this group's block for `block_hash` (spec.state.group_key)."""
        return group_key(block_hash, self.group_id)


class TensorKVCacheManager:
    """Block tables of running requests, one per KV cache group, over one `TensorBlockPool`, and their KV memory."""

    def __init__(
        self,
        num_gpu_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        profile: str = "vllm-v1",
        hash_fn: str = DEFAULT_HASH_FN,
        seed: str = DEFAULT_SEED,
        device: str | torch.device | None = None,
        kv_source: KVSource = prefix_kv_source,
        key_capacity: int | None = None,
        groups: str | Sequence[KVGroup] = (FULL,),
        enable_kv_cache_events: bool = False,
    ) -> None:
        """Build a manager over a fresh pool, with its KV cache groups and one KV value per token slot in each.

        Args:
            groups: the KV cache groups, as `"full,sliding:8"` or `KVGroup` values, in vLLM's
                group order (spec.attention.parse_groups); one full-attention group by default.
            enable_kv_cache_events: the pool publishes KV cache events, drained by `take_events`.

        Raises:
            InvalidRequest: a size is not a positive integer, the profile or hash function is
                unknown, a group is malformed, a chunk is not a multiple of the block size, or
                the device cannot be used.

        Cost: O(num_groups * num_gpu_blocks * block_size).
        """
        self.config = manager_config(block_size, hash_fn, seed, groups)  # fixed: the spec's checks and chain
        kv_groups = self.config.groups
        # The pool owns the blocks; the KV memory is one int64 per token slot, per group.
        self.block_pool = TensorBlockPool(
            num_gpu_blocks, enable_caching, profile, device, key_capacity, enable_kv_cache_events=enable_kv_cache_events
        )
        self.kv_memory = GroupedKVCache(self.block_pool, block_size, len(kv_groups))
        self.kv_cache = self.kv_memory[0]  # group 0's store: the only one with the default single group
        self.block_size = block_size  # fixed
        self.enable_caching = self.block_pool.enable_caching  # fixed
        self.hash_fn = hash_fn  # fixed
        self.seed = seed  # fixed
        self.groups = kv_groups  # fixed
        # What allocate_slots' checks read (spec.manager.check_allocation).
        config, pool = self.config, self.block_pool
        self._view = ManagerView(config, num_gpu_blocks, self.enable_caching, pool.get_block_hash, config.block_hashes)
        self._groups = [_Group(g, i, self.kv_memory[i], block_size) for i, g in enumerate(kv_groups)]  # fixed
        self._single_full = kv_groups == (FULL,)  # fixed: one table, no null positions, no coordinator
        self._skips = any(g.skips for g in kv_groups)  # fixed: some group frees blocks it no longer reads
        # How snapshots name the groups: () for the default single full-attention group, as the spec.
        self._snapshot_groups = () if self._single_full else tuple(str(g) for g in kv_groups)
        self.kv_source: KVSource = kv_source  # what a step writes; set_kv_source replaces it
        self.req_to_blocks = self._groups[0].tables  # group 0's block tables (the only ones by default)
        self.num_computed_tokens: dict[str, int] = {}  # request id -> tokens resident so far
        self._counters = _HitCounters()  # hit statistics since construction; grown by admissions and resets

    @property
    def device(self) -> torch.device:
        """The device the pool and the KV memory live on."""
        return self.block_pool.device

    @property
    def kv_caches(self) -> tuple[PagedKVCache, ...]:
        """Each KV cache group's KV store, in group order."""
        return self.kv_memory.stores

    def block_table(self, request_id: str, group_id: int = 0) -> list[BlockId]:
        """A running request's block table in one group (a copy; NULL_BLOCK_ID where skipped).

        Raises:
            InvalidRequest: request_id is not running, or group_id names no group.
        """
        if not isinstance(group_id, int) or isinstance(group_id, bool) or not 0 <= group_id < len(self._groups):
            raise InvalidRequest(f"group_id={group_id!r} names no KV cache group (0..{len(self._groups) - 1})")
        table = self._groups[group_id].tables.get(request_id)
        if table is None:
            raise InvalidRequest(f"request_id={request_id!r} is not running")
        return list(table)

    def _table(self, block_ids: Sequence[int]) -> torch.Tensor:
        if not block_ids:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        return torch.frombuffer(array.array("q", block_ids), dtype=torch.int64).to(self.device)

    def _check_request(self, request: Request, op: str) -> None:
        check_request(request, op, len(self._groups))

    # --- the KV content protocol --------------------------------------------------------------

    def set_kv_source(self, source: KVSource) -> None:
        """Where the values written for resident tokens come from (the harness's model of the KV)."""
        self.kv_source = source

    def read_kv(self, block_ids: Sequence[BlockId]) -> list[list[int]]:
        """The value in every slot of each block, read back from the KV memory on the device.

        `block_ids` is read as a prefix hit is returned: group by group, each
        group's part as long, part g from group g's store (with one group,
        any list of blocks). A null position (NULL_BLOCK_ID, where a group's
        attention type skips a block) reads as `[]`, an empty page: no group
        ever writes the null block. Every other entry is its page, one value
        per slot, in the order given.

        Raises:
            InvalidBlock: an id is not a block of this pool.
            InvalidRequest: with several groups, the list does not split evenly into them.
        """
        return self.kv_memory.read_groups(block_ids)

    # --- the request level --------------------------------------------------------------------

    def get_computed_blocks(
        self, request: Request, max_cache_hit_length: int | None = None
    ) -> tuple[list[BlockId], int]:
        """The longest cached, intact prefix of a new request every group can serve: at most len - 1 tokens.

        The scheduler may cap the hit further (`max_cache_hit_length`: what an
        external connector lets the local cache serve, 0 included), and so may
        the request (`prefix_cache_hit_limit`; 0: no lookup at all). Each hit
        block's content is checked against the checksum it was sealed with in
        its group's store; a block that fails is quarantined (its key's
        `BlockRemoved` published, with events on) and the lookup goes on
        without it (another block registered under the same hash may still be
        intact).

        Returns:
            The hit blocks, group by group (each group's as many positions, the null block
            where its attention type skips them), and the tokens they cover.

        Raises:
            InvalidRequest: the request has no tokens, misplaced mm_inputs, a bad num_preemptions,
                is already running, or (with several groups) its id contains the table-name mark;
                the cap is not None or a non-negative integer.

        Cost: O(tokens) for the hashes, O(1) host work per position looked up, one checksum
        pass over the hit per group.
        """
        max_length = check_lookup(request, max_cache_hit_length, len(self._groups), self.num_computed_tokens)
        if not self._reads_cache(request):
            return [], 0
        return self._intact_hit(request, max_length)

    def _reads_cache(self, request: Request) -> bool:
        """Whether the request's lookup runs (caching on, a hit limit other than 0); only then is it counted
        in the local hit statistics. Cost: O(1)."""
        return self.enable_caching and request.prefix_cache_hit_limit != 0

    def get_num_cached_tokens(self, request: Request) -> int:
        """How many of a request's tokens are cached: the intact hit within len - 1 tokens, nothing taken.

        vLLM 0.34's probe: bounded by len - 1 alone (a hit limit of 0 aside:
        no lookup, 0), for a running request too. A corrupt block met on the
        way is quarantined, as by any lookup: it is not cached content.

        Raises:
            InvalidRequest: the request has no tokens, misplaced mm_inputs, a bad num_preemptions or hit limit,
                or (with several groups) its id contains the table-name mark.

        Cost: as `get_computed_blocks`.
        """
        self._check_request(request, "get_num_cached_tokens")
        if not self._reads_cache(request):
            return 0
        return self._intact_hit(request, len(request.token_ids) - 1)[1]

    def _intact_hit(self, request: Request, max_length: int) -> tuple[list[BlockId], int]:
        """The intact hit every group agrees on within max_length tokens, corrupt blocks quarantined."""
        if self._single_full:
            return self._full_hit(self.config.block_hashes(request)[: max_length // self.block_size])
        hashes = self.config.block_hashes(request)
        while True:
            per_group, length = self._agreed_hit(hashes, max_length)
            if not self._quarantine_corrupt(per_group):
                return [b for blocks in per_group for b in blocks], length

    def _full_hit(self, hashes: Sequence[BlockHash]) -> tuple[list[BlockId], int]:
        """One full-attention group's hit: cached blocks from the first, each intact."""
        hits: list[BlockId] = []
        while True:
            for h in hashes[len(hits) :]:
                b = self.block_pool.get_cached_block(h)
                if b is None:
                    break
                hits.append(b)
            num_intact = self._num_intact(self.kv_cache, hits)
            if num_intact == len(hits):
                return hits, len(hits) * self.block_size
            hits = hits[:num_intact]

    def _num_intact(self, kv: PagedKVCache, hits: list[BlockId]) -> int:
        """How many leading hit blocks pass their checksum in `kv`; quarantine every one that fails."""
        if not hits:
            return 0
        ids = self._table(hits)
        intact = kv.intact(ids)
        if bool(intact.all()):
            return len(hits)
        self.block_pool.quarantine_blocks(ids[~intact])
        return int(torch.nonzero(~intact)[0])

    def _quarantine_corrupt(self, per_group: list[list[BlockId]]) -> bool:
        """Check every group's hit blocks (null positions hold nothing) in its store; quarantine the corrupt ones.

        Returns:
            Whether any block was quarantined (the hit must then be searched again).
        """
        found = False
        for grp, blocks in zip(self._groups, per_group):
            held = [b for b in blocks if b != NULL_BLOCK_ID]
            if held and self._num_intact(grp.kv, held) < len(held):
                found = True
        return found

    def _agreed_hit(self, hashes: tuple[BlockHash, ...], max_length: int) -> tuple[list[list[BlockId]], int]:
        """The hit every group agrees on, each attention type searched in turn (vLLM's coordinators).

        Groups of one attention type are searched together (a position hits
        only if each of them has it cached), full attention first. Each
        search may only shorten the candidate length; rounds repeat until
        none does (a single round for one full type and one other, whose
        search the full one cannot cut again). Each group's hit is then cut
        to the agreed length.

        Returns:
            Each group's hit blocks and the hit length in tokens.
        """
        block_size = self.block_size
        kinds: dict[KVGroup, list[_Group]] = {}
        for grp in self._groups:
            kinds.setdefault(grp.group, []).append(grp)
        order = sorted(kinds.items(), key=lambda item: item[0].kind != "full")  # stable: full attention first
        found: dict[int, list[BlockId]] = {}
        length = max_length
        while True:
            candidate = length
            for group, members in order:
                if group.kind == "full" and members[0].group_id in found:
                    candidate = min(candidate, len(found[members[0].group_id]) * block_size)
                    continue
                hits = self._type_hit(group, members, hashes, candidate)
                candidate = len(hits[0]) * block_size
                for grp, blocks in zip(members, hits):
                    found[grp.group_id] = blocks
            done = candidate >= length or len(self._groups) == 1 or (len(order) == 2 and order[0][0].kind == "full")
            length = candidate
            if done:
                break
        num_blocks = length // block_size
        return [found[grp.group_id][:num_blocks] for grp in self._groups], length

    def _type_hit(
        self, group: KVGroup, members: list[_Group], hashes: tuple[BlockHash, ...], max_length: int
    ) -> list[list[BlockId]]:
        """One attention type's hit within `max_length` tokens, for each of its groups (`find_longest_cache_hit`).

        - full: the cached blocks from the first, left to right;
        - sliding:W: scanned right to left for a run of cdiv(W - 1, B) cached
          blocks (what the next token's window reads), the null block before
          it; a shorter run that reaches the first block is a hit too;
        - chunked:C: the null block before the chunk that holds position
          max_length, then the cached blocks from there, left to right.

        Cost: O(positions scanned) lookups.
        """
        block_size, lookup = self.block_size, self.block_pool.get_cached_block
        max_blocks = min(max_length // block_size, len(hashes))

        def cached(i: int) -> list[BlockId] | None:
            blocks: list[BlockId] = []
            for grp in members:
                b = lookup(grp.key(hashes[i]))
                if b is None:
                    return None
                blocks.append(b)
            return blocks

        if group.kind == "sliding":
            need = -(-(group.size - 1) // block_size)
            run: list[list[BlockId]] = []  # the current run of cached positions, rightmost first
            first = 0
            for i in range(max_blocks - 1, -1, -1):
                blocks = cached(i)
                if blocks is None:
                    run = []
                    continue
                run.append(blocks)
                first = i
                if len(run) >= need:
                    break
            else:  # no whole window cached: only a run that reaches the first block is a hit
                first = 0
            return [[NULL_BLOCK_ID] * first + [r[k] for r in reversed(run)] for k in range(len(members))]
        start = 0
        if group.kind == "chunked" and max_length > 0:
            start = (max_length - max_length % group.size) // block_size
        out: list[list[BlockId]] = [[NULL_BLOCK_ID] * start for _ in members]
        for i in range(start, max_blocks):
            blocks_at = cached(i)
            if blocks_at is None:
                break
            for hit, b in zip(out, blocks_at):
                hit.append(b)
        return out

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Sequence[BlockId] = (),
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
    ) -> list[BlockId] | None:
        """Give a request slots for its next tokens, write their KV, register the blocks they fill.

        Phases, one method each, every one after validation a loop over the
        groups that ends before the next begins (as the spec and vLLM's
        coordinator): validate, prepare the write, free skipped blocks (a
        running request's; even when the step is then refused), plan, touch
        the hits, take blocks for external tokens, take blocks for new
        tokens, write, register full blocks. A request's first step that is
        served is its admission, counted in the hit statistics then (a step
        refused for want of blocks is retried by the scheduler, and counted
        once, when it is served).

        `delay_cache_blocks`: an asynchronous external load (a first step with
        external tokens; `num_new_tokens` may then be 0). The step takes the
        blocks and writes the loaded tokens' KV as any step writes external
        tokens (the load's writes), but registers nothing: no request can hit
        a block before the load is done, when `cache_blocks` seals and
        registers them.

        With events on, the step publishes what its pool calls do, in order:
        a `BlockRemoved` per cached key a taken block loses, then one
        `BlockStored` per group that registers blocks (none for a delayed load).

        Returns:
            The newly taken blocks, group by group in table order, or None (nothing taken or
            touched; skipped blocks freed all the same) when too few blocks are free.

        Raises:
            InvalidRequest: a bad count, no token scheduled without a delayed load, a delay that is
                not a bool or has no external tokens, a hit on a running request, more tokens than
                the request has, misplaced mm_inputs, a request id with the table-name mark (several
                groups), or a KV source that returns the wrong number of values or values beyond int64.
            InvalidBlock: a hit block is not registered under the request's chain in its group.
            NotWritable: a block the step writes is shared or registered; nothing changes.

        Cost: O(new blocks + hit blocks + new tokens) in a constant number of kernels per group,
        plus hashing of new full blocks.
        """
        step = check_allocation(
            self._view, self.num_computed_tokens, request, num_new_tokens, num_new_computed_tokens,
            new_computed_blocks, num_external_computed_tokens, delay_cache_blocks,
        )  # fmt: skip
        starts, values = self._prepare_write(step)
        if step.running and self._skips:
            self._free_skipped_blocks(step)
        if not self._fits(step):
            return None
        return self._serve_allocation(step, starts, values)

    def _serve_allocation(self, step: AllocationStep, starts: list[int], values: torch.Tensor) -> list[BlockId]:
        """Phases 5 to 9 of a step that fits: touch, take, write, register; then record the step.

        `starts` and `values` are phase 2's: each group's first written
        position, and the KV values the step writes.

        Returns:
            The newly taken blocks, group by group in table order.
        """
        tables, num_cached = self._touch_hits(step)
        new_blocks = self._take_external_blocks(step, tables)
        table_ids = self._take_new_blocks(step, tables, new_blocks)
        self._write_groups(step, table_ids, starts, values)
        if step.delay_cache_blocks:  # registered by cache_blocks once the load is done
            rid = step.request.request_id
            for grp, cached in zip(self._groups, num_cached):
                grp.num_cached[rid] = cached
        else:
            self._register_full_blocks(step, tables, num_cached, table_ids)
        self._record_step(step)
        return new_blocks[0] if len(new_blocks) == 1 else [b for blocks in new_blocks for b in blocks]

    def _write_start(self, grp: _Group, step: AllocationStep) -> int:
        """The first position the step writes in a group: after the hit, and past the group's null positions.

        A step writes the positions from `step.num_local_computed` on: after its prefix hit (or its earlier
        steps), its external tokens included.

        A group's null positions are its leading `skipped_blocks(num_computed)`
        ones (a running request's were nulled by earlier steps and this one's
        phase 3; a first step's are nulled as its hit is touched); on a first
        step with external tokens they can cover some of the step's positions,
        which that group then does not write. A running request can have more:
        `cache_blocks` may take its computed count back below a window it had
        already slid past (a failed load), and a null position is never written.
        """
        if not grp.skips:
            return step.num_local_computed
        first = grp.skipped_blocks(step.num_computed)
        if step.running:
            first = self._leading_nulls(grp.tables[step.request.request_id], first)
        return max(step.num_local_computed, first * self.block_size)

    @staticmethod
    def _leading_nulls(table: list[BlockId], at_least: int) -> int:
        """How many leading positions of a table are null, or `at_least` if fewer (they are to be nulled).

        A table's null positions are always its leading ones, so the count is
        found by looking past `at_least`. Cost: O(1) unless a computed count was
        taken back, then O(null positions past it).
        """
        n = at_least
        while n < len(table) and table[n] == NULL_BLOCK_ID:
            n += 1
        return n

    def _prepare_write(self, step: AllocationStep) -> tuple[list[int], torch.Tensor]:
        """Phase 2: where and what the step writes, once the values and the blocks held to take them are checked.

        Everything that can refuse runs before anything changes: the freeing
        of skipped blocks, the touch, the new blocks and the write come after
        it.

        Returns:
            Each group's first written position (`_write_start`), and the KV values the step writes.

        Raises:
            InvalidRequest: as `_kv_values`.
            NotWritable: as `_check_held_blocks_writable`.
        """
        starts = [self._write_start(grp, step) for grp in self._groups]
        values = self._kv_values(step.request, step.num_local_computed, step.num_tokens)
        if step.running:
            rid = step.request.request_id
            for grp, start in zip(self._groups, starts):
                self._check_held_blocks_writable(grp, grp.tables[rid], start, step.num_tokens)
        return starts, values

    def _free_skipped_blocks(self, step: AllocationStep) -> None:
        """Phase 3: a running request frees, in every group, the blocks it no longer reads (`remove_skipped_blocks`).

        Counted from the tokens computed before this step (the window of its
        first new token); each freed block becomes the null block in the
        table, and the group's freed blocks go to `free_blocks` in one call,
        last first, as a finished request's do. The walk stops at a null
        position: everything before it went in an earlier step.
        """
        rid = step.request.request_id
        for grp in self._groups:
            if not grp.skips:
                continue
            table = grp.tables[rid]
            freed: list[BlockId] = []
            for i in range(min(grp.skipped_blocks(step.num_computed), len(table)) - 1, -1, -1):
                if table[i] == NULL_BLOCK_ID:
                    break
                freed.append(table[i])
                table[i] = NULL_BLOCK_ID
            if freed:
                self.block_pool.free_blocks(freed)

    def _fits(self, step: AllocationStep) -> bool:
        """Phase 4: whether every group's new blocks fit in the free blocks (vLLM's `get_num_blocks_to_allocate`).

        Planned before anything is taken or touched, so a step that cannot be
        served is refused whole rather than failing halfway with its hits
        touched. A group needs a block for every position up to the step's
        last token except those it already has (or, on a first step, skips
        or hits); hit blocks sitting in the free queue leave it when touched,
        so they use up free blocks too.
        """
        pool, rid = self.block_pool, step.request.request_id
        num_required = -(-step.num_tokens // self.block_size)
        needed = 0
        for grp, hits in zip(self._groups, step.hits):
            if step.running:
                needed += max(num_required - len(grp.tables[rid]), 0)
                continue
            skipped = grp.skipped_blocks(step.num_computed)
            needed += max(num_required - max(skipped, len(hits)), 0)
            kept = hits[skipped:] if skipped else hits
            if kept:
                needed += sum(1 for b in kept if pool.get_ref_cnt(b) == 0)  # the host face: no wait
        return needed <= pool.get_num_free_blocks()

    def _touch_hits(self, step: AllocationStep) -> tuple[list[list[BlockId]], list[int]]:
        """Phase 5: take a reference on each hit block a group still reads, so none is evicted while the request runs.

        A first step only, every group's before any block is taken: a hit
        block still in the free queue could otherwise be the one they take.
        The positions the request skips from the start become the null block.

        Returns:
            Each group's block table (a running request's own, to be extended in place), and
            how many leading positions of each are registered (or null).
        """
        rid = step.request.request_id
        if step.running:
            return [grp.tables[rid] for grp in self._groups], [grp.num_cached[rid] for grp in self._groups]
        tables: list[list[BlockId]] = []
        for grp, hits in zip(self._groups, step.hits):
            skipped = grp.skipped_blocks(step.num_computed)
            kept = list(hits[skipped:] if skipped else hits)
            if kept:
                self.block_pool.touch(kept)
            tables.append([NULL_BLOCK_ID] * skipped + kept if skipped else kept)
        return tables, [len(t) for t in tables]

    def _take_external_blocks(self, step: AllocationStep, tables: list[list[BlockId]]) -> list[list[BlockId]]:
        """Phase 6: blocks for the tokens an external KV cache loads, in every group that still reads some of them.

        A first step only, after every group's hits are touched. A group that
        skips every computed token (a chunk boundary) takes none for them.

        Returns:
            Each group's blocks taken (its table extended by them).
        """
        taken: list[list[BlockId]] = [[] for _ in self._groups]
        num_external = step.num_external
        if num_external == 0:
            return taken
        num_blocks = -(-step.num_computed // self.block_size)
        for grp, table, new in zip(self._groups, tables, taken):
            skipped_tokens = grp.skipped_tokens(step.num_computed)
            if skipped_tokens and min(step.num_computed - skipped_tokens, num_external) <= 0:
                continue
            count = max(0, num_blocks - len(table))
            if count:
                new += self.block_pool.get_new_blocks(count)
                table += new
        return taken

    def _take_new_blocks(
        self, step: AllocationStep, tables: list[list[BlockId]], new_blocks: list[list[BlockId]]
    ) -> list[torch.Tensor]:
        """Phase 7: take the blocks the step's tokens need and append them, group by group.

        The table only grows while the request runs (as vLLM's, the null
        block standing in for a freed position), so tokens already scheduled
        keep their slots.

        Returns:
            Each group's whole block table as a device tensor (what the write reads); `tables`
            and `new_blocks` are extended by the blocks taken.
        """
        num_required = -(-step.num_tokens // self.block_size)
        rid = step.request.request_id
        table_ids: list[torch.Tensor] = []
        for grp, table, new in zip(self._groups, tables, new_blocks):
            new_ids = self.block_pool.get_new_blocks_tensor(max(num_required - len(table), 0))
            held = self._table(table)
            if new_ids.numel():
                taken = cast("list[BlockId]", new_ids.tolist())
                table += taken
                new += taken
                held = torch.cat((held, new_ids))
            table_ids.append(held)
            grp.tables[rid] = table
        return table_ids

    def _write_groups(
        self, step: AllocationStep, table_ids: list[torch.Tensor], starts: list[int], values: torch.Tensor
    ) -> None:
        """Phase 8: write the step's KV in every group, each from its first written position on."""
        rid = step.request.request_id
        for grp, ids, start in zip(self._groups, table_ids, starts):
            group_values = values[start - step.num_local_computed :] if start > step.num_local_computed else values
            if grp.group_id == 0:
                self._write_step(rid, ids, start, group_values)
            else:
                self._write_group(grp.group_id, ids, start, group_values)

    def _write_step(self, request_id: str, block_table: torch.Tensor, start: int, values: torch.Tensor) -> None:
        """Phase 8 in group 0 (the only group by default): write the step's KV through its block table.

        Its own method, so that a subclass can change where a step's KV lands
        in memory (the memory mutants do); `_write_group` writes the others.
        """
        if values.numel():
            self.kv_cache.write_tokens(block_table, start, values)

    def _write_group(self, group_id: int, block_table: torch.Tensor, start: int, values: torch.Tensor) -> None:
        """Phase 8: write a step's KV into a group's store, through its block table (checked for writability).

        `start` is past the group's null positions (`_write_start`): no write lands in the null block.
        """
        if values.numel():
            self._groups[group_id].kv.write_tokens(block_table, start, values)

    def _register_full_blocks(
        self,
        step: AllocationStep,
        tables: list[list[BlockId]],
        num_cached: list[int],
        table_ids: list[torch.Tensor] | None = None,
    ) -> None:
        """Phase 9: register (cache_full_blocks) and seal every block the step fills, so later requests can hit it.

        Registered after the write (phase 8), so the checksum a block is
        sealed with is of the content it holds, in its group's store. Group
        g's blocks are keyed by (hash, g) (spec.state.group_key), so groups
        never share a block. A null position holds nothing and is left out,
        as the spec does (the group's `BlockStored` is published all the same,
        even with no block); it is only ever among the new positions when a
        step before registered nothing (a delayed load that also computed
        tokens, its window slid since). `table_ids` are the tables as device
        tensors where the step has them (the write read them); else the
        blocks are sent from `tables`.
        """
        rid = step.request.request_id
        if self.enable_caching:
            # Only a full block is registered: a partial one's tokens are still to come.
            num_full = min(step.num_tokens, len(step.request.token_ids)) // self.block_size
            publishes = self.block_pool.kv_event_queue is not None
            for g, (grp, table, cached) in enumerate(zip(self._groups, tables, num_cached)):
                if num_full <= cached:
                    continue
                positions: Sequence[int] = range(cached, num_full)
                chain: Sequence[BlockHash] = step.hashes[cached:num_full]
                if grp.skips and NULL_BLOCK_ID in table[cached:num_full]:
                    positions = [i for i in positions if table[i] != NULL_BLOCK_ID]
                    chain = [step.hashes[i] for i in positions]
                    full = self._table([table[i] for i in positions])
                elif table_ids is not None:
                    full = table_ids[g][cached:num_full]
                else:
                    full = self._table(table[cached:num_full])
                keys = chain if g == 0 else [grp.key(h) for h in chain]
                stored = self._stored(step, grp, cached, num_full, positions, keys) if publishes else None
                self.block_pool.cache_full_blocks(full, keys, stored)
                grp.kv.seal(full)
                num_cached[g] = num_full
        for grp, cached in zip(self._groups, num_cached):
            grp.num_cached[rid] = cached

    def _stored(
        self,
        step: AllocationStep,
        grp: _Group,
        num_cached: int,
        num_full: int,
        positions: Sequence[int],
        keys: Sequence[BlockHash],
    ) -> BlockStored:
        """The `BlockStored` of one group registering positions [num_cached, num_full), as vLLM's pool builds it.

        Its parent is the key of the position before in the same group (None
        from the first block), named even where that position is null or its
        key was evicted since: vLLM names it all the same. The tokens are every
        new position's; the extra keys those of the registered (non-null)
        `positions`, as the spec's. Cost: O(new full blocks).
        """
        request, block_size = step.request, self.block_size
        return BlockStored(
            block_hashes=tuple(keys),
            parent_block_hash=grp.key(step.hashes[num_cached - 1]) if num_cached else None,
            token_ids=request.token_ids[num_cached * block_size : num_full * block_size],
            block_size=block_size,
            lora_name=request.lora_name,
            extra_keys=event_extra_keys(
                positions, block_size, request.lora_name, request.mm_inputs, request.cache_salt
            ),
            group_idx=grp.group_id,
        )

    def _record_step(self, step: AllocationStep) -> None:
        """The bookkeeping of a served step: the request's computed tokens, and its admission on a first step.

        A first step served is the admission the hit statistics count (a step
        refused for want of blocks is retried, and counted once, when served).
        """
        request = step.request
        self.num_computed_tokens[request.request_id] = step.num_tokens
        if not step.running:
            # On a first step, the tokens computed here are its local hit: nothing was computed before it.
            local_hit, preempted = step.num_local_computed, request.num_preemptions > 0
            self._counters.admit(
                len(request.token_ids), local_hit, step.num_external, preempted, self._reads_cache(request)
            )

    def _kv_values(self, request: Request, start: int, end: int) -> torch.Tensor:
        """The source's values for positions [start, end), checked, as an int64 device tensor.

        Raises:
            InvalidRequest: the source returned the wrong number of values, or non-int64 ones.
        """
        if start >= end:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        values = self.kv_source(request, start, end)
        if len(values) != end - start:
            raise InvalidRequest(
                f"allocate_slots: the KV source gave {len(values)} values for positions [{start}, {end}) "
                f"of request_id={request.request_id!r}; one per token was expected"
            )
        try:
            if set(map(type, values)) != {int}:
                raise TypeError(f"values of types {sorted({type(v).__name__ for v in values})}")
            host = array.array("q", values)
        except (TypeError, OverflowError) as e:
            raise InvalidRequest(
                f"allocate_slots: the KV source must give int64 values for request_id={request.request_id!r} ({e})"
            ) from None
        return torch.frombuffer(host, dtype=torch.int64).to(self.device)

    def _check_held_blocks_writable(self, grp: _Group, table: list[BlockId], start: int, end: int) -> None:
        """Refuse a step whose first tokens land in a block a group already holds that is not writable.

        Blocks taken by this step are writable by construction; only the
        request's own last block can already hold tokens of the step.

        Raises:
            NotWritable: as PagedKVCache.check_writable.
        """
        if start >= end:
            return
        first, last = start // self.block_size, min((end - 1) // self.block_size, len(table) - 1)
        if first <= last:
            grp.kv.check_writable(self._table(table[first : last + 1]))

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register a running request's blocks full up to `num_computed_tokens`: an asynchronous load is done.

        vLLM's `KVCacheManager.cache_blocks`, called by the scheduler when a
        load that `allocate_slots(..., delay_cache_blocks=True)` started is
        done. The load's KV was written by that step; each block is sealed now,
        as it is registered, with the content it holds, and with events on each
        group that registers publishes its `BlockStored`. A load that failed
        partway gives fewer tokens than were computed: the request's computed
        count goes back to it (never below what it has registered), and the KV
        of the tokens after it is cleared (0, no prefix's value: the load did
        not deliver it), so the step that computes them again writes them, into
        blocks no request can hit yet (a group's registered positions all lie
        before the count).

        Raises:
            InvalidRequest: the request is not running, or (after its own checks, as every
                operation's) the count is not an integer between its registered and its
                computed tokens.

        Cost: O(tokens) to hash the request, O(1) host work per block registered, and one
        write per group of a failed load's tokens.
        """
        self._check_request(request, "cache_blocks")
        rid = request.request_id
        computed = self.num_computed_tokens.get(rid)
        if computed is None:
            raise InvalidRequest(f"cache_blocks: request_id={rid!r} is not running")
        num_cached = [grp.num_cached[rid] for grp in self._groups]
        check_cache_count(rid, num_computed_tokens, computed, max(num_cached) * self.block_size)
        n = num_computed_tokens
        if n < computed:
            self._clear_tokens(rid, n, computed)
        if self.enable_caching:
            step = AllocationStep(
                request=request,
                running=True,
                hits=(),
                hashes=self.config.block_hashes(request),
                num_computed=n,
                num_local_computed=n,
                num_tokens=n,
                delay_cache_blocks=False,
            )
            self._register_full_blocks(step, [grp.tables[rid] for grp in self._groups], num_cached)
        self.num_computed_tokens[rid] = n

    def _clear_tokens(self, request_id: str, start: int, end: int) -> None:
        """Zero the KV of a running request's positions [start, end) in every group (a failed load's tokens).

        Null positions are passed over (no group writes the null block). The
        blocks are checked in every group before any is written, so a refusal
        (NotWritable, which no caller can bring about: every position from a
        registered count on is in a block the request took and holds alone)
        changes nothing.
        """
        bs, spans = self.block_size, []
        for grp in self._groups:
            table = grp.tables[request_id]
            first = max(start, self._leading_nulls(table, grp.skipped_blocks(start)) * bs)
            if first < end:
                ids = self._table(table[first // bs : -(-end // bs)])
                grp.kv.check_writable(ids)
                spans.append((grp.kv, ids, first % bs, end - first))
        for kv, ids, offset, num_tokens in spans:
            kv.write_tokens(ids, offset, torch.zeros(num_tokens, dtype=torch.int64, device=self.device))

    def free(self, request_id: str) -> None:
        """Release a finished or preempted request: each group's blocks tail first, group by group.

        One `free_blocks` call per group in group order, as vLLM's coordinator
        frees its managers; null positions hold nothing and are passed over.

        Raises:
            InvalidRequest: request_id is not running.

        Cost: O(blocks of the request) in a constant number of kernels per group.
        """
        if request_id not in self.num_computed_tokens:
            raise InvalidRequest(f"free: request_id={request_id!r} is not running (freed twice?)")
        # Tail first: a request's last blocks are the most specific (least likely
        # to be shared), so they go first in the batch and are evicted first.
        for grp in self._groups:
            table = grp.tables.pop(request_id)
            del grp.num_cached[request_id]
            held = [b for b in reversed(table) if b != NULL_BLOCK_ID] if grp.skips else table[::-1]
            if held:
                self.block_pool.free_blocks(held)
        del self.num_computed_tokens[request_id]

    def evict_blocks(self, block_ids: Sequence[BlockId]) -> None:
        """Drop the cached hash of each block, held or free (vLLM's `KVCacheManager.evict_blocks`).

        The external connector reports blocks whose load failed: their content
        is not what their hash says, so no request may hit them again, but
        whoever holds them keeps them (a request's table is append-only, and
        its count of registered positions stays: the spec's). A hit search
        then stops at the hole. Blocks without a hash are left alone; with
        events on, each hash dropped publishes a `BlockRemoved`.

        Raises:
            InvalidBlock: an id is out of range or the null block.
            InvalidRequest: an id is named twice.

        Cost: O(len(block_ids)), as TensorBlockPool.evict_blocks.
        """
        self.block_pool.evict_blocks(block_ids)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash if no block is held, and count the reset; refuse (False) otherwise.

        A refusal changes nothing and counts nothing; with events on, a reset
        publishes `AllBlocksCleared`.

        Cost: O(num_gpu_blocks).
        """
        if not self.block_pool.reset_prefix_cache():
            return False
        self._counters.num_resets += 1
        return True

    def prefix_cache_stats(self) -> PrefixCacheStats:
        """The hit statistics since the manager was built (kvspec.spec.stats). Cost: O(1)."""
        return self._counters.value()

    def take_events(self) -> list[KVCacheEvent]:
        """The KV cache events published since the last call (none with events off). Cost: O(1)."""
        return self.block_pool.take_events()

    # --- observation --------------------------------------------------------------------------

    def snapshot(self) -> Snapshot:
        """The pool's snapshot with every running request's block tables, named by table_name, and the groups.

        Cost: O(blocks).
        """
        tables = tuple(sorted(
            (table_name(rid, grp.group_id), tuple(blocks)) for grp in self._groups for rid, blocks in grp.tables.items()
        ))  # fmt: skip
        return self.block_pool.snapshot(block_tables=tables, kv_groups=self._snapshot_groups)

    def check_invariants(self) -> None:
        """Check every state invariant via the spec's predicates, and the pool's own representation.

        Raises:
            InvariantViolation: naming the first invariant that fails.
            AssertionError: the pool's tensors and host map disagree.
        """
        check_all(self.snapshot())
        self.block_pool.check_invariants()
