"""The torch KVCacheManager: request block tables over the tensor pool, with real KV memory.

The request-level behaviour is vLLM's KVCacheManager for one full-attention
group, as the spec states it (kvspec.spec.manager): `get_computed_blocks`
finds a new request's cached prefix (at most len - 1 tokens, whole blocks),
`allocate_slots` touches the hit, takes new blocks and registers the blocks a
step fills, `free` releases a request tail first.

What the spec has no notion of is memory. Here every step writes, inside
`allocate_slots`, after the blocks are taken and before the full ones are
registered, the KV of every token it makes resident: positions from the end
of the prefix hit to the step's last token (tokens an external connector
loads included: they land in the same slots). The values come from a
`KVSource`, a function of the request's whole prefix, so two different
prefixes never write the same value and a hit can be checked by reading the
blocks back (`read_kv`). A registered block is sealed with a checksum; a hit
re-computes it, and a block whose content changed (a flipped bit) is
quarantined (TensorBlockPool.quarantine_blocks) and the hit stops before it,
so corrupt KV is never served.

Design choice: the write happens in `allocate_slots`, not in a separate
forward pass, so that the content a block is registered with is the content
it holds; the rejected alternative (register, then write later) would let a
hit in between read a page nobody has written yet.
"""

from __future__ import annotations

import array
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

import torch

from kvspec.gpu_impl.block_pool import TensorBlockPool
from kvspec.gpu_impl.kv_cache import PagedKVCache
from kvspec.spec.errors import InvalidBlock, InvalidRequest
from kvspec.spec.hashing import DEFAULT_HASH_FN, DEFAULT_SEED, MultiModalInput, hash_request_blocks
from kvspec.spec.invariants import check_all
from kvspec.spec.manager import Request
from kvspec.spec.state import BlockHash, BlockId, Snapshot

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
    write_start: int  # the first token position the step writes: its KV follows the prefix hit
    num_tokens: int  # tokens resident once the step has run: hit, external and new included


class TensorKVCacheManager:
    """Block tables of running requests over one `TensorBlockPool`, and the KV memory behind them."""

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
    ) -> None:
        """Build a manager over a fresh pool, with one KV value per token slot.

        Raises:
            InvalidRequest: a size is not a positive integer, the profile or hash function is
                unknown, or the device cannot be used.

        Cost: O(num_gpu_blocks * block_size).
        """
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            raise InvalidRequest(f"block_size must be a positive integer; got block_size={block_size!r}")
        hash_request_blocks((), block_size, hash_fn=hash_fn, seed=seed)  # validates hash_fn
        # The pool owns the blocks; the KV memory is one int64 per token slot.
        self.block_pool = TensorBlockPool(num_gpu_blocks, enable_caching, profile, device, key_capacity)
        self.kv_cache = PagedKVCache(self.block_pool, block_size)
        self.block_size = block_size  # fixed
        self.enable_caching = self.block_pool.enable_caching  # fixed
        self.hash_fn = hash_fn  # fixed
        self.seed = seed  # fixed
        self.kv_source: KVSource = kv_source  # what a step writes; set_kv_source replaces it
        self.req_to_blocks: dict[str, list[BlockId]] = {}  # request id -> block table (append-only)
        self.num_cached_block: dict[str, int] = {}  # request id -> leading blocks registered
        self.num_computed_tokens: dict[str, int] = {}  # request id -> tokens resident so far

    @property
    def device(self) -> torch.device:
        """The device the pool and the KV memory live on."""
        return self.block_pool.device

    def _block_hashes(self, request: Request) -> tuple[BlockHash, ...]:
        return hash_request_blocks(
            request.token_ids, self.block_size, request.lora_name, request.mm_inputs,
            request.cache_salt, self.hash_fn, self.seed,
        )

    def _table(self, block_ids: Sequence[int]) -> torch.Tensor:
        if not block_ids:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        return torch.frombuffer(array.array("q", block_ids), dtype=torch.int64).to(self.device)

    # --- the KV content protocol --------------------------------------------------------------

    def set_kv_source(self, source: KVSource) -> None:
        """Where the values written for resident tokens come from (the harness's model of the KV)."""
        self.kv_source = source

    def read_kv(self, block_ids: Sequence[BlockId]) -> list[list[int]]:
        """The value in every slot of each block, read back from the KV memory on the device.

        Raises:
            InvalidBlock: an id is not a block of this pool.
        """
        return cast("list[list[int]]", self.kv_cache.read_blocks(block_ids).tolist())

    # --- the request level --------------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[list[BlockId], int]:
        """The longest cached, intact prefix of a new request: at most len - 1 tokens, in whole blocks.

        Each hit block's content is checked against the checksum it was sealed
        with; a block that fails is quarantined and the lookup goes on from it
        (another block registered under the same hash may still be intact).

        Raises:
            InvalidRequest: the request has no tokens, misplaced mm_inputs, or is already running.

        Cost: O(tokens) for the hashes, O(1) host work per hit block, one checksum pass over the hit.
        """
        _check_request(request, "get_computed_blocks")
        if request.request_id in self.req_to_blocks:
            raise InvalidRequest(f"get_computed_blocks: request_id={request.request_id!r} is already running")
        if not self.enable_caching:
            return [], 0
        # NOTE: at most len - 1 tokens: the last prompt token must be computed to
        # produce the logits that sample the first output token.
        max_hit_blocks = (len(request.token_ids) - 1) // self.block_size
        hashes = self._block_hashes(request)[:max_hit_blocks]
        hits: list[BlockId] = []
        while True:
            for h in hashes[len(hits):]:
                b = self.block_pool.get_cached_block(h)
                if b is None:
                    break
                hits.append(b)
            num_intact = self._num_intact(hits)
            if num_intact == len(hits):
                return hits, len(hits) * self.block_size
            hits = hits[:num_intact]

    def _num_intact(self, hits: list[BlockId]) -> int:
        """How many leading hit blocks pass their checksum; quarantine every one that fails."""
        if not hits:
            return 0
        ids = self._table(hits)
        intact = self.kv_cache.intact(ids)
        if bool(intact.all()):
            return len(hits)
        self.block_pool.quarantine_blocks(ids[~intact])
        return int(torch.nonzero(~intact)[0])

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Sequence[BlockId] = (),
        num_external_computed_tokens: int = 0,
    ) -> list[BlockId] | None:
        """Give a request slots for its next tokens, write their KV, register the blocks they fill.

        Phases, one method each: validate, plan, prepare the write, touch the
        hits, take new blocks, write, register full blocks. Only validation
        looks at the whole request; the others work on one pool and one block
        table, so several KV cache groups become a loop over them.

        Returns:
            The newly taken blocks, or None (and no change) when too few blocks are free.

        Raises:
            InvalidRequest: a bad count, a hit on a running request, more tokens than the request
                has, misplaced mm_inputs, or a KV source that returns the wrong number of values or
                values beyond int64.
            InvalidBlock: a hit block is not registered under the request's chain.
            NotWritable: a block the step writes is shared or registered; nothing changes.

        Cost: O(new blocks + hit blocks + new tokens) in a constant number of kernels, plus
        hashing of new full blocks.
        """
        step = self._validate_allocation(
            request, num_new_tokens, num_new_computed_tokens, new_computed_blocks, num_external_computed_tokens
        )
        num_to_allocate = self._plan_allocation(step)
        if num_to_allocate is None:
            return None
        values = self._prepare_write(step)
        self._touch_hits(step)
        new_blocks, table_ids = self._take_new_blocks(step, num_to_allocate)
        self._write_step(request.request_id, table_ids, step.write_start, values)
        self._register_full_blocks(step, table_ids)
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
        write_start = num_computed + num_new_computed_tokens
        return _AllocationStep(request, table, new_computed_blocks, hashes, write_start, total)

    def _check_hit_blocks(
        self, request: Request, num_new_computed_tokens: int, new_computed_blocks: Sequence[BlockId]
    ) -> tuple[BlockHash, ...]:
        """The hit covers its tokens in whole blocks, each registered under the request's own chain.

        Returns:
            The request's hash chain (registration needs it too).
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
            # A bool is an int to Python but no block id (as in the spec): True would name block 1.
            in_range = isinstance(b, int) and not isinstance(b, bool) and 0 <= b < pool.num_gpu_blocks
            if not in_range or pool.get_block_hash(b) != hashes[i]:
                raise InvalidBlock(f"allocate_slots: hit block_id={b!r} is not registered under the request's hash {i}")
        return hashes

    def _plan_allocation(self, step: _AllocationStep) -> int | None:
        """Phase 2: how many new blocks the step needs, or None when they do not fit.

        Planned before anything changes, so a step that cannot be served is
        refused whole rather than failing halfway with its hits touched.
        """
        num_required = -(-step.num_tokens // self.block_size)
        num_to_allocate = max(num_required - len(step.table) - len(step.hits), 0)
        pool = self.block_pool
        hit_ids = self._table(step.hits)
        # Hit blocks sitting in the free queue leave it when touched: they use up free blocks too.
        num_evictable_hits = int((pool.ref_cnt[hit_ids] == 0).sum()) if step.hits else 0
        if num_to_allocate + num_evictable_hits > pool.get_num_free_blocks():
            return None
        return num_to_allocate

    def _prepare_write(self, step: _AllocationStep) -> torch.Tensor:
        """Phase 3: the KV values the step writes, once they and the blocks already held to take them are checked.

        Everything that can refuse runs before anything changes: the touch,
        the new blocks and the write come after it.

        Raises:
            InvalidRequest: as `_kv_values`.
            NotWritable: as `_check_held_blocks_writable`.
        """
        values = self._kv_values(step.request, step.write_start, step.num_tokens)
        self._check_held_blocks_writable(step.table, step.write_start, step.num_tokens)
        return values

    def _touch_hits(self, step: _AllocationStep) -> None:
        """Phase 4: take a reference on each hit block, so none is evicted while the request runs.

        Before new blocks are taken: a hit block still in the free queue could
        otherwise be the one they take.
        """
        if step.hits:
            self.block_pool.touch(list(step.hits))

    def _take_new_blocks(self, step: _AllocationStep, num_to_allocate: int) -> tuple[list[BlockId], torch.Tensor]:
        """Phase 5: take the planned blocks and append them, after the hits, to the block table.

        The table only grows while the request runs (append-only, as vLLM's),
        so tokens already scheduled keep their slots.

        Returns:
            The new blocks, and the request's whole block table as a device tensor (what the write reads).
        """
        new_ids = self.block_pool.get_new_blocks_tensor(num_to_allocate)
        new_blocks = cast("list[BlockId]", new_ids.tolist())
        table = step.table + list(step.hits) + new_blocks
        self.req_to_blocks[step.request.request_id] = table
        table_ids = torch.cat((self._table(table[: len(table) - len(new_blocks)]), new_ids))
        return new_blocks, table_ids

    def _register_full_blocks(self, step: _AllocationStep, table_ids: torch.Tensor) -> None:
        """Phase 7: register (cache_full_blocks) and seal every block the step fills, so later requests can hit it.

        Registered after the write (phase 6), so the checksum a block is sealed
        with is of the content it holds.
        """
        rid = step.request.request_id
        # The hit blocks are registered already (that is why they hit).
        num_cached = self.num_cached_block.get(rid, 0) + len(step.hits)
        if self.enable_caching:
            # Only a full block is registered: a partial one's tokens are still to come.
            num_full = min(step.num_tokens, len(step.request.token_ids)) // self.block_size
            if num_full > num_cached:
                self.block_pool.cache_full_blocks(table_ids[num_cached:num_full], step.hashes[num_cached:num_full])
                self.kv_cache.seal(table_ids[num_cached:num_full])
                num_cached = num_full
        self.num_cached_block[rid] = num_cached

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
                f"allocate_slots: the KV source must give int64 values for request_id={request.request_id!r} "
                f"({e})"
            ) from None
        return torch.frombuffer(host, dtype=torch.int64).to(self.device)

    def _check_held_blocks_writable(self, table: list[BlockId], start: int, end: int) -> None:
        """Refuse a step whose first tokens land in a block already held that is not writable.

        Blocks taken by this step are writable by construction; only the
        request's own last block can already hold tokens of the step.

        Raises:
            NotWritable: as PagedKVCache.check_writable.
        """
        if start >= end:
            return
        first, last = start // self.block_size, min((end - 1) // self.block_size, len(table) - 1)
        if first <= last:
            self.kv_cache.check_writable(self._table(table[first : last + 1]))

    def _write_step(self, request_id: str, block_table: torch.Tensor, start: int, values: torch.Tensor) -> None:
        """Phase 6: write a step's KV into its slots through the request's block table (checked for writability)."""
        if values.numel():
            self.kv_cache.write_tokens(block_table, start, values)

    def free(self, request_id: str) -> None:
        """Release a finished or preempted request; its blocks are freed tail first.

        Raises:
            InvalidRequest: request_id is not running.

        Cost: O(blocks of the request) in a constant number of kernels.
        """
        table = self.req_to_blocks.get(request_id)
        if table is None:
            raise InvalidRequest(f"free: request_id={request_id!r} is not running (freed twice?)")
        # Tail first: a request's last blocks are the most specific (least likely
        # to be shared), so they go first in the batch and are evicted first.
        self.block_pool.free_blocks(table[::-1])
        del self.req_to_blocks[request_id]
        del self.num_cached_block[request_id]
        del self.num_computed_tokens[request_id]

    # --- observation --------------------------------------------------------------------------

    def snapshot(self) -> Snapshot:
        """The pool's snapshot with every running request's block table. Cost: O(blocks)."""
        tables = tuple(sorted((rid, tuple(BlockId(b) for b in blocks)) for rid, blocks in self.req_to_blocks.items()))
        return self.block_pool.snapshot(block_tables=tables)

    def check_invariants(self) -> None:
        """Check every state invariant via the spec's predicates, and the pool's own representation.

        Raises:
            InvariantViolation: naming the first invariant that fails.
            AssertionError: the pool's tensors and host map disagree.
        """
        check_all(self.snapshot())
        self.block_pool.check_invariants()
