"""kvspec's own targets, as the ``kvspec.targets`` entry points of its pyproject.toml name them.

Each record names its code by "module:function", so loading this module
imports nothing of the targets themselves: ``kvspec check --impl reference``
never imports torch, and ``--impl gpu`` on a machine without torch is a
one-line could-not-run. A third-party pool registers the same way, from its
own distribution (docs: the adapter guide).
"""

from __future__ import annotations

from kvspec.conformance.runner.registry import Target

__all__ = [
    "GPU",
    "KVCACHED",
    "OVERLAY",
    "REFERENCE",
    "SPEC",
    "TPU_INFERENCE",
    "VLLM",
    "VLLM_ASCEND",
    "VLLM_MLX",
    "VLLM_V0",
]

_VLLM_FACTORIES = "kvspec.conformance.targets.vllm.factories"
_PLUGIN_FACTORIES = "kvspec.conformance.targets.plugins.targets:factory_for"

REFERENCE = Target(
    name="reference",
    summary="the reference model: vLLM's data structures, O(1) per block",
    factory="kvspec.conformance.targets.builtin:make_reference",
    default_order=1,
)
SPEC = Target(
    name="spec",
    summary="the executable specification itself (the harness's own plumbing, and the smallest adapter)",
    factory="kvspec.conformance.targets.builtin:make_spec",
    default_order=2,
)
GPU = Target(
    name="gpu",
    summary="gpu_impl: pool state and paged KV in torch tensors (--device cpu|cuda:N)",
    factory="kvspec.gpu_impl.adapter:make_adapter",
    default_order=3,
)
# vLLM is the regression oracle's business: checked only when named.
VLLM = Target(
    name="vllm",
    summary="the installed vLLM, or with KVSPEC_VLLM_VERSION=X that release in light mode; vllm@X: release X's pool",
    # No factory of its own: "vllm" too is resolved, so KVSPEC_VLLM_VERSION's release is fetched
    # (and refused in one line if it cannot be) before anything runs.
    resolve=f"{_VLLM_FACTORIES}:factory_for",
    forms=("vllm", "vllm@X.Y.Z"),
)
VLLM_V0 = Target(
    name="vllm-v0",
    summary="vLLM v0's prefix-caching allocator and evictor of release X (before 0.8.0), in light mode",
    resolve=f"{_VLLM_FACTORIES}:factory_for",
    forms=("vllm-v0@X.Y.Z",),
)
# Plugins of vLLM's block manager, loaded from their own distributions (kvspec.conformance.targets.plugins).
VLLM_MLX = Target(
    name="vllm-mlx",
    summary="vllm-mlx's PagedCacheManager and BlockAwarePrefixCache",
    resolve=_PLUGIN_FACTORIES,
)
KVCACHED = Target(
    name="kvcached",
    summary="kvcached's ElasticBlockPool on vLLM X",
    resolve=_PLUGIN_FACTORIES,
    forms=("kvcached", "kvcached@X"),
)
TPU_INFERENCE = Target(
    name="tpu-inference",
    summary="tpu-inference's ContinuousFreeQueue in vLLM X's pool",
    resolve=_PLUGIN_FACTORIES,
    forms=("tpu-inference", "tpu-inference@X"),
)
VLLM_ASCEND = Target(
    name="vllm-ascend",
    summary="vllm-ascend's patched pool methods on vLLM X",
    resolve=_PLUGIN_FACTORIES,
    forms=("vllm-ascend", "vllm-ascend@X"),
)
OVERLAY = Target(
    name="overlay",
    summary="any plugin that patches vLLM's pool: overlay:vllm@X+module:function",
    resolve=_PLUGIN_FACTORIES,
    prefix="overlay:",
    forms=("overlay:vllm@X+module:function",),
)
