"""The `kvspec` command line.

Each subcommand lives in its own module under `kvspec.conformance.tools.commands`
and exposes `register(subparsers)`; this module only discovers them, so a new
command never edits a shared file. Exit codes are the harness's: 0 conforms /
proved, 1 the implementation is wrong (diverged, crashed, hung) / refuted, 2 no
verdict (bad arguments, an adapter that cannot be built, a malformed trace, an
inconclusive run), 130 interrupted by Ctrl-C.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, TextIO

from hypothesis.configuration import set_hypothesis_home_dir

import kvspec
import kvspec.conformance.tools.commands as commands
from kvspec.conformance.core.results import EXIT_COULD_NOT_RUN, EXIT_INTERRUPTED
from kvspec.conformance.core.watch import ctrl_c_pressed, telling_ctrl_c_apart
from kvspec.conformance.runner.isolation import kvspec_failed, system_refused
from kvspec.conformance.tools.commands._arguments import OneLineParser

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The parser with every discovered subcommand registered."""
    parser = OneLineParser(
        prog="kvspec",
        description="A formally checked model of vLLM's prefix-caching block manager, and a conformance harness.",
    )
    parser.add_argument("--version", action="version", version=f"kvspec {kvspec.__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineParser)
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):  # shared helpers of the commands, not commands
            continue
        module = importlib.import_module(f"{commands.__name__}.{info.name}")
        module.register(subparsers)
    return parser


def _keep_hypothesis_files_out_of_the_current_folder() -> None:
    """Hypothesis caches what it scrapes from the loaded modules in `.hypothesis/` of the current folder; a
    command leaves nothing but what the user named there, so that cache goes to ~/.cache/kvspec/hypothesis
    (HYPOTHESIS_STORAGE_DIRECTORY, when set, wins). The example database is never kept unless --database says.
    """
    if "HYPOTHESIS_STORAGE_DIRECTORY" in os.environ:
        return
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvspec" / "hypothesis"
    set_hypothesis_home_dir(str(cache))


def main(argv: Sequence[str] | None = None) -> int:
    """Run one subcommand; returns the process exit code."""
    _keep_hypothesis_files_out_of_the_current_folder()
    stdout = _WatchedStdout(sys.stdout)
    sys.stdout = stdout  # the same stream, with what went wrong writing to it
    prog = "kvspec"
    try:
        with telling_ctrl_c_apart():
            parser = build_parser()
            try:
                args = parser.parse_args(argv)
            except SystemExit as e:  # argparse exits 2 on bad usage, 0 on --help
                code = int(e.code or 0)
            else:
                if args.command is None:
                    parser.print_help()
                    code = EXIT_COULD_NOT_RUN
                else:
                    prog = f"kvspec {args.command}"
                    code = args.run(args)
            # Python flushes stdout at exit, after main has returned: a failure there would be a traceback.
            sys.stdout.flush()
    except KeyboardInterrupt as e:  # the user's Ctrl-C: an implementation's own is its crash, caught where it ran
        if ctrl_c_pressed():
            code = _interrupted(prog)
        else:  # raised by code, past every handler of an implementation's calls: kvspec's fault
            print(f"{prog}: {kvspec_failed(e)}", file=sys.stderr)
            code = EXIT_COULD_NOT_RUN
    except BrokenPipeError as e:  # stdout's, or a pipe kvspec writes to otherwise: its reader went away
        stdout.failed = stdout.failed or e
    except OSError as e:
        if stdout.failed is None:  # not stdout's: the system refused something else kvspec asked of it
            print(f"{prog}: {system_refused(e)}", file=sys.stderr)
            code = EXIT_COULD_NOT_RUN
    finally:
        sys.stdout = stdout.stream
    # A failed write to stdout is said even where it was caught on the way (argparse ignores one in --help).
    if isinstance(stdout.failed, BrokenPipeError):
        return _output_closed(prog)
    if stdout.failed is not None:
        return _output_failed(prog, stdout.failed)
    return code


def _interrupted(prog: str) -> int:
    """A Ctrl-C stopped the command: one line, no verdict, the shell's exit code for it (128 + SIGINT).

    Every report is written whole or not at all (`_arguments.write_output`), so one the command had not
    finished is not there.
    """
    print(f"{prog}: interrupted (Ctrl-C): no verdict", file=sys.stderr)
    return EXIT_INTERRUPTED


class _WatchedStdout:
    """stdout while a command runs: every write and flush passed on, and the error of one that failed kept,
    so an OSError of stdout (a full disk, a device gone) is told apart from one of any other file."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.failed: OSError | None = None

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except OSError as e:
            self.failed = e
            raise

    def writelines(self, lines: Iterable[str]) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        try:
            self.stream.flush()
        except OSError as e:
            self.failed = e
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def _silence_stdout() -> None:
    """Point stdout at /dev/null: what is still buffered goes there when Python flushes it at exit, instead
    of failing again with a traceback."""
    try:
        fileno = sys.stdout.fileno()
    except (OSError, ValueError):  # not a file (a test's capture): nothing is flushed to a descriptor at exit
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fileno)
    os.close(devnull)


def _output_closed(prog: str) -> int:
    """The reader of our output went away (``kvspec mutants --list | head``): say so once, reach no verdict."""
    _silence_stdout()
    print(f"{prog}: the output was closed before the command finished", file=sys.stderr)
    return EXIT_COULD_NOT_RUN


def _output_failed(prog: str, error: OSError) -> int:
    """stdout cannot be written (``kvspec invariants > /dev/full``): say why once, reach no verdict."""
    _silence_stdout()
    print(f"{prog}: cannot write stdout: {error.strerror or error}", file=sys.stderr)
    return EXIT_COULD_NOT_RUN


if __name__ == "__main__":
    sys.exit(main())
