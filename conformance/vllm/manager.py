"""vLLM's KVCacheManager behind the request-level adapter protocol.

The adapter plays the scheduler's part and nothing more: it builds the config
objects a scheduler's engine passes (one full-attention KV-cache group, a
``KVCacheConfig``), one vLLM ``Request`` per running request (with the LoRA
request, cache_salt and multimodal inputs the release understands), and after
each successful ``allocate_slots`` advances ``request.num_computed_tokens`` as
the scheduler does once a step is scheduled. Everything else (the prefix hit
and its cap, which blocks are touched and taken, what is registered, the free
order) is vLLM's.

Three API generations, told apart by the loaded code, not the version string:

- 0.8.x (``blocks="list"``; run on 0.8.5.post1): ``get_computed_blocks`` returns a
  plain list of blocks, ``allocate_slots(request, num_tokens,
  new_computed_blocks)`` counts the hit from the blocks it is given, the
  manager hashes requests itself (``caching_hash_algo``), and ``free`` reverses
  the block table only when caching is on.
- 0.9.x (``hashes="manager"``; run on 0.9.2): ``KVCacheBlocks`` and
  ``num_new_computed_tokens`` arrive; the manager still hashes requests itself.
- 0.10.1 on (``hashes="request"``; run on 0.10.2 and 0.33.0): the
  ``Request`` carries the release's block hasher; from 0.11 (and 0.33's ``hash_block_size``) only parameters
  are added, which are passed by name where the loaded code takes them.

A freed request may be preempted, not finished: the harness's ``free`` does
not say which. The adapter treats it as preemption does: it keeps the vLLM
``Request`` (with the block hashes computed so far, on the request from 0.10.1,
in the manager by request id before, where only a finished request gets
``free_block_hashes``) and re-admits that same object with its computed tokens
reset, as the scheduler does. For a finished request this is unobservable:
the harness never reuses a finished request's id.

Refused, with a ValueError that says so: releases whose ``KVCacheManager``
takes no ``KVCacheConfig`` or takes ``num_preallocate_tokens`` (0.8.0 to 0.8.4
pre-allocate 64 tokens ahead; not run here): another design, not driven half
right. A salted request on a release whose ``Request`` has no cache_salt
(before 0.9.0) gets ``InvalidRequest`` with caching on; with caching off a
salt keys nothing and the request is sent without it.

Hash values are vLLM's own (``sha256``/``sha256_cbor`` from 0.10.1, else the
manager's ``caching_hash_algo``); the harness compares them as an equality
relation, and ``kvspec hashes`` checks the values.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Sequence
from typing import Any

from kvspec.conformance.adapter import AdapterConfig, KVCacheManagerAdapter
from kvspec.conformance.vllm.adapter import VllmRelease, pool_snapshot
from kvspec.spec.errors import InvalidRequest
from kvspec.spec.manager import Request
from kvspec.spec.state import BlockHash, BlockId, Snapshot

__all__ = ["VllmManagerAdapter", "make_manager_adapter"]

# Large enough that vLLM's max_model_len never caps a harness request.
_MAX_MODEL_LEN = 1 << 16


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
        rejected_mistakes: None of the harness's request-level mistakes gets a typed error.
    """

    validates_bad_input = False
    rejected_mistakes: frozenset[str] = frozenset()

    def __init__(self, release: VllmRelease, config: AdapterConfig) -> None:
        if release.source != "installed":
            raise ValueError(
                f"{release.label}: the request level needs vLLM installed (its Request and config "
                "classes); light mode loads the pool only. Use level='pool', or an environment with vLLM"
            )
        import torch  # the installed vLLM depends on it

        self.release = release
        self.config = config
        mod = release.module
        interface = mod("vllm.v1.kv_cache_interface")
        manager_mod = mod("vllm.v1.core.kv_cache_manager")
        manager_cls = manager_mod.KVCacheManager
        manager_params = inspect.signature(manager_cls).parameters
        if "kv_cache_config" not in manager_params or "num_preallocate_tokens" in manager_params:
            raise ValueError(
                f"{release.label}: its KVCacheManager takes ({', '.join(manager_params)}): no KVCacheConfig, "
                "or blocks pre-allocated ahead of the tokens asked for; the request-level adapter speaks "
                "the managers that take a KVCacheConfig and allocate what is asked (0.8.5 on). Use level='pool'"
            )
        ku = release.kv_cache_utils
        self._request_cls: Any = mod("vllm.v1.request").Request
        self._request_params = inspect.signature(self._request_cls).parameters
        # Where hashes come from: the Request's block hasher (0.10.1+) or the manager itself.
        self.hashes: str = "request" if "block_hasher" in self._request_params else "manager"
        # What get_computed_blocks / allocate_slots return: KVCacheBlocks (0.9+) or a plain list (0.8.x).
        self._kv_cache_blocks_cls: Any = getattr(manager_mod, "KVCacheBlocks", None)
        self.blocks: str = "list" if self._kv_cache_blocks_cls is None else "KVCacheBlocks"
        block_size = config.block_size
        spec_cls = interface.FullAttentionSpec
        spec = spec_cls(**_kwargs_for(spec_cls, {
            "block_size": block_size, "num_kv_heads": 1, "head_size": 1, "dtype": torch.float32, "use_mla": False,
        }))  # fmt: skip
        group = interface.KVCacheGroupSpec(["layer.0"], spec)
        cfg_cls = interface.KVCacheConfig
        kv_cache_config = cfg_cls(**_kwargs_for(cfg_cls, {
            "num_blocks": config.num_gpu_blocks, "kv_cache_tensors": [], "tensors": {}, "kv_cache_groups": [group],
        }))  # fmt: skip
        # Before 0.10.1 the manager hashes with "sha256" or, for any other name, builtin hash().
        self.hash_fn = config.hash_fn if config.hash_fn in release.hash_functions else "sha256"
        if self.hashes == "manager" and self.hash_fn != "builtin":
            self.hash_fn = "sha256" if "sha256" in release.hash_functions else "builtin"
        self.manager: Any = manager_cls(**_kwargs_for(manager_cls, {
            "kv_cache_config": kv_cache_config,
            "max_model_len": _MAX_MODEL_LEN,
            "scheduler_block_size": block_size,
            "hash_block_size": block_size,
            "enable_caching": config.enable_caching,
            "caching_hash_algo": self.hash_fn,
        }))  # fmt: skip
        self._pool: Any = self.manager.block_pool
        self._block_hasher: Any = None
        if self.hashes == "request":
            fn = release.hash_functions[self.hash_fn]
            if hasattr(ku, "init_none_hash"):
                ku.init_none_hash(fn)
            self._block_hasher = ku.get_request_block_hasher(block_size, fn)
        self._sampling_params = mod("vllm.sampling_params").SamplingParams(max_tokens=1)
        self._lora_cls = mod("vllm.lora.request").LoRARequest
        self._lora_ids: dict[str, int] = {}  # vLLM wants an int id per adapter; stable per name
        self._allocate_params = inspect.signature(self.manager.allocate_slots).parameters
        self._requests: dict[str, Any] = {}  # running request id -> vLLM Request
        self._freed: dict[str, Any] = {}  # freed (finished or preempted) request id -> its vLLM Request
        self._last_hit: dict[str, Any] = {}  # request id -> what its get_computed_blocks returned
        self._mm: Any = None
        with contextlib.suppress(ImportError):  # multimodal inputs are optional here
            self._mm = mod("vllm.multimodal.inputs")

    # -- requests ------------------------------------------------------------

    def _lora(self, request: Request) -> Any:
        if not request.lora_name:
            return None
        lora_id = self._lora_ids.setdefault(request.lora_name, len(self._lora_ids) + 1)
        return self._lora_cls(request.lora_name, lora_id, f"/lora/{request.lora_name}")

    def _mm_args(self, request: Request) -> dict[str, Any]:
        """The Request arguments that carry ``request.mm_inputs``, in the release's shape."""
        if not request.mm_inputs:
            return {"mm_features": [], "multi_modal_inputs": None, "multi_modal_hashes": None,
                    "multi_modal_placeholders": None}  # fmt: skip
        if self._mm is None:
            raise InvalidRequest(f"{self.release.label}: vllm.multimodal does not import; no multimodal input")
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
        raise InvalidRequest(f"{self.release.label} takes multimodal inputs in another shape; none can be sent")

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
            raise InvalidRequest(
                f"{self.release.label}: its Request takes no cache_salt (added in 0.9.0); "
                f"request_id={request.request_id!r} with cache_salt={request.cache_salt!r} cannot be sent"
            )
        if running is None:
            return self._request_cls(**_kwargs_for(self._request_cls, {
                "request_id": request.request_id,
                "prompt_token_ids": list(request.token_ids),
                "sampling_params": self._sampling_params,
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
            raise InvalidRequest(
                f"request_id={request.request_id!r} is running with {len(known)} tokens that "
                "the new token_ids do not start with; a running request only grows"
            )
        if len(tokens) > len(known):
            running.append_output_token_ids(tokens[len(known) :])
        return running

    # -- translation ---------------------------------------------------------

    def _ids(self, blocks: Any) -> list[BlockId]:
        """Block ids of what the manager returned: KVCacheBlocks (group 0) or a plain list."""
        if self._kv_cache_blocks_cls is not None:
            return [BlockId(b) for b in blocks.get_block_ids()[0]]
        return [BlockId(b.block_id) for b in blocks]

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
        blocks = [self._pool.blocks[b] for b in block_ids]
        return blocks if self._kv_cache_blocks_cls is None else self._kv_cache_blocks_cls((blocks,))

    # -- the protocol --------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[list[BlockId], int]:
        """vLLM's ``get_computed_blocks`` for a new request (its own len-1 cap, where it has one)."""
        vreq = self._vllm_request(request)
        result = self.manager.get_computed_blocks(vreq)
        blocks, num_tokens = result[0], result[1]
        if len(result) > 2 and hasattr(vreq, "shared_prefix_boundary"):
            vreq.shared_prefix_boundary = result[2]  # the scheduler keeps it on the request
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
        vreq = self._vllm_request(request)
        table_before = self._block_table(request.request_id) if request.request_id in self._requests else ()
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
        vreq.num_computed_tokens += num_new_computed_tokens + num_external_computed_tokens + num_new_tokens
        returned = self._ids(new_blocks)
        if not num_external_computed_tokens:
            return returned
        # NOTE: newer releases (0.33) take the blocks for external tokens in a
        # separate stage and return only those for the tokens to compute; the
        # scheduler reads the table instead. The table is append-only, so the
        # blocks taken for external tokens are the ones between the hit and the
        # returned blocks: vLLM's own table, not a guess.
        table = self._block_table(request.request_id)
        start = len(table_before) + len(new_computed_blocks)
        return [*table[start : len(table) - len(returned)], *returned]

    def free(self, request_id: str) -> None:
        """vLLM's ``free``; the request stops running, its Request kept as on preemption (see the module doc)."""
        vreq = self._requests.pop(request_id, None)
        if vreq is None:
            raise InvalidRequest(f"free: request_id={request_id!r} is not running (freed twice?)")
        self.manager.free(vreq)
        vreq.num_computed_tokens = 0  # as the scheduler resets a preempted request
        self._freed[request_id] = vreq

    def _raw(self, key: Any) -> BlockHash:
        if isinstance(key, bytes):
            return BlockHash(bytes(key[:-4]))  # digest + 4-byte group id
        value: int = key.block_hash.hash_value if hasattr(key, "block_hash") else key.hash_value
        return BlockHash(value.to_bytes(max(1, (value.bit_length() + 8) // 8), "big", signed=True))

    def _block_table(self, request_id: str) -> tuple[BlockId, ...]:
        if hasattr(self.manager, "get_block_ids"):
            return tuple(BlockId(b) for b in self.manager.get_block_ids(request_id)[0])
        # 0.8.x: the manager's own table (a defaultdict: read without inserting)
        return tuple(BlockId(b.block_id) for b in self.manager.req_to_blocks.get(request_id, ()))

    def snapshot(self) -> Snapshot:
        """The pool's state and every running request's block table."""
        tables = tuple((rid, self._block_table(rid)) for rid in sorted(self._requests))
        return pool_snapshot(self._pool, self.config.num_gpu_blocks, self.config.enable_caching, self._raw,
                             block_tables=tables)  # fmt: skip


def make_manager_adapter(release: VllmRelease, config: AdapterConfig) -> KVCacheManagerAdapter:
    """The request-level adapter over one installed vLLM.

    Raises:
        ValueError: the release is loaded in light mode, or its KVCacheManager takes no KVCacheConfig
            or pre-allocates (before 0.8.5).
    """
    return VllmManagerAdapter(release, config)
