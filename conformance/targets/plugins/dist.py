"""A plugin's own files, fetched once from the package registry and cached, never installed.

A plugin is checked the way light mode checks a vLLM release: its
distribution is downloaded with ``pip download --no-deps`` (a wheel, or the
source distribution where the plugin ships no wheel), and only the files the
pool is made of are kept, under ``~/.cache/kvspec/plugins/<name>-<version>/``
(``$KVSPEC_PLUGIN_CACHE`` overrides). Nothing is built and nothing is
installed: a plugin's dependencies (jax, mlx, torch_npu, a CUDA toolchain) are
exactly what the overlay leaves out.

A source distribution is unpacked, not built. pip prepares an sdist's
metadata by running its build backend, which for a package with device
extensions fails on a machine without the device toolkit (kvcached's
``setup.py`` asks torch for its CUDA or HIP version). ``--no-clean`` keeps
the tree pip unpacked before that step, and the files are read from it.
The rejected alternative, fetching the archive from the index by URL, would
bypass the registry's ordinary client.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tarfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from kvspec.conformance.targets.archives import cached_folder, extract_zip, is_release_number, pip_download

__all__ = ["PluginDist", "PluginFetchError", "cache_dir", "fetch_dist"]

_DEFAULT_CACHE = Path("~/.cache/kvspec/plugins")


class PluginFetchError(RuntimeError):
    """A plugin's distribution could not be downloaded or read."""


@dataclass(frozen=True, slots=True)
class PluginDist:
    """One release of a plugin on the package registry, and the files of it the overlay runs."""

    name: str  # the distribution's name on the registry, e.g. "kvcached"
    version: str  # e.g. "0.1.6"
    files: tuple[str, ...]  # paths inside the distribution to keep; a path ending in "/" keeps a whole folder
    kind: Literal["wheel", "sdist"] = "wheel"  # what the registry offers for it
    # more pip download arguments: a wheel built for one Python and platform only is still
    # just files to read (e.g. "--python-version", "3.11", "--platform", "manylinux_2_34_x86_64")
    pip_args: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        """``kvcached==0.1.6``: how reports name it."""
        return f"{self.name}=={self.version}"


def cache_dir() -> Path:
    """The folder that holds extracted plugins: ``$KVSPEC_PLUGIN_CACHE`` or ``~/.cache/kvspec/plugins``."""
    override = os.environ.get("KVSPEC_PLUGIN_CACHE")
    return Path(override).expanduser() if override else _DEFAULT_CACHE.expanduser()


def _wanted(path: str, files: Iterable[str]) -> bool:
    return any(path == f or (f.endswith("/") and path.startswith(f)) for f in files)


def _pip_download(dist: PluginDist, work: Path) -> subprocess.CompletedProcess[str]:
    # pip's temporary folders go under `work`, so --no-clean leaves the unpacked sdist there
    return pip_download(f"{dist.name}=={dist.version}", work / "download", wheel=dist.kind == "wheel",
                        unpack_in=work / "tmp", args=dist.pip_args)  # fmt: skip


def _unpacked_sdist(dist: PluginDist, work: Path) -> Path | None:
    """The source tree pip unpacked (its PKG-INFO names this release), or the archive unpacked here."""
    wanted = re.sub(r"[-_.]+", "-", dist.name).lower()
    for info in sorted((work / "tmp").glob("pip-*/*/PKG-INFO")):
        text = info.read_text(encoding="utf-8", errors="replace")
        name = re.search(r"^Name: (.+)$", text, re.M)
        version = re.search(r"^Version: (.+)$", text, re.M)
        same_name = name is not None and re.sub(r"[-_.]+", "-", name[1].strip()).lower() == wanted
        if same_name and version is not None and version[1].strip() == dist.version:
            return info.parent
    for archive in sorted((work / "download").glob("*.tar.gz")):
        with tarfile.open(archive) as tf:
            tf.extractall(work / "unpacked", filter="data")
        tops = [p for p in (work / "unpacked").iterdir() if p.is_dir()]
        return tops[0] if len(tops) == 1 else None
    return None


def _extract(dist: PluginDist, work: Path, target: Path) -> int:
    """Copy the wanted files into `target`; returns how many were kept."""
    if dist.kind == "wheel":
        wheels = sorted((work / "download").glob("*.whl"))
        return extract_zip(wheels[0], target, lambda name: _wanted(name, dist.files))[1] if wheels else 0
    kept = 0
    tree = _unpacked_sdist(dist, work)
    if tree is None:
        return 0
    for path in sorted(tree.rglob("*")):
        rel = path.relative_to(tree).as_posix()
        if path.is_file() and _wanted(rel, dist.files):
            (target / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target / rel)
            kept += 1
    return kept


def fetch_dist(dist: PluginDist, *, cache: Path | None = None, archive: Path | None = None) -> Path:
    """The folder holding the plugin's kept files, downloading and extracting them on first use.

    Args:
        dist: The plugin release and the files to keep.
        cache: The cache folder; ``cache_dir()`` when None.
        archive: The distribution already on disk (a ``.whl``, or a ``.tar.gz`` sdist), used
            instead of downloading it.

    Returns:
        The extracted folder (paths as inside the distribution).

    Raises:
        PluginFetchError: the version is malformed, pip found no such
            distribution, or it holds none of the wanted files.
    """
    if not is_release_number(dist.version):
        raise PluginFetchError(f"cannot fetch {dist.name} version={dist.version!r}: not a release number")

    def fill(work: Path, target: Path) -> str:
        if archive is None:
            proc = _pip_download(dist, work)
        else:
            (work / "download").mkdir(parents=True)
            (work / "tmp").mkdir()
            shutil.copyfile(archive, work / "download" / Path(archive).name)
            proc = subprocess.CompletedProcess([], 0, "", "")
        if _extract(dist, work, target) == 0:
            raise PluginFetchError(
                f"cannot fetch {dist.label} ({dist.kind}) from the package registry: pip exited "
                f"rc={proc.returncode} and left none of {list(dist.files)}; {proc.stderr.strip()[-300:]}"
            )
        return f"{dist.label} {dist.kind}\n"

    return cached_folder(cache or cache_dir(), f"{dist.name}-{dist.version}", fill)
