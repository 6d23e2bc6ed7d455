"""`kvspec mutants`: how strong is the harness? Run it against every known-wrong implementation.

Prints one row per mutant (killed or not, seconds to kill, length of the
shrunk counterexample, what the harness saw), then the benchmark lines:
every mutant killed within 60 s, and the median shrunk trace at most 8 steps.
Exit 0 iff every mutant is killed; 1 if one survives; 2 if the run could not
be interpreted (an unknown `--only` name, or the unmutated reference itself
failing the check, which would make every kill meaningless).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvspec.conformance.core.results import EXIT_COULD_NOT_RUN, EXIT_DIVERGES, EXIT_OK, CheckResult, Verdict
from kvspec.conformance.core.run_config import ConfigError, RunConfig
from kvspec.conformance.tools.commands._arguments import (
    DEFAULT_TRACE_DIR,
    non_negative_int,
    output_dir,
    positive_float,
    positive_int,
    refuse,
)
from kvspec.conformance.tools.mutants import (
    KILL_TIME_TARGET_S,
    MEDIAN_TRACE_TARGET,
    Mutant,
    MutantResult,
    factory_name,
    run_control,
    run_mutants,
    summarize,
)
from kvspec.mutants import discover


def register(subparsers: Any) -> None:
    """Add the `mutants` subcommand."""
    p = subparsers.add_parser(
        "mutants",
        help="run the harness against every deliberately wrong implementation; exit 0 iff all are killed",
        description=__doc__.splitlines()[0] if __doc__ else None,
    )
    p.add_argument("--max-examples", type=positive_int, default=200, help="example budget per mutant (default 200)")
    p.add_argument("--seed", type=non_negative_int, default=0, help="harness seed (default 0)")
    p.add_argument(
        "--time-budget",
        type=positive_float,
        default=KILL_TIME_TARGET_S,
        help=f"wall-clock seconds per mutant (default {KILL_TIME_TARGET_S:g})",
    )
    p.add_argument("--only", action="append", metavar="NAME", default=None, help="run only this mutant (repeatable)")
    p.add_argument("--list", action="store_true", help="list the mutants and exit")
    p.add_argument(
        "--trace-dir",
        type=output_dir,
        default=Path(DEFAULT_TRACE_DIR) / "mutants",
        help=f"where each mutant's failing trace is written (default ./{DEFAULT_TRACE_DIR}/mutants)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.set_defaults(run=run)


def _select(mutants: list[Mutant], only: list[str] | None) -> list[Mutant]:
    if not only:
        return mutants
    by_name = {m.name: m for m in mutants}
    unknown = [n for n in only if n not in by_name]
    if unknown:
        raise ValueError(f"unknown mutant {', '.join(unknown)}; known: {', '.join(sorted(by_name))}")
    return [by_name[n] for n in dict.fromkeys(only)]


def _row(result: MutantResult, level: str) -> str:
    killed = "killed" if result.killed else "SURVIVED"
    seconds = f"{result.seconds_to_kill:.2f}" if result.seconds_to_kill is not None else f"({result.seconds:.1f})"
    steps = str(result.shrunk_steps) if result.shrunk_steps is not None else "-"
    how = result.failure_kind or "-"
    message = result.message.splitlines()[0] if result.message else ""
    if len(message) > 70:
        message = message[:67] + "..."
    return f"{result.name:34} {level:7} {killed:8} {seconds:>8} {steps:>5}  {how}: {message}"


def run(args: argparse.Namespace) -> int:
    """Run the selected mutants and print the table and the benchmark lines."""
    if args.max_examples < 1 or args.time_budget <= 0:
        print(
            f"kvspec mutants: --max-examples must be >= 1 and --time-budget > 0; "
            f"got max_examples={args.max_examples} time_budget={args.time_budget}",
            file=sys.stderr,
        )
        return EXIT_COULD_NOT_RUN
    try:  # the record every campaign is run under, refused here rather than by the control's campaign
        RunConfig(max_examples=args.max_examples, seed=args.seed, time_budget_s=args.time_budget)
    except ConfigError as e:
        return refuse("kvspec mutants", e)
    found = discover()
    try:
        mutants = _select(found.mutants, args.only)
    except ValueError as e:
        print(f"kvspec mutants: {e}", file=sys.stderr)
        return EXIT_COULD_NOT_RUN
    if args.list and args.json:  # a script's list, as --json promises: not the table
        listed = [{"name": m.name, "level": m.level, "impl": factory_name(m), "kind": m.kind,
                   "description": m.description} for m in mutants]  # fmt: skip
        print(json.dumps(listed, indent=2))
        return EXIT_OK
    if args.list:
        for m in mutants:
            print(f"{m.name:34} {m.level:7} {factory_name(m)}\n    {m.kind}: {m.description}")
        return EXIT_OK
    for line in found.skipped:
        print(f"skipped mutant module {line}", file=sys.stderr)

    controls = _controls(args, mutants)
    if controls is None:
        return EXIT_COULD_NOT_RUN
    # One folder for the run's traces, so that every story printed can be replayed.
    trace_dir: Path = args.trace_dir
    levels = {m.name: m.level for m in mutants}
    if not args.json:
        print(f"\n{'mutant':34} {'level':7} {'verdict':8} {'seconds':>8} {'steps':>5}  what the harness saw")

    def show(result: MutantResult) -> None:
        if not args.json:
            print(_row(result, levels[result.name]), flush=True)

    results = run_mutants(mutants, args.max_examples, args.seed, args.time_budget, trace_dir=trace_dir, on_result=show)
    summary = summarize(results)
    if args.json:
        _print_json(mutants, results, summary, controls, found.skipped, trace_dir)
    else:
        _print_summary(summary, trace_dir)
    return EXIT_OK if not summary.survivors else EXIT_DIVERGES


def _controls(args: argparse.Namespace, mutants: Sequence[Mutant]) -> list[CheckResult] | None:
    """The unmutated reference at each level the mutants need, printed; None (and why, on stderr) if it fails."""
    try:
        controls = run_control(mutants, args.max_examples, args.seed, args.time_budget)
    except Exception as e:  # noqa: BLE001 - the harness itself failed: say so, exit 2, no traceback
        why = f"{type(e).__name__}: {e}"
        print(f"kvspec mutants: the harness failed on the unmutated reference: {why}", file=sys.stderr)
        return None
    if not args.json:
        for c in controls:
            print(
                f"control: reference at {c.level} level, caching {'on' if c.enable_caching else 'off'}, "
                f"profile {c.profile}{'' if c.groups == 'full' else ', KV cache groups ' + c.groups}: "
                f"{c.verdict} ({c.examples_run} examples, {c.steps_run} steps, {c.seconds:.1f} s)"
            )
    broken = [c for c in controls if c.verdict is not Verdict.CONFORMS]
    for c in broken:
        if c.verdict.exit_code == EXIT_COULD_NOT_RUN:  # no verdict (a budget too small to conclude): not its fault
            said = f"the check of the unmutated reference reached no verdict ({c.verdict.value}"
            said += f": {c.message.splitlines()[0]})" if c.message else ")"
        else:
            detail = c.failure.message if c.failure is not None else c.verdict.value
            said = f"the unmutated reference does not conform ({detail})"
        print(f"kvspec mutants: {said}; kills would mean nothing", file=sys.stderr)
    return None if broken else controls


def _print_json(
    mutants: Sequence[Mutant],
    results: Sequence[MutantResult],
    summary: Any,
    controls: Sequence[CheckResult],
    skipped: Sequence[str],
    trace_dir: Path,
) -> None:
    levels = {m.name: m.level for m in mutants}
    impls = {m.name: factory_name(m) for m in mutants}
    control = [
        {
            "level": c.level,
            "enable_caching": c.enable_caching,
            "profile": c.profile,
            "verdict": c.verdict.value,
            "seconds": c.seconds,
        }
        for c in controls
    ]
    report = {
        "mutants": [asdict(r) | {"level": levels[r.name], "impl": impls[r.name]} for r in results],
        "summary": asdict(summary),
        "control": control,
        "skipped_modules": list(skipped),
        "trace_dir": str(trace_dir),
    }
    print(json.dumps(report, indent=2))


def _print_summary(summary: Any, trace_dir: Path) -> None:
    print(
        f"\nkilled {summary.num_killed} of {summary.num_mutants} mutants"
        + (f"; survivors: {', '.join(summary.survivors)}" if summary.survivors else "")
    )
    notes = [f"{len(summary.survivors)} not killed"] if summary.survivors else []
    if summary.slowest is not None:
        notes.append(f"slowest kill: {summary.slowest}, {summary.max_seconds_to_kill:.1f} s")
    print(
        f"benchmark: every mutant killed within {KILL_TIME_TARGET_S:g} s: "
        f"{'yes' if summary.all_killed_within_target else 'NO'}" + (f" ({'; '.join(notes)})" if notes else "")
    )
    median = "-" if summary.median_shrunk_steps is None else f"{summary.median_shrunk_steps:g}"
    print(
        f"benchmark: median shrunk trace {median} steps (target <= {MEDIAN_TRACE_TARGET}): "
        f"{'yes' if summary.median_within_target else 'NO'}"
    )
    print(f"traces: {trace_dir} (kvspec replay TRACE --impl IMPL replays one; `--list` names each IMPL)")
