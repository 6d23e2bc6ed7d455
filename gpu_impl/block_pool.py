"""The torch BlockPool: ref counts, hash flags and the free order in a host array mirrored by a device tensor.

Same observable behaviour as the spec's pool under every profile (the same
block ids in the same order, the same error type for the same bad input,
state unchanged after an error). Under the queue policies (`vllm-v1`,
`vllm-v1-tail`) `get_new_blocks(n)` is a selection of the n smallest free keys
(gpu_impl.free_queue; lemma 6, the key encoding, is why that is vLLM's order);
under seed 002's keyed policies it comes from host structures over per-block
stamps (gpu_impl.stamped_free: first fit, then the policy's key). `free_blocks` and
`touch` of a whole request are a gather, a scatter and a batch of free
blocks each.

Design choice, two paths over one state: every per-block field lives in one
int64 array with a host face and a device face (gpu_impl.mirror; on the CPU
they are one memory), and every call decides on the host face; the device
face follows, for device code to read. A batch of at most `python_path_max`
blocks, which is what a single request sends, runs as a Python loop; a
longer one as batched tensor operations. Both paths make the same checks in
the same order and the same writes, and the lock-step tests run each of
them alone against the reference. Rejected: one path of tensor operations
for every batch (an earlier design), which paid 8-12 torch operator calls of
about 2 us each on the CPU for any call, however few blocks it named: 15-35
us for one block, 7-13x the reference's time; and long batches as kernels
over the device face (the design before this one), which on CUDA waited
for the device five or six times a call (gpu_impl.mirror says why deciding
on the host costs none).

What a call costs in torch calls (tests/gpu_impl/test_operator_calls.py
holds the counts; a call is about 2 us on the CPU, a launch 5-10 us on CUDA;
a wait is a call that hands a device value to the host):

| call | torch calls | on the device | waits |
|---|---|---|---|
| a short call, ids in a list (every operation) | none | none | none |
| a short call, ids in a tensor | 1: `tolist` | 1 on CUDA | 1 on CUDA |
| short `get_new_blocks_tensor` | 1: `frombuffer` (CPU); `tensor`, `to` (CUDA) | CUDA: `to` | none |
| a long call, ids in a list | 6 (take) to 20 (free), whatever its length | none | none |
| a long call, ids on the device | the same, and `cpu` for the ids | `cpu` | 1 |
| long `get_new_blocks_tensor` | 11 | `to`: the ids handed back | none |
| `get_cached_block`, `is_block_writable`, `get_num_free_blocks`, `get_usage`, `snapshot` | none | none | none |

No call writes the device face. Its writes wait on the host (gpu_impl.mirror)
until the device face is next read, and then go across together, with no
wait: the entries Python wrote as one staged copy and one scatter (a
short call marks each block it wrote once, every field of it going across,
rather than each field: 0.2-0.4 us less for a one-block free, and 2-3 us
for a sixteen-block take or free, measured side by side on the CPU with two memories; its
price is the push's seven torch calls instead of two), and each
long call's tensor writes (one to three: ref counts, hash flags, the queue's
slots) replayed there, one kernel each, their arguments in one upload.
Every reader of the device face goes through `ref_cnt`, `has_hash`,
`is_corrupt` (and the free queue's `free_key`, `key_to_block`), which bring
it up to date first; `sync_device` does it at a point of the caller's
choosing (the end of a scheduler step).

The one wait that stays, ids in on the device, is the price of two
promises: a bad id raises at the call that passed it, with nothing changed
(DESIGN.md's bad input), and the host face is current when the call
returns. Reading the ids later would move the error to a later call and the
wait with it.

Design choice, the hash-to-blocks map: a host dict beside the arrays, and a
flag per block, `has_hash`, in the mirrored state. Block hashes are bytes
made on the host (sha256 over the tokens), every lookup's answer is needed on
the host (it becomes the request's block table), and `get_cached_block` is
asked one hash at a time. The rejected alternative, a device table (64-bit
fingerprints in a sorted tensor, looked up with `searchsorted`), pays a copy
to the device and a read back per lookup. Measured with `kvspec bench gpu`
(its second table) on one CPU core, torch 2.13, 1e6 registered hashes: one
lookup takes 0.13 us in the dict and 17 us in the device table; a 1e3-hash
chain looked up as one batch costs 0.38 ms in the device table against
0.32 ms for 1e3 dict lookups. Even batched the device table only breaks
even, before it pays for registering blocks (a re-sort, or a probing kernel)
and for checking the full hash behind a fingerprint match; on CUDA each
lookup also waits for the device.

The map is kept lazily, so that eviction stays a batched operation: taking
(or evicting) a block clears its flag and nothing else; its entry in the
dict goes stale. A lookup reads the flag on the host face in O(1), skips a
stale entry and drops it; re-registering the block drops its stale entry
too. An eager map would delete two dict entries per evicted block: measured,
2.7 us per block in a 1e6-block pool (cache misses), which made a 1e5-block
`get_new_blocks` as slow as the reference however fast the device is.

Corrupt blocks (seed 002): `quarantine_blocks` takes a block whose KV content
failed its checksum out of circulation. A free one leaves the free queue at
once; a held one loses its hash at once and is quarantined when its last
holder frees it. A quarantined block is never free, hashed, held or reused,
and the snapshot lists it (`Snapshot.quarantined`, checked by
inv_quarantine_isolated and inv_conservation).

KV cache events (vLLM's `enable_kv_cache_events`): with the flag on, every
operation queues what vLLM's pool publishes, in the spec's order
(kvspec.spec.events), and `take_events` drains the queue: a `BlockRemoved`
per key a block loses when it is taken or evicted by id, a `BlockStored` per
registration, `AllBlocksCleared` per reset; nothing on a free, a touch or a
lookup. The lazy map does not delay a removal: it is published when the
flag clears, read from `_registered_hash` before the flag goes. With the
flag off the queue is None and each operation pays one test of it, no loop.
Quarantine is not in the spec, so the decision is this module's: a
quarantined block that loses its hash publishes a `BlockRemoved` for it at
once (the key leaves the hash table then, and a router that kept it would
send requests here for a prefix no longer served); retiring it later, when
its last holder frees it, publishes nothing (it has no key left).

Bad input: every argument is checked before anything changes. A short batch
is checked by the loop that reads its blocks, a long one by tensor
operations (types, range, duplicates) before it writes; either way the first sign
of trouble hands the ids to a diagnosis that walks them in order exactly as
the spec does, so the error type and the block named are the spec's.
"""

from __future__ import annotations

import array
from collections.abc import Callable, Iterable, Sequence
from itertools import islice
from typing import Any, cast

import torch

from kvspec.gpu_impl.device import pick_device
from kvspec.gpu_impl.free_queue import KeyedFreeQueue, default_key_capacity
from kvspec.gpu_impl.mirror import DeviceFaceView, MirroredState, Ones
from kvspec.gpu_impl.sizing import DEFAULT_MARGIN, CapacityPlan, KVLayout, device_free_memory, plan_capacity
from kvspec.gpu_impl.stamped_free import StampedFreeBlocks
from kvspec.spec.errors import (
    AlreadyCached,
    DoubleFree,
    InvalidBlock,
    InvalidRequest,
    PoolExhausted,
    is_int,
)
from kvspec.spec.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from kvspec.spec.invariants import check_all
from kvspec.spec.ordering import ProfileRule, profile_rule
from kvspec.spec.state import NULL_BLOCK_ID, BlockHash, BlockId, Snapshot, canonical_hash_to_blocks

__all__ = ["PYTHON_PATH_MAX", "BlockIds", "TensorBlockPool"]

# A batch of block ids: a Python sequence (what vLLM's callers pass), or a 1-D
# integer tensor (a caller that already holds the ids on the device).
BlockIds = Sequence[BlockId] | torch.Tensor

# The longest batch that runs as a Python loop; a longer one runs as tensor
# operations. Both run on the host face whatever the device (gpu_impl.mirror),
# so the crossover is the host's: a Python step costs 0.1-0.3 us a block, the
# tensor path a floor of 15-35 us and then 0.05-0.3 us a block. Measured with
# `kvspec bench gpu --python-path-max 0` against `--python-path-max 100000`
# (torch 2.13, one thread): crossover 200-300 blocks in a 1e4-block pool,
# 130-250 in a 1e6-block pool; with the faces in two memories (`--two-memories`,
# the push to the device face timed too) 128-256. On CUDA each replayed tensor
# write adds a kernel launch to the push (three at most per call), a few us.
PYTHON_PATH_MAX = 256

# The mirrored state holds four fields per block, side by side, then the free
# queue's key index. Side by side: a short call touches one or two cache lines
# a block instead of four (measured: free_blocks of 16 blocks of a 1e6-block
# pool, 8 us in four arrays, 3 us interleaved).
_NUM_FIELDS = 4
_REF, _HASH, _CORRUPT, _FREE_KEY = range(_NUM_FIELDS)  # block b's field f is state entry 4 * b + f


# Ids `ids_as_tensor` converts at a time: 8 KB of pointers and at most 1,024 objects (64 KB of cache
# lines), within the second-level cache and its TLB. Measured, 1e5 ids: chunks of 512, 1,024 and 2,048
# ids 9.8, 9.3 and 11.4 ms.
_IDS_CHUNK = 1024


def ids_as_tensor(block_ids: Sequence[object]) -> torch.Tensor | None:
    """Block ids from a list as an int64 CPU tensor (one torch call over an array's memory), or None unless
    every one is a plain int (bools, floats, int subclasses: the caller's checks say what they are).

    The floor of any long call with ids in a list: `kvspec bench gpu` times it. Each id is an int object
    somewhere in the heap, and in a process that has run a while they lie scattered, one cache miss
    each; so the ids are read in chunks that stay in cache from the type check to the copy (one miss an
    id, not two: 1e5 ids a pool handed out, 9.3 ms against 20.1).

    Raises:
        OverflowError: a value is beyond int64.
    """
    if not block_ids:
        return torch.empty(0, dtype=torch.int64)
    if not isinstance(block_ids, list | tuple):  # a sequence that may not slice
        block_ids = list(block_ids)
    values = array.array("q")
    for start in range(0, len(block_ids), _IDS_CHUNK):
        chunk = block_ids[start : start + _IDS_CHUNK]
        if set(map(type, chunk)) != {int}:
            return None
        values.extend(cast("Sequence[int]", chunk))
    return torch.frombuffer(values, dtype=torch.int64)


def _int_bounds(values: torch.Tensor) -> tuple[int, int]:
    """The smallest and largest of a non-empty host tensor, as ints: one reduction and one conversion."""
    lo, hi = torch.stack(torch.aminmax(values)).tolist()
    return lo, hi


class TensorBlockPool:
    """A pool of `num_gpu_blocks` KV blocks with prefix caching, its state in a host array and a device tensor."""

    def __init__(
        self,
        num_gpu_blocks: int,
        enable_caching: bool = True,
        profile: str = "vllm-v1",
        device: str | torch.device | None = None,
        key_capacity: int | None = None,
        python_path_max: int | None = None,
        share_host_memory: bool | None = None,
        enable_kv_cache_events: bool = False,
    ) -> None:
        """Build the pool on a device; block 0 becomes the null block.

        Args:
            num_gpu_blocks: blocks in the pool, the null block included.
            enable_caching: prefix caching on or off.
            profile: the ordering rule (kvspec.spec.ordering.PROFILES).
            device: where the device face lives; None picks (gpu_impl.device.pick_device).
            key_capacity: the free queue's key index length (None: the default; tests
                pass a small one to force relabels). A keyed policy has no key index.
            python_path_max: the longest batch run as a Python loop, a longer one as tensor
                operations (None: PYTHON_PATH_MAX; tests pass 0 for the tensor path alone).
            share_host_memory: one memory for both faces (None: on the CPU only; tests pass
                False on the CPU to run the synchronisation CUDA needs).
            enable_kv_cache_events: queue the KV cache events every operation publishes,
                for `take_events` (the module docstring).

        Raises:
            InvalidRequest: num_gpu_blocks is not an integer >= 1, the profile is unknown,
                the device cannot be used, python_path_max is not an integer >= 0,
                share_host_memory is asked for a device with its own memory, or key_capacity
                is below 2 * num_gpu_blocks.

        Cost: O(num_gpu_blocks).
        """
        rule = self._check_arguments(num_gpu_blocks, profile, python_path_max)
        self.device = pick_device(device)  # fixed
        self.num_gpu_blocks = num_gpu_blocks  # fixed
        self.enable_caching = bool(enable_caching)  # fixed
        self.profile = profile  # fixed: the ordering rule it claims
        self._unhashed_to_left = rule.unhashed_to_left  # fixed, read on every free
        # fixed: the longest batch run in Python over the host face
        self.python_path_max = PYTHON_PATH_MAX if python_path_max is None else python_path_max
        length = self._state_length(rule, key_capacity)
        self._init_state(length, share_host_memory)
        self._init_free_order(rule, key_capacity)
        self._state.upload(0, length)  # built on the host face (the fields and the queue's keys): one copy
        self._init_host_maps()
        self._init_batch_tensors()
        self.capacity_plan: CapacityPlan | None = None  # set when the pool was sized from memory
        # Events published and not yet taken (take_events drains it); None: events off, nothing kept.
        self.kv_event_queue: list[KVCacheEvent] | None = [] if enable_kv_cache_events else None

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

    # --- the steps of __init__, in its order ----------------------------------------------

    @staticmethod
    def _check_arguments(num_gpu_blocks: int, profile: str, python_path_max: int | None) -> ProfileRule:
        """Refuse a bad pool size, profile or python_path_max, in that order; return the profile's rule.

        Raises:
            InvalidRequest: as `__init__`.
        """
        if not is_int(num_gpu_blocks) or num_gpu_blocks < 1:
            raise InvalidRequest(
                "num_gpu_blocks must be an integer >= 1 (block 0 is the null block); "
                f"got num_gpu_blocks={num_gpu_blocks!r}"
            )
        try:
            rule = profile_rule(profile)
        except ValueError as e:
            raise InvalidRequest(str(e)) from None
        if python_path_max is not None and (not is_int(python_path_max) or python_path_max < 0):
            raise InvalidRequest(f"python_path_max must be an integer >= 0; got python_path_max={python_path_max!r}")
        return rule

    def _state_length(self, rule: ProfileRule, key_capacity: int | None) -> int:
        """The mirrored state's entries: the per-block fields, then the free queue's key index.

        A keyed policy keeps its order on the host, so it has no key index.
        """
        n = self.num_gpu_blocks
        extra = 0 if rule.keyed else max(default_key_capacity(n) if key_capacity is None else key_capacity, 0)
        return _NUM_FIELDS * n + extra

    def _init_state(self, length: int, share_host_memory: bool | None) -> None:
        """The mirrored state, and each per-block field as a strided view of it on both faces.

        Raises:
            InvalidRequest: share_host_memory is asked for a device with its own memory.
        """
        try:
            # A block's fields are its row of the state: a short call marks the block (host_written's rows), not
            # each field.
            state = MirroredState(length, self.device, share_host_memory, row_width=_NUM_FIELDS)
        except ValueError as e:
            raise InvalidRequest(str(e)) from None
        self._state = state  # every per-block field below, both faces
        self._track = not state.is_shared  # fixed: writes are marked and synchronised
        end, step = _NUM_FIELDS * self.num_gpu_blocks, _NUM_FIELDS
        # NOTE: the null block's ref_cnt stays 0 and it is never queued: it is a
        # placeholder for slots that need no memory, never handed out or freed.
        self._ref_cnt = state.tensor[_REF:end:step]  # requests holding each block (device face: `ref_cnt`)
        # Whether each block is registered in the hash table (1) or not (0): the
        # truth the dict below is read through.
        self._has_hash = state.tensor[_HASH:end:step]  # (device face: `has_hash`)
        self._is_corrupt = state.tensor[_CORRUPT:end:step]  # held, found corrupt: quarantine on free (1)
        self._ref = state.host[_REF:end:step]  # the host faces of the three, for Python
        self._hash_flags = state.host[_HASH:end:step]
        self._corrupt = state.host[_CORRUPT:end:step]
        # The host faces of the three as CPU tensors, for the long batches' tensor operations.
        self._ref_host = state.host_tensor[_REF:end:step]
        self._has_hash_host = state.host_tensor[_HASH:end:step]
        self._corrupt_host = state.host_tensor[_CORRUPT:end:step]
        self._field_views = {  # each field's view of the two faces, for writes replayed on the device
            _REF: (self._ref_host, self._ref_cnt),
            _HASH: (self._has_hash_host, self._has_hash),
            _CORRUPT: (self._corrupt_host, self._is_corrupt),
        }

    def _init_free_order(self, rule: ProfileRule, key_capacity: int | None) -> None:
        """The eviction order, every usable block free in id order.

        Queue policies: each block's key in its fourth field, the key index
        after the fields. Keyed policies: stamps and the order on the host (the
        field stays 0).
        """
        n, dev = self.num_gpu_blocks, self.device
        # Exactly one of the two is set, typed, so that a call reaches its own with no cast.
        self._stamped: StampedFreeBlocks | None = None  # a keyed policy's free blocks
        self._queue: KeyedFreeQueue | None = None  # a queue policy's free queue
        self.free_block_queue: KeyedFreeQueue | StampedFreeBlocks
        if rule.keyed:
            self.free_block_queue = self._stamped = StampedFreeBlocks(
                n, rule, self._hash_flags, self._has_hash_host, dev, self.python_path_max
            )
        else:
            try:
                self.free_block_queue = self._queue = KeyedFreeQueue(
                    n, dev, key_capacity, self._state, (_FREE_KEY, _NUM_FIELDS), _NUM_FIELDS * n
                )
            except ValueError as e:  # a key index too short for the pool
                raise InvalidRequest(str(e)) from None

    def _init_host_maps(self) -> None:
        """The host-only bookkeeping: the hash map and the quarantine."""
        # The hash map (host, see the module docstring): hash -> the blocks
        # registered under it, in registration order (a dict used as an ordered
        # set: the first live one is what a hit returns). Entries of blocks whose
        # flag is clear are stale: skipped, and dropped when met.
        self.cached_block_hash_to_block: dict[BlockHash, dict[int, None]] = {}
        # Block -> the hash it was last registered under (None: never, or dropped); a list, not a dict: an
        # event's key is read for every evicted block, a list index is one memory read where a dict lookup
        # is two (1e5 scattered reads of a 1e6-entry map: 42 ms against 82), and the garbage collector walks
        # it faster (a 1e5-block take with events, 1e6 blocks: 159-165 ms against 246-250; gpu-impl.md).
        self._registered_hash: list[BlockHash | None] = [None] * self.num_gpu_blocks
        self.quarantined: dict[int, None] = {}  # blocks found corrupt, in the order they were retired
        self._num_corrupt_held = 0  # blocks with is_corrupt set (all held)

    def _init_batch_tensors(self) -> None:
        """The CPU tensors the long path reuses, allocated once at the pool's size."""
        n = self.num_gpu_blocks
        # Duplicate detection for long batches: each id writes its position in the batch. A batch is shorter
        # than the pool, so int32 holds any position of a pool below 2**31 blocks, and half the bytes are half
        # the scattered cache lines (1e5 ids of a 1e6-block pool: 0.8 ms against 1.2 with int64).
        position = torch.int32 if n <= 2**31 else torch.int64
        self._scratch = torch.empty(n, dtype=position)
        self._positions = torch.arange(n, dtype=position)  # what each id of a batch writes there
        self._no_blocks = torch.empty(0, dtype=torch.int64)

    # --- argument checks ------------------------------------------------------------------

    def _short(self, block_ids: BlockIds, op: str) -> Sequence[object] | None:
        """The ids as a host sequence when the batch is short enough for the host face, else None.

        Raises:
            InvalidRequest: a tensor that is not a 1-D integer tensor.
        """
        if isinstance(block_ids, torch.Tensor):
            self._check_tensor(block_ids, op)
            return cast("list[int]", block_ids.tolist()) if block_ids.numel() <= self.python_path_max else None
        return block_ids if len(block_ids) <= self.python_path_max else None

    @staticmethod
    def _check_tensor(block_ids: torch.Tensor, op: str) -> None:
        if block_ids.dim() != 1 or block_ids.dtype.is_floating_point or block_ids.dtype == torch.bool:
            raise InvalidRequest(
                f"{op}: block_ids must be a 1-D integer tensor; got dtype={block_ids.dtype} "
                f"shape={tuple(block_ids.shape)}"
            )

    def _index(self, block_ids: BlockIds, op: str) -> torch.Tensor:
        """A long batch as an int64 CPU tensor, checked (ints, in range, not null, distinct).

        Ids on the device come to the host first: the one wait such a call pays (its ids must be read
        before anything changes, and every decision is made on the host face: gpu_impl.mirror).

        Raises:
            InvalidBlock, InvalidRequest: as `_check_ids`.
        """
        if isinstance(block_ids, torch.Tensor):
            ids = self._state.to_host(block_ids)
            self._check_batch(ids, op, ids.tolist)
            return ids
        try:
            found = ids_as_tensor(block_ids)
            if found is None:  # raises, unless the ids are only int subclasses
                found = ids_as_tensor(self._plain_ids(block_ids, op))
            ids = cast(torch.Tensor, found)  # plain ints always convert
        except OverflowError:
            self._check_ids(block_ids, op)  # raises: an id beyond int64 is not a block
            raise
        self._check_batch(ids, op, lambda: block_ids)
        return ids

    def _check_batch(self, ids: torch.Tensor, op: str, as_list: Callable[[], Sequence[object]]) -> None:
        """Range and distinctness of a long batch in a constant number of tensor operations; diagnose on failure."""
        lo, hi = _int_bounds(ids)
        # More ids than the pool has usable blocks must repeat one (or name the null block); the
        # scatter below has one position per block and cannot take them.
        bad = lo < 1 or hi >= self.num_gpu_blocks or ids.numel() >= self.num_gpu_blocks
        if not bad:
            # Each id writes its position; a repeated id keeps one of its
            # positions, so some other position reads back a different one.
            positions = self._positions[: ids.numel()]
            self._scratch.scatter_(0, ids, positions)
            bad = not bool(torch.equal(self._scratch.index_select(0, ids), positions))
        if bad:
            self._check_ids(as_list(), op)
            raise AssertionError(f"{op}: block_ids={list(as_list())} flagged on the device but every check passes")

    def _check_ids(self, block_ids: Sequence[object], op: str) -> None:
        """Raise the spec's error for the first bad id, walking the ids in order; return if none is bad.

        Raises:
            InvalidBlock: an id is not an int in range, or is the null block.
            InvalidRequest: an id is named twice.
        """
        for b in block_ids:
            if not is_int(b) or not 0 <= b < self.num_gpu_blocks:
                raise InvalidBlock(
                    f"{op}: block_id={b!r} is not a block of this pool (ids 0..{self.num_gpu_blocks - 1})"
                )
            if b == NULL_BLOCK_ID:
                raise InvalidBlock(f"{op}: block_id=0 is the null block, whose ref_cnt is never maintained")
        if len(set(block_ids)) != len(block_ids):
            raise InvalidRequest(f"{op}: block_ids={list(block_ids)} names a block twice")

    def _plain_ids(self, block_ids: Sequence[object], op: str) -> list[int]:
        """Checked ids as plain ints (an int subclass passes the spec's checks but not the fast loops)."""
        self._check_ids(block_ids, op)
        return [int(cast(int, b)) for b in block_ids]

    # --- marking writes (only when the two faces are two memories) ------------------------

    def sync_device(self) -> None:
        """Bring the device face up to date now: every call's waiting writes, in one upload, no wait.

        Reading the device face does it anyway; a scheduler may call it at the end of a step, so that the
        next long batch starts with nothing to copy. Nothing to do on the CPU (one memory).
        """
        self._state.device_face()

    # The device face's fields, brought up to date as they are read (short calls leave their writes on the
    # host: gpu_impl.mirror). Every kernel and every other reader goes through these.
    ref_cnt = DeviceFaceView("Requests holding each block (the device face).")
    has_hash = DeviceFaceView("Whether each block is registered in the hash table (1) or not (0) (the device face).")
    is_corrupt = DeviceFaceView("Held blocks found corrupt, quarantined on free (1) (the device face).")

    def _apply(self, field: int, method: str, *args: object, **kwargs: Any) -> None:
        """A long batch's tensor write of one field through the host face, replayed on the device face at the
        next push (gpu_impl.mirror): `method(*args, **kwargs)` on the field's view of each face."""
        self._state.apply(*self._field_views[field], method, *args, **kwargs)

    # --- operations -----------------------------------------------------------------------

    def get_block_hash(self, block_id: int) -> BlockHash | None:
        """The hash `block_id` is registered under, or None (host only). Cost: O(1)."""
        return self._registered_hash[block_id] if self._hash_flags[block_id] else None

    def get_ref_cnt(self, block_id: int) -> int:
        """Requests holding `block_id` now (host only; `ref_cnt` is the device face). Cost: O(1)."""
        return self._ref[block_id]

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

        Cost: O(num_blocks): Python over the host face for a short batch, a constant number
        of tensor operations and the list returned for a long one.
        """
        self._check_take(num_blocks)
        if num_blocks <= self.python_path_max:
            return cast("list[BlockId]", self._take_short(num_blocks))
        return cast("list[BlockId]", self._take_long(num_blocks).tolist())

    def get_new_blocks_tensor(self, num_blocks: int) -> torch.Tensor:
        """`get_new_blocks`, returning the ids as an int64 device tensor (no list of the ids on the host).

        Raises:
            InvalidRequest, PoolExhausted: as `get_new_blocks`.
        """
        self._check_take(num_blocks)
        if num_blocks <= self.python_path_max:
            return self._state.to_device(self._take_short(num_blocks))
        return self._state.to_device(self._take_long(num_blocks))

    def _check_take(self, num_blocks: int) -> None:
        if not is_int(num_blocks) or num_blocks < 0:
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

    def _take_short(self, num_blocks: int) -> list[int]:
        queue = self._queue
        if queue is not None:
            taken = queue.popleft_list(num_blocks)
        else:
            assert self._stamped is not None
            taken = self._stamped.take(num_blocks)
        if self.kv_event_queue is not None:
            self._publish_removed(taken)  # before the loop below clears the flags it reads
        ref, flags = self._ref, self._hash_flags
        for b in taken:
            ref[b] = 1
            # Taking a block is what evicts it: a freed block stays hittable until
            # its memory is actually needed. Its dict entry goes stale (see above).
            flags[b] = 0
        if self._track:
            self._state.host_written(taken)
        return taken

    def _take_long(self, num_blocks: int) -> torch.Tensor:
        """Take a long batch on the host face; the taken ids as a CPU tensor."""
        if self._queue is not None:
            taken = self._queue.popleft_n(num_blocks)
            if self.kv_event_queue is not None:
                self._publish_removed_long(taken)
        else:  # the keyed order lives on the host
            assert self._stamped is not None
            host_ids, taken = self._stamped.take_long(num_blocks)
            if self.kv_event_queue is not None:
                self._publish_removed(host_ids)
        self._apply(_REF, "index_fill_", 0, taken, 1)
        self._apply(_HASH, "index_fill_", 0, taken, 0)  # evicted, as above
        self._state.host_written()
        return taken

    def touch(self, block_ids: BlockIds) -> None:
        """Take a hit on cached blocks: free ones leave the queue, every one gains a reference.

        Raises:
            InvalidBlock: an id is out of range, the null block, or has no hash.
            InvalidRequest: an id is named twice.

        Cost: O(len(block_ids)): Python over the host face for a short batch, a constant
        number of tensor operations for a long one.
        """
        ids = self._short(block_ids, "touch")
        if ids is None:
            return self._touch_long(self._index(block_ids, "touch"))
        n, flags = self.num_gpu_blocks, self._hash_flags
        for b in ids:
            if type(b) is not int or not 0 < b < n or not flags[b]:
                ids = self._refuse_touch(ids)
                break
        if len(ids) > 1 and len(set(ids)) != len(ids):
            self._check_ids(ids, "touch")
        ref, hits = self._ref, cast("list[int]", ids)
        was_free: list[int] = []
        for b in hits:
            r = ref[b]
            if r == 0:
                was_free.append(b)
            ref[b] = r + 1
        queue = self._queue
        if queue is not None:
            queue.remove_list(was_free)
        else:  # a hit is an access
            assert self._stamped is not None
            self._stamped.hit_list(hits, was_free)
        if self._track:
            self._state.host_written(hits)
        return None

    def _refuse_touch(self, block_ids: Sequence[object]) -> list[int]:
        """Raise the spec's error for a touch its loop did not accept (ids, duplicates, then hashes), in order.

        Returns:
            The ids as plain ints, when nothing was wrong but their type.
        """
        ids = self._plain_ids(block_ids, "touch")
        for b in ids:
            if not self._hash_flags[b]:
                raise InvalidBlock(
                    f"touch: block_id={b} has no hash (ref_cnt={self._ref[b]}), "
                    "so no request can have hit it; stale block table?"
                )
        return ids

    def _touch_long(self, ids: torch.Tensor) -> None:
        hashed = self._has_hash_host.index_select(0, ids)
        if not bool(hashed.all()):
            b = int(ids[int(torch.nonzero(hashed == 0)[0])])
            raise InvalidBlock(
                f"touch: block_id={b} has no hash (ref_cnt={self._ref[b]}), "
                "so no request can have hit it; stale block table?"
            )
        ref_cnt = self._ref_host.index_select(0, ids)
        min_ref, max_ref = _int_bounds(ref_cnt)
        # A hit usually finds its blocks all free or all held: then no mask (a nonzero and an index, 0.6 ms a 1e5).
        was_free = ids if max_ref == 0 else self._no_blocks if min_ref > 0 else ids[ref_cnt == 0]
        if self._queue is not None:
            self._queue.remove(was_free)
        else:
            assert self._stamped is not None
            self._stamped.hit(ids, was_free)
        self._apply(_REF, "index_add_", 0, ids, Ones(ids.numel()))
        self._state.host_written()

    def free_blocks(self, ordered_block_ids: BlockIds, evict_first: bool = False) -> None:
        """Drop one reference per block, in eviction-priority order (a request's blocks tail first).

        Blocks whose ref_cnt reaches 0 join the queue as one batch per end:
        under `vllm-v1` those without a hash go to the left end in the given
        order (nobody can hit them, so they are reused first), the hashed ones
        to the right end (LRU); under `vllm-v1-tail` all go right. Under a
        keyed policy every block named is stamped, in the given order, and the
        newly free ones take the places their keys give them. With
        `evict_first` (vLLM 0.34.0 on) every block freed goes before every
        other cached block: all of them in the left batch, or, keyed, into the
        key's first tier. A block found corrupt while held is quarantined instead.

        Raises:
            InvalidBlock: an id is out of range or the null block.
            InvalidRequest: an id is named twice, or evict_first is not a bool.
            DoubleFree: a block has ref_cnt 0.

        Cost: O(len(ordered_block_ids)): Python over the host face for a short batch, a
        constant number of tensor operations for a long one.
        """
        if evict_first is not True and evict_first is not False:
            raise InvalidRequest(f"free_blocks: evict_first={evict_first!r} is not a bool")
        ids = ordered_block_ids
        if isinstance(ids, torch.Tensor) or len(ids) > self.python_path_max:
            short = self._short(ids, "free_blocks")
            if short is None:
                return self._free_long(self._index(ids, "free_blocks"), evict_first)
            ids = cast("list[BlockId]", short)
        return self._free_short(ids, evict_first)

    def _free_short(self, ids: Sequence[BlockId], evict_first: bool) -> None:
        """`free_blocks` of a short batch, over the host face: drop every reference, then free the blocks that reach 0.

        Raises:
            InvalidBlock, InvalidRequest, DoubleFree: as `free_blocks`, every dropped reference handed back first.
        """
        # Every finished request lands here, so one pass checks an id and drops
        # its reference at once; the queue changes only after every id passed.
        # Anything the pass does not accept hands back the references it
        # dropped and goes to the spec's diagnosis.
        n, ref, flags, to_left = self.num_gpu_blocks, self._ref, self._hash_flags, self._unhashed_to_left
        corrupt = self._corrupt if self._num_corrupt_held else None  # None: no held block is corrupt (usually)
        left: list[int] = []  # newly free without a hash: reused first
        right: list[int] = []  # newly free with a hash: kept longest (LRU)
        retired: list[int] = []  # newly free but corrupt: quarantined
        dropped = 0
        for b in ids:
            if type(b) is not int or not 0 < b < n or (r := ref[b]) == 0:
                self._undrop(ids, dropped)
                return self.free_blocks(cast("list[BlockId]", self._refuse_free(ids)), evict_first)
            ref[b] = r - 1
            dropped += 1
            if r == 1:
                if corrupt is not None and corrupt[b]:
                    retired.append(b)
                elif evict_first or (to_left and not flags[b]):
                    left.append(b)
                else:
                    right.append(b)
        if dropped > 1 and len(set(ids)) != dropped:
            self._undrop(ids, dropped)
            self._check_ids(ids, "free_blocks")
        if retired:
            self._retire(retired)
        queue = self._queue
        if queue is not None:
            if left:
                queue.prepend_list(left)
            if right:
                queue.append_list(right)
        else:  # every block named is stamped; the newly free take their keys' places
            assert self._stamped is not None
            self._stamped.freed_list(cast("list[int]", ids), left + right, evict_first)
        if self._track:
            self._state.host_written(ids)
        return None

    def _undrop(self, block_ids: Sequence[object], dropped: int) -> None:
        """Hand back the references a refused free dropped: one for each of the first `dropped` ids."""
        ref = self._ref
        for b in islice(block_ids, dropped):
            ref[cast(int, b)] += 1

    def _refuse_free(self, block_ids: Sequence[object]) -> list[int]:
        """Raise the spec's error for a free its loop did not accept (ids, duplicates, then double free), in order.

        Returns:
            The ids as plain ints, when nothing was wrong but their type.
        """
        ids = self._plain_ids(block_ids, "free_blocks")
        for b in ids:
            if self._ref[b] == 0:
                raise DoubleFree(f"free_blocks: block_id={b} has ref_cnt=0, no request holds it (double free?)")
        return ids

    def _retire(self, retired: list[int]) -> None:
        """Quarantine corrupt blocks whose last holder just freed them (host face; the free marks their rows)."""
        corrupt = self._corrupt
        for b in retired:
            corrupt[b] = 0
            self.quarantined[b] = None
        self._num_corrupt_held -= len(retired)

    def _free_long(self, ids: torch.Tensor, evict_first: bool) -> None:
        ref_cnt = self._ref_host.index_select(0, ids)
        min_ref, max_ref = _int_bounds(ref_cnt)
        if min_ref == 0:
            b = int(ids[int(torch.nonzero(ref_cnt == 0)[0])])
            raise DoubleFree(f"free_blocks: block_id={b} has ref_cnt=0, no request holds it (double free?)")
        self._apply(_REF, "index_add_", 0, ids, Ones(ids.numel()), alpha=-1)
        if min_ref == 1:  # some block is free now
            newly_free = ids if max_ref == 1 else ids[ref_cnt == 1]
            if self._num_corrupt_held:
                newly_free = self._retire_long(newly_free)
            if self._stamped is None:
                self._queue_long(newly_free, evict_first)
        else:
            newly_free = self._no_blocks
        if self._stamped is not None:
            self._stamped.freed(ids, newly_free, evict_first)
        self._state.host_written()

    def _queue_long(self, newly_free: torch.Tensor, evict_first: bool) -> None:
        """Send blocks whose ref_cnt reached 0 to their ends of the queue (host face, tensors)."""
        queue = self._queue
        assert queue is not None
        if evict_first:  # every one to the left end, as one batch in the given order
            queue.prepend_n(newly_free)
            return
        if not self._unhashed_to_left:
            queue.append_n(newly_free)
            return
        flags = self._has_hash_host.index_select(0, newly_free)
        num_hashed = int(torch.count_nonzero(flags))
        if num_hashed == 0:
            queue.prepend_n(newly_free)
        elif num_hashed == newly_free.numel():
            queue.append_n(newly_free)
        else:
            hashed = flags != 0
            queue.prepend_n(newly_free[~hashed])
            queue.append_n(newly_free[hashed])

    def _retire_long(self, newly_free: torch.Tensor) -> torch.Tensor:
        """Quarantine the corrupt blocks among those whose ref_cnt just reached 0; return the others."""
        corrupt = self._corrupt_host.index_select(0, newly_free) != 0
        if not bool(corrupt.any()):
            return newly_free
        retired = newly_free[corrupt]
        self._apply(_CORRUPT, "index_fill_", 0, retired, 0)
        for b in retired.tolist():
            self.quarantined[b] = None
        self._num_corrupt_held -= retired.numel()
        return newly_free[~corrupt]

    def cache_full_blocks(
        self, block_ids: BlockIds, block_hashes: Sequence[BlockHash], stored: BlockStored | None = None
    ) -> None:
        """Register full, held blocks under their hashes.

        NOTE: a hash already registered gets this block added after the others
        rather than replacing the request's block with the existing one: block
        tables are append-only, so identical full blocks are not merged.

        With events on, the registration publishes one `BlockStored`: `stored`
        when given (the request level knows the parent, the tokens and the
        request's keys, which vLLM's pool reads off the request; it is
        published even if no block is named), else the keys alone when any
        block is registered.

        Raises:
            InvalidRequest: caching is off, the lengths differ, an id is named twice, a hash is not bytes.
            InvalidBlock: an id is out of range, the null block, not held, or found corrupt.
            AlreadyCached: a block already has a hash.

        Cost: O(len(block_ids)): one host map insert per block, plus a constant number of
        tensor operations for a long batch.
        """
        if not self.enable_caching:
            raise InvalidRequest("cache_full_blocks: prefix caching is off (enable_caching=False), nothing is hashed")
        if len(block_ids) != len(block_hashes):
            raise InvalidRequest(
                f"cache_full_blocks: {len(block_ids)} block_ids but {len(block_hashes)} block_hashes; "
                "one hash per block"
            )
        ids = self._short(block_ids, "cache_full_blocks")
        if ids is None:
            return self._cache_long(self._index(block_ids, "cache_full_blocks"), block_hashes, stored)
        n, ref, flags, corrupt = self.num_gpu_blocks, self._ref, self._hash_flags, self._corrupt
        for b, h in zip(ids, block_hashes):
            if type(b) is not int or not 0 < b < n or ref[b] == 0 or flags[b] or corrupt[b] or type(h) is not bytes:
                ids = self._plain_ids(ids, "cache_full_blocks")
                self._diagnose_cache(ids, block_hashes)  # raises, unless only the types were unusual
                break
        if len(ids) > 1 and len(set(ids)) != len(ids):
            self._check_ids(ids, "cache_full_blocks")
        for b in cast("list[int]", ids):
            flags[b] = 1
        if self._stamped is not None:  # block-age reads when the content was registered
            self._stamped.registered_list(cast("list[int]", ids))
        if self._track:
            self._state.host_written(cast("list[int]", ids))
        self._register(cast("list[int]", ids), block_hashes, stored)
        return None

    def _cache_long(self, ids: torch.Tensor, block_hashes: Sequence[BlockHash], stored: BlockStored | None) -> None:
        bad = (self._ref_host.index_select(0, ids) == 0) | (self._has_hash_host.index_select(0, ids) != 0)
        if self._num_corrupt_held:
            bad |= self._corrupt_host.index_select(0, ids) != 0
        host_ids = cast("list[int]", ids.tolist())
        if bool(bad.any()) or set(map(type, block_hashes)) != {bytes}:
            self._diagnose_cache(host_ids, block_hashes)
        self._apply(_HASH, "index_fill_", 0, ids, 1)
        if self._stamped is not None:
            self._stamped.registered(ids)
        self._state.host_written()
        self._register(host_ids, block_hashes, stored)

    def _register(self, block_ids: list[int], block_hashes: Sequence[BlockHash], stored: BlockStored | None) -> None:
        """Enter flagged blocks in the host map, then publish the registration (events on).

        Cost: O(len(block_ids)) dict operations.
        """
        registered, table = self._registered_hash, self.cached_block_hash_to_block
        for b, h in zip(block_ids, block_hashes):
            stale = registered[b]
            if stale is not None:
                # The entry an earlier (lazy) eviction left behind goes now.
                self._drop_entry(stale, b)
            registered[b] = h
            entry = table.get(h)
            if entry is None:
                table[h] = {b: None}
            else:
                entry[b] = None
        queue = self.kv_event_queue
        if queue is not None:
            if stored is not None:
                queue.append(stored)
            elif block_ids:
                queue.append(BlockStored(block_hashes=tuple(block_hashes), parent_block_hash=None))

    def _drop_entry(self, block_hash: BlockHash, block_id: int) -> None:
        """Remove one block from a hash's entry, if it is there; an emptied entry goes. Cost: O(1)."""
        entry = self.cached_block_hash_to_block.get(block_hash)
        if entry is not None:
            entry.pop(block_id, None)
            if not entry:
                del self.cached_block_hash_to_block[block_hash]

    def _publish_removed(self, block_ids: Iterable[int]) -> None:
        """Queue a `BlockRemoved` for each block that is hashed now, in order; called before the flags clear.

        The key is the one the block was registered under: `_registered_hash`
        is exact for a flagged block (only a clear flag leaves it stale).
        Cost: O(len(block_ids)) host reads.
        """
        queue = cast("list[KVCacheEvent]", self.kv_event_queue)
        flags, registered = self._hash_flags, cast("list[BlockHash]", self._registered_hash)  # flagged: registered
        for b in block_ids:
            if flags[b]:
                queue.append(BlockRemoved((registered[b],)))

    def _publish_removed_long(self, ids: torch.Tensor) -> None:
        """`_publish_removed` for a long batch: the hashed ids picked by tensor operations, only they go to Python,
        and each costs what building its event costs (`kvspec bench gpu --events` prints that floor)."""
        hashed = cast("list[int]", ids[self._has_hash_host.index_select(0, ids) != 0].tolist())
        registered = cast("list[BlockHash]", self._registered_hash)  # every flagged block is registered
        cast("list[KVCacheEvent]", self.kv_event_queue).extend([BlockRemoved((registered[b],)) for b in hashed])

    def take_events(self) -> list[KVCacheEvent]:
        """The events published since the last call, oldest first, and none kept (none at all with events off).

        Cost: O(1): the queue is handed over, not copied.
        """
        events = self.kv_event_queue
        if not events:
            return []
        self.kv_event_queue = []
        return events

    def _diagnose_cache(self, block_ids: list[int], block_hashes: Sequence[object]) -> None:
        """Raise the spec's error for the first block that cannot be registered, in order; return if none."""
        for b, h in zip(block_ids, block_hashes):
            if not isinstance(h, bytes):
                raise InvalidRequest(f"cache_full_blocks: block_hash={h!r} for block_id={b} is not bytes")
            if self._ref[b] == 0:
                raise InvalidBlock(
                    f"cache_full_blocks: block_id={b} has ref_cnt=0; only a held, computed block is cached"
                )
            if self._hash_flags[b]:
                raise AlreadyCached(f"cache_full_blocks: block_id={b} is already registered; a block is cached once")
            if self._corrupt[b]:
                raise InvalidBlock(
                    f"cache_full_blocks: block_id={b} failed its checksum and awaits quarantine; "
                    "its content cannot be served"
                )

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
            self._registered_hash[b] = None
        if not entry:
            del self.cached_block_hash_to_block[block_hash]
        return None if found is None else BlockId(found)

    def evict_blocks(self, block_ids: BlockIds) -> None:
        """Drop the cached hash of each block; holders keep their blocks, blocks without a hash are left alone.

        With events on, each hash dropped publishes a `BlockRemoved`, in the order given.

        Raises:
            InvalidBlock: an id is out of range or the null block.
            InvalidRequest: an id is named twice.

        Cost: O(len(block_ids)) (the dict entries go stale).
        """
        ids = self._short(block_ids, "evict_blocks")
        if ids is None:
            long_ids = self._index(block_ids, "evict_blocks")
            if self.kv_event_queue is not None:
                self._publish_removed_long(long_ids)
            self._apply(_HASH, "index_fill_", 0, long_ids, 0)
            if self._stamped is not None:  # a free block that loses its hash joins first fit
                self._stamped.lost_hash(cast("list[int]", long_ids.tolist()))
            self._state.host_written()
            return
        n = self.num_gpu_blocks
        for b in ids:
            if type(b) is not int or not 0 < b < n:
                ids = self._plain_ids(ids, "evict_blocks")
                break
        if len(ids) > 1 and len(set(ids)) != len(ids):
            self._check_ids(ids, "evict_blocks")
        if self.kv_event_queue is not None:
            self._publish_removed(cast("list[int]", ids))
        flags = self._hash_flags
        for b in cast("list[int]", ids):
            flags[b] = 0
        if self._stamped is not None:  # a free block that loses its hash joins first fit
            self._stamped.lost_hash(cast("list[int]", ids))
        if self._track:
            self._state.host_written(cast("list[int]", ids))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash if no block is held; refuse (False, nothing changes) otherwise.

        With events on, a reset publishes `AllBlocksCleared` (a refusal publishes nothing).

        Cost: O(num_gpu_blocks).
        """
        num_usable = self.num_gpu_blocks - 1 - len(self.quarantined)
        if self.free_block_queue.num_free_blocks != num_usable:
            return False
        self.cached_block_hash_to_block = {}
        self._registered_hash = [None] * self.num_gpu_blocks
        self._apply(_HASH, "zero_")
        self._state.host_written()
        if self._stamped is not None:
            self._stamped.reset()
        if self.kv_event_queue is not None:
            self.kv_event_queue.append(AllBlocksCleared())
        return True

    def is_block_writable(self, block_id: BlockId) -> bool:
        """Whether a request may write into `block_id`: not null, held once, not hashed.

        Raises:
            InvalidBlock: block_id is not a block of this pool.

        Cost: O(1), host only.
        """
        if not is_int(block_id) or not 0 <= block_id < self.num_gpu_blocks:
            raise InvalidBlock(
                f"is_block_writable: block_id={block_id!r} is not a block of this pool "
                f"(ids 0..{self.num_gpu_blocks - 1})"
            )
        return block_id != NULL_BLOCK_ID and not self._hash_flags[block_id] and self._ref[block_id] == 1

    def writable_mask(self, block_ids: torch.Tensor) -> torch.Tensor:
        """`is_block_writable` for a batch of in-range ids, as a device bool tensor (no host sync).

        The rule is kvspec.spec.invariants.is_block_writable's, evaluated on the
        device; tests check the two agree on every reachable state.
        """
        return (block_ids != NULL_BLOCK_ID) & (self.ref_cnt[block_ids] == 1) & (self.has_hash[block_ids] == 0)

    # --- corrupt blocks -------------------------------------------------------------------

    def quarantine_blocks(self, block_ids: BlockIds) -> None:
        """Retire blocks whose content is corrupt: never hit again, never reallocated.

        Each block loses its hash now (no request can hit it again). A free
        block leaves the free queue and is quarantined now; a held one is
        quarantined when its last holder frees it (its holders keep it until
        then: their block tables are append-only). Quarantining a block twice
        changes nothing. With events on, each hash dropped publishes a
        `BlockRemoved` now, in the order given; the later retirement publishes nothing.

        Raises:
            InvalidBlock: an id is out of range or the null block.
            InvalidRequest: an id is named twice.

        Cost: O(len(block_ids)) Python steps over the host face, at any length (a rare call).
        """
        if isinstance(block_ids, torch.Tensor):
            self._check_tensor(block_ids, "quarantine_blocks")
            block_ids = cast("list[BlockId]", block_ids.tolist())
        ids = self._plain_ids(block_ids, "quarantine_blocks")
        ref, flags, corrupt = self._ref, self._hash_flags, self._corrupt
        queue = self.free_block_queue
        if self.kv_event_queue is not None:
            # The key leaves the hash table now: a router must hear it (the module docstring).
            self._publish_removed(ids)
        retired: list[int] = []
        for b in ids:
            flags[b] = 0
            if ref[b] > 0:
                if not corrupt[b]:
                    corrupt[b] = 1
                    self._num_corrupt_held += 1
            elif queue.is_free(b):
                retired.append(b)
        queue.remove_list(retired)
        for b in retired:
            self.quarantined[b] = None
        if self._track:
            self._state.host_written(ids)

    # --- observation ----------------------------------------------------------------------

    def snapshot(
        self, block_tables: tuple[tuple[str, tuple[BlockId, ...]], ...] | None = None, kv_groups: tuple[str, ...] = ()
    ) -> Snapshot:
        """The state in the spec's normal form, read from the host face (stale map entries left out).

        The host face, which every operation leaves current: reading a state needs no device work, and a
        call's writes may still wait for the device face (gpu_impl.mirror). check_invariants reads
        the device face and requires it equal.

        `block_tables` and `kv_groups` are the request level's, passed through (None and () at the pool level).

        Cost: O(num_gpu_blocks).
        """
        flags = self._hash_flags.tolist()
        block_hash: list[BlockHash | None] = [None] * self.num_gpu_blocks
        for b, h in enumerate(self._registered_hash):
            if h is not None and flags[b]:
                block_hash[b] = h
        table = self.cached_block_hash_to_block
        live = ((h, tuple(BlockId(b) for b in entry if flags[b])) for h, entry in table.items())
        return Snapshot(
            num_gpu_blocks=self.num_gpu_blocks,
            enable_caching=self.enable_caching,
            ref_cnt=tuple(self._ref.tolist()),
            block_hash=tuple(block_hash),
            free_queue=tuple(self.free_block_queue.ordered().tolist()),
            hash_to_blocks=canonical_hash_to_blocks(tuple((h, blocks) for h, blocks in live if blocks)),
            block_tables=block_tables,
            quarantined=tuple(BlockId(b) for b in self.quarantined),
            kv_groups=kv_groups,
        )

    def check_invariants(self) -> None:
        """Check every state invariant via the spec's predicates, then the representation.

        Raises:
            InvariantViolation: naming the first spec invariant that fails.
            AssertionError: the two faces, the hash map or the key index disagree.
        """
        check_all(self.snapshot())
        problems = self._state.representation_errors()
        assert not problems, "mirrored state: " + "; ".join(problems)
        flags = self._hash_flags
        for h, entry in self.cached_block_hash_to_block.items():
            assert entry, f"the hash map keeps an empty entry for {h!r}"
            for b in entry:
                assert self._registered_hash[b] == h, (
                    f"block {b} is in the entry of {h!r} but was last registered under {self._registered_hash[b]!r}"
                )
        for b in torch.nonzero(self._has_hash_host).squeeze(1).tolist():
            registered = self._registered_hash[b]
            assert registered is not None and b in self.cached_block_hash_to_block.get(registered, {}), (
                f"block {b} is flagged as hashed but not in the hash map"
            )
        assert not flags[NULL_BLOCK_ID], "the null block is flagged as hashed"
        flag_values = torch.cat((self.has_hash, self.is_corrupt))
        assert bool(((flag_values == 0) | (flag_values == 1)).all()), "a hash or corrupt flag is neither 0 nor 1"
        corrupt = torch.nonzero(self.is_corrupt).squeeze(1)
        assert corrupt.numel() == self._num_corrupt_held, (
            f"{corrupt.numel()} blocks flagged corrupt but the count is {self._num_corrupt_held}"
        )
        assert bool((self.ref_cnt[corrupt] > 0).all()), "a block flagged corrupt is not held"
        problems = self.free_block_queue.representation_errors()
        assert not problems, "free queue: " + "; ".join(problems)
