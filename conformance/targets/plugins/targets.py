"""The plugin targets kvspec knows by name, what each claims, and what each is known to do differently.

``kvspec check --impl NAME`` accepts, besides the built-in names:

- ``vllm-mlx``: vllm-mlx's ``PagedCacheManager`` (pool) and ``BlockAwarePrefixCache`` (request level);
- ``kvcached`` / ``kvcached@X``: kvcached's ``ElasticBlockPool`` on vLLM X (default 0.30.0, the release
  kvcached 0.1.6 is tested with);
- ``tpu-inference`` / ``tpu-inference@X``: tpu-inference's ``ContinuousFreeQueue`` in vLLM X's pool
  (default 0.32.0);
- ``vllm-ascend`` / ``vllm-ascend@X``: vllm-ascend 0.23.0's patched pool methods on vLLM X (default 0.23.0);
- ``overlay:vllm@X+module:function``: any plugin that patches vLLM's pool modules, applied by
  ``function(overlay)`` (kvspec.conformance.targets.plugins.overlay says what it may do).

The profile a target claims is the one of the vLLM release it runs on (a user
swapping the plugin in expects that release's behaviour); vllm-mlx, which has
its own pool, is checked under the profile its code follows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvspec.conformance.core.adapter import AdapterConfig
from kvspec.conformance.runner.registry import FactoryError, load_factory
from kvspec.conformance.targets.plugins import kvcached, probes, tpu_inference, vllm_ascend, vllm_mlx
from kvspec.conformance.targets.plugins.adapters import OverlayCache, make_factory
from kvspec.conformance.targets.plugins.dist import PluginDist
from kvspec.conformance.targets.plugins.findings import Finding, PluginProbe
from kvspec.conformance.targets.plugins.overlay import Overlay, load_overlay
from kvspec.conformance.targets.vllm.adapter import make_pool_adapter

__all__ = ["OVERLAY_PREFIX", "TARGETS", "PluginTarget", "factory_for", "overlay_factory"]

OVERLAY_PREFIX = "overlay:"

Factory = Callable[[AdapterConfig], object]


@dataclass(frozen=True)
class PluginTarget:
    """One plugin as kvspec checks it."""

    name: str  # the --impl name
    dist: PluginDist  # the release of the plugin that is checked
    base: str | None  # the vLLM release it runs on by default; None: it has its own pool
    profile: str  # the profile it claims
    claim: str  # why that release and profile, in one line
    levels: tuple[str, ...]  # the levels it provides
    make: Callable[[str | None], Factory]  # base release (None: the default) -> factory
    probes: tuple[PluginProbe, ...] = ()  # its directed probes
    findings: tuple[Finding, ...] = field(default_factory=tuple)  # its known divergences

    def factory(self, base: str | None = None) -> Factory:
        """The factory on the given vLLM release (the default one when None)."""
        return self.make(base)

    def impl_name(self, base: str | None = None) -> str:
        """The name reports, traces and ``kvspec replay`` use: ``kvcached@0.30.0``, or ``vllm-mlx``."""
        chosen = base or self.base
        return self.name if chosen is None else f"{self.name}@{chosen}"


_ORDER_KEEPS_REUSE = "reuse stays correct"

_MLX_FINDINGS: tuple[Finding, ...] = (
    Finding("double-free-keyerror", "free_blocks", r"KeyError",
            "frees a block whose ref_count is already 0 by deleting it from its map of allocated blocks a second "
            "time, which raises KeyError; vLLM accepts the second free silently (ref_cnt -1), the spec raises "
            "DoubleFree", "errors"),
    Finding("null-touch-counted", "touch", r"null block",
            "touch counts a reference on the null block (its ref_count grows); the spec raises InvalidBlock",
            "errors"),
    Finding("null-free-skipped", "free_blocks", r"null block",
            "free_blocks skips the null block silently; the spec raises InvalidBlock", "errors"),
    Finding("registered-again-skipped", "cache_full_blocks", r"AlreadyCached",
            "cache_full_blocks keeps a cached block's first hash and skips it silently; the spec raises "
            "AlreadyCached", "errors"),
    Finding("block-keyed-by-own-tokens", "allocate_slots", r"returned \[\d+(, \d+)*\]; the spec returned \[",
            "the prefix cache keys a block by its own tokens only (no parent hash) and store_cache reuses any held "
            "block with the same tokens, so a block computed after one prefix is reused after another; vLLM and "
            "the spec key a block by its whole prefix", "KV reuse", is_bug=True),
    Finding("stale-key-after-reuse", "allocate_slots", r"hash-table entry",
            "a block's prefix-cache key survives the block's reallocation (eviction clears only the chained hash, "
            "which the request path never sets), so the old key hits the block while it holds another request's "
            "KV; vLLM and the spec drop a block's hash when it is reallocated", "KV reuse", is_bug=True),
    Finding("extra-keys-ignored", "get_computed_blocks", r"a prefix of the request.s own chain",
            "the prefix cache's key leaves out the LoRA adapter (and cache_salt and images), so a request under "
            "one adapter hits blocks computed under another; vLLM and the spec put them in the block hash",
            "KV reuse", is_bug=True),
    Finding("no-hit-cap", "get_computed_blocks", r"at most len\(prompt\) - 1",
            "a prefix hit can cover the whole prompt; vLLM and the spec reuse at most len - 1 tokens, so the "
            "last token is computed", "hit cap", is_bug=True),
    Finding("partial-allocation", "allocate_slots", r"the spec returned None",
            "when blocks run out, store_cache allocates as many as it can and keeps them; vLLM and the spec "
            "allocate all of a step's blocks or none (None)", "bookkeeping"),
    Finding("freed-head-first", "free", r"free_queue",
            "release_cache frees a request's blocks head first, so its first block is evicted before its last; "
            "vLLM and the spec free tail first", "order"),
    Finding("hashes-with-caching-off", "allocate_slots", r"caching off",
            "the prefix cache registers full blocks even with enable_caching=False (its path does not read the "
            "flag); vLLM and the spec cache nothing then", "bookkeeping", is_bug=True),
)  # fmt: skip

_KVCACHED_FINDINGS: tuple[Finding, ...] = (
    Finding("hashless-reused-oldest-first", "free_blocks", r"free_queue",
            "a block freed without a hash goes to the end of its page's FIFO free list (reused oldest-freed "
            "first); vLLM from 0.24 and the spec's vllm-v1 put it at the front (newest freed first)", "order"),
    Finding("usage-counts-null", "get_usage", r"returned",
            "get_usage counts the null block as used (1 - free / num_gpu_blocks); vLLM from 0.10.2 and the spec "
            "leave it out", "result"),
    Finding("reset-accepted-while-held-caching-off", "reset_prefix_cache", r"returned True; the spec returned False",
            "with caching off, reset_prefix_cache returns True while blocks are held; vLLM and the spec return "
            "False", "result", caching=False),
    Finding("reset-accepted-while-held", "reset_prefix_cache", r"returned True; the spec returned False",
            "reset_prefix_cache returns True while blocks are held and empties the hash table, the held blocks "
            "keeping their block_hash (hash_table_consistent breaks until they are freed); vLLM and the spec "
            "refuse (False)", "bookkeeping", is_bug=True, caching=True),
    Finding("freed-ref-kept-caching-off", "free_blocks", r"ref_cnt is 0",
            "with caching off, free_blocks hands blocks back to kvcached's allocator without dropping their "
            "ref_cnt, so a free block reads ref_cnt 1; vLLM and the spec drop it to 0", "bookkeeping",
            is_bug=True, caching=False),
    Finding("registered-again-assert", "cache_full_blocks", r"AssertionError",
            "registering a cached block again fails the release's own assert in cache_full_blocks (kvcached runs "
            "vLLM's there, NativeBlockPoolMixin); the spec raises AlreadyCached", "errors"),
    Finding("registered-again-skipped", "cache_full_blocks", r"AlreadyCached",
            "registering a cached block again keeps its first hash silently; the spec raises AlreadyCached",
            "errors"),
)  # fmt: skip

_TPU_FINDINGS: tuple[Finding, ...] = (
    Finding("no-prepend-n", "free_blocks", r"prepend_n",
            "ContinuousFreeQueue has no prepend_n, which vLLM 0.32's free_blocks calls on every free with caching "
            "on (and on a double free with caching off), so those raise AttributeError; vLLM's "
            "FreeKVCacheBlockQueue has it", "crash", is_bug=True),
    Finding("single-block-from-the-top", "get_new_blocks", r"returned \[\d+\]; the spec returned \[",
            "a one-block allocation takes the highest free id (ContinuousFreeQueue.popleft); vLLM and the spec take "
            "the front of the free queue", "order"),
)  # fmt: skip

_ASCEND_FINDINGS: tuple[Finding, ...] = (
    Finding("double-free-dropped", "free_blocks", r"DoubleFree",
            "free_blocks drops a block whose ref_cnt is already 0 with a warning line (SWA_BLOCK_DIAG) and applies "
            "the rest of the call; vLLM 0.23.0 drives its ref_cnt to -1, the spec raises DoubleFree", "errors"),
    Finding("named-twice-dropped", "free_blocks", r"names a block twice",
            "free_blocks drops the second copy of a block named twice with a warning line; vLLM 0.23.0 takes both "
            "references (ref_cnt -1, and the block never returns to the free queue: leaked), the spec raises "
            "InvalidRequest", "errors"),
    Finding("null-free-passed-through", "free_blocks", r"null block",
            "free_blocks passes the null block on to vLLM 0.23.0's, which drives its ref_cnt to -1 (the patch "
            "filters only queue insertions); the spec raises InvalidBlock", "errors"),
    Finding("registered-again-assert", "cache_full_blocks", r"AssertionError",
            "registering a cached block again fails vLLM 0.23.0's own assert in cache_full_blocks; the spec raises "
            "AlreadyCached", "errors"),
)  # fmt: skip

TARGETS: dict[str, PluginTarget] = {
    "vllm-mlx": PluginTarget(
        "vllm-mlx", vllm_mlx.DIST, None, "vllm-v1-tail",
        "its own pool (paged_cache.py); free_block_batch appends every freed block at the right end",
        ("pool", "manager"), lambda base: vllm_mlx.factory(),
        probes.MLX_POOL_PROBES + probes.MLX_REQUEST_PROBES, _MLX_FINDINGS,
    ),
    "kvcached": PluginTarget(
        "kvcached", kvcached.DIST, kvcached.SUPPORTED_VLLM, "vllm-v1",
        "vLLM 0.30.0's profile: kvcached 0.1.6 is tested up to vLLM 0.30.0 (its README)",
        ("pool",), lambda base: kvcached.factory(base or kvcached.SUPPORTED_VLLM),
        probes.KVCACHED_PROBES, _KVCACHED_FINDINGS,
    ),
    "tpu-inference": PluginTarget(
        "tpu-inference", tpu_inference.DIST, tpu_inference.SUPPORTED_VLLM, "vllm-v1",
        "vLLM 0.32.0's profile: vllm-tpu 0.32.0 pins tpu-inference==0.32.0 and ships vLLM 0.32.0's block_pool.py",
        ("pool",), lambda base: tpu_inference.factory(base or tpu_inference.SUPPORTED_VLLM),
        probes.TPU_PROBES, _TPU_FINDINGS,
    ),
    "vllm-ascend": PluginTarget(
        "vllm-ascend", vllm_ascend.DIST, vllm_ascend.SUPPORTED_VLLM, "vllm-v1-tail",
        "vLLM 0.23.0's profile: vllm-ascend 0.23.0 patches vLLM 0.23.0 (vllm_version_is('0.23.0') branches)",
        ("pool",), lambda base: vllm_ascend.factory(base or vllm_ascend.SUPPORTED_VLLM),
        probes.ASCEND_PROBES, _ASCEND_FINDINGS,
    ),
}  # fmt: skip


_OVERLAYS = OverlayCache()


def overlay_factory(name: str) -> Factory:
    """The factory for ``overlay:vllm@X+module:function``: release X, patched by ``function(overlay)``.

    The function is imported normally (its module is the user's), called once
    per process with a fresh `Overlay` of release X, and the pools it leaves
    are driven by vLLM's own adapter at the pool level.

    Raises:
        ValueError: the name is malformed, or the module or function cannot be found.
    """
    spec = name[len(OVERLAY_PREFIX) :]
    base, plus, target = spec.partition("+")
    release, _, version = base.partition("@")
    module_name, colon, attr = target.partition(":")
    if release != "vllm" or not version or not plus or not colon or not module_name or not attr:
        raise ValueError("expected overlay:vllm@<release>+<module>:<function>")
    try:  # module:function or path/to/file.py:function, as --impl names an implementation's factory
        apply: Any = load_factory(target)
    except FactoryError as e:
        raise ValueError(f"cannot find {target} ({e})") from None

    def build() -> Overlay:
        overlay = load_overlay(version, {}, label=f"{target} on vllm=={version}")
        apply(overlay)
        return overlay

    def adapter(config: AdapterConfig) -> object:
        return make_pool_adapter(_OVERLAYS.get(name, build).vllm_release(), config)

    return make_factory(name, adapter)


def factory_for(name: str) -> Factory:
    """The factory a plugin name means (see the module docstring).

    Raises:
        ValueError: an unknown target, or a malformed name.
    """
    if name.startswith(OVERLAY_PREFIX):
        return overlay_factory(name)
    target_name, at, base = name.partition("@")
    target = TARGETS.get(target_name)
    if target is None or (at and not base):
        raise ValueError(f"not a plugin target ({', '.join(TARGETS)}, each optionally @<vllm release>)")
    if at and target.base is None:
        raise ValueError(f"{target_name} has its own pool and runs on no vLLM release")
    factory = target.factory(base or None)
    # the name given (a trace records it, and kvspec replay reads it back)
    factory.__name__ = factory.__qualname__ = name
    return factory
