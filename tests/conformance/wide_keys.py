"""A vLLM pool whose hash-table key carries the group id in 8 bytes where vLLM's carries 4, and the short
campaign that shows it: the pool keys, finds and frees consistently, so hash values compared as names see
nothing, and compared exactly the first registration diverges (the value kept is not the value handed over).

Shared by the miniature release's test (test_exact_hashes.py, default suite) and a real release's
(test_vllm_adapter.py, marked vllm).
"""

from __future__ import annotations

from kvspec.conformance.core.adapter import AdapterConfig
from kvspec.conformance.core.lockstep import ConformanceFailure, Factory, LockStep
from kvspec.conformance.targets.vllm.adapter import VllmRelease, make_pool_adapter
from kvspec.spec.state import BlockHash


def wide_group_id_factory(release: VllmRelease, *, names_only: bool = False) -> Factory:
    """`release`'s pool (load it fresh: the patch changes its module globals) with 8-byte group ids in its keys;
    `names_only`: the adapter declares that hash values are compared as names."""
    block_hash = getattr(release.kv_cache_utils, "BlockHash", bytes)  # a NewType over bytes, or bytes
    release.block_pool.make_block_hash_with_group_id = lambda h, g: block_hash(bytes(h) + g.to_bytes(8, "big"))

    def factory(config: AdapterConfig) -> object:
        adapter = make_pool_adapter(release, config)
        if names_only:
            adapter.uses_kvspec_hash_chain = False
        return adapter

    return factory


def register_and_free(factory: Factory, block_hash: BlockHash) -> tuple[str, int | None, str]:
    """Take a block, register it under `block_hash`, look it up, free it: the verdict, the failing step and
    its message."""
    lock = LockStep(factory, AdapterConfig("pool", 4))
    steps = [("get_new_blocks", (1,)), ("cache_full_blocks", ([1], [block_hash])), ("get_cached_block", (block_hash,)),
             ("free_blocks", ([1],))]  # fmt: skip
    try:
        lock.check()
        for op, args in steps:
            lock.call(op, *args)
            lock.check()
    except ConformanceFailure as f:
        return f.failure.kind.value, f.failure.step, f.failure.message
    return "conforms", None, ""
