"""The free blocks of a keyed policy (seed 002): first fit, then the key, as host metadata.

The spec derives a keyed policy's free queue (kvspec.spec.ordering): the free
blocks without a hash by id (first fit), then the hashed ones by
`eviction_key`, every key read from stamps a logical clock writes
(kvspec.spec.ops: an allocation and a hit stamp the last access and count an
access, a free stamps the last access of every block it names, a
registration stamps `registered_at`).

Design choice, the order is host metadata, as the hash map is (see
gpu_impl.block_pool): every take's answer is needed on the host (it becomes a
request's block table), and a free block's key never changes while it is
free (only held blocks are stamped; a hit takes the block out), so two binary
heaps keep the order at O(log n) a block: the ids of the free blocks without
a hash, and the `eviction_key` of the free hashed ones (it opens with the
tier a free with `evict_first` gives and ends with the block id), each
packed into one int, its components side by side in fixed-width fields: the
ints compare as the tuples do, and a heap of ints pops about 10x faster than
one of tuples (1e5 pops from 1e6 entries, measured: 0.08 s against 0.74).
Removals (a hit, a quarantine, a block losing its hash) are lazy: an entry
is live while its block is free and its key is the one recorded in `_live`
(a list indexed by block, as the pool's block -> hash map is: a long free
sets 1e5 scattered entries of it, a long take clears them); stale entries
are skipped when they reach the top, and the cached heap is rebuilt when
they outnumber the live ones. Stamps are three host arrays beside it.

The rejected alternative, built and measured (`kvspec bench gpu --profile
lru-timestamp`, one CPU thread, torch 2.13): the stamps in the pool's
mirrored state and a selection per take over the device face (one `nonzero`
for first fit, a stable sort of the free hashed blocks' keys when it evicts):
a constant number of kernels, but O(num_gpu_blocks log num_gpu_blocks) work
for every take that evicts, 97 ms for one block in a 1e6-block pool against
the reference's 36 us, and, on a device, a wait for every answer anyway.

Cost: a take, a hit and a free O(log n) amortized per block; a registration
O(1) per block; `ordered` (the snapshot only) O(n log n). Long batches come
in as tensors: their stamps go in one scatter each (the stamp arrays are
shared with CPU tensors), and the keys of the blocks a long free makes free
are computed column by column, by `eviction_key` itself on int64 tensors,
then packed and pushed; a weight whose score could pass int64 falls back to
Python's ints. Measured side by side (`kvspec bench gpu --profile
lru-timestamp --pools 1e6 --batches 1e5`, CPU, two runs each, reference /
gpu_impl, lists / ids in a tensor): a take 1.70-2.44x / 1.38-1.44x before,
4.42-5.38x / 3.38-4.10x after; a free 1.46-1.48x / 1.08-1.16x before,
3.26-3.44x / 2.74-3.45x after; a touch 1.80-2.35x / 2.97-3.58x before,
2.44-2.65x / 8.20-8.70x after. Then (2026-12-07) `_live` became a list (a
1e5-entry `dict.update` into a 1e6-entry dict took 144 ms of a 358 ms
free), a long free finds its hashed blocks by one gather of the pool's
flags instead of a Python loop, and a long take stamps in three scatters;
the same benchmark, two runs each, gpu_impl's time with lists (ratio) /
with ids in a tensor: a take 195-201 ms (4.24-4.67x) / 219-268 ms before,
106-110 ms (7.31-7.32x) / 143-159 ms after; a free 149-186 ms
(2.83-3.11x) / 138-175 ms before, 103-104 ms (3.39-3.40x) / 87-88 ms
after; a touch 102-141 ms (2.46-2.97x) / 56-75 ms before, 82-84 ms (3.34x)
/ 48-53 ms after. What is left is a pop per block: 1e5 `heappop`s from a
1e6-entry heap and the Python loop around them, about 0.1 s.
"""

from __future__ import annotations

import array
import heapq
import itertools
import operator
from collections.abc import Iterable, Sequence
from typing import cast

import torch

from kvspec.spec.ordering import PY, ProfileRule, eviction_key

__all__ = ["StampedFreeBlocks"]

Key = tuple[int, ...]
# Bits per component of a packed key, beyond the weight's: stamps, access counts and block ids are
# int64 (the stamp arrays' type), and a score q * last_access + p * accesses is below (p + q) * 2**63.
_FIELD_BITS = 64


class StampedFreeBlocks:
    """The free blocks in a keyed policy's order, and the stamps that order reads.

    The pool owns this and calls it only with blocks in the right state: `take`
    with n <= num_free_blocks, `remove_list` with free blocks, `freed*` naming
    held blocks. It never sees ref counts; it reads the pool's hash flags
    (host face) to place a newly free block.
    """

    def __init__(
        self,
        num_gpu_blocks: int,
        rule: ProfileRule,
        hash_flags: memoryview,
        hash_flags_tensor: torch.Tensor,
        device: torch.device,
    ) -> None:
        """Blocks 1..num_gpu_blocks-1 free, never stamped (block 0 is the null block and never free).

        Args:
            num_gpu_blocks: the pool size, the null block included.
            rule: the keyed policy.
            hash_flags: the pool's hash flags (host face): 1 for a block with a hash.
            hash_flags_tensor: the same flags as a CPU tensor over the same memory, for long batches.
            device: where `ordered` puts its tensor.

        Cost: O(num_gpu_blocks).
        """
        assert rule.keyed, f"profile {rule.name!r} is a queue policy: gpu_impl.free_queue keeps it"
        n = num_gpu_blocks
        self._rule = rule  # fixed
        self._hash_flags = hash_flags
        self._hash_flags_t = hash_flags_tensor
        self._device = device  # fixed
        self.clock = 0  # the next stamp
        self.last_access = array.array("q", [0]) * n
        self.num_accesses = array.array("q", [0]) * n
        self.registered_at = array.array("q", [0]) * n
        self.is_evict_first = bytearray(n)  # 1 for a block whose last free asked to evict it first
        self._free = bytearray(n)  # 1 for a free block
        # The same arrays as CPU tensors sharing their memory, for the long batches' stamps (one scatter each).
        self._last_access_t = _shared_tensor(self.last_access, torch.int64)
        self._num_accesses_t = _shared_tensor(self.num_accesses, torch.int64)
        self._registered_at_t = _shared_tensor(self.registered_at, torch.int64)
        self._is_evict_first_t = _shared_tensor(self.is_evict_first, torch.uint8)
        self._free_t = _shared_tensor(self._free, torch.uint8)
        for b in range(1, n):
            self._free[b] = 1
        self.num_free_blocks = max(n - 1, 0)
        self._first_fit = list(range(1, n))  # ids of free blocks without a hash (sorted: already a heap)
        weight = rule.weight
        self._weight_terms = weight.numerator + weight.denominator  # fixed: a score is below this times 2**63
        self._width = _FIELD_BITS + self._weight_terms.bit_length()  # fixed
        self._id_mask = (1 << self._width) - 1  # a packed key's last field: the block id
        self._cached: list[int] = []  # the packed keys of free hashed blocks, lazily deleted
        # Block -> the packed key of its live entry in _cached, 0 for none (a packed key ends with the block
        # id, so it is never 0); a list, not a dict: a long free sets 1e5 scattered entries of a 1e6-entry map
        # (measured: see _add_cached_batch).
        self._live = [0] * n
        self._num_live = 0  # the nonzero entries of _live
        self.key_capacity = 0  # no key index in the pool's state

    def _spec_key(self, b: int) -> Key:
        """Block b's eviction key, the spec's tuple."""
        stamps = self.last_access[b], self.num_accesses[b], self.registered_at[b], bool(self.is_evict_first[b])
        return cast(Key, eviction_key(self._rule, b, *stamps, PY))

    def _key(self, b: int) -> int:
        """Block b's eviction key, packed."""
        return self._pack(self._spec_key(b))

    def _pack(self, key: Key) -> int:
        """A key as one int that orders as the key does: each component (a non-negative int below
        2**width, see _FIELD_BITS) in a field of `width` bits, the first in the highest."""
        packed, width = 0, self._width
        for component in key:
            packed = (packed << width) | int(component)
        return packed

    def _pack_columns(self, columns: Sequence[Iterable[int]]) -> list[int]:
        """`_pack` for many keys given component by component, in C-level maps (no Python frame a key)."""
        shift = itertools.repeat(self._width)
        packed: Iterable[int] = columns[0]
        for column in columns[1:]:
            packed = map(operator.or_, map(operator.lshift, packed, shift), column)
        return list(packed)

    def _add(self, b: int) -> None:
        """A block that just became free takes its place (it has no live entry: only free blocks have one)."""
        if self._hash_flags[b]:
            key = self._key(b)
            self._live[b] = key
            self._num_live += 1
            heapq.heappush(self._cached, key)
            self._compact()
        else:
            heapq.heappush(self._first_fit, b)

    def _stamp(self, stamps: array.array[int], block_ids: Sequence[int]) -> None:
        clock = self.clock
        for i, b in enumerate(block_ids):
            stamps[b] = clock + i
        self.clock += len(block_ids)

    def _stamp_tensor(self, stamps: torch.Tensor, block_ids: torch.Tensor) -> None:
        """`_stamp` for a batch in a tensor: one scatter (ids are distinct: the pool checked them)."""
        k = block_ids.numel()
        stamps.index_copy_(0, block_ids, torch.arange(self.clock, self.clock + k, dtype=torch.int64))
        self.clock += k

    def _add_cached_batch(self, block_ids: torch.Tensor, evict_first: bool) -> None:
        """`_add` for many free hashed blocks at once: their keys computed column by column, then pushed.

        The key is still `eviction_key`'s, evaluated on int64 tensors of stamps (its arithmetic is
        the same on ints and tensors); the tier is one value, since every block of a free shares it.
        A weight whose score could pass int64 (`lru-lfu:W` with a fine W) takes Python's ints, block
        by block: stamps and access counts are below the clock, so the score is below (p + q) * clock.
        """
        if self._weight_terms * max(self.clock, 1) >= 2**63:
            for b in cast("list[int]", block_ids.tolist()):
                self._add(b)
            return
        key = eviction_key(
            self._rule,
            block_ids,
            self._last_access_t.index_select(0, block_ids),
            self._num_accesses_t.index_select(0, block_ids),
            self._registered_at_t.index_select(0, block_ids),
            evict_first,
            PY,
        )
        k = block_ids.numel()
        columns = [
            cast("list[int]", c.tolist()) if isinstance(c, torch.Tensor) else itertools.repeat(cast(int, c), k)
            for c in key
        ]
        keys = self._pack_columns(columns)
        live = self._live  # none of the blocks has a live entry: they were not free
        for b, packed in zip(cast("list[int]", block_ids.tolist()), keys):
            live[b] = packed
        self._num_live += len(keys)
        cached, push = self._cached, heapq.heappush
        for packed in keys:  # O(1) comparisons where the fresh last access leads the key (lru-timestamp)
            push(cached, packed)
        self._compact()

    def _compact(self) -> None:
        """Rebuild the cached heap from the live entries when stale ones dominate it. Cost: O(n) when it does."""
        if len(self._cached) > 2 * self._num_live + 64:  # the scan is paid for by the stale entries it drops
            live, id_mask = self._live, self._id_mask
            # A set: a block that left and came back under the same key (block-age: a hit, then a free) has a
            # stale entry equal to its live one, and only one of them may stay.
            self._cached = list({key for key in self._cached if live[key & id_mask] == key})
            heapq.heapify(self._cached)

    # --- the order ------------------------------------------------------------------------------

    def _pop(self, n: int) -> list[int]:
        """The n free blocks the policy gives out next (first fit, then the smallest keys), out of the heaps."""
        taken: list[int] = []
        free, flags, first_fit, pop = self._free, self._hash_flags, self._first_fit, heapq.heappop
        while first_fit and len(taken) < n:
            b = pop(first_fit)
            if free[b] and not flags[b]:  # else quarantined, or re-added under its hash
                taken.append(b)
        cached, live, id_mask, first_fit_taken = self._cached, self._live, self._id_mask, len(taken)
        while len(taken) < n:
            key = pop(cached)
            b = key & id_mask
            if live[b] == key:  # else stale: the block left, or its key changed
                live[b] = 0
                taken.append(b)
        self._num_live -= len(taken) - first_fit_taken
        return taken

    def take(self, n: int) -> list[int]:
        """Take the n blocks the policy gives out first, in order, stamped as allocated (one access each)."""
        taken = self._pop(n)
        free, accesses = self._free, self.num_accesses
        for b in taken:
            free[b] = 0
            accesses[b] = 1
        self._stamp(self.last_access, taken)
        self.num_free_blocks -= n
        return taken

    def take_long(self, n: int) -> tuple[list[int], torch.Tensor]:
        """`take` for a long batch: the ids as a list and as a CPU tensor, the stamps in three scatters."""
        taken = self._pop(n)
        ids = _shared_tensor(array.array("q", taken), torch.int64)
        self._free_t.index_fill_(0, ids, 0)
        self._num_accesses_t.index_fill_(0, ids, 1)
        self._stamp_tensor(self._last_access_t, ids)
        self.num_free_blocks -= n
        return taken, ids

    def ordered(self) -> torch.Tensor:
        """Every free block in the policy's order (for the snapshot). Cost: O(n log n)."""
        free, flags = self._free, self._hash_flags
        first_fit = sorted(b for b in set(self._first_fit) if free[b] and not flags[b])
        cached = [key & self._id_mask for key in sorted(key for key in self._live if key)]
        return torch.tensor(first_fit + cached, dtype=torch.int64, device=self._device)

    def is_free(self, block_id: int) -> bool:
        """Whether `block_id` is free. Cost: O(1)."""
        return bool(self._free[block_id])

    # --- what the pool's operations do to it ----------------------------------------------------

    def hit_list(self, block_ids: Sequence[int], was_free: Sequence[int]) -> None:
        """A hit on `block_ids`: each is stamped and counts an access; the free ones among them leave."""
        accesses = self.num_accesses
        for b in block_ids:
            accesses[b] += 1
        self._stamp(self.last_access, block_ids)
        self.remove_list(was_free)

    def freed_list(self, block_ids: Sequence[int], newly_free: Sequence[int], evict_first: bool) -> None:
        """A free naming `block_ids` (every one stamped, in order, and tiered); `newly_free` join the free blocks."""
        self._stamp(self.last_access, block_ids)
        tier = self.is_evict_first
        for b in block_ids:
            tier[b] = evict_first
        for b in newly_free:
            self._free[b] = 1
            self._add(b)
        self.num_free_blocks += len(newly_free)

    def registered_list(self, block_ids: Sequence[int]) -> None:
        """`block_ids` registered under their hashes now (block-age reads when)."""
        self._stamp(self.registered_at, block_ids)

    def remove_list(self, block_ids: Sequence[int]) -> None:
        """Free blocks that stop being free (a hit, a quarantine); their entries go stale."""
        free, live, num_live = self._free, self._live, self._num_live
        for b in block_ids:
            free[b] = 0
            if live[b]:
                live[b] = 0
                num_live -= 1
        self._num_live = num_live
        self.num_free_blocks -= len(block_ids)

    def lost_hash(self, block_ids: Sequence[int]) -> None:
        """Blocks whose hash was just dropped (`evict_blocks`): the free ones among them join first fit."""
        free, live = self._free, self._live
        for b in block_ids:
            if free[b] and live[b]:
                live[b] = 0
                self._num_live -= 1
                heapq.heappush(self._first_fit, b)

    def reset(self) -> None:
        """Every hash was dropped (`reset_prefix_cache`): every free block is first fit now. Cost: O(n)."""
        self._first_fit = [b for b in range(len(self._free)) if self._free[b]]
        self._cached, self._live, self._num_live = [], [0] * len(self._free), 0

    # --- the same for long batches (ids as device tensors) --------------------------------------

    def hit(self, block_ids: torch.Tensor, was_free: torch.Tensor) -> None:
        """`hit_list` for a batch in a tensor: the stamps in two scatters."""
        self._num_accesses_t.index_add_(0, block_ids, torch.ones(1, dtype=torch.int64).expand(block_ids.numel()))
        self._stamp_tensor(self._last_access_t, block_ids)
        self.remove_list(was_free.tolist())

    def freed(self, block_ids: torch.Tensor, newly_free: torch.Tensor, evict_first: bool) -> None:
        """`freed_list` for a batch in a tensor: the stamps in scatters, the cached blocks' keys by column."""
        self._stamp_tensor(self._last_access_t, block_ids)
        self._is_evict_first_t.index_fill_(0, block_ids, int(evict_first))
        if newly_free.numel() == 0:
            return
        self._free_t.index_fill_(0, newly_free, 1)
        is_hashed = self._hash_flags_t.index_select(0, newly_free) != 0
        hashed = newly_free[is_hashed]
        if hashed.numel() < newly_free.numel():
            first_fit, push = self._first_fit, heapq.heappush
            for b in cast("list[int]", newly_free[~is_hashed].tolist()):
                push(first_fit, b)
        if hashed.numel():
            self._add_cached_batch(hashed, evict_first)
        self.num_free_blocks += newly_free.numel()

    def registered(self, block_ids: torch.Tensor) -> None:
        """`registered_list` for a batch in a tensor: one scatter."""
        self._stamp_tensor(self._registered_at_t, block_ids)

    # --- checking -------------------------------------------------------------------------------

    def representation_errors(self) -> list[str]:
        """Where the heaps, the free flags and the stamps disagree (for check_invariants). Cost: O(n log n)."""
        errors: list[str] = []
        free, flags = self._free, self._hash_flags
        if free and free[0]:
            errors.append("the null block is flagged free")
        counted = sum(free)
        if counted != self.num_free_blocks:
            errors.append(f"{counted} blocks are flagged free but num_free_blocks={self.num_free_blocks}")
        first_fit = {b for b in self._first_fit if free[b] and not flags[b]}
        for b in range(1, len(free)):
            if free[b] and not flags[b] and b not in first_fit:
                errors.append(f"free block {b} has no hash but no first-fit entry")
            if free[b] and flags[b] and self._live[b] != self._key(b):
                errors.append(f"free block {b} has a hash but no live entry under its key {self._spec_key(b)}")
        if any(key and not (free[b] and flags[b]) for b, key in enumerate(self._live)):
            errors.append("a live cached entry names a block that is not free with a hash")
        if sum(key != 0 for key in self._live) != self._num_live:
            errors.append(f"{sum(key != 0 for key in self._live)} live cached entries but _num_live={self._num_live}")
        stamps = [*self.last_access, *self.registered_at]
        if any(s != 0 and s >= self.clock for s in stamps):
            errors.append(f"a stamp is not below the clock ({self.clock})")
        return errors


def _shared_tensor(buffer: array.array[int] | bytearray, dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor over `buffer`'s memory: a write through either is seen by the other."""
    return torch.frombuffer(buffer, dtype=dtype) if len(buffer) else torch.empty(0, dtype=dtype)
