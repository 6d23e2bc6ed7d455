"""Argument types every command shares: each value is checked before any work starts, and refused in one line.

An argparse `type=` function raises `argparse.ArgumentTypeError` with what
was wrong; the CLI's parser (kvspec.conformance.tools.cli) prints that as one line
on stderr and exits 2. Paths that a command will write are checked up front
too, so a run is never lost to an output that cannot be written at its end,
and nothing is created outside the paths the user named. What is written at the
end goes through `write_output`: whole or not at all, a failure said in one line;
and `text_for_people` keeps stdout for the JSON alone under `--json -`.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import sys
from collections.abc import Iterator
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import NoReturn

from kvspec.conformance.core.files import write_whole
from kvspec.conformance.core.run_config import DEFAULT_BUILD_TIMEOUT_S, DRAWN, ConfigError, too_wide_for_campaigns
from kvspec.conformance.runner import run as runner
from kvspec.conformance.targets.archives import is_release_number
from kvspec.spec.attention import format_groups, parse_groups
from kvspec.spec.errors import InvalidRequest
from kvspec.spec.ordering import is_profile, known_profiles

__all__ = [
    "DEFAULT_TRACE_DIR",
    "FLAGS",
    "OneLineParser",
    "add_timeouts",
    "check_device",
    "fraction",
    "campaign_group_layout",
    "group_layout",
    "group_layout_or_drawn",
    "integer",
    "json_output",
    "memory_size",
    "non_negative_float",
    "non_negative_int",
    "number",
    "output_dir",
    "output_file",
    "positive_float",
    "port",
    "positive_int",
    "profile_name",
    "refuse",
    "release_number",
    "text_for_people",
    "write_output",
]

DEFAULT_TRACE_DIR = str(runner.DEFAULT_TRACE_DIR)


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose refusal is one line on stderr (`kvspec check: --steps: must be at least 1; got 0`).

    argparse's own prints the whole usage first; a user's mistake should read
    as one sentence, with `--help` for the rest.
    """

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {_one_line(message)} (see {self.prog} --help)\n")


def _one_line(message: str) -> str:
    # "argument --steps: must be at least 1" reads better as "--steps: must be at least 1".
    return " ".join(message.removeprefix("argument ").split())


_MAX_INT = 2**63 - 1  # no count, size or seed here is wider than 64 bits


def _number(text: str, kind: type[int] | type[float]) -> int | float:
    shown = repr(text) if len(text) <= 40 else repr(text[:37] + "...")
    try:
        value = _integer(text) if kind is int else kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{shown} is not {'an integer' if kind is int else 'a number'}") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{shown} is not a finite number")
    if isinstance(value, int) and abs(value) > _MAX_INT:
        raise argparse.ArgumentTypeError(f"{shown} is wider than a 64-bit integer, which every count here fits in")
    return value


def _integer(text: str) -> int:
    """An integer written plainly or as the docs and --help write sizes (`1e5`, `2.5e3`); ValueError otherwise.

    Decimal, not float, so `1e18` is exact and `1.0000000000000001e16` is not
    rounded into an integer it does not name.
    """
    try:
        return int(text)
    except ValueError:
        pass
    try:
        value = Decimal(text.strip())
    except InvalidOperation:
        raise ValueError(text) from None
    # int() refuses a literal of over 4,300 digits; an exponent names as many without writing them.
    if not value.is_finite() or value.adjusted() > sys.get_int_max_str_digits() or value != value.to_integral_value():
        raise ValueError(text)
    return int(value)


def integer(text: str) -> int:
    """An integer, its range left to the record it goes into (kvspec.conformance.core.run_config.LIMITS).

    >>> integer("-3")
    -3
    >>> integer("1e5")
    100000
    """
    return int(_number(text, int))


def number(text: str) -> float:
    """A finite number, its range left to the record it goes into (seconds of a budget or a timeout)."""
    return float(_number(text, float))


# The command line's flag for each RunConfig field, for a refusal of the record in the user's words.
FLAGS: dict[str, str] = {
    "impls": "--impl", "levels": "--level", "caching": "--caching", "profile": "--profile", "groups": "--groups",
    "events": "--events", "device": "--device", "max_examples": "--max-examples", "steps": "--steps",
    "cover_rounds": "--cover-rounds", "time_budget_s": "--time-budget", "step_timeout_s": "--step-timeout",
    "build_timeout_s": "--build-timeout",
    "seed": "--seed", "jobs": "--jobs", "trace_dir": "--trace-dir", "html_dir": "--html-dir", "junit": "--junit",
    "json": "--json", "keep_deepest": "--keep-deepest", "database": "--database",
}  # fmt: skip


def add_timeouts(p: argparse.ArgumentParser) -> None:
    """The two time limits on the implementation: one per call, and one per adapter built (imports included)."""
    p.add_argument(
        "--step-timeout",
        type=number,
        default=10.0,
        metavar="SECONDS",
        help="the most one implementation call may take (default 10, from 0.1 to a week)",
    )
    p.add_argument(
        "--build-timeout",
        type=number,
        default=DEFAULT_BUILD_TIMEOUT_S,
        metavar="SECONDS",
        help="the most importing and building the implementation may take, each adapter built "
        f"(default {DEFAULT_BUILD_TIMEOUT_S:g}, from 0.1 to a week): its own limit, so a slow import is not taken "
        "for a hung call; past it the implementation is hung, at building the adapter",
    )


def refuse(prog: str, error: ConfigError) -> int:
    """Print a refused record as one line naming the flag (`kvspec check: --jobs: must be at least 1; got 0`);
    the exit code 2."""
    print(f"{prog}: {FLAGS.get(error.name, error.name)}: {error.short}", file=sys.stderr)
    return 2


def check_device(device: str | None) -> None:
    """Refuse a device this machine does not have, asking the runtime that would use it (torch, through
    gpu_impl); a name torch does not know is some other runtime's, and left to its adapter.

    Raises:
        ConfigError: the device does not exist here (`cuda:99` on a machine with one GPU, or none).
    """
    if device is None:
        return
    try:
        # NOTE: gpu_impl needs torch, an optional dependency: without it there is no torch device to ask about
        from kvspec.gpu_impl.device import device_problem
    except ImportError:
        return
    problem = device_problem(device)
    if problem is not None:
        raise ConfigError("device", problem)


def positive_int(text: str) -> int:
    """An integer of at least 1 (a count of examples, steps, blocks).

    >>> positive_int("3")
    3
    """
    value = int(_number(text, int))
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1; got {value}")
    return value


def non_negative_int(text: str) -> int:
    """An integer of at least 0 (a seed, a number of extra rounds, a port)."""
    value = int(_number(text, int))
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0; got {value}")
    return value


def positive_float(text: str) -> float:
    """A number above 0 (seconds of a budget or a timeout).

    >>> positive_float("0.5")
    0.5
    """
    value = float(_number(text, float))
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be above 0; got {text}")
    return value


def non_negative_float(text: str) -> float:
    """A number of at least 0 (a memory share, a per-path budget that may be off)."""
    value = float(_number(text, float))
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0; got {text}")
    return value


def fraction(text: str) -> float:
    """A fraction in [0, 1) (a safety margin: 1 would keep everything free).

    >>> fraction("0.2")
    0.2
    """
    value = float(_number(text, float))
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1); got {text}")
    return value


_UNITS = {"": None, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_UNITS.update({"kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12})


def memory_size(text: str) -> int:
    """A memory size with its unit: 141GiB, 80GB, 512MiB (0 needs none). A bare number is refused: GiB or GB?

    >>> memory_size("2KiB"), memory_size("1.5GB"), memory_size("0")
    (2048, 1500000000, 0)
    """
    if text.strip().startswith("-"):
        raise argparse.ArgumentTypeError(f"{text!r} is negative; a memory size is at least 0")
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size such as 141GiB, 80GB or 512MiB")
    number, unit = float(match.group(1)), match.group(2).lower()
    if unit not in _UNITS:
        units = "B, KiB, MiB, GiB, KB, MB or GB"
        raise argparse.ArgumentTypeError(f"unknown unit {match.group(2)!r} in {text!r}; use {units}")
    scale = _UNITS[unit]
    if scale is None:
        if number == 0:
            return 0
        raise argparse.ArgumentTypeError(
            f"{text!r} has no unit: write {match.group(1)}GiB (2^30 bytes, as nvidia-smi reports) or {match.group(1)}GB"
        )
    # Decimal, not float: 1.1GB is 1,100,000,000 bytes, not a float's nearest neighbour of it.
    size = int(Decimal(match.group(1)) * scale)
    if size > _MAX_INT:
        # a size no memory has, whose blocks would print as a count of 40 digits
        raise argparse.ArgumentTypeError(f"{text!r} is more than 2^63 bytes (8 EiB), larger than any memory")
    return size


def _writable_dir(path: Path) -> bool:
    """Whether a file can be created in `path`, found by creating one (permission bits say nothing to root,
    or on a read-only or virtual file system such as /proc)."""
    if not path.is_dir():
        return False
    probe = path / f".kvspec-write-probe-{os.getpid()}"
    try:
        fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except OSError:
        return False
    os.close(fd)
    probe.unlink()
    return True


def _named(text: str) -> None:
    # Path("") is ".", the current folder: an empty name would read as "a folder" or write into it.
    if not text:
        raise argparse.ArgumentTypeError("an empty path; give a path")


def output_file(text: str) -> Path:
    """A file the command will write: its folder must exist and be writable; an existing file must be a file."""
    _named(text)
    path = Path(text)
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder; give a file path")
    if not parent.exists():
        raise argparse.ArgumentTypeError(f"cannot write {text}: the folder {parent} does not exist")
    if path.exists():
        try:
            with open(path, "a"):
                pass
        except OSError as e:
            raise argparse.ArgumentTypeError(f"cannot write {text}: {e.strerror}") from None
    elif not _writable_dir(parent):
        raise argparse.ArgumentTypeError(f"cannot write {text}: files cannot be created in {parent}")
    return path


def output_dir(text: str) -> Path:
    """A folder the command will write into: an existing writable folder, or a new one in an existing writable folder.

    It is not created here: only a run that writes something creates it.
    """
    _named(text)
    path = Path(text)
    if path.exists():
        if not path.is_dir():
            raise argparse.ArgumentTypeError(f"{text} exists and is not a folder")
        if not _writable_dir(path):
            raise argparse.ArgumentTypeError(f"cannot write into {text}: files cannot be created there")
        return path
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.exists():
        raise argparse.ArgumentTypeError(f"cannot create {text}: the folder {parent} does not exist")
    if not _writable_dir(parent):
        raise argparse.ArgumentTypeError(f"cannot create {text}: files cannot be created in {parent}")
    return path


def json_output(text: str) -> str | Path:
    """Where a command writes its JSON: `-` for stdout, else a file path checked as `output_file`."""
    return text if text == "-" else output_file(text)


def write_output(prog: str, path: str | Path, content: str | bytes) -> int:
    """Write what the user asked for (`--json`, `--html`, `--junit`, `-o`, `--plot`) whole or not at all
    (`core.files.write_whole`: a failed write leaves what was there as it was).

    `-` is stdout (a failure there is the CLI's to say, as for any other output). Returns 0, or 2 after one
    line on stderr (`kvspec check: cannot write r.json: <why>`).
    """
    if str(path) == "-":
        sys.stdout.write(content if isinstance(content, str) else content.decode("utf-8"))
        sys.stdout.flush()
        return 0
    try:
        write_whole(path, content)
    except OSError as e:
        print(f"{prog}: cannot write {path}: {e.strerror or e}", file=sys.stderr)
        return 2
    return 0


@contextlib.contextmanager
def text_for_people(json_path: str | Path | None) -> Iterator[None]:
    """With `--json -` stdout carries the JSON alone: what the block prints for people goes to stderr.

    The JSON itself is written after the block, with `write_output`.
    """
    if json_path is None or str(json_path) != "-":
        yield
        return
    with contextlib.redirect_stdout(sys.stderr):
        yield


def profile_name(text: str) -> str:
    """The name of a profile (kvspec.spec.ordering: the named ones and lru-lfu:W)."""

    if not is_profile(text):
        raise argparse.ArgumentTypeError(f"unknown profile {text!r}; known: {known_profiles()}")
    return text


def group_layout(text: str) -> str:
    """KV cache groups for the manager level: `full,sliding:8`, `chunked:16`, ... (spec.attention)."""

    try:
        return format_groups(parse_groups(text))
    except InvalidRequest as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def campaign_group_layout(text: str) -> str:
    """`group_layout` that a request-level campaign can cross (run_config.too_wide_for_campaigns)."""

    layout = group_layout(text)
    too_wide = too_wide_for_campaigns(parse_groups(layout))
    if too_wide is not None:
        raise argparse.ArgumentTypeError(too_wide)
    return layout


def group_layout_or_drawn(text: str) -> str:
    """`group_layout`, or `drawn`: one to three groups drawn per example."""

    return text if text == DRAWN else group_layout(text)


def release_number(text: str) -> str:
    """A vLLM release as the package registry spells it (`0.8.5.post1`), refused before anything is fetched.

    An empty one would otherwise read as "none given" and load some other vLLM than the one named.

    >>> release_number("0.8.5.post1")
    '0.8.5.post1'
    """
    if not is_release_number(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a release number such as 0.34.0 or 0.8.5.post1")
    return text


def port(text: str) -> int:
    """A TCP port, 0 for any free one."""
    value = int(_number(text, int))
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port in 0..65535; got {value}")
    return value
