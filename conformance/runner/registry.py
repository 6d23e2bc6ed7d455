"""The factory registry: from an implementation's name to the factory that builds its adapters.

Targets register themselves, the way pytest finds its plugins: every
distribution may declare entry points in the ``kvspec.targets`` group, each
naming a `Target` (kvspec's own are in ``kvspec.conformance.targets.catalog``,
declared in its pyproject.toml). The registry holds no list: a third-party
pool ships its own target and ``kvspec check --impl <its name>`` finds it.

A name is a target's ("reference"; "vllm@0.24.0" for a target with forms;
"overlay:vllm@X+module:function" for one with a prefix), or for anyone else's
code "module:function" (the module imported as usual, the current folder last
on the path) or "path/to/file.py:function" (the file loaded as Python runs a
script: its folder first on the path, so it imports the modules beside it by
name). The function is what follows the last colon. `load_factory` turns a
name into a factory, or says in one line why it cannot; `factory_name` goes
the other way, for the replay hint of a factory passed as an object.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.metadata
import importlib.util
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from kvspec.conformance.core.adapter import AdapterConfig
from kvspec.conformance.core.watch import IMPLEMENTATION_FAULTS, StepTimeout, command_kept, raise_if_ctrl_c, said

__all__ = [
    "TARGET_GROUP",
    "Factory",
    "FactoryError",
    "Target",
    "default_targets",
    "factory_name",
    "find_target",
    "known_targets",
    "load_factory",
    "target_names",
]

Factory = Callable[[AdapterConfig], object]

# The entry-point group targets register in (pyproject.toml: [project.entry-points."kvspec.targets"]).
TARGET_GROUP = "kvspec.targets"


class FactoryError(ValueError):
    """An implementation name that cannot be turned into a factory: unknown, not importable, not callable."""


@dataclass(frozen=True, kw_only=True)
class Target:
    """An implementation kvspec checks by name, registered through a ``kvspec.targets`` entry point.

    A plain target has one factory; a target with forms (``vllm@0.24.0``,
    ``kvcached@0.30.0``) or a prefix (``overlay:...``) resolves the whole name
    to a factory. Nothing is imported until the target is checked: the entry
    point loads this record, and the record names its code by "module:function".

    >>> t = Target(name="mine", summary="my pool", factory="mypool:make_adapter")
    >>> t.accepts("mine"), t.accepts("mine@1.0"), t.accepts("minefield")
    (True, False, False)
    >>> Target(name="theirs", summary="", resolve="theirs:factory_for").accepts("theirs@1.0")
    True
    """

    name: str  # what --impl takes
    summary: str  # one line, for --help and the docs
    factory: str = ""  # "module:function": the factory the plain name stands for
    resolve: str = ""  # "module:function" taking its other names ("name@...", a prefixed one) to their factory
    forms: tuple[str, ...] = ()  # the names it takes, as help shows them ("vllm", "vllm@X.Y.Z"); () : its plain name
    prefix: str = ""  # a name starting with this is the target's, whole (resolved by `resolve`)
    default_order: int | None = None  # checked by `kvspec check` without --impl, smallest first; None: only when named
    unavailable: str = ""  # set by the registry for an entry point that does not load: why, in one line

    def accepts(self, name: str) -> bool:
        """Whether ``name`` is this target's: its plain name, one of its forms, or a name with its prefix."""
        if name == self.name:
            return bool(self.factory or self.resolve)
        if self.resolve and name.startswith(self.name + "@"):
            return True
        return bool(self.prefix) and name.startswith(self.prefix)


@functools.cache
def known_targets() -> tuple[Target, ...]:
    """Every target the installed distributions register, by name (read once per process)."""
    found: dict[str, Target] = {}
    for entry in importlib.metadata.entry_points(group=TARGET_GROUP):
        if entry.name in found:
            continue  # the first distribution to claim a name keeps it
        found[entry.name] = _load_target(entry)
    return tuple(found[name] for name in sorted(found))


def _load_target(entry: importlib.metadata.EntryPoint) -> Target:
    """The `Target` an entry point names, or a target that explains, when named, why it cannot be loaded."""
    owner = entry.dist.name if entry.dist is not None else "an installed distribution"
    try:
        target = entry.load()
    except IMPLEMENTATION_FAULTS as e:  # a third party's module can fail any way its top level can
        raise_if_ctrl_c(e)
        why = f"entry point {entry.value} of {owner} does not load ({type(e).__name__}: {said(e)})"
        return _broken(entry.name, why)
    if not isinstance(target, Target):
        return _broken(entry.name, f"entry point {entry.value} of {owner} is a {type(target).__name__}, not a Target")
    if target.name != entry.name:
        return _broken(entry.name, f"entry point {entry.name!r} of {owner} names a target called {target.name!r}")
    return target


def _broken(name: str, why: str) -> Target:
    """A target whose every name resolves to a one-line `FactoryError` saying why."""
    return Target(name=name, summary=why, resolve="-", unavailable=why)


def find_target(name: str) -> Target | None:
    """The registered target that accepts ``name``, or None (a "module:function" name, or a typo)."""
    for target in known_targets():
        if target.accepts(name):
            return target
    return None


def target_names() -> str:
    """The registered names and forms, for help texts: "gpu, kvcached, kvcached@X, overlay:vllm@X+module:function"."""
    return ", ".join(name for target in known_targets() for name in (target.forms or (target.name,)))


def default_targets() -> tuple[Target, ...]:
    """The targets `kvspec check` checks when it is given no --impl, in their declared order."""
    chosen = [t for t in known_targets() if t.default_order is not None]
    return tuple(sorted(chosen, key=lambda t: (t.default_order, t.name)))


# Modules that moved, old prefix -> new: traces record a factory as "module:function", and a trace
# saved before a move still replays. The mutant set left the tests package for kvspec.mutants; the
# harness went into layers (core, runner, targets, tools).
MOVED_MODULES: dict[str, str] = {
    "kvspec.tests.mutants.": "kvspec.mutants.",
    "kvspec.conformance.adapter:": "kvspec.conformance.core.adapter:",
    "kvspec.conformance.branches:": "kvspec.conformance.core.branches:",
    "kvspec.conformance.builtin:": "kvspec.conformance.targets.builtin:",
    "kvspec.conformance.campaign:": "kvspec.conformance.runner.campaign:",
    "kvspec.conformance.cli:": "kvspec.conformance.tools.cli:",
    "kvspec.conformance.contracts:": "kvspec.conformance.tools.contracts:",
    "kvspec.conformance.coverage:": "kvspec.conformance.core.coverage:",
    "kvspec.conformance.error_contract:": "kvspec.conformance.core.error_contract:",
    "kvspec.conformance.groups_demo:": "kvspec.conformance.tools.groups_demo:",
    "kvspec.conformance.hash_names:": "kvspec.conformance.core.hash_names:",
    "kvspec.conformance.isolation:": "kvspec.conformance.runner.isolation:",
    "kvspec.conformance.jobs:": "kvspec.conformance.runner.jobs:",
    "kvspec.conformance.kv_events:": "kvspec.conformance.core.kv_events:",
    "kvspec.conformance.kv_source:": "kvspec.conformance.core.kv_source:",
    "kvspec.conformance.lockstep:": "kvspec.conformance.core.lockstep:",
    "kvspec.conformance.machine:": "kvspec.conformance.core.machine:",
    "kvspec.conformance.minimize:": "kvspec.conformance.runner.minimize:",
    "kvspec.conformance.mutants:": "kvspec.conformance.tools.mutants:",
    "kvspec.conformance.operations:": "kvspec.conformance.core.operations:",
    "kvspec.conformance.plugins.adapters:": "kvspec.conformance.targets.plugins.adapters:",
    "kvspec.conformance.plugins.dist:": "kvspec.conformance.targets.plugins.dist:",
    "kvspec.conformance.plugins.findings:": "kvspec.conformance.targets.plugins.findings:",
    "kvspec.conformance.plugins.kvcached:": "kvspec.conformance.targets.plugins.kvcached:",
    "kvspec.conformance.plugins.kvcached_device:": "kvspec.conformance.targets.plugins.kvcached_device:",
    "kvspec.conformance.plugins.matrix:": "kvspec.conformance.tools.plugin_matrix:",
    "kvspec.conformance.plugins.overlay:": "kvspec.conformance.targets.plugins.overlay:",
    "kvspec.conformance.plugins.probes:": "kvspec.conformance.targets.plugins.probes:",
    "kvspec.conformance.plugins.targets:": "kvspec.conformance.targets.plugins.targets:",
    "kvspec.conformance.plugins.tpu_inference:": "kvspec.conformance.targets.plugins.tpu_inference:",
    "kvspec.conformance.plugins.vllm_ascend:": "kvspec.conformance.targets.plugins.vllm_ascend:",
    "kvspec.conformance.plugins.vllm_mlx:": "kvspec.conformance.targets.plugins.vllm_mlx:",
    "kvspec.conformance.reactions:": "kvspec.conformance.core.reactions:",
    "kvspec.conformance.registry:": "kvspec.conformance.runner.registry:",
    "kvspec.conformance.replaying:": "kvspec.conformance.runner.replaying:",
    "kvspec.conformance.report:": "kvspec.conformance.core.report:",
    "kvspec.conformance.results:": "kvspec.conformance.core.results:",
    "kvspec.conformance.router_mirror:": "kvspec.conformance.tools.router_mirror:",
    "kvspec.conformance.runner:": "kvspec.conformance.runner.run:",
    "kvspec.conformance.simulate:": "kvspec.conformance.tools.simulate:",
    "kvspec.conformance.strategies:": "kvspec.conformance.core.strategies:",
    "kvspec.conformance.survey:": "kvspec.conformance.runner.survey:",
    "kvspec.conformance.trace:": "kvspec.conformance.core.trace:",
    "kvspec.conformance.vllm.adapter:": "kvspec.conformance.targets.vllm.adapter:",
    # the factories left vLLM's pool adapter for a module of their own
    "kvspec.conformance.vllm.adapter:make_adapter": "kvspec.conformance.targets.vllm.factories:make_adapter",
    "kvspec.conformance.vllm.adapter:make_installed_adapter": (
        "kvspec.conformance.targets.vllm.factories:make_installed_adapter"
    ),
    "kvspec.conformance.vllm.events:": "kvspec.conformance.targets.vllm.events:",
    "kvspec.conformance.vllm.hashes:": "kvspec.conformance.targets.vllm.hashes:",
    "kvspec.conformance.vllm.lightmode:": "kvspec.conformance.targets.vllm.lightmode:",
    "kvspec.conformance.vllm.manager:": "kvspec.conformance.targets.vllm.manager:",
    "kvspec.conformance.vllm.oracle:": "kvspec.conformance.tools.oracle:",
    "kvspec.conformance.vllm.reactions:": "kvspec.conformance.targets.vllm.reactions:",
    "kvspec.conformance.vllm.releases:": "kvspec.conformance.targets.vllm.releases:",
    "kvspec.conformance.vllm.v0:": "kvspec.conformance.targets.vllm.v0:",
    "kvspec.conformance.walkthrough:": "kvspec.conformance.tools.walkthrough:",
    "kvspec.conformance.watch:": "kvspec.conformance.core.watch:",
    "kvspec.conformance.workloads:": "kvspec.conformance.tools.workloads:",
}


def load_factory(name: str, timeout_s: float | None = None, folder: Path | None = None) -> Factory:
    """The factory a name stands for: a registered target's name ("reference", "vllm@0.24.0",
    "overlay:..."), "module:function" or "path/to/file.py:function".

    The module's top level runs in this process; what the command needs of the process is kept through it
    (`watch.command_kept`), so an import that closes stdout or lowers the recursion limit takes no verdict away.

    Args:
        name: what the user named.
        timeout_s: the most loading may take (a module's top level runs as it is imported: one that never
            ends would hang the command before any campaign's time limit is in force); None: no limit.
        folder: what a relative file in ``name`` is relative to, and the folder searched last for a module (a
            run's `RunConfig.folder`: an import's os.chdir moves no name loaded after it); None: the current one.

    Raises:
        FactoryError: the name is malformed, the target or module does not load (or not within
            ``timeout_s``), the attribute is missing, or it is not callable; the message says which.
    """
    with _loading_within(name, timeout_s), command_kept():
        return _factory(name, Path.cwd() if folder is None else folder)


@contextlib.contextmanager
def _loading_within(name: str, timeout_s: float | None) -> Iterator[None]:
    """Raise FactoryError where the block runs past ``timeout_s``: SIGALRM, so only a top level that runs
    Python is stopped (one stuck in C is not), and only in the main thread, where signals are delivered."""
    if timeout_s is None or threading.current_thread() is not threading.main_thread():
        yield
        return

    def past_the_limit(signum: int, frame: object) -> None:
        raise StepTimeout  # let through by every loader's handler (raise_if_ctrl_c), caught below

    old = signal.signal(signal.SIGALRM, past_the_limit)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        yield
    except StepTimeout:
        why = f"loading it took more than {timeout_s:g} s (--build-timeout): a module that never finishes loading?"
        raise FactoryError(f"implementation {name!r}: {why}") from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _factory(name: str, folder: Path) -> Factory:
    """`load_factory`'s work, without its time limit."""
    target = find_target(name)
    if target is not None:
        return _target_factory(target, name, folder)
    where = name
    for old in sorted(MOVED_MODULES, key=len, reverse=True):  # a function's own move before its module's
        if name.startswith(old):
            where = MOVED_MODULES[old] + name[len(old) :]
            break
    if ":" not in where:
        raise FactoryError(
            f"implementation {name!r} is neither a registered target ({target_names()}) "
            "nor module:function or file.py:function"
        )
    return _load_callable(name, where, folder)


def _target_factory(target: Target, name: str, folder: Path) -> Factory:
    """A registered target's factory for ``name``, which it accepts."""
    if target.unavailable:
        raise FactoryError(f"implementation {name!r}: {target.unavailable}")
    if name == target.name and target.factory:
        return _load_callable(name, target.factory, folder)
    resolve = _load_callable(name, target.resolve, folder)
    try:
        factory: Factory = resolve(name)
    except ValueError as e:  # the target's own refusal of the name, in its words
        raise FactoryError(f"implementation {name!r}: {said(e)}") from None
    except IMPLEMENTATION_FAULTS as e:  # resolving loads code (a vLLM source tree): it can fail any way, exit too
        raise_if_ctrl_c(e)
        raise FactoryError(f"implementation {name!r} does not load ({type(e).__name__}: {said(e)})") from None
    return factory


def _load_callable(name: str, where: str, folder: Path) -> Callable[..., Any]:
    """The callable "module:function" or "path/file.py:function" names (``name`` is what the user gave)."""
    # The last colon: a path may hold one (C:\\pool.py:factory), a function name never does.
    module_name, _, attr = where.rpartition(":")
    if not module_name or not attr:
        raise FactoryError(f"implementation {name!r}: expected module:function, got {where!r}")
    is_path = _is_path(module_name)
    obj: Any = _load_file(name, module_name, folder) if is_path else _import_module(name, module_name, folder)
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise FactoryError(f"implementation {name!r}: {module_name} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise FactoryError(f"implementation {name!r}: {where} is a {type(obj).__name__}, not a callable factory")
    found: Callable[..., Any] = obj
    return found


def _is_path(module_name: str) -> bool:
    """Whether the part before the colon names a file rather than a module."""
    return module_name.endswith(".py") or "/" in module_name or os.sep in module_name


def _import_module(name: str, module_name: str, folder: Path) -> ModuleType:
    """A module by name; `folder` (the current one) is searched last, so `kvspec check --impl pool:factory`
    finds ./pool.py without shadowing an installed module of the same name."""
    cwd = str(folder)
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)
    try:
        return importlib.import_module(module_name)
    except IMPLEMENTATION_FAULTS as e:  # an import can fail any way the module's top level can, exit too
        raise_if_ctrl_c(e)
        raise FactoryError(
            f"implementation {name!r}: module {module_name} does not import ({type(e).__name__}: {said(e)})"
        ) from None


def _load_file(name: str, path_text: str, folder: Path) -> ModuleType:
    """A Python file, loaded as `python path` would run it: named after its stem, its folder first on the path;
    a relative path is relative to `folder`."""
    path = (folder / path_text).resolve()
    if not path.is_file():  # a FIFO or a device is refused here too: importing one could wait for ever
        what = f"{path_text} is not a regular file" if path.exists() else f"no such file {path_text}"
        raise FactoryError(f"implementation {name!r}: {what}")
    module_name = path.stem
    loaded = sys.modules.get(module_name)
    if loaded is not None and getattr(loaded, "__file__", None) and Path(loaded.__file__ or "").resolve() == path:
        return loaded  # already loaded (a module beside it imported it by name)
    if loaded is not None:
        module_name = f"_kvspec_impl_{module_name}"  # another module holds the name: load this one privately
    beside = str(path.parent)
    if beside not in sys.path:
        sys.path.insert(0, beside)
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise FactoryError(f"implementation {name!r}: {path_text} cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # before it runs: dataclasses and pickling look their module up there
    try:
        spec.loader.exec_module(module)
    except IMPLEMENTATION_FAULTS as e:  # the file's top level can fail any way, exit too
        raise_if_ctrl_c(e)
        del sys.modules[module_name]
        why = f"{path_text} does not import ({type(e).__name__}: {said(e)})"
        raise FactoryError(f"implementation {name!r}: {why}") from None
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
    for registered in known_targets():
        if registered.factory == target:
            return registered.name
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
