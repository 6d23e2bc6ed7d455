"""The free blocks of a keyed policy (seed 002): first fit, then the key, as host metadata.

The spec derives a keyed policy's free queue (kvspec.spec.ordering): the
free blocks without a hash by id (first fit), then the hashed ones by
`eviction_key`, every key read from stamps a logical clock writes
(kvspec.spec.ops: an allocation and a hit stamp the last access and count an
access, a free stamps the last access of every block it names, a
registration stamps `registered_at`).

Design choice, the order is host metadata, as the hash map is (see
gpu_impl.block_pool): every take's answer is needed on the host (it becomes
a request's block table), and a free block's key never changes while it is
free (only held blocks are stamped; a hit takes the block out). The free
blocks without a hash are a binary heap of ids. The free hashed ones are
ordered by their `eviction_key` (it opens with the tier a free with
`evict_first` gives and ends with the block id), packed into one int, its
components in fields just wide enough for the pool's ids, the stamps and the
access counts so far (`field_widths`; widened, and every entry repacked,
when the clock or a hit's count passes them): the ints compare as the tuples
do, and under lru-timestamp, block-age or lfu a key fits in int64 (1 + 32 +
20 bits for a 1e6-block pool, lfu's 8 more for the count), so a long free
packs and sorts its keys in tensor operations. Those keys live in two parts:
a run in ascending order and a heap for the rest. A free stamps the blocks
it names with fresh stamps, so under lru-timestamp every key it adds is the
largest yet and extends the run at once, and under lfu a long free's blocks
with the same count fall together into one gap of the run and go in as one
slice; a take reads the run from its head in slices, up to the heap's
smallest, a Python step or (a long take) a few tensor operations a slice
instead of a heap pop a block. Keys that come out of order one by one
(block-age's) go through the heap at O(log n). Removals (a hit, a
quarantine, a block losing its hash) are lazy: an entry is live while its
block is free and its key has the tag recorded in `_live` (indexed by block:
the key itself, or, for a key wider than int64 whose lowest int64 group
holds the last access, that group, which no other entry of the block shares,
since only a free makes an entry and every free stamps the last access
afresh; int64 with a tensor over it while the tags fit, so a long free
writes it in one scatter, a long take checks its slices in gathers and a
long hit only clears free flags); stale entries are skipped when reached,
and dropped when they outnumber the live ones. Stamps are three host arrays
beside it.

The rejected alternative, built and measured (`kvspec bench gpu --profile
lru-timestamp`, one CPU thread, torch 2.13): the stamps in the pool's
mirrored state and a selection per take over the device face (one `nonzero`
for first fit, a stable sort of the free hashed blocks' keys when it
evicts): a constant number of kernels, but O(num_gpu_blocks log
num_gpu_blocks) work for every take that evicts, 97 ms for one block in a
1e6-block pool against the reference's 36 us, and, on a device, a wait for
every answer anyway.

Cost: a take, a hit and a free O(log n) amortized per block, O(1) for a key
that extends the run; a registration O(1) per block; `ordered` (the snapshot
only) O(n log n); a widening O(n log n), once per doubling of the clock or
of the largest access count. Long batches come in as tensors: their stamps
go in one scatter each (the stamp arrays are shared with CPU tensors), and
the keys of the blocks a long free makes free are computed column by column,
by `eviction_key` itself on int64 tensors, packed by groups of fields that
fit in int64 and sorted there, a key wider than int64 made a Python int from
its groups' bytes in one C loop (`join_int64_groups`); a field wider than
int64 (a fine `lru-lfu:W`) falls back to Python's ints block by block. The
measurements behind each step are in docs/reference/gpu-impl.md.
"""

from __future__ import annotations

import array
import bisect
import heapq
import itertools
import operator
import pickle
from collections.abc import Sequence
from typing import cast

import torch

from kvspec.spec.ordering import PY, ProfileRule, eviction_key

__all__ = ["StampedFreeBlocks", "field_offsets", "field_widths", "join_int64_groups", "pack"]

Key = tuple[int, ...]
# Packed keys' stamp fields start this wide, and widen a bit at a time (a widening repacks every entry, so
# it is paid once per doubling of the clock, past 2**32 stamps). lru-timestamp's and block-age's keys of a
# 1e6-block pool fit in int64 (1 + stamp bits + 20) until 2**42 stamps, and a long free packs them in
# tensor operations.
_FIRST_STAMP_BITS = 32
# An access count restarts at 1 whenever its block is allocated and only a hit adds to it, so its field
# starts far narrower than a stamp's (and widens the same way, when a hit counts past it): lfu's keys of a
# 1e6-block pool are 1 + 8 + 32 + 20 = 61 bits, an int64, while no block is hit 255 times in one stay.
_FIRST_ACCESS_BITS = 8
_INT64_BITS = 63  # the bits of a non-negative int64
_PICKLE_LONG1 = 0x8A  # pickle's opcode for an int given by a length byte and its bytes (pickletools: LONG1)
# A long free's keys that fall in one gap of the run go in there when that moves at most this many of the
# run's entries a key: a heap push and its pop cost about 360 ns, moving an entry about 5 (measured on a
# 1e6-entry run, docs/reference/gpu-impl.md); and at most this many such slices a call.
_TAIL_MOVES_PER_PUSH = 64
_MAX_SLICES = 8


def field_widths(rule: ProfileRule, max_block_id: int, stamp_bound: int, access_bound: int) -> tuple[int, ...]:
    """The bits of each component of a packed key, for block ids up to `max_block_id`, stamps up to
    `stamp_bound` and access counts up to `access_bound`: the widest key's, since `eviction_key` never
    decreases in its arguments.

    >>> from kvspec.spec.ordering import profile_rule
    >>> field_widths(profile_rule("lru-timestamp"), 1023, 2**32 - 1, 2**8 - 1)  # tier, last access, block id
    (1, 32, 10)
    >>> field_widths(profile_rule("lfu"), 1023, 2**32 - 1, 2**8 - 1)  # tier, accesses, last access, block id
    (1, 8, 32, 10)
    """
    widest = eviction_key(rule, max_block_id, stamp_bound, access_bound, stamp_bound, False, PY)
    return tuple(int(cast(int, c)).bit_length() for c in widest)


def join_int64_groups(parts: Sequence[torch.Tensor], offsets: Sequence[int], bits: int) -> list[int]:
    """Python ints `sum(part << offset)` from non-negative int64 tensors whose bits do not overlap (the
    groups of a packed key wider than int64), `bits` wide in all.

    Made in one C loop: the ints' bytes are written in tensor operations as a pickle of a list of LONG1
    ints (pickle's documented opcode: a length byte, then the bytes of the int's two's complement, the
    lowest first) and unpickled. Joining the groups in Python's ints costs a shift and an or a key, two
    ints made and dropped: 1e5 keys of 87 bits in 15-19 ms against 7-9 (docs/reference/gpu-impl.md).

    >>> join_int64_groups([torch.tensor([1, 2]), torch.tensor([5, 0])], [60, 0], 62)
    [1152921504606846981, 2305843009213693952]
    """
    k = parts[0].numel()
    width = bits // 8 + 1  # whole bytes, and a sign bit (0) above the key's
    buffer = bytearray(1 + k * (2 + width) + 2)
    buffer[0], buffer[-2:] = ord("("), b"l."  # MARK, the ints, LIST and STOP
    records = torch.frombuffer(buffer, dtype=torch.uint8)[1:-2].view(k, 2 + width)
    records[:, 0], records[:, 1] = _PICKLE_LONG1, width
    bytes_ = torch.zeros((k, width), dtype=torch.int64)
    first_bits = 8 * torch.arange(width)  # byte j holds the key's bits 8j .. 8j + 7
    for part, offset in zip(parts, offsets):
        # The group's bits in each byte's lowest 8: shifted down to it (the bytes from the group's lowest bit
        # up; by 63, nothing of a non-negative int64 is left) or up (the byte its lowest bit falls in; by 8, a
        # byte wholly below the group gets none). The bits above the lowest 8 are dropped as uint8 takes them.
        down, up = (first_bits - offset).clamp(0, _INT64_BITS), (offset - first_bits).clamp(0, 8)
        bytes_ |= part[:, None] >> down << up
    records[:, 2:] = bytes_  # int64 to uint8: modulo 256
    return cast("list[int]", pickle.loads(buffer))  # our own bytes: nothing but ints to load


def _ascending(parts: list[torch.Tensor]) -> list[torch.Tensor]:
    """Distinct keys given by int64 groups (the highest first), in ascending order: as they come when they
    already are (a free's fresh stamps usually put them so: one check), else by stable sorts, the lowest
    group first."""
    later_larger = parts[-1][1:] > parts[-1][:-1]
    for part in reversed(parts[:-1]):
        later_larger = (part[1:] > part[:-1]) | ((part[1:] == part[:-1]) & later_larger)
    if bool(later_larger.all()):
        return parts
    if len(parts) == 1:  # one sort, not an argsort and a gather (block-age's unsorted frees pay it)
        return [parts[0].sort().values]
    order = torch.arange(parts[0].numel())
    for part in reversed(parts):
        order = order[part[order].argsort(stable=True)]
    return [part[order] for part in parts]


def field_offsets(widths: Sequence[int]) -> tuple[int, ...]:
    """Where each field of a packed key starts, its lowest bit: the first field in the highest bits.

    >>> field_offsets((1, 4, 2))
    (6, 2, 0)
    """
    return tuple(sum(widths[i + 1 :]) for i in range(len(widths)))


def pack(key: Key, offsets: Sequence[int]) -> int:
    """A key as one int that orders as the key does: each component shifted to its field (`field_offsets`;
    every component must fit its field, so the fields do not overlap and adding them is or-ing them).

    >>> pack((1, 5, 3), field_offsets((1, 4, 2)))  # 1 | 0101 | 11
    87
    """
    return sum(map(operator.lshift, key, offsets))


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
        python_path_max: int,
    ) -> None:
        """Blocks 1..num_gpu_blocks-1 free, never stamped (block 0 is the null block and never free).

        Args:
            num_gpu_blocks: the pool size, the null block included.
            rule: the keyed policy.
            hash_flags: the pool's hash flags (host face): 1 for a block with a hash.
            hash_flags_tensor: the same flags as a CPU tensor over the same memory, for long batches.
            device: where `ordered` puts its tensor.
            python_path_max: the pool's longest Python loop; a long take reads a longer slice of the
                order in tensor operations (a shorter one costs less as a loop).

        Cost: O(num_gpu_blocks).
        """
        assert rule.keyed, f"profile {rule.name!r} is a queue policy: gpu_impl.free_queue keeps it"
        n = num_gpu_blocks
        self._rule = rule  # fixed
        self._hash_flags = hash_flags
        self._hash_flags_t = hash_flags_tensor
        self._device = device  # fixed
        self._python_path_max = python_path_max  # fixed
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
        self._max_block_id = max(n - 1, 0)  # fixed
        # Whether the key reads the access count (lfu, lru-lfu): only then must a hit's counts fit their field.
        self._reads_accesses = eviction_key(rule, 0, 0, 1, 0, False, PY) != eviction_key(rule, 0, 0, 0, 0, False, PY)
        self._last_access_field = _last_access_field(rule)
        self._set_widths(_FIRST_STAMP_BITS, _FIRST_ACCESS_BITS)
        # The packed keys of the free hashed blocks (the module docstring), stale entries skipped when reached:
        # a run in ascending order, read from _run_head on, and a heap of the keys that came in below its last.
        self._run: list[int] = []
        self._run_head = 0
        self._heap: list[int] = []
        # Block -> the tag (`_tag_mask`) of its latest entry, 0 for none: the entry is live while its block is
        # free and its key has this tag. Indexed by block: a long free sets 1e5 scattered entries.
        self._live, self._live_t = self._empty_live()
        self._num_live = 0  # the free hashed blocks: the live entries

    def _set_widths(self, stamp_bits: int, access_bits: int) -> None:
        """Pack keys for stamps below 2**stamp_bits and access counts below 2**access_bits."""
        self._stamp_bits, self._access_bits = stamp_bits, access_bits
        self._stamp_bound = (1 << stamp_bits) - 1  # no stamp above this may be packed
        self._access_bound = (1 << access_bits) - 1  # nor an access count above this one
        self._widths = field_widths(self._rule, self._max_block_id, self._stamp_bound, self._access_bound)
        self._offsets = field_offsets(self._widths)
        self._id_mask = (1 << self._widths[-1]) - 1  # a packed key's last field: the block id
        self._groups = _int64_groups(self._widths)
        self._int64_keys = self._groups is not None and len(self._groups) == 1
        # An entry's tag, what `_live` records of its key: the key itself, unless the key spans int64 groups and
        # the lowest holds the last access: then that group (-1 keeps every bit). A free stamps the last access
        # of every block it names afresh, and only a free makes an entry, so no two entries of a block share a
        # last access, nor a tag; and a tag that fits in int64 goes into `_live` in one scatter.
        low = self._groups[-1][0] if self._groups is not None else len(self._widths)
        tag_is_low = not self._int64_keys and self._last_access_field is not None and self._last_access_field >= low
        self._tag_mask = (1 << sum(self._widths[low:])) - 1 if tag_is_low else -1

    def _empty_live(self) -> tuple[array.array[int] | list[int], torch.Tensor | None]:
        """A block -> tag map with no entry: int64, with a CPU tensor over it, while tags fit; else Python's ints."""
        n = len(self._free)
        if self._int64_keys or self._tag_mask != -1:
            live = array.array("q", [0]) * n
            return live, _shared_tensor(live, torch.int64)
        return [0] * n, None

    def _widen(self, accesses: int = 0) -> None:
        """Widen the fields until the clock and `accesses` fit them, and repack every entry. Called when the
        clock passes the stamp fields, before packing a key and before flagging newly free blocks (they have
        no entry yet), and when a hit counts `accesses` past the access field (after the blocks it hit left
        the order). Cost: O(n log n), once per doubling of the clock or of the largest access count."""
        self._set_widths(  # stamps and counts are int64: 63 bits hold them all
            min(max(self._stamp_bits, self.clock.bit_length()), _INT64_BITS),
            min(max(self._access_bits, accesses.bit_length()), _INT64_BITS),
        )
        self._live, self._live_t = self._empty_live()
        live, free, hashed, tag_mask = self._live, self._free, self._hash_flags, self._tag_mask
        keys = [(b, self._key(b)) for b in range(len(live)) if free[b] and hashed[b]]
        for b, key in keys:
            live[b] = key & tag_mask
        self._run, self._run_head, self._heap = sorted(key for _, key in keys), 0, []

    def _spec_key(self, b: int) -> Key:
        """Block b's eviction key, the spec's tuple."""
        stamps = self.last_access[b], self.num_accesses[b], self.registered_at[b], bool(self.is_evict_first[b])
        return cast(Key, eviction_key(self._rule, b, *stamps, PY))

    def _key(self, b: int) -> int:
        """Block b's eviction key, packed."""
        return pack(self._spec_key(b), self._offsets)

    def _pack_groups(self, columns: Sequence[torch.Tensor | int], k: int) -> list[torch.Tensor]:
        """`pack` for k keys given component by component: each group of fields (`_int64_groups`) packed
        into an int64 tensor in tensor operations, the group in the highest bits first."""
        assert self._groups is not None
        parts = []
        for start, stop in self._groups:
            packed = torch.zeros(k, dtype=torch.int64)
            for column, width in zip(columns[start:stop], self._widths[start:stop]):
                packed = packed.bitwise_left_shift_(width).bitwise_or_(column)
            parts.append(packed)
        return parts

    def _join_groups(self, parts: Sequence[torch.Tensor]) -> list[int]:
        """Packed keys as Python ints from their groups' tensors (`join_int64_groups`)."""
        assert self._groups is not None
        offsets = [self._offsets[stop - 1] for _, stop in self._groups]  # a group's lowest bit: its last field's
        return join_int64_groups(parts, offsets, sum(self._widths))

    def _add_list(self, block_ids: Sequence[int]) -> None:
        """Blocks that just became free take their places, a Python step each (none has a live entry: they
        were not free): first fit for those without a hash, the order for the others."""
        free, hashed, run = self._free, self._hash_flags, self._run
        for b in block_ids:
            free[b] = 1
            if not hashed[b]:
                heapq.heappush(self._first_fit, b)
                continue
            key = self._key(b)
            self._live[b] = key & self._tag_mask
            self._num_live += 1
            if run and key < run[-1]:  # onto the run when none there is larger, else into the heap
                heapq.heappush(self._heap, key)
            else:
                run.append(key)
        if len(run) - self._run_head + len(self._heap) > 2 * self._num_live + 64:  # `_compact`'s test, inline
            self._compact()

    def _push_sorted(self, keys: list[int]) -> None:
        """Entries in ascending order into the order, by slices: those not below the run's last extend it at
        once; those that fall between the same two of the run's entries go in there at once, when moving the
        run's tail costs less than pushing each into the heap and popping it later (under lfu, a free's blocks
        counted as often fall together: the fresh stamps put them after all the others with their count); the
        rest go into the heap. At most `_MAX_SLICES` slices a call, so keys scattered through the run
        (block-age's) cost a few searches more, not two a key."""
        run, heap, push, head = self._run, self._heap, heapq.heappush, self._run_head
        split = bisect.bisect_left(keys, run[-1]) if run else 0
        start = 0
        for _ in range(_MAX_SLICES):
            if start == split:
                break
            at = bisect.bisect_right(run, keys[start], head)  # keys[start] < run[-1], so at < len(run)
            stop = bisect.bisect_right(keys, run[at], start, split)  # run[at - 1] <= keys[start:stop] <= run[at]
            if (stop - start) * _TAIL_MOVES_PER_PUSH >= len(run) - at:
                run[at:at] = keys[start:stop]
            else:
                for key in keys[start:stop]:
                    push(heap, key)
            start = stop
        for key in keys[start:split]:
            push(heap, key)
        run.extend(keys[split:] if split else keys)

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
        """`_add_list` for many free hashed blocks at once: their keys computed column by column, then pushed.

        The key is still `eviction_key`'s, evaluated on int64 tensors of stamps (its arithmetic is
        the same on ints and tensors); the tier is one value, since every block of a free shares it.
        Keys are packed by groups of fields that fit in int64 and sorted in tensor operations (one group
        while the key fits in int64); wider ones are then made Python's ints at once (`join_int64_groups`).
        A field wider than int64 (`lru-lfu:W` with a fine W: a score up to (p + q) times a stamp) takes
        Python's ints block by block.
        """
        if self._groups is None:
            self._add_list(cast("list[int]", block_ids.tolist()))
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
        # None of the blocks has a live entry (they were not free): their keys go in as they are.
        parts = _ascending(self._pack_groups(cast("list[torch.Tensor | int]", list(key)), k))
        id_mask = self._id_mask
        if self._int64_keys:
            (packed,) = parts
            cast(torch.Tensor, self._live_t).index_copy_(0, packed & id_mask, packed)
            self._push_sorted(cast("list[int]", packed.tolist()))
        else:
            keys = self._join_groups(parts)
            if self._live_t is not None:  # the tags are the lowest group (`_set_widths`), which ends with the id
                self._live_t.index_copy_(0, parts[-1] & id_mask, parts[-1])
            else:
                live = self._live
                for packed_key in keys:
                    live[packed_key & id_mask] = packed_key
            self._push_sorted(keys)
        self._num_live += k
        self._compact()

    def _compact(self) -> None:
        """Drop the stale entries when they outnumber the live ones (the scan is paid for by the stale
        entries it drops). Cost: O(n) when it does."""
        if len(self._run) - self._run_head + len(self._heap) <= 2 * self._num_live + 64:
            return
        free, live, id_mask, tag = self._free, self._live, self._id_mask, self._tag_mask
        # One entry per live key: a block that left and came back under the same key (block-age: a hit, then
        # a free) has a stale entry equal to its live one. The run stays in order (a dict keeps it).
        run = dict.fromkeys(
            [key for key in self._run[self._run_head :] if free[b := key & id_mask] and live[b] == key & tag]
        )
        heap = [key for key in set(self._heap) if key not in run and free[b := key & id_mask] and live[b] == key & tag]
        heapq.heapify(heap)
        self._run, self._run_head, self._heap = list(run), 0, heap

    # --- the order ------------------------------------------------------------------------------

    def _pop(self, n: int, in_tensors: bool = False) -> list[int]:
        """The n free blocks the policy gives out next (first fit, then the smallest keys), out of the order;
        `in_tensors` (a long batch) reads the run's slices in tensor operations."""
        taken: list[int] = []
        free, flags, first_fit, pop = self._free, self._hash_flags, self._first_fit, heapq.heappop
        while first_fit and len(taken) < n:
            b = pop(first_fit)
            if free[b] and not flags[b]:  # else quarantined, or re-added under its hash
                taken.append(b)
        first_fit_taken = len(taken)
        self._pop_cached(n, taken, in_tensors)
        self._num_live -= len(taken) - first_fit_taken
        return taken

    def _pop_cached(self, n: int, taken: list[int], in_tensors: bool) -> None:
        """Append the free hashed blocks with the smallest keys to `taken` until it holds n: the run's
        entries below the heap's smallest go in slices, a Python step each instead of a heap pop, or a
        few tensor operations a slice when `in_tensors`, the keys fit in int64 and the slice is longer than
        a Python loop should be (run and heap can interleave finely: block-age's hit blocks come back
        below the run's last)."""
        run, heap, live, free, id_mask = self._run, self._heap, self._live, self._free, self._id_mask
        tag = self._tag_mask
        head, per_live = self._run_head, 1.0
        while len(taken) < n:
            if heap and (head == len(run) or heap[0] < run[head]):
                tagged = heapq.heappop(heap) & tag  # the tag holds the id (one int op on a wide key, not two)
                b = tagged & id_mask
                if free[b] and live[b] == tagged:  # else stale: the block left, or its key changed
                    live[b] = 0
                    taken.append(b)
                continue
            need = n - len(taken)
            # A slice read in tensors is as long as the entries read per live one so far say the need takes (its
            # live entries past the need are left): the stale ones met (hit blocks) cost one slice more, not a
            # slice a halving of the need.
            end = min(len(run), head + (int(need * per_live) + 64 if in_tensors and self._live_t is not None else need))
            if heap:
                end = bisect.bisect_right(run, heap[0], head, end)
            assert end > head, "the order ran out of entries before it ran out of free hashed blocks"
            if in_tensors and self._live_t is not None and end - head > self._python_path_max:
                got, read = self._take_live_tensor(run[head:end], need)
                taken += got
                per_live, end = min(max(per_live, read / max(len(got), 1)), 4.0), head + read  # 4: a bound on a read
            else:
                end = min(end, head + need)
                for key in run[head:end]:  # a slice: islice would step over the `head` entries before it
                    tagged = key & tag
                    b = tagged & id_mask
                    if free[b] and live[b] == tagged:
                        live[b] = 0
                        taken.append(b)
            head = end
        if head == len(run):
            run.clear()
            head = 0
        elif head > 4096 and 2 * head > len(run):  # the read part outgrew the rest: drop it, O(1) amortized
            del run[:head]
            head = 0
        self._run_head = head

    def _take_live_tensor(self, keys: list[int], need: int) -> tuple[list[int], int]:
        """The blocks of the first `need` live entries among `keys` (ascending), taken in tensor operations,
        and how many of the keys that read (up to the next live one): the loop of `_pop_cached` on a long
        slice, each of its reads and writes one gather or scatter, over the keys' tags (int64: `_live_t`)."""
        assert self._live_t is not None
        tag = self._tag_mask
        tags = torch.tensor(keys if tag == -1 else [key & tag for key in keys], dtype=torch.int64)
        ids = tags & self._id_mask
        is_live = (self._free_t.index_select(0, ids) != 0) & (self._live_t.index_select(0, ids) == tags)
        is_live[1:] &= tags[1:] != tags[:-1]  # a key twice (block-age: left and came back) is taken once
        wanted = is_live.cumsum(0) <= need  # the keys read: all but those from the (need + 1)-th live one on
        taken = ids[is_live & wanted]
        self._live_t.index_fill_(0, taken, 0)
        return cast("list[int]", taken.tolist()), int(wanted.count_nonzero())

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
        taken = self._pop(n, in_tensors=True)
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
        live, tag, id_mask = self._live, self._tag_mask, self._id_mask
        entries = {*itertools.islice(self._run, self._run_head, None), *self._heap}  # one of each key
        cached = sorted(key for key in entries if free[b := key & id_mask] and live[b] == key & tag)
        cached = [key & id_mask for key in cached]
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
        if self._reads_accesses and block_ids:
            most = max(map(accesses.__getitem__, block_ids))
            if most > self._access_bound:
                self._widen(most)

    def freed_list(self, block_ids: Sequence[int], newly_free: Sequence[int], evict_first: bool) -> None:
        """A free naming `block_ids` (every one stamped, in order, and tiered); `newly_free` join the free blocks."""
        self._stamp(self.last_access, block_ids)
        if self.clock > self._stamp_bound:
            self._widen()
        tier = self.is_evict_first
        for b in block_ids:
            tier[b] = evict_first
        self._add_list(newly_free)
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
                self._num_live -= 1
                heapq.heappush(self._first_fit, b)
            live[b] = 0  # a held block's key, left by a long hit, must not outlive its hash

    def reset(self) -> None:
        """Every hash was dropped (`reset_prefix_cache`): every free block is first fit now. Cost: O(n)."""
        self._first_fit = [b for b in range(len(self._free)) if self._free[b]]
        self._run, self._run_head, self._heap = [], 0, []
        (self._live, self._live_t), self._num_live = self._empty_live(), 0

    # --- the same for long batches (ids as device tensors) --------------------------------------

    def hit(self, block_ids: torch.Tensor, was_free: torch.Tensor) -> None:
        """`hit_list` for a batch in a tensor: the stamps in two scatters, the free ones leave in one (their
        entries go stale by the free flag; `_live` keeps their keys until they are free again)."""
        self._num_accesses_t.index_add_(0, block_ids, torch.ones(1, dtype=torch.int64).expand(block_ids.numel()))
        self._stamp_tensor(self._last_access_t, block_ids)
        self._free_t.index_fill_(0, was_free, 0)
        self._num_live -= int(self._hash_flags_t.index_select(0, was_free).count_nonzero())
        self.num_free_blocks -= was_free.numel()
        if self._reads_accesses and block_ids.numel():
            most = int(self._num_accesses_t.index_select(0, block_ids).max())
            if most > self._access_bound:
                self._widen(most)

    def freed(self, block_ids: torch.Tensor, newly_free: torch.Tensor, evict_first: bool) -> None:
        """`freed_list` for a batch in a tensor: the stamps in scatters, the cached blocks' keys by column."""
        self._stamp_tensor(self._last_access_t, block_ids)
        if self.clock > self._stamp_bound:
            self._widen()
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
        """Where the order, the free flags and the stamps disagree (for check_invariants). Cost: O(n log n)."""
        errors: list[str] = []
        free, flags, live = self._free, self._hash_flags, self._live
        if free and free[0]:
            errors.append("the null block is flagged free")
        counted = sum(free)
        if counted != self.num_free_blocks:
            errors.append(f"{counted} blocks are flagged free but num_free_blocks={self.num_free_blocks}")
        first_fit = {b for b in self._first_fit if free[b] and not flags[b]}
        entries = {*itertools.islice(self._run, self._run_head, None), *self._heap}
        for b in range(1, len(free)):
            if not free[b]:
                continue
            if not flags[b] and b not in first_fit:
                errors.append(f"free block {b} has no hash but no first-fit entry")
            if not flags[b] and live[b]:
                errors.append(f"free block {b} has no hash but a key in the cached order")
            if flags[b] and (live[b] != self._key(b) & self._tag_mask or self._key(b) not in entries):
                errors.append(f"free block {b} has a hash but no live entry under its key {self._spec_key(b)}")
            if flags[b] and max(self.last_access[b], self.registered_at[b]) > self._stamp_bound:
                errors.append(f"free block {b}'s stamps pass the packed keys' fields ({self._stamp_bound})")
            if flags[b] and self._reads_accesses and self.num_accesses[b] > self._access_bound:
                errors.append(f"free block {b}'s access count passes the packed keys' field ({self._access_bound})")
        num_cached = sum(1 for f, h in zip(free, flags) if f and h)
        if num_cached != self._num_live:
            errors.append(f"{num_cached} free blocks have a hash but _num_live={self._num_live}")
        run = self._run[self._run_head :]
        if any(a > b for a, b in zip(run, run[1:])):
            errors.append("the cached order's run is not in ascending order")
        heap = self._heap
        if any(heap[(i - 1) // 2] > heap[i] for i in range(1, len(heap))):
            errors.append("the cached order's heap is not a heap")
        stamps = [*self.last_access, *self.registered_at]
        if any(s != 0 and s >= self.clock for s in stamps):
            errors.append(f"a stamp is not below the clock ({self.clock})")
        return errors


def _int64_groups(widths: Sequence[int]) -> list[tuple[int, int]] | None:
    """The fields of a packed key in runs (start, stop) of at most 63 bits each, the first fields first,
    grouped from the last field up; None when one field alone is wider (it cannot be an int64).

    >>> _int64_groups((1, 32, 20)), _int64_groups((1, 32, 32, 20)), _int64_groups((1, 97, 32, 20))
    ([(0, 3)], [(0, 2), (2, 4)], None)
    >>> _int64_groups((31, 32)), _int64_groups((32, 32))  # 63 bits fit one int64, 64 do not
    ([(0, 2)], [(0, 1), (1, 2)])
    """
    if max(widths, default=0) > _INT64_BITS:
        return None
    groups: list[tuple[int, int]] = []
    stop, bits = len(widths), 0
    for i in range(len(widths) - 1, -1, -1):
        if bits + widths[i] > _INT64_BITS:
            groups.append((i + 1, stop))
            stop, bits = i + 1, 0
        bits += widths[i]
    groups.append((0, stop))
    return groups[::-1]


def _last_access_field(rule: ProfileRule) -> int | None:
    """Which component of the rule's `eviction_key` is the block's last access itself, if one is.

    >>> from kvspec.spec.ordering import profile_rule
    >>> [_last_access_field(profile_rule(p)) for p in ("lru-timestamp", "lfu", "lru-lfu:0.5", "block-age")]
    [1, 2, 2, None]
    """
    probes = [eviction_key(rule, 3, last, 1, 7, False, PY) for last in (11, 13)]
    found = [i for i, pair in enumerate(zip(*probes)) if pair == (11, 13)]
    return found[0] if found else None


def _shared_tensor(buffer: array.array[int] | bytearray, dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor over `buffer`'s memory: a write through either is seen by the other."""
    return torch.frombuffer(buffer, dtype=dtype) if len(buffer) else torch.empty(0, dtype=dtype)
