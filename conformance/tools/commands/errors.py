"""`kvspec errors`: each operation's caller mistakes, the error type the spec raises, and the order of the checks.

The table is computed from the spec each time (kvspec.conformance.core.error_contract):
each mistake's canonical call is run on the spec, and every pair of mistakes
of an operation is made in one call to find which check runs first.
"""

from __future__ import annotations

import argparse
from typing import Any

from kvspec.conformance.core.error_contract import build_contract, contract_json, render_text
from kvspec.conformance.tools.commands._arguments import json_output, text_for_people
from kvspec.conformance.tools.commands._check_output import write_json

__all__ = ["register", "run"]


def register(subparsers: Any) -> None:
    """Add the `errors` subcommand."""
    p = subparsers.add_parser(
        "errors",
        help="list every caller mistake, the error type the spec raises and the order of the checks",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        epilog="exit codes: 0 the table printed; 2 a bad flag or a --json that cannot be written",
    )
    p.add_argument("--json", type=json_output, metavar="PATH", help="also write the table as JSON (- for stdout)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Print the table (and write it as JSON when asked)."""

    contract = build_contract()
    with text_for_people(args.json):
        print(render_text(contract))
    if args.json is not None:
        return write_json(contract_json(contract), args.json, prog="kvspec errors")
    return 0
