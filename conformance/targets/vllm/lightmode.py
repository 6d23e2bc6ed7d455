"""Light mode: vLLM's real BlockPool from a release wheel, without installing vLLM.

The regression oracle must drive every vLLM release from 0.8.0 on. Installing
each one (torch, transformers, a CUDA toolchain's worth of wheels) costs
minutes and gigabytes per release; the pool itself needs none of that. Light
mode therefore reads a release's wheel as a zip file, keeps the handful of
modules the pool is made of, and executes them unmodified under a private
top-level package name (``_kvspec_vllm_0_33_0`` and so on). Every other
``vllm.*`` module they import is a placeholder. Several releases can be loaded
side by side in one process, next to an installed vLLM, without touching
``sys.modules["vllm"]``.

What is real and what is not:

- whole modules, executed as shipped: ``v1/core/block_pool.py``,
  ``v1/core/kv_cache_utils.py``, ``distributed/kv_events.py``, ``envs.py``,
  ``utils/hashing.py``, ``utils/math_utils.py`` and ``utils/gc_utils.py`` (where
  the release has them), and ``v1/core/kv_cache_metrics.py``;
- selected definitions from heavy modules (``Layout.partial_defs``): the hash helpers
  (``sha256``, ``sha256_cbor``, ...) and ``cdiv`` from ``vllm/utils``,
  ``get_mm_features_in_window`` from ``vllm/multimodal/utils.py`` and
  ``token_slice`` from ``vllm/v1/token_buffer.py``. The
  definitions (and the top-level names they use, transitively) are taken from
  the wheel's source and executed as written; the rest of such a module is a
  placeholder;
- ``vllm.logger.init_logger`` is ``logging.getLogger``;
- everything else (config, platforms, ``Request``, the KV-cache specs, torch
  helpers) is a placeholder: any attribute is a fresh, subclassable, callable
  stand-in. Each one handed out is recorded in ``LightRelease.placeholders_used``
  so a check can assert that no pool path leaned on one;
- a device runtime (``torch``, ``triton``, ...) that loaded code imports is a
  stand-in (kvspec.conformance.targets.loader.DeviceRuntimeModule): its names
  can be read (annotations, ``isinstance``, a dtype) but calling one raises
  ``HarnessLimit``, kvspec's "cannot run this", never a verdict. No release's
  pool modules import one; a fork's may, at module level.

A source tree (`load_tree`) is one more folder: a checkout holding ``vllm/``,
or a fork whose package has its own name (``myfork/v1/core/block_pool.py``
importing ``myfork.*``), loaded with that name as an alias of ``vllm``.

Which modules are real is a ``Layout``: ``V1`` is the list above; ``V0`` is
vLLM v0's prefix-caching allocator (``core/block/prefix_caching_block.py``,
``naive_block.py``, ``common.py``, ``interfaces.py``, ``core/evictor.py`` or
``evictor_v2.py``) with ``Device`` and ``cdiv`` from ``vllm/utils``; the
same release extracted in both layouts lives in two cache folders.

The rejected alternative was a subprocess per release with a stub ``vllm``
package on its path: simpler isolation, but every pool operation would cross a
process boundary and block objects could not be inspected directly.

Imports inside the loaded code are redirected by giving each loaded module its
own ``__builtins__`` whose ``__import__`` maps ``vllm`` to the private package
name; this also covers imports that run lazily inside functions. The import
machinery, the placeholders and the wheel cache are the overlay's too
(kvspec.conformance.targets.loader and .archives); what this module adds is
which of a release's modules are real (the `Layout`) and the `LightRelease`.

NOTE: hash functions that pickle their input (``sha256``, ``xxhash``) hash the
pickled qualified name of any vLLM class inside the input. The hash inputs of
every release from 0.8.0 to 0.33.0 are tuples of builtins (ints, bytes, str,
tuples), so the private package name does not change a hash value; pass
``package_name="vllm"`` to load under the real name when exact module names
matter.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.machinery
import inspect
import logging
import os
import re
import subprocess
import sys
import threading
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvspec.conformance.core.adapter import HarnessLimit
from kvspec.conformance.targets.archives import cached_folder, extract_zip, is_release_number, pip_download
from kvspec.conformance.targets.loader import (
    DeviceRuntimeModule,
    PlaceholderModule,
    PrivateFinder,
    SourceTree,
    exec_definitions,
    is_placeholder,
    redirecting_builtins,
)
from kvspec.conformance.targets.vllm.releases import RELEASES

__all__ = [
    "LAYOUTS",
    "V0",
    "V1",
    "Layout",
    "LightModeError",
    "LightRelease",
    "cache_dir",
    "fetch_release",
    "load_release",
    "release_files",
]


@dataclass(frozen=True, slots=True)
class Layout:
    """Which modules of a wheel light mode runs for one generation of vLLM's block manager.

    Attributes:
        name: ``"v1"`` (``vllm/v1/core/block_pool.py``, 0.8.0 on) or ``"v0"``
            (``vllm/core/block/prefix_caching_block.py``, vLLM v0's allocator).
        whole_modules: Modules loaded whole, by path inside the wheel; a release lacking one skips it.
        partial_defs: Heavy modules from which only these top-level names (and
            what they use) run. Keys are module names; the source is
            ``<name>.py`` or ``<name>/__init__.py``.
        required: The file a wheel must ship for this layout to load it.
        suffix: Appended to the version for the cache folder and package name
            (one release can be extracted in both layouts side by side).
        entry_modules: What loading imports (by vLLM name); the rest is imported as they ask.
    """

    name: str
    whole_modules: tuple[str, ...]
    partial_defs: Mapping[str, tuple[str, ...]]
    required: str
    suffix: str
    entry_modules: tuple[str, ...]


V1 = Layout(
    "v1",
    whole_modules=(
        "vllm/v1/core/block_pool.py",
        "vllm/v1/core/kv_cache_utils.py",
        "vllm/v1/core/kv_cache_metrics.py",
        "vllm/distributed/kv_events.py",
        "vllm/envs.py",
        "vllm/utils/hashing.py",
        "vllm/utils/math_utils.py",
        "vllm/utils/gc_utils.py",  # 0.34.0: gc_untrack, which must hand back the container it is given
    ),
    partial_defs={
        "vllm.utils": (
            "sha256",
            "sha256_cbor",
            "sha256_cbor_64bit",
            "xxhash",
            "xxhash_cbor",
            "get_hash_fn_by_name",
            "cdiv",
        ),
        "vllm.multimodal.utils": ("get_mm_features_in_window",),
        "vllm.v1.token_buffer": ("token_slice",),  # 0.34.0: the hasher slices the request's tokens with it
    },
    required="vllm/v1/core/block_pool.py",
    suffix="",
    entry_modules=("vllm.v1.core.kv_cache_utils", "vllm.v1.core.block_pool"),
)
# vLLM v0's prefix-caching allocator: the allocator, the hashless allocator it
# wraps, their shared helpers and interfaces, and the evictor (``evictor_v2.py``
# until 0.6.3, ``evictor.py`` after); ``Device`` and ``cdiv`` from vllm/utils.
V0 = Layout(
    "v0",
    whole_modules=(
        "vllm/core/block/prefix_caching_block.py",
        "vllm/core/block/naive_block.py",
        "vllm/core/block/common.py",
        "vllm/core/block/interfaces.py",
        "vllm/core/evictor.py",
        "vllm/core/evictor_v2.py",
    ),
    partial_defs={"vllm.utils": ("Device", "cdiv")},
    required="vllm/core/block/prefix_caching_block.py",
    suffix="-v0",
    entry_modules=("vllm.core.block.prefix_caching_block",),
)
LAYOUTS: Mapping[str, Layout] = {"v1": V1, "v0": V0}

_DEFAULT_CACHE = Path("~/.cache/kvspec/vllm-wheels")

_lock = threading.RLock()
_loaded: dict[tuple[str, str], LightRelease] = {}
_num_fresh = 0


class LightModeError(RuntimeError):
    """A release could not be fetched or loaded in light mode."""


def cache_dir() -> Path:
    """Return the folder that holds the extracted releases.

    Returns:
        ``$KVSPEC_VLLM_CACHE`` when set, else ``~/.cache/kvspec/vllm-wheels``.
    """
    override = os.environ.get("KVSPEC_VLLM_CACHE")
    return Path(override).expanduser() if override else _DEFAULT_CACHE.expanduser()


def release_files(layout: Layout = V1) -> tuple[str, ...]:
    """Return the wheel paths light mode keeps for a layout (those a release lacks are skipped).

    Args:
        layout: ``V1`` (the BlockPool) or ``V0`` (v0's prefix-caching allocator).

    Returns:
        The whole modules, then the sources of the partially loaded modules.
    """
    partial: list[str] = []
    for module_name in layout.partial_defs:
        base = module_name.replace(".", "/")
        partial += [f"{base}.py", f"{base}/__init__.py"]
    return layout.whole_modules + tuple(partial)


def fetch_release(
    version: str,
    *,
    cache: Path | None = None,
    wheel: Path | None = None,
    keep_wheel: bool = False,
    layout: Layout = V1,
) -> Path:
    """Extract the files light mode needs from a vLLM release wheel.

    The wheel is downloaded with ``pip download --no-deps`` unless ``wheel``
    names a local copy; only ``release_files()`` are extracted, and the wheel
    (hundreds of MB) is deleted afterwards unless ``keep_wheel``.

    Args:
        version: A release as the package registry spells it, e.g. ``"0.8.5.post1"``.
        cache: The cache folder; ``cache_dir()`` when None.
        wheel: A wheel already on disk, used instead of downloading.
        keep_wheel: Keep the downloaded wheel beside the extracted files.
        layout: Which modules to keep (``V1``: the BlockPool; ``V0``: v0's allocator).

    Returns:
        The folder that holds ``vllm/...`` for this release.

    Raises:
        LightModeError: the version is malformed, the download failed, or the
            wheel lacks ``layout.required`` (for ``V1``: releases before 0.8.0).
    """
    if not is_release_number(version):
        raise LightModeError(f"cannot fetch vllm version={version!r}: not a release number")

    def fill(work: Path, target: Path) -> str:
        found = wheel or _download_wheel(version, work / "wheel")
        names, _ = extract_zip(found, target, set(release_files(layout)).__contains__)
        if layout.required not in names:
            raise LightModeError(
                f"cannot load vllm=={version} in light mode ({layout.name}): its wheel has no {layout.required}"
            )
        if keep_wheel and found.parent == work / "wheel":
            found.rename(target / found.name)
        return found.name + "\n"

    files = hashlib.sha256("\n".join(release_files(layout)).encode()).hexdigest()[:16]
    return cached_folder(cache or cache_dir(), version + layout.suffix, fill, stamp=f"files {files}")


NEWEST = "newest"  # stands for the package registry's newest vLLM release, wherever a release is named


def newest_release() -> str:
    """The newest vLLM release on the package registry, asked of pip now (kvspec's table need not know it).

    Raises:
        LightModeError: pip could not say (no registry reachable); the message has pip's last line.
    """
    cmd = [sys.executable, "-m", "pip", "index", "versions", "vllm", "--disable-pip-version-check"]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=120)
    found = re.match(r"vllm \(([^)]+)\)", proc.stdout.strip())
    if proc.returncode != 0 or found is None or not is_release_number(found[1]):
        last = (proc.stderr.strip().splitlines() or ["no answer"])[-1][-300:]
        raise LightModeError(f"cannot ask the package registry for its newest vLLM release: {last}")
    return found[1]


def _download_wheel(version: str, dest: Path) -> Path:
    """Download the release's wheel with pip into ``dest``."""
    proc = pip_download(f"vllm=={version}", dest)
    wheels = sorted(dest.glob("vllm-*.whl"))
    if proc.returncode != 0 or not wheels:
        last = (proc.stderr.strip().splitlines() or ["no message"])[-1][-300:]  # pip's verdict, one line
        raise LightModeError(f"cannot download vllm=={version} from the package registry: {last}")
    return wheels[0]


@dataclass(eq=False)
class LightRelease:
    """One vLLM release's pool modules, loaded under a private package name.

    Attributes:
        version: The release, e.g. ``"0.33.0"``.
        package_name: The private top-level name the modules live under.
        root: The extracted folder (holds ``vllm/...``, or a fork's ``<package>/...``).
        modules: Every loaded module, keyed by its vLLM name (``"vllm.envs"``).
        placeholders_used: ``"module:attribute"`` for every placeholder handed
            out so far (grows as the loaded code runs).
        placeholders_at_load: ``placeholders_used`` as it stood right after
            loading; anything beyond it was reached by running pool code.
        layout: Which modules are real (``V1`` or ``V0``).
        package: The package's folder under ``root``: ``"vllm"``, or a fork's own name (``"myfork"``),
            which its code imports itself by; both names load the same modules.
    """

    version: str
    package_name: str
    root: Path
    modules: dict[str, types.ModuleType] = field(default_factory=dict)
    placeholders_used: set[str] = field(default_factory=set)
    placeholders_at_load: frozenset[str] = frozenset()
    layout: Layout = V1
    package: str = "vllm"
    device_runtimes: dict[str, DeviceRuntimeModule] = field(default_factory=dict)

    def module(self, vllm_name: str) -> types.ModuleType:
        """Return a loaded module by its vLLM name, importing it if needed.

        Args:
            vllm_name: e.g. ``"vllm.v1.core.kv_cache_utils"``.

        Returns:
            The module.
        """
        if vllm_name not in self.modules:
            importlib.import_module(self.package_name + vllm_name[len("vllm") :])
        return self.modules[vllm_name]

    @property
    def tree(self) -> SourceTree:
        """The release's files: the extracted folder, holding ``vllm/...`` (a fork: ``<package>/...``)."""
        return SourceTree(self.root, "vllm", "" if self.package == "vllm" else self.package)

    @property
    def block_pool(self) -> types.ModuleType:
        """The release's ``vllm.v1.core.block_pool``."""
        return self.module("vllm.v1.core.block_pool")

    @property
    def kv_cache_utils(self) -> types.ModuleType:
        """The release's ``vllm.v1.core.kv_cache_utils``."""
        return self.module("vllm.v1.core.kv_cache_utils")

    @property
    def BlockPool(self) -> type:  # noqa: N802 - vLLM's class name
        """The release's ``BlockPool`` class."""
        cls: type = self.block_pool.BlockPool
        return cls

    @property
    def KVCacheBlock(self) -> type:  # noqa: N802 - vLLM's class name
        """The release's ``KVCacheBlock`` class."""
        cls: type = self.kv_cache_utils.KVCacheBlock
        return cls

    def hash_functions(self) -> dict[str, Callable[[Any], Any]]:
        """Return the release's named block-hash functions that light mode can run.

        Returns:
            ``{"builtin": hash, "sha256": ..., "sha256_cbor": ..., ...}``: the
            names the release's ``--prefix-caching-hash-algo`` accepts (plus
            ``"builtin"`` where the release hashes with ``hash()``), each bound
            to the release's own function. ``xxhash`` ones appear only where
            the release ships them; they need the ``xxhash`` package to run.
        """
        found: dict[str, Callable[[Any], Any]] = {}
        for module_name in ("vllm.utils.hashing", "vllm.utils"):
            path = _module_source(self.tree, module_name, self.layout)
            if path is None:
                continue
            mod = self.module(module_name)
            for name in ("sha256", "sha256_cbor", "sha256_cbor_64bit", "xxhash", "xxhash_cbor"):
                fn = mod.__dict__.get(name)
                if callable(fn) and not is_placeholder(fn) and name not in found:
                    found[name] = fn
        # releases whose block hash is an int (before 0.10.2) also accept
        # Python's hash(); from 0.10.2 a hash must return bytes
        block_hash = getattr(self.kv_cache_utils, "BlockHash", None)
        if hasattr(self.kv_cache_utils, "BlockHashType") or (
            isinstance(block_hash, type) and issubclass(block_hash, tuple)
        ):
            found["builtin"] = hash
        return found

    def make_pool(self, num_gpu_blocks: int, enable_caching: bool = True, **kwargs: Any) -> Any:
        """Construct the release's ``BlockPool`` with the arguments it requires.

        ``hash_block_size`` (required from 0.12) defaults to 16 when the
        constructor takes it and ``kwargs`` does not give it.

        Args:
            num_gpu_blocks: Pool size, the null block included where the release has one.
            enable_caching: Prefix caching on or off.
            **kwargs: Passed through (``enable_kv_cache_events``, ``hash_block_size``, ...).

        Returns:
            A new ``BlockPool``.
        """
        params = inspect.signature(self.BlockPool).parameters
        if "hash_block_size" in params and "hash_block_size" not in kwargs:
            kwargs["hash_block_size"] = 16
        return self.BlockPool(num_gpu_blocks, enable_caching, **kwargs)


def load_release(
    version: str,
    *,
    cache: Path | None = None,
    package_name: str | None = None,
    fresh: bool = False,
    layout: Layout = V1,
) -> LightRelease:
    """Fetch (if needed) and load one release's pool modules in light mode.

    Args:
        version: A release, e.g. ``"0.33.0"``.
        cache: The cache folder; ``cache_dir()`` when None.
        package_name: The top-level name to load under; a private
            ``_kvspec_vllm_<version>`` when None. ``"vllm"`` is allowed only
            while no other ``vllm`` is imported.
        fresh: Load a new, independent copy (module globals such as
            ``NONE_HASH`` are per copy) instead of reusing an earlier load.
        layout: ``V1`` (the BlockPool) or ``V0`` (v0's prefix-caching allocator and evictor).

    Returns:
        The loaded release; the layout's entry modules (for ``V1``:
        ``block_pool`` and ``kv_cache_utils``) are imported.

    Raises:
        LightModeError: fetching failed, or ``package_name`` is taken.
    """
    root = fetch_release(version, cache=cache, layout=layout)
    base = package_name or "_kvspec_vllm_" + re.sub(r"[^0-9a-zA-Z]", "_", version + layout.suffix)
    return _load(version, root, base, fresh, layout)


def load_tree(tree: Path, *, fresh: bool = False) -> LightRelease:
    """Load a vLLM source tree's pool modules in light mode: a pull request's checkout, a fork's, nothing built.

    The tree is read where it is (the folder that holds ``vllm/``); exactly the
    modules a release's light mode runs are real, the rest placeholders, as
    for a wheel. Its version is its ``vllm/_version.py``'s where a build wrote
    one, else the newest release of the table with ``.dev0+tree`` (a branch
    is newer than the last release it started from): which release's declared
    reactions it is checked against.

    A fork whose package has another name (``myfork/v1/core/block_pool.py``,
    importing ``myfork.*``) is found the same way (`tree_package`) and loaded
    under that name as an alias of ``vllm``: no file is edited.

    Raises:
        LightModeError: the folder holds no ``<package>/v1/core/block_pool.py``, or several.
    """
    root, package = tree_package(tree.expanduser().resolve(), str(tree))
    version = tree_version(root, package)
    digest = hashlib.sha256(str(root).encode()).hexdigest()[:12]
    try:
        release = _load(version, root, f"_kvspec_vllm_tree_{digest}", fresh, V1, package)
    except LightModeError:
        raise
    except Exception as e:  # the tree's code, as checked out: a syntax error, an import of what light mode lacks
        where = _traceback_line(e, root)
        what = str(e) if isinstance(e, HarnessLimit) else f"{type(e).__name__}: {e}"
        raise LightModeError(f"{tree}'s pool modules do not load{where}: {what}") from e
    for module, name in (("block_pool", "BlockPool"), ("kv_cache_utils", "KVCacheBlock")):
        if not isinstance(getattr(release, module).__dict__.get(name), type):
            raise LightModeError(f"{tree} is not a vLLM source tree: {package}/v1/core/{module}.py defines no {name}")
    return release


def _traceback_line(e: BaseException, root: Path) -> str:
    """`` (at <file>:<line>)`` for the deepest frame of ``e`` in a file under ``root``, or ``""``."""
    found = ""
    tb = e.__traceback__
    while tb is not None:
        path = Path(tb.tb_frame.f_code.co_filename)
        if path.is_relative_to(root):
            found = f" (at {path.relative_to(root)}:{tb.tb_lineno})"
        tb = tb.tb_next
    if isinstance(e, SyntaxError) and e.filename and Path(e.filename).is_relative_to(root):
        found = f" (at {Path(e.filename).relative_to(root)}:{e.lineno})"
    return found


def tree_package(folder: Path, shown: str) -> tuple[Path, str]:
    """Where a source tree holds vLLM's pool: the folder that holds the package, and the package's name.

    ``folder`` is the tree (holding ``vllm/``, else exactly one package with
    ``v1/core/block_pool.py``: a fork's) or a package's own folder (which names
    one package of a tree holding several).

    Raises:
        LightModeError: no such package, or several and none named ``vllm`` (``shown``: the folder as named).
    """
    pool = V1.required.removeprefix("vllm/")
    if (folder / pool).is_file() and folder.name.isidentifier():
        return folder.parent, folder.name
    if (folder / "vllm" / pool).is_file():
        return folder, "vllm"
    found = sorted(p.name for p in folder.iterdir() if (p / pool).is_file()) if folder.is_dir() else []
    if len(found) == 1 and found[0].isidentifier():
        return folder, found[0]
    if found:
        example = f"vllm@{Path(shown) / found[0]}"
        raise LightModeError(f"{shown} holds several vLLM packages ({', '.join(found)}): name one's folder ({example})")
    raise LightModeError(f"{shown} is not a vLLM source tree: it has no {V1.required}")


def tree_version(root: Path, package: str = "vllm") -> str:
    """The version a source tree declares (``<package>/_version.py``, written by a build), else the newest
    release's ``.dev0+tree``."""
    written = root / package / "_version.py"
    found = re.search(r"""^(?:__version__|version)\s*=\s*(?:\w+\s*=\s*)?['"]([^'"]+)['"]""",
                      written.read_text(encoding="utf-8") if written.is_file() else "", re.M)  # fmt: skip
    return found[1] if found else f"{RELEASES[-1]}.dev0+tree"


def _load(version: str, root: Path, base: str, fresh: bool, layout: Layout, package: str = "vllm") -> LightRelease:
    """Load the layout's modules of the vLLM under ``root`` as the private package ``base`` (once, unless fresh)."""
    global _num_fresh
    with _lock:
        key = (version, base)
        if not fresh and key in _loaded:
            return _loaded[key]
        name = base
        if fresh:
            _num_fresh += 1
            name = f"{base}__{_num_fresh}"
        if name in sys.modules:
            raise LightModeError(
                f"cannot load vllm=={version} as package_name={name!r}: a module of that name is already imported"
            )
        release = LightRelease(version=version, package_name=name, root=root, layout=layout, package=package)
        finder = _ReleaseFinder(release)
        sys.meta_path.insert(0, finder)
        try:
            for entry in layout.entry_modules:
                release.module(entry)
        except BaseException as e:
            sys.meta_path.remove(finder)
            for mod_name in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
                del sys.modules[mod_name]
            if isinstance(e, ImportError) and e.name and not e.name.startswith(name):
                raise LightModeError(
                    f"vllm=={version}'s pool modules import {e.name!r}, which is not installed here (kvspec's "
                    "vllm extra has what light mode needs: pip install 'kvspec[vllm]')"
                ) from e
            raise
        release.placeholders_at_load = frozenset(release.placeholders_used)
        if not fresh:
            _loaded[key] = release
        return release


# ---------------------------------------------------------------------------
# import machinery (kvspec.conformance.targets.loader): which modules are real is the layout's


def _module_source(tree: SourceTree, vllm_name: str, layout: Layout) -> Path | None:
    """The extracted source of a module light mode runs (whole or partially)."""
    rel = vllm_name.replace(".", "/")
    is_partial = vllm_name in layout.partial_defs
    candidates = ((f"{rel}.py", tree.module_file(vllm_name)), (f"{rel}/__init__.py", tree.init_file(vllm_name)))
    for candidate, path in candidates:
        if path is not None and (is_partial or candidate in layout.whole_modules):
            return path
    return None


class _ReleaseFinder(PrivateFinder):
    """Serves ``<package_name>.*``: real, partial or placeholder modules."""

    def __init__(self, release: LightRelease) -> None:
        super().__init__(redirecting_builtins(self._private_name, stand_in=self._device_runtime))
        self.release = release

    def _private_name(self, name: str) -> str:
        top, dot, rest = name.partition(".")
        # A fork imports itself by its own name (``myfork.v1.core...``): the same modules as ``vllm.*``.
        is_ours = top in ("vllm", self.release.package)
        return self.release.package_name + dot + rest if is_ours else name

    def _device_runtime(self, name: str) -> DeviceRuntimeModule:
        """A device runtime imported by loaded code: a stand-in (light mode runs nothing built)."""
        runtimes = self.release.device_runtimes
        if name not in runtimes:
            runtimes[name] = DeviceRuntimeModule(name, self.release.placeholders_used)
            parent, _, child = name.rpartition(".")
            if parent:
                setattr(self._device_runtime(parent), child, runtimes[name])
        return runtimes[name]

    def real_name(self, fullname: str) -> str | None:
        pkg = self.release.package_name
        if fullname == pkg:
            return "vllm"
        if fullname.startswith(pkg + "."):
            return "vllm" + fullname[len(pkg) :]
        return None

    def locate(self, real: str) -> tuple[Path | None, bool, Path | None]:
        source = _module_source(self.release.tree, real, self.release.layout)
        return source, source is None or source.name == "__init__.py", None

    def new_module(self, real: str, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        if real in self.release.layout.partial_defs or spec.origin is None:
            return PlaceholderModule(spec.name, real, self.release.placeholders_used, self._submodule)
        return types.ModuleType(spec.name)

    def _submodule(self, real: str) -> types.ModuleType | None:
        release = self.release
        return release.module(real) if _module_source(release.tree, real, release.layout) is not None else None

    def register(self, real: str, module: types.ModuleType) -> None:
        self.release.modules[real] = module

    def execute(self, real: str, module: types.ModuleType, path: Path | None) -> None:
        if real == "vllm.logger":
            module.__dict__["init_logger"] = logging.getLogger
            module.__dict__["logger"] = logging.getLogger(real)
        elif path is not None and real in self.release.layout.partial_defs:
            exec_definitions(module, path, self.release.layout.partial_defs[real], self.builtins)
        else:
            super().execute(real, module, path)
