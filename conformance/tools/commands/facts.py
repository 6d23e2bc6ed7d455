"""`kvspec facts IMPL`: what a vLLM's block pool measures as, beside what kvspec's table declares.

IMPL is a vLLM as --impl names it: a release (vllm@0.34.0, from its wheel in
light mode, any release the package registry has), a source tree
(vllm@path/to/checkout, the folder that holds vllm/), or the installed vLLM
(vllm). Every fact of kvspec's release table that can be measured is: the
API from the loaded code (signatures, attributes), each behaviour from a
short scenario on a pool of 8 blocks. A fact that is not measured says so
and why; it is never filled in from the table.

The table sets each fact beside the value declared for one release of
kvspec's table: by default the newest declared release at or below the
measured version (the newest declared one for a vLLM newer than the table),
--beside VERSION another. A row marked * differs. --entry prints instead
the ReleaseFacts(...) of the measured vLLM, for releases.py: each fact not
measured taken from the release beside it, with a comment saying so.

Exit codes: 0 every measured fact equals the release beside it, 1 one
differs (so a CI that pins "no change" fails on it), 2 no answer (a name
that loads no vLLM, a --beside the table does not declare).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

from kvspec.conformance.core.adapter import AdapterConfig
from kvspec.conformance.core.results import EXIT_COULD_NOT_RUN, EXIT_DIVERGES, EXIT_OK
from kvspec.conformance.targets.vllm.adapter import VllmRelease
from kvspec.conformance.targets.vllm.factories import factory_for
from kvspec.conformance.targets.vllm.lightmode import LightModeError
from kvspec.conformance.targets.vllm.measure import measure_facts
from kvspec.conformance.targets.vllm.releases import RELEASES
from kvspec.conformance.tools.vllm_facts import beside_release, compare, entry_literal, format_table, rows_json

__all__ = ["register", "run"]


def register(subparsers: Any) -> None:
    """Add the `facts` subcommand."""
    p = subparsers.add_parser(
        "facts",
        help="a vLLM's block-pool facts, measured, beside those kvspec's table declares (exit 1 when one differs)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("impl", metavar="IMPL", help="the vLLM: vllm@<release>, vllm@<dir> or vllm")
    p.add_argument(
        "--beside", metavar="VERSION", help="the declared release to compare with (default: the newest at or below)"
    )
    p.add_argument("--entry", action="store_true", help="print the ReleaseFacts(...) of IMPL for releases.py instead")
    p.add_argument("--json", action="store_true", help="print the comparison as JSON (the entry included)")
    p.set_defaults(run=run)


def _refuse(message: str) -> int:
    print(f"kvspec facts: {message}", file=sys.stderr)
    return EXIT_COULD_NOT_RUN


def _load(impl: str) -> VllmRelease:
    """The vLLM ``impl`` names, loaded at the pool level as every command loads it.

    Raises:
        ValueError: the name loads no vLLM (the message says why).
    """
    if impl != "vllm" and not impl.startswith("vllm@"):
        raise ValueError(f"{impl!r} names no vLLM BlockPool: name vllm@<release>, vllm@<dir> or vllm")
    try:
        adapter: Any = factory_for(impl)(AdapterConfig(level="pool", num_gpu_blocks=8))
    except (ImportError, LightModeError) as e:
        raise ValueError(str(e)) from None
    release: VllmRelease = adapter.release
    return release


def run(args: argparse.Namespace) -> int:
    """Measure IMPL; print its facts beside a declared release's; exit 1 if a measured one differs."""
    if args.beside is not None and args.beside not in RELEASES:
        return _refuse(f"--beside {args.beside}: not a release kvspec's table declares ({RELEASES[0]}..{RELEASES[-1]})")
    logging.disable(logging.WARNING)  # vLLM logs the refused reset of a scenario; the facts say it all
    try:
        release = _load(args.impl)
    except ValueError as e:
        return _refuse(" ".join(str(e).split()))
    measured = measure_facts(release)
    beside = args.beside or beside_release(measured.version)
    rows = compare(measured, beside)
    if args.json:
        print(json.dumps(rows_json(args.impl, measured, beside, rows), indent=1))
    elif args.entry:
        print(entry_literal(measured, beside, rows))
    else:
        print(format_table(measured, beside, rows))
    return EXIT_DIVERGES if any(r.differs for r in rows) else EXIT_OK
