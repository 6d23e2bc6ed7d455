"""gpu_impl behind the conformance protocols: `kvspec check --impl gpu` builds it from here.

The pool and the manager already speak vLLM's operation names, so the adapter
only builds them from an `AdapterConfig`, on `config.device` (None: CUDA when
present, else the CPU). The manager also speaks the KV content protocol
(`set_kv_source`, `read_kv`), so the harness can check what a prefix hit
reads back from device memory. The manager has the config's KV cache groups
(`config.groups`); `read_kv` reads a hit's flat list group by group, each
group's blocks from its own store, and a null position reads as [].

With `config.events` both are built with KV cache events on
(`enable_kv_cache_events`), and the harness drains them through the
implementations' own `take_events`; the manager's `prefix_cache_stats`,
`evict_blocks`, `reset_prefix_cache`, capped `get_computed_blocks`,
`get_num_cached_tokens`, requests' hit limits, and the
asynchronous external load (`allocate_slots`' `delay_cache_blocks`,
`cache_blocks`) are its own methods too. It publishes every `BlockStored`
field and keeps every counter, so nothing is declared not applicable.
"""

from __future__ import annotations

from kvspec.conformance.core.adapter import AdapterConfig, BlockManagerAdapter, KVCacheManagerAdapter
from kvspec.gpu_impl.block_pool import TensorBlockPool
from kvspec.gpu_impl.kv_cache_manager import TensorKVCacheManager

__all__ = ["TensorManagerAdapter", "TensorPoolAdapter", "make_adapter"]


class TensorPoolAdapter(TensorBlockPool):
    """The tensor pool, built from a config."""

    def __init__(self, config: AdapterConfig) -> None:
        super().__init__(
            config.num_gpu_blocks,
            config.enable_caching,
            config.profile,
            config.device,
            enable_kv_cache_events=config.events,
        )


class TensorManagerAdapter(TensorKVCacheManager):
    """The tensor KVCacheManager with KV memory, built from a config."""

    uses_kvspec_hash_chain = True  # it hashes with kvspec.spec.hashing: hash values are compared exactly
    kv_cache_groups = True  # it builds the layout config.groups names, one KV store per group

    def __init__(self, config: AdapterConfig) -> None:
        super().__init__(
            config.num_gpu_blocks,
            config.block_size,
            config.enable_caching,
            config.profile,
            config.hash_fn,
            config.seed,
            config.device,
            groups=config.groups,
            enable_kv_cache_events=config.events,
        )


def make_adapter(config: AdapterConfig) -> BlockManagerAdapter | KVCacheManagerAdapter:
    """gpu_impl at the level the config asks for ("pool" or "manager").

    Raises:
        ValueError: the level is neither.
        InvalidRequest: the config's sizes, profile or device are not usable.
    """
    if config.level == "pool":
        return TensorPoolAdapter(config)
    if config.level == "manager":
        return TensorManagerAdapter(config)
    raise ValueError(f"gpu_impl builds level 'pool' or 'manager'; got level={config.level!r}")
