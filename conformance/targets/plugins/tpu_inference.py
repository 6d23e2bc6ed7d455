"""tpu-inference's ``ContinuousFreeQueue`` inside vLLM's ``BlockPool``, injected as ``core/core_tpu.py`` does.

For disaggregated serving, tpu-inference's engine start-up
(``tpu_inference/core/core_tpu.py``) replaces, in every prefill and decode
engine, the free queue of the pool vLLM just built::

    pool.free_block_queue = ContinuousFreeQueue(pool.blocks)
    pool.null_block = pool.free_block_queue.popleft()
    pool.null_block.is_null = True

The overlay runs the same three lines after every pool the harness builds
(``after_pool_init``), with ``ContinuousFreeQueue`` from the plugin's wheel
(``runner/continuous_block_pool.py``, run as shipped) on vLLM 0.32.0: the
release tpu-inference 0.32.0 is paired with (vllm-tpu 0.32.0 pins
``tpu-inference==0.32.0`` and ships a ``block_pool.py`` byte for byte
vLLM 0.32.0's). Nothing of it is a placeholder.

``ContinuousFreeQueue`` keeps free blocks as intervals of ids, not as a
queue: a request of several blocks takes the best-fitting run of ids, a
single block the highest free id. The snapshot lists its free blocks in id
order; which blocks an allocation takes is compared through
``get_new_blocks``' result. It has no ``prepend_n``, which vLLM's
``free_blocks`` calls from 0.23 on.
"""

from __future__ import annotations

from typing import Any

from kvspec.conformance.core.adapter import AdapterConfig
from kvspec.conformance.targets.plugins.adapters import OverlayCache, hash_table_entries, make_factory, pool_state
from kvspec.conformance.targets.plugins.dist import PluginDist, fetch_dist
from kvspec.conformance.targets.plugins.overlay import Overlay, load_overlay
from kvspec.conformance.targets.vllm.adapter import make_pool_adapter
from kvspec.spec.state import Snapshot

__all__ = ["DIST", "INJECTION", "SUPPORTED_VLLM", "apply", "factory", "load"]

DIST = PluginDist(
    "tpu-inference",
    "0.32.0",
    ("tpu_inference/runner/continuous_block_pool.py", "tpu_inference/logger.py", "tpu_inference/core/core_tpu.py"),
)
SUPPORTED_VLLM = "0.32.0"
# The lines of core_tpu.py that `apply` repeats (a test checks the wheel still has them).
INJECTION: tuple[str, ...] = (
    "pool.free_block_queue = ContinuousFreeQueue(pool.blocks)",
    "pool.null_block = pool.free_block_queue.popleft()",
    "pool.null_block.is_null = True",
)
_CACHE = OverlayCache()


def apply(overlay: Overlay) -> None:
    """Replace every new pool's free queue with a ``ContinuousFreeQueue``, as core_tpu.py does."""
    queue_cls = overlay.import_plugin("tpu_inference.runner.continuous_block_pool").ContinuousFreeQueue

    def inject(pool: Any) -> None:
        pool.free_block_queue = queue_cls(pool.blocks)
        pool.null_block = pool.free_block_queue.popleft()
        pool.null_block.is_null = True

    overlay.after_pool_init(inject)


def load(vllm_version: str) -> Overlay:
    """tpu-inference's wheel on a fresh light-mode copy of a vLLM release, applied (once per process)."""

    def build() -> Overlay:
        root = fetch_dist(DIST)
        label = f"{DIST.label} on vllm=={vllm_version}"
        overlay = load_overlay(vllm_version, {"tpu_inference": root}, label=label)
        apply(overlay)
        return overlay

    return _CACHE.get(vllm_version, build)


class _IntervalState:
    """The vLLM adapter's translation and state, with the free blocks read from the interval queue."""

    pool: Any
    config: AdapterConfig
    _raw: Any

    def snapshot(self) -> Snapshot:
        """vLLM's blocks and hash table; the free blocks in id order (the queue keeps intervals, no order)."""
        pool = self.pool
        free = sorted(pool.free_block_queue.free_blocks)
        table = hash_table_entries(pool.cached_block_hash_to_block)
        return pool_state(self.config, pool.blocks, free, table, self._raw)


def _adapter(vllm_version: str, config: AdapterConfig) -> object:
    adapter = make_pool_adapter(load(vllm_version).vllm_release(), config)
    adapter.__class__ = type("TpuInferencePoolAdapter", (_IntervalState, type(adapter)), {})
    return adapter


def factory(vllm_version: str = SUPPORTED_VLLM) -> Any:
    """The factory for ``tpu-inference@<vllm_version>`` (pool level)."""
    return make_factory(f"tpu-inference@{vllm_version}", lambda config: _adapter(vllm_version, config))
