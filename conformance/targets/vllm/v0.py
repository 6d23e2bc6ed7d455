"""vLLM v0's prefix-caching allocator and LRU evictor behind the pool-level adapter protocol.

vLLM v0 (every release to 0.10.2) keeps its prefix cache in
``PrefixCachingBlockAllocator`` (``vllm/core/block/prefix_caching_block.py``):
blocks without content come from a hashless ``NaiveBlockAllocator``, cached
blocks with ref_cnt 0 wait in an ``LRUEvictor`` keyed by ``(last_accessed,
-num_hashed_tokens)``, and a full block's content hash is computed by the block
itself from (previous block, token ids). Light mode (``lightmode.V0``) loads
those modules unmodified from a release's wheel; this adapter drives them.

Translation choices (the adapter translates and validates nothing):

- **Block ids.** The allocator is built with ``block_ids=range(1, n)``, so the
  spec's ids are v0's ids; block 0, the spec's null block, names no v0 block
  (v0 has none).
- **Hashes.** v0 cannot be told a hash: it hashes a block's tokens. Each
  distinct spec hash gets a token id of its own (0, 1, 2, ... in order of
  first use), and a block registered under it is a one-token first block
  (block size 1, no previous block) holding that token, so v0's hash is
  ``hash((True, None, token, None))``: distinct tokens give distinct hashes,
  and the harness's ``HashNames`` checks that the pairing of spec hashes with
  v0's stays one to one on every step. The pool level has no chains, so
  every block is a chain's first and ``num_hashed_tokens`` is 1 for all.
- **Time.** v0 stamps ``last_accessed`` only through
  ``mark_blocks_as_accessed(block_ids, now)``, which its scheduler calls. The
  adapter is that caller and applies the spec's logical clock: ``now``
  advances by one per block stamped, in call order; an allocation and a hit
  stamp each block taken, ``free_blocks`` stamps each block just before it
  frees it (while v0 still tracks it), ``cache_full_blocks`` advances the
  clock without a stamp (v0 keeps no registration time). No two stamps are
  equal, so v0's hashed-tokens tie-break is never reached.
- **Hits.** ``touch(b)`` is v0's hit: ``allocate_immutable_block`` with the
  token of b's cached content, which v0 resolves through its own hash table.
  ``get_cached_block(h)`` reads that table (``_cached_blocks``, the map
  ``allocate_immutable_block`` consults), after the caller's end-of-step
  ``mark_blocks_as_computed``.
- **The free queue** reported is v0's allocation order: the hashless
  allocator's free list as it pops, then the order the real
  ``LRUEvictor.evict`` gives on a copy of the evictor (so its lazy deletion is
  what is reported, not a re-derivation of its key).

What v0 does that the spec does not is left for the harness to find: v0 keeps
one block per hash, so promoting a full block whose content is already cached
frees the new block and takes a reference on the cached one; its hashless
free list is LIFO (a freed block is reused first), not first fit.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from kvspec.conformance.core.adapter import (
    AdapterConfig,
    AdapterFactory,
    BlockManagerAdapter,
    KVCacheManagerAdapter,
    LevelNotProvided,
)
from kvspec.conformance.core.reactions import NotExpressible, Reaction
from kvspec.conformance.targets.vllm import lightmode
from kvspec.spec.state import BlockHash, BlockId, Snapshot, canonical_hash_to_blocks

__all__ = ["V0_PROFILES", "V0_RELEASES", "VllmV0PoolAdapter", "load_lru_evictor", "make_v0_light_adapter"]

# Every release on the package registry whose wheel ships
# vllm/core/block/prefix_caching_block.py (measured by reading each wheel: 0.4.0
# and 0.11.0 do not). The adapter speaks the allocator API of 0.5.1 on
# (allocate_mutable_block; mark_blocks_as_accessed from 0.4.2) and refuses the
# older ones by name.
V0_RELEASES: tuple[str, ...] = (
    "0.4.0.post1", "0.4.1", "0.4.2", "0.4.3", "0.5.0", "0.5.0.post1", "0.5.1", "0.5.2", "0.5.3",
    "0.5.3.post1", "0.5.4", "0.5.5", "0.6.0", "0.6.1", "0.6.1.post1", "0.6.1.post2", "0.6.2", "0.6.3",
    "0.6.3.post1", "0.6.4", "0.6.4.post1", "0.6.5", "0.6.6", "0.6.6.post1", "0.7.0", "0.7.1", "0.7.2",
    "0.7.3", "0.8.0", "0.8.1", "0.8.2", "0.8.3", "0.8.4", "0.8.5", "0.8.5.post1", "0.9.0", "0.9.0.1",
    "0.9.1", "0.9.2", "0.10.0", "0.10.1", "0.10.1.1", "0.10.2",
)  # fmt: skip

# The profiles `--profile auto` tries on a v0 release: v0's own, then v1's.
V0_PROFILES: tuple[str, ...] = ("lru-timestamp", "vllm-v1", "vllm-v1-tail")

_ALLOCATOR = "vllm.core.block.prefix_caching_block"


def _allocator_module(version: str) -> Any:
    """The release's prefix_caching_block module, loaded in light mode (V0 layout)."""
    return lightmode.load_release(version, layout=lightmode.V0).module(_ALLOCATOR)


def load_lru_evictor(version: str) -> type:
    """v0's real ``LRUEvictor`` class of a release (``evictor.py``, or ``evictor_v2.py`` before 0.6.4).

    Raises:
        LightModeError: the release could not be fetched or has no v0 allocator.
    """
    release = lightmode.load_release(version, layout=lightmode.V0)
    name = "vllm.core.evictor" if (release.root / "vllm/core/evictor.py").exists() else "vllm.core.evictor_v2"
    cls: type = release.module(name).LRUEvictor
    return cls


class VllmV0PoolAdapter:
    """One v0 ``PrefixCachingBlockAllocator`` driven with the harness's block ids and ``bytes`` hashes.

    Attributes:
        version: The release.
        allocator: v0's allocator object.
        validates_bad_input: False: v0 trusts its caller; its reactions are not measured, so no mistake is sent.
        mistake_reactions: Empty (not measured yet).
    """

    validates_bad_input = False
    mistake_reactions: dict[str, Reaction] = {}

    def __init__(self, version: str, config: AdapterConfig) -> None:
        if config.level != "pool":
            raise LevelNotProvided(f"vllm=={version} (v0) is driven at the pool level only")
        if not config.enable_caching:
            raise ValueError(
                f"vllm=={version} (v0): the adapter drives the prefix-caching allocator only; "
                "v0's caching-off allocator (NaiveBlockAllocator) is not driven"
            )
        if config.num_gpu_blocks < 2:
            raise ValueError(f"num_gpu_blocks={config.num_gpu_blocks}: v0 needs at least one block beside block 0")
        self.version = version
        self.config = config
        module = _allocator_module(version)
        if not callable(getattr(module.PrefixCachingBlockAllocator, "allocate_mutable_block", None)):
            raise ValueError(
                f"vllm=={version} (v0): its allocator has no allocate_mutable_block (the API from 0.5.1), "
                "which this adapter speaks"
            )
        self.allocator: Any = module.PrefixCachingBlockAllocator(
            num_blocks=config.num_gpu_blocks - 1, block_size=1, block_ids=range(1, config.num_gpu_blocks)
        )
        self._held: dict[int, list[Any]] = {}  # block id -> v0's Block objects, one per reference held
        self._tokens: dict[bytes, int] = {}  # spec hash -> the token id that stands for it
        self._content: dict[int, bytes] = {}  # v0 content hash -> spec hash
        self._now = 0  # the logical clock the adapter feeds v0 as `now`

    # -- translation ---------------------------------------------------------

    def _stamp(self, block_id: int) -> None:
        """``mark_blocks_as_accessed`` with the next tick, as v0's scheduler would call it."""
        self._now += 1
        self.allocator.mark_blocks_as_accessed([block_id], float(self._now))

    def _token(self, block_hash: BlockHash) -> int:
        if not isinstance(block_hash, bytes):
            raise NotExpressible(f"block_hash={block_hash!r} is not bytes, the harness's hashes")
        return self._tokens.setdefault(bytes(block_hash), len(self._tokens))

    def _take(self, block_id: BlockId, op: str) -> Any:
        """A v0 Block object for a reference the harness holds on ``block_id``."""
        held = self._held.get(block_id) if isinstance(block_id, int) else None
        if not held:
            raise NotExpressible(f"{op} takes v0 Block objects, and block_id={block_id!r} has no reference held")
        return held.pop()

    def _hold(self, block: Any) -> BlockId:
        self._held.setdefault(block.block_id, []).append(block)
        return BlockId(block.block_id)

    def _cached_hash_of(self, block_id: int) -> int | None:
        return next((h for h, b in self.allocator._cached_blocks.items() if b == block_id), None)

    # -- the protocol --------------------------------------------------------

    def get_new_blocks(self, num_blocks: int) -> list[BlockId]:
        """v0's ``allocate_mutable_block``, ``num_blocks`` times, each block then stamped."""
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool):
            raise NotExpressible(f"num_blocks={num_blocks!r}: v0 allocates one block per call")
        ids = [self._hold(self.allocator.allocate_mutable_block(prev_block=None)) for _ in range(num_blocks)]
        for b in ids:
            self._stamp(b)
        return ids

    def touch(self, block_ids: Sequence[BlockId]) -> None:
        """v0's hit: ``allocate_immutable_block`` with each block's cached content, then stamped."""
        for b in block_ids:
            content = self._cached_hash_of(b) if isinstance(b, int) else None
            if content is None or content not in self._content:
                raise NotExpressible(f"touch: block_id={b!r} holds no cached content v0 can be asked for")
            token = self._tokens[self._content[content]]
            self._stamp(self._hold(self.allocator.allocate_immutable_block(prev_block=None, token_ids=[token])))

    def get_cached_block(self, block_hash: BlockHash) -> BlockId | None:
        """The block v0's hash table holds for the content that stands for ``block_hash``."""
        token = self._token(block_hash)
        content = next((c for c, h in self._content.items() if self._tokens[h] == token), None)
        found = None if content is None else self.allocator._cached_blocks.get(content)
        return None if found is None else BlockId(found)

    def cache_full_blocks(self, block_ids: Sequence[BlockId], block_hashes: Sequence[BlockHash]) -> None:
        """Fill each block with its hash's token: v0 promotes it (or swaps in the block already cached)."""
        for b, h in zip(block_ids, block_hashes):
            token = self._token(h)
            block = self._take(b, "cache_full_blocks")
            block.append_token_ids([token])
            self._content[block.content_hash] = bytes(h)
            self._hold(block)  # under the id v0 left it with: the cached block's, where it swapped
            self._now += 1
        if hasattr(self.allocator, "_touched_blocks"):
            # from 0.6.0 a promoted block is a hit only after the caller's end-of-step
            # mark_blocks_as_computed; before, marking is incremental and the call raises
            self.allocator.mark_blocks_as_computed([])

    def free_blocks(self, block_ids: Sequence[BlockId]) -> None:
        """v0's ``free``, one block at a time, each stamped just before."""
        for b in block_ids:
            block = self._take(b, "free_blocks")
            self._stamp(b)
            self.allocator.free(block)

    def get_num_free_blocks(self) -> int:
        """v0's ``get_num_free_blocks``."""
        num: int = self.allocator.get_num_free_blocks()
        return num

    def snapshot(self) -> Snapshot:
        """v0's ref counts, hash table and allocation order in the spec's form."""
        n = self.config.num_gpu_blocks
        alloc = self.allocator
        ref_cnt = [0] + [alloc._refcounter.get(b) for b in range(1, n)]
        block_hash: list[BlockHash | None] = [None] * n
        table = []
        for content, b in alloc._cached_blocks.items():
            raw = BlockHash(int(content).to_bytes(8, "big", signed=True))
            block_hash[b] = raw
            table.append((raw, (BlockId(b),)))
        return Snapshot(
            num_gpu_blocks=n,
            enable_caching=True,
            ref_cnt=tuple(ref_cnt),
            block_hash=tuple(block_hash),
            free_queue=tuple(BlockId(b) for b in _allocation_order(alloc)),
            hash_to_blocks=canonical_hash_to_blocks(tuple(table)),
            block_tables=None,
        )


def _allocation_order(alloc: Any) -> list[int]:
    """The order v0 hands out free blocks: the hashless free list, then what the real evictor evicts, in turn.

    NOTE: a block the evictor counts but can no longer evict (its one heap entry
    went stale: ``LRUEvictor.update`` changes a timestamp without pushing a new
    entry, and ``evict`` drops an entry whose timestamp differs) is left out:
    it cannot be handed out, so the state invariants name it (ref_cnt 0, not
    free) instead of the queue hiding it.
    """
    order = list(alloc._hashless_allocator._free_block_indices)
    evictor = copy.deepcopy(alloc.evictor)
    while evictor.num_blocks:
        try:
            order.append(evictor.evict()[0])
        except ValueError:  # what is left has only stale heap entries
            break
    return order


class _Reset:
    """``reset_prefix_cache`` (v0 from 0.7.0)."""

    allocator: Any

    def reset_prefix_cache(self) -> bool:
        """v0's ``reset_prefix_cache``."""
        done: bool = self.allocator.reset_prefix_cache()
        return done


_WITH_RESET = type("VllmV0PoolAdapterWithReset", (_Reset, VllmV0PoolAdapter), {})


def make_v0_light_adapter(version: str) -> AdapterFactory:
    """A factory for one v0 release's allocator, loaded in light mode.

    Args:
        version: One of ``V0_RELEASES``.

    Returns:
        A factory (pool level, caching on) with the optional operations the release has.
    """

    def factory(config: AdapterConfig) -> BlockManagerAdapter | KVCacheManagerAdapter:
        allocator_cls = _allocator_module(version).PrefixCachingBlockAllocator
        has_reset = callable(getattr(allocator_cls, "reset_prefix_cache", None))
        cls = _WITH_RESET if has_reset else VllmV0PoolAdapter
        adapter: BlockManagerAdapter = cls(version, config)
        return adapter

    factory.__qualname__ = factory.__name__ = f"vllm@{version}"
    factory.min_num_gpu_blocks = 2  # type: ignore[attr-defined]
    factory.levels = ("pool",)  # type: ignore[attr-defined]
    return factory
