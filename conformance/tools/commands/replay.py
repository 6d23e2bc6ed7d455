"""`kvspec replay TRACE --impl X`: re-run a recorded trace and give its verdict again.

The trace's steps (operations with literal arguments) run on the named
implementation and on the spec in lock-step, checked exactly as the
conformance machine checks them, so a failure found by `kvspec check`
replays to the same verdict, and a fixed implementation replays to
"conforms". Exit codes as `kvspec check`; a malformed trace file exits 2
with the line that is wrong, and so does a step no campaign could have sent
(an argument of the wrong type or range not recorded as a caller mistake),
before anything is sent. A replay writes no trace unless `--trace-dir` (or
`--html-dir`) asks for one.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from typing import Any

from kvspec.conformance.core.report import render_story
from kvspec.conformance.core.results import CheckResult, Verdict
from kvspec.conformance.core.run_config import ConfigError, RunConfig
from kvspec.conformance.core.trace import MalformedTrace, Trace
from kvspec.conformance.runner.registry import Factory, FactoryError, load_factory, target_names
from kvspec.conformance.runner.replaying import load_sendable
from kvspec.conformance.runner.run import replay_configured, replay_record
from kvspec.conformance.tools.commands._arguments import (
    add_timeouts,
    check_device,
    json_output,
    output_dir,
    refuse,
    text_for_people,
)
from kvspec.conformance.tools.commands._check_output import summary_json, write_json
from kvspec.conformance.tools.view import attach_page

__all__ = ["register", "run"]


def register(subparsers: Any) -> None:
    """Add the `replay` subcommand."""
    p = subparsers.add_parser(
        "replay",
        help="re-run a trace on an implementation and print its story (exit as kvspec check)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("trace", metavar="TRACE", help="a .trace.jsonl file written by kvspec check")
    p.add_argument(
        "--impl",
        metavar="NAME|module:function",
        help=f"the implementation ({target_names()}, module:function "
        "or path/file.py:function); "
        "default: the one named in the trace",
    )
    add_timeouts(p)
    p.add_argument(
        "--trace-dir",
        type=output_dir,
        default=None,
        metavar="DIR",
        help="also save the replay's own failure trace here (default: none is written, the trace replayed is "
        "the record; with --html-dir, the page's trace is saved beside it)",
    )
    p.add_argument("--json", type=json_output, metavar="PATH", help="also write the result as JSON (- for stdout)")
    p.add_argument(
        "--html-dir", type=output_dir, metavar="DIR", help="also write a step-through page of the replay's failure here"
    )
    p.add_argument(
        "--device",
        default=None,
        metavar="DEVICE",
        help="run a device-backed implementation on this device instead of the trace's (cpu, cuda:0)",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Replay the trace; print the recorded and the new verdict and the story; exit per the new verdict."""
    try:
        record = replay_record(
            step_timeout_s=args.step_timeout, build_timeout_s=args.build_timeout,
            trace_dir=args.trace_dir or args.html_dir, json=args.json,
            html_dir=args.html_dir,
            device=args.device,
        )  # fmt: skip
        check_device(record.device)
    except ConfigError as e:
        return refuse("kvspec replay", e)
    try:
        trace = load_sendable(args.trace)  # read, and every step checked before anything is sent
    except MalformedTrace as e:
        print(f"kvspec replay: cannot read the trace: {e}", file=sys.stderr)
        return 2
    impl = args.impl or trace.impl
    if not impl:
        print(
            "kvspec replay: the trace names no implementation; give one with --impl NAME or module:function",
            file=sys.stderr,
        )
        return 2
    try:
        # refused as check refuses it: before any work
        factory = load_factory(impl, record.build_timeout_s, record.folder)
    except FactoryError as e:
        print(f"kvspec replay: {e}", file=sys.stderr)
        return 2
    with text_for_people(record.json):
        result = _replay(args, trace, impl, factory, record)
    if record.json is not None:
        document = summary_json([result], result.seconds) | {"kvspec": "replay", "trace": str(args.trace)}
        if write_json(document, record.json, prog="kvspec replay"):
            return 2
    return result.exit_code


def _replay(args: argparse.Namespace, trace: Trace, impl: str, factory: Factory, record: RunConfig) -> CheckResult:
    """Replay the trace, printing the recorded and the new verdict and the story; the result."""
    recorded = trace.verdict or "not recorded"
    print(f"replaying {args.trace} ({len(trace.steps)} steps, recorded verdict: {recorded}) on {impl}\n")
    result = replay_configured(trace, factory, replace(record, impls=(impl,)))
    attach_page(result, record.html_dir, record.folder)  # the story printed below names the page
    if result.verdict is Verdict.COULD_NOT_RUN:
        # No verdict: a bad argument or a factory that would not build says why in its message; a step kvspec
        # itself could not run (its limit, or a bug in the spec) has a story up to that step too.
        if result.failure is not None:
            print(result.failure.story)
        why = result.message or (result.failure.message if result.failure is not None else "no verdict")
        print(f"kvspec replay: {why}", file=sys.stderr)
        return result
    if result.failure is not None:
        print(result.failure.story)
    elif result.verdict is Verdict.CONFORMS:
        print(render_story(replace(trace, impl=impl, verdict=Verdict.CONFORMS, failure=None)))
    else:
        print(f"{result.verdict}: {result.message}")
    same = "same as recorded" if result.verdict is trace.verdict else f"recorded: {recorded}"
    print(f"\nverdict: {result.verdict} ({same})")
    return result
