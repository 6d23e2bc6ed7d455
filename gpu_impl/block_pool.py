"""The torch BlockPool: ref counts, hash flags and the free order as device tensors.

Same observable behaviour as vLLM's BlockPool under the `vllm-v1` and
`vllm-v1-tail` profiles (the same block ids in the same order, the same error
type for the same bad input, state unchanged after an error), with every
per-block update of a request done as one batched tensor operation:
`get_new_blocks(n)` is one selection of the n smallest free keys
(gpu_impl.free_queue; lemma 6, the key encoding, is why that is vLLM's order),
`free_blocks` and `touch` of a whole request are a gather, a scatter and a
queue batch each.

Design choice, the hash-to-blocks map: a host dict beside the tensors, and a
flag per block, `has_hash`, on the device. Block hashes are bytes made on the
host (sha256 over the tokens), every lookup's answer is needed on the host (it
becomes the request's block table), and `get_cached_block` is asked one hash
at a time. The rejected alternative, a device table (64-bit fingerprints in a
sorted tensor, looked up with `searchsorted`), pays a copy to the device and a
read back per lookup. Measured with `kvspec bench gpu` (its second table) on
one CPU core, torch 2.13, 1e6 registered hashes: one lookup takes 0.13 us in
the dict and 17 us in the device table; a 1e3-hash chain looked up as one
batch costs 0.38 ms in the device table against 0.32 ms for 1e3 dict lookups.
Even batched the device table only breaks even, before it pays for
registering blocks (a re-sort, or a probing kernel) and for checking the full
hash behind a fingerprint match; on CUDA each lookup also waits for the
device.

The map is kept lazily, so that eviction stays a batched device operation:
taking (or evicting) a block clears its flag and nothing else; its entry in
the dict goes stale. The flags are mirrored on the host in a bytearray (on the
CPU, the flag tensor is that bytearray), so a lookup skips a stale entry in
O(1) and drops it; re-registering the block drops its stale entry too. An
eager map would delete two dict entries per evicted block: measured, 2.7 us
per block in a 1e6-block pool (cache misses), which made a 1e5-block
`get_new_blocks` as slow as the reference however fast the device is.

Corrupt blocks (seed 002): `quarantine_blocks` takes a block whose KV content
failed its checksum out of circulation. A free one leaves the free queue at
once; a held one loses its hash at once and is quarantined when its last
holder frees it. A quarantined block is never free, hashed, held or reused,
and the snapshot lists it (`Snapshot.quarantined`, checked by
inv_quarantine_isolated and inv_conservation).

Bad input: every argument is checked before anything changes. The fast checks
only detect that something is wrong (types, range, duplicates: on the host for
a short list, on the device for a long one); the diagnosis then walks the ids
in order exactly as the spec does, so the error type and the block named are
the spec's.
"""

from __future__ import annotations

import array
from collections.abc import Callable, Sequence
from typing import cast

import torch

from kvspec.gpu_impl.device import pick_device
from kvspec.gpu_impl.free_queue import KeyedFreeQueue
from kvspec.gpu_impl.sizing import DEFAULT_MARGIN, CapacityPlan, KVLayout, device_free_memory, plan_capacity
from kvspec.spec.errors import (
    AlreadyCached,
    DoubleFree,
    InvalidBlock,
    InvalidRequest,
    PoolExhausted,
)
from kvspec.spec.invariants import check_all
from kvspec.spec.ordering import profile_rule
from kvspec.spec.state import NULL_BLOCK_ID, BlockHash, BlockId, Snapshot, canonical_hash_to_blocks

__all__ = ["BlockIds", "TensorBlockPool"]

# A batch of block ids: a Python sequence (what vLLM's callers pass), or a 1-D
# integer tensor (a caller that already holds the ids on the device).
BlockIds = Sequence[BlockId] | torch.Tensor

# Up to this many ids, checks and small reads run on the host (Python over a
# short list beats the ~2 us a torch operator costs); beyond it, on the device
# (a constant number of kernels, no per-id Python work). Measured crossover on
# the CPU: a few hundred ids.
_HOST_CHECK_MAX = 256


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class TensorBlockPool:
    """A pool of `num_gpu_blocks` KV blocks with prefix caching, its state in device tensors."""

    def __init__(
        self,
        num_gpu_blocks: int,
        enable_caching: bool = True,
        profile: str = "vllm-v1",
        device: str | torch.device | None = None,
        key_capacity: int | None = None,
    ) -> None:
        """Build the pool on a device; block 0 becomes the null block.

        Args:
            num_gpu_blocks: blocks in the pool, the null block included.
            enable_caching: prefix caching on or off.
            profile: the ordering rule (kvspec.spec.ordering.PROFILES).
            device: where the tensors live; None picks (gpu_impl.device.pick_device).
            key_capacity: the free queue's key index length (None: the default; tests
                pass a small one to force relabels).

        Raises:
            InvalidRequest: num_gpu_blocks is not an integer >= 1, the profile is unknown,
                or the device cannot be used.

        Cost: O(num_gpu_blocks).
        """
        if not _is_int(num_gpu_blocks) or num_gpu_blocks < 1:
            raise InvalidRequest(
                "num_gpu_blocks must be an integer >= 1 (block 0 is the null block); "
                f"got num_gpu_blocks={num_gpu_blocks!r}"
            )
        try:
            rule = profile_rule(profile)
        except ValueError as e:
            raise InvalidRequest(str(e)) from None
        self.device = pick_device(device)  # fixed
        self.num_gpu_blocks = num_gpu_blocks  # fixed
        self.enable_caching = bool(enable_caching)  # fixed
        self.profile = profile  # fixed: the ordering rule it claims
        self._unhashed_to_left = rule.unhashed_to_left  # fixed, read on every free
        self._on_host = self.device.type == "cpu"  # fixed: no copies between host and device
        n, dev = num_gpu_blocks, self.device
        # NOTE: the null block's ref_cnt stays 0 and it is never queued: it is a
        # placeholder for slots that need no memory, never handed out or freed.
        self.ref_cnt = torch.zeros(n, dtype=torch.int32, device=dev)  # requests holding each block
        # Whether each block is registered in the hash table: the truth the map
        # below is read through. _hash_flags is its host mirror (one byte per
        # block, read by Python in O(1)); on the CPU the two share memory.
        self._hash_flags = bytearray(n)
        self._host_has_hash = torch.frombuffer(self._hash_flags, dtype=torch.bool)
        self.has_hash = self._host_has_hash if self._on_host else torch.zeros(n, dtype=torch.bool, device=dev)
        self.is_corrupt = torch.zeros(n, dtype=torch.bool, device=dev)  # held, found corrupt: quarantine on free
        self.free_block_queue = KeyedFreeQueue(n, dev, key_capacity)  # the eviction order
        # The hash map (host, see the module docstring): hash -> the blocks
        # registered under it, in registration order (a dict used as an ordered
        # set: the first live one is what a hit returns). Entries of blocks whose
        # flag is clear are stale: skipped, and dropped when met.
        self.cached_block_hash_to_block: dict[BlockHash, dict[int, None]] = {}
        self._registered_hash: dict[int, BlockHash] = {}  # block -> the hash it was last registered under
        self.quarantined: dict[int, None] = {}  # blocks found corrupt, in the order they were retired
        self._num_corrupt_held = 0  # blocks with is_corrupt set (all held)
        self._scratch = torch.empty(n, dtype=torch.int64, device=dev)  # duplicate detection for long batches
        self._ones = torch.ones(n, dtype=torch.int32, device=dev)  # increments for ref_cnt.index_add_
        self._no_blocks = torch.empty(0, dtype=torch.int64, device=dev)
        self.capacity_plan: CapacityPlan | None = None  # set when the pool was sized from memory

    @classmethod
    def from_memory(
        cls,
        layout: KVLayout,
        gpu_mem: int | None = None,
        weights: int = 0,
        overhead: int = 0,
        margin: float = DEFAULT_MARGIN,
        enable_caching: bool = True,
        profile: str = "vllm-v1",
        device: str | torch.device | None = None,
    ) -> TensorBlockPool:
        """A pool sized by seed 002's rule (gpu_impl.sizing.plan_capacity) for a model's KV layout.

        Args:
            layout: what one block holds.
            gpu_mem: the memory budget in bytes; None reads the free memory of the (CUDA) device.
            weights: bytes deducted for the model weights.
            overhead: bytes deducted for the runtime.
            margin: the fraction of what is left that stays free.
            enable_caching: prefix caching on or off.
            profile: the ordering rule.
            device: where the pool lives; None picks.

        Returns:
            The pool; `capacity_plan` holds the computation.

        Raises:
            InvalidRequest: a bad size (see plan_capacity), or no gpu_mem and no CUDA device.
        """
        dev = pick_device(device)
        if gpu_mem is None:
            memory, source = device_free_memory(str(dev))
        else:
            memory, source = gpu_mem, "gpu_mem"
        plan = plan_capacity(layout, memory, weights, overhead, margin, source)
        pool = cls(plan.num_gpu_blocks, enable_caching, profile, dev)
        pool.capacity_plan = plan
        return pool

    # --- argument checks ------------------------------------------------------------------

    def _index(self, block_ids: BlockIds, op: str) -> torch.Tensor:
        """The ids as an int64 device tensor, after checking them (ints, in range, not null, distinct).

        Raises:
            InvalidBlock, InvalidRequest: as `_diagnose_ids`.
        """
        if isinstance(block_ids, torch.Tensor):
            if block_ids.dim() != 1 or block_ids.dtype.is_floating_point or block_ids.dtype == torch.bool:
                raise InvalidRequest(
                    f"{op}: block_ids must be a 1-D integer tensor; got dtype={block_ids.dtype} "
                    f"shape={tuple(block_ids.shape)}"
                )
            ids = block_ids.to(device=self.device, dtype=torch.int64)
            if 0 < ids.numel() <= _HOST_CHECK_MAX:
                host_ids = cast("list[int]", ids.tolist())
                if min(host_ids) < 1 or max(host_ids) >= self.num_gpu_blocks or len(set(host_ids)) != len(host_ids):
                    self._diagnose_ids(host_ids, op)
            elif ids.numel():
                self._check_on_device(ids, op, ids.tolist)
            return ids
        n = len(block_ids)
        if n == 0:
            return self._no_blocks
        if set(map(type, block_ids)) != {int}:
            self._diagnose_ids(block_ids, op)
        if n <= _HOST_CHECK_MAX:
            if min(block_ids) < 1 or max(block_ids) >= self.num_gpu_blocks or len(set(block_ids)) != n:
                self._diagnose_ids(block_ids, op)
            return self._to_device(block_ids)
        ids = self._to_device(block_ids)
        self._check_on_device(ids, op, lambda: block_ids)
        return ids

    def _to_device(self, block_ids: Sequence[int]) -> torch.Tensor:
        """Checked int ids as an int64 tensor on the device (one buffer copy, no per-id Python objects)."""
        host = torch.frombuffer(array.array("q", block_ids), dtype=torch.int64)
        return host if self._on_host else host.to(self.device)

    def _check_on_device(self, ids: torch.Tensor, op: str, as_list: Callable[[], Sequence[object]]) -> None:
        """Range and distinctness of a long batch in a constant number of kernels; diagnose on failure."""
        lo_hi = torch.aminmax(ids)
        lo, hi = int(lo_hi.min), int(lo_hi.max)
        bad = lo < 1 or hi >= self.num_gpu_blocks
        if not bad:
            # Each id writes its position; a repeated id keeps one of its
            # positions, so some other position reads back a different one.
            positions = torch.arange(ids.numel(), dtype=torch.int64, device=self.device)
            self._scratch[ids] = positions
            bad = not bool(torch.equal(self._scratch[ids], positions))
        if bad:
            self._diagnose_ids(as_list(), op)

    def _diagnose_ids(self, block_ids: Sequence[object], op: str) -> None:
        """Raise the spec's error for the first bad id, walking the ids in order.

        Raises:
            InvalidBlock: an id is not an int in range, or is the null block.
            InvalidRequest: an id is named twice.
        """
        for b in block_ids:
            if not _is_int(b) or not 0 <= cast(int, b) < self.num_gpu_blocks:
                raise InvalidBlock(
                    f"{op}: block_id={b!r} is not a block of this pool (ids 0..{self.num_gpu_blocks - 1})"
                )
            if b == NULL_BLOCK_ID:
                raise InvalidBlock(f"{op}: block_id=0 is the null block, whose ref_cnt is never maintained")
        if len(set(block_ids)) != len(block_ids):
            raise InvalidRequest(f"{op}: block_ids={list(block_ids)} names a block twice")
        raise AssertionError(f"{op}: block_ids={list(block_ids)} flagged as bad but every check passes")

    @staticmethod
    def _small(values: torch.Tensor) -> list[int] | None:
        """A short vector's values on the host (a read back beats a reduction kernel); None for a long one."""
        return cast("list[int]", values.tolist()) if values.numel() <= _HOST_CHECK_MAX else None

    # --- hash flags -------------------------------------------------------------------------

    def _set_hash_flags(self, block_ids: torch.Tensor, value: bool) -> None:
        """Set or clear `has_hash` for a batch, on the device and in the host mirror."""
        self.has_hash.index_fill_(0, block_ids, value)
        if not self._on_host:
            self._host_has_hash.index_fill_(0, block_ids.cpu(), value)

    def get_block_hash(self, block_id: int) -> BlockHash | None:
        """The hash `block_id` is registered under, or None (host only). Cost: O(1)."""
        return self._registered_hash.get(block_id) if self._hash_flags[block_id] else None

    # --- operations -----------------------------------------------------------------------

    def get_num_free_blocks(self) -> int:
        """How many blocks `get_new_blocks` could take now. Cost: O(1)."""
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """The fraction of usable blocks (all but the null block and quarantined ones) held by requests.

        Cost: O(1).
        """
        num_usable = self.num_gpu_blocks - 1 - len(self.quarantined)
        if num_usable <= 0:
            return 0.0
        return 1.0 - self.free_block_queue.num_free_blocks / num_usable

    def get_new_blocks(self, num_blocks: int) -> list[BlockId]:
        """Take the blocks with the smallest keys (the left end), evicting their cached hashes.

        Raises:
            InvalidRequest: num_blocks is not a non-negative integer.
            PoolExhausted: fewer than num_blocks blocks are free.

        Cost: O(num_blocks) in a constant number of kernels; no per-block host work but the list returned.
        """
        taken = self.get_new_blocks_tensor(num_blocks)
        return cast("list[BlockId]", taken.tolist())

    def get_new_blocks_tensor(self, num_blocks: int) -> torch.Tensor:
        """`get_new_blocks`, returning the ids as an int64 device tensor (no list of the ids on the host).

        Raises:
            InvalidRequest, PoolExhausted: as `get_new_blocks`.
        """
        if not _is_int(num_blocks) or num_blocks < 0:
            raise InvalidRequest(
                f"get_new_blocks: num_blocks must be a non-negative integer; got num_blocks={num_blocks!r}"
            )
        num_free = self.free_block_queue.num_free_blocks
        if num_blocks > num_free:
            raise PoolExhausted(
                f"cannot allocate num_blocks={num_blocks}: {num_free} free of "
                f"num_gpu_blocks={self.num_gpu_blocks}, one is the null block"
                + (f" and {len(self.quarantined)} quarantined" if self.quarantined else "")
            )
        taken = self.free_block_queue.popleft_n(num_blocks)
        self.ref_cnt.index_fill_(0, taken, 1)
        # Taking a block is what evicts it: a freed block stays hittable until
        # its memory is actually needed. Its dict entry goes stale (see above).
        self._set_hash_flags(taken, False)
        return taken

    def touch(self, block_ids: BlockIds) -> None:
        """Take a hit on cached blocks: free ones leave the queue, every one gains a reference.

        Raises:
            InvalidBlock: an id is out of range, the null block, or has no hash.
            InvalidRequest: an id is named twice.

        Cost: O(len(block_ids)) in a constant number of kernels.
        """
        ids = self._index(block_ids, "touch")
        if ids.numel() == 0:
            return
        if isinstance(block_ids, torch.Tensor) or len(block_ids) > _HOST_CHECK_MAX:
            all_hashed = bool(self.has_hash.index_select(0, ids).all())
        else:
            flags = self._hash_flags
            all_hashed = all(flags[b] for b in block_ids)
        if not all_hashed:
            b = int(ids[int(torch.nonzero(~self.has_hash.index_select(0, ids))[0])])
            raise InvalidBlock(
                f"touch: block_id={b} has no hash (ref_cnt={int(self.ref_cnt[b])}), "
                "so no request can have hit it; stale block table?"
            )
        was_free = self.ref_cnt.index_select(0, ids) == 0
        small = self._small(was_free)
        if small is None or any(small):
            self.free_block_queue.remove(ids if small is not None and all(small) else ids[was_free])
        self.ref_cnt.index_add_(0, ids, self._ones[: ids.numel()])

    def free_blocks(self, ordered_block_ids: BlockIds) -> None:
        """Drop one reference per block, in eviction-priority order (a request's blocks tail first).

        Blocks whose ref_cnt reaches 0 join the queue as one batch per end:
        under `vllm-v1` those without a hash go to the left end in the given
        order (nobody can hit them, so they are reused first), the hashed ones
        to the right end (LRU); under `vllm-v1-tail` all go right. A block
        found corrupt while held is quarantined instead.

        Raises:
            InvalidBlock: an id is out of range or the null block.
            InvalidRequest: an id is named twice.
            DoubleFree: a block has ref_cnt 0.

        Cost: O(len(ordered_block_ids)) in a constant number of kernels.
        """
        ids = self._index(ordered_block_ids, "free_blocks")
        if ids.numel() == 0:
            return
        ref_cnt = self.ref_cnt.index_select(0, ids)
        small = self._small(ref_cnt)
        if small is not None:
            min_ref, max_ref = min(small), max(small)
        else:
            extremes = torch.aminmax(ref_cnt)
            min_ref, max_ref = int(extremes.min), int(extremes.max)
        if min_ref == 0:
            b = int(ids[int(torch.nonzero(ref_cnt == 0)[0])])
            raise DoubleFree(f"free_blocks: block_id={b} has ref_cnt=0, no request holds it (double free?)")
        self.ref_cnt.index_add_(0, ids, self._ones[: ids.numel()], alpha=-1)
        if min_ref > 1:
            return
        newly_free = ids if max_ref == 1 else ids[ref_cnt == 1]
        if self._num_corrupt_held:
            newly_free = self._retire_corrupt(newly_free)
        if not self._unhashed_to_left:
            self.free_block_queue.append_n(newly_free)
            return
        hashed = self.has_hash.index_select(0, newly_free)
        small = self._small(hashed)
        num_hashed = sum(small) if small is not None else int(torch.count_nonzero(hashed))
        if num_hashed == 0:
            self.free_block_queue.prepend_n(newly_free)
        elif num_hashed == newly_free.numel():
            self.free_block_queue.append_n(newly_free)
        else:
            self.free_block_queue.prepend_n(newly_free[~hashed])
            self.free_block_queue.append_n(newly_free[hashed])

    def _retire_corrupt(self, newly_free: torch.Tensor) -> torch.Tensor:
        """Quarantine the corrupt blocks among those whose ref_cnt just reached 0; return the others."""
        corrupt = self.is_corrupt.index_select(0, newly_free)
        if not bool(corrupt.any()):
            return newly_free
        retired = newly_free[corrupt]
        self.is_corrupt.index_fill_(0, retired, False)
        for b in retired.tolist():
            self.quarantined[b] = None
            self._num_corrupt_held -= 1
        return newly_free[~corrupt]

    def cache_full_blocks(self, block_ids: BlockIds, block_hashes: Sequence[BlockHash]) -> None:
        """Register full, held blocks under their hashes.

        NOTE: a hash already registered gets this block added after the others
        rather than replacing the request's block with the existing one: block
        tables are append-only, so identical full blocks are not merged.

        Raises:
            InvalidRequest: caching is off, the lengths differ, an id is named twice, a hash is not bytes.
            InvalidBlock: an id is out of range, the null block, not held, or found corrupt.
            AlreadyCached: a block already has a hash.

        Cost: O(len(block_ids)): one gather on the device, one host map insert per block.
        """
        if not self.enable_caching:
            raise InvalidRequest("cache_full_blocks: prefix caching is off (enable_caching=False), nothing is hashed")
        if len(block_ids) != len(block_hashes):
            raise InvalidRequest(
                f"cache_full_blocks: {len(block_ids)} block_ids but {len(block_hashes)} block_hashes; "
                "one hash per block"
            )
        ids = self._index(block_ids, "cache_full_blocks")
        if ids.numel() == 0:
            return
        bad = (self.ref_cnt.index_select(0, ids) == 0) | self.has_hash.index_select(0, ids)
        if self._num_corrupt_held:
            bad |= self.is_corrupt.index_select(0, ids)
        if bool(bad.any()) or set(map(type, block_hashes)) != {bytes}:
            self._diagnose_cache(ids.tolist(), block_hashes)
        self._set_hash_flags(ids, True)
        registered, table = self._registered_hash, self.cached_block_hash_to_block
        for b, h in zip(block_ids if isinstance(block_ids, list) else ids.tolist(), block_hashes):
            stale = registered.get(b)
            if stale is not None:
                # The entry an earlier (lazy) eviction left behind goes now.
                self._drop_entry(stale, b)
            registered[b] = h
            entry = table.get(h)
            if entry is None:
                table[h] = {b: None}
            else:
                entry[b] = None

    def _drop_entry(self, block_hash: BlockHash, block_id: int) -> None:
        """Remove one block from a hash's entry, if it is there; an emptied entry goes. Cost: O(1)."""
        entry = self.cached_block_hash_to_block.get(block_hash)
        if entry is not None:
            entry.pop(block_id, None)
            if not entry:
                del self.cached_block_hash_to_block[block_hash]

    def _diagnose_cache(self, block_ids: list[int], block_hashes: Sequence[object]) -> None:
        """Raise the spec's error for the first block that cannot be registered, in order."""
        for b, h in zip(block_ids, block_hashes):
            if not isinstance(h, bytes):
                raise InvalidRequest(f"cache_full_blocks: block_hash={h!r} for block_id={b} is not bytes")
            if int(self.ref_cnt[b]) == 0:
                raise InvalidBlock(
                    f"cache_full_blocks: block_id={b} has ref_cnt=0; only a held, computed block is cached"
                )
            if self._hash_flags[b]:
                raise AlreadyCached(
                    f"cache_full_blocks: block_id={b} is already registered; a block is cached once"
                )
            if bool(self.is_corrupt[b]):
                raise InvalidBlock(
                    f"cache_full_blocks: block_id={b} failed its checksum and awaits quarantine; "
                    "its content cannot be served"
                )
        raise AssertionError(f"cache_full_blocks: block_ids={block_ids} flagged as bad but every check passes")

    def get_cached_block(self, block_hash: BlockHash) -> BlockId | None:
        """The first block registered under `block_hash`, or None.

        Stale entries met on the way (blocks evicted since) are dropped.

        Raises:
            InvalidRequest: block_hash is not bytes.

        Cost: O(1) amortized, host only.
        """
        if not isinstance(block_hash, bytes):
            raise InvalidRequest(f"get_cached_block: block_hash={block_hash!r} is not bytes")
        entry = self.cached_block_hash_to_block.get(block_hash)
        if entry is None:
            return None
        flags = self._hash_flags
        stale: list[int] = []
        found: int | None = None
        for b in entry:
            if flags[b]:
                found = b
                break
            stale.append(b)
        for b in stale:
            del entry[b]
            del self._registered_hash[b]
        if not entry:
            del self.cached_block_hash_to_block[block_hash]
        return None if found is None else BlockId(found)

    def evict_blocks(self, block_ids: BlockIds) -> None:
        """Drop the cached hash of each block; holders keep their blocks, blocks without a hash are left alone.

        Raises:
            InvalidBlock: an id is out of range or the null block.
            InvalidRequest: an id is named twice.

        Cost: O(len(block_ids)) in one kernel (the dict entries go stale).
        """
        ids = self._index(block_ids, "evict_blocks")
        if ids.numel():
            self._set_hash_flags(ids, False)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash if no block is held; refuse (False, nothing changes) otherwise.

        Cost: O(num_gpu_blocks).
        """
        num_usable = self.num_gpu_blocks - 1 - len(self.quarantined)
        if self.free_block_queue.num_free_blocks != num_usable:
            return False
        self.cached_block_hash_to_block = {}
        self._registered_hash = {}
        self.has_hash.zero_()
        self._host_has_hash.zero_()
        return True

    def is_block_writable(self, block_id: BlockId) -> bool:
        """Whether a request may write into `block_id`: not null, held once, not hashed.

        Raises:
            InvalidBlock: block_id is not a block of this pool.

        Cost: O(1).
        """
        if not _is_int(block_id) or not 0 <= block_id < self.num_gpu_blocks:
            raise InvalidBlock(
                f"is_block_writable: block_id={block_id!r} is not a block of this pool "
                f"(ids 0..{self.num_gpu_blocks - 1})"
            )
        return block_id != NULL_BLOCK_ID and not self._hash_flags[block_id] and int(self.ref_cnt[block_id]) == 1

    def writable_mask(self, block_ids: torch.Tensor) -> torch.Tensor:
        """`is_block_writable` for a batch of in-range ids, as a device bool tensor (no host sync).

        The rule is kvspec.spec.invariants.is_block_writable's, evaluated on the
        device; tests check the two agree on every reachable state.
        """
        return (block_ids != NULL_BLOCK_ID) & (self.ref_cnt[block_ids] == 1) & ~self.has_hash[block_ids]

    # --- corrupt blocks -------------------------------------------------------------------

    def quarantine_blocks(self, block_ids: BlockIds) -> None:
        """Retire blocks whose content is corrupt: never hit again, never reallocated.

        Each block loses its hash now (no request can hit it again). A free
        block leaves the free queue and is quarantined now; a held one is
        quarantined when its last holder frees it (its holders keep it until
        then: their block tables are append-only). Quarantining a block twice
        changes nothing.

        Raises:
            InvalidBlock: an id is out of range or the null block.
            InvalidRequest: an id is named twice.

        Cost: O(len(block_ids)).
        """
        ids = self._index(block_ids, "quarantine_blocks")
        if ids.numel() == 0:
            return
        self._set_hash_flags(ids, False)
        held = self.ref_cnt.index_select(0, ids) > 0
        free = self.free_block_queue.contains(ids)
        newly_corrupt = ids[held & ~self.is_corrupt.index_select(0, ids)]
        self.is_corrupt.index_fill_(0, newly_corrupt, True)
        self._num_corrupt_held += newly_corrupt.numel()
        retired = ids[free]
        self.free_block_queue.remove(retired)
        for b in retired.tolist():
            self.quarantined[b] = None

    # --- observation ----------------------------------------------------------------------

    def snapshot(self, block_tables: tuple[tuple[str, tuple[BlockId, ...]], ...] | None = None) -> Snapshot:
        """The state in the spec's normal form (stale map entries left out). Cost: O(num_gpu_blocks)."""
        flags = self._hash_flags
        block_hash: list[BlockHash | None] = [None] * self.num_gpu_blocks
        for b, h in self._registered_hash.items():
            if flags[b]:
                block_hash[b] = h
        table = self.cached_block_hash_to_block
        live = ((h, tuple(BlockId(b) for b in entry if flags[b])) for h, entry in table.items())
        return Snapshot(
            num_gpu_blocks=self.num_gpu_blocks,
            enable_caching=self.enable_caching,
            ref_cnt=tuple(self.ref_cnt.tolist()),
            block_hash=tuple(block_hash),
            free_queue=tuple(self.free_block_queue.ordered().tolist()),
            hash_to_blocks=canonical_hash_to_blocks(tuple((h, blocks) for h, blocks in live if blocks)),
            block_tables=block_tables,
            quarantined=tuple(BlockId(b) for b in self.quarantined),
        )

    def check_invariants(self) -> None:
        """Check every state invariant via the spec's predicates, then that the tensors agree with the host.

        Raises:
            InvariantViolation: naming the first spec invariant that fails.
            AssertionError: the device flags, their host mirror, the hash map or the key index disagree.
        """
        check_all(self.snapshot())
        assert torch.equal(self.has_hash.cpu(), self._host_has_hash), "has_hash and its host mirror differ"
        flags = self._hash_flags
        for h, entry in self.cached_block_hash_to_block.items():
            assert entry, f"the hash map keeps an empty entry for {h!r}"
            for b in entry:
                assert self._registered_hash.get(b) == h, (
                    f"block {b} is in the entry of {h!r} but was last registered under {self._registered_hash.get(b)!r}"
                )
        for b in torch.nonzero(self._host_has_hash).squeeze(1).tolist():
            registered = self._registered_hash.get(b)
            assert registered is not None and b in self.cached_block_hash_to_block.get(registered, {}), (
                f"block {b} is flagged as hashed but not in the hash map"
            )
        assert not flags[NULL_BLOCK_ID], "the null block is flagged as hashed"
        corrupt = torch.nonzero(self.is_corrupt).squeeze(1)
        assert corrupt.numel() == self._num_corrupt_held, (
            f"{corrupt.numel()} blocks flagged corrupt but the count is {self._num_corrupt_held}"
        )
        assert bool((self.ref_cnt[corrupt] > 0).all()), "a block flagged corrupt is not held"
        problems = self.free_block_queue.representation_errors()
        assert not problems, "free queue: " + "; ".join(problems)
