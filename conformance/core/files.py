"""Every file kvspec writes (a report, a trace, a page) is written whole or not at all; every file a user
names for kvspec to read is a regular file.

A file is written beside itself under a temporary name, then moved onto its path: a write that fails (a
full disk) leaves the file that was there as it was, never half of one, and a reader never sees a file
being written. A path that is no regular file (a device such as /dev/full, a FIFO) cannot be replaced so,
and is written directly. A link stays a link: the file it names is replaced.

A file read is refused unless it is a regular file, before it is opened: a FIFO with no writer would block
the read for ever, and a device such as /dev/zero would never end; what is read is read whole.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from pathlib import Path

__all__ = ["NotAFile", "read_text_file", "write_whole"]


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


class NotAFile(OSError):
    """A path a user named for kvspec to read is there, but it is no regular file (a FIFO, a device, a folder)."""


def read_text_file(path: str | Path) -> str:
    """The text (UTF-8) of the regular file at `path` (a link to one is followed), read whole.

    Raises:
        FileNotFoundError: nothing is at `path`.
        NotAFile: what is at `path` is no regular file; it was not opened, or opened without waiting and closed.
        OSError: it cannot be read.
        UnicodeDecodeError: it is not UTF-8.
    """
    _refuse_unless_regular(os.stat(path).st_mode)
    # Opened without waiting, then checked again: what was swapped in after the check must not block either.
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    with os.fdopen(fd, "rb") as stream:
        _refuse_unless_regular(os.fstat(fd).st_mode)
        os.set_blocking(fd, True)
        return stream.read().decode("utf-8")


def _refuse_unless_regular(mode: int) -> None:
    """Raise NotAFile, naming what it is, unless `mode` is a regular file's."""
    if stat.S_ISREG(mode):
        return
    if stat.S_ISFIFO(mode):
        raise NotAFile("a FIFO, not a regular file: reading it would wait for a writer")
    if stat.S_ISDIR(mode):
        raise NotAFile("a folder, not a regular file")
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        raise NotAFile("a device, not a regular file: reading it need never end")
    raise NotAFile("not a regular file")
