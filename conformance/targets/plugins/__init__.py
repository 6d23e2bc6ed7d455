"""Plugins of vLLM's block manager, checked as they run in production: an overlay of their modules on vLLM's.

- ``dist``: a plugin's distribution (wheel, or sdist unpacked without building), fetched once and cached;
- ``overlay``: a vLLM release's light-mode pool modules with a plugin's modules on top, and what a
  ``module:function`` given as ``overlay:vllm@X+module:function`` may do with it;
- ``adapters``: factories and the state in normal form, shared by the targets;
- the targets, one module each: ``vllm_mlx``, ``kvcached`` (with ``kvcached_device``, its device
  placeholders), ``tpu_inference``, ``vllm_ascend``; ``targets`` names them for ``--impl``;
- ``findings`` and ``probes``: the known divergences, in words, and the scenarios that show them;
"""

from kvspec.conformance.targets.plugins.overlay import Overlay, OverlayError, load_overlay, load_plugin

__all__ = ["Overlay", "OverlayError", "load_overlay", "load_plugin"]
