"""`kvspec mirror TRACE`: replay a trace's KV cache events into the mirrors routers build, and show where they drift.

Two mirrors, as a router author would write them (kvspec.conformance.tools.router_mirror):
the counting one (a count per key: stored +1 per block, removed -1, cleared:
empty) and the naive one (a set that forgets a key on its first removal).
Each is compared with the pool's hash table after every step of the trace;
the first step where it disagrees is printed with the step's events, and so
is every stored block whose parent the counting mirror does not hold (a
router that chains blocks by parent cannot attach it).

The trace must have been recorded with events (`kvspec check --events`; a
failure's trace, or `--keep-deepest` for a passing campaign's deepest
example). Exit 0 when the counting mirror holds the pool's keys at every
step (the naive mirror's drift is the router's to handle, not the pool's
fault), 1 when it drifts (the stream itself is wrong), 2 for a trace that
cannot be read or has no events: one without steps, one whose stream has no
events, or one with a step that lacks the side's outcome or state (a snapshot
left out, a call that crashed) before the counting mirror drifted, since the
mirror cannot be checked at that step or after it.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from typing import Any

from kvspec.conformance.core.trace import MalformedTrace, read_trace
from kvspec.conformance.tools.router_mirror import Drift, MirrorReport, replay_mirrors

__all__ = ["register", "run"]


def register(subparsers: Any) -> None:
    """Add the `mirror` subcommand."""
    p = subparsers.add_parser(
        "mirror",
        help="replay a trace's KV cache events into a router's mirror; where it drifts from the pool",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("trace", metavar="TRACE", help="a .trace.jsonl written by kvspec check --events")
    p.add_argument(
        "--side",
        choices=("implementation", "spec"),
        default="implementation",
        help="whose event stream and hash table to replay (default: the implementation's)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the text")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Replay and print; exit 1 when the counting mirror drifts."""
    try:
        report = replay_mirrors(read_trace(args.trace), args.side)
    except (MalformedTrace, OSError) as e:
        print(f"kvspec mirror: cannot read the trace: {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"kvspec mirror: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(asdict(report), indent=2))
    else:
        print(_text(report, args.trace))
    return 1 if report.counting is not None else 0


def _text(report: MirrorReport, path: str) -> str:
    lines = [f"kvspec mirror: {path}, the {report.side}'s stream: {report.num_events} events in {report.steps} steps"]
    lines += _drift("counting mirror (a count per key)", report.counting, "the stream is wrong")
    lines += _drift(
        "naive mirror (forgets a key on its first removal)",
        report.naive,
        "a router must count references: a key can have several blocks",
    )
    if report.misreads:
        lines.append(f"removals of a key another block still holds (a naive mirror drops it): {len(report.misreads)}")
        lines += [f"  step {step}: {key}" for step, key in report.misreads[:10]]
    if report.orphans:
        lines.append(f"stored blocks whose parent the counting mirror does not hold: {len(report.orphans)}")
        lines += [f"  step {step}: {what}" for step, what in report.orphans[:10]]
        if len(report.orphans) > 10:
            lines.append(f"  ... and {len(report.orphans) - 10} more")
    else:
        lines.append("every stored block's parent is held by the counting mirror when it arrives")
    if report.stopped_at is not None:
        lines.append(
            f"replayed up to step {report.stopped_at}, which lacks the {report.side}'s outcome or state: "
            "the steps from there on are not checked"
        )
    return "\n".join(lines)


def _drift(what: str, drift: Drift | None, meaning: str) -> list[str]:
    if drift is None:
        return [f"{what}: holds the pool's keys after every step"]
    out = [f"{what}: drifts at step {drift.step} ({drift.op}): {meaning}", f"  events: {drift.events}"]
    if drift.holds_extra:
        out.append(f"  holds what the pool does not: {', '.join(drift.holds_extra)}")
    if drift.lacks:
        out.append(f"  lacks what the pool holds: {', '.join(drift.lacks)}")
    return out
