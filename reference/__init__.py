"""The reference model: vLLM's data structures, O(1) work per block.

`BlockPool` (a linked free queue threaded through the blocks, a hash map that
keeps duplicates, the null block taken out at construction) and
`KVCacheManager` (request block tables over it). Same behaviour as
`kvspec.spec`, checked against it by the conformance harness.
"""

from kvspec.reference.block_pool import BlockPool
from kvspec.reference.free_queue import FreeKVCacheBlockQueue, KVCacheBlock
from kvspec.reference.kv_cache_manager import KVCacheManager

__all__ = ["BlockPool", "FreeKVCacheBlockQueue", "KVCacheBlock", "KVCacheManager"]
