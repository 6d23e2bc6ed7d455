"""`kvspec bench TARGET`: the benchmarks, one per implementation.

`reference` times the reference model's operations on pools of 1e3 to 1e6
blocks and prints how each grows with the pool (flat is the claim of its
`Cost:` lines); `gpu` runs gpu_impl's benchmark; `harness` times the
request-level campaign against the reference, one KV cache group layout per
row. Every argument after the
target goes to that benchmark (`kvspec bench reference --sizes 1000 10000`).
A benchmark is imported only when it is asked for, so `gpu` (and torch) is
never loaded by `reference`.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from typing import Any

from kvspec.conformance.core.results import EXIT_COULD_NOT_RUN

# target -> the module whose `main(argv) -> int` runs it
TARGETS = {
    "reference": "kvspec.benchmarks.reference_bench",
    "gpu": "kvspec.benchmarks.gpu_bench",
    "harness": "kvspec.benchmarks.harness_bench",
}


def register(subparsers: Any) -> None:
    """Add the `bench` subcommand."""
    p = subparsers.add_parser(
        "bench",
        help="benchmark an implementation (reference: per-operation cost as the pool grows)",
        description=__doc__.splitlines()[0] if __doc__ else None,
        epilog="exit codes: the benchmark's own (kvspec bench TARGET --help), 2 when it cannot run",
    )
    p.add_argument("target", choices=sorted(TARGETS), help="which implementation to benchmark")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for that benchmark (see TARGET --help)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Run the chosen benchmark; its exit code, or 2 if it cannot be loaded."""
    module_name = TARGETS[args.target]
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        print(f"kvspec bench {args.target}: cannot load {module_name} ({e})", file=sys.stderr)
        return EXIT_COULD_NOT_RUN
    main: Callable[[Sequence[str]], int] = module.main
    return main(list(args.args))
