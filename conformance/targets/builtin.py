"""The built-in implementations as adapters: the spec itself, and the reference model.

The spec adapter holds a `PoolState` (or `ManagerState`) value and replaces it
after each operation; it exists so that `kvspec check --impl spec` runs the
harness's own plumbing against the spec, and so that users see the smallest
possible adapter.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

from kvspec.conformance.core.adapter import AdapterConfig, BlockManagerAdapter, KVCacheManagerAdapter
from kvspec.reference import BlockPool, KVCacheManager
from kvspec.spec import manager as spec_manager
from kvspec.spec import ops as spec_ops
from kvspec.spec.events import KVCacheEvent
from kvspec.spec.manager import Request
from kvspec.spec.state import BlockHash, BlockId, Snapshot
from kvspec.spec.stats import PrefixCacheStats
from kvspec.spec.step import Step

__all__ = [
    "ReferenceManagerAdapter",
    "ReferencePoolAdapter",
    "SpecManagerAdapter",
    "SpecPoolAdapter",
    "make_reference",
    "make_spec",
]


class _SpecState:
    """Holds a spec state value and steps it: every spec operation returns a `Step` (state, result, events)."""

    state: Any
    _events: list[KVCacheEvent]

    def _apply(self, operation: Callable[..., Step[Any, Any]], *args: Any) -> Any:
        step = operation(self.state, *args)
        self.state = step.state
        self._events.extend(step.events)
        return step.result

    def snapshot(self) -> Snapshot:
        return cast(Snapshot, self.state.snapshot())

    def take_events(self) -> list[KVCacheEvent]:
        """The events published since the last call (every Step's events, in order)."""
        events, self._events = self._events, []
        return events


class SpecPoolAdapter(_SpecState):
    """The spec's BlockPool operations behind the adapter protocol."""

    def __init__(self, config: AdapterConfig) -> None:
        self.state = spec_ops.new_pool(config.num_gpu_blocks, config.enable_caching, config.profile)
        self._events = []

    def get_new_blocks(self, num_blocks: int) -> list[BlockId]:
        return list(self._apply(spec_ops.get_new_blocks, num_blocks))

    def touch(self, block_ids: Sequence[BlockId]) -> None:
        self._apply(spec_ops.touch, block_ids)

    def get_cached_block(self, block_hash: BlockHash) -> BlockId | None:
        return cast("BlockId | None", self._apply(spec_ops.get_cached_block, block_hash))

    def cache_full_blocks(self, block_ids: Sequence[BlockId], block_hashes: Sequence[BlockHash]) -> None:
        self._apply(spec_ops.cache_full_blocks, block_ids, block_hashes)

    def free_blocks(self, block_ids: Sequence[BlockId], evict_first: bool = False) -> None:
        self._apply(spec_ops.free_blocks, block_ids, evict_first)

    def evict_blocks(self, block_ids: Sequence[BlockId]) -> None:
        self._apply(spec_ops.evict_blocks, block_ids)

    def reset_prefix_cache(self) -> bool:
        return bool(self._apply(spec_ops.reset_prefix_cache))

    def is_block_writable(self, block_id: BlockId) -> bool:
        return bool(self._apply(spec_ops.is_block_writable, block_id))

    def get_num_free_blocks(self) -> int:
        return int(self._apply(spec_ops.get_num_free_blocks))

    def get_usage(self) -> float:
        return float(self._apply(spec_ops.get_usage))


class SpecManagerAdapter(_SpecState):
    """The spec's KVCacheManager functions behind the adapter protocol."""

    uses_kvspec_hash_chain = True  # it is kvspec's chain: hash values are compared exactly
    kv_cache_groups = True  # it builds the layout config.groups names

    def __init__(self, config: AdapterConfig) -> None:
        self.state = spec_manager.new_manager(
            config.num_gpu_blocks,
            config.block_size,
            config.enable_caching,
            config.profile,
            config.hash_fn,
            config.seed,
            config.groups,
        )
        self._events = []

    def get_computed_blocks(
        self, request: Request, max_cache_hit_length: int | None = None
    ) -> tuple[list[BlockId], int]:
        blocks, num_tokens = self._apply(spec_manager.get_computed_blocks, request, max_cache_hit_length)
        return list(blocks), num_tokens

    def get_num_cached_tokens(self, request: Request) -> int:
        return int(self._apply(spec_manager.get_num_cached_tokens, request))

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Sequence[BlockId] = (),
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
    ) -> list[BlockId] | None:
        new_blocks = self._apply(
            spec_manager.allocate_slots,
            request,
            num_new_tokens,
            num_new_computed_tokens,
            new_computed_blocks,
            num_external_computed_tokens,
            delay_cache_blocks,
        )
        return None if new_blocks is None else list(new_blocks)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        self._apply(spec_manager.cache_blocks, request, num_computed_tokens)

    def free(self, request_id: str) -> None:
        self._apply(spec_manager.free, request_id)

    def evict_blocks(self, block_ids: Sequence[BlockId]) -> None:
        self._apply(spec_manager.evict_blocks, block_ids)

    def reset_prefix_cache(self) -> bool:
        return bool(self._apply(spec_manager.reset_prefix_cache))

    def prefix_cache_stats(self) -> PrefixCacheStats:
        """The hit statistics since the manager was built."""
        return cast(PrefixCacheStats, self.state.stats)


class ReferencePoolAdapter(BlockPool):
    """The reference BlockPool already speaks the protocol; this only builds it from a config."""

    def __init__(self, config: AdapterConfig) -> None:
        super().__init__(config.num_gpu_blocks, config.enable_caching, config.profile, config.events)


class ReferenceManagerAdapter(KVCacheManager):
    """The reference KVCacheManager, built from a config."""

    uses_kvspec_hash_chain = True  # it hashes with kvspec.spec.hashing: hash values are compared exactly
    kv_cache_groups = True  # it builds the layout config.groups names

    def __init__(self, config: AdapterConfig) -> None:
        super().__init__(
            config.num_gpu_blocks,
            config.block_size,
            config.enable_caching,
            config.profile,
            config.hash_fn,
            config.seed,
            config.groups,
            config.events,
        )


def make_spec(config: AdapterConfig) -> BlockManagerAdapter | KVCacheManagerAdapter:
    """The spec as an implementation under test."""
    return SpecPoolAdapter(config) if config.level == "pool" else SpecManagerAdapter(config)


def make_reference(config: AdapterConfig) -> BlockManagerAdapter | KVCacheManagerAdapter:
    """The reference model as an implementation under test."""
    return ReferencePoolAdapter(config) if config.level == "pool" else ReferenceManagerAdapter(config)
