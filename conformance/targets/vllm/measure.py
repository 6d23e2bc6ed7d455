"""A vLLM's ``ReleaseFacts``, measured from the loaded code instead of read from the table (`kvspec facts`).

Why: releases.py declares each release's facts, and a vLLM the table has
never seen (a newer release, a development build, a pull request's checkout)
is checked under the facts of the declared release before it. Whether that
is right is a question about the new vLLM, answered here by measuring it:
the API fields from signatures and attributes (what the pool adapter already
reads, taken from it, not read again), the behaviours from a short scenario
each, run on a pool of 8 blocks with explicit block ids. The same functions,
run on every declared release, check the table itself.

Design choice: a fact no function here can measure is left out of
``MeasuredFacts.values`` with the reason in ``not_measured``; it is never
filled in from the table. The rejected alternative, the nearest declared
release's value in its place, would print a guess as a measurement, and a
table checked against itself would pass whatever it says. Likewise a
scenario that raises where none should is a fact not measured, with the
exception named, not a run that stops: a vLLM nobody has seen yet is
measured as far as it can be.
"""

from __future__ import annotations

import ast
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from kvspec.conformance.core.adapter import AdapterConfig
from kvspec.conformance.targets.builtin import make_reference
from kvspec.conformance.targets.loader import is_placeholder
from kvspec.conformance.targets.vllm.adapter import VllmPoolAdapter, VllmRelease, make_pool_adapter
from kvspec.conformance.targets.vllm.hashes import measure_release
from kvspec.conformance.targets.vllm.lightmode import LightModeError, tree_package
from kvspec.conformance.targets.vllm.releases import RELEASES, ReleaseFacts
from kvspec.spec.state import BlockHash, BlockId

__all__ = ["FACT_FIELDS", "MeasuredFacts", "free_order_scenario", "measure_facts"]

# Every fact of a release, in ReleaseFacts' order (its version is not a fact).
FACT_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(ReleaseFacts) if f.name != "version")

_H1, _H2 = BlockHash(b"\x00\x01"), BlockHash(b"\xff")
_NUM_GPU_BLOCKS = 8  # the null block included; every scenario's pool


class _NotMeasured(Exception):
    """This vLLM gives no way to measure the fact (the message says why)."""


@dataclass(frozen=True, slots=True)
class MeasuredFacts:
    """What was measured of one vLLM.

    Attributes:
        version: The vLLM's version (a tree's ``0.34.0.dev0+tree``).
        label: How reports name it (``vllm==0.34.0 (light)``).
        values: Each measured fact's value, by ``ReleaseFacts`` field name.
        not_measured: Each fact not measured, and why.
    """

    version: str
    label: str
    values: dict[str, Any]
    not_measured: dict[str, str]


def measure_facts(release: VllmRelease) -> MeasuredFacts:
    """Measure every fact of ``ReleaseFacts`` the loaded vLLM shows.

    Args:
        release: A vLLM loaded in light mode, from a source tree, or installed.

    Returns:
        Its measured facts; each one not measured with the reason.
    """
    values: dict[str, Any] = {}
    not_measured: dict[str, str] = {}
    for name in FACT_FIELDS:
        measure = _MEASURES.get(name)
        if measure is None:
            not_measured[name] = _UNMEASURABLE[name]
            continue
        try:
            values[name] = measure(release)
        except _NotMeasured as e:
            not_measured[name] = str(e)
        except Exception as e:  # noqa: BLE001 - a vLLM nobody has seen may raise anything; the fact says which
            not_measured[name] = f"its scenario raised {type(e).__name__}: {e}"
    return MeasuredFacts(release.version, release.label, values, not_measured)


def _pool(release: VllmRelease, caching: bool = True) -> VllmPoolAdapter:
    """A fresh pool adapter over the release (the null block taken out where it has one)."""
    config = AdapterConfig(level="pool", num_gpu_blocks=_NUM_GPU_BLOCKS, enable_caching=caching)
    return make_pool_adapter(release, config)


def _params(fn: Callable[..., Any]) -> tuple[str, ...]:
    """A callable's parameter names (after ``self`` for a bound method or a class)."""
    return tuple(inspect.signature(fn).parameters)


# ---------------------------------------------------------------------------
# the API, as the adapter reads it


def _pool_init_params(release: VllmRelease) -> tuple[str, ...]:
    return _params(release.block_pool.BlockPool)


def _has_is_null_flag(release: VllmRelease) -> bool:
    return hasattr(_pool(release).pool.blocks[0], "is_null")


def _cache_full_blocks_params(release: VllmRelease) -> tuple[str, ...]:
    return _pool(release)._cfb_params


def _block_hashes_from_request(release: VllmRelease) -> bool:
    # the hashes are an argument until the release reads the request's own
    return "block_hashes" not in _pool(release)._cfb_params


def _has_block_hash_to_block_map(release: VllmRelease) -> bool:
    return type(_pool(release).pool.cached_block_hash_to_block).__name__ == "BlockHashToBlockMap"


def _free_blocks_takes(keyword: str) -> Callable[[VllmRelease], bool]:
    return lambda release: keyword in _params(_pool(release).pool.free_blocks)


def _hash_map_holds_block_ids(release: VllmRelease) -> bool:
    return hasattr(_pool(release).pool.cached_block_hash_to_block, "_dup_ids")


def _request_hit_limit(release: VllmRelease) -> bool:
    """The request's hit limit and the manager's ``get_num_cached_tokens``, where those modules load; for a
    source tree, read from its files (light mode runs neither module, but the tree holds both)."""
    request = getattr(release.module("vllm.v1.request"), "Request", None)
    manager = getattr(release.module("vllm.v1.core.kv_cache_manager"), "KVCacheManager", None)
    if request is not None and manager is not None and not is_placeholder(request) and not is_placeholder(manager):
        return hasattr(request, "get_max_cache_hit_length") and hasattr(manager, "get_num_cached_tokens")
    if release.source != "tree":
        raise _NotMeasured(f"{release.label} has no request level here: light mode loads only the pool's modules")
    try:
        root, package = tree_package(Path(release.where), release.where)
    except LightModeError as e:
        raise _NotMeasured(f"{release.label}: {e}") from None
    found = [_defines_method(root / package / file, cls, method) for file, cls, method in (
        ("v1/request.py", "Request", "get_max_cache_hit_length"),
        ("v1/core/kv_cache_manager.py", "KVCacheManager", "get_num_cached_tokens"),
    )]  # fmt: skip
    if None in found:
        raise _NotMeasured(f"{release.label}: the tree has no {package}/v1/request.py or kv_cache_manager.py to read")
    return all(found)


def _defines_method(path: Path, cls: str, method: str) -> bool | None:
    """Whether the file's top-level class ``cls`` defines ``method`` (read, not run); None: no such file or class."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return None
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            return any(isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name == method for n in node.body)
    return None


def _hash_chain_differs(release: VllmRelease) -> tuple[str, ...]:
    """``kvspec.conformance.targets.vllm.hashes``' measurement, in fresh interpreters (a release of the table)."""
    if release.source != "light" or release.version not in RELEASES:
        raise _NotMeasured(
            f"{release.label}: the chain is measured for a release of the table only (its default hash "
            "function, which kvspec does not measure, picks the chain)"
        )
    return measure_release(release.version).differences


# ---------------------------------------------------------------------------
# the behaviours, one scenario each (8 blocks, explicit ids)


def free_order_scenario(pool: Any) -> list[BlockId]:
    """Free [7, 6] (no hash), then [3, 2h, 1h] tail first, then [5, 4]: the free queue after, left to right.

    Args:
        pool: A fresh pool adapter of 8 blocks with caching on (block 1 hashed ``b"\\x00\\x01"``, 2 ``b"\\xff"``).

    Returns:
        The free queue's block ids: the order checks the eviction order.
    """
    pool.get_new_blocks(7)
    pool.cache_full_blocks([BlockId(1), BlockId(2)], [_H1, _H2])
    for freed in ([7, 6], [3, 2, 1], [5, 4]):
        pool.free_blocks([BlockId(b) for b in freed])
    return list(pool.snapshot().free_queue)


_FREE_ORDERS: dict[tuple[int, ...], str] = {(7, 6, 3, 2, 1, 5, 4): "all_right", (5, 4, 3, 7, 6, 2, 1): "hashless_left"}


def _free_order(release: VllmRelease) -> str:
    queue = free_order_scenario(_pool(release))
    return _FREE_ORDERS.get(tuple(queue), f"neither: free queue {queue}")


def _matches_seed_order(release: VllmRelease) -> bool:
    """The free-order scenario leaves the queue the spec's seed order (the reference under vllm-v1) does."""
    seed = make_reference(AdapterConfig(level="pool", num_gpu_blocks=_NUM_GPU_BLOCKS, profile="vllm-v1"))
    return free_order_scenario(_pool(release)) == free_order_scenario(seed)


def _free_end_without_caching(release: VllmRelease) -> str:
    pool = _pool(release, caching=False)
    pool.get_new_blocks(7)
    pool.free_blocks([BlockId(7), BlockId(6)])
    pool.free_blocks([BlockId(1), BlockId(2)])
    queue = list(pool.snapshot().free_queue)
    ends: dict[tuple[int, ...], str] = {(1, 2, 7, 6): "left", (7, 6, 1, 2): "right"}
    return ends.get(tuple(queue), f"neither: free queue {queue}")


def _null_block_ref_cnt_after(release: VllmRelease, op: str) -> tuple[int, bool] | None:
    """The null block's ``ref_cnt`` after ``op([null_block])``, and whether it is then queued (None: no null block)."""
    pool = _pool(release)
    if not pool.has_null_block:
        return None
    getattr(pool, op)([BlockId(0)])
    snap = pool.snapshot()
    return snap.ref_cnt[0], 0 in snap.free_queue


def _null_on_free(release: VllmRelease) -> str:
    after = _null_block_ref_cnt_after(release, "free_blocks")
    if after is None:
        return "no_null_block"
    named = {(-1, False): "decrements_ref_cnt", (0, False): "skipped"}
    return named.get(after, f"neither: ref_cnt={after[0]}, queued={after[1]}")


def _touch_skips_null(release: VllmRelease) -> bool:
    # a release without a null block has none to skip: False, as the table says
    after = _null_block_ref_cnt_after(release, "touch")
    return after is not None and after[0] == 0


def _usage_counts_null(release: VllmRelease) -> bool | str:
    """``get_usage`` after one block is taken, against vLLM's own pool size with and without the null block."""
    adapter = _pool(release)
    adapter.get_new_blocks(1)
    pool = adapter.pool
    usage, free, total = pool.get_usage(), pool.get_num_free_blocks(), pool.num_gpu_blocks
    if math.isclose(usage, 1 - free / total):
        return True
    if math.isclose(usage, 1 - free / (total - 1)):
        return False
    return f"neither: get_usage()={usage} with {free} of {total} free"


def _reset_needs_all_free(release: VllmRelease) -> bool:
    """Refused (nothing changed) while a block is held; with all free, every hash dropped, the queue kept."""
    pool = _pool(release)
    pool.get_new_blocks(2)
    pool.cache_full_blocks([BlockId(1)], [_H1])
    held = pool.snapshot()
    refused = pool.reset_prefix_cache() is False and pool.snapshot() == held
    pool.free_blocks([BlockId(2), BlockId(1)])
    queue = pool.snapshot().free_queue
    done = pool.reset_prefix_cache() is True
    after = pool.snapshot()
    return refused and done and after.free_queue == queue and not any(after.block_hash) and not after.hash_to_blocks


def _error_of(pool: VllmPoolAdapter, call: Callable[[], object]) -> str | None:
    """The type name of what ``call`` raises, ``(state changed)`` added where it changed the pool; None: nothing."""
    before = pool.snapshot()
    try:
        call()
    except Exception as e:  # noqa: BLE001 - which exception it is, is the fact measured
        return type(e).__name__ + ("" if pool.snapshot() == before else " (state changed)")
    return None


def _overallocate_error(release: VllmRelease) -> str:
    pool = _pool(release)
    return _error_of(pool, lambda: pool.get_new_blocks(pool.get_num_free_blocks() + 1)) or "no error"


def _double_free_error(release: VllmRelease) -> str | None:
    """None: no error, ``ref_cnt`` -1 and the queue unchanged (what the table's None means)."""
    pool = _pool(release)
    pool.get_new_blocks(1)
    pool.free_blocks([BlockId(1)])
    queue = pool.snapshot().free_queue
    error = _error_of(pool, lambda: pool.free_blocks([BlockId(1)]))
    after = pool.snapshot()
    if error is None and (after.ref_cnt[1], after.free_queue) != (-1, queue):
        return f"no error, and ref_cnt={after.ref_cnt[1]}, queue {'kept' if after.free_queue == queue else 'changed'}"
    return error


def _blocks_know_their_pool(release: VllmRelease) -> bool:
    """A block of another pool, freed through this one, goes back to the pool that made it."""
    device, host = _pool(release), _pool(release)
    device.get_new_blocks(1)
    host.get_new_blocks(1)
    before = device.get_num_free_blocks(), host.get_num_free_blocks()
    device.pool.free_blocks([host._block(BlockId(1), "free_blocks")])
    return (device.get_num_free_blocks(), host.get_num_free_blocks()) == (before[0], before[1] + 1)


_MEASURES: dict[str, Callable[[VllmRelease], Any]] = {
    "pool_init_params": _pool_init_params,
    "has_null_block": lambda release: _pool(release).has_null_block,
    "has_is_null_flag": _has_is_null_flag,
    "touch_shape": lambda release: _pool(release).touch_shape,
    "cache_full_blocks_params": _cache_full_blocks_params,
    "block_hashes_from_request": _block_hashes_from_request,
    "get_cached_block_by_group": lambda release: _pool(release)._lookup_by_group,
    "hash_key_kind": lambda release: _pool(release).hash_key_kind,
    "has_block_hash_to_block_map": _has_block_hash_to_block_map,
    "has_evict_blocks": lambda release: hasattr(_pool(release), "evict_blocks"),
    "has_is_block_writable": lambda release: hasattr(_pool(release), "is_block_writable"),
    "free_order": _free_order,
    "free_has_prepend_kwarg": _free_blocks_takes("prepend"),
    "free_has_evict_first_kwarg": _free_blocks_takes("evict_first"),
    "hash_map_holds_block_ids": _hash_map_holds_block_ids,
    "blocks_know_their_pool": _blocks_know_their_pool,
    "request_hit_limit": _request_hit_limit,
    "free_end_without_caching": _free_end_without_caching,
    "null_on_free": _null_on_free,
    "touch_skips_null": _touch_skips_null,
    "usage_counts_null": _usage_counts_null,
    "reset_needs_all_free": _reset_needs_all_free,
    "overallocate_error": _overallocate_error,
    "double_free_error": _double_free_error,
    "matches_seed_order": _matches_seed_order,
    "hash_chain_differs": _hash_chain_differs,
}
# The facts nothing here measures, and why (each is declared in releases.py from the release's source).
_UNMEASURABLE: dict[str, str] = {
    "hash_algos": "the names --prefix-caching-hash-algo accepts live in vLLM's config, which light mode does not load",
    "none_hash": "how NONE_HASH is derived is read from the source; the hash chain's measurement covers its value",
}
assert set(_MEASURES) | set(_UNMEASURABLE) == set(FACT_FIELDS), "every fact is measured or says why not"
