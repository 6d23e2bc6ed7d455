"""What every plugin target shares: factories that load an overlay once per process, and the state in normal form.

A factory built here loads its overlay on first use (in the process that
runs the campaign, so a patch never outlives it) and then builds one
adapter per example from it. Pools the overlay drives through vLLM's own
adapter (kvspec.conformance.targets.vllm.adapter) need nothing else; a plugin whose
pool keeps its state in other structures (kvcached's allocator and LRU
dictionary, tpu-inference's intervals, vllm-mlx's own classes) reports it
through `pool_state`, which builds the spec's `Snapshot` from block objects
and an explicit free order.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from kvspec.conformance.core.adapter import AdapterConfig, LevelNotProvided
from kvspec.conformance.targets.plugins.overlay import Overlay
from kvspec.spec.state import BlockHash, BlockId, Snapshot, canonical_hash_to_blocks

__all__ = ["OverlayCache", "hash_table_entries", "make_factory", "pool_state"]

Factory = Callable[[AdapterConfig], object]


class OverlayCache:
    """One overlay per key and process, built on first use."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._built: dict[str, Overlay] = {}

    def get(self, key: str, build: Callable[[], Overlay]) -> Overlay:
        """The overlay for `key`, building it with `build` the first time."""
        with self._lock:
            if key not in self._built:
                self._built[key] = build()
            return self._built[key]


def make_factory(
    name: str,
    build: Callable[[AdapterConfig], object],
    levels: Sequence[str] = ("pool",),
    min_num_gpu_blocks: int = 1,
) -> Factory:
    """A factory named `name` for the levels given; another level is n/a (`LevelNotProvided`).

    Args:
        name: The implementation name (``"kvcached@0.30.0"``), shown in reports and traces.
        build: Builds the adapter for a configuration of a provided level.
        levels: The levels the target provides.
        min_num_gpu_blocks: The smallest pool it can build (the machine starts there).

    Returns:
        The factory, with ``levels`` and ``min_num_gpu_blocks`` declared on it.
    """
    provided = tuple(levels)

    def factory(config: AdapterConfig) -> object:
        if config.level not in provided:
            raise LevelNotProvided(f"{name} provides the {' and '.join(provided)} level, not {config.level}")
        return build(config)

    factory.__name__ = factory.__qualname__ = name
    factory.levels = provided  # type: ignore[attr-defined]
    factory.min_num_gpu_blocks = min_num_gpu_blocks  # type: ignore[attr-defined]
    return factory


def hash_table_entries(table: Any) -> Iterable[tuple[Any, list[Any]]]:
    """(key, blocks in registration order) of a vLLM-style hash table: a dict of one block or of ``{id: block}``."""
    cache = getattr(table, "_cache", table)  # BlockHashToBlockMap keeps its dict in _cache
    for key, value in cache.items():
        yield key, list(value.values()) if isinstance(value, dict) else [value]


def pool_state(
    config: AdapterConfig,
    blocks: Sequence[Any],
    free_queue: Sequence[int],
    table: Iterable[tuple[Any, Sequence[Any]]],
    raw: Callable[[Any], BlockHash],
    ref_cnt: Callable[[Any], int] = lambda block: int(block.ref_cnt),
    block_tables: tuple[tuple[str, tuple[BlockId, ...]], ...] | None = None,
) -> Snapshot:
    """A pool's state in the spec's normal form.

    Args:
        config: The configuration the pool was built for.
        blocks: Every block object, indexed by id (``block_id``, ``block_hash``).
        free_queue: The free block ids, in the order the pool hands them out.
        table: (key, blocks) for every hash-table entry, blocks in registration order.
        raw: A hash-table key, or a block's hash, as the harness's ``bytes``.
        ref_cnt: A block's reference count as the pool keeps it.
        block_tables: The running requests' block tables, at the request level.

    Returns:
        The snapshot.
    """
    n = config.num_gpu_blocks
    counts = [0] * n
    hashes: list[BlockHash | None] = [None] * n
    for block in blocks:
        counts[block.block_id] = ref_cnt(block)
        hashes[block.block_id] = None if block.block_hash is None else raw(block.block_hash)
    entries = tuple((raw(key), tuple(BlockId(b.block_id) for b in found)) for key, found in table)
    return Snapshot(
        num_gpu_blocks=n,
        enable_caching=config.enable_caching,
        ref_cnt=tuple(counts),
        block_hash=tuple(hashes),
        free_queue=tuple(BlockId(b) for b in free_queue),
        hash_to_blocks=canonical_hash_to_blocks(entries),
        block_tables=block_tables,
    )
