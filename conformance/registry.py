"""The factory registry: from an implementation's name to the factory that builds its adapters.

A name is a built-in implementation ("reference", "spec", "gpu", "vllm"), a
vLLM release ("vllm@0.24.0": that release's own pool, loaded from its wheel),
a plugin target, or for anyone else's "module:function" (the module imported
as usual, the current folder last on the path) or "path/to/file.py:function"
(the file loaded as Python runs a script: its folder first on the path, so
it imports the modules beside it by name). The function is what follows the
last colon. `load_factory` turns a name into a factory, or says in one line
why it cannot; `factory_name` goes the other way, for the replay hint of a
factory passed as an object.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from kvspec.conformance.adapter import AdapterConfig

__all__ = [
    "BUILTIN_IMPLS",
    "DEFAULT_IMPLS",
    "PLUGIN_IMPLS",
    "VLLM_RELEASE_PREFIX",
    "Factory",
    "FactoryError",
    "factory_name",
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
# "vllm-v0@0.6.6": that release's v0 prefix-caching allocator and evictor, loaded the same way.
VLLM_V0_RELEASE_PREFIX = "vllm-v0@"


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
    """The factory a name stands for: a built-in name ("reference", ...), "vllm@<release>", a plugin
    target, "module:function" or "path/to/file.py:function".

    Raises:
        FactoryError: the name is malformed, the module or file does not import, the
            attribute is missing, or it is not callable; the message says which.
    """
    if name.startswith((VLLM_RELEASE_PREFIX, VLLM_V0_RELEASE_PREFIX)):
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
        raise FactoryError(
            f"implementation {name!r} is neither a built-in name ({known}) nor module:function or file.py:function"
        )
    # The last colon: a path may hold one (C:\pool.py:factory), a function name never does.
    module_name, _, attr = target.rpartition(":")
    if not module_name or not attr:
        raise FactoryError(f"implementation {name!r}: expected module:function, got {target!r}")
    obj: Any = _load_file(name, module_name) if _is_path(module_name) else _import_module(name, module_name)
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise FactoryError(f"implementation {name!r}: {module_name} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise FactoryError(f"implementation {name!r}: {target} is a {type(obj).__name__}, not a callable factory")
    factory: Factory = obj
    return factory


def _is_path(module_name: str) -> bool:
    """Whether the part before the colon names a file rather than a module."""
    return module_name.endswith(".py") or "/" in module_name or os.sep in module_name


def _import_module(name: str, module_name: str) -> ModuleType:
    """A module by name; the current folder is searched last, so `kvspec check --impl pool:factory`
    finds ./pool.py without shadowing an installed module of the same name."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)
    try:
        return importlib.import_module(module_name)
    except Exception as e:  # an import can fail any way the module's top level can
        raise FactoryError(
            f"implementation {name!r}: module {module_name} does not import ({type(e).__name__}: {e})"
        ) from None


def _load_file(name: str, path_text: str) -> ModuleType:
    """A Python file, loaded as `python path` would run it: named after its stem, its folder first on the path."""
    path = Path(path_text).resolve()
    if not path.is_file():
        raise FactoryError(f"implementation {name!r}: no such file {path_text}")
    module_name = path.stem
    loaded = sys.modules.get(module_name)
    if loaded is not None and getattr(loaded, "__file__", None) and Path(loaded.__file__ or "").resolve() == path:
        return loaded  # already loaded (a module beside it imported it by name)
    if loaded is not None:
        module_name = f"_kvspec_impl_{module_name}"  # another module holds the name: load this one privately
    folder = str(path.parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise FactoryError(f"implementation {name!r}: {path_text} cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # before it runs: dataclasses and pickling look their module up there
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # the file's top level can fail any way
        del sys.modules[module_name]
        raise FactoryError(f"implementation {name!r}: {path_text} does not import ({type(e).__name__}: {e})") from None
    return module


def factory_name(factory: object) -> str | None:
    """A name `load_factory` turns back into `factory` in a new process started in the current folder, or None.

    A built-in's name; "path/to/file.py:function" for a function of a top-level module
    (the examples, a test's own adapter: importable only where its folder is on the path),
    relative to the current folder when it lies inside it; "module:function" for one inside a package.
    None for what has no importable name (a lambda, a function defined in another function,
    a plugin target's factory, whose name the caller knows).

    >>> factory_name(load_factory("reference"))
    'reference'
    >>> factory_name(lambda config: None) is None
    True
    """
    module = sys.modules.get(getattr(factory, "__module__", None) or "")
    qualname = getattr(factory, "__qualname__", None)
    if module is None or not isinstance(qualname, str) or "<" in qualname:
        return None
    obj: object = module
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    if obj is not factory:
        return None
    target = f"{module.__name__}:{qualname}"
    for builtin, builtin_target in BUILTIN_IMPLS.items():
        if builtin_target == target:
            return builtin
    file = getattr(module, "__file__", None)
    is_top_level = "." not in module.__name__ and not hasattr(module, "__path__")
    if not (is_top_level and file and file.endswith(".py")):
        return target
    path = Path(file).resolve()
    try:
        shown = str(path.relative_to(Path.cwd().resolve()))
    except ValueError:
        shown = str(path)
    return f"{shown}:{qualname}"
