"""`kvspec view TRACE`: a trace as a step-through page, spec beside implementation.

The page is one self-contained HTML file (no network, works from file://):
every block with its ref count and hash, the free queue left to right, the
hash table and the request block tables at each step, the changed blocks
framed; for a failure it opens at the first divergence with the differing
fields marked and the broken rule in words. The spec's side is computed by
running the steps through the spec; the implementation's is what the trace
records (view does not run it; kvspec replay does). Where the file's record
is not what kvspec computes (a recorded spec state or outcome, or a first
divergence the recorded sides do not show), the page says so at the top.
`-o PATH` writes it (default:
beside the trace, named after it); `--serve` serves it on 127.0.0.1 until
Ctrl-C. Exit 0, or 2 when the trace cannot be read or the page not written.
A trace is checked as `kvspec replay` checks it before anything is drawn: a
step no campaign could have sent (an argument of the wrong type or range not
recorded as a caller mistake) is refused in one line, naming the step.
"""

from __future__ import annotations

import argparse
import os
import stat
import sys
from pathlib import Path
from typing import Any

from kvspec.conformance.core.trace import MalformedTrace
from kvspec.conformance.runner.replaying import load_sendable
from kvspec.conformance.tools.commands._arguments import output_file, port, write_output
from kvspec.conformance.tools.view import page_path_for, render_page, serve_page, trace_to_page_data

__all__ = ["register", "run"]


def register(subparsers: Any) -> None:
    """Add the `view` subcommand."""
    p = subparsers.add_parser(
        "view",
        help="a trace as a step-through browser page (spec beside implementation, first divergence marked)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("trace", metavar="TRACE", help="a .trace.jsonl file (kvspec check, kvspec replay)")
    p.add_argument(
        "-o", "--output", type=output_file, metavar="PATH", help="where the page is written (default: beside the trace)"
    )
    p.add_argument("--serve", action="store_true", help="serve the page on 127.0.0.1 until Ctrl-C instead")
    p.add_argument("--port", type=port, default=0, metavar="N", help="the port for --serve (default: a free one)")
    p.add_argument("--no-open", dest="open_browser", action="store_false", help="with --serve, do not open a browser")
    p.set_defaults(run=run)


def _refusal(args: argparse.Namespace) -> str | None:
    """Why these arguments cannot mean anything, in one line; None when they can."""
    if not args.serve and args.port:
        return "--port goes with --serve (the page is written to a file otherwise)"
    if not args.serve and not args.open_browser:
        return "--no-open goes with --serve (a written page is never opened)"
    if args.serve and args.output:
        return "-o and --serve are two ways to show the page; give one"
    if not args.output and not args.serve and _is_pipe(args.trace):
        return f"{args.trace} is a pipe, with no folder to write the page beside; give -o PAGE.html or --serve"
    if args.output and Path(args.output).resolve() == Path(args.trace).resolve():
        return f"-o {args.output} is the trace itself; the page would replace it (give another path)"
    return None


def _is_pipe(path: str) -> bool:
    """Whether `path` is a pipe (a shell's `<(command)`): looked at, not read."""
    try:
        return stat.S_ISFIFO(os.stat(path).st_mode)
    except OSError:  # the reader says why it cannot read it
        return False


def run(args: argparse.Namespace) -> int:
    """Write (or serve) the page of one trace."""
    refusal = _refusal(args)
    if refusal:
        print(f"kvspec view: {refusal}", file=sys.stderr)
        return 2
    try:
        doc = trace_to_page_data(load_sendable(args.trace))  # every step checked as replay checks it
    except MalformedTrace as e:
        print(f"kvspec view: cannot read the trace: {e}", file=sys.stderr)
        return 2
    if args.serve:
        if not 0 <= args.port <= 65535:
            print(f"kvspec view: --port must be 0 to 65535; got {args.port}", file=sys.stderr)
            return 2
        try:
            return serve_page(render_page(doc), args.port, args.open_browser, announce=lambda s: print(s, flush=True))
        except OSError as e:
            print(f"kvspec view: cannot serve on 127.0.0.1:{args.port} ({e})", file=sys.stderr)
            return 2
    out = Path(args.output) if args.output else page_path_for(args.trace, Path(args.trace).parent)
    page = render_page(doc).encode("utf-8")
    if write_output("kvspec view", out, page):
        return 2
    print(f"page: {out} ({len(page) / 1024:.0f} KiB, {len(doc['steps']) - 1} steps)")
    return 0
