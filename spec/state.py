"""The pool state, frozen, and the `Snapshot` every implementation reports.

The state is a value, not an object graph: tuples indexed by block id and a
tuple for the free queue. The spec is written for obviousness, not speed, and a
value-based state is what CrossHair and z3 can reason about (object identity is
CrossHair's weak spot). The reference model keeps vLLM's linked structures and
turns them into this same `Snapshot` for comparison.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NewType

__all__ = [
    "NULL_BLOCK_ID",
    "TABLE_GROUP_MARK",
    "BlockHash",
    "BlockId",
    "PoolConfig",
    "PoolState",
    "Snapshot",
    "canonical_hash_to_blocks",
    "group_key",
    "table_name",
]

BlockId = NewType("BlockId", int)
BlockHash = NewType("BlockHash", bytes)

# NOTE: vLLM takes block 0 out of the free queue at construction and uses it as
# a placeholder (sliding-window layers point unneeded slots at it); its ref_cnt
# is never maintained, so it must never be freed, touched, hashed or queued.
NULL_BLOCK_ID = BlockId(0)

HashTable = tuple[tuple[BlockHash, tuple[BlockId, ...]], ...]
BlockTables = tuple[tuple[str, tuple[BlockId, ...]], ...]

# A request has one block table per KV cache group. The snapshot names group
# 0's table by the request id, as before groups existed, and group g's by
# `table_name(request_id, g)`; request ids may not contain the mark when a
# manager has several groups (spec.manager checks it).
TABLE_GROUP_MARK = "#"


def table_name(request_id: str, group_id: int) -> str:
    """The snapshot's name for a request's block table in one KV cache group.

    >>> table_name("r1", 0), table_name("r1", 2)
    ('r1', 'r1#2')
    """
    return request_id if group_id == 0 else f"{request_id}{TABLE_GROUP_MARK}{group_id}"


def group_key(block_hash: BlockHash, group_id: int) -> BlockHash:
    """The hash-table key of a block of KV cache group `group_id`: its hash with the group id after it.

    As vLLM's `make_block_hash_with_group_id` (digest, then the group id in 4
    bytes), so that two groups never share a block by accident: the same
    tokens give each group its own key. Group 0's key is the bare hash, so a
    single-group manager's states are byte for byte those of the pool level,
    which has no groups.

    >>> group_key(BlockHash(b"h"), 0), group_key(BlockHash(b"h"), 1)
    (b'h', b'h\\x00\\x00\\x00\\x01')
    """
    return block_hash if group_id == 0 else BlockHash(block_hash + group_id.to_bytes(4, "big"))


def canonical_hash_to_blocks(entries: HashTable) -> HashTable:
    """The normal form of a hash table: entries ordered by their first block id.

    Within an entry the blocks stay in registration order, because the first one
    is what `get_cached_block` returns. Ordering entries by block id (not by hash
    value) keeps the form independent of the hash function.

    >>> canonical_hash_to_blocks(((BlockHash(b"b"), (BlockId(3),)), (BlockHash(b"a"), (BlockId(1), BlockId(5)))))
    ((b'a', (1, 5)), (b'b', (3,)))
    """
    return tuple(sorted(entries, key=lambda entry: entry[1][0] if entry[1] else -1))


@dataclass(frozen=True, slots=True)
class PoolConfig:
    """What a pool is built with; never changes after construction."""

    num_gpu_blocks: int  # blocks in the pool, the null block included
    enable_caching: bool = True  # False: nothing is hashed and nothing hits
    profile: str = "vllm-v1"  # the eviction policy (spec.ordering.profile_rule)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The observable state of a block manager, in a normal form every implementation can build.

    Two implementations conform on a step when their snapshots are equal after
    their hash values are renamed consistently (`with_canonical_hashes`).
    """

    num_gpu_blocks: int  # pool size, the null block included
    enable_caching: bool  # prefix caching on or off
    ref_cnt: tuple[int, ...]  # ref_cnt[b]: requests holding block b; the null block's is 0
    block_hash: tuple[BlockHash | None, ...]  # block_hash[b]: set once b is full and registered
    free_queue: tuple[BlockId, ...]  # ref_cnt-0 blocks, left end taken first
    hash_to_blocks: HashTable  # hash -> blocks registered with it, in normal form
    block_tables: BlockTables | None = None  # table_name(request, group) -> its blocks; None at the pool level
    quarantined: tuple[BlockId, ...] = ()  # blocks found corrupt: never free, hashed, held or reused
    # The attention type of each KV cache group (spec.attention: "full", "sliding:8", ...),
    # at the request level; () stands for one full-attention group, the default.
    kv_groups: tuple[str, ...] = ()

    @property
    def num_free_blocks(self) -> int:
        """The number of blocks in the free queue."""
        return len(self.free_queue)

    def with_canonical_hashes(self) -> Snapshot:
        """The same snapshot with every hash renamed by first appearance in block-id order.

        Two snapshots whose implementations use different hash functions are
        equal after this iff they share the same equality relation on hashes.
        """
        names: dict[bytes, BlockHash] = {}

        def rename(h: BlockHash) -> BlockHash:
            if h not in names:
                names[h] = BlockHash(b"h%d" % (len(names) + 1))
            return names[h]

        block_hash = tuple(None if h is None else rename(h) for h in self.block_hash)
        table = tuple((rename(h), blocks) for h, blocks in self.hash_to_blocks)
        return replace(self, block_hash=block_hash, hash_to_blocks=canonical_hash_to_blocks(table))


@dataclass(frozen=True, slots=True)
class PoolState:
    """The spec's state of one BlockPool: a `Snapshot`'s fields plus the config."""

    config: PoolConfig  # fixed at construction
    ref_cnt: tuple[int, ...]  # changed by get_new_blocks, touch, free_blocks
    block_hash: tuple[BlockHash | None, ...]  # set by cache_full_blocks, cleared by eviction/reset
    free_queue: tuple[BlockId, ...]  # changed by get_new_blocks, touch, free_blocks
    hash_to_blocks: HashTable  # mirrors block_hash; always in normal form
    # What a keyed policy reads (spec.ordering), stamped by a logical clock; a
    # queue policy (vLLM v1) keeps them at 0: its order is the queue itself.
    clock: int = 0  # the next stamp; it advances by one per block stamped
    last_access: tuple[int, ...] = ()  # last_access[b]: b's last allocation, hit or free
    num_accesses: tuple[int, ...] = ()  # num_accesses[b]: its allocation and hits since it was last allocated
    registered_at: tuple[int, ...] = ()  # registered_at[b]: when its content was registered
    is_evict_first: tuple[bool, ...] = ()  # is_evict_first[b]: b's last free asked to evict it first

    @staticmethod
    def initial(config: PoolConfig) -> PoolState:
        """A fresh pool: every block but the null block free, in id order, nothing cached, no stamps."""
        n = config.num_gpu_blocks
        return PoolState(
            config=config,
            ref_cnt=(0,) * n,
            block_hash=(None,) * n,
            free_queue=tuple(BlockId(b) for b in range(1, n)),
            hash_to_blocks=(),
            last_access=(0,) * n,
            num_accesses=(0,) * n,
            registered_at=(0,) * n,
            is_evict_first=(False,) * n,
        )

    @property
    def num_gpu_blocks(self) -> int:
        """The pool size, the null block included."""
        return self.config.num_gpu_blocks

    def snapshot(self, block_tables: BlockTables | None = None, kv_groups: tuple[str, ...] = ()) -> Snapshot:
        """This state as a `Snapshot` (with the request block tables and KV cache groups, at the request level)."""
        return Snapshot(
            num_gpu_blocks=self.config.num_gpu_blocks,
            enable_caching=self.config.enable_caching,
            ref_cnt=self.ref_cnt,
            block_hash=self.block_hash,
            free_queue=self.free_queue,
            hash_to_blocks=self.hash_to_blocks,
            block_tables=block_tables,
            kv_groups=kv_groups,
        )
