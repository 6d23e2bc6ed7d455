"""vllm-mlx's block pool and prefix cache, from its wheel: ``PagedCacheManager`` and ``BlockAwarePrefixCache``.

vllm-mlx (vLLM's API on Apple silicon) does not build on vLLM's pool: its
``paged_cache.py`` is a clone of it (``CacheBlock``, a doubly linked
``FreeKVCacheBlockQueue``, ``BlockHashToBlockMap``, ``PagedCacheManager``
with vLLM's operation names), and ``prefix_cache.py``'s
``BlockAwarePrefixCache`` is the request path its scheduler uses with
``use_paged_cache``. Both modules run unmodified from the wheel (stdlib
only; ``mlx`` is imported in a ``try`` and left out, so no tensor data is
stored). Nothing is a placeholder.

Pool level (`MlxPoolAdapter`): vLLM's operations map one to one, except
that ``cache_full_blocks`` hashes a block itself, from its tokens and its
parent's hash. The adapter registers block b under the harness's hash h by
giving it, as its only block, tokens that name h (a number per distinct
hash, so vllm-mlx's own hash of them is a function of h alone) and looks h up through the same function.
``PagedCacheManager`` holds its null block with ``ref_count`` 1 where vLLM
keeps it at 0; the adapter reports 1 as the spec's 0, any other value as
is. The profile it claims: every freed block goes to the right end
(``free_block_batch`` appends), ``vllm-v1-tail``.

Request level (`MlxPrefixCacheAdapter`): ``fetch_cache(request_id,
tokens)`` both looks a prompt up and takes references on the hit; the
harness asks for the lookup (``get_computed_blocks``) before the allocation
(``allocate_slots``), so the adapter answers the lookup with the functions
``fetch_cache`` looks up with (``find_shared_prefix``, then
``_find_best_prefix_match``) and calls ``fetch_cache`` itself at the
request's first ``allocate_slots``, followed by ``store_cache`` over the
tokens computed so far (it allocates the blocks beyond those the request
holds); ``free`` is ``release_cache``. vllm-mlx's scheduler calls
``store_cache`` once, when a request finishes, and never ``release_cache``:
its KV lives in mlx-lm's own cache while the request runs. The harness
drives the same calls step by step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvspec.conformance.core.adapter import AdapterConfig
from kvspec.conformance.core.reactions import NotExpressible
from kvspec.conformance.targets.plugins.adapters import OverlayCache, hash_table_entries, make_factory, pool_state
from kvspec.conformance.targets.plugins.dist import PluginDist, fetch_dist
from kvspec.conformance.targets.plugins.overlay import Overlay, load_plugin
from kvspec.spec.errors import PoolExhausted
from kvspec.spec.manager import Request
from kvspec.spec.state import BlockHash, BlockId, Snapshot

__all__ = ["DIST", "MlxPoolAdapter", "MlxPrefixCacheAdapter", "factory", "load"]

DIST = PluginDist("vllm-mlx", "0.6.0", ("vllm_mlx/paged_cache.py", "vllm_mlx/prefix_cache.py"))
_CACHE = OverlayCache()


def load() -> Overlay:
    """vllm-mlx's two modules from its wheel (once per process)."""

    def build() -> Overlay:
        return load_plugin({"vllm_mlx": fetch_dist(DIST)}, label=DIST.label)

    return _CACHE.get("", build)


def _null_ref_cnt(block: Any) -> int:
    # vllm-mlx pins its null block at ref_count 1; that is the spec's 0 (its ref_cnt is not maintained)
    return 0 if block.is_null and block.ref_count == 1 else int(block.ref_count)


class MlxPoolAdapter:
    """``PagedCacheManager`` behind the pool protocol.

    Attributes:
        validates_bad_input: False: vllm-mlx checks no argument but an over-allocation.
        rejected_mistakes: That one.
    """

    validates_bad_input = False
    rejected_mistakes = frozenset({"get_new_blocks: more than free"})

    def __init__(self, config: AdapterConfig) -> None:
        self.config = config
        self.paged = load().import_plugin("vllm_mlx.paged_cache")
        self.pool: Any = self.paged.PagedCacheManager(
            block_size=config.block_size, max_blocks=config.num_gpu_blocks, enable_caching=config.enable_caching
        )
        self._names: dict[bytes, BlockHash] = {}  # vllm-mlx's hash of a block -> the harness's hash
        self._numbers: dict[bytes, int] = {}  # the harness's hash -> the token that names it

    def _block(self, block_id: BlockId, op: str) -> Any:
        blocks = self.pool.blocks
        if isinstance(block_id, bool) or not isinstance(block_id, int) or not 0 <= block_id < len(blocks):
            raise NotExpressible(f"{op}: block_id={block_id!r} names no block of vllm-mlx (ids 0..{len(blocks) - 1})")
        return blocks[block_id]

    def _tokens(self, block_hash: BlockHash) -> list[int]:
        """A block's worth of tokens that names the hash: its number, in order of first use, then zeros.

        Token ids must fit in 4 bytes (vllm-mlx packs them so), so a hash is named, not spelt.
        """
        number = self._numbers.setdefault(bytes(block_hash), len(self._numbers) + 1)
        return [number] + [0] * (self.config.block_size - 1)

    def _mlx_hash(self, block_hash: BlockHash) -> bytes:
        mlx_hash: bytes = self.paged.compute_block_hash(None, self._tokens(block_hash))
        self._names[mlx_hash] = block_hash
        return mlx_hash

    def get_new_blocks(self, num_blocks: int) -> list[BlockId]:
        """``get_new_blocks``; its over-allocation ``ValueError`` becomes ``PoolExhausted``."""
        try:
            return [BlockId(b.block_id) for b in self.pool.get_new_blocks(num_blocks)]
        except ValueError as e:
            if not str(e).startswith("Cannot allocate"):
                raise
            raise PoolExhausted(f"cannot allocate num_blocks={num_blocks} ({DIST.label} said: {e})") from e

    def touch(self, block_ids: Sequence[BlockId]) -> None:
        """``touch``."""
        self.pool.touch([self._block(b, "touch") for b in block_ids])

    def get_cached_block(self, block_hash: BlockHash) -> BlockId | None:
        """``get_cached_block``, with the hash vllm-mlx gave the block's tokens."""
        block = self.pool.get_cached_block(self._mlx_hash(block_hash))
        return None if block is None else BlockId(block.block_id)

    def cache_full_blocks(self, block_ids: Sequence[BlockId], block_hashes: Sequence[BlockHash]) -> None:
        """``cache_full_blocks`` block by block, each the first block of its own token list."""
        for b, h in zip(block_ids, block_hashes):
            self._mlx_hash(h)
            self.pool.cache_full_blocks([self._block(b, "cache_full_blocks")], self._tokens(h), 0, 1)

    def free_blocks(self, block_ids: Sequence[BlockId]) -> None:
        """``free_block_batch`` (vLLM's ``free_blocks``), in the given order."""
        self.pool.free_block_batch([self._block(b, "free_blocks") for b in block_ids])

    def reset_prefix_cache(self) -> bool:
        """``reset_prefix_cache``."""
        return bool(self.pool.reset_prefix_cache())

    def get_num_free_blocks(self) -> int:
        """The ``free_blocks`` property."""
        return int(self.pool.free_blocks)

    def get_usage(self) -> float:
        """The ``usage`` property."""
        return float(self.pool.usage)

    def snapshot(self) -> Snapshot:
        """Blocks, the free queue (walked from its head) and the hash table, in the spec's form."""
        queue = [b.block_id for b in self.pool.free_block_queue.get_all_free_blocks()]
        table = hash_table_entries(self.pool.cached_block_hash_to_block)
        return pool_state(self.config, self.pool.blocks, queue, table, self._raw, _null_ref_cnt)

    def _raw(self, mlx_hash: Any) -> BlockHash:
        return self._names.get(bytes(mlx_hash), BlockHash(bytes(mlx_hash)))


class MlxPrefixCacheAdapter:
    """``BlockAwarePrefixCache`` over a ``PagedCacheManager`` behind the request protocol (see the module docstring).

    Attributes:
        validates_bad_input: False: vllm-mlx checks no request.
        rejected_mistakes: None.
    """

    validates_bad_input = False
    rejected_mistakes: frozenset[str] = frozenset()

    def __init__(self, config: AdapterConfig) -> None:
        self.config = config
        overlay = load()
        paged_mod = overlay.import_plugin("vllm_mlx.paged_cache")
        prefix_mod = overlay.import_plugin("vllm_mlx.prefix_cache")
        self.paged: Any = paged_mod.PagedCacheManager(
            block_size=config.block_size, max_blocks=config.num_gpu_blocks, enable_caching=config.enable_caching
        )
        self.cache: Any = prefix_mod.BlockAwarePrefixCache(None, self.paged)
        self._computed: dict[str, int] = {}  # running request -> tokens computed so far

    def get_computed_blocks(self, request: Request) -> tuple[list[BlockId], int]:
        """What ``fetch_cache`` finds for the prompt, without taking its references yet."""
        tokens = list(request.token_ids)
        shared, _ = self.paged.find_shared_prefix(tokens)
        if not shared:
            best = self.cache._find_best_prefix_match(tokens) if tokens else None
            shared = list(best[1]) if best else []
        # fetch_cache keeps the blocks still allocated and counts their tokens
        found = [self.paged.allocated_blocks[b] for b in shared if b in self.paged.allocated_blocks]
        return [BlockId(b.block_id) for b in found], sum(b.token_count for b in found)

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Sequence[BlockId] = (),
        num_external_computed_tokens: int = 0,
    ) -> list[BlockId] | None:
        """``fetch_cache`` at admission, then ``store_cache`` over the tokens computed after this step."""
        rid, tokens = request.request_id, list(request.token_ids)
        if rid not in self._computed:
            self.cache.fetch_cache(rid, tokens)
            self._computed[rid] = 0
        table = self.paged.get_block_table(rid)
        before = len(table.block_ids) if table is not None else 0
        total = self._computed[rid] + num_new_computed_tokens + num_external_computed_tokens + num_new_tokens
        stored = self.cache.store_cache(rid, tokens[:total], [])
        self._computed[rid] = total
        return [] if stored is None else [BlockId(b) for b in stored.block_ids[before:]]

    def free(self, request_id: str) -> None:
        """``release_cache``: every block of the request's table freed, head first."""
        self.cache.release_cache(request_id)
        self._computed.pop(request_id, None)

    def snapshot(self) -> Snapshot:
        """The pool, with each block's hash as the prefix cache keys it (its own tokens), and the block tables."""
        paged = self.paged
        queue = [b.block_id for b in paged.free_block_queue.get_all_free_blocks()]
        table = [(h, [paged.blocks[b]]) for h, b in paged.hash_to_block.items()]
        tables = tuple(
            (rid, tuple(BlockId(b) for b in paged.request_tables[rid].block_ids))
            for rid in sorted(self._computed)
            if rid in paged.request_tables
        )
        blocks = [_LegacyView(b) for b in paged.blocks]
        return pool_state(self.config, blocks, queue, table, _legacy_raw, _null_ref_cnt, tables)


class _LegacyView:
    """A block as the prefix cache sees it: its hash is ``hash_value``, the digest of its own tokens."""

    def __init__(self, block: Any) -> None:
        self.block_id, self.is_null, self.ref_count = block.block_id, block.is_null, block.ref_count
        self.block_hash = block.hash_value


def _legacy_raw(hash_value: Any) -> BlockHash:
    return BlockHash(str(hash_value).encode())


def factory() -> Any:
    """The factory for ``vllm-mlx``: ``PagedCacheManager`` (pool) and ``BlockAwarePrefixCache`` (request level)."""

    def build(config: AdapterConfig) -> object:
        return MlxPoolAdapter(config) if config.level == "pool" else MlxPrefixCacheAdapter(config)

    return make_factory("vllm-mlx", build, levels=("pool", "manager"))
