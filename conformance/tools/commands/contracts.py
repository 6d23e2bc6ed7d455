"""`kvspec contracts`: CrossHair searches the spec's contracts, within a time budget per condition.

Each function of the spec that carries icontract conditions (spec.ops,
spec.manager, spec.ordering's helpers) has every postcondition searched for a
counterexample: arguments where the preconditions hold but the postcondition
fails, or an error the function does not declare is raised. The report says
"no counterexample found within budget" or prints the counterexample; it never
says "verified". A condition whose search met no precondition within the
budget searched nothing, and is reported as such. Exit 0 when every condition
was searched and nothing was found, 1 when a counterexample was, 2 when
CrossHair is not installed, a name is unknown, or a condition was not searched
(CrossHair could not analyse it, or no input met its preconditions).
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from typing import TYPE_CHECKING, Any

from kvspec.conformance.tools.commands._arguments import positive_float, positive_int
from kvspec.conformance.tools.contracts import DEFAULT_MODULES, check_modules, contract_functions

if TYPE_CHECKING:
    from kvspec.conformance.tools.contracts import ContractsReport

__all__ = ["register", "render_text", "run"]


def register(subparsers: Any) -> None:
    """Add the `contracts` subcommand."""
    p = subparsers.add_parser(
        "contracts",
        help="search the spec's contracts for counterexamples with CrossHair",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        epilog="exit codes: 0 every condition searched, no counterexample found (a search, not a proof); "
        "1 CrossHair found a counterexample; 2 CrossHair does not import, an unknown function, or a condition "
        "not searched",
    )
    p.add_argument(
        "--per-condition-timeout",
        type=positive_float,
        default=3.0,
        metavar="S",
        help="CrossHair's budget per postcondition, in CPU seconds (default 3)",
    )
    p.add_argument(
        "--per-path-timeout",
        type=positive_float,
        default=1.0,
        metavar="S",
        help="CrossHair's budget per path (default 1)",
    )
    p.add_argument(
        "--max-paths",
        type=positive_int,
        metavar="N",
        help="also end each postcondition's search after N paths: the same inputs on every machine, "
        "where a budget in seconds searches fewer on a slower one",
    )
    p.add_argument(
        "--function",
        action="append",
        metavar="NAME",
        help="search only this function (e.g. free_blocks or kvspec.spec.ops.free_blocks; repeatable)",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(run=run)


def render_text(report: ContractsReport) -> str:
    """The report as a table, counterexamples under their function."""
    lines = [
        f"kvspec contracts: CrossHair {report.crosshair_version} over the spec's contracts, "
        f"{report.per_condition_timeout:g} CPU s per postcondition"
        + (f", at most {report.max_paths} paths" if report.max_paths else ""),
        "  inputs: pool and manager states from a corpus of reachable states; every other argument symbolic",
        "",
        f"{'function':<44} {'conds':>5} {'paths':>6} {'seconds':>8}  result",
    ]
    for f in report.functions:
        if f.failures:
            result = f"COUNTEREXAMPLE in {len(f.failures)} of {len(f.conditions)} conditions"
        elif f.not_searched:
            result = f"NOT SEARCHED: {f.summary}"
        else:
            result = f.summary
        lines.append(f"{f.name:<44} {len(f.conditions):>5} {f.num_paths:>6} {f.seconds:>8.1f}  {result}")
        for c in f.failures:
            lines.append(f"    condition: {c.condition}")
            lines.append(textwrap.indent(textwrap.fill(f"{c.status}: {c.message}", 110), "      "))
    found = [f for f in report.functions if f.failures]
    unsearched = [f for f in report.functions if f.not_searched and not f.failures]
    lines.append("")
    if found:
        lines.append(f"counterexamples in {len(found)} of {len(report.functions)} functions ({report.seconds:.1f} s)")
    if unsearched:
        lines.append(
            f"{len(unsearched)} of {len(report.functions)} functions not searched in full (NOT SEARCHED above): "
            "nothing is said about those conditions"
        )
    if not found and not unsearched:
        lines.append(
            f"no counterexample found within budget in any of {len(report.functions)} functions "
            f"({sum(len(f.conditions) for f in report.functions)} postconditions, {report.seconds:.1f} s); "
            "a search, not a proof"
        )
    return "\n".join(lines)


def _as_json(report: ContractsReport) -> dict[str, object]:
    return {
        "crosshair_version": report.crosshair_version,
        "per_condition_timeout": report.per_condition_timeout,
        "max_paths": report.max_paths,
        "ok": report.ok,
        "seconds": round(report.seconds, 3),
        "functions": [
            {
                "function": f.name,
                "ok": f.ok,
                "result": f.summary,
                "conditions": [
                    {
                        "condition": c.condition,
                        "status": c.status,
                        "exhausted": c.exhausted,
                        "paths": c.num_paths,
                        "seconds": round(c.seconds, 3),
                        "counterexample": c.message or None,
                    }
                    for c in f.conditions
                ],
            }
            for f in report.functions
        ],
    }


def run(args: argparse.Namespace) -> int:
    """Run CrossHair over the spec; exit 0 iff every condition was searched and none had a counterexample."""
    try:
        import crosshair  # noqa: F401 - an optional dependency (the `proofs` extra): say so before any work

    except ImportError as e:
        print(f"kvspec contracts: CrossHair does not import ({e}); install it with pip install 'kvspec[proofs]'",
              file=sys.stderr)  # fmt: skip
        return 2
    only = tuple(args.function or ())
    if only:
        known = {f.__name__ for f in contract_functions(DEFAULT_MODULES)} | {
            f"{f.__module__}.{f.__name__}" for f in contract_functions(DEFAULT_MODULES)
        }
        missing = [name for name in only if name not in known]
        if missing:
            print(
                f"kvspec contracts: no function with contracts named {missing[0]!r}; known: "
                + ", ".join(sorted(n for n in known if "." not in n)),
                file=sys.stderr,
            )
            return 2
    report = check_modules(DEFAULT_MODULES, args.per_condition_timeout, args.per_path_timeout, only, args.max_paths)
    print(json.dumps(_as_json(report), indent=2) if args.json else render_text(report))
    if report.found:
        return 1
    return 2 if report.could_not_run else 0
