"""The free queue as integer keys in the mirrored state (decided on the host, followed on the device): lemma 6.

Design choice: no links. Every free block carries an int64 key and the queue
is the free blocks in ascending key order. Two host counters bound the keys:
`lo` <= every free key <= `hi`. A batch of k blocks sent to the left end gets
the keys `lo - k + i` (i = 0..k-1), so it keeps its order and sits below every
free block; a batch sent to the right end gets `hi + 1 + i`. Taking n blocks
is selecting the n smallest keys. The rejected alternative, vLLM's doubly
linked list, is a pointer chase: one dependent load per block, which no
batched operation can do.

Why this is vLLM's order: lemma 6, the key encoding
(`lemma_key_encoding_matches_queue`, kvspec.spec.lemmas; the helpers are
kvspec.spec.ordering.left_batch_key / right_batch_key). It proves, by
induction on the relation R (the free blocks are exactly the queue's, keys
strictly increase along the queue, every free key lies in [lo, hi], and
lo <= hi + 1), that the encoding takes the same blocks in the same order as
the linked list after every operation sequence. This queue does three things
the lemma's model does not, and each preserves R, which is all the induction
needs: it starts from the spec's initial keys (`initial_free_key`) shifted by
a constant; after a take it raises `lo` to just above the last key taken
(still at most every free key left), and restarts the bounds in the middle
when the queue empties (no free key to bound); and it relabels (below), a
strictly increasing renumbering with `lo`, `hi` the new smallest and largest
key. Every other update is the model's own.

The selection itself: `torch.topk(free_key, n, largest=False)` would be the
literal reading, but it scans all num_gpu_blocks keys for every allocation
(1.6 ms for a 1e6-block pool on one CPU core, against the reference's ~1 us
for one block). Keys here are small integers, so they double as positions in
an index `key_to_block` (key -> block id, EMPTY where no free block has that
key): the n smallest keys are the first n occupied positions from `lo`. A
batch is then one slice (no gaps) or one `nonzero` over a window (gaps left by
blocks a cache hit took out of the middle), with the window doubled until it
holds n blocks. Every gap it scans lies before the n-th block taken, so it is
consumed by that take: each gap is paid for once, by the touch that made it.

When a batch does not fit at an end of the index, the free blocks are given
new keys `c, c + 1, ...` in their current order (a relabel: O(free blocks),
and a strictly increasing map of the keys, so the queue order, which is all
that lemma 6 speaks about, is unchanged). The index is 4 x num_gpu_blocks + 64
keys long, so after a relabel each end has room for at least num_gpu_blocks
more keys and relabels cost O(1) per freed block, amortized.

Two faces, one queue: the keys and the index live in the pool's
`MirroredState` (gpu_impl.mirror), and every operation reads and writes the
host face, where the pool decides. The list methods (`popleft_list`,
`remove_list`, `prepend_list`, `append_list`) are Python over it, for a
request's few blocks: no torch operator at all unless a take meets more gaps
than it is worth scanning one by one (`_HOST_SCAN_MAX`), or a batch forces a
relabel; those run as tensor operations over the host face. The tensor
methods (`popleft_n`, `remove`, `prepend_n`, `append_n`) are tensor
operations over the host face, for long batches, on CPU tensors. Each marks
what it wrote (the list methods the key index, the pool the blocks' rows); the
device face follows when it is next read (`free_key` and `key_to_block` are
its views).
"""

from __future__ import annotations

import array

import torch

from kvspec.gpu_impl.mirror import DeviceFaceView, MirroredState
from kvspec.spec.ordering import initial_free_key, initial_key_counters, left_batch_key, right_batch_key

__all__ = ["EMPTY", "KeyedFreeQueue", "default_key_capacity"]

EMPTY = -1  # key_to_block value of a key no free block holds

# A take on the host steps over at most this many gaps one by one; past that,
# one `nonzero` over the host face is cheaper than the Python loop.
_HOST_SCAN_MAX = 256
_EMPTY_ROW = memoryview(array.array("q", [EMPTY]) * 1024)  # copied over the keys a short take vacates


def default_key_capacity(num_gpu_blocks: int) -> int:
    """The length of the key index for a pool of `num_gpu_blocks` blocks.

    >>> default_key_capacity(10)
    104
    """
    return 4 * num_gpu_blocks + 64


def _min_key_capacity(num_gpu_blocks: int) -> int:
    # A relabel centres the m free blocks; a batch of k more must then fit on
    # either side: (cap - m) // 2 >= k with m + k <= num_gpu_blocks - 1.
    return 2 * num_gpu_blocks


class KeyedFreeQueue:
    """The free blocks of one pool, in eviction order, as keys with a host and a device face.

    The pool owns this queue and its state, and calls it only with blocks in
    the right state: `prepend_*`/`append_*` with blocks that are not free,
    `remove*` with blocks that are. It never sees ref counts or hashes. With
    two memories, each list method marks the key index entries it writes; a
    block's key lies in the block's row, which the pool marks once for every
    block a call names (`host_written`), whichever of its fields the call wrote.
    """

    def __init__(
        self,
        num_gpu_blocks: int,
        device: torch.device,
        key_capacity: int | None,
        state: MirroredState,
        free_key_at: tuple[int, int],
        key_index_at: int,
    ) -> None:
        """Queue blocks 1..num_gpu_blocks-1 in id order (block 0 is the null block and never queued).

        Args:
            num_gpu_blocks: the pool size, the null block included.
            device: where the keys' device face lives.
            key_capacity: the length of the key index; None for the default. A
                smaller one (at least 2 x num_gpu_blocks) relabels more often,
                which is what tests want.
            state: the pool's mirrored state, which holds the keys (the pool uploads it).
            free_key_at: (start, step): block b's key is state entry start + step * b
                (the pool interleaves it with the block's other fields: row b).
            key_index_at: where the key index's key_capacity entries start in the state.

        Raises:
            ValueError: key_capacity is below the minimum, or a block's key does not lie in
                the state's row of that block (free_key_at's step is not the row width).

        Cost: O(num_gpu_blocks).
        """
        cap = default_key_capacity(num_gpu_blocks) if key_capacity is None else key_capacity
        if cap < _min_key_capacity(num_gpu_blocks):
            raise ValueError(
                f"key_capacity={cap} is below the minimum 2 * num_gpu_blocks={_min_key_capacity(num_gpu_blocks)}"
            )
        n = num_gpu_blocks
        self.device = device  # fixed
        self.key_capacity = cap  # fixed: keys are 0..cap-1
        self._init_views(n, state, free_key_at, key_index_at)
        self._keys = torch.arange(cap, dtype=torch.int64)  # every key (host): a batch's keys are a slice
        self._queue_every_block(n)
        self.num_relabels = 0  # how many times the keys were renumbered (for benchmarks and tests)

    def _init_views(
        self, num_gpu_blocks: int, state: MirroredState, free_key_at: tuple[int, int], key_index_at: int
    ) -> None:
        """Where the keys live in the state: `free_key` and `key_to_block` as views of both faces."""
        fk_start, fk_step = free_key_at
        if fk_step != state.row_width or not 0 <= fk_start < fk_step:
            raise ValueError(
                f"free_key_at={free_key_at}: block b's key must lie in the state's row b (width "
                f"{state.row_width}), so marking the row marks the key"
            )
        fk_end, k2b_end = fk_start + fk_step * num_gpu_blocks, key_index_at + self.key_capacity
        self._state = state  # fixed: where the keys live (shared with the pool)
        self._track = not state.is_shared  # fixed: mark writes, so the two faces can be made equal
        self._fk_start, self._fk_step = fk_start, fk_step  # fixed: free_key[b] is state entry start + step * b
        self._k2b_base = key_index_at  # fixed: key_to_block[k] is state entry _k2b_base + k
        # free_key[b]: block b's key while b is free; stale otherwise (a block is
        # free iff key_to_block[free_key[b]] == b, so nothing resets it on take).
        self._free_key = state.tensor[fk_start:fk_end:fk_step]  # device face (`free_key`)
        # key_to_block[k]: the free block whose key is k, or EMPTY. Every
        # occupied key lies in [lo, hi].
        self._key_to_block = state.tensor[key_index_at:k2b_end]  # device face (`key_to_block`)
        self._free_key_host = state.host_tensor[fk_start:fk_end:fk_step]  # host face, for tensor operations
        self._key_to_block_host = state.host_tensor[key_index_at:k2b_end]
        self._fk = state.host[fk_start:fk_end:fk_step]  # host face, for Python
        self._k2b = state.host[key_index_at:k2b_end]

    # The device face's views, brought up to date as they are read (gpu_impl.mirror: every call leaves its
    # writes on the host until the device face is next read).
    free_key = DeviceFaceView("free_key[b]: block b's key while b is free (the device face).")
    key_to_block = DeviceFaceView("key_to_block[k]: the free block whose key is k, or EMPTY (the device face).")

    def _apply_k2b(self, method: str, *args: object) -> None:
        """A tensor write of the key index through the host face, replayed on the device face (gpu_impl.mirror)."""
        self._state.apply(self._key_to_block_host, self._key_to_block, method, *args)

    def _apply_fk(self, method: str, *args: object) -> None:
        """A tensor write of the blocks' keys through the host face, replayed on the device face."""
        self._state.apply(self._free_key_host, self._free_key, method, *args)

    def _queue_every_block(self, num_gpu_blocks: int) -> None:
        """The initial queue, written on the host face: blocks 1..num_gpu_blocks-1 free in id order."""
        num_free = num_gpu_blocks - 1
        # The spec's initial keys (block b gets initial_free_key(b) = b, lo = 1,
        # hi = n - 1), shifted by a constant to the middle of the index so that
        # both ends have room: the same order.
        shift = (self.key_capacity - num_free) // 2 - initial_free_key(1)
        lo, hi = initial_key_counters(num_gpu_blocks)
        self.lo = lo + shift  # <= every free key; changed by takes, left batches, relabels
        self.hi = hi + shift  # >= every free key; changed by right batches, relabels
        self.num_free_blocks = num_free  # kept in step with key_to_block
        self.num_gaps = 0  # EMPTY keys inside [lo, hi]: hi - lo + 1 == num_free_blocks + num_gaps
        self._free_key_host.fill_(EMPTY)
        self._key_to_block_host.fill_(EMPTY)
        if num_free:
            blocks = torch.arange(1, num_gpu_blocks, dtype=torch.int64)
            self._key_to_block_host[self.lo : self.hi + 1] = blocks
            self._free_key_host[1:] = blocks + shift

    # --- taking -------------------------------------------------------------------------------

    def popleft_list(self, n: int) -> list[int]:
        """Remove and return the n free blocks with the smallest keys, smallest first (host face).

        Args:
            n: how many; at most num_free_blocks (the pool checks).

        Cost: O(n + gaps skipped) Python steps; past _HOST_SCAN_MAX gaps, a few tensor operations.
        """
        assert 0 <= n <= self.num_free_blocks, f"popleft_list(n={n}) with {self.num_free_blocks} free"
        if n == 0:
            return []
        lo, k2b = self.lo, self._k2b
        if self.num_gaps == 0:
            end = lo + n
            taken: list[int] = k2b[lo:end].tolist()
        else:
            taken = []
            end = lo
            for k in range(lo, min(self.hi + 1, lo + n + _HOST_SCAN_MAX)):
                b = k2b[k]
                if b >= 0:
                    taken.append(b)
                    if len(taken) == n:
                        end = k + 1
                        break
            else:
                selected, end = self._select(self._key_to_block_host, lo, n)
                taken = selected.tolist()
            self.num_gaps -= (end - lo) - n
        if end - lo <= len(_EMPTY_ROW):
            k2b[lo:end] = _EMPTY_ROW[: end - lo]
            if self._track:
                self._state.wrote_host_range(self._k2b_base + lo, self._k2b_base + end)
        else:
            self._apply_k2b("__setitem__", slice(lo, end), EMPTY)
        self._taken_up_to(end, n)
        return taken

    def popleft_n(self, n: int) -> torch.Tensor:
        """Remove and return the n free blocks with the smallest keys, smallest first (host face, tensors).

        Args:
            n: how many; at most num_free_blocks (the pool checks).

        Returns:
            An int64 CPU tensor of n block ids.

        Cost: O(n + gaps skipped), a constant number of tensor operations per doubling.
        """
        assert 0 <= n <= self.num_free_blocks, f"popleft_n(n={n}) with {self.num_free_blocks} free"
        lo, k2b = self.lo, self._key_to_block_host
        if n == 0:
            return k2b[lo:lo].clone()
        if self.num_gaps == 0:
            end = lo + n
            taken = k2b[lo:end].clone()
        else:
            taken, end = self._select(k2b, lo, n)
            self.num_gaps -= (end - lo) - n
        self._apply_k2b("__setitem__", slice(lo, end), EMPTY)
        self._taken_up_to(end, n)
        return taken

    def _select(self, key_to_block: torch.Tensor, lo: int, n: int) -> tuple[torch.Tensor, int]:
        """The n blocks with the smallest keys from `lo` on, gaps skipped, and the key after the last.

        A window doubled until it holds n blocks. Every gap in it lies before
        the n-th block, so the take consumes it: the doubling is paid for by gaps.
        """
        span = self.hi - lo + 1
        width = min(span, n + min(self.num_gaps, max(n, 1024)))
        while True:
            window = key_to_block[lo : lo + width]
            positions = torch.nonzero(window >= 0).squeeze(1)
            if positions.numel() >= n:
                break
            assert width < span, f"free queue holds {positions.numel()} blocks in [lo, hi], expected {n}+"
            width = min(span, 2 * width)
        positions = positions[:n]
        return window[positions], lo + int(positions[-1]) + 1

    def _taken_up_to(self, end: int, n: int) -> None:
        self.lo = end
        self.num_free_blocks -= n
        if self.num_free_blocks == 0:
            self._recentre_empty()

    def remove_list(self, block_ids: list[int]) -> None:
        """Take free blocks out of the middle of the queue (a cache hit on them); their keys become gaps (host face).

        Args:
            block_ids: distinct blocks, each free.

        Cost: O(len(block_ids)) Python steps.
        """
        k = len(block_ids)
        if k == 0:
            return
        fk, k2b = self._fk, self._k2b
        if self._track:
            base = self._k2b_base
            self._state.wrote_host([base + fk[b] for b in block_ids])
        for b in block_ids:
            k2b[fk[b]] = EMPTY
        self._removed(k)

    def remove(self, block_ids: torch.Tensor) -> None:
        """`remove_list` for a CPU tensor of blocks (host face, tensors).

        Cost: O(len(block_ids)) in two tensor operations.
        """
        k = block_ids.numel()
        if k == 0:
            return
        keys = self._free_key_host.index_select(0, block_ids)
        self._apply_k2b("index_fill_", 0, keys, EMPTY)
        self._removed(k)

    def _removed(self, k: int) -> None:
        self.num_free_blocks -= k
        self.num_gaps += k
        if self.num_free_blocks == 0:
            self._recentre_empty()

    # --- putting back -------------------------------------------------------------------------

    def prepend_list(self, block_ids: list[int]) -> None:
        """Put blocks at the left end in the given order, the first taken first (host face).

        Args:
            block_ids: distinct blocks, none of them free.

        Cost: O(len(block_ids)) Python steps, plus an occasional relabel.
        """
        k = len(block_ids)
        if k == 0:
            return
        if self.lo - k < 0:
            self._relabel()
        first = left_batch_key(self.lo, k, 0)  # keys lo - k + i, i = 0..k-1
        self._put_list(block_ids, first)
        self.lo = first

    def append_list(self, block_ids: list[int]) -> None:
        """Put blocks at the right end in the given order, the last taken last (host face).

        Args:
            block_ids: distinct blocks, none of them free.

        Cost: O(len(block_ids)) Python steps, plus an occasional relabel.
        """
        k = len(block_ids)
        if k == 0:
            return
        if self.hi + k >= self.key_capacity:
            self._relabel()
        first = right_batch_key(self.hi, 0)  # keys hi + 1 + i, i = 0..k-1
        self._put_list(block_ids, first)
        self.hi = first + k - 1

    def _put_list(self, block_ids: list[int], first: int) -> None:
        fk, k = self._fk, len(block_ids)
        if k == 1:
            self._k2b[first] = block_ids[0]
            fk[block_ids[0]] = first
        else:
            self._k2b[first : first + k] = array.array("q", block_ids)
            for key, b in enumerate(block_ids, first):
                fk[b] = key
        if self._track:  # free_key[b] is in row b, which the pool marks
            self._state.wrote_host_range(self._k2b_base + first, self._k2b_base + first + k)
        self.num_free_blocks += k

    def prepend_n(self, block_ids: torch.Tensor) -> None:
        """`prepend_list` for a CPU tensor of blocks (host face, tensors).

        Cost: O(len(block_ids)) in two tensor operations, plus an occasional relabel.
        """
        k = block_ids.numel()
        if k == 0:
            return
        if self.lo - k < 0:
            self._relabel()
        first = left_batch_key(self.lo, k, 0)
        self._put(block_ids, first)
        self.lo = first

    def append_n(self, block_ids: torch.Tensor) -> None:
        """`append_list` for a CPU tensor of blocks (host face, tensors).

        Cost: O(len(block_ids)) in two tensor operations, plus an occasional relabel.
        """
        k = block_ids.numel()
        if k == 0:
            return
        if self.hi + k >= self.key_capacity:
            self._relabel()
        first = right_batch_key(self.hi, 0)
        self._put(block_ids, first)
        self.hi = first + k - 1

    def _put(self, block_ids: torch.Tensor, first: int) -> None:
        k = block_ids.numel()
        self._apply_k2b("__setitem__", slice(first, first + k), block_ids)
        self._apply_fk("index_copy_", 0, block_ids, self._keys[first : first + k])
        self.num_free_blocks += k

    # --- reading ------------------------------------------------------------------------------

    def ordered(self) -> torch.Tensor:
        """Every free block, left end first, read from the host face (current after every operation; the
        snapshot reads it). Cost: O(hi - lo)."""
        span = self._key_to_block_host[self.lo : self.hi + 1]
        return span[span >= 0]

    def is_free(self, block_id: int) -> bool:
        """Whether a block is free: its key is a valid key that maps back to it (host face). Cost: O(1)."""
        key = self._fk[block_id]
        return 0 <= key < self.key_capacity and self._k2b[key] == block_id

    def representation_errors(self) -> list[str]:
        """What is wrong with the counters and the two index tensors, if anything (for check_invariants).

        Reads the device face; the pool checks that the host face equals it.
        Cost: O(key_capacity).
        """
        errors: list[str] = []
        lo, hi, cap = self.lo, self.hi, self.key_capacity
        if not (0 <= lo <= hi + 1 <= cap):
            return [f"key bounds out of range: lo={lo} hi={hi} key_capacity={cap}"]
        occupied = self.key_to_block >= 0
        if bool(occupied[:lo].any()) or bool(occupied[hi + 1 :].any()):
            errors.append(f"a free block has a key outside [lo={lo}, hi={hi}]")
        num_occupied = int(occupied.sum())
        if num_occupied != self.num_free_blocks:
            errors.append(f"num_free_blocks={self.num_free_blocks} but {num_occupied} keys are occupied")
        if hi - lo + 1 != self.num_free_blocks + self.num_gaps:
            errors.append(
                f"hi - lo + 1 = {hi - lo + 1} but num_free_blocks={self.num_free_blocks} + num_gaps={self.num_gaps}"
            )
        keys = torch.nonzero(occupied).squeeze(1)
        blocks = self.key_to_block[keys]
        if not torch.equal(self.free_key[blocks], keys):
            errors.append("free_key does not map some free block back to its key")
        if blocks.numel() != torch.unique(blocks).numel():
            errors.append("a block holds two keys")
        return errors

    # --- keeping the keys in range ----------------------------------------------------------------

    def _recentre_empty(self) -> None:
        # No free block: every key in [lo, hi] is a gap (already EMPTY), so the
        # bounds can restart anywhere; the middle leaves room at both ends.
        self.lo = self.key_capacity // 2
        self.hi = self.lo - 1
        self.num_gaps = 0

    def _relabel(self) -> None:
        """Give the free blocks consecutive keys, in order, centred in the index.

        A strictly increasing renumbering: the queue order does not change.
        Tensor operations over the host face. Cost: O(hi - lo).
        """
        old_lo, old_end = self.lo, self.hi + 1
        span = self._key_to_block_host[old_lo:old_end]
        blocks = span[span >= 0]
        m = blocks.numel()
        first = (self.key_capacity - m) // 2
        self._apply_k2b("__setitem__", slice(old_lo, old_end), EMPTY)
        self._apply_k2b("__setitem__", slice(first, first + m), blocks)
        self._apply_fk("index_copy_", 0, blocks, self._keys[first : first + m])
        self.lo, self.hi, self.num_gaps = first, first + m - 1, 0
        self.num_relabels += 1
