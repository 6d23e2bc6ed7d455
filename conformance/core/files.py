"""Every file kvspec writes (a report, a trace, a page) is written whole or not at all; every file a user
names for kvspec to read is a regular file.

A file is written beside itself under a temporary name, then moved onto its path: a write that fails (a
full disk) leaves the file that was there as it was, never half of one, and a reader never sees a file
being written. A path that is no regular file (a device such as /dev/full, a FIFO) cannot be replaced so,
and is written directly. A link stays a link: the file it names is replaced.

A file read is a regular file or a pipe, read whole. A pipe is what a shell's `<(command)` names, so it is
read as `cat` reads it, but only once something writes to it: a FIFO nobody writes to within
`PIPE_WAIT_S` is refused, where the read would wait for ever, and so is one that carries more than the
reader takes. A device such as /dev/zero, which need never end, and a folder are refused before they
are opened.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import select
import stat
from pathlib import Path
from typing import BinaryIO

__all__ = ["PIPE_WAIT_S", "NotAFile", "read_text_file", "shown", "write_whole"]

# How long a pipe may stay silent before its first byte (or its end): a FIFO no program writes to.
PIPE_WAIT_S = 10.0


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


def shown(path: str | Path, folder: Path) -> str:
    """`path` as a person who started the command in `folder` names it: relative to it where it lies inside.

    >>> shown("/work/run/kvspec-traces/a.trace.jsonl", Path("/work/run")), shown("/tmp/a", Path("/work/run"))
    ('kvspec-traces/a.trace.jsonl', '/tmp/a')
    """
    try:
        return str(Path(path).relative_to(folder))
    except ValueError:  # outside it (or relative already): as it is
        return str(path)


class NotAFile(OSError):
    """A path a user named for kvspec to read is there, but it is no regular file (a FIFO, a device, a folder)."""


def read_text_file(path: str | Path, max_bytes: int | None = None, pipe_wait_s: float = PIPE_WAIT_S) -> str:
    """The text (UTF-8) of the regular file or pipe at `path` (a link to one is followed), read whole.

    Args:
        path: what to read.
        max_bytes: the most a pipe may carry (a regular file's size is the caller's to check); None: no limit.
        pipe_wait_s: how long a pipe may stay silent before its first byte or its end.

    Raises:
        FileNotFoundError: nothing is at `path`.
        NotAFile: what is at `path` is a folder or a device (not opened), a pipe nobody wrote to within
            `pipe_wait_s`, or one that carried more than `max_bytes`.
        OSError: it cannot be read.
        UnicodeDecodeError: it is not UTF-8.
    """
    _refuse_unless_readable(os.stat(path).st_mode)
    # Opened without waiting (a FIFO's open waits for a writer), then checked again: what was swapped in
    # after the check must not block either.
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    with os.fdopen(fd, "rb") as stream:
        mode = os.fstat(fd).st_mode
        _refuse_unless_readable(mode)
        if stat.S_ISFIFO(mode):
            return _read_pipe(fd, stream, max_bytes, pipe_wait_s).decode("utf-8")
        os.set_blocking(fd, True)
        return stream.read().decode("utf-8")


def _read_pipe(fd: int, stream: BinaryIO, max_bytes: int | None, wait_s: float) -> bytes:
    """A pipe's bytes to its end, once it has said something within `wait_s`; at most `max_bytes`."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    if not poller.poll(int(wait_s * 1000)):  # no byte and no end: no program has opened it to write
        raise NotAFile(f"a FIFO nobody wrote to within {wait_s:g} s")
    os.set_blocking(fd, True)
    data = stream.read() if max_bytes is None else stream.read(max_bytes + 1)
    if max_bytes is not None and len(data) > max_bytes:
        raise NotAFile(f"a pipe that carries more than {max_bytes:,} bytes, the most kvspec reads")
    return data


def _refuse_unless_readable(mode: int) -> None:
    """Raise NotAFile, naming what it is, unless `mode` is a regular file's or a pipe's."""
    if stat.S_ISREG(mode) or stat.S_ISFIFO(mode):
        return
    if stat.S_ISDIR(mode):
        raise NotAFile("a folder, not a regular file")
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        raise NotAFile("a device, not a regular file: reading it need never end")
    raise NotAFile("not a regular file")
