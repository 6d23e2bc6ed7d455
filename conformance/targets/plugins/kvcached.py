"""kvcached's ``ElasticBlockPool`` on a vLLM release, as kvcached's vLLM integration builds it.

In production kvcached patches vLLM at start-up: ``ElasticBlockPoolPatch``
injects the class ``ElasticBlockPool(BlockPool)`` into
``vllm.v1.core.block_pool`` (with ``NativeBlockPoolMixin`` in front of it on
vLLM 0.26 to 0.30), and its ``KVCacheCoordinator`` patch builds the pool as
``ElasticBlockPool(num_blocks, block_size, cell_size=..., num_layers=...,
enable_caching=..., num_kv_buffers=..., max_cached_blocks=..., hash_block_size=...)``.
The overlay does the same: the patch runs unmodified from kvcached's source
distribution (it ships no wheel), and the factory constructs the pool with
those arguments. Block ids come from kvcached's own ``KVCacheManager``, run
as shipped; only its C++ page allocator and GPU set-up are placeholders
(kvspec.conformance.targets.plugins.kvcached_device).

The geometry: every pool the harness builds lies on one page
(``KVCACHED_PAGE_SIZE_MB`` is set to 2 MiB per block, and a block is 2 MiB),
as a small pool does in production, where a 2 MiB page holds dozens of
blocks. The page's FIFO free list then decides which free block comes next.

How the pool orders its free blocks, and what of the spec's order applies:
a block freed without a hash goes back to the page's free list at its end
(reused oldest-freed first); a block freed with a hash stays cached in an
LRU dictionary (``_evictable_blocks``, in freeing order; a touch takes it
out, a later free puts it at the end) and is evicted only when the page has
too few free blocks for an allocation, least recently freed first. So:
blocks without a hash are handed out before any cached block is evicted,
and cached blocks are evicted in LRU order, as in the spec's ``vllm-v1``;
but among blocks without a hash kvcached reuses the oldest freed first,
where vLLM (since 0.24) reuses the newest freed first. The snapshot lists
the free blocks in the order kvcached hands them out (the page's free list,
then the LRU dictionary) and the harness compares it exactly, so the order
difference is reported, not excused.
"""

from __future__ import annotations

from typing import Any

from kvspec.conformance.core.adapter import AdapterConfig
from kvspec.conformance.core.reactions import NotExpressible
from kvspec.conformance.targets.plugins import kvcached_device
from kvspec.conformance.targets.plugins.adapters import OverlayCache, hash_table_entries, make_factory, pool_state
from kvspec.conformance.targets.plugins.dist import PluginDist, fetch_dist
from kvspec.conformance.targets.plugins.overlay import Overlay, load_overlay
from kvspec.conformance.targets.vllm.adapter import make_pool_adapter
from kvspec.spec.state import BlockId, Snapshot

__all__ = ["DIST", "KNOWN_DEVIATIONS", "SUPPORTED_VLLM", "apply", "factory", "load"]

DIST = PluginDist("kvcached", "0.1.6", ("kvcached/",), kind="sdist")
# kvcached 0.1.6's README: "vLLM ≥ v0.17.0 (tested up to v0.30.0)"
SUPPORTED_VLLM = "0.30.0"

# Results that differ from vLLM's by design, read from kvcached's source: not compared in the
# campaigns (the summary says so), and shown by a directed probe in `kvspec oracle --plugins`.
KNOWN_DEVIATIONS: dict[str, str] = {
    "get_usage": "kvcached 0.1.6 counts the null block as used: get_usage() = 1 - free / num_gpu_blocks "
    "(ElasticBlockPool.get_usage), where vLLM from 0.10.2 divides by num_gpu_blocks - 1",
}

_MIB = 1024 * 1024
_BLOCK_MEM_SIZE = 2 * _MIB  # bytes per block and layer: one block per 2 MiB of a page
_CACHE = OverlayCache()


def apply(overlay: Overlay) -> None:
    """Inject ``ElasticBlockPool`` as kvcached does and build the harness's pools as its coordinator patch does."""
    patches = overlay.import_plugin("kvcached.integration.vllm.patches")
    block_pool_mod = overlay.module("vllm.v1.core.block_pool")
    if not patches.ElasticBlockPoolPatch().apply(block_pool_mod):
        raise RuntimeError(f"{overlay.label}: ElasticBlockPoolPatch.apply returned False (vLLM version not detected?)")
    elastic = block_pool_mod.ElasticBlockPool
    manager_mod = overlay.import_plugin("kvcached.kv_cache_manager")

    def build(num_gpu_blocks: int, enable_caching: bool, hash_block_size: int = 16) -> Any:
        # KVCACHED_PAGE_SIZE_MB as the whole pool: one page (kvcached reads it into PAGE_SIZE at import)
        setattr(manager_mod, "PAGE_SIZE", num_gpu_blocks * _BLOCK_MEM_SIZE)  # noqa: B010
        pool = elastic(
            num_gpu_blocks,
            hash_block_size,
            cell_size=_BLOCK_MEM_SIZE // hash_block_size,
            num_layers=1,
            enable_caching=enable_caching,
            num_kv_buffers=2,
            max_cached_blocks=patches._get_max_cached_blocks(hash_block_size),
            hash_block_size=hash_block_size,
        )
        # Production schedules only once the workers created the KV tensors and
        # the manager reserved block 0 (its start-up thread); wait for that too.
        pool.kv_cache_manager._wait_post_init()
        return pool

    overlay.use_pool_class(build)


def load(vllm_version: str) -> Overlay:
    """kvcached's source on a fresh light-mode copy of a vLLM release, applied (once per process)."""

    def build() -> Overlay:
        root = fetch_dist(DIST)
        overlay = load_overlay(
            vllm_version,
            {"kvcached": root},
            label=f"{DIST.label} on vllm=={vllm_version}",
            placeholders={
                "kvcached.vmm_ops": kvcached_device.vmm_ops_module,
                "kvcached.integration.vllm.interfaces": kvcached_device.interfaces_module,
            },
        )
        apply(overlay)
        return overlay

    return _CACHE.get(vllm_version, build)


class _ElasticState:
    """The vLLM adapter's translation, with the state read where ``ElasticBlockPool`` keeps it."""

    pool: Any
    config: AdapterConfig
    _raw: Any

    def _block(self, block_id: BlockId, op: str) -> Any:
        blocks = self.pool.kv_block_pool
        if isinstance(block_id, bool) or not isinstance(block_id, int) or not 0 <= block_id < len(blocks):
            raise NotExpressible(f"{op}: block_id={block_id!r} names no block of kvcached (ids 0..{len(blocks) - 1})")
        return blocks[block_id]

    def snapshot(self) -> Snapshot:
        """Blocks and hashes as kvcached keeps them; free blocks in the order kvcached hands them out."""
        pool, manager = self.pool, self.pool.kv_cache_manager
        pages = list(manager.avail_pages.values()) + list(manager.full_pages.values())
        assert len(pages) <= 1 and manager.page_allocator.get_num_free_pages() == 0, (
            f"the overlay builds every pool on one page; pages={[p.page_id for p in pages]}"
        )
        order = list(manager.reserved_blocks) + [b for page in pages for b in page.free_list]
        order += list(pool._evictable_blocks)  # evicted (least recently freed first) once the page runs out
        native = getattr(pool, "cached_block_hash_to_block", None)  # NativeBlockPoolMixin (vLLM 0.26 to 0.30)
        table = hash_table_entries(native if native is not None else pool._cached_blocks)
        return pool_state(self.config, pool.kv_block_pool, order, table, self._raw)


def _adapter(vllm_version: str, config: AdapterConfig) -> object:
    release = load(vllm_version).vllm_release()
    adapter = make_pool_adapter(release, config)
    # the same translation and operations, with the state read from kvcached's structures
    adapter.__class__ = type("KvcachedPoolAdapter", (_ElasticState, type(adapter)), {})
    # A declared fact of kvcached 0.1.6 (patches.py), shown by the usage probe; the
    # rest of the pool is still compared. A release that changes it diverges there.
    adapter.known_deviations = dict(KNOWN_DEVIATIONS)
    # kvcached's own reactions to caller mistakes are not declared: every campaign diverges on a
    # valid call first (a page's blocks go out in FIFO order), so no survey can measure one and
    # no campaign could check one. No mistake is sent; the summary lists them all.
    adapter.mistake_reactions = {}
    return adapter


def factory(vllm_version: str = SUPPORTED_VLLM) -> Any:
    """The factory for ``kvcached@<vllm_version>`` (pool level)."""
    return make_factory(f"kvcached@{vllm_version}", lambda config: _adapter(vllm_version, config))
