"""A distribution's files on disk: downloaded once with pip, the wanted ones kept in a cache folder.

Light mode keeps a vLLM release's pool modules from its wheel
(``~/.cache/kvspec/vllm-wheels/<version>/``), the plugins keep a plugin's
pool modules from its wheel or source distribution
(``~/.cache/kvspec/plugins/<name>-<version>/``); both go through here. A
distribution is fetched with ``pip download --no-deps`` (the registry's
ordinary client), read as an archive, never built or installed; the archive
itself (hundreds of MB for vLLM) is dropped once the wanted files are kept.

Every cache folder is filled in a private folder beside it and renamed into
place, with a marker file written last, so that concurrent fetches of one
release never see half of one and an interrupted fetch is redone. The
rejected alternative, a lock file per release, leaves a stale lock behind a
killed process.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path

__all__ = ["MARKER", "cached_folder", "extract_zip", "is_release_number", "pip_download"]

MARKER = "KVSPEC_EXTRACTED"  # written last: an extraction without it is incomplete
# \Z, not $: $ also matches before a final newline, which is no part of a file name or a pip pin.
_VERSION_RE = re.compile(r"^[0-9]+(\.[0-9]+)*([.-]?(post|rc|a|b|dev)[0-9]*)*\Z")


def is_release_number(version: str) -> bool:
    """Whether ``version`` reads as a release number (``0.8.5.post1``), safe in a file name and a pip pin.

    >>> is_release_number("0.8.5.post1"), is_release_number("0.8; rm -rf /")
    (True, False)
    """
    return _VERSION_RE.match(version) is not None


def cached_folder(base: Path, name: str, fill: Callable[[Path, Path], str], stamp: str = "") -> Path:
    """The folder ``base/name``, filled by ``fill`` on first use.

    Args:
        base: The cache folder.
        name: The entry, e.g. ``"0.33.0"`` or ``"kvcached-0.1.6"``.
        fill: ``fill(work, target)`` puts the wanted files in ``target`` (``work`` is a private
            scratch folder beside it, removed afterwards) and returns the marker's text.
        stamp: What was asked of ``fill`` (e.g. which files it keeps), recorded in the marker: a
            folder filled under another stamp is filled again, so a kvspec that keeps more files
            of a release than an older one did never reads that older, shorter extraction.

    Returns:
        ``base/name``, complete.

    Raises:
        Whatever ``fill`` raises; nothing is left in the cache then.
    """
    root = base / name
    stamp_line = f"stamp: {stamp}\n" if stamp else ""
    if (root / MARKER).exists():
        if stamp_line in (root / MARKER).read_text():
            return root
        shutil.rmtree(root, ignore_errors=True)  # filled under another stamp
    if base.exists() and not base.is_dir():  # a cache named by the environment (KVSPEC_*_CACHE) may be anything
        raise NotADirectoryError(f"the cache {base} is not a folder")
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=base))
    try:
        target = work / "extracted"
        target.mkdir()
        (target / MARKER).write_text(fill(work, target) + stamp_line)
        try:
            target.rename(root)
        except OSError:
            if not (root / MARKER).exists():  # a stale, unfinished folder
                shutil.rmtree(root)
                target.rename(root)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return root


def pip_download(
    requirement: str, dest: Path, *, wheel: bool = True, unpack_in: Path | None = None, args: Sequence[str] = ()
) -> subprocess.CompletedProcess[str]:
    """Download one distribution, without its dependencies, with pip.

    Args:
        requirement: e.g. ``"vllm==0.33.0"``.
        dest: Where the archive goes.
        wheel: A wheel (``--only-binary``), else a source distribution (``--no-binary``).
        unpack_in: Keep what pip unpacks (an sdist's tree, before pip runs its build backend)
            in this folder: ``--no-clean`` with pip's temporary folders under it.
        args: More pip arguments (``--python-version``, ``--platform``, ...).

    Returns:
        pip's finished process (not checked: the caller says what a failure means).
    """
    binary = "--only-binary=:all:" if wheel else "--no-binary=:all:"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", binary, "--disable-pip-version-check", "-q"]
    env = dict(os.environ)
    if unpack_in is not None:
        cmd.append("--no-clean")
        unpack_in.mkdir(parents=True, exist_ok=True)
        env["TMPDIR"] = str(unpack_in)
    cmd += [*args, requirement, "-d", str(dest)]
    return subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)


def extract_zip(archive: Path, target: Path, keep: Callable[[str], bool]) -> tuple[frozenset[str], int]:
    """Copy the members of a zip archive (a wheel) that ``keep`` accepts into ``target``.

    Args:
        archive: The wheel.
        target: Where the kept files go, at their paths inside the archive.
        keep: Whether to keep a member, by its path.

    Returns:
        Every member's path, and how many files were kept.
    """
    kept = 0
    with zipfile.ZipFile(archive) as zf:
        names = frozenset(zf.namelist())
        for name in sorted(names):
            if keep(name) and not name.endswith("/"):
                (target / name).parent.mkdir(parents=True, exist_ok=True)
                (target / name).write_bytes(zf.read(name))
                kept += 1
    return names, kept
