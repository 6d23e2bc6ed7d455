"""What a pool tells the world: KV cache events, and the mirror a router builds from them.

KV-aware routers keep a copy of an engine's prefix cache, built from the
stream of events its block pool publishes (vLLM's `vllm/distributed/kv_events.py`,
emitted by `BlockPool` when `enable_kv_cache_events` is on and drained by
`take_events`). Every spec operation returns the events vLLM 0.33 emits for
it, in order, as part of its `Step`:

- `BlockStored`: one per `cache_full_blocks` call (at the request level, one
  per KV cache group that registers blocks in a step), naming every block it
  registered, even under a hash that another block already holds;
- `BlockRemoved`: one per hash-table key that leaves the table when its block
  is evicted (reallocated by `get_new_blocks`, or dropped by `evict_blocks`);
- `AllBlocksCleared`: one per successful `reset_prefix_cache`;
- nothing on a free, a touch or a lookup: a freed block stays cached.

Keys are the hash table's own keys (`spec.state.group_key`: a hash with its
KV cache group after it), so an event names exactly what the table holds and
the harness renames event hashes with the same names as the state's. vLLM
publishes the bare hash and the group index apart; an adapter folds them.

`EventMirror` is what a router that reference-counts the stream holds
(stored +1 per block, removed -1, cleared: empty). The rules that it must
match the hash table, and what a stored block's parent must be, are in
`spec.invariants` (`EVENT_RULES`); the ways a router that does not count
references would misread the same stream are `naive_misreads` and
`orphaned_stores`, reported beside a violation, never as one.

Design choice: events are values returned by the operations, not a queue in
the state, so a refused call emits nothing by construction and a query's
step is its input state untouched; the alternative (an event queue field
drained by a `take_events` operation) would make every snapshot comparison
carry undelivered events.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvspec.spec.hashing import ExtraKey, MultiModalInput, block_extra_keys
from kvspec.spec.state import BlockHash, HashTable

__all__ = [
    "MEDIUM_GPU",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventMirror",
    "KVCacheEvent",
    "event_extra_keys",
    "naive_misreads",
    "orphaned_stores",
    "table_counts",
]

MEDIUM_GPU = "GPU"  # where the blocks live, as vLLM's events name it (a CPU or disk tier names its own)

# One event's extra keys per block, as vLLM publishes them: untagged (the LoRA
# name, (mm identifier, offset) pairs, the cache salt), None for a block with none.
EventExtraKeys = tuple[tuple[object, ...] | None, ...]


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks were registered in the hash table (one `cache_full_blocks` call of one group).

    At the pool level the spec is told blocks and hashes only: the request's
    facts (tokens, block size, LoRA, extra keys) are None there, and the
    parent is None (each call registers blocks as a chain of its own).
    """

    block_hashes: tuple[BlockHash, ...]  # the keys registered, in block order (null positions left out)
    parent_block_hash: BlockHash | None  # the key of the position before the first, in the same group; None: first
    token_ids: tuple[int, ...] | None = None  # the tokens of the positions [first, last] (null ones included)
    block_size: int | None = None  # tokens per block
    lora_name: str | None = None  # the request's LoRA adapter, if any
    extra_keys: EventExtraKeys | None = None  # one entry per registered block; None when no block has any
    group_idx: int = 0  # the KV cache group
    medium: str = MEDIUM_GPU


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """A key left the hash table: its block was evicted (reallocated, or dropped by id)."""

    block_hashes: tuple[BlockHash, ...]  # the key removed (vLLM publishes one event per key)
    medium: str = MEDIUM_GPU


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The prefix cache was reset: every key left the table."""

    medium: str = MEDIUM_GPU


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


def event_extra_keys(
    positions: Sequence[int],
    block_size: int,
    lora_name: str | None,
    mm_inputs: Sequence[MultiModalInput],
    cache_salt: str | None,
) -> EventExtraKeys | None:
    """The extra keys a `BlockStored` publishes for blocks at these positions (vLLM's `to_event_extra_keys`).

    The same keys the hash chain uses (`spec.hashing.block_extra_keys`), untagged,
    as routers parse them: the LoRA name, `(identifier, offset)` per image, the salt.

    >>> event_extra_keys([0, 1], 4, "l", [], "s")
    (('l', 's'), ('l',))
    >>> event_extra_keys([1], 4, None, [], "s") is None, event_extra_keys([], 4, None, [], None) is None
    (False, True)
    """
    if not positions:
        return None
    return tuple(
        _untagged(block_extra_keys(i * block_size, (i + 1) * block_size, lora_name, mm_inputs, cache_salt))
        for i in positions
    )


def _untagged(keys: tuple[ExtraKey, ...] | None) -> tuple[object, ...] | None:
    if keys is None:
        return None
    return tuple(tuple(k[1:]) if k[0] == "mm" else k[1] for k in keys)


def table_counts(hash_to_blocks: HashTable) -> dict[BlockHash, int]:
    """How many blocks the hash table holds under each key: what a reference-counting mirror must hold.

    >>> table_counts(((BlockHash(b"a"), (1, 4)),))
    {b'a': 2}
    """
    return {h: len(blocks) for h, blocks in hash_to_blocks if blocks}


@dataclass(frozen=True, slots=True)
class EventMirror:
    """What a router that reference-counts the stream holds: a count per key, and every key it was told of.

    `known` lets a rule tell a parent the router has heard of (held now, or
    removed since) from one it never heard of; a clear forgets both.
    """

    counts: Mapping[BlockHash, int] = field(default_factory=dict)  # key -> blocks stored minus removed (> 0 only)
    known: frozenset[BlockHash] = frozenset()  # every key stored since the last clear

    def holds(self, key: BlockHash) -> bool:
        """Whether the mirror holds `key` now."""
        return self.counts.get(key, 0) > 0

    def apply(self, events: Sequence[KVCacheEvent]) -> EventMirror:
        """The mirror after `events`, in order (a removal of a key it does not hold leaves a negative count).

        >>> m = EventMirror().apply([BlockStored((BlockHash(b"a"), BlockHash(b"a")), None)])
        >>> dict(m.counts), dict(m.apply([BlockRemoved((BlockHash(b"a"),))]).counts)
        ({b'a': 2}, {b'a': 1})
        """
        if not events:  # most steps publish nothing: the same mirror (it is a value)
            return self
        counts = dict(self.counts)
        known = set(self.known)
        for event in events:
            if isinstance(event, BlockStored):
                for key in event.block_hashes:
                    counts[key] = counts.get(key, 0) + 1
                    known.add(key)
            elif isinstance(event, BlockRemoved):
                for key in event.block_hashes:
                    counts[key] = counts.get(key, 0) - 1
            else:
                counts.clear()
                known.clear()
        return EventMirror({k: c for k, c in counts.items() if c != 0}, frozenset(known))

    def matches(self, hash_to_blocks: HashTable) -> bool:
        """Whether the mirror holds exactly the table's keys, each as many times as blocks are registered under it."""
        return self.counts == table_counts(hash_to_blocks)


def naive_misreads(before: EventMirror, events: Sequence[KVCacheEvent]) -> list[BlockHash]:
    """The keys a router that forgets a key on its first removal drops while another block still holds them.

    vLLM keeps identical full blocks apart (a block table is append-only), so a
    key can be registered by several blocks; evicting one of them publishes a
    `BlockRemoved` for a key that is still cached. Not a violation: a router
    must count references.

    >>> a = BlockHash(b"a")
    >>> naive_misreads(EventMirror(), [BlockStored((a, a), None), BlockRemoved((a,))])
    [b'a']
    """
    misread: list[BlockHash] = []
    mirror = before
    for event in events:
        mirror = mirror.apply([event])
        if isinstance(event, BlockRemoved):
            misread += [k for k in event.block_hashes if mirror.holds(k)]
    return misread


def orphaned_stores(before: EventMirror, events: Sequence[KVCacheEvent]) -> list[BlockStored]:
    """The `BlockStored` events whose parent the reference-counting mirror does not hold when they arrive.

    A router that builds a tree from parents cannot attach them. It happens
    without any fault: a sliding-window or chunked group's parent is the
    position before, which that group may have freed and lost (or never
    registered), and a parent evicted by id while held is gone; the rule
    `event_parent_known` says which parents must be known.

    >>> a, b = BlockHash(b"a"), BlockHash(b"b")
    >>> [e.block_hashes for e in orphaned_stores(EventMirror(), [BlockStored((b,), a)])]
    [(b'b',)]
    """
    orphans: list[BlockStored] = []
    mirror = before
    for event in events:
        parent = event.parent_block_hash if isinstance(event, BlockStored) else None
        if parent is not None and not mirror.holds(parent):
            orphans.append(event)  # type: ignore[arg-type]
        mirror = mirror.apply([event])
    return orphans
