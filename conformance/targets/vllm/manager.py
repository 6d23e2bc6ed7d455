"""vLLM's KVCacheManager behind the request-level adapter protocol.

The adapter plays the scheduler's part and nothing more: it builds the
arguments a scheduler's engine passes (the pool size and block size, or from
0.8.3 one full-attention KV-cache group in a ``KVCacheConfig``), one vLLM
``Request`` per running request (with the LoRA request, cache_salt and
multimodal inputs the release understands), and after each successful
``allocate_slots`` advances ``request.num_computed_tokens`` as the scheduler
does once a step is scheduled. Everything else (the prefix hit, which blocks
are touched and taken, what is registered, the free order) is vLLM's.

API generations, told apart by the loaded code (constructor and method
signatures, attributes), not the version string:

- 0.8.0 to 0.8.2 (``constructor="sizes"``): ``KVCacheManager(block_size,
  num_gpu_blocks, max_model_len, sliding_window, enable_caching,
  num_preallocate_tokens, log_stats)``; builtin ``hash()`` only; no null
  block (the pool is built one block smaller and block ids shifted by one,
  as at the pool level); and the manager returns the whole prefix hit: the
  len-1 cap lives in that generation's scheduler, which drops the last block
  of a hit that covers every token. The adapter does what that scheduler
  does, and declares it (``not_applicable``), so the hit rules check the
  pair a deployment of these releases runs.
- 0.8.3 on (``constructor="kv_cache_config"``): a ``KVCacheConfig``, the cap
  in the manager, ``caching_hash_algo`` (``builtin`` or ``sha256``).
- 0.8.x (``blocks="list"``): ``get_computed_blocks`` returns a plain list of
  blocks, ``allocate_slots(request, num_tokens, new_computed_blocks)`` counts
  the hit from the blocks it is given, the manager hashes requests itself,
  and ``free`` reverses the block table only when caching is on.
- 0.9.x (``hashes="manager"``): ``KVCacheBlocks`` and
  ``num_new_computed_tokens`` arrive; the manager still hashes requests itself.
- 0.10.1 on (``hashes="request"``): the ``Request`` carries the release's
  block hasher; from 0.11 (and 0.33's ``hash_block_size``) only parameters
  are added, which are passed by name where the loaded code takes them.

NOTE: 0.8.0 to 0.8.4 take ``num_preallocate_tokens`` (default 64: a request
that needs a new block gets up to 64 tokens' worth more, so ``allocate_slots``
takes more blocks than asked). The adapter passes ``num_preallocate_tokens=0``,
a value the constructor accepts, under which ``allocate_slots`` takes exactly
the blocks asked for, as 0.8.5 (which removed the parameter) does. Stated
limit: those releases' schedulers used the default, so the pre-allocation
branch is not exercised; the adapter declares it (``not_applicable``) and
the summary and the oracle list it.

Features a release lacks are declared, not faked (``not_applicable``, see
``kvspec.conformance.core.adapter``): before 0.9.0 the ``Request`` takes no
``cache_salt``, so the harness sends no salted request (a salted one that
arrives anyway, from a trace, cannot be sent (``NotExpressible``) with caching on; with
caching off a salt keys nothing and the request is sent without it).

A freed request may be preempted, not finished: the harness's ``free`` does
not say which. The adapter treats it as preemption does: it keeps the vLLM
``Request`` (with the block hashes computed so far, on the request from 0.10.1,
in the manager by request id before, where only a finished request gets
``free_block_hashes``) and re-admits that same object with its computed tokens
reset, as the scheduler does. For a finished request this is unobservable:
the harness never reuses a finished request's id. Freeing a request that is
not running goes to vLLM's ``free`` with that kept ``Request``, and vLLM
answers as it does (every release: nothing to free, no error); only an id
never admitted, for which there is no vLLM ``Request`` to pass, is refused.

What the pool tells the world (``config.events``): the manager is built with
``enable_kv_cache_events=True`` and ``log_stats=True`` where its constructor
takes them. ``take_events`` (0.9.0 on) drains vLLM's queue into the spec's
events (kvspec.conformance.targets.vllm.events), keys in the snapshot's form; before
0.20 its events name no group and its engine runs one group when events are
on, so with several groups none is read (declared). ``prefix_cache_stats``
adds up the intervals ``make_prefix_cache_stats()`` hands out. Releases up
to 0.24 (of those measured) count a request in ``get_computed_blocks`` (at
the lookup); 0.33's manager leaves it to the scheduler, which counts it at
admission (``record_prefix_cache_stats`` after a successful
``allocate_slots``): the adapter plays that part, as it plays the
scheduler's others, and sets ``Request.num_preemptions`` from the spec's
request, so a re-admission is counted apart. The external connector's
counters live in vLLM's ``Scheduler``, not its manager: declared
``not_applicable["connector statistics"]``. Beyond the core protocol the
adapter has what the manager has: ``reset_prefix_cache`` (every release),
``evict_blocks`` (0.24 and 0.33 of those measured) and the scheduler's hit
cap ``max_cache_hit_length`` in ``get_computed_blocks`` (0.33): an adapter
without it has no such parameter, so the harness draws no cap; and 0.34's
``get_num_cached_tokens``. From 0.34 a ``Request`` carries its own bound on
its hit (``prefix_cache_hit_limit``, read from its sampling parameters):
the adapter gives the harness's limit through vLLM's own route (0:
``skip_reading_prefix_cache=True``; N: prompt scoring from row N,
``prompt_logprob_start=N``), and the manager's ``record_prefix_cache_stats``
leaves a request whose lookup did not run out of the statistics, as the spec
does. Before 0.34 it is declared ``not_applicable["prefix cache hit limit"]``.

Hash values are vLLM's own (``sha256``/``sha256_cbor`` from 0.10.1, else the
manager's ``caching_hash_algo``, else builtin ``hash()``), the function the
config names where the release has it, NONE_HASH derived under
``PYTHONHASHSEED=config.seed`` (left unset for ``VLLM_NONE_HASH_SEED`` where
the release derives NONE_HASH from that seed when unset, 0.29+: a deployment
that sets nothing). Where the release's chain is kvspec's (releases.py,
``hash_chain_differs``, measured on the golden cases) and it hashes here with
the config's function, the adapter declares ``uses_kvspec_hash_chain``: every
block hash must be the spec's value, so a salt or an extra key on the wrong
block diverges at its first registration. Elsewhere the harness compares them
as names, and the adapter says why (``not_applicable["exact hash values"]``).
Keys carry the group id as the spec's ``group_key`` makes them: none for
group 0, four bytes after the digest for the others.

NOTE: from 0.31 vLLM's LoRA key is ``("lora", name, path)``; the harness's
requests name a LoRA by its name only, which the adapter gives vLLM with the
path ``/lora/<name>``, and the spec keys ``("lora", name)``. Where hashes are
compared exactly, the adapter translates a LoRA block's hash back to the
harness's name for it, and only a hash that is kvspec's chain for that request
with that path (``kvspec.spec.hashing``'s ``lora_path``), the value a router
computes from the same request: any other value is reported as vLLM made it,
and diverges.

KV cache groups (``AdapterConfig.groups``, e.g. ``"full,sliding:8"``): the
``KVCacheConfig`` holds one ``KVCacheGroupSpec`` per group, in order
(``FullAttentionSpec``, ``SlidingWindowSpec(sliding_window=W)``,
``ChunkedLocalAttentionSpec(attention_chunk_size=C)``, each with the config's
block size), with dense prefix-cache retention (``None``, the spec's; 0.33's
engine resolves 0, declared not applicable). Hits and new blocks cross the
API as one flat list, group by group (``get_block_ids()`` gives one list per
group; the null block, id 0, stands at a skipped position); a hit goes back
to vLLM as a ``KVCacheBlocks`` of per-group lists, and the blocks taken for
external tokens are read per group from vLLM's tables. The snapshot names
group g's table ``table_name(request_id, g)`` and lists the groups; a
hash-table key keeps its group id (with one full-attention group it is left
out, as before groups existed). A request runs from a successful
``allocate_slots`` to its ``free`` by the adapter's own bookkeeping: vLLM's
``remove_skipped_blocks`` runs at the start of ``allocate_slots`` and indexes
a defaultdict, so a new request whose allocation fails may leave an empty
table in vLLM. A release without the groups is declared, never faked
(``LevelNotProvided`` with why): 0.8.x (one table per request), no spec class
for an attention type (0.9.2 has no ``ChunkedLocalAttentionSpec``), no
``HybridKVCacheCoordinator``, an assertion of its own when built (0.10.2's
coordinator takes one full-attention type and one other), or a group run by
another attention type's manager.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from kvspec.conformance.core.adapter import AdapterConfig, KVCacheManagerAdapter, LevelNotProvided
from kvspec.conformance.core.operations import HIT_LIMIT
from kvspec.conformance.core.reactions import NotExpressible, Reaction
from kvspec.conformance.targets.vllm.adapter import (
    VllmRelease,
    has_null_block,
    installed_release,
    pool_snapshot,
    vllm_id_set,
)
from kvspec.conformance.targets.vllm.events import EventTranslator, StatsSum, event_facts, fields_not_published
from kvspec.conformance.targets.vllm.hashes import hash_seed_env
from kvspec.conformance.targets.vllm.reactions import manager_reactions
from kvspec.conformance.targets.vllm.releases import RELEASES, facts_for, hash_chain_note
from kvspec.spec.attention import FULL, KVGroup, format_groups, parse_groups
from kvspec.spec.events import KVCacheEvent
from kvspec.spec.hashing import VLLM_NONE_HASH_SEED, hash_request_blocks
from kvspec.spec.manager import Request, snapshot_groups
from kvspec.spec.state import NULL_BLOCK_ID, BlockHash, BlockId, Snapshot, group_key, table_name
from kvspec.spec.stats import PrefixCacheStats

__all__ = ["VllmManagerAdapter", "make_events_only_adapter", "make_full_report_adapter", "make_manager_adapter"]

# Large enough that vLLM's max_model_len never caps a harness request.
_MAX_MODEL_LEN = 1 << 16
# The path of a harness LoRA (which has a name only) in vLLM's LoRARequest.
_LORA_PATH = "/lora/{}"

# Each attention type's KVCacheSpec (vllm/v1/kv_cache_interface.py), the parameter that
# sizes it, and the single-type manager vLLM must pick for it (single_type_kv_cache_manager.py).
_SPEC_CLASS = {"full": "FullAttentionSpec", "sliding": "SlidingWindowSpec", "chunked": "ChunkedLocalAttentionSpec"}
_SPEC_SIZE = {"sliding": "sliding_window", "chunked": "attention_chunk_size"}
_MANAGER_CLASS = {
    "full": "FullAttentionManager",
    "sliding": "SlidingWindowManager",
    "chunked": "ChunkedLocalAttentionManager",
}


def _kwargs_for(fn: Any, wanted: dict[str, Any]) -> dict[str, Any]:
    """The entries of ``wanted`` that ``fn`` takes, by parameter name."""
    params = inspect.signature(fn).parameters
    return {name: value for name, value in wanted.items() if name in params}


class VllmManagerAdapter:
    """One vLLM ``KVCacheManager`` over a pool of ``config.num_gpu_blocks`` blocks.

    Attributes:
        release: The vLLM being driven.
        manager: vLLM's ``KVCacheManager``.
        validates_bad_input: False: vLLM's manager trusts its scheduler's arguments.
        rejected_mistakes: None of the harness's request-level mistakes gets a typed error from vLLM.
        mistake_reactions: What the release does with each request-level caller mistake under this
            caching setting (declared in kvspec.conformance.targets.vllm.reactions); the others are not sent.
        not_applicable: What the harness checks that this release does not have or leaves to its
            scheduler, each with why (see the module doc); the harness does not exercise it.
        constructor: ``"sizes"`` (0.8.0 to 0.8.2) or ``"kv_cache_config"``.
        blocks: What ``get_computed_blocks`` returns: ``"list"`` (0.8.x) or ``"KVCacheBlocks"``.
        hashes: Who hashes a request's blocks: ``"manager"`` or ``"request"`` (0.10.1+).
        hash_fn: The block-hash function the release uses here.
        has_null_block: The release takes block 0 out as the null block (from 0.8.3).
        uses_kvspec_hash_chain: vLLM's chain here is kvspec's for the config's hash function and seed
            (the release's measured fact), so the harness compares hash values exactly.
    """

    validates_bad_input = False
    kv_cache_groups = True  # it builds config.groups as vLLM's KV cache groups (LevelNotProvided where it has none)
    rejected_mistakes: frozenset[str] = frozenset()
    # Set on every vLLM Request it hands over, where not None: 0.33's get_computed_blocks reads
    # request.kv_cache_report_mode (getattr, default "incremental"); nothing in vLLM 0.33 sets it.
    kv_cache_report_mode: str | None = None

    def __init__(self, release: VllmRelease, config: AdapterConfig) -> None:
        if release.source != "installed":
            raise LevelNotProvided(
                f"{release.label}: the request level needs vLLM installed (its Request and config "
                "classes); light mode loads the pool only. Use level='pool', or an environment with vLLM"
            )
        self.release = release
        self.config = config
        self.mistake_reactions: dict[str, Reaction] = manager_reactions(
            release.version, config.enable_caching, config.groups
        )
        mod = release.module
        manager_mod = mod("vllm.v1.core.kv_cache_manager")
        manager_cls = manager_mod.KVCacheManager
        manager_params = inspect.signature(manager_cls).parameters
        self.constructor: str = "kv_cache_config" if "kv_cache_config" in manager_params else "sizes"
        if self.constructor == "sizes" and not {"block_size", "num_gpu_blocks"} <= set(manager_params):
            raise ValueError(
                f"{release.label}: its KVCacheManager takes ({', '.join(manager_params)}): neither a "
                "KVCacheConfig nor block_size and num_gpu_blocks; this adapter speaks 0.8.0 to 0.33's managers"
            )
        self._request_cls: Any = mod("vllm.v1.request").Request
        self._request_params = inspect.signature(self._request_cls).parameters
        # Where hashes come from: the Request's block hasher (0.10.1+) or the manager itself.
        self.hashes: str = "request" if "block_hasher" in self._request_params else "manager"
        # What get_computed_blocks / allocate_slots return: KVCacheBlocks (0.9+) or a plain list (0.8.x).
        self._kv_cache_blocks_cls: Any = getattr(manager_mod, "KVCacheBlocks", None)
        self.blocks: str = "list" if self._kv_cache_blocks_cls is None else "KVCacheBlocks"
        self.hash_fn = self._hash_fn(release, config, manager_params)
        # None where vLLM's chain here is kvspec's; else why hash values are compared as names.
        self._names_only_why = self._hash_chain_why(release, config)
        self.uses_kvspec_hash_chain = self._names_only_why is None
        self._lora_hashes: dict[bytes, bytes] = {}  # vLLM's hash of a LoRA block -> the harness's (module NOTE)
        # Releases before 0.8.3 allocate block 0 like any other: built one block smaller,
        # vLLM's block k is the spec's block k + 1 (see kvspec.conformance.targets.vllm.adapter).
        self.has_null_block = has_null_block(release, config)
        self._offset = 0 if self.has_null_block else 1
        self.manager: Any = self._layout_manager(manager_cls, config.num_gpu_blocks - self._offset)
        self._pool: Any = self.manager.block_pool
        self._block_hasher: Any = self._request_block_hasher() if self.hashes == "request" else None
        self._sampling_params_cls = mod("vllm.sampling_params").SamplingParams
        self._sampling_params = self._sampling_params_cls(max_tokens=1)
        # Whether a Request carries a hit limit (0.34.0 on, releases.py's request_hit_limit), read from the code.
        self._takes_hit_limit = hasattr(self._request_cls, "get_prefix_cache_hit_limit")
        self._lora_cls = mod("vllm.lora.request").LoRARequest
        self._lora_ids: dict[str, int] = {}  # vLLM wants an int id per adapter; stable per name
        self._allocate_params = inspect.signature(self.manager.allocate_slots).parameters
        self._requests: dict[str, Any] = {}  # running request id -> vLLM Request
        self._freed: dict[str, Any] = {}  # freed (finished or preempted) request id -> its vLLM Request
        self._last_hit: dict[str, Any] = {}  # request id -> the hit get_computed_blocks gave (after the cap)
        self._mm: Any = None
        with contextlib.suppress(ImportError):  # multimodal inputs are optional here
            self._mm = mod("vllm.multimodal.inputs")
        # The sizes generation's scheduler, not its manager, holds the len-1 cap (see the module doc).
        self._scheduler_caps_hit = self.constructor == "sizes"
        self.not_applicable = self._not_applicable(release, manager_params)

    def _layout_manager(self, manager_cls: Any, num_blocks: int) -> Any:
        """vLLM's manager for the layout, checked to have the groups asked for (LevelNotProvided where not)."""
        # The KV cache groups; one full-attention group is the manager as before groups existed.
        self.groups: tuple[KVGroup, ...] = parse_groups(self.config.groups)
        self._grouped = self.groups != (FULL,)
        if self._grouped:
            self._check_groups_supported()
        self.manager = self._build_manager(manager_cls, num_blocks)
        if self._grouped:
            self._check_group_managers()
        return self.manager

    def _hash_fn(self, release: VllmRelease, config: AdapterConfig, manager_params: Any) -> str:
        """The manager's hash function: the request's (0.10.1+), the manager's caching_hash_algo
        ("sha256", or builtin hash() for any other name), or builtin hash() alone (0.8.0 to 0.8.2)."""
        hash_fn = config.hash_fn if config.hash_fn in release.hash_functions else "sha256"
        if self.hashes == "manager" and "caching_hash_algo" not in manager_params:
            return "builtin"
        if self.hashes == "manager" and hash_fn != "builtin":
            return "sha256" if "sha256" in release.hash_functions else "builtin"
        return hash_fn

    def _request_block_hasher(self) -> Any:
        """The release's block hasher a Request carries (0.10.1+), NONE_HASH derived for the config's seed."""
        release, config, ku = self.release, self.config, self.release.kv_cache_utils
        fn = release.hash_functions[self.hash_fn]
        if hasattr(ku, "init_none_hash"):
            # Derived under PYTHONHASHSEED=config.seed, as in a deployment that sets it: unset,
            # 0.10.x draws a new NONE_HASH from os.urandom at every call, so a second adapter in
            # this process (a replica, for a caller mistake) would re-key the first one's chains.
            # Left unset for VLLM_NONE_HASH_SEED where the release derives it from that seed when
            # unset (0.29+), so the check is of vLLM as a deployment that sets nothing runs it.
            with hash_seed_env(None if self._unset_seed(release, config) else config.seed):
                ku.init_none_hash(fn)
        return ku.get_request_block_hasher(config.block_size, fn)

    @staticmethod
    def _unset_seed(release: VllmRelease, config: AdapterConfig) -> bool:
        """Whether NONE_HASH is derived with PYTHONHASHSEED unset: the seed asked for is the one the release uses so."""
        return (
            config.seed == VLLM_NONE_HASH_SEED
            and release.version in RELEASES
            and facts_for(release.version).none_hash == "init_none_hash_fixed_default_seed"
        )

    def _hash_chain_why(self, release: VllmRelease, config: AdapterConfig) -> str | None:
        """None where vLLM's chain here is kvspec's (compared exactly); else why hash values are compared as names."""
        if release.version not in RELEASES:
            return f"{release.label} is not in kvspec's release table, so whether its chain is kvspec's is not known"
        note = hash_chain_note(release.version)
        if note is None and self.hash_fn != config.hash_fn:
            note = (f"the harness asked for hash_fn={config.hash_fn!r}, which {release.label} does not have "
                    f"(it hashes with {self.hash_fn!r} here)")  # fmt: skip
        return note

    def _not_applicable(self, release: VllmRelease, manager_params: Any) -> dict[str, str]:
        """What the harness checks that this release does not have, or leaves to its scheduler, with why."""
        not_applicable: dict[str, str] = {}
        if self._names_only_why is not None:
            not_applicable["exact hash values"] = f"hash values compared as names: {self._names_only_why}"
        if "cache_salt" not in self._request_params:
            not_applicable["cache_salt"] = (
                f"{release.label}'s Request takes no cache_salt (added in 0.9.0): no salted request is sent"
            )
        if "num_preallocate_tokens" in manager_params:
            not_applicable["allocate_slots: pre-allocation"] = (
                f"{release.label}'s KVCacheManager is built with num_preallocate_tokens=0 (its scheduler "
                "used 64), so allocate_slots takes the blocks asked for; the pre-allocation branch is not run"
            )
        retention = "prefix_cache_retention_interval"
        interface = self.release.module("vllm.v1.kv_cache_interface") if self.constructor != "sizes" else None
        if any(g.kind == "sliding" for g in self.groups) and retention in getattr(
            getattr(interface, "KVCacheConfig", None), "__dataclass_fields__", {}
        ):
            not_applicable["sparse prefix-cache retention"] = (
                f"{release.label}'s KVCacheConfig is built with {retention}=None (dense: a sliding-window group "
                "registers every full block, as the spec does); its engine resolves 0 by default, under which "
                "a sliding-window group registers only the blocks a hit at the prompt's replay boundary or at a "
                "shared-prefix junction reads; that branch is not run"
            )
        if not self._takes_hit_limit:
            not_applicable[HIT_LIMIT.name] = (
                f"{release.label}'s Request has no prefix_cache_hit_limit (added in 0.34.0): no request with a "
                "hit limit is sent"
            )
        if self._scheduler_caps_hit:
            not_applicable["get_computed_blocks: len-1 cap in the manager"] = (
                f"{release.label}'s manager returns the whole hit and its scheduler drops the last block "
                "of a hit that covers every token; the adapter does what that scheduler does"
            )
        return not_applicable

    def _groups_text(self) -> str:
        return format_groups(self.groups)

    def _check_groups_supported(self) -> None:
        """Refuse, before building anything, KV cache groups the loaded code cannot take.

        Raises:
            LevelNotProvided: the release builds its manager from the pool's sizes or returns plain
                lists (0.8.x: one table), lacks an attention type's spec class, or has no hybrid
                coordinator for several groups.
        """
        label, groups = self.release.label, self._groups_text()
        if self.constructor == "sizes" or self.blocks == "list":
            raise LevelNotProvided(
                f"{label}: its KVCacheManager keeps one block table per request (no KVCacheBlocks per "
                f"group), so it has no KV cache groups; groups={groups!r} is not provided (only 'full')"
            )
        interface = self.release.module("vllm.v1.kv_cache_interface")
        for kind in sorted({g.kind for g in self.groups}):
            if not hasattr(interface, _SPEC_CLASS[kind]):
                raise LevelNotProvided(
                    f"{label}: vllm.v1.kv_cache_interface has no {_SPEC_CLASS[kind]}, so its manager has no "
                    f"{kind} attention group; groups={groups!r} is not provided"
                )
        if len(self.groups) > 1:
            try:
                coordinator = self.release.module("vllm.v1.core.kv_cache_coordinator")
            except ImportError:
                coordinator = None
            if not hasattr(coordinator, "HybridKVCacheCoordinator"):
                raise LevelNotProvided(
                    f"{label}: no HybridKVCacheCoordinator (vllm.v1.core.kv_cache_coordinator), so its "
                    f"manager takes one KV cache group; groups={groups!r} is not provided"
                )

    def _check_group_managers(self) -> None:
        """The built manager runs each group with its attention type's own manager, never another one.

        Raises:
            LevelNotProvided: vLLM picked another single-type manager for a group (or has no
                coordinator to ask), so the layout would run as something else.
        """
        coordinator = getattr(self.manager, "coordinator", None)
        managers = list(getattr(coordinator, "single_type_managers", ()))
        got = [type(m).__name__ for m in managers]
        want = [_MANAGER_CLASS[g.kind] for g in self.groups]
        if got != want:
            raise LevelNotProvided(
                f"{self.release.label}: groups={self._groups_text()!r} ran as {got or 'no per-group managers'} "
                f"where each attention type's own manager ({want}) is needed; not provided"
            )

    def _kv_cache_groups(self, interface: Any, block_size: int) -> list[Any]:
        """One ``KVCacheGroupSpec`` per group, each with its attention type's spec and ``block_size``."""
        import torch  # the installed vLLM depends on it; its attention spec names a dtype

        out = []
        for i, group in enumerate(self.groups):
            spec_cls = getattr(interface, _SPEC_CLASS[group.kind])
            wanted: dict[str, Any] = {
                "block_size": block_size, "num_kv_heads": 1, "head_size": 1, "dtype": torch.float32,
                "use_mla": False,
            }  # fmt: skip
            if group.kind in _SPEC_SIZE:
                wanted[_SPEC_SIZE[group.kind]] = group.size
            spec = spec_cls(**_kwargs_for(spec_cls, wanted))
            out.append(interface.KVCacheGroupSpec([f"layer.{i}"], spec))
        return out

    def _build_manager(self, manager_cls: Any, num_blocks: int) -> Any:
        """vLLM's KVCacheManager over ``num_blocks`` blocks, with the arguments its generation takes.

        Parameters are passed by name where the loaded code takes them:
        ``num_preallocate_tokens=0`` (0.8.0 to 0.8.4, see the module NOTE), the
        sizes (0.8.0 to 0.8.2) or a ``KVCacheConfig`` of one ``KVCacheGroupSpec``
        per KV cache group (0.8.3 on; ``FullAttentionSpec``, ``SlidingWindowSpec``,
        ``ChunkedLocalAttentionSpec``, every one with the config's block size),
        and 0.33's ``scheduler_block_size``/``hash_block_size``.

        Raises:
            LevelNotProvided: the release refuses the groups when building, with a limit it states ("assumes").
        """
        block_size = self.config.block_size
        wanted: dict[str, Any] = {
            "max_model_len": _MAX_MODEL_LEN,
            "scheduler_block_size": block_size,
            "hash_block_size": block_size,
            "enable_caching": self.config.enable_caching,
            "caching_hash_algo": self.hash_fn,
            "num_preallocate_tokens": 0,
            # What the pool tells the world (config.events): its events, and the hit statistics.
            "enable_kv_cache_events": self.config.events,
            "log_stats": self.config.events,
        }
        if self.constructor == "sizes":
            wanted.update(block_size=block_size, num_gpu_blocks=num_blocks, sliding_window=None)
        else:
            interface = self.release.module("vllm.v1.kv_cache_interface")
            cfg_cls = interface.KVCacheConfig
            wanted["kv_cache_config"] = cfg_cls(**_kwargs_for(cfg_cls, {
                "num_blocks": num_blocks, "kv_cache_tensors": [], "tensors": {},
                "kv_cache_groups": self._kv_cache_groups(interface, block_size),
                # Dense retention, the spec's: every full block of every group is registered
                # (0.33's engine resolves 0 by default; see _not_applicable).
                "prefix_cache_retention_interval": None,
            }))  # fmt: skip
        if not self._grouped:
            return manager_cls(**_kwargs_for(manager_cls, wanted))
        try:
            return manager_cls(**_kwargs_for(manager_cls, wanted))
        except (AssertionError, ValueError) as e:
            # The limits a release states for its hybrid coordinator (0.9.2 and 0.10.2: "HybridKVCacheCoordinator
            # assumes exactly one other type of groups now", an assert; "... assumes the full attention group ids
            # and other attention group ids do not interleave", a ValueError). Anything else is a failure.
            if "assumes" not in str(e):
                raise
            raise LevelNotProvided(
                f"{self.release.label}: its KVCacheManager refuses groups={self._groups_text()!r} "
                f"({type(e).__name__}: {str(e)[:200]}); not provided"
            ) from e

    # -- requests ------------------------------------------------------------

    def _lora(self, request: Request) -> Any:
        if not request.lora_name:
            return None
        lora_id = self._lora_ids.setdefault(request.lora_name, len(self._lora_ids) + 1)
        return self._lora_cls(request.lora_name, lora_id, _LORA_PATH.format(request.lora_name))

    def _mm_args(self, request: Request) -> dict[str, Any]:
        """The Request arguments that carry ``request.mm_inputs``, in the release's shape."""
        if not request.mm_inputs:
            return {"mm_features": [], "multi_modal_inputs": None, "multi_modal_hashes": None,
                    "multi_modal_placeholders": None}  # fmt: skip
        if self._mm is None:
            raise NotExpressible(f"{self.release.label}: vllm.multimodal does not import; no multimodal input")
        positions = [self._mm.PlaceholderRange(offset=mm.offset, length=mm.length) for mm in request.mm_inputs]
        if "mm_features" in self._request_params:  # 0.11+: one feature spec per input
            spec_cls = self._mm.MultiModalFeatureSpec
            return {"mm_features": [spec_cls(**_kwargs_for(spec_cls, {
                "data": None, "modality": "image", "identifier": mm.identifier, "mm_position": position,
            })) for mm, position in zip(request.mm_inputs, positions, strict=True)]}  # fmt: skip
        if "multi_modal_hashes" in self._request_params:  # before: parallel lists; only the hashes key blocks
            return {
                "multi_modal_inputs": [self._mm.MultiModalKwargs({}) for _ in request.mm_inputs],
                "multi_modal_hashes": [mm.identifier for mm in request.mm_inputs],
                "multi_modal_placeholders": positions,
            }
        raise NotExpressible(f"{self.release.label} takes multimodal inputs in another shape; none can be sent")

    def _vllm_request(self, request: Request) -> Any:
        """The vLLM Request for ``request``: a new one for a new id, else the running one, grown to its tokens."""
        running = self._requests.get(request.request_id)
        freed = self._freed.get(request.request_id)
        # Re-admission after preemption: the scheduler keeps the Request object (its block hashes included).
        known_prefix = freed is not None and list(request.token_ids[: len(freed.all_token_ids)]) == list(
            freed.all_token_ids
        )
        if running is None and known_prefix:
            running = freed
        if request.cache_salt and self.config.enable_caching and "cache_salt" not in self._request_params:
            # With caching on, dropping the salt would send another request than the one asked for;
            # with caching off a salt keys nothing (no block is hashed), so the request is the same without it.
            raise NotExpressible(
                f"{self.release.label}: its Request takes no cache_salt (added in 0.9.0); "
                f"request_id={request.request_id!r} with cache_salt={request.cache_salt!r} cannot be sent"
            )
        if running is None:
            return self._request_cls(**_kwargs_for(self._request_cls, {
                "request_id": request.request_id,
                "prompt": None,  # the prompt text (0.8.0 to 0.8.4); blocks are keyed by token ids
                "prompt_token_ids": list(request.token_ids),
                "sampling_params": self._sampling_params_for(request),
                "pooling_params": None,
                "eos_token_id": None,
                "arrival_time": 0.0,
                "lora_request": self._lora(request),
                "cache_salt": request.cache_salt,
                **self._mm_args(request),
                "block_hasher": self._block_hasher,
            }))  # fmt: skip
        known = list(running.all_token_ids)
        tokens = list(request.token_ids)
        if tokens[: len(known)] != known:
            raise NotExpressible(
                f"request_id={request.request_id!r} is running with {len(known)} tokens that "
                "the new token_ids do not start with; a running request only grows"
            )
        if len(tokens) > len(known):
            running.append_output_token_ids(tokens[len(known) :])
        return running

    def _sampling_params_for(self, request: Request) -> Any:
        """The SamplingParams that give the vLLM Request the harness request's hit limit, by vLLM's own route.

        0: ``skip_reading_prefix_cache=True`` (a request that must not read
        the cache). N: prompt scoring from row N (``prompt_logprobs=0``,
        ``prompt_logprob_start=N``) with ``skip_reading_prefix_cache=False``,
        which vLLM's ``get_prefix_cache_hit_limit`` reads as N. None: no
        bound. A release without the limit cannot carry one: with caching
        off the limit bounds nothing (no lookup runs), so the request is the
        same without it; with caching on it cannot be sent.

        Raises:
            NotExpressible: a hit limit, caching on, on a release whose Request has none.
        """
        limit = request.prefix_cache_hit_limit
        if limit is None or not (self._takes_hit_limit or self.config.enable_caching):
            return self._sampling_params
        if not self._takes_hit_limit:
            raise NotExpressible(
                f"{self.release.label}: its Request has no prefix_cache_hit_limit (added in 0.34.0); "
                f"request_id={request.request_id!r} with prefix_cache_hit_limit={limit!r} cannot be sent"
            )
        if limit == 0:
            return self._sampling_params_cls(max_tokens=1, skip_reading_prefix_cache=True)
        return self._sampling_params_cls(
            max_tokens=1, prompt_logprobs=0, prompt_logprob_start=limit, skip_reading_prefix_cache=False
        )

    # -- translation ---------------------------------------------------------

    def _group_ids(self, blocks: Any) -> list[list[BlockId]]:
        """Block ids of what the manager returned, one list per group: KVCacheBlocks or (0.8.x) a plain list."""
        if self._kv_cache_blocks_cls is not None:
            return [[BlockId(b + self._offset) for b in group] for group in blocks.get_block_ids()]
        return [[BlockId(b.block_id + self._offset) for b in blocks]]

    def _ids(self, blocks: Any) -> list[BlockId]:
        """Block ids of what the manager returned, as the harness's one flat list: group by group."""
        return [b for group in self._group_ids(blocks) for b in group]

    def _split(self, block_ids: Sequence[BlockId], op: str) -> list[list[BlockId]]:
        """A flat list of hit blocks, group by group, split into one list per group (each as many).

        Raises:
            NotExpressible: the list does not split evenly over the groups, so no group's share is known.
        """
        num_groups = len(self.groups)
        n, rest = divmod(len(block_ids), num_groups)
        if rest:
            raise NotExpressible(
                f"{op}: {len(block_ids)} hit blocks do not split evenly over {num_groups} KV cache groups "
                f"({self._groups_text()}): vLLM takes one list per group"
            )
        return [list(block_ids[g * n : (g + 1) * n]) for g in range(num_groups)]

    def _block(self, block_id: BlockId) -> Any:
        """vLLM's ``KVCacheBlock`` for a harness block id; an id that names none cannot be passed."""
        index = block_id - self._offset if isinstance(block_id, int) and not isinstance(block_id, bool) else -1
        if not 0 <= index < len(self._pool.blocks):
            raise NotExpressible(
                f"allocate_slots: block_id={block_id!r} names no block of {self.release.label} "
                f"(ids {self._offset}..{self.config.num_gpu_blocks - 1})"
            )
        return self._pool.blocks[index]

    def _hit_blocks(self, request_id: str, block_ids: Sequence[BlockId]) -> Any:
        """The hit to pass, as the scheduler passes it.

        What get_computed_blocks returned, if it names these blocks (0.33 tells
        "no hit" from a hit by the identity of its empty KVCacheBlocks); None
        for no blocks otherwise, as for a running request; else vLLM's blocks.
        """
        last = self._last_hit.pop(request_id, None)
        if last is not None and self._ids(last) == list(block_ids):
            return last
        if not block_ids:
            return None
        if self._kv_cache_blocks_cls is None:
            return [self._block(b) for b in block_ids]
        # One list per group; the null block (id 0) at a skipped position is vLLM's own null block.
        per_group = self._split(block_ids, "allocate_slots")
        return self._kv_cache_blocks_cls(tuple([self._block(b) for b in group] for group in per_group))

    # -- the protocol --------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[list[BlockId], int]:
        """vLLM's ``get_computed_blocks`` for a new request, capped at len - 1 tokens where the scheduler caps it.

        From 0.8.3 the manager caps the hit itself. Before, its scheduler did:
        a hit that covers every token loses its last block, so that one token
        is computed; the adapter does the same (see the module doc).
        """
        return self._lookup(request, None)

    def _lookup(self, request: Request, max_cache_hit_length: int | None) -> tuple[list[BlockId], int]:
        """``get_computed_blocks``, with the scheduler's cap where one is given (only releases that take it)."""
        vreq = self._scheduled(request)
        if max_cache_hit_length is None:
            result = self.manager.get_computed_blocks(vreq)
        else:
            result = self.manager.get_computed_blocks(vreq, max_cache_hit_length=max_cache_hit_length)
        blocks, num_tokens = result[0], result[1]
        if len(result) > 2 and hasattr(vreq, "shared_prefix_boundary"):
            vreq.shared_prefix_boundary = result[2]  # the scheduler keeps it on the request
        if self._scheduler_caps_hit and blocks and num_tokens == len(request.token_ids):
            blocks, num_tokens = blocks[:-1], num_tokens - self.config.block_size
        self._last_hit[request.request_id] = blocks
        return self._ids(blocks), int(num_tokens)

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Sequence[BlockId] = (),
        num_external_computed_tokens: int = 0,
    ) -> list[BlockId] | None:
        """vLLM's ``allocate_slots``; on success the request's computed tokens advance as the scheduler's do.

        Before ``num_external_computed_tokens`` was a parameter the scheduler
        passed external tokens as new ones; before ``num_new_computed_tokens``
        (0.8.x) the manager counted the hit from the blocks it was given.
        """
        vreq = self._scheduled(request)
        running = request.request_id in self._requests
        tables_before = self._block_tables(request.request_id) if running else tuple(() for _ in self.groups)
        num_tokens = num_new_tokens
        if "num_external_computed_tokens" not in self._allocate_params:
            num_tokens += num_external_computed_tokens
        new_blocks = self.manager.allocate_slots(**_kwargs_for(self.manager.allocate_slots, {
            "request": vreq,
            "num_new_tokens": num_tokens,
            "num_tokens": num_tokens,  # 0.8.x's name
            "num_new_computed_tokens": num_new_computed_tokens,
            "new_computed_blocks": self._hit_blocks(request.request_id, new_computed_blocks),
            "num_external_computed_tokens": num_external_computed_tokens,
        }))  # fmt: skip
        if new_blocks is None:
            return None
        self._requests[request.request_id] = vreq
        self._freed.pop(request.request_id, None)
        if self.uses_kvspec_hash_chain and request.lora_name:
            self._learn_lora_hashes(request)
        vreq.num_computed_tokens += num_new_computed_tokens + num_external_computed_tokens + num_new_tokens
        if not running:
            self._admitted(vreq, num_new_computed_tokens)
        returned = self._group_ids(new_blocks)
        if not num_external_computed_tokens:
            return [b for group in returned for b in group]
        # NOTE: newer releases (0.33) take the blocks for external tokens in a
        # separate stage and return only those for the tokens to compute; the
        # scheduler reads the table instead. A table is append-only (a skipped
        # position turns into the null block in place), so in each group the
        # blocks taken for external tokens are the ones between the hit and the
        # returned blocks, nulls left out: vLLM's own table, not a guess.
        tables = self._block_tables(request.request_id)
        hits = self._split(new_computed_blocks, "allocate_slots")
        out: list[BlockId] = []
        for table, before, hit, new in zip(tables, tables_before, hits, returned, strict=True):
            start = len(before) + len(hit)
            out += [b for b in table[start : len(table) - len(new)] if b != NULL_BLOCK_ID]
            out += new
        return out

    def _scheduled(self, request: Request) -> Any:
        """The vLLM Request for ``request`` as the scheduler hands it over: with its preemption count
        (and the report mode a scheduler asked for, ``kv_cache_report_mode``)."""
        vreq = self._vllm_request(request)
        if hasattr(vreq, "num_preemptions"):  # 0.24 on: a re-admission's hits are counted apart
            vreq.num_preemptions = request.num_preemptions
        if self.kv_cache_report_mode is not None:
            vreq.kv_cache_report_mode = self.kv_cache_report_mode
        return vreq

    def _admitted(self, vreq: Any, num_local_hits: int) -> None:
        """What the scheduler does once a waiting request is admitted: from 0.33 it records the hit statistics.

        Releases before count a request in ``get_computed_blocks`` (at the
        lookup); 0.33's manager leaves it to the scheduler, which calls
        ``record_prefix_cache_stats`` after a successful ``allocate_slots``
        with the local hit ("Record at admission so unscheduled lookups are
        not counted", ``vllm/v1/core/sched/scheduler.py``). The adapter plays
        that part, as it plays the scheduler's other duties.
        """
        record = getattr(self.manager, "record_prefix_cache_stats", None)
        if callable(record):
            record(vreq, num_local_hits)

    def reset_prefix_cache(self) -> bool:
        """vLLM's ``KVCacheManager.reset_prefix_cache`` (refused while blocks are held)."""
        done: bool = self.manager.reset_prefix_cache()
        return done

    def free(self, request_id: str) -> None:
        """vLLM's ``free``; the request stops running, its Request kept as on preemption (see the module doc).

        A request that is not running but was admitted before (finished or
        preempted) goes to vLLM's ``free`` with its kept ``Request``, and vLLM
        answers as it does (a preempted request aborted in the waiting queue
        takes the same path in vLLM's scheduler).

        Raises:
            NotExpressible: ``request_id`` was never admitted: there is no vLLM ``Request`` to pass.
        """
        vreq = self._requests.pop(request_id, None)
        if vreq is None:
            freed = self._freed.get(request_id)
            if freed is None:
                raise NotExpressible(
                    f"free: request_id={request_id!r} was never admitted, so there is no vLLM Request "
                    "to pass to vLLM's free (it takes the Request object, not an id)"
                )
            self.manager.free(freed)
            return
        self.manager.free(vreq)
        vreq.num_computed_tokens = 0  # as the scheduler resets a preempted request
        self._freed[request_id] = vreq

    def _raw(self, key: Any) -> BlockHash:
        """A hash-table key (or a block's hash) as the spec's key: the hash, with its group id after it
        for groups other than 0, as the spec's ``group_key`` makes it.

        With one full-attention group every key is group 0's, the bare hash, as
        before groups existed. A LoRA block's hash is the harness's where it is
        kvspec's chain with the LoRA path given (module NOTE).
        """
        if isinstance(key, bytes):  # digest + 4-byte group id
            digest, group_id = bytes(key[:-4]), int.from_bytes(key[-4:], "big")
            return group_key(BlockHash(self._lora_hashes.get(digest, digest)), group_id)
        value: int = key.block_hash.hash_value if hasattr(key, "block_hash") else key.hash_value
        raw = BlockHash(value.to_bytes(max(1, (value.bit_length() + 8) // 8), "big", signed=True))
        return group_key(raw, int(key.group_id)) if self._grouped and hasattr(key, "group_id") else raw

    def _learn_lora_hashes(self, request: Request) -> None:
        """The harness's hash of each full block of a LoRA request that vLLM just stepped, by the hash vLLM gives it
        where that is kvspec's chain with the LoRA path the adapter gave (module NOTE); learned as vLLM hashes
        them, so a replica given the same calls translates the same hashes."""
        cfg = self.config
        chain = (request.token_ids, cfg.block_size, request.lora_name, request.mm_inputs, request.cache_salt,
                 cfg.hash_fn, cfg.seed)  # fmt: skip
        with_path = hash_request_blocks(*chain, lora_path=_LORA_PATH.format(request.lora_name))
        self._lora_hashes.update(zip(with_path, hash_request_blocks(*chain), strict=True))

    def _block_tables(self, request_id: str) -> tuple[tuple[BlockId, ...], ...]:
        """The request's block table in every group (0.8.x: its one table)."""
        if hasattr(self.manager, "get_block_ids"):
            return tuple(
                tuple(BlockId(b + self._offset) for b in group) for group in self.manager.get_block_ids(request_id)
            )
        # 0.8.x: the manager's own table (a defaultdict: read without inserting)
        return (tuple(BlockId(b.block_id + self._offset) for b in self.manager.req_to_blocks.get(request_id, ())),)

    def snapshot(self) -> Snapshot:
        """The pool's state and every running request's block tables, one per group, with the groups.

        "Running" is the adapter's own bookkeeping (a successful ``allocate_slots``,
        no ``free`` since), not vLLM's tables: vLLM's ``remove_skipped_blocks``
        indexes a defaultdict, so a new request whose allocation failed can leave
        an empty table there.
        """
        tables = tuple(sorted(
            (table_name(rid, g), table)
            for rid in self._requests for g, table in enumerate(self._block_tables(rid))
        ))  # fmt: skip
        snap = pool_snapshot(self._pool, self.config.num_gpu_blocks, self.config.enable_caching, self._raw,
                             self._offset, block_tables=tables)  # fmt: skip
        return replace(snap, kv_groups=snapshot_groups(self.groups)) if self._grouped else snap


# ---------------------------------------------------------------------------
# what a release's manager has beyond the core protocol: each a mixin, present only where vLLM has it


class _EvictBlocks(VllmManagerAdapter):
    """``evict_blocks`` (``KVCacheManager.evict_blocks``; 0.24 and 0.33 of those measured): failed external loads.

    vLLM takes a set of block ids (ints), so every int is passed as given
    (shifted, for a release without a null block) and vLLM answers as it
    does; only a value that is not an int has no translation.
    """

    def evict_blocks(self, block_ids: Sequence[BlockId]) -> None:
        """vLLM's ``evict_blocks``: its set of block ids.

        Raises:
            NotExpressible: an id is not an int (vLLM's ids are ints).
        """
        self.manager.evict_blocks(vllm_id_set(block_ids, self._offset))


class _NumCachedTokens(VllmManagerAdapter):
    """``get_num_cached_tokens(request)`` (0.34.0 on): a probe of the cache that takes nothing."""

    def get_num_cached_tokens(self, request: Request) -> int:
        """vLLM's ``get_num_cached_tokens`` for the request's vLLM Request (the running one, if it runs)."""
        return int(self.manager.get_num_cached_tokens(self._vllm_request(request)))


class _HitCap(VllmManagerAdapter):
    """``get_computed_blocks(request, max_cache_hit_length)``: the scheduler's cap (0.33 of the releases measured)."""

    def get_computed_blocks(
        self, request: Request, max_cache_hit_length: int | None = None
    ) -> tuple[list[BlockId], int]:
        """vLLM's ``get_computed_blocks`` with the scheduler's cap on the hit (None: len - 1, the manager's own)."""
        return self._lookup(request, max_cache_hit_length)


class _ManagerEvents(VllmManagerAdapter):
    """``take_events`` (with ``config.events``, 0.9.0 on): the manager built with events on, its queue drained.

    Keys are folded into the snapshot's form (``_raw``: with the group id
    when there are several groups). A 64-bit event key (0.10.2 on, vLLM's
    default) is mapped back through the block hashes of every vLLM
    ``Request`` the adapter handed over (``remember``), which hold every
    digest vLLM registered or names as a parent.
    """

    def __init__(self, release: VllmRelease, config: AdapterConfig) -> None:
        super().__init__(release, config)

        facts = event_facts(release.version)
        self._events = EventTranslator(facts, self._event_key)
        self._handed: list[Any] = []  # every vLLM Request handed over, and how many of its hashes are remembered
        self._remembered: dict[int, int] = {}
        self.not_applicable.update(fields_not_published(facts, release.label))

    def _scheduled(self, request: Request) -> Any:
        vreq = super()._scheduled(request)
        if id(vreq) not in self._remembered:
            self._remembered[id(vreq)] = 0
            self._handed.append(vreq)
        return vreq

    def _event_key(self, value: Any, group: int) -> BlockHash:
        if isinstance(value, (bytes, bytearray)):  # a digest (0.10.2 on): the table's key is it and its group
            return self._raw(bytes(value) + group.to_bytes(4, "big"))
        raw = int(value).to_bytes(max(1, (int(value).bit_length() + 8) // 8), "big", signed=True)
        return BlockHash(raw + group.to_bytes(4, "big") if self._grouped else raw)

    def take_events(self) -> list[KVCacheEvent]:
        """The events vLLM's manager queued since the last call, as the spec's (vLLM's queue is emptied)."""
        for vreq in self._handed:
            hashes = list(getattr(vreq, "block_hashes", None) or ())
            seen = self._remembered[id(vreq)]
            if len(hashes) > seen:
                self._events.remember(hashes[seen:])
                self._remembered[id(vreq)] = len(hashes)
        return self._events.translate(self.manager.take_events())


class _ManagerStats(VllmManagerAdapter):
    """``prefix_cache_stats`` (with ``config.events``): vLLM's intervals (``make_prefix_cache_stats``) added up."""

    def __init__(self, release: VllmRelease, config: AdapterConfig) -> None:
        super().__init__(release, config)

        self._stats = StatsSum()
        self.not_applicable["connector statistics"] = (
            f"{release.label}: the external connector's counters (connector_prefix_cache_stats) are kept by "
            "vLLM's Scheduler, not its KVCacheManager, which the adapter drives"
        )

    def reset_prefix_cache(self) -> bool:
        done = super().reset_prefix_cache()
        self._stats.add(self.manager.make_prefix_cache_stats())  # an interval's reset flag counts one reset
        return done

    def prefix_cache_stats(self) -> PrefixCacheStats:
        """The hit statistics since the manager was built: every interval vLLM handed out, added up."""
        self._stats.add(self.manager.make_prefix_cache_stats())
        return self._stats.total


_MANAGER_CLASSES: dict[tuple[type[VllmManagerAdapter], ...], type[VllmManagerAdapter]] = {}


def make_manager_adapter(release: VllmRelease, config: AdapterConfig, *, stats: bool = True) -> KVCacheManagerAdapter:
    """The request-level adapter over one installed vLLM, with exactly the operations its manager has.

    ``evict_blocks`` where ``KVCacheManager`` has it, the hit cap where its
    ``get_computed_blocks`` takes ``max_cache_hit_length``; with
    ``config.events``, ``take_events`` where it takes
    ``enable_kv_cache_events`` (and its events name the group, or there is
    one group) and ``prefix_cache_stats`` where it hands out its statistics
    (unless ``stats`` is False: see ``make_events_only_adapter``).

    Raises:
        ValueError: the release is loaded in light mode, its KVCacheManager takes neither a KVCacheConfig
            nor the pool's sizes, or it has no null block and ``config.num_gpu_blocks < 2``.
    """
    if release.source != "installed":
        return VllmManagerAdapter(release, config)  # raises LevelNotProvided, saying why

    cls = release.module("vllm.v1.core.kv_cache_manager").KVCacheManager
    params = inspect.signature(cls).parameters
    mixins: list[type[VllmManagerAdapter]] = []
    if callable(getattr(cls, "evict_blocks", None)):
        mixins.append(_EvictBlocks)
    if "max_cache_hit_length" in inspect.signature(cls.get_computed_blocks).parameters:
        mixins.append(_HitCap)
    if callable(getattr(cls, "get_num_cached_tokens", None)):
        mixins.append(_NumCachedTokens)
    one_group = len(parse_groups(config.groups)) == 1
    no_group_events = False
    if config.events and "enable_kv_cache_events" in params:
        if one_group or event_facts(release.version).groups_in_events:
            mixins.append(_ManagerEvents)
        else:
            no_group_events = True
    if config.events and stats and callable(getattr(cls, "make_prefix_cache_stats", None)):
        mixins.append(_ManagerStats)
    key = tuple(mixins)
    if key not in _MANAGER_CLASSES:
        name = "VllmManagerAdapter" + "".join(m.__name__.replace("_", "With", 1) for m in mixins)
        _MANAGER_CLASSES[key] = type(name, (*mixins, VllmManagerAdapter), {}) if mixins else VllmManagerAdapter
    adapter = _MANAGER_CLASSES[key](release, config)
    if no_group_events:
        adapter.not_applicable["KV cache events"] = (
            f"{release.label}: its events name no KV cache group (group_idx from 0.20.0), and its engine turns "
            "the hybrid KV cache manager off when events are on, so with several groups no event is read"
        )
    return adapter


def make_full_report_adapter(config: AdapterConfig) -> KVCacheManagerAdapter:
    """The installed vLLM's request level with every request in ``kv_cache_report_mode == "full"``.

    vLLM 0.33's ``get_computed_blocks`` publishes a ``BlockStored`` for the
    blocks a lookup hits when the request asks for full reports (for a
    gateway that learns of reused blocks); it reads the attribute with
    ``getattr`` and nothing in vLLM 0.33 sets it, so only a scheduler or
    request class of one's own reaches that path. This factory plays such a
    scheduler: ``kvspec check --impl
    kvspec.conformance.targets.vllm.manager:make_full_report_adapter --level manager --events``.

    Raises:
        LevelNotProvided: the pool level (requests, and their report mode, are the request level's).
    """
    if config.level != "manager":
        raise LevelNotProvided("a request's kv_cache_report_mode is read by the KVCacheManager: request level only")
    adapter = make_manager_adapter(installed_release(), config)
    assert isinstance(adapter, VllmManagerAdapter), f"make_manager_adapter built a {type(adapter).__name__}"
    adapter.kv_cache_report_mode = "full"
    return adapter


def make_events_only_adapter(config: AdapterConfig) -> KVCacheManagerAdapter:
    """The installed vLLM's request level with its KV cache events checked and its hit statistics left out.

    Up to 0.24 (of the releases measured) the manager counts a request at its
    lookup, where vLLM 0.33 and the spec count it at admission, so with the
    statistics checked every events campaign of such a release stops at its
    first lookup. This factory leaves ``prefix_cache_stats`` out (declared
    ``not_applicable["hit statistics"]``), so the rest of the request level,
    its events included, is still judged: ``kvspec check --impl
    kvspec.conformance.targets.vllm.manager:make_events_only_adapter --level manager --events``.

    Raises:
        LevelNotProvided: the pool level (it has no hit statistics to leave out; use ``vllm``).
    """
    if config.level != "manager":
        raise LevelNotProvided("the hit statistics are the request level's: use the vllm adapter at the pool level")
    release = installed_release()
    adapter = make_manager_adapter(release, config, stats=False)
    assert isinstance(adapter, VllmManagerAdapter), f"make_manager_adapter built a {type(adapter).__name__}"
    adapter.not_applicable["hit statistics"] = (
        f"{release.label}: left out by make_events_only_adapter, for a release that counts a request at its "
        "lookup (up to 0.24 of the releases measured) where the spec counts it at admission"
    )
    return adapter
