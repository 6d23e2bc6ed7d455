"""gpu_impl: the block pool and its paged KV memory in torch tensors, on CUDA when present.

`TensorBlockPool` keeps ref counts, hash flags and the free order (integer
keys, lemma 6) in one array with two faces (`gpu_impl.mirror`): on the host,
where every call decides (a request's few blocks in Python, long batches as
tensor operations), and on the device, which follows for device code to
read; on the CPU the two are one memory.
`TensorKVCacheManager` adds request block tables, one per KV cache group
(full attention, sliding windows, chunked local attention), and the KV
memory a prefix hit reads back (`PagedKVCache`, one store per group in a
`GroupedKVCache`);
`gpu_impl.sizing` computes a pool's size from device memory. The adapter the
conformance harness builds (`kvspec.gpu_impl.adapter:make_adapter`) is kept
apart: nothing here knows it is being tested.

`device_check.sh` (beside this file) runs, on a CUDA machine, the conformance
checks on the device, the corruption tests and the benchmark, and prints one
table; `KVSPEC_DEVICE=cpu` runs it anywhere.

Names are imported on first use, so `kvspec.gpu_impl.sizing` (plain
arithmetic) works without importing torch.
"""

from __future__ import annotations

import importlib
import warnings
from typing import TYPE_CHECKING, Any

# NOTE: a torch built with NumPy support warns at import when NumPy is absent;
# gpu_impl never converts to NumPy, so the warning is noise in every output.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)

if TYPE_CHECKING:
    from kvspec.gpu_impl.block_pool import TensorBlockPool
    from kvspec.gpu_impl.device import pick_device
    from kvspec.gpu_impl.free_queue import KeyedFreeQueue
    from kvspec.gpu_impl.kv_cache import GroupedKVCache, PagedKVCache
    from kvspec.gpu_impl.kv_cache_manager import KVSource, TensorKVCacheManager, prefix_kv_source
    from kvspec.gpu_impl.sizing import CapacityPlan, KVLayout, parse_size, plan_capacity

__all__ = [
    "CapacityPlan",
    "GroupedKVCache",
    "KVLayout",
    "KVSource",
    "KeyedFreeQueue",
    "PagedKVCache",
    "TensorBlockPool",
    "TensorKVCacheManager",
    "parse_size",
    "pick_device",
    "plan_capacity",
    "prefix_kv_source",
]

_HOME = {
    "TensorBlockPool": "block_pool",
    "pick_device": "device",
    "KeyedFreeQueue": "free_queue",
    "GroupedKVCache": "kv_cache",
    "PagedKVCache": "kv_cache",
    "KVSource": "kv_cache_manager",
    "TensorKVCacheManager": "kv_cache_manager",
    "prefix_kv_source": "kv_cache_manager",
    "CapacityPlan": "sizing",
    "KVLayout": "sizing",
    "parse_size": "sizing",
    "plan_capacity": "sizing",
}


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
