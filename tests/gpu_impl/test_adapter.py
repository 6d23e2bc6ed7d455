"""The built-in adapter factory `kvspec.gpu_impl.adapter:make_adapter`: both levels, the device, events, bad configs."""

from __future__ import annotations

import pytest

from kvspec.conformance.core.adapter import (
    AdapterConfig,
    BlockManagerAdapter,
    KVCacheManagerAdapter,
    KVContentAdapter,
    capabilities,
)
from kvspec.gpu_impl.adapter import TensorManagerAdapter, TensorPoolAdapter, make_adapter
from kvspec.spec.errors import InvalidRequest
from kvspec.spec.events import AllBlocksCleared
from kvspec.spec.stats import PrefixCacheStats


def test_both_levels_speak_their_protocols():
    pool = make_adapter(AdapterConfig("pool", 8, device="cpu"))
    manager = make_adapter(AdapterConfig("manager", 8, block_size=2, device="cpu"))
    assert isinstance(pool, TensorPoolAdapter) and isinstance(pool, BlockManagerAdapter)
    assert capabilities(pool) == {
        "evict_blocks", "reset_prefix_cache", "is_block_writable", "get_num_free_blocks", "get_usage"
    }  # fmt: skip
    assert isinstance(manager, TensorManagerAdapter) and isinstance(manager, KVCacheManagerAdapter)
    assert isinstance(manager, KVContentAdapter)  # the harness reads its hits back from memory
    assert manager.block_size == 2 and manager.device.type == "cpu"


def test_the_config_is_honoured():
    pool = make_adapter(AdapterConfig("pool", 5, enable_caching=False, profile="vllm-v1-tail", device="cpu"))
    assert isinstance(pool, TensorPoolAdapter)
    assert (pool.num_gpu_blocks, pool.enable_caching, pool.profile) == (5, False, "vllm-v1-tail")


def test_bad_configs_are_refused():
    with pytest.raises(ValueError, match=r"^gpu_impl builds level 'pool' or 'manager'; got level='cluster'$"):
        make_adapter(AdapterConfig("cluster", 8))  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match=r"^device='tpu' is not a device name torch knows"):
        make_adapter(AdapterConfig("pool", 8, device="tpu"))
    with pytest.raises(InvalidRequest, match=r"^unknown hash_fn='md5'"):
        make_adapter(AdapterConfig("manager", 8, hash_fn="md5", device="cpu"))


def test_events_are_built_on_when_the_config_asks():
    for level in ("pool", "manager"):
        on = make_adapter(AdapterConfig(level, 8, block_size=2, device="cpu", events=True))  # type: ignore[arg-type]
        off = make_adapter(AdapterConfig(level, 8, block_size=2, device="cpu"))  # type: ignore[arg-type]
        pool_on = on.block_pool if isinstance(on, TensorManagerAdapter) else on
        pool_off = off.block_pool if isinstance(off, TensorManagerAdapter) else off
        assert pool_on.kv_event_queue == [] and pool_off.kv_event_queue is None, level
        assert on.reset_prefix_cache() and on.take_events() == [AllBlocksCleared()], level
        assert off.reset_prefix_cache() and off.take_events() == [], level
    manager = make_adapter(AdapterConfig("manager", 8, block_size=2, device="cpu"))
    # the request level's optional operations, every one
    assert capabilities(manager) == {"evict_blocks", "reset_prefix_cache", "cache_blocks", "get_num_cached_tokens"}
    assert manager.prefix_cache_stats() == PrefixCacheStats()
