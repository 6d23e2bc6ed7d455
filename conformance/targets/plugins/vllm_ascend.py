"""vllm-ascend 0.23.0's patched ``free_blocks`` and free queue, on vLLM 0.23.0.

vllm-ascend's platform plugin imports ``vllm_ascend/patch/platform/
patch_kv_cache_utils.py`` when vLLM loads it, and that module's import
replaces, on vLLM's own classes, ``BlockPool.free_blocks`` and
``FreeKVCacheBlockQueue.prepend_n`` / ``append_n`` (plus layout helpers of
``kv_cache_utils`` the pool does not use). The overlay imports the same
module, unmodified, from the 0.23.0 wheel (0.23.0.post1 ships no cp311
wheel; the 0.23.0 wheel is fetched as CPython 3.11's whatever Python runs
kvspec) on a fresh light-mode copy of vLLM 0.23.0, so the patches land on
that copy's classes as they land on vLLM's in production.

One placeholder: ``vllm_ascend.utils`` imports torch_npu (the Ascend
runtime); the patch uses only its ``vllm_version_is``, copied here (it
compares vLLM's version, which the overlay reports as the release's).

What the patch does with bad input, read from its code: a block named twice
in one ``free_blocks`` call, or freed while its ``ref_cnt`` is already 0,
is dropped from the call with a warning line (``SWA_BLOCK_DIAG ...``)
instead of an error, and the rest of the call applies; the queue
insertions drop null, duplicate, still-referenced and still-linked blocks
the same way. Those mistakes are declared ignored (``IGNORED_MISTAKES``,
kvspec.conformance.core.reactions) on top of vLLM 0.23.0's own reactions, and the
campaigns send them and check it: the state after such a call must be what
the call without the bad block gives.
"""

from __future__ import annotations

import types
from typing import Any

from kvspec.conformance.core.adapter import AdapterConfig
from kvspec.conformance.core.reactions import ignores
from kvspec.conformance.targets.plugins.adapters import OverlayCache, make_factory
from kvspec.conformance.targets.plugins.dist import PluginDist, fetch_dist
from kvspec.conformance.targets.plugins.overlay import Overlay, load_overlay
from kvspec.conformance.targets.vllm.adapter import make_pool_adapter

__all__ = ["DIST", "IGNORED_MISTAKES", "PATCH_MODULE", "SUPPORTED_VLLM", "apply", "factory", "load"]

DIST = PluginDist(
    "vllm-ascend",
    "0.23.0",
    ("vllm_ascend/patch/platform/patch_kv_cache_utils.py", "vllm_ascend/utils.py"),
    # its only wheel is built for CPython 3.11 on manylinux_2_34; the files read are Python, so any Python fetches it
    pip_args=("--python-version", "3.11", "--implementation", "cp", "--abi", "cp311",
              "--platform", "manylinux_2_34_x86_64"),
)  # fmt: skip
SUPPORTED_VLLM = "0.23.0"
PATCH_MODULE = "vllm_ascend.patch.platform.patch_kv_cache_utils"
# Caller mistakes the patch drops with a warning, the good part of the call applying
# ("ignored" in the declared-reaction sense: the bad part changes nothing).
IGNORED_MISTAKES: dict[str, str] = {
    "free_blocks: named twice": "the second and later copies of a block are dropped (duplicate_free_batch)",
    "free_blocks: double free": "a block whose ref_cnt is already 0 is dropped (ref_cnt_underflow_free_blocks)",
}
_CACHE = OverlayCache()


def _utils_module(overlay: Overlay) -> types.ModuleType:
    """``vllm_ascend.utils`` without torch_npu: ``vllm_version_is`` as the plugin defines it."""
    # optional dependency (the vllm extra): only a plugin that picks patches by version needs it
    from packaging.version import Version

    module = types.ModuleType("vllm_ascend.utils", "vllm-ascend's vllm_version_is; the rest needs torch_npu.")

    def vllm_version_is(target_vllm_version: str) -> bool:
        # the real one reads VLLM_VERSION from vllm_ascend.envs, else vllm.__version__: the release's
        version = overlay.module("vllm").__version__
        return bool(Version(version) == Version(target_vllm_version))

    module.__dict__["vllm_version_is"] = vllm_version_is
    return module


def apply(overlay: Overlay) -> None:
    """Import the patch module, whose import replaces the pool's methods (as vLLM's plugin loading does)."""
    overlay.import_plugin(PATCH_MODULE)


def load(vllm_version: str) -> Overlay:
    """vllm-ascend's patch on a fresh light-mode copy of a vLLM release (once per process)."""

    def build() -> Overlay:
        root = fetch_dist(DIST)
        label = f"{DIST.label} on vllm=={vllm_version}"
        overlay = load_overlay(
            vllm_version, {"vllm_ascend": root}, label=label, placeholders={"vllm_ascend.utils": _utils_module}
        )
        apply(overlay)
        return overlay

    return _CACHE.get(vllm_version, build)


def _adapter(vllm_version: str, config: AdapterConfig) -> object:
    adapter = make_pool_adapter(load(vllm_version).vllm_release(), config)
    ignored = {mistake: ignores(why) for mistake, why in IGNORED_MISTAKES.items()}
    adapter.mistake_reactions = {**adapter.mistake_reactions, **ignored}
    return adapter


def factory(vllm_version: str = SUPPORTED_VLLM) -> Any:
    """The factory for ``vllm-ascend@<vllm_version>`` (pool level)."""
    return make_factory(f"vllm-ascend@{vllm_version}", lambda config: _adapter(vllm_version, config))
