"""Every file kvspec writes (a report, a trace, a page) is written whole or not at all.

A file is written beside itself under a temporary name, then moved onto its path: a write that fails (a
full disk) leaves the file that was there as it was, never half of one, and a reader never sees a file
being written. A path that is no regular file (a device such as /dev/full, a FIFO) cannot be replaced so,
and is written directly. A link stays a link: the file it names is replaced.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from pathlib import Path

__all__ = ["write_whole"]


def write_whole(path: str | Path, content: str | bytes) -> Path:
    """Write `content` (text as UTF-8) to `path`, its folder created if missing; returns the path.

    Raises:
        OSError: the folder cannot be made or the file cannot be written; what was at `path` is as it was.
    """
    data = content.encode("utf-8") if isinstance(content, str) else content
    given = Path(path)
    target = Path(os.path.realpath(given))
    if target.exists() and not target.is_file():
        with open(target, "wb") as stream:
            stream.write(data)
        return given
    target.parent.mkdir(parents=True, exist_ok=True)
    _replace_whole(target, data)
    return given


def _replace_whole(target: Path, data: bytes) -> None:
    """Write `data` to a new file in `target`'s folder and move it onto `target` (its mode kept, if it exists)."""
    try:
        mode: int | None = stat.S_IMODE(target.stat().st_mode)
    except FileNotFoundError:
        mode = None
    temporary = target.parent / f".{target.name[:180]}.{os.getpid()}-{secrets.token_hex(4)}.tmp"
    # 0o666 less the umask, as any new file the user's shell creates; an existing file's own mode otherwise.
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as stream:
            stream.write(data)
            stream.flush()
            if mode is not None:
                os.fchmod(stream.fileno(), mode)
            os.fsync(stream.fileno())
        os.replace(temporary, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
