"""Running a package's modules from files on disk under a private name, without installing it.

Light mode (kvspec.conformance.targets.vllm.lightmode) runs a vLLM release's
pool modules this way, and the overlay (kvspec.conformance.targets.plugins.overlay)
runs a plugin's modules on top of them. Both need the same four things, and
this module is the one place that has them:

- a `SourceTree`: where a package's files are, a folder holding the package
  under some name (``<root>/vllm/...`` extracted from a wheel; a vLLM checkout
  or a fork whose package is called something else is one more tree, not a
  third loader);
- a `PrivateFinder`: a meta-path finder serving one or more private
  top-level names (``_kvspec_vllm_0_33_0``, ``_kvspec_plugin_kvcached__3``)
  from such trees; what each module is (a source file run whole, a partial
  module, an empty package, a stand-in) is the subclass's to say;
- `redirecting_builtins`: the ``__builtins__`` of every module run this way,
  whose ``__import__`` maps real names (``vllm``) to the private ones, also
  for imports that run lazily inside functions, and whose ``importlib`` maps
  ``import_module`` the same way;
- placeholders (`placeholder`, `PlaceholderModule`): for heavy code the
  loaded modules import but never run on the paths the harness drives,
  any attribute is a fresh, subclassable, callable stand-in, each one handed
  out recorded so a check can assert that no observed path leaned on one;
- device runtimes (`DEVICE_RUNTIMES`: torch, triton, jax, ...): a loader
  either refuses them (``import torch`` raises ImportError, as on a machine
  without one) or stands them in (`DeviceRuntimeModule`: a module imports
  and names its types, but calling anything of the runtime raises
  `HarnessLimit`, so a pool path that needs the device ends in kvspec's
  "cannot run this", never in a verdict on the implementation);
  and `exec_definitions`, which runs only the named top-level definitions of
  a heavy module (and what they use) as written.

The rejected alternative was a rewrite of the loaded sources (``vllm.`` to the
private name): line numbers and tracebacks would no longer match the
release's files, and imports built at run time would escape it.
"""

from __future__ import annotations
import __future__

import abc
import ast
import builtins
import importlib
import importlib.abc
import importlib.machinery
import types
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvspec.conformance.core.adapter import HarnessLimit

__all__ = [
    "DEVICE_RUNTIMES",
    "DeviceRuntimeModule",
    "PlaceholderModule",
    "PrivateFinder",
    "SourceTree",
    "exec_definitions",
    "is_placeholder",
    "placeholder",
    "redirecting_builtins",
]

# Top-level modules of device runtimes: what no loaded pool module may need to run on the CPU.
DEVICE_RUNTIMES: frozenset[str] = frozenset({"torch", "torch_npu", "jax", "jaxlib", "mlx", "triton", "libtpu"})


@dataclass(frozen=True, slots=True)
class SourceTree:
    """A package's files in a folder, named by the name the code imports it as.

    Attributes:
        root: The folder that holds the package's folder.
        name: The name the loaded code imports the package as (``"vllm"``).
        folder: The package's folder name under ``root``, where it differs from
            ``name`` (a fork shipped as ``vllm_fork`` but imported as ``vllm``).
    """

    root: Path
    name: str
    folder: str = ""

    def _base(self, dotted: str) -> Path:
        top, _, rest = dotted.partition(".")
        assert top == self.name, f"module={dotted!r} is not in package={self.name!r}"
        parts = [self.folder or self.name, *(rest.split(".") if rest else [])]
        return self.root.joinpath(*parts)

    def module_file(self, dotted: str) -> Path | None:
        """The module's own file (``<package>/a/b.py``), or None."""
        path = self._base(dotted).with_suffix(".py")
        return path if path.is_file() else None

    def package_dir(self, dotted: str) -> Path | None:
        """The package's folder (``<package>/a/b/``), or None."""
        path = self._base(dotted)
        return path if path.is_dir() else None

    def init_file(self, dotted: str) -> Path | None:
        """The package's ``__init__.py``, or None."""
        path = self._base(dotted) / "__init__.py"
        return path if path.is_file() else None


# ---------------------------------------------------------------------------
# imports inside loaded code


class _ImportlibShim(types.ModuleType):
    """``importlib`` inside loaded code: ``import_module`` maps names as ``import`` does there."""

    def __init__(self, rename: Callable[[str], str]) -> None:
        super().__init__("importlib")
        self._rename = rename

    def import_module(self, name: str, package: str | None = None) -> types.ModuleType:
        """``importlib.import_module`` with real names mapped to the private ones."""
        return importlib.import_module(self._rename(name), package)

    def __getattr__(self, name: str) -> Any:
        return getattr(importlib, name)


def redirecting_builtins(
    rename: Callable[[str], str],
    *,
    refused: Collection[str] = (),
    refused_why: str = "",
    stand_in: Callable[[str], types.ModuleType] | None = None,
) -> dict[str, Any]:
    """A ``__builtins__`` for loaded code whose absolute imports go through ``rename``.

    Args:
        rename: Maps an absolute module name (``"vllm.envs"``) to the one to import.
        refused: Top-level modules the loaded code cannot import (device runtimes): ImportError, as
            on a machine without them.
        refused_why: Ends the ImportError's message (``"left out of the overlay X"``).
        stand_in: Where given, a device runtime (`DEVICE_RUNTIMES`) is not imported: ``stand_in(name)``
            is the module of that dotted name (a `DeviceRuntimeModule`).

    Returns:
        A copy of the builtins whose ``__import__`` maps names and whose ``importlib``
        (when imported without a from-list) maps ``import_module`` the same way.
    """
    real_import = builtins.__import__
    shim = _ImportlibShim(rename)

    def redirected_import(
        name: str,
        globals: Mapping[str, Any] | None = None,
        locals: Mapping[str, Any] | None = None,
        fromlist: Sequence[str] | None = (),
        level: int = 0,
    ) -> types.ModuleType:
        if level == 0 and (name == "importlib" or name.startswith("importlib.")):
            found = real_import(name, globals, locals, fromlist or (), level)
            return found if fromlist else shim
        top = name.partition(".")[0]
        if level == 0 and top in refused:
            raise ImportError(f"{name} is a device runtime, {refused_why}")
        if level == 0 and stand_in is not None and top in DEVICE_RUNTIMES:
            # ``import torch.cuda`` binds ``torch``; ``from torch.cuda import x`` reads x off ``torch.cuda``.
            return stand_in(name if fromlist else top)
        if level == 0:
            name = rename(name)
        return real_import(name, globals, locals, fromlist or (), level)

    table = dict(builtins.__dict__)
    table["__import__"] = redirected_import
    return table


class PrivateFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves modules under private top-level names from source trees.

    A subclass says which names are its own (`real_name`), where each module's
    file is (`locate`), what module object stands for it (`new_module`) and
    how it runs (`execute`); this class does the import system's part.
    """

    def __init__(self, builtins_table: dict[str, Any]) -> None:
        self.builtins = builtins_table  # the __builtins__ of every module run from source

    @abc.abstractmethod
    def real_name(self, fullname: str) -> str | None:
        """The module's real dotted name, or None for a name that is not this finder's."""

    @abc.abstractmethod
    def locate(self, real: str) -> tuple[Path | None, bool, Path | None]:
        """(the file to run or None, whether it is a package, the package's folder for its submodules)."""

    def new_module(self, real: str, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        """The module object (None: the import system's default)."""
        return None

    def register(self, real: str, module: types.ModuleType) -> None:
        """Record a module before it runs (its own imports may ask for it back)."""

    def execute(self, real: str, module: types.ModuleType, path: Path | None) -> None:
        """Run the module: its whole source, when it has one."""
        if path is not None:
            self.run_source(module, path)

    def run_source(self, module: types.ModuleType, path: Path) -> None:
        """Run a file's source, unmodified, as the module's body."""
        module.__dict__["__builtins__"] = self.builtins
        exec(compile(path.read_text(encoding="utf-8"), str(path), "exec"), module.__dict__)

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None = None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        real = self.real_name(fullname)
        if real is None:
            return None
        source, is_package, folder = self.locate(real)
        spec = importlib.machinery.ModuleSpec(
            fullname, self, origin=str(source) if source else None, is_package=is_package
        )
        spec.has_location = source is not None
        if folder is not None:
            spec.submodule_search_locations = [str(folder)]
        return spec

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        real = self.real_name(spec.name)
        assert real is not None, f"spec.name={spec.name!r} is not this finder's"
        return self.new_module(real, spec)

    def exec_module(self, module: types.ModuleType) -> None:
        spec = module.__spec__
        assert spec is not None, f"module={module.__name__!r} has no spec"
        real = self.real_name(spec.name)
        assert real is not None, f"spec.name={spec.name!r} is not this finder's"
        self.register(real, module)
        self.execute(real, module, Path(spec.origin) if spec.origin is not None else None)


# ---------------------------------------------------------------------------
# placeholders


class _PlaceholderMeta(type):
    """Metaclass of placeholder classes: any attribute is another placeholder."""

    _kvspec_path: str
    _kvspec_used: set[str] | None

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return placeholder(f"{cls._kvspec_path}.{name}", cls._kvspec_used)

    def __getitem__(cls, item: Any) -> Any:
        return cls

    def __repr__(cls) -> str:
        return f"<light-mode placeholder {cls._kvspec_path}>"


class _PlaceholderBase(metaclass=_PlaceholderMeta):
    _kvspec_path = "?"
    _kvspec_used = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return placeholder(f"{type(self)._kvspec_path}().{name}", type(self)._kvspec_used)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self


def placeholder(path: str, used: set[str] | None) -> type:
    """A stand-in class for ``path``: subclassable, callable, any attribute another stand-in.

    Args:
        path: What it stands for, e.g. ``"vllm.config:VllmConfig"``.
        used: Records ``path`` (and every stand-in reached from this one); None records nothing.

    Returns:
        The stand-in.
    """
    if used is not None:
        used.add(path)
    return _PlaceholderMeta(path.rsplit(".", 1)[-1], (_PlaceholderBase,), {"_kvspec_path": path, "_kvspec_used": used})


def is_placeholder(value: object) -> bool:
    """Whether ``value`` is a stand-in handed out by `placeholder`."""
    return isinstance(value, _PlaceholderMeta)


class PlaceholderModule(types.ModuleType):
    """A stand-in for a heavy module; also a package for submodules that do run."""

    def __init__(
        self, name: str, real: str, used: set[str], submodule: Callable[[str], types.ModuleType | None]
    ) -> None:
        """A stand-in module.

        Args:
            name: The module's private name.
            real: Its real name, e.g. ``"vllm.config"``.
            used: Where the stand-ins it hands out are recorded.
            submodule: Returns the real submodule of that (real) name when one runs, else None.
        """
        super().__init__(name)
        self._kvspec_real = real
        self._kvspec_used = used
        self._kvspec_submodule = submodule

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        found = self._kvspec_submodule(f"{self._kvspec_real}.{name}")
        if found is not None:
            return found
        value = placeholder(f"{self._kvspec_real}:{name}", self._kvspec_used)
        setattr(self, name, value)
        return value


class _DeviceStandInMeta(_PlaceholderMeta):
    """A device runtime's name: a type or value to name, never to run."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _device_stand_in(f"{cls._kvspec_path}.{name}", cls._kvspec_used)

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        raise HarnessLimit(
            f"{cls._kvspec_path}() was called: {cls._kvspec_path.partition('.')[0]} is a device runtime, "
            "which kvspec stands in and does not run (check a build that has it installed: --impl vllm)"
        )

    def __repr__(cls) -> str:
        return f"<device runtime stand-in {cls._kvspec_path}>"


def _device_stand_in(path: str, used: set[str] | None) -> type:
    if used is not None:
        used.add(path)
    namespace = {"_kvspec_path": path, "_kvspec_used": used}
    return _DeviceStandInMeta(path.rsplit(".", 1)[-1], (_PlaceholderBase,), namespace)


class DeviceRuntimeModule(types.ModuleType):
    """A device runtime (``torch``, ``triton``, ...) as loaded code sees it where the loader stands it in.

    Why a stand-in keeps the pool's observable behaviour: a pool module that
    imports torch at module level to annotate with ``torch.Tensor``, to test
    ``isinstance(x, torch.Tensor)`` (False: nothing here is a tensor) or to
    hold a dtype does the same with this module as with torch. Anything that
    would *run* device code (calling any of its names: ``torch.zeros``,
    ``torch.cuda.is_available()``) raises `HarnessLimit` instead of guessing
    an answer, so such a path reports kvspec's limit, not the implementation.
    Every name handed out is recorded in ``used`` (``"torch.cuda.is_available"``).
    """

    def __init__(self, name: str, used: set[str]) -> None:
        super().__init__(name)
        self._kvspec_used = used

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        value = _device_stand_in(f"{self.__name__}.{name}", self._kvspec_used)
        setattr(self, name, value)
        return value


# ---------------------------------------------------------------------------
# running part of a module


def _defined_names(node: ast.stmt) -> set[str]:
    """The top-level names a statement binds (a ``try: import xxhash`` guard binds what it imports)."""
    names: set[str] = set()
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        names.add(node.name)
    elif isinstance(node, ast.Assign | ast.AnnAssign):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        names |= {t.id for t in targets if isinstance(t, ast.Name)}
    elif isinstance(node, ast.Import | ast.ImportFrom):
        names |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
    elif isinstance(node, ast.Try):
        for sub in ast.walk(node):
            if isinstance(sub, ast.Import | ast.ImportFrom):
                names |= {(a.asname or a.name).split(".")[0] for a in sub.names}
            elif isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store):
                names.add(sub.id)
    return names


def _chosen_statements(tree: ast.Module, wanted: Iterable[str]) -> list[int]:
    """The indices of the top-level statements that define ``wanted``, and what they use, transitively."""
    defines: dict[str, list[int]] = {}
    uses: dict[int, set[str]] = {}
    for index, node in enumerate(tree.body):
        for name in _defined_names(node):
            defines.setdefault(name, []).append(index)
        uses[index] = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
    chosen: set[int] = set()
    todo = [n for n in wanted if n in defines]
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for index in defines.get(name, []):
            if index not in chosen:
                chosen.add(index)
                todo += [n for n in uses[index] if n in defines]
    return sorted(chosen)


def exec_definitions(
    module: types.ModuleType, path: Path, wanted: Iterable[str], builtins_table: dict[str, Any]
) -> None:
    """Run only the top-level statements of ``path`` that define ``wanted`` (and what they use), in order.

    Args:
        module: The module to run them in (a `PlaceholderModule`: the rest of it stays stand-ins).
        path: The module's source file.
        wanted: The top-level names to define.
        builtins_table: The ``__builtins__`` to run them with.
    """
    module.__dict__["__builtins__"] = builtins_table
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    for index in _chosen_statements(tree, wanted):
        # annotations stay unevaluated: they name heavy types (torch.Tensor)
        # that a partial module does not define
        code = compile(
            ast.Module(body=[tree.body[index]], type_ignores=[]),
            str(path),
            "exec",
            flags=__future__.annotations.compiler_flag,
            dont_inherit=True,
        )
        try:
            exec(code, module.__dict__)
        except ImportError:
            # a heavy import next to a wanted definition (torch, numpy):
            # leave its names to the placeholder fallback
            continue
