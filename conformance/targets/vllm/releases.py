"""What an adapter must know about each vLLM release's BlockPool, 0.8.0 to 0.34.0.

Every fact here was measured by loading the release's real ``block_pool.py``
and ``kv_cache_utils.py`` in light mode and driving them (pool of 8 blocks,
block size 4), or read from the release's source where noted. Facts are stored
as change points (the first release where a value holds) rather than one
hand-written row per release, so a row cannot silently disagree with its
neighbours; ``facts_for(version)`` expands them into one ``ReleaseFacts``.

Seed 000 ("no-hash blocks to the left end, hashed to the right, freed
tail-first") describes 0.24.0 and later. Earlier releases put every freed
block at the right end (profile ``vllm-v1-tail``).

Where a release's block-hash chain is kvspec's (``hash_chain_differs``) is
measured from the golden hash cases in fresh interpreters
(``kvspec.conformance.targets.vllm.hashes.measure_releases``), and a test measures it
again for every release, so the table cannot go stale; the harness compares
hash values exactly at the request level only where it is. Every other fact
light mode can measure is measured again the same way
(``kvspec.conformance.targets.vllm.measure``, ``kvspec facts``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, TypeVar

from kvspec.spec.hashing import VLLM_NONE_HASH_SEED

__all__ = [
    "HASH_CHAIN_DIFFERENCES",
    "RELEASES",
    "HashChainDifference",
    "ReleaseFacts",
    "facts_for",
    "hash_chain_note",
    "since",
    "version_key",
]

# Every release on the package registry that ships vllm/v1/core/block_pool.py.
RELEASES: tuple[str, ...] = (
    "0.8.0", "0.8.1", "0.8.2", "0.8.3", "0.8.4", "0.8.5", "0.8.5.post1",
    "0.9.0", "0.9.0.1", "0.9.1", "0.9.2", "0.10.0", "0.10.1", "0.10.1.1",
    "0.10.2", "0.11.0", "0.11.1", "0.11.2", "0.12.0", "0.13.0", "0.14.0",
    "0.14.1", "0.15.0", "0.15.1", "0.16.0", "0.17.0", "0.17.1", "0.18.0",
    "0.18.1", "0.19.0", "0.19.1", "0.20.0", "0.20.1", "0.20.2", "0.21.0",
    "0.22.0", "0.22.1", "0.23.0", "0.24.0", "0.25.0", "0.25.1", "0.26.0",
    "0.27.0", "0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0",
    "0.33.0", "0.34.0",
)  # fmt: skip

TouchShape = Literal["list", "tuple_of_lists", "flat"]
HashKeyKind = Literal["block_hash_type", "named_tuple_with_group", "bytes_with_group"]
FreeOrder = Literal["all_right", "hashless_left"]
End = Literal["left", "right"]
NullOnFree = Literal["no_null_block", "decrements_ref_cnt", "skipped"]
NoneHash = Literal[
    "builtin_hash_of_None",
    "inverted_seed_check",
    "module_level_seeded",
    "init_none_hash_random_unless_seeded",
    "init_none_hash_fixed_default_seed",
]
# How a release's chain (its default hash function) differs from kvspec's, in the
# order they are measured: under PYTHONHASHSEED set, the first of NONE_HASH, a
# chain without extra keys, the extra keys; then NONE_HASH with it unset.
HashChainDifference = Literal["none_hash", "chain", "untagged_extra_keys", "extra_keys", "unset_seed"]
# Each difference in the words the check summary and `kvspec hashes` print.
HASH_CHAIN_DIFFERENCES: dict[HashChainDifference, str] = {
    "none_hash": "its NONE_HASH under PYTHONHASHSEED=s is not derived from s as kvspec's is",
    "chain": "its chain differs even without extra keys (the values it chains, or how it serializes them)",
    "untagged_extra_keys": "its extra keys are untagged",
    "extra_keys": "its extra keys differ from kvspec's",
    "unset_seed": f"with PYTHONHASHSEED unset its NONE_HASH is not derived from {VLLM_NONE_HASH_SEED!r}",
}


@dataclass(frozen=True, slots=True)
class ReleaseFacts:
    """The API shapes and measured pool behaviours of one vLLM release.

    Attributes:
        version: The release, as the package registry spells it.
        pool_init_params: ``BlockPool.__init__`` parameters after ``self``;
            from 0.12.0 ``hash_block_size`` is required (third, positional).
        has_null_block: Block 0 is taken out of the free queue at init as
            ``pool.null_block`` (so ``num_gpu_blocks - 1`` are allocatable).
        has_is_null_flag: ``KVCacheBlock.is_null`` exists (else compare with
            ``pool.null_block``).
        touch_shape: ``touch([b, ...])``, ``touch(([b, ...],))`` (one list
            per KV-cache group) or a flat sequence again.
        cache_full_blocks_params: Parameters after ``self``.
        block_hashes_from_request: ``cache_full_blocks`` reads
            ``request.block_hashes`` instead of taking a ``block_hashes``
            argument (and no longer computes missing hashes itself).
        get_cached_block_by_group: ``get_cached_block(hash, group_ids)``
            returns a list (one block per group) or None; before, it took
            only the hash and returned one block or None.
        hash_key_kind: The hash-table key: ``BlockHashType(hash_value: int,
            token_ids, extra_keys)``; ``BlockHashWithGroupId(BlockHash(hash_value:
            int, token_ids, extra_keys), group_id)``; or ``bytes`` digest plus
            ``group_id.to_bytes(4, "big")``. Built from 32 raw bytes ``raw``:
            ``BlockHashType(int.from_bytes(raw, "big"), tokens, extra)``,
            ``BlockHash(int.from_bytes(raw, "big"), tokens, extra)``, or
            ``BlockHash(raw)``; the pool adds the group id itself.
        has_block_hash_to_block_map: ``cached_block_hash_to_block`` is a
            ``BlockHashToBlockMap`` (``_cache`` maps a key to one block or a
            dict of them); before, a ``defaultdict(dict)``.
        hash_algos: Names the release's ``prefix_caching_hash_algo`` accepts
            (``builtin`` is Python's ``hash()``); the first is the default.
        none_hash: How ``NONE_HASH`` (the parent hash of a chain's first
            block) is made; see FINDINGS for the exact rules.
        has_evict_blocks: ``evict_blocks(block_ids: set[int])`` exists: it
            drops the hashes of the given blocks, in use or not, and leaves
            ``ref_cnt`` and the free queue alone.
        has_is_block_writable: ``is_block_writable(b)`` exists: not null,
            ``ref_cnt == 1`` and no hash.
        free_order: Where a block whose ``ref_cnt`` drops to 0 goes when
            caching is on: every one to the right end, or blocks without a
            hash to the left end (in the order given, as one batch in front
            of the queue) and hashed ones to the right end.
        free_has_prepend_kwarg: ``free_blocks(blocks, prepend=False)``
            (0.23.0 only: ``prepend=True`` puts every freed block in front).
        free_has_evict_first_kwarg: ``free_blocks(blocks, evict_first=False)``
            (0.34.0 on): ``evict_first=True`` puts freed cached blocks in
            front too, with those without a hash, "for blocks whose contents
            another tier already holds". No caller inside vLLM passes it.
        hash_map_holds_block_ids: ``BlockHashToBlockMap._cache`` maps a key to
            one block id, the ids of a key cached by several blocks kept
            apart in ``_dup_ids`` (0.34.0 on); before, to blocks.
        blocks_know_their_pool: ``KVCacheBlock.pool`` names the pool that
            made the block (a weak reference from 0.34.0), and ``free_blocks``
            hands a block of another pool to that pool with the same
            arguments (0.30.0 on; in 0.34.0 the scheduler's deferred frees mix blocks
            of a host tier's private pool with the device pool's).
        request_hit_limit: The request level caps a prefix hit by
            ``request.prefix_cache_hit_limit`` (0 skips the lookup) through
            ``request.get_max_cache_hit_length()``, and the manager has
            ``get_num_cached_tokens(request)``, a lookup that takes nothing
            (0.34.0 on); ``get_num_common_prefix_blocks`` is gone.
        free_end_without_caching: Where freed blocks go with
            ``enable_caching=False``.
        null_on_free: What ``free_blocks([null_block])`` does: decrements the
            null block's ``ref_cnt`` below 0 (never queued), or skips it.
        touch_skips_null: ``touch`` leaves the null block's ``ref_cnt`` alone.
        usage_counts_null: ``get_usage() == 1 - free / num_gpu_blocks`` (the
            null block counts as used); else ``1 - free / (num_gpu_blocks - 1)``.
        reset_needs_all_free: ``reset_prefix_cache()`` returns False and does
            nothing while any non-null block has ``ref_cnt > 0``; otherwise it
            drops every hash, keeps the free-queue order and returns True.
        overallocate_error: Exception type of ``get_new_blocks(n)`` with
            ``n > get_num_free_blocks()`` (state unchanged).
        double_free_error: Exception type of freeing a block whose ``ref_cnt``
            is already 0; None: no error, ``ref_cnt`` becomes -1 and the queue
            is unchanged (a later allocation of it trips an assert).
        matches_seed_order: The seed's eviction order holds with caching on.
        hash_chain_differs: How the release's block-hash chain, with its
            default hash function (``hash_algos[0]``), differs from kvspec's
            (``kvspec.spec.hashing`` with the same hash function, seed ``s``
            under ``PYTHONHASHSEED=s`` and ``VLLM_NONE_HASH_SEED`` with it
            unset, the LoRA path in the LoRA key), measured on the golden
            cases; empty where it is kvspec's, and only there the harness
            compares hash values exactly at the request level.
    """

    version: str
    pool_init_params: tuple[str, ...]
    has_null_block: bool
    has_is_null_flag: bool
    touch_shape: TouchShape
    cache_full_blocks_params: tuple[str, ...]
    block_hashes_from_request: bool
    get_cached_block_by_group: bool
    hash_key_kind: HashKeyKind
    has_block_hash_to_block_map: bool
    hash_algos: tuple[str, ...]
    none_hash: NoneHash
    has_evict_blocks: bool
    has_is_block_writable: bool
    free_order: FreeOrder
    free_has_prepend_kwarg: bool
    free_has_evict_first_kwarg: bool
    hash_map_holds_block_ids: bool
    blocks_know_their_pool: bool
    request_hit_limit: bool
    free_end_without_caching: End
    null_on_free: NullOnFree
    touch_skips_null: bool
    usage_counts_null: bool
    reset_needs_all_free: bool
    overallocate_error: str
    double_free_error: str | None
    matches_seed_order: bool
    hash_chain_differs: tuple[HashChainDifference, ...]


def version_key(version: str) -> tuple[int, ...]:
    """Order release strings numerically (``.postN`` sorts after its base).

    A development build or a local version (``0.34.1.dev3+g1234abc``, what a
    vLLM pull request's CI installs) orders as its release segment: it is
    checked under the facts of the newest release at or before it.

    >>> version_key("0.8.5.post1") > version_key("0.8.5")
    True
    >>> version_key("0.34.1.dev3+g1234abc")
    (0, 34, 1)

    Raises:
        ValueError: it does not start with a release number.
    """
    found = re.match(r"(\d+(?:\.\d+)*)(?:\.post(\d+))?", version)
    if found is None:
        raise ValueError(f"version={version!r} does not start with a release number")
    post = (int(found[2]),) if found[2] else ()
    return tuple(int(part) for part in found[1].split(".")) + post


_T = TypeVar("_T")


def since(version: str, changes: Sequence[tuple[str, _T]]) -> _T:
    """The value of the last change point at or before ``version``."""
    key = version_key(version)
    found = [value for first, value in changes if version_key(first) <= key]
    assert found, f"version={version!r} is older than the first change point {changes[0][0]}"
    return found[-1]


_CFB_OLD = ("request", "blocks", "block_hashes", "num_cached_blocks", "num_full_blocks", "block_size")
_CFB_NEW = ("request", "blocks", "num_cached_blocks", "num_full_blocks", "block_size", "kv_cache_group_id")

_INIT_012 = ("num_gpu_blocks", "enable_caching", "hash_block_size", "enable_kv_cache_events", "metrics_collector")
_POOL_INIT: list[tuple[str, tuple[str, ...]]] = [
    ("0.8.0", ("num_gpu_blocks", "enable_caching")),
    ("0.9.0", ("num_gpu_blocks", "enable_caching", "enable_kv_cache_events")),
    ("0.12.0", _INIT_012),
    ("0.30.0", (*_INIT_012, "medium")),
    ("0.33.0", (*_INIT_012, "num_hash_lookahead_tokens", "medium")),
]
_CACHE_FULL_BLOCKS: list[tuple[str, tuple[str, ...]]] = [
    ("0.8.0", _CFB_OLD),
    ("0.8.3", (*_CFB_OLD, "hash_fn")),
    ("0.9.1", (*_CFB_OLD, "kv_cache_group_id", "hash_fn")),
    ("0.10.1", _CFB_NEW),
    ("0.22.0", (*_CFB_NEW, "block_mask")),
]
_TOUCH: list[tuple[str, TouchShape]] = [("0.8.0", "list"), ("0.9.1", "tuple_of_lists"), ("0.14.0", "flat")]
_HASH_KEY: list[tuple[str, HashKeyKind]] = [
    ("0.8.0", "block_hash_type"),
    ("0.9.1", "named_tuple_with_group"),
    ("0.10.2", "bytes_with_group"),
]
_HASH_ALGOS: list[tuple[str, tuple[str, ...]]] = [
    ("0.8.0", ("builtin",)),
    ("0.8.3", ("builtin", "sha256")),
    ("0.10.0", ("builtin", "sha256", "sha256_cbor_64bit")),
    ("0.10.2", ("sha256", "sha256_cbor")),
    ("0.13.0", ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")),
]
_NONE_HASH: list[tuple[str, NoneHash]] = [
    ("0.8.0", "builtin_hash_of_None"),
    ("0.8.3", "inverted_seed_check"),
    ("0.8.5", "module_level_seeded"),
    ("0.10.0", "init_none_hash_random_unless_seeded"),
    ("0.29.0", "init_none_hash_fixed_default_seed"),
]
_FREE_ORDER: list[tuple[str, FreeOrder]] = [("0.8.0", "all_right"), ("0.24.0", "hashless_left")]
_FREE_END_NO_CACHING: list[tuple[str, End]] = [
    ("0.8.0", "right"),
    ("0.24.0", "left"),
    ("0.27.0", "right"),
    ("0.28.0", "left"),
]
# Measured (kvspec.conformance.targets.vllm.hashes.measure_releases), see ReleaseFacts.hash_chain_differs.
_HASH_CHAIN_DIFFERS: list[tuple[str, tuple[HashChainDifference, ...]]] = [
    ("0.8.0", ("chain",)),  # builtin hash(); its NONE_HASH is hash('None') whatever the seed
    ("0.8.3", ("none_hash", "unset_seed")),  # NONE_HASH from sha256 (an int) or os.urandom
    ("0.10.0", ("untagged_extra_keys", "unset_seed")),  # init_none_hash: hash_fn(seed), os.urandom unset
    ("0.29.0", ("untagged_extra_keys",)),  # unset: hash_fn("vllm-none-hash")
    ("0.31.0", ()),  # tagged extra keys, the LoRA path in the LoRA key: kvspec's chain
]
_NULL_ON_FREE: list[tuple[str, NullOnFree]] = [
    ("0.8.0", "no_null_block"),
    ("0.8.3", "decrements_ref_cnt"),
    ("0.33.0", "skipped"),
]


def _flag(version: str, first: str, last: str | None = None) -> bool:
    key = version_key(version)
    return version_key(first) <= key and (last is None or key <= version_key(last))


def facts_for(version: str) -> ReleaseFacts:
    """Return the facts for one release.

    Args:
        version: A release from ``RELEASES``.

    Returns:
        Its ``ReleaseFacts``.

    Raises:
        KeyError: ``version`` is not a release this table covers.
    """
    if version not in RELEASES:
        raise KeyError(f"no facts for vllm version={version!r}: covered are {RELEASES[0]}..{RELEASES[-1]}")
    free_order = since(version, _FREE_ORDER)
    return ReleaseFacts(
        version=version,
        pool_init_params=since(version, _POOL_INIT),
        has_null_block=_flag(version, "0.8.3"),
        has_is_null_flag=_flag(version, "0.9.1"),
        touch_shape=since(version, _TOUCH),
        cache_full_blocks_params=since(version, _CACHE_FULL_BLOCKS),
        block_hashes_from_request=_flag(version, "0.10.1"),
        get_cached_block_by_group=_flag(version, "0.9.1"),
        hash_key_kind=since(version, _HASH_KEY),
        has_block_hash_to_block_map=_flag(version, "0.11.0"),
        hash_algos=since(version, _HASH_ALGOS),
        none_hash=since(version, _NONE_HASH),
        has_evict_blocks=_flag(version, "0.13.0"),
        has_is_block_writable=_flag(version, "0.29.0"),
        free_order=free_order,
        free_has_prepend_kwarg=_flag(version, "0.23.0", "0.23.0"),
        free_has_evict_first_kwarg=_flag(version, "0.34.0"),
        hash_map_holds_block_ids=_flag(version, "0.34.0"),
        blocks_know_their_pool=_flag(version, "0.30.0"),
        request_hit_limit=_flag(version, "0.34.0"),
        free_end_without_caching=since(version, _FREE_END_NO_CACHING),
        null_on_free=since(version, _NULL_ON_FREE),
        touch_skips_null=_flag(version, "0.33.0"),
        usage_counts_null=not _flag(version, "0.10.2"),
        reset_needs_all_free=True,
        overallocate_error="ValueError",
        double_free_error=None,
        matches_seed_order=free_order == "hashless_left",
        hash_chain_differs=since(version, _HASH_CHAIN_DIFFERS),
    )


def hash_chain_note(version: str) -> str | None:
    """Why hash values are compared as names for a release (its chain is not kvspec's), or None where exactly.

    >>> hash_chain_note("0.33.0") is None
    True
    """
    differs = facts_for(version).hash_chain_differs
    if not differs:
        return None
    why = "; ".join(HASH_CHAIN_DIFFERENCES[d] for d in differs)
    return f"vLLM {version}'s chain is not kvspec's ({why})"
