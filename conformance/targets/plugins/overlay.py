"""The overlay: a vLLM release's pool modules with a plugin's own modules on top, as production loads them.

Most plugins of vLLM's block manager do what vLLM plugins do: take vLLM's own
pool modules and replace a class or a method (vllm-ascend reassigns
``BlockPool.free_blocks``), inject a subclass into ``vllm.v1.core.block_pool``
(kvcached's ``ElasticBlockPool``), or swap a part of a pool after vLLM built
it (tpu-inference's ``ContinuousFreeQueue``). An `Overlay` reproduces that
without installing either: a fresh light-mode copy of the release
(kvspec.conformance.targets.vllm.lightmode, its own module globals, so a patch never
reaches another check in the same process), then the plugin's modules,
executed unmodified from its distribution, with ``import vllm...`` inside
them bound to that copy and the plugin's own package to a private name.

What runs and what does not:

- the plugin's modules that make up the pool run whole, as shipped; its
  package ``__init__`` files do not run (they import the plugin's runtime:
  jax, mlx, torch_npu), so each package is an empty stand-in for its modules;
- a module named in ``placeholders`` (device code: a C++ page allocator, an
  accelerator runtime, GPU tensor set-up) is a module kvspec supplies, a
  faithful small copy of the behaviour the pool depends on, whose docstring
  says what it replaces and why the pool's observable behaviour is kept;
- device runtimes do not import inside plugin code (``DEVICE_RUNTIMES``:
  ``import torch`` raises ImportError there, as on a machine without it),
  so a plugin's "am I on ROCm?" probe takes its no-device branch wherever
  kvspec runs, and a plugin that needs one at import says so at once;
- ``importlib.import_module("vllm...")`` inside plugin code is bound to the
  release as ``import`` is, and the release reports its own version as
  ``vllm.__version__`` (plugins pick their patches by it).

How a plugin is applied (a ``module:function`` given
``overlay:vllm@X+module:function`` receives the `Overlay` and does one or
more of these, the way the plugin does it in production):

- patch the release's objects in place: ``overlay.module("vllm.v1.core.block_pool").BlockPool.free_blocks = f``,
  or run a plugin module whose import patches them (``overlay.import_plugin(name)``);
- ``overlay.after_pool_init(hook)``: ``hook(pool)`` runs on every ``BlockPool``
  the harness builds, right after its constructor, as a plugin's start-up
  code does after vLLM built its pool;
- ``overlay.use_pool_class(factory)``: the harness builds its pools with
  ``factory(num_gpu_blocks, enable_caching, **kwargs)`` (the constructor
  arguments of the release's ``BlockPool``) instead.

The overlay serves the plugin's modules with light mode's loader
(kvspec.conformance.targets.loader): the same finder, the same mapped
``import`` and ``importlib``, one more private package per plugin package.

The harness then drives the result with the vLLM adapter
(kvspec.conformance.targets.vllm.adapter) at the pool level, exactly as it drives
the release itself. The rejected alternative, a subprocess with the plugin
and vLLM installed, needs the plugin's device runtime to import at all.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import inspect
import itertools
import re
import sys
import threading
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvspec.conformance.targets.loader import DEVICE_RUNTIMES, PrivateFinder, SourceTree, redirecting_builtins
from kvspec.conformance.targets.vllm.adapter import VllmRelease
from kvspec.conformance.targets.vllm.lightmode import LightRelease, load_release

__all__ = ["Overlay", "OverlayError", "PoolFactory", "load_overlay", "load_plugin"]

PoolFactory = Callable[..., Any]  # (num_gpu_blocks, enable_caching, **kwargs) -> a BlockPool

_counter = itertools.count(1)
_lock = threading.RLock()


class OverlayError(RuntimeError):
    """An overlay could not be built: a plugin module is missing or does not run on the release."""


@dataclass(eq=False)
class Overlay:
    """One vLLM release's light-mode pool modules with plugin modules loaded on top.

    Attributes:
        release: The fresh light-mode copy of the release (its globals are this overlay's own);
            None for a plugin whose pool does not build on vLLM's (``load_plugin``).
        label: How reports name it, e.g. ``"kvcached==0.1.6 on vllm==0.30.0"``.
        roots: Each plugin top-level package, and the folder that holds it.
        placeholders: Plugin module name -> builder of the module that stands in for it (device code).
        private: Each plugin top-level package, and the private name it is loaded under.
        plugin_modules: Every plugin module loaded so far, by its real dotted name.
        pool_hooks: Run on every new ``BlockPool`` after its constructor (``after_pool_init``).
        pool_factory: Builds pools instead of the release's ``BlockPool`` (``use_pool_class``).
    """

    release: LightRelease | None  # None for a plugin that stands alone (its own pool classes)
    label: str
    roots: dict[str, Path] = field(default_factory=dict)
    placeholders: dict[str, Callable[[Overlay], types.ModuleType]] = field(default_factory=dict)
    private: dict[str, str] = field(default_factory=dict)
    plugin_modules: dict[str, types.ModuleType] = field(default_factory=dict)
    pool_hooks: list[Callable[[Any], None]] = field(default_factory=list)
    pool_factory: PoolFactory | None = None

    def module(self, name: str) -> types.ModuleType:
        """A module of the overlay by its real name: ``vllm...`` from the release, else a plugin module.

        Raises:
            OverlayError: a plugin module that is not in the plugin's files.
        """
        if name == "vllm" or name.startswith("vllm."):
            return self._light().module(name)
        return self.import_plugin(name)

    def _light(self) -> LightRelease:
        if self.release is None:
            raise OverlayError(f"{self.label} is loaded without a vLLM release")
        return self.release

    def import_plugin(self, name: str) -> types.ModuleType:
        """Import a plugin module (running it, and any patching its import does) by its real dotted name.

        Raises:
            OverlayError: the module is not in the plugin's files, or running it raised.
        """
        top = name.split(".")[0]
        if top not in self.private:
            raise OverlayError(f"{self.label}: {name!r} is not in a plugin package (have {sorted(self.roots)})")
        private = self.private[top] + name[len(top) :]
        try:
            return importlib.import_module(private)
        except Exception as e:
            raise OverlayError(f"{self.label}: importing {name} failed: {type(e).__name__}: {e}") from e

    def add_package(self, top: str, root: Path) -> None:
        """Serve one more plugin package: ``top`` (e.g. ``"myplugin"``) from the folder ``root`` that holds it.

        Raises:
            OverlayError: a package of that name is already served.
        """
        if top in self.roots:
            raise OverlayError(f"{self.label}: package {top!r} is already served from {self.roots[top]}")
        self.roots[top] = Path(root)
        with _lock:
            self.private[top] = f"_kvspec_plugin_{re.sub(r'[^0-9a-zA-Z]', '_', top)}__{next(_counter)}"

    def after_pool_init(self, hook: Callable[[Any], None]) -> None:
        """Run ``hook(pool)`` on every pool the harness builds, right after its constructor."""
        self.pool_hooks.append(hook)

    def use_pool_class(self, factory: PoolFactory) -> None:
        """Build the harness's pools with ``factory(num_gpu_blocks, enable_caching, **kwargs)``."""
        self.pool_factory = factory

    def vllm_release(self) -> VllmRelease:
        """The release as the vLLM adapter drives it: its ``BlockPool`` is the overlay's pool."""
        light = self._light()
        view = _BlockPoolView(self, light)
        return _OverlayRelease(
            light.version, "light", view, light.kv_cache_utils, light.hash_functions(), light.module, self.label
        )

    def new_pool(self, *args: Any, **kwargs: Any) -> Any:
        """A pool built as the harness builds one: the overlay's factory or the release's class, then the hooks."""
        pool = (self.pool_factory or self._light().BlockPool)(*args, **kwargs)
        for hook in self.pool_hooks:
            hook(pool)
        return pool


@dataclass(frozen=True, eq=False)
class _OverlayRelease(VllmRelease):
    """A release whose pool is an overlay's; reports name the plugin."""

    overlay_label: str = ""

    @property
    def label(self) -> str:
        """``kvcached==0.1.6 on vllm==0.30.0 (light)``."""
        return f"{self.overlay_label} (light)"


class _BlockPoolView(types.ModuleType):
    """The release's ``block_pool`` module as the adapter sees it: ``BlockPool`` builds the overlay's pool."""

    def __init__(self, overlay: Overlay, light: LightRelease) -> None:
        super().__init__(light.block_pool.__name__)
        self._block_pool = light.block_pool
        base = overlay.pool_factory or light.BlockPool

        def BlockPool(*args: Any, **kwargs: Any) -> Any:  # noqa: N802 - vLLM's class name
            return overlay.new_pool(*args, **kwargs)

        # the adapter reads the constructor's parameters and the class's optional methods
        BlockPool.__signature__ = inspect.signature(base)  # type: ignore[attr-defined]
        for name in ("evict_blocks", "is_block_writable"):
            method = getattr(base, name, None)
            if callable(method):
                setattr(BlockPool, name, method)
        self.BlockPool = BlockPool

    def __getattr__(self, name: str) -> Any:
        return getattr(self._block_pool, name)


# ---------------------------------------------------------------------------
# loading


def load_overlay(
    version: str,
    roots: Mapping[str, Path],
    *,
    label: str,
    placeholders: Mapping[str, Callable[[Overlay], types.ModuleType]] | None = None,
) -> Overlay:
    """A fresh light-mode copy of a vLLM release, ready to load plugin packages from their folders.

    Args:
        version: The vLLM release, e.g. ``"0.30.0"`` (fetched once, then cached).
        roots: Each plugin top-level package (``"kvcached"``) and the folder holding it.
        label: How reports name the overlay.
        placeholders: Plugin module name -> builder of the module that stands in for it.

    Returns:
        The overlay; nothing of the plugin has run yet.

    Raises:
        kvspec.conformance.targets.vllm.lightmode.LightModeError: the release could not be fetched or loaded.
    """
    release = load_release(version, fresh=True)
    # the real package's __version__; plugins choose their patches by it
    setattr(sys.modules[release.package_name], "__version__", version)  # noqa: B010
    return _install(Overlay(release, label, dict(roots), dict(placeholders or {})))


def load_plugin(
    roots: Mapping[str, Path],
    *,
    label: str,
    placeholders: Mapping[str, Callable[[Overlay], types.ModuleType]] | None = None,
) -> Overlay:
    """A plugin's packages alone, for a plugin whose pool does not build on vLLM's (vllm-mlx).

    Args:
        roots: Each plugin top-level package and the folder holding it.
        label: How reports name it.
        placeholders: Plugin module name -> builder of the module that stands in for it.

    Returns:
        The overlay (``release`` None); nothing of the plugin has run yet.
    """
    return _install(Overlay(None, label, dict(roots), dict(placeholders or {})))


def _install(overlay: Overlay) -> Overlay:
    """Give the overlay's plugin packages private names and serve them."""
    roots, overlay.roots = overlay.roots, {}
    for top, root in roots.items():
        overlay.add_package(top, root)
    sys.meta_path.insert(0, _PluginFinder(overlay))
    return overlay


def _plugin_rename(overlay: Overlay) -> Callable[[str], str]:
    """How plugin code's imports are mapped: ``vllm`` to the release, plugin packages to their private names."""
    release = overlay.release.package_name if overlay.release is not None else None

    def rename(name: str) -> str:
        top, dot, rest = name.partition(".")
        if top == "vllm" and release is not None:
            return release + dot + rest
        private = overlay.private.get(top)  # read at each import: packages may be added later
        return private + dot + rest if private is not None else name

    return rename


class _PluginFinder(PrivateFinder):
    """Serves an overlay's private plugin packages: source modules, empty packages, placeholders."""

    def __init__(self, overlay: Overlay) -> None:
        why = f"left out of the overlay {overlay.label}"
        super().__init__(redirecting_builtins(_plugin_rename(overlay), refused=DEVICE_RUNTIMES, refused_why=why))
        self.overlay = overlay

    def real_name(self, fullname: str) -> str | None:
        head, dot, rest = fullname.partition(".")
        if not head.startswith("_kvspec_plugin_"):
            return None
        top = next((t for t, private in self.overlay.private.items() if private == head), None)
        return None if top is None else top + dot + rest

    def locate(self, real: str) -> tuple[Path | None, bool, Path | None]:
        """A placeholder or an empty package runs no file; a package's ``__init__`` never runs."""
        top = real.split(".")[0]
        tree = SourceTree(self.overlay.roots[top], top)
        if real in self.overlay.placeholders:
            return None, False, None
        source = tree.module_file(real)
        if source is not None:
            return source, False, None
        folder = tree.package_dir(real)
        if folder is not None:
            return None, True, folder
        raise ModuleNotFoundError(f"{self.overlay.label}: no module {real!r} in the plugin's files")

    def new_module(self, real: str, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        builder = self.overlay.placeholders.get(real)
        return builder(self.overlay) if builder is not None else None

    def register(self, real: str, module: types.ModuleType) -> None:
        self.overlay.plugin_modules[real] = module
