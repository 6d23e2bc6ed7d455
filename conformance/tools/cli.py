"""The `kvspec` command line.

Each subcommand lives in its own module under `kvspec.conformance.tools.commands`
and exposes `register(subparsers)`; this module only discovers them, so a new
command never edits a shared file. Exit codes are the harness's: 0 conforms /
proved, 1 the implementation is wrong (diverged, crashed, hung) / refuted, 2 no
verdict (bad arguments, an adapter that cannot be built, a malformed trace, an
inconclusive run).
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys
from collections.abc import Sequence
from pathlib import Path

from hypothesis.configuration import set_hypothesis_home_dir

import kvspec
import kvspec.conformance.tools.commands as commands
from kvspec.conformance.core.results import EXIT_COULD_NOT_RUN
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
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse exits 2 on bad usage, 0 on --help
        return int(e.code or 0)
    if args.command is None:
        parser.print_help()
        return EXIT_COULD_NOT_RUN
    try:
        code: int = args.run(args)
    except BrokenPipeError:
        return _output_closed(args.command)
    return code


def _output_closed(command: str) -> int:
    """The reader of our output went away (``kvspec mutants --list | head``): say so once, reach no verdict.

    Python would print a traceback at exit while flushing the closed stdout;
    pointing stdout at /dev/null first leaves nothing to flush.
    """
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    print(f"kvspec {command}: the output was closed before the command finished", file=sys.stderr)
    return EXIT_COULD_NOT_RUN


if __name__ == "__main__":
    sys.exit(main())
