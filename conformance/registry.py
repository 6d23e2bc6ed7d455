"""The factory registry: from an implementation's name to the factory that builds its adapters.

A name is a built-in implementation ("reference", "spec", "gpu", "vllm"), a
vLLM release ("vllm@0.24.0": that release's own pool, loaded from its wheel),
or "module:function" for anyone else's. `load_factory` turns a name into a
factory, or says in one line why it cannot.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from kvspec.conformance.adapter import AdapterConfig

__all__ = [
    "BUILTIN_IMPLS",
    "DEFAULT_IMPLS",
    "PLUGIN_IMPLS",
    "VLLM_RELEASE_PREFIX",
    "Factory",
    "FactoryError",
    "load_factory",
]

Factory = Callable[[AdapterConfig], object]

# Built-in implementations by name -> "module:function". Others add entries here
# as they land; a name whose module does not import gives a clean could-not-run.
BUILTIN_IMPLS: dict[str, str] = {
    "reference": "kvspec.conformance.builtin:make_reference",
    "spec": "kvspec.conformance.builtin:make_spec",
    "gpu": "kvspec.gpu_impl.adapter:make_adapter",
    "vllm": "kvspec.conformance.vllm.adapter:make_adapter",
}
# What `kvspec check` runs without --impl (those whose module imports); vllm is
# the regression oracle's business and runs only when named.
DEFAULT_IMPLS: tuple[str, ...] = ("reference", "spec", "gpu")


# Modules that moved, old prefix -> new: the mutant set left the tests package for kvspec.mutants.
MOVED_MODULES: dict[str, str] = {"kvspec.tests.mutants.": "kvspec.mutants."}


class FactoryError(ValueError):
    """An implementation name that cannot be turned into a factory: unknown, not importable, not callable."""


# "vllm@0.24.0": that vLLM release's real pool, loaded from its wheel (light mode, fetched on first use).
VLLM_RELEASE_PREFIX = "vllm@"


def _vllm_release_factory(name: str) -> Factory:
    """The factory for `vllm@<release>`; the release itself is fetched and loaded when an adapter is built."""
    try:
        from kvspec.conformance.vllm.adapter import factory_for
    except Exception as e:  # an import can fail any way the module's top level can
        raise FactoryError(
            f"implementation {name!r}: the vLLM adapter does not import ({type(e).__name__}: {e})"
        ) from None
    try:
        factory: Factory = factory_for(name)
    except ValueError as e:
        raise FactoryError(f"implementation {name!r}: {e}") from None
    return factory


# Plugins of vLLM's block manager, loaded from their own distributions
# (kvspec.conformance.plugins.targets): each also as "<name>@<vLLM release>",
# and "overlay:vllm@<release>+module:function" for any plugin that patches vLLM's pool.
PLUGIN_IMPLS: tuple[str, ...] = ("vllm-mlx", "kvcached", "tpu-inference", "vllm-ascend")


def _plugin_factory(name: str) -> Factory:
    """The factory for a plugin target or an overlay; the plugin is fetched and loaded when an adapter is built."""
    try:
        from kvspec.conformance.plugins.targets import factory_for
    except Exception as e:  # an import can fail any way the module's top level can
        why = f"{type(e).__name__}: {e}"
        raise FactoryError(f"implementation {name!r}: the plugin targets do not import ({why})") from None
    try:
        factory: Factory = factory_for(name)
    except ValueError as e:
        raise FactoryError(f"implementation {name!r}: {e}") from None
    return factory


def load_factory(name: str) -> Factory:
    """The factory a name stands for: a built-in name ("reference", ...), "vllm@<release>" or "module:function".

    Raises:
        FactoryError: the name is malformed, the module does not import, the
            attribute is missing, or it is not callable; the message says which.
    """
    if name.startswith(VLLM_RELEASE_PREFIX):
        return _vllm_release_factory(name)
    if name.startswith("overlay:") or name.partition("@")[0] in PLUGIN_IMPLS:
        return _plugin_factory(name)
    target = BUILTIN_IMPLS.get(name, name)
    for old, new in MOVED_MODULES.items():
        # Traces saved before a module moved name it by its old path; they still replay.
        if target.startswith(old):
            target = new + target[len(old) :]
    if ":" not in target:
        known = ", ".join(sorted(BUILTIN_IMPLS))
        raise FactoryError(f"implementation {name!r} is neither a built-in name ({known}) nor module:function")
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise FactoryError(f"implementation {name!r}: expected module:function, got {target!r}")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as e:  # an import can fail any way the module's top level can
        raise FactoryError(
            f"implementation {name!r}: module {module_name} does not import ({type(e).__name__}: {e})"
        ) from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise FactoryError(f"implementation {name!r}: module {module_name} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise FactoryError(f"implementation {name!r}: {target} is a {type(obj).__name__}, not a callable factory")
    factory: Factory = obj
    return factory
