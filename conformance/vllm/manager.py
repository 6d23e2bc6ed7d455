"""vLLM's KVCacheManager behind the request-level adapter protocol.

The adapter plays the scheduler's part and nothing more: it builds the config
objects a scheduler's engine passes (one full-attention KV-cache group, a
``KVCacheConfig``), one vLLM ``Request`` per running request (with the LoRA
request, cache_salt and multimodal features the release understands, and the
release's block hasher), and after each successful ``allocate_slots`` advances
``request.num_computed_tokens`` as the scheduler does once a step is scheduled.
Everything else (the prefix hit and its cap, which blocks are touched and
taken, what is registered, the free order) is vLLM's.

Design choice: generations are told apart by the parameters the loaded code
takes (``num_external_computed_tokens``, ``hash_block_size``, ``block_hasher``,
``mm_features``, ...), so the same adapter speaks every release whose
KVCacheManager takes a ``KVCacheConfig`` and whose ``Request`` takes a
``block_hasher`` (0.10.1 on). Earlier releases compute hashes inside the
manager from request attributes of another shape; they are refused with a
ValueError that says so rather than driven half right.

Hash values are vLLM's own (its ``sha256`` or ``sha256_cbor``); the harness
compares them as an equality relation, and ``kvspec hashes`` checks the values.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
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
        request_mod = mod("vllm.v1.request")
        ku = release.kv_cache_utils
        self._request_cls: Any = request_mod.Request
        if "block_hasher" not in inspect.signature(self._request_cls).parameters:
            raise ValueError(
                f"{release.label}: its KVCacheManager hashes requests itself from request attributes "
                "(before 0.10.1); the request-level adapter speaks 0.10.1 and later. Use level='pool'"
            )
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
        self.manager: Any = manager_mod.KVCacheManager(**_kwargs_for(manager_mod.KVCacheManager, {
            "kv_cache_config": kv_cache_config,
            "max_model_len": _MAX_MODEL_LEN,
            "scheduler_block_size": block_size,
            "hash_block_size": block_size,
            "enable_caching": config.enable_caching,
        }))  # fmt: skip
        self._pool: Any = self.manager.block_pool
        self._kv_cache_blocks_cls = manager_mod.KVCacheBlocks
        hash_fn = config.hash_fn if config.hash_fn in release.hash_functions else "sha256"
        fn = release.hash_functions[hash_fn]
        if hasattr(ku, "init_none_hash"):
            ku.init_none_hash(fn)
        self._block_hasher = ku.get_request_block_hasher(block_size, fn)
        self._sampling_params = mod("vllm.sampling_params").SamplingParams(max_tokens=1)
        self._lora_cls = mod("vllm.lora.request").LoRARequest
        self._lora_ids: dict[str, int] = {}  # vLLM wants an int id per adapter; stable per name
        self._allocate_params = inspect.signature(self.manager.allocate_slots).parameters
        self._requests: dict[str, Any] = {}  # running request id -> vLLM Request
        self._last_hit: dict[str, Any] = {}  # request id -> the KVCacheBlocks its get_computed_blocks returned
        self._mm: Any = None
        with contextlib.suppress(ImportError):  # multimodal inputs are optional here
            self._mm = mod("vllm.multimodal.inputs")

    # -- requests ------------------------------------------------------------

    def _lora(self, request: Request) -> Any:
        if not request.lora_name:
            return None
        lora_id = self._lora_ids.setdefault(request.lora_name, len(self._lora_ids) + 1)
        return self._lora_cls(request.lora_name, lora_id, f"/lora/{request.lora_name}")

    def _mm_features(self, request: Request) -> list[Any]:
        if not request.mm_inputs:
            return []
        if self._mm is None or not hasattr(self._mm, "MultiModalFeatureSpec"):
            raise InvalidRequest(f"{self.release.label} takes multimodal inputs in another shape; none can be sent")
        features = []
        for mm in request.mm_inputs:
            position = self._mm.PlaceholderRange(offset=mm.offset, length=mm.length)
            spec_cls = self._mm.MultiModalFeatureSpec
            features.append(spec_cls(**_kwargs_for(spec_cls, {
                "data": None, "modality": "image", "identifier": mm.identifier, "mm_position": position,
            })))  # fmt: skip
        return features

    def _vllm_request(self, request: Request) -> Any:
        """The vLLM Request for ``request``: a new one for a new id, else the running one, grown to its tokens."""
        running = self._requests.get(request.request_id)
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
                "mm_features": self._mm_features(request),
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

    # -- the protocol --------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[list[BlockId], int]:
        """vLLM's ``get_computed_blocks`` for a new request (its own len-1 cap, where it has one)."""
        vreq = self._vllm_request(request)
        result = self.manager.get_computed_blocks(vreq)
        blocks, num_tokens = result[0], result[1]
        if len(result) > 2 and hasattr(vreq, "shared_prefix_boundary"):
            vreq.shared_prefix_boundary = result[2]  # the scheduler keeps it on the request
        self._last_hit[request.request_id] = blocks
        return [BlockId(b) for b in blocks.get_block_ids()[0]], int(num_tokens)

    def _hit_blocks(self, request_id: str, block_ids: Sequence[BlockId]) -> Any:
        """The KVCacheBlocks to pass: the one get_computed_blocks returned, if it names these blocks."""
        last = self._last_hit.pop(request_id, None)
        if last is not None and list(last.get_block_ids()[0]) == list(block_ids):
            return last
        return self._kv_cache_blocks_cls(([self._pool.blocks[b] for b in block_ids],))

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Sequence[BlockId] = (),
        num_external_computed_tokens: int = 0,
    ) -> list[BlockId] | None:
        """vLLM's ``allocate_slots``; on success the request's computed tokens advance as the scheduler's do."""
        vreq = self._vllm_request(request)
        kwargs: dict[str, Any] = {}
        num_tokens = num_new_tokens
        if "num_external_computed_tokens" in self._allocate_params:
            kwargs["num_external_computed_tokens"] = num_external_computed_tokens
        else:  # before it was a parameter the scheduler added external tokens to the new ones
            num_tokens += num_external_computed_tokens
        hit = self._hit_blocks(request.request_id, new_computed_blocks)
        new_blocks = self.manager.allocate_slots(vreq, num_tokens, num_new_computed_tokens, hit, **kwargs)
        if new_blocks is None:
            return None
        self._requests[request.request_id] = vreq
        vreq.num_computed_tokens += num_new_computed_tokens + num_external_computed_tokens + num_new_tokens
        return [BlockId(b) for b in new_blocks.get_block_ids()[0]]

    def free(self, request_id: str) -> None:
        """vLLM's ``free`` (tail first); the request stops running."""
        vreq = self._requests.pop(request_id, None)
        if vreq is None:
            raise InvalidRequest(f"free: request_id={request_id!r} is not running (freed twice?)")
        self.manager.free(vreq)

    def _raw(self, key: Any) -> BlockHash:
        if isinstance(key, bytes):
            return BlockHash(bytes(key[:-4]))  # digest + 4-byte group id
        value: int = key.block_hash.hash_value if hasattr(key, "block_hash") else key.hash_value
        return BlockHash(value.to_bytes(max(1, (value.bit_length() + 8) // 8), "big", signed=True))

    def snapshot(self) -> Snapshot:
        """The pool's state and every running request's block table."""
        tables = tuple(
            (rid, tuple(BlockId(b) for b in itertools.chain(self.manager.get_block_ids(rid)[0])))
            for rid in sorted(self._requests)
        )
        return pool_snapshot(self._pool, self.config.num_gpu_blocks, self.config.enable_caching, self._raw,
                             block_tables=tables)  # fmt: skip


def make_manager_adapter(release: VllmRelease, config: AdapterConfig) -> KVCacheManagerAdapter:
    """The request-level adapter over one installed vLLM.

    Raises:
        ValueError: the release is loaded in light mode or predates 0.10.1's request block hasher.
    """
    return VllmManagerAdapter(release, config)
