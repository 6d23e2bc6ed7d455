"""The free blocks of a keyed policy (seed 002, vLLM v0) as stamps on the device: first fit, then the key.

The spec derives a keyed policy's free queue (kvspec.spec.ordering): the free
blocks without a hash by id (first fit), then the hashed ones by
`eviction_key`, every key read from stamps a logical clock writes
(kvspec.spec.ops: an allocation and a hit stamp the last access and count an
access, a free stamps the last access of every block it names, a
registration stamps `registered_at`). Here those stamps are int64 fields of
the pool's `MirroredState`, beside a free flag per block, so they have a host
face (Python stamps a request's few blocks) and a device face (kernels stamp
long batches and select).

Design choice: no ordered index; a take selects. A free block's key never
changes while it is free (only held blocks are stamped, and a hit takes the
block out), so the order is fixed by the stamps alone, and `get_new_blocks(n)`
is a selection over them: one `nonzero` over the pool for the free blocks
without a hash (ascending ids: first fit), and, only when those are fewer than
n, one over the free hashed blocks and a stable sort of their keys, least
significant key first (the ascending ids they come in end every tie, as the
spec's key ends with the id). Cost: a take is a constant number of kernels,
O(num_gpu_blocks) work for the scan and O(f log f) for the sort of the f free
hashed blocks when it evicts; a hit, a free and a registration are O(blocks
named) (Python over the host face for a short batch, one scatter for a long
one); the snapshot's `ordered` one sort. The rejected alternative, a device
heap or sorted index updated per free, is a sequence of dependent updates a
GPU cannot batch, for a saving only a pool that evicts on every call of one
block would see; the reference keeps the heaps (kvspec.reference.keyed_free),
where Python pays per element anyway.

A block losing its hash while free (`evict_blocks`, `reset_prefix_cache`)
needs nothing here: the scan reads the pool's hash flags, so it joins first
fit at once, as the spec re-derives the order.

The keys are the spec's own `eviction_key`, evaluated on tensors; `lru-lfu:W`
with W = p/q is `q * last_access + p * accesses`, exact in int64 while
`keys_fit` holds ((p + q) x (clock + 1) below 2^62, checked per take, and
lemma 6 proves that bound enough); beyond it the keys are compared exactly
on the host.
"""

from __future__ import annotations

import torch

from kvspec.gpu_impl.mirror import MirroredState
from kvspec.spec.ordering import ProfileRule, eviction_key, keys_fit

__all__ = ["NUM_STAMP_FIELDS", "StampedFreeBlocks"]

NUM_STAMP_FIELDS = 3  # per block, side by side: last access, accesses, registration
_LAST, _ACCESSES, _REGISTERED = range(NUM_STAMP_FIELDS)


class StampedFreeBlocks:
    """The free blocks in a keyed policy's order, and the stamps that order reads, in a mirrored state.

    The pool owns this and calls it only with blocks in the right state, as it
    calls the queue policies' KeyedFreeQueue: `take` with n <= num_free_blocks,
    `remove*` with free blocks, `freed*` with blocks whose ref_cnt just reached
    0. It never sees ref counts. After a call that changed it the pool calls
    `sync` on the shared state.
    """

    def __init__(
        self,
        num_gpu_blocks: int,
        rule: ProfileRule,
        state: MirroredState,
        has_hash: torch.Tensor,
        free_at: tuple[int, int],
        stamps_at: int,
    ) -> None:
        """Blocks 1..num_gpu_blocks-1 free, never stamped (block 0 is the null block and never free).

        Args:
            num_gpu_blocks: the pool size, the null block included.
            rule: the keyed policy.
            state: the pool's mirrored state; this writes the two places below.
            has_hash: the pool's hash flags (device face), which first fit reads.
            free_at: (start, step): block b's free flag is state entry start + step * b.
            stamps_at: block b's stamps are the NUM_STAMP_FIELDS entries from stamps_at + 3 * b.

        Cost: O(num_gpu_blocks) on the host, then the pool uploads.
        """
        assert rule.keyed, f"profile {rule.name!r} is a queue policy: gpu_impl.free_queue keeps it"
        n, (start, step) = num_gpu_blocks, free_at
        self._rule = rule  # fixed
        self._state = state
        self._track = not state.is_shared  # fixed: writes are marked and synchronised
        self._has_hash = has_hash
        self._free_start, self._free_step, self._stamps_at = start, step, stamps_at  # fixed
        self.free = state.tensor[start : start + step * n : step]  # 1 for a free block (device face)
        self._free_host = state.host[start : start + step * n : step]
        end = stamps_at + NUM_STAMP_FIELDS * n
        self.last_access = state.tensor[stamps_at + _LAST : end : NUM_STAMP_FIELDS]
        self.num_accesses = state.tensor[stamps_at + _ACCESSES : end : NUM_STAMP_FIELDS]
        self.registered_at = state.tensor[stamps_at + _REGISTERED : end : NUM_STAMP_FIELDS]
        self._last_host = state.host[stamps_at + _LAST : end : NUM_STAMP_FIELDS]
        self._accesses_host = state.host[stamps_at + _ACCESSES : end : NUM_STAMP_FIELDS]
        self._registered_host = state.host[stamps_at + _REGISTERED : end : NUM_STAMP_FIELDS]
        for b in range(1, n):
            self._free_host[b] = 1
        self.clock = 0  # the next stamp (host)
        self.num_free_blocks = max(n - 1, 0)
        self._ticks = torch.arange(n, dtype=torch.int64, device=state.device)  # clock + i for a batch's i-th block
        self.key_capacity = 0  # no key index (the pool sizes its state by this and stamp_length)

    @staticmethod
    def stamp_length(num_gpu_blocks: int) -> int:
        """The state entries the stamps take, after the pool's fields."""
        return NUM_STAMP_FIELDS * num_gpu_blocks

    # --- marking writes (only when the two faces are two memories) ------------------------------

    def _wrote_free_host(self, block_ids: list[int]) -> None:
        self._state.wrote_host([self._free_start + self._free_step * b for b in block_ids])

    def _wrote_stamp_host(self, field: int, block_ids: list[int]) -> None:
        self._state.wrote_host([self._stamps_at + NUM_STAMP_FIELDS * b + field for b in block_ids])

    def _wrote_free_device(self, block_ids: torch.Tensor) -> None:
        self._state.wrote_device(block_ids * self._free_step + self._free_start)

    def _wrote_stamp_device(self, field: int, block_ids: torch.Tensor) -> None:
        self._state.wrote_device(block_ids * NUM_STAMP_FIELDS + (self._stamps_at + field))

    # --- the order ------------------------------------------------------------------------------

    def _keys(self, cached: torch.Tensor) -> list[torch.Tensor] | None:
        """The spec's eviction_key of free hashed blocks, on tensors, most significant first, without the id.

        The ids end every tie by themselves: `cached` is in ascending order and
        the sorts are stable. None when a term could leave int64 (kvspec.spec.ordering.keys_fit).
        """
        if not keys_fit(self._rule, self.clock):
            return None
        terms = eviction_key(self._rule, cached, self.last_access[cached], self.num_accesses[cached],
                             self.registered_at[cached])  # fmt: skip
        return list(terms[:-1])

    def _in_key_order(self, cached: torch.Tensor) -> torch.Tensor:
        """`cached` (ascending ids) sorted by the policy's key: stable sorts, least significant key first."""
        keys = self._keys(cached)
        if keys is None:  # the combined key could overflow int64: compare exactly on the host
            w = self._rule.weight
            host = cached.tolist()
            last, accesses = self.last_access[cached].tolist(), self.num_accesses[cached].tolist()
            rank = sorted(range(len(host)), key=lambda i: (last[i] + w * accesses[i], last[i], host[i]))
            return cached[torch.tensor(rank, dtype=torch.int64, device=cached.device)]
        order = torch.arange(cached.numel(), device=cached.device)
        for key in reversed(keys):
            order = order[torch.sort(key[order], stable=True).indices]
        return cached[order]

    def _first(self, n: int) -> torch.Tensor:
        """The n free blocks the policy gives out first, in order (device)."""
        free = self.free != 0
        hashed = self._has_hash != 0
        first_fit = torch.nonzero(free & ~hashed).squeeze(1)
        if first_fit.numel() >= n:
            return first_fit[:n]
        cached = self._in_key_order(torch.nonzero(free & hashed).squeeze(1))
        return torch.cat((first_fit, cached[: n - first_fit.numel()]))

    def ordered(self) -> torch.Tensor:
        """Every free block in the policy's order (device). Cost: one scan and one sort."""
        return self._first(self.num_free_blocks)

    def is_free(self, block_id: int) -> bool:
        """Whether `block_id` is free (host face). Cost: O(1)."""
        return bool(self._free_host[block_id])

    # --- taking (every take is kernels: it selects over the pool) --------------------------------

    def take(self, n: int) -> torch.Tensor:
        """Take the n blocks the policy gives out first, stamped as allocated (one access each).

        Returns:
            Their ids, in order, as an int64 device tensor.
        """
        taken = self._first(n)
        self.free.index_fill_(0, taken, 0)
        self.last_access.index_copy_(0, taken, self._ticks[:n] + self.clock)
        self.num_accesses.index_fill_(0, taken, 1)
        self.clock += n
        self.num_free_blocks -= n
        if self._track:
            self._wrote_free_device(taken)
            self._wrote_stamp_device(_LAST, taken)
            self._wrote_stamp_device(_ACCESSES, taken)
        return taken

    # --- stamping and membership: short batches on the host face ---------------------------------

    def hit_list(self, block_ids: list[int], was_free: list[int]) -> None:
        """A hit on `block_ids`: each is stamped and counts an access; the free ones among them leave."""
        last, accesses, clock = self._last_host, self._accesses_host, self.clock
        for i, b in enumerate(block_ids):
            last[b] = clock + i
            accesses[b] += 1
        self.clock += len(block_ids)
        self.remove_list(was_free)
        if self._track:
            self._wrote_stamp_host(_LAST, block_ids)
            self._wrote_stamp_host(_ACCESSES, block_ids)

    def freed_list(self, block_ids: list[int], newly_free: list[int]) -> None:
        """A free naming `block_ids` (every one stamped, in order); `newly_free` join the free blocks."""
        last, clock = self._last_host, self.clock
        for i, b in enumerate(block_ids):
            last[b] = clock + i
        self.clock += len(block_ids)
        free = self._free_host
        for b in newly_free:
            free[b] = 1
        self.num_free_blocks += len(newly_free)
        if self._track:
            self._wrote_stamp_host(_LAST, block_ids)
            self._wrote_free_host(newly_free)

    def registered_list(self, block_ids: list[int]) -> None:
        """`block_ids` registered under their hashes now (block-age reads when)."""
        registered, clock = self._registered_host, self.clock
        for i, b in enumerate(block_ids):
            registered[b] = clock + i
        self.clock += len(block_ids)
        if self._track:
            self._wrote_stamp_host(_REGISTERED, block_ids)

    def remove_list(self, block_ids: list[int]) -> None:
        """Free blocks that stop being free (a hit, a quarantine)."""
        free = self._free_host
        for b in block_ids:
            free[b] = 0
        self.num_free_blocks -= len(block_ids)
        if self._track:
            self._wrote_free_host(block_ids)

    # --- the same for long batches on the device face --------------------------------------------

    def _stamp(self, stamps: torch.Tensor, field: int, block_ids: torch.Tensor) -> None:
        k = block_ids.numel()
        stamps.index_copy_(0, block_ids, self._ticks[:k] + self.clock)
        self.clock += k
        if self._track:
            self._wrote_stamp_device(field, block_ids)

    def hit(self, block_ids: torch.Tensor, was_free: torch.Tensor) -> None:
        """`hit_list` for a long batch (device)."""
        self._stamp(self.last_access, _LAST, block_ids)
        self.num_accesses.index_add_(0, block_ids, torch.ones_like(block_ids))
        if self._track:
            self._wrote_stamp_device(_ACCESSES, block_ids)
        self._set_free(was_free, 0)

    def freed(self, block_ids: torch.Tensor, newly_free: torch.Tensor) -> None:
        """`freed_list` for a long batch (device)."""
        self._stamp(self.last_access, _LAST, block_ids)
        self._set_free(newly_free, 1)

    def registered(self, block_ids: torch.Tensor) -> None:
        """`registered_list` for a long batch (device)."""
        self._stamp(self.registered_at, _REGISTERED, block_ids)

    def _set_free(self, block_ids: torch.Tensor, value: int) -> None:
        self.free.index_fill_(0, block_ids, value)
        self.num_free_blocks += block_ids.numel() if value else -block_ids.numel()
        if self._track:
            self._wrote_free_device(block_ids)

    # --- checking -------------------------------------------------------------------------------

    def representation_errors(self) -> list[str]:
        """Where the free flags disagree with the count or take the null block (for check_invariants)."""
        errors: list[str] = []
        flags = self.free
        if flags.numel() and int(flags[0]) != 0:
            errors.append("the null block is flagged free")
        if not bool(((flags == 0) | (flags == 1)).all()):
            errors.append("a free flag is neither 0 nor 1")
        counted = int(torch.count_nonzero(flags))
        if counted != self.num_free_blocks:
            errors.append(f"{counted} blocks are flagged free but num_free_blocks={self.num_free_blocks}")
        stamps = torch.cat((self.last_access, self.registered_at))
        if stamps.numel() and int(stamps.max()) >= max(self.clock, 1):
            errors.append(f"a stamp is not below the clock ({self.clock})")
        return errors
