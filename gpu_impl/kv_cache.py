"""Paged KV memory: one tensor `[num_gpu_blocks, block_size, *slot_shape]`, addressed through block tables.

A token at position p of a request lives in slot `p % block_size` of block
`block_table[p // block_size]`. Writes and reads of a run of tokens are one
gather/scatter each, on the pool's device. A write is refused (`NotWritable`)
unless every block it touches is writable under the pool's state right now
(kvspec.spec.invariants.is_block_writable: not null, held by exactly one
request, not hashed): a shared or cached block's content belongs to everyone
who can hit it.

Checksums (seed 002, corrupt blocks): when a block is registered its content
is sealed with a checksum, and a hit re-computes it. The checksum is a
weighted sum of the block's 16-bit words (its bytes, for a page of an odd
number of bytes), `sum_j word_j * w_j` with odd weights `w_j < 2**24` that
depend on the word's position. No sum can overflow int64 for blocks under 32
MiB, so a single flipped bit (bit k of word j) changes it by exactly
`+-2**k * w_j`, which is never 0: every single-bit flip is detected, and so
is a value moved to another slot. Words rather than bytes: half as many
elements to widen to int64 and multiply; with the pages gathered as rows
(`index_select`) and multiplied in place, a pass over 64 KiB pages went from
0.6-0.9 ms to 40-70 us a block on one CPU core. (32-bit words would be
faster again, but their sums overflow int64 and the argument above would
rest on wrap-around; an integer matrix-vector product is faster on the CPU
but CUDA has none.) The
rejected alternative, a cryptographic digest per block, is not a batched
tensor operation and would move every hit's KV to the host.

KV cache groups (spec.attention): a model's layers fall into groups, each
with its own attention type and its own KV, all allocating blocks from one
pool. `GroupedKVCache` keeps one `PagedKVCache` per group, each with a page
for every block id of the pool: block b names page b of every group's store,
and the group that holds b (a block belongs to one group at a time: its
hash-table key carries the group id) is the only one that writes or reads
that page. The rejected alternative, one shared store, would need the
groups' layers to have the same KV shape and would let a block read back
another group's KV unnoticed when it changes groups.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvspec.gpu_impl.block_pool import TensorBlockPool
from kvspec.gpu_impl.sizing import KVLayout
from kvspec.spec.errors import InvalidBlock, InvalidRequest, NotWritable, is_int
from kvspec.spec.state import NULL_BLOCK_ID, BlockId

__all__ = ["GroupedKVCache", "PagedKVCache"]

_WEIGHT_MULTIPLIER = 2654435761  # Knuth's multiplicative hash constant: spreads positions over the weights
_WEIGHT_MODULUS = 1 << 24  # weights stay below 2**24, so byte sums of blocks < 2 GiB fit in int64
# The int64 working copy of one checksum pass over many blocks, at most: small
# on the CPU (it stays in cache: 5x faster than 64 MiB chunks), large where
# the device has its own memory and each chunk costs kernel launches.
_CHECKSUM_CHUNK_BYTES = {"cpu": 1 << 20}
_DEVICE_CHECKSUM_CHUNK_BYTES = 1 << 30


# sizing.DTYPE_SIZES names -> torch attribute names, where they differ.
_TORCH_DTYPES = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "fp32": "float32",
    "float": "float32",
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}


class PagedKVCache:
    """The KV memory of one pool: a page per block, a checksum per registered block."""

    def __init__(
        self,
        block_pool: TensorBlockPool,
        block_size: int,
        slot_shape: Sequence[int] = (),
        dtype: torch.dtype = torch.int64,
    ) -> None:
        """Allocate zeroed KV memory for every block of `block_pool`, on its device.

        Args:
            block_pool: the pool whose blocks these pages are (its state decides what is writable).
            block_size: token slots per block.
            slot_shape: the shape of one token's KV (e.g. (2, layers, kv_heads, head_dim));
                () for one value per token.
            dtype: the element type.

        Raises:
            InvalidRequest: block_size or a slot dimension is not a positive integer.

        Cost: O(num_gpu_blocks * block_size * prod(slot_shape)) memory.
        """
        if not is_int(block_size) or block_size < 1:
            raise InvalidRequest(f"block_size must be a positive integer; got block_size={block_size!r}")
        if not all(is_int(d) and d >= 1 for d in slot_shape):
            raise InvalidRequest(
                f"slot_shape dimensions must be positive integers; got slot_shape={tuple(slot_shape)!r}"
            )
        self.block_pool = block_pool  # the state that decides writability (read only here)
        self.block_size = block_size  # fixed
        self.slot_shape = tuple(slot_shape)  # fixed
        dev = block_pool.device
        self.kv = torch.zeros((block_pool.num_gpu_blocks, block_size, *self.slot_shape), dtype=dtype, device=dev)
        self.checksum = torch.zeros(block_pool.num_gpu_blocks, dtype=torch.int64, device=dev)  # set by seal
        self._pages = self.kv.view(block_pool.num_gpu_blocks, -1)  # a view: one row per block
        num_bytes = self.kv[0].numel() * self.kv.element_size()
        self._word = torch.int16 if num_bytes % 2 == 0 else torch.uint8  # fixed: what the checksum sums
        positions = torch.arange(num_bytes // (2 if self._word == torch.int16 else 1), dtype=torch.int64, device=dev)
        self._weights = (positions * _WEIGHT_MULTIPLIER) % _WEIGHT_MODULUS | 1  # odd, position-dependent
        chunk_bytes = _CHECKSUM_CHUNK_BYTES.get(dev.type, _DEVICE_CHECKSUM_CHUNK_BYTES)
        self._checksum_chunk = max(1, chunk_bytes // (8 * self._weights.numel()))  # fixed: blocks per pass

    @classmethod
    def for_layout(cls, block_pool: TensorBlockPool, layout: KVLayout) -> PagedKVCache:
        """KV memory shaped like a model's: `[num_gpu_blocks, block_size, 2, layers, kv_heads, head_dim]`.

        Raises:
            InvalidRequest: the layout's dtype has no torch equivalent on this build.
        """
        name = _TORCH_DTYPES.get(layout.dtype, layout.dtype)
        dtype = getattr(torch, name, None)
        if not isinstance(dtype, torch.dtype):
            raise InvalidRequest(f"dtype={layout.dtype!r} has no torch dtype in torch {torch.__version__}")
        return cls(block_pool, layout.block_size, layout.slot_shape, dtype)

    # --- writes and reads through a block table -------------------------------------------------

    def slots(self, block_table: torch.Tensor, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The (block id, slot) of every token position in [start, end) of a request.

        Raises:
            InvalidRequest: the range is empty, negative, or runs past the block table.
        """
        if not 0 <= start < end or end > block_table.numel() * self.block_size:
            raise InvalidRequest(
                f"token positions [{start}, {end}) are not within the block table of "
                f"{block_table.numel()} blocks of block_size={self.block_size}"
            )
        positions = torch.arange(start, end, dtype=torch.int64, device=block_table.device)
        return block_table[positions // self.block_size], positions % self.block_size

    def check_writable(self, block_ids: torch.Tensor) -> None:
        """Refuse unless every block is writable now (spec.invariants.is_block_writable, batched).

        Raises:
            NotWritable: naming the first block that is null, free, shared or hashed.
        """
        pool = self.block_pool
        if block_ids.numel() <= pool.python_path_max:
            # A step's few blocks: checked in Python on the pool's host face, not by the mask's kernels.
            unwritable = [b for b in block_ids.tolist() if not pool.is_block_writable(b)]
            if not unwritable:
                return
            b = unwritable[0]
        else:
            writable = pool.writable_mask(block_ids)
            if bool(writable.all()):
                return
            b = int(block_ids[int(torch.nonzero(~writable)[0])])
        raise NotWritable(
            f"cannot write KV into block_id={b}: ref_cnt={pool.get_ref_cnt(b)} "
            f"has_hash={pool.get_block_hash(b) is not None}; only a block held by one request and not yet "
            "registered is writable (shared or cached KV belongs to every request that can hit it)"
        )

    def write_tokens(self, block_table: torch.Tensor, start: int, values: torch.Tensor) -> None:
        """Write the KV of token positions [start, start + len(values)) of a request, through its block table.

        Args:
            block_table: the request's block ids, int64 on the device.
            start: the first position written.
            values: one entry of `slot_shape` per position.

        Raises:
            InvalidRequest: the positions run past the table, or values has the wrong shape.
            NotWritable: a block written is not writable; nothing is written.
        """
        end = start + values.shape[0]
        if tuple(values.shape[1:]) != self.slot_shape:
            raise InvalidRequest(
                f"KV values of shape {tuple(values.shape)} for slot_shape={self.slot_shape}; "
                "one slot per token was expected"
            )
        blocks, offsets = self.slots(block_table, start, end)
        first, last = start // self.block_size, (end - 1) // self.block_size
        self.check_writable(block_table[first : last + 1])
        self.kv[blocks, offsets] = values.to(self.kv.dtype)

    def read_tokens(self, block_table: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """The KV of token positions [start, end) of a request, read through its block table."""
        blocks, offsets = self.slots(block_table, start, end)
        return self.kv[blocks, offsets]

    def read_blocks(self, block_ids: Sequence[BlockId] | torch.Tensor) -> torch.Tensor:
        """The whole page of each block, `[len(block_ids), block_size, *slot_shape]`.

        Raises:
            InvalidBlock: an id is not a block of this pool.
        """
        if isinstance(block_ids, torch.Tensor):
            ids = block_ids.to(self.kv.device, torch.int64)
        else:
            n = self.block_pool.num_gpu_blocks
            for b in block_ids:
                if not is_int(b) or not 0 <= b < n:
                    raise InvalidBlock(f"read_kv: block_id={b!r} is not a block of this pool (ids 0..{n - 1})")
            ids = torch.tensor(list(block_ids), dtype=torch.int64, device=self.kv.device)
        return self.kv[ids]

    # --- checksums ----------------------------------------------------------------------------------

    def block_checksums(self, block_ids: torch.Tensor) -> torch.Tensor:
        """The checksum of each block's current content, int64 on the device.

        One gather and one reduction per chunk of blocks; a chunk's int64
        working copy stays under _CHECKSUM_CHUNK_BYTES, so a hit of 1e5 blocks
        of real-sized KV needs no more memory than a few blocks do.
        """
        per_chunk, n = self._checksum_chunk, block_ids.numel()
        if n <= per_chunk:
            return self._checksums(block_ids)
        return torch.cat([self._checksums(block_ids[i : i + per_chunk]) for i in range(0, n, per_chunk)])

    def _checksums(self, block_ids: torch.Tensor) -> torch.Tensor:
        # index_select over one row per page: 2-3x faster on the CPU than indexing the
        # page tensor itself; the widening copy is then multiplied in place.
        words = self._pages.index_select(0, block_ids).view(self._word).to(torch.int64)
        return words.mul_(self._weights).sum(dim=1)

    def seal(self, block_ids: torch.Tensor) -> None:
        """Record the checksum of each block's content: done when the block is registered (full, final)."""
        if block_ids.numel():
            self.checksum[block_ids] = self.block_checksums(block_ids)

    def intact(self, block_ids: torch.Tensor) -> torch.Tensor:
        """Whether each sealed block still has the content it was sealed with (a device bool tensor)."""
        return self.block_checksums(block_ids) == self.checksum[block_ids]

    def inject_bit_flip(self, block_id: int, byte_offset: int, bit: int) -> None:
        """Flip one bit of a block's memory in place: the fault seed 002 asks the pool to survive.

        For fault-injection tests and the device check; nothing in the pool calls it.

        Args:
            block_id: the block whose page is hit.
            byte_offset: which byte of the page (0 .. page bytes - 1).
            bit: which bit of that byte (0..7).

        Raises:
            InvalidBlock: block_id is not a block of this pool.
            InvalidRequest: byte_offset or bit is out of range.
        """
        n = self.block_pool.num_gpu_blocks
        if not is_int(block_id) or not 0 <= block_id < n:
            raise InvalidBlock(f"inject_bit_flip: block_id={block_id!r} is not a block of this pool (ids 0..{n - 1})")
        page = self.kv[block_id].view(-1).view(torch.uint8)
        if not is_int(byte_offset) or not 0 <= byte_offset < page.numel():
            raise InvalidRequest(f"inject_bit_flip: byte_offset={byte_offset!r} not in 0..{page.numel() - 1}")
        if not is_int(bit) or not 0 <= bit < 8:
            raise InvalidRequest(f"inject_bit_flip: bit={bit!r} not in 0..7")
        page[byte_offset] ^= 1 << bit


class GroupedKVCache:
    """The KV memory of a manager's KV cache groups: one `PagedKVCache` per group, over one pool."""

    def __init__(
        self,
        block_pool: TensorBlockPool,
        block_size: int,
        num_groups: int = 1,
        slot_shape: Sequence[int] = (),
        dtype: torch.dtype = torch.int64,
    ) -> None:
        """Allocate zeroed KV memory for every block of `block_pool` in each of `num_groups` groups.

        Raises:
            InvalidRequest: as `PagedKVCache`, or num_groups is not a positive integer.

        Cost: O(num_groups * num_gpu_blocks * block_size * prod(slot_shape)) memory.
        """
        if not is_int(num_groups) or num_groups < 1:
            raise InvalidRequest(f"num_groups must be a positive integer; got num_groups={num_groups!r}")
        # fixed: group g's store is stores[g]
        self.stores = tuple(PagedKVCache(block_pool, block_size, slot_shape, dtype) for _ in range(num_groups))
        self.block_pool = block_pool  # read only here
        self.block_size = block_size  # fixed

    def __len__(self) -> int:
        return len(self.stores)

    def __getitem__(self, group_id: int) -> PagedKVCache:
        return self.stores[group_id]

    def read_groups(self, block_ids: Sequence[BlockId]) -> list[list[int]]:
        """The page of each block of a flat, group-by-group list (a prefix hit), each read from its group's store.

        The list is split into as many equal parts as there are groups (a
        hit's groups all have the same number of positions); part g is read
        from group g's store. A null position (NULL_BLOCK_ID) reads as `[]`:
        no group ever writes the null block, so it holds no group's KV. Every
        other position reads as its page, one value per slot.

        Raises:
            InvalidBlock: an id is not a block of this pool.
            InvalidRequest: the list does not split evenly into the groups.

        Cost: one gather per group, and the pages copied to the host.
        """
        num_groups = len(self.stores)
        if len(block_ids) % num_groups:
            raise InvalidRequest(
                f"read_kv: {len(block_ids)} block ids do not split into {num_groups} KV cache groups; "
                "the list is read group by group, each group's part as long"
            )
        n = len(block_ids) // num_groups
        pages: list[list[int]] = []
        for g, store in enumerate(self.stores):
            part = block_ids[g * n : (g + 1) * n]
            rows: list[list[int]] = store.read_blocks(part).tolist() if part else []
            pages.extend([] if b == NULL_BLOCK_ID else row for b, row in zip(part, rows))
        return pages
