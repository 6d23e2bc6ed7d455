"""vLLM's own BlockPool and KVCacheManager behind the harness's adapter protocols.

The adapter drives vLLM's objects and translates, nothing more: block ids to
vLLM's ``KVCacheBlock`` objects and back, the harness's ``bytes`` hashes to the
hash-key type of the release (an int inside a named tuple before 0.10.2, a
digest with a 4-byte group id after) and the ``touch`` argument shape. Which
API generation a vLLM speaks is read from the
loaded code (signatures and attributes), not from its version string, so a
release this module has never seen is still driven correctly where its shapes
match an earlier one.

Design choice: never fake behaviour. An operation a release lacks
(``evict_blocks`` before 0.13, ``is_block_writable`` before 0.29) is absent from
the adapter, so ``capabilities()`` reports it missing and the harness does not
exercise it. The adapter checks no argument on vLLM's behalf: every caller
mistake reaches vLLM, and what the release does with it (raise its own
``ValueError``, accept a double free, ...) is a declared, measured fact of
the release (``kvspec.conformance.targets.vllm.reactions``: ``pool_reactions``), checked on every campaign
(kvspec.conformance.core.reactions). Only a value vLLM's API cannot take at all
is not sent: its pool takes ``KVCacheBlock`` objects, so an id that names no
block, or one that is not an int, has no translation (``NotExpressible``).
The rejected alternative, an adapter that validates like the spec, would
hide exactly the historical bugs the oracle exists to find.

What the pool tells the world (``config.events``): a release that publishes
KV cache events (0.9.0 on) is built with ``enable_kv_cache_events=True`` and
its adapter has ``take_events``, which drains vLLM's queue and returns the
spec's events, keys in the adapter's key form
(``kvspec.conformance.targets.vllm.events``: what each release publishes, declared per
release range); a release before has no ``take_events``.

Two ways to reach a vLLM:
- the installed package (``import vllm``), at the pool and the request level;
- light mode (``kvspec.conformance.targets.vllm.lightmode``): one release's real pool
  modules loaded from its wheel, at the pool level, any release from 0.8.0.

The factories that ``--impl`` and ``kvspec replay`` name are in
``kvspec.conformance.targets.vllm.factories``, which picks this module or the request
level's (``manager``) per level.

Hash values, exactly. At the pool level no chain is computed: the harness
hands the pool its hash values, so the adapter declares
``uses_kvspec_hash_chain`` for every release, and the harness checks that the
pool keeps, keys and reports exactly the value it was handed (the group id
added to the key and taken off again, an int key made from the bytes and
read back), not only which blocks share one. At the request level vLLM
computes the chain (``kvspec.conformance.targets.vllm.manager``). A factory names the
hash function and NONE_HASH seed the spec must hash with (``spec_hashing``):
where a release's chain is kvspec's (releases.py, ``hash_chain_differs``,
measured), the release's default hash function and the seed it uses with
``PYTHONHASHSEED`` unset, so the harness checks vLLM's chain as a deployment
that sets nothing computes it; elsewhere kvspec's defaults, and hash values
are compared as names.

NOTE: releases 0.8.0 to 0.8.2 have no null block: every block is allocatable.
The adapter builds such a pool with ``num_gpu_blocks - 1`` blocks and shifts
block ids by one, so the spec's block 0 (the null block) names no vLLM block and
vLLM's block k is the spec's block k + 1. The allocatable blocks, their order
and every operation on them are vLLM's, unchanged.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import os
import types
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from kvspec.conformance.core.adapter import AdapterConfig
from kvspec.conformance.core.reactions import NotExpressible, Reaction
from kvspec.conformance.targets.vllm import lightmode
from kvspec.conformance.targets.vllm.events import (
    EventFacts,
    EventTranslator,
    PoolEventRequest,
    event_facts,
    fields_not_published,
)
from kvspec.conformance.targets.vllm.reactions import pool_reactions
from kvspec.conformance.targets.vllm.releases import ReleaseFacts, facts_for
from kvspec.spec.events import KVCacheEvent
from kvspec.spec.hashing import DEFAULT_HASH_FN, DEFAULT_SEED, VLLM_NONE_HASH_SEED
from kvspec.spec.state import BlockHash, BlockId, Snapshot, canonical_hash_to_blocks

__all__ = [
    "VERSION_ENV",
    "VllmPoolAdapter",
    "VllmRelease",
    "installed_release",
    "light_release",
    "make_pool_adapter",
    "pool_snapshot",
    "spec_hashing_for",
    "vllm_id_set",
]

# Set to a release ("0.24.0") to make `make_adapter` load it in light mode.
VERSION_ENV = "KVSPEC_VLLM_VERSION"

# The KV cache group the pool level registers and looks up in, where the release takes one: not 0, so a
# pool that drops, zeroes or misencodes the group id (in its keys or its events) is seen, which group 0,
# whose 4 bytes are all zero in every byte order, would hide.
POOL_GROUP = 1

HashKeyKind = Literal["block_hash_type", "named_tuple_with_group", "bytes_with_group"]
TouchShape = Literal["list", "tuple_of_lists", "flat"]


@dataclass(frozen=True, eq=False)
class VllmRelease:
    """The pool modules of one vLLM, installed or loaded in light mode.

    Attributes:
        version: The release, e.g. ``"0.33.0"``.
        source: ``"installed"`` (``import vllm``), ``"light"`` (from the wheel) or
            ``"tree"`` (a source tree, in light mode).
        block_pool: Its ``vllm.v1.core.block_pool`` module.
        kv_cache_utils: Its ``vllm.v1.core.kv_cache_utils`` module.
        hash_functions: Its named block-hash functions (``sha256``, ...; ``builtin``
            where a block hash may be an int).
        module: Imports one of its modules by vLLM name (``"vllm.utils.hashing"``).
    """

    version: str
    source: Literal["installed", "light", "tree"]
    block_pool: types.ModuleType
    kv_cache_utils: types.ModuleType
    hash_functions: dict[str, Callable[[Any], Any]]
    module: Callable[[str], types.ModuleType]
    where: str = ""  # a source tree's folder

    @property
    def label(self) -> str:
        """``vllm==0.33.0 (installed)``: how reports name this vLLM."""
        return f"vllm=={self.version} ({self.source}{' ' + self.where if self.where else ''})"


def installed_release() -> VllmRelease:
    """The vLLM installed in this environment.

    Returns:
        Its pool modules, imported normally.

    Raises:
        ImportError: vLLM is not installed or its pool modules do not import.
    """
    block_pool = importlib.import_module("vllm.v1.core.block_pool")
    kv_cache_utils = importlib.import_module("vllm.v1.core.kv_cache_utils")
    version = importlib.metadata.version("vllm")
    hash_functions: dict[str, Callable[[Any], Any]] = {}
    for name in ("vllm.utils.hashing", "vllm.utils"):
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        for fn_name in ("sha256", "sha256_cbor", "sha256_cbor_64bit", "xxhash", "xxhash_cbor"):
            fn = getattr(mod, fn_name, None)
            if callable(fn) and fn_name not in hash_functions:
                hash_functions[fn_name] = fn
    if _hash_key_kind(kv_cache_utils) != "bytes_with_group":
        hash_functions["builtin"] = hash
    return VllmRelease(version, "installed", block_pool, kv_cache_utils, hash_functions, importlib.import_module)


def light_release(version: str, *, fresh: bool = False) -> VllmRelease:
    """One release's real pool modules, loaded from its wheel (downloaded once, then cached).

    Args:
        version: A release from 0.8.0 on, e.g. ``"0.24.0"``.
        fresh: Load an independent copy (its module globals, such as ``NONE_HASH``, are its own).

    Returns:
        The release.

    Raises:
        kvspec.conformance.targets.vllm.lightmode.LightModeError: it could not be fetched or loaded.
    """
    light = lightmode.load_release(version, fresh=fresh)
    return VllmRelease(version, "light", light.block_pool, light.kv_cache_utils, light.hash_functions(), light.module)


def tree_release(tree: Path) -> VllmRelease:
    """A vLLM source tree's pool modules (a pull request's checkout), loaded in light mode where it is.

    Raises:
        kvspec.conformance.targets.vllm.lightmode.LightModeError: the folder is not a vLLM source tree.
    """
    light = lightmode.load_tree(tree)
    return VllmRelease(
        light.version,
        "tree",
        light.block_pool,
        light.kv_cache_utils,
        light.hash_functions(),
        light.module,
        where=str(light.root),
    )


# ---------------------------------------------------------------------------
# API generations, read from the code


def _declared_facts(version: str) -> ReleaseFacts | None:
    """The release's declared facts, or None for a release the table does not cover (then nothing is excused)."""
    try:
        return facts_for(version)
    except KeyError:
        return None


def spec_hashing_for(version: str | None) -> tuple[str, str]:
    """The hash function and NONE_HASH seed the spec hashes with when it checks a release.

    Where the release's chain is kvspec's (its measured ``hash_chain_differs``
    is empty): its default hash function and ``VLLM_NONE_HASH_SEED``, the seed
    it derives NONE_HASH from with ``PYTHONHASHSEED`` unset, so the spec's
    chain is the one a deployment that sets nothing computes, value for
    value. Elsewhere (or for a release the table does not cover, or None):
    kvspec's defaults, and hash values are compared as names.

    >>> spec_hashing_for("0.33.0"), spec_hashing_for("0.9.2")
    (('sha256', 'vllm-none-hash'), ('sha256_cbor', 'kvspec'))
    """
    facts = _declared_facts(version) if version else None
    if facts is None or facts.hash_chain_differs:
        return DEFAULT_HASH_FN, DEFAULT_SEED
    return facts.hash_algos[0], VLLM_NONE_HASH_SEED


def _selected_spec_hashing() -> tuple[str, str]:
    """``spec_hashing_for`` the vLLM ``make_adapter`` drives: ``$KVSPEC_VLLM_VERSION``'s, else the installed one's."""
    version = os.environ.get(VERSION_ENV)
    return spec_hashing_for(version) if version else _installed_spec_hashing()


def _installed_spec_hashing() -> tuple[str, str]:
    """``spec_hashing_for`` the installed vLLM (kvspec's defaults where none is installed)."""
    try:
        return spec_hashing_for(importlib.metadata.version("vllm"))  # read without importing vLLM
    except importlib.metadata.PackageNotFoundError:
        return spec_hashing_for(None)


def _hash_key_kind(kv_cache_utils: types.ModuleType) -> HashKeyKind:
    """Which hash-key type the release's pool uses."""
    if hasattr(kv_cache_utils, "BlockHashType"):
        return "block_hash_type"
    block_hash = getattr(kv_cache_utils, "BlockHash", None)
    if isinstance(block_hash, type) and issubclass(block_hash, tuple):
        return "named_tuple_with_group"
    return "bytes_with_group"


def _touch_shape(pool: Any) -> TouchShape:
    """``touch([b])`` (to 0.9.0), ``touch(([b],))`` (one list per group, 0.9.1 to 0.13) or flat (0.14+)."""
    param = next(iter(inspect.signature(pool.touch).parameters.values()))
    annotation = param.annotation if isinstance(param.annotation, str) else repr(param.annotation)
    if annotation.replace("typing.", "").startswith(("tuple[", "Tuple[")):
        return "tuple_of_lists"
    if param.name == "blocks" and annotation.replace("typing.", "").startswith(("list[", "List[")):
        return "list"
    return "flat"


def _walk_free_queue(queue: Any, limit: int) -> list[Any]:
    """The free queue's blocks, left to right, by following its links (at most ``limit``)."""
    head = getattr(queue, "fake_free_list_head", None)
    if head is not None:  # sentinel head and tail (0.10.2+)
        node, tail = head.next_free_block, queue.fake_free_list_tail
    else:
        node, tail = queue.free_list_head, None
    found: list[Any] = []
    # bounded, so a corrupted list (a cycle) shows up as duplicates, never as a hang
    while node is not None and node is not tail and len(found) < limit:
        found.append(node)
        node = node.next_free_block
    return found


def _hash_table_entries(table: Any) -> Iterable[tuple[Any, list[Any]]]:
    """(key, blocks in registration order) for every entry of the pool's hash table."""
    cache = getattr(table, "_cache", table)  # BlockHashToBlockMap (0.11+) or a defaultdict(dict)
    duplicates = getattr(table, "_dup_ids", None)
    if duplicates is not None:  # 0.34+: a key maps to a block id; the ids of a key held by several, apart
        for key, block_id in cache.items():
            yield key, [table._blocks[b] for b in duplicates.get(key, (block_id,))]
        return
    for key, value in cache.items():
        yield key, list(value.values()) if isinstance(value, dict) else [value]


def _pool_kwargs(release: VllmRelease, block_size: int, events: bool = False) -> dict[str, Any]:
    """The BlockPool constructor's keyword arguments beyond the pool size and caching flag
    (``enable_kv_cache_events=True`` with ``events``, where the release takes it: 0.9.0 on)."""
    params = inspect.signature(release.block_pool.BlockPool).parameters
    kwargs: dict[str, Any] = {"hash_block_size": block_size} if "hash_block_size" in params else {}  # from 0.12
    if events and "enable_kv_cache_events" in params:
        kwargs["enable_kv_cache_events"] = True
    return kwargs


def has_null_block(release: VllmRelease, config: AdapterConfig) -> bool:
    """Whether the release takes block 0 out as the null block (from 0.8.3), probed on a 2-block pool of its own.

    Releases before allocate block 0 like any other; an adapter then builds
    vLLM's pool one block smaller and shifts ids by one (see the module NOTE).

    Raises:
        ValueError: the release has no null block and ``config.num_gpu_blocks < 2`` (its pool would be empty).
    """
    pool = release.block_pool.BlockPool(2, config.enable_caching, **_pool_kwargs(release, config.block_size))
    found = hasattr(pool, "null_block")
    if not found and config.num_gpu_blocks < 2:
        raise ValueError(
            f"{release.label} has no null block, so a pool of num_gpu_blocks={config.num_gpu_blocks} "
            "(the null block included) would be empty; use num_gpu_blocks >= 2"
        )
    return found


class _PoolRequest:
    """The request argument of ``cache_full_blocks`` at the pool level.

    With KV events off, vLLM's ``cache_full_blocks`` reads only the request's
    ``block_hashes`` (0.10.1+; before, the hashes are an argument and the
    request is read only to compute hashes that were not given, which the
    adapter always gives). The attributes are the ones vLLM's ``Request`` has.
    """

    def __init__(self, block_hashes: list[Any]) -> None:
        self.request_id = "kvspec-pool"  # vLLM's Request.request_id
        self.block_hashes = block_hashes  # vLLM's Request.block_hashes


# ---------------------------------------------------------------------------
# the pool level


class VllmPoolAdapter:
    """One vLLM ``BlockPool``, driven with the harness's block ids and ``bytes`` hashes.

    Attributes:
        release: The vLLM being driven.
        pool: vLLM's ``BlockPool`` object.
        validates_bad_input: False: vLLM checks almost no argument; a mistake is sent only with a reaction.
        mistake_reactions: What the release does with each caller mistake (declared in releases.py).
        has_null_block: The release takes block 0 out as ``pool.null_block``.
        hash_key_kind: The release's hash-table key type.
        touch_shape: How the release's ``touch`` takes its blocks.
    """

    validates_bad_input = False
    # The harness hands the pool its hash values (no chain is computed at this level), so every
    # release is checked to keep exactly the value it was handed; see the module doc.
    uses_kvspec_hash_chain = True

    def __init__(self, release: VllmRelease, config: AdapterConfig) -> None:
        self.release = release
        self.config = config
        bp, ku = release.block_pool, release.kv_cache_utils
        self.has_null_block = has_null_block(release, config)
        self._offset = 0 if self.has_null_block else 1
        self.pool: Any = bp.BlockPool(
            config.num_gpu_blocks - self._offset,
            config.enable_caching,
            **_pool_kwargs(release, config.block_size, config.events),
        )
        self.hash_key_kind = _hash_key_kind(ku)
        self.touch_shape = _touch_shape(self.pool)
        self._cfb_params = tuple(inspect.signature(self.pool.cache_full_blocks).parameters)
        self._lookup_by_group = "kv_cache_group_ids" in inspect.signature(self.pool.get_cached_block).parameters
        self._group = POOL_GROUP if self._lookup_by_group and "kv_cache_group_id" in self._cfb_params else 0
        self._make_key_with_group = getattr(ku, "make_block_hash_with_group_id", None)
        self._any_hash_fn = next(iter(release.hash_functions.values()), hash)
        # A declared fact of the release (releases.py: before 0.10.2 get_usage counts
        # the null block as used), never measured here: a release or a patch that
        # starts to count it outside that range then diverges instead of being excused.
        facts = _declared_facts(release.version)
        self.mistake_reactions: dict[str, Reaction] = pool_reactions(release.version)
        self.known_deviations: dict[str, str] = (
            {"get_usage": f"{release.label} counts the null block as used in get_usage (vLLM before 0.10.2)"}
            if facts is not None and facts.usage_counts_null
            else {}
        )
        if "evict_first" in inspect.signature(self.pool.free_blocks).parameters:  # 0.34.0 on, read from the code
            # The harness sends a trailing parameter only to a method that takes it: this one does.
            self.free_blocks = self._free_blocks_evict_first  # type: ignore[method-assign]

    # -- translation ---------------------------------------------------------

    def _block(self, block_id: BlockId, op: str) -> Any:
        """vLLM's block object for an id; an id that names none has no translation (nothing is called)."""
        index = block_id - self._offset if isinstance(block_id, int) and not isinstance(block_id, bool) else -1
        if not 0 <= index < len(self.pool.blocks):
            raise NotExpressible(
                f"{op} takes KVCacheBlock objects, and block_id={block_id!r} names none of {self.release.label}'s "
                f"(ids {self._offset}..{self.config.num_gpu_blocks - 1})"
            )
        return self.pool.blocks[index]

    def _id(self, block: Any) -> BlockId:
        return BlockId(block.block_id + self._offset)

    def _key(self, block_hash: BlockHash) -> Any:
        """The release's hash value for the harness's ``bytes`` hash (group id not yet added)."""
        if not isinstance(block_hash, bytes):
            raise NotExpressible(f"block_hash={block_hash!r} is not bytes, which {self.release.label}'s hash keys are")
        ku = self.release.kv_cache_utils
        if self.hash_key_kind == "bytes_with_group":
            return ku.BlockHash(bytes(block_hash))
        # int hash values: a leading 0x01 byte keeps leading zero bytes of the hash
        value = int.from_bytes(b"\x01" + bytes(block_hash), "big")
        cls = ku.BlockHashType if self.hash_key_kind == "block_hash_type" else ku.BlockHash
        return cls(value, (), None)

    def _raw(self, key: Any) -> BlockHash:
        """The harness's ``bytes`` hash of a hash-table key or a block's ``block_hash``."""
        if self.hash_key_kind == "bytes_with_group":
            return BlockHash(bytes(key[:-4]))
        if self.hash_key_kind == "named_tuple_with_group":
            key = key.block_hash
        value: int = key.hash_value
        encoded = value.to_bytes((value.bit_length() + 7) // 8, "big")
        assert encoded[:1] == b"\x01", f"hash_value={value} was not made by this adapter"
        return BlockHash(encoded[1:])

    def _lookup_key(self, block_hash: BlockHash) -> Any:
        key = self._key(block_hash)
        if self.hash_key_kind == "named_tuple_with_group" and not self._lookup_by_group:
            raise AssertionError(f"{self.release.label}: group-keyed hashes without a group lookup")
        return key

    # -- the protocol --------------------------------------------------------

    def get_new_blocks(self, num_blocks: int) -> list[BlockId]:
        """vLLM's ``get_new_blocks`` (its over-allocation ``ValueError`` is a declared reaction)."""
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool):
            raise NotExpressible(f"num_blocks={num_blocks!r}: {self.release.label}'s get_new_blocks takes an int")
        return [self._id(b) for b in self.pool.get_new_blocks(num_blocks)]

    def touch(self, block_ids: Sequence[BlockId]) -> None:
        """vLLM's ``touch``, in the argument shape of the release."""
        blocks = [self._block(b, "touch") for b in block_ids]
        self.pool.touch((blocks,) if self.touch_shape == "tuple_of_lists" else blocks)

    def get_cached_block(self, block_hash: BlockHash) -> BlockId | None:
        """vLLM's ``get_cached_block`` (in the adapter's KV cache group, ``POOL_GROUP``, where it takes one)."""
        key = self._lookup_key(block_hash)
        if self._lookup_by_group:
            found = self.pool.get_cached_block(key, [self._group])
            return None if found is None else self._id(found[0])
        block = self.pool.get_cached_block(key)
        return None if block is None else self._id(block)

    def cache_full_blocks(self, block_ids: Sequence[BlockId], block_hashes: Sequence[BlockHash]) -> None:
        """vLLM's ``cache_full_blocks`` over exactly these blocks (none of them cached before)."""
        blocks = [self._block(b, "cache_full_blocks") for b in block_ids]
        keys = [self._key(h) for h in block_hashes]
        kwargs: dict[str, Any] = {
            "request": self._cfb_request(keys, len(blocks)),
            "blocks": blocks,
            "num_cached_blocks": 0,
            "num_full_blocks": len(blocks),
            "block_size": self.config.block_size,
        }
        if "block_hashes" in self._cfb_params:  # before 0.10.1 the hashes are an argument
            kwargs["block_hashes"] = keys
        if "hash_fn" in self._cfb_params:  # used only for hashes not given
            kwargs["hash_fn"] = self._any_hash_fn
        if "kv_cache_group_id" in self._cfb_params:
            kwargs["kv_cache_group_id"] = self._group
        self.pool.cache_full_blocks(**kwargs)

    def _cfb_request(self, keys: list[Any], num_blocks: int) -> Any:
        """The request ``cache_full_blocks`` reads (with events on, what its ``BlockStored`` reads too)."""
        return _PoolRequest(keys)

    def free_blocks(self, block_ids: Sequence[BlockId]) -> None:
        """vLLM's ``free_blocks``, in the given order."""
        self.pool.free_blocks([self._block(b, "free_blocks") for b in block_ids])

    def _free_blocks_evict_first(self, block_ids: Sequence[BlockId], evict_first: bool = False) -> None:
        """vLLM's ``free_blocks`` where it takes ``evict_first`` (0.34.0 on): freed cached blocks to the front."""
        self.pool.free_blocks([self._block(b, "free_blocks") for b in block_ids], evict_first=evict_first)

    def reset_prefix_cache(self) -> bool:
        """vLLM's ``reset_prefix_cache``."""
        done: bool = self.pool.reset_prefix_cache()
        return done

    def get_num_free_blocks(self) -> int:
        """vLLM's ``get_num_free_blocks``."""
        num: int = self.pool.get_num_free_blocks()
        return num

    def get_usage(self) -> float:
        """vLLM's ``get_usage`` (before 0.10.2 it counts the null block as used)."""
        usage: float = self.pool.get_usage()
        return usage

    def snapshot(self) -> Snapshot:
        """vLLM's blocks, free queue (its linked list, walked) and hash table, in the spec's form."""
        return pool_snapshot(self.pool, self.config.num_gpu_blocks, self.config.enable_caching, self._raw, self._offset)


def pool_snapshot(
    pool: Any,
    num_gpu_blocks: int,
    enable_caching: bool,
    raw: Callable[[Any], BlockHash],
    offset: int = 0,
    block_tables: tuple[tuple[str, tuple[BlockId, ...]], ...] | None = None,
) -> Snapshot:
    """A vLLM ``BlockPool``'s state as the spec's ``Snapshot``.

    Args:
        pool: vLLM's ``BlockPool``.
        num_gpu_blocks: The pool size the harness asked for (the null block included).
        enable_caching: Prefix caching on or off.
        raw: Turns a hash-table key (or a block's ``block_hash``) into ``bytes``.
        offset: Added to vLLM's block ids (1 for releases without a null block).
        block_tables: The running requests' block tables, at the request level.

    Returns:
        The snapshot: every block's ``ref_cnt`` and hash, the free queue read by
        following its links, the hash table in registration order.
    """
    ref_cnt = [0] * num_gpu_blocks
    block_hash: list[BlockHash | None] = [None] * num_gpu_blocks
    for block in pool.blocks:
        b = block.block_id + offset
        ref_cnt[b] = block.ref_cnt
        block_hash[b] = None if block.block_hash is None else raw(block.block_hash)
    queue = _walk_free_queue(pool.free_block_queue, limit=num_gpu_blocks + 1)
    table = tuple(
        (raw(key), tuple(BlockId(b.block_id + offset) for b in blocks))
        for key, blocks in _hash_table_entries(pool.cached_block_hash_to_block)
    )
    return Snapshot(
        num_gpu_blocks=num_gpu_blocks,
        enable_caching=enable_caching,
        ref_cnt=tuple(ref_cnt),
        block_hash=tuple(block_hash),
        free_queue=tuple(BlockId(b.block_id + offset) for b in queue),
        hash_to_blocks=canonical_hash_to_blocks(table),
        block_tables=block_tables,
    )


class _EvictBlocks:
    """``evict_blocks`` (vLLM 0.13+)."""

    pool: Any
    _offset: int

    def evict_blocks(self, block_ids: Sequence[BlockId]) -> None:
        """vLLM's ``evict_blocks``: it takes a set of plain int ids, which are sent as they are (its own
        bound check at the pool's end, and -1 as a Python index, are what it does with a bad one).

        Raises:
            NotExpressible: an id is not an int (vLLM's ids are ints).
        """
        self.pool.evict_blocks(vllm_id_set(block_ids, self._offset))


def vllm_id_set(block_ids: Sequence[BlockId], offset: int) -> set[int]:
    """The set of plain int ids vLLM's ``evict_blocks`` takes (pool's and manager's), each as given, shifted by
    ``offset`` (1 for a release without a null block): a bad one is vLLM's to answer.

    Raises:
        NotExpressible: an id is not an int (vLLM's ids are ints).
    """
    for b in block_ids:
        if not isinstance(b, int) or isinstance(b, bool):
            raise NotExpressible(f"evict_blocks takes vLLM's int block ids; block_id={b!r} is not one")
    return {b - offset for b in block_ids}


class _IsBlockWritable:
    """``is_block_writable`` (vLLM 0.29+)."""

    pool: Any
    _block: Callable[[BlockId, str], Any]

    def is_block_writable(self, block_id: BlockId) -> bool:
        """vLLM's ``is_block_writable``."""
        writable: bool = self.pool.is_block_writable(self._block(block_id, "is_block_writable"))
        return writable


_POOL_CLASSES: dict[tuple[bool, bool], type[VllmPoolAdapter]] = {
    (False, False): VllmPoolAdapter,
    (True, False): type("VllmPoolAdapterWithEvict", (_EvictBlocks, VllmPoolAdapter), {}),
    (False, True): type("VllmPoolAdapterWithWritable", (_IsBlockWritable, VllmPoolAdapter), {}),
    (True, True): type("VllmPoolAdapterWithEvictAndWritable", (_EvictBlocks, _IsBlockWritable, VllmPoolAdapter), {}),
}


def make_pool_adapter(release: VllmRelease, config: AdapterConfig) -> VllmPoolAdapter:
    """A pool adapter with exactly the optional operations the release's ``BlockPool`` has
    (and ``take_events`` with ``config.events``, where the release publishes events)."""
    cls = release.block_pool.BlockPool
    key = (callable(getattr(cls, "evict_blocks", None)), callable(getattr(cls, "is_block_writable", None)))
    if config.events and "enable_kv_cache_events" in inspect.signature(cls).parameters:
        return _with_pool_events(_POOL_CLASSES[key])(release, config)
    return _POOL_CLASSES[key](release, config)


# ---------------------------------------------------------------------------
# KV cache events at the pool level (kvspec.conformance.targets.vllm.events)


class _PoolEvents(VllmPoolAdapter):
    """``take_events`` (vLLM 0.9.0 on, with ``config.events``): the pool built with events on, drained per call.

    The pool level's keys are the harness's ``bytes`` hashes, registered in
    group ``POOL_GROUP``, which folds to the spec's bare key (an event naming
    any other group names another key): an event's int ``hash_value`` (before
    0.10.2) is decoded as ``_raw`` decodes a key, a digest (or its 64-bit int,
    the one form taken where the release's ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``
    asks for it) is the hash the adapter gave vLLM.
    ``cache_full_blocks`` passes the request its ``BlockStored`` reads
    (``PoolEventRequest``: placeholder tokens, nothing else, as the pool
    level knows nothing else). The fields the release does not publish are
    declared ``not_applicable``.
    """

    def __init__(self, release: VllmRelease, config: AdapterConfig) -> None:
        super().__init__(release, config)
        facts = event_facts(release.version)
        self._events = EventTranslator(facts, self._event_key, _int_event_keys(release, facts))
        self._groups_in_events = facts.groups_in_events
        self.not_applicable: dict[str, str] = fields_not_published(facts, release.label)

    def _event_key(self, value: Any, group: int) -> BlockHash:
        if isinstance(value, int):  # a key's own hash_value (before 0.10.2): made by _key, read as _raw reads it
            encoded = value.to_bytes((value.bit_length() + 7) // 8, "big")
            if encoded[:1] != b"\x01":
                raise ValueError(f"{self.release.label} published the key {value}, which this adapter never made")
            value = encoded[1:]
        if group == self._group or not self._groups_in_events:  # the pool level's one group: the spec has none
            return BlockHash(bytes(value))
        # any other group, 0 included, keeps its 4 bytes, so the key matches none the spec published
        return BlockHash(bytes(value) + group.to_bytes(4, "big"))

    def _key(self, block_hash: BlockHash) -> Any:
        key = super()._key(block_hash)
        self._events.remember([bytes(block_hash)])  # for a 64-bit event key (0.10.2 on): the digest it names
        return key

    def _cfb_request(self, keys: list[Any], num_blocks: int) -> Any:
        return PoolEventRequest(keys, num_blocks, self.config.block_size)

    def take_events(self) -> list[KVCacheEvent]:
        """The events vLLM's pool queued since the last call, as the spec's (drained: vLLM's queue is emptied)."""
        return self._events.translate(self.pool.take_events())


def _int_event_keys(release: VllmRelease, facts: EventFacts) -> bool | None:
    """Whether the release's events key blocks by 64-bit ints, as its ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``
    reads in this environment (from 0.10.2); None where it reads no such setting (light mode's placeholder)."""
    if facts.hash_form != "digest":
        return None
    try:
        value = getattr(release.module("vllm.envs"), "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", None)
    except ImportError:
        return None
    return value if isinstance(value, bool) else None


_WITH_POOL_EVENTS: dict[type[VllmPoolAdapter], type[VllmPoolAdapter]] = {}


def _with_pool_events(cls: type[VllmPoolAdapter]) -> type[VllmPoolAdapter]:
    """``cls`` with ``take_events`` (one class per base, made once)."""
    if cls not in _WITH_POOL_EVENTS:
        _WITH_POOL_EVENTS[cls] = type(f"{cls.__name__}WithEvents", (_PoolEvents, cls), {})
    return _WITH_POOL_EVENTS[cls]
