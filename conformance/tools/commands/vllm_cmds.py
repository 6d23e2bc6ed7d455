"""`kvspec oracle` and `kvspec hashes`: kvspec against real vLLM releases."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

from kvspec.conformance.core.results import EXIT_COULD_NOT_RUN, EXIT_DIVERGES, EXIT_OK, Verdict
from kvspec.conformance.core.run_config import ConfigError, RunConfig
from kvspec.conformance.targets.archives import is_release_number
from kvspec.conformance.targets.plugins.targets import TARGETS
from kvspec.conformance.targets.vllm.adapter import spec_hashing_for
from kvspec.conformance.targets.vllm.factories import loadable_release
from kvspec.conformance.targets.vllm.hashes import FLEET_SEED, compare_release, measure_release, measure_releases
from kvspec.conformance.targets.vllm.lightmode import NEWEST
from kvspec.conformance.targets.vllm.releases import HASH_CHAIN_DIFFERENCES, RELEASES
from kvspec.conformance.targets.vllm.v0 import V0_RELEASES
from kvspec.conformance.tools import oracle, oracle_matrix
from kvspec.conformance.tools import plugin_matrix as matrix
from kvspec.conformance.tools.commands._arguments import (
    output_dir,
    positive_float,
    positive_int,
    refuse,
    release_number,
)


def register(subparsers: Any) -> None:
    """Add the `oracle` and `hashes` subcommands."""
    p = subparsers.add_parser(
        "oracle",
        help="check vLLM releases, each in its own process, and print one matrix",
        description="Run the harness against each vLLM release (pool level in light mode from the release's "
        "wheel; request level in a virtual environment per release, created on demand) and print "
        "version x (level, caching, profile, hash compatibility), with notes on known bugs found.",
    )
    p.add_argument(
        "--vllm",
        nargs="*",
        default=[],
        metavar="VERSION",
        help="releases, e.g. 0.6.6 0.10.2 0.34.0 (before 0.8.0: vLLM v0's allocator; a release kvspec's table does not "
        "declare is checked too; newest: the package registry's newest, asked now)",
    )
    p.add_argument("--all", action="store_true", help="every release from 0.8.0 to the newest")
    p.add_argument(
        "--plugins",
        nargs="*",
        default=None,
        metavar="NAME",
        help="instead of vLLM releases: the plugin targets (vllm-mlx, kvcached[@X], tpu-inference[@X], "
        "vllm-ascend[@X]; none named: every target, as the README's table), one matrix",
    )
    p.add_argument(
        "--level", choices=("pool", "manager", "both"), default=None, help="default: pool (both with --plugins)"
    )
    p.add_argument("--caching", choices=("on", "off", "both"), default="both")
    p.add_argument(
        "--max-examples", type=positive_int, default=100, help="harness examples per profile and caching setting"
    )
    p.add_argument("--time-budget", type=positive_float, default=120.0, help="harness seconds per release and level")
    p.add_argument(
        "--trace-dir", type=output_dir, default="kvspec-oracle-traces", help="where divergence traces are written"
    )
    p.add_argument(
        "--events",
        action="store_true",
        help="also check, per release and level, the KV cache events (the router's mirror rules, the spec's "
        "events; at the request level the hit statistics): one more campaign with caching on, an events column",
    )
    p.add_argument("--json", action="store_true", help="print the matrix as JSON")
    p.add_argument("--bench", action="store_true", help="instead: benchmark the reference against vLLM's BlockPool")
    p.add_argument(
        "--bench-version", type=release_number, default=None, help="the release to benchmark (default: the newest)"
    )
    p.set_defaults(run=run_oracle_cmd)
    _register_hashes(subparsers)


def _register_hashes(subparsers: Any) -> None:
    """Add the `hashes` subcommand."""
    h = subparsers.add_parser(
        "hashes",
        help="golden hash vectors: kvspec's block-hash chain against vLLM's, on the same inputs",
        epilog="exit codes: 0 every vector matches (--all: every release measured); 1 a vector differs; "
        "2 vLLM cannot be loaded, or a release not measured",
    )
    h.add_argument("--impl", choices=("vllm",), default="vllm")
    which = h.add_mutually_exclusive_group()
    which.add_argument(
        "--version",
        type=release_number,
        default=None,
        help="a release to load in light mode (default: the installed vLLM)",
    )
    which.add_argument(
        "--all",
        action="store_true",
        help="every release from 0.8.0 to the newest, one line each: whether its chain is kvspec's (what "
        "kvspec check --impl vllm compares exactly) and whether two engine processes agree on it (fleet)",
    )
    h.add_argument("--json", action="store_true")
    h.add_argument("--verbose", action="store_true", help="print every vector")
    h.add_argument("--no-fleet", action="store_true",
                   help="skip the fleet check (two fresh processes per PYTHONHASHSEED setting)")  # fmt: skip
    h.set_defaults(run=run_hashes_cmd)


def run_oracle_cmd(args: argparse.Namespace) -> int:
    """Run the oracle. Exit 0 when every cell conforms to some profile; 1 when a cell conforms to none (each
    profile diverges, with its trace); 2 when a cell or a profile reached no verdict (not run, inconclusive)."""

    if args.bench:
        # optional dependency (the gpu extra, through the benchmarks' imports): only --bench runs it
        from kvspec.benchmarks.vllm_bench import main as bench_main

        return bench_main(args.bench_version or RELEASES[-1])
    try:  # the record each worker's campaign is run under: refused here, not by every worker after its wheel
        RunConfig(max_examples=args.max_examples, time_budget_s=args.time_budget)
    except ConfigError as e:
        return refuse("kvspec oracle", e)
    if args.plugins is not None:
        return run_plugins_cmd(args)
    args.level = args.level or "pool"
    if args.all and args.vllm:  # either would be the other's silent loss: every release run for one asked, or not
        print("kvspec oracle: --all and --vllm each name the releases; give one of them", file=sys.stderr)
        return EXIT_COULD_NOT_RUN
    versions = _oracle_versions(list(RELEASES) if args.all else list(args.vllm))
    if versions is None:
        return EXIT_COULD_NOT_RUN
    levels = ["pool", "manager"] if args.level == "both" else [args.level]
    cachings = ["on", "off"] if args.caching == "both" else [args.caching]

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    rows = oracle.run_oracle(
        versions,
        levels=levels,
        caching=args.caching,
        max_examples=args.max_examples,
        time_budget=args.time_budget,
        trace_dir=args.trace_dir,
        log=log,
        events=args.events,
    )
    if args.json:
        print(json.dumps(oracle_matrix.rows_to_json(rows), indent=1))
    else:
        print(oracle_matrix.format_matrix(rows, levels, cachings))
    return _oracle_exit(rows)


def _oracle_versions(asked: list[str]) -> list[str] | None:
    """The releases to run, ``newest`` asked of the registry and each release the table does not declare
    fetched now; None after a one-line refusal (no release named, not a release number, one the registry lacks)."""
    if not asked:
        print("kvspec oracle: name releases with --vllm X [Y ...] or use --all", file=sys.stderr)
        return None
    unknown = [v for v in asked if v not in V0_RELEASES and v != NEWEST and not is_release_number(v)]
    if unknown:
        v0_only = [v for v in V0_RELEASES if v not in RELEASES]
        known = f"{V0_RELEASES[0]} to {RELEASES[-1]} ({v0_only[0]} to {v0_only[-1]}: vLLM v0's allocator)"
        print(
            f"kvspec oracle: {', '.join(unknown)} is not a vLLM release number (e.g. 0.34.0, or newest); "
            f"kvspec's table declares {known}, and any other release the package registry has is checked too",
            file=sys.stderr,
        )
        return None
    try:  # a release the table does not declare is fetched now: one the registry lacks is refused before any work
        return list(dict.fromkeys(v if v in RELEASES or v in V0_RELEASES else loadable_release(v) for v in asked))
    except ValueError as e:
        print(f"kvspec oracle: {e}", file=sys.stderr)
        return None


def run_plugins_cmd(args: argparse.Namespace) -> int:
    """`kvspec oracle --plugins`: exit 0 when every cell conforms, 1 when one diverges (with its trace), 2 when
    one reached no verdict (could not run, inconclusive). Probes are findings and do not change the exit code."""

    rows: list[tuple[str, str | None]] = []
    for name in args.plugins:
        target, at, base = name.partition("@")
        if target not in TARGETS or (TARGETS[target].base is None and base) or (at and not base):
            print(f"kvspec oracle: unknown plugin target {name!r}; known: {', '.join(TARGETS)}", file=sys.stderr)
            return EXIT_COULD_NOT_RUN
        if base and base != NEWEST and not is_release_number(base):  # a worker per cell would find it, each
            print(f"kvspec oracle: {name}: {base!r} is not a vLLM release number (e.g. 0.34.0, or newest)",
                  file=sys.stderr)  # fmt: skip
            return EXIT_COULD_NOT_RUN
        rows.append((target, base or None))
    level = args.level or "both"
    rows_found = matrix.run_plugin_matrix(
        rows or matrix.default_rows(),
        levels=["pool", "manager"] if level == "both" else [level],
        cachings=["on", "off"] if args.caching == "both" else [args.caching],
        max_examples=args.max_examples,
        time_budget=args.time_budget,
        trace_dir=args.trace_dir,
        log=lambda msg: print(msg, file=sys.stderr, flush=True),
    )
    text = json.dumps(matrix.rows_to_json(rows_found), indent=1) if args.json else None
    print(text or matrix.format_plugin_matrix(rows_found))
    verdicts = [Verdict(c["verdict"]) for r in rows_found for c in r.cells.values()]
    verdicts = [v for v in verdicts if v is not Verdict.NOT_APPLICABLE]
    if any(r.error for r in rows_found) or not verdicts or any(v.exit_code == 2 for v in verdicts):
        return EXIT_COULD_NOT_RUN
    return EXIT_DIVERGES if any(v.exit_code == 1 for v in verdicts) else EXIT_OK


def _oracle_exit(rows: Any) -> int:
    # A cell the release has no level for says "n/a", as a level's verdict does.
    cells = [c for row in rows for c in row.cells.values() if c.status != Verdict.NOT_APPLICABLE.value]
    verdicts = [Verdict(r["verdict"]) for c in cells for r in c.profiles.values()]
    if not cells or any(c.status != "ran" for c in cells) or any(v.exit_code == 2 for v in verdicts):
        return EXIT_COULD_NOT_RUN
    # The events column (--events): a release whose stream breaks a rule or differs from the spec's diverges.
    events = [r for row in rows for c in row.events.values() if c.status == "ran" for r in c.profiles.values()]
    if any(Verdict(r["verdict"]).exit_code == 2 for r in events):
        return EXIT_COULD_NOT_RUN
    if any(Verdict(r["verdict"]) is not Verdict.CONFORMS for r in events):
        return EXIT_DIVERGES
    return EXIT_OK if all(c.conforms_to() for c in cells) else EXIT_DIVERGES


def run_hashes_cmd(args: argparse.Namespace) -> int:
    """Compare the chains; exit 0 when every vector matches, 1 when one differs, 2 when vLLM cannot be loaded."""

    logging.disable(logging.WARNING)

    if args.all:
        return _hashes_all(args.json)
    try:
        report = compare_release(args.version)
    except ImportError as e:
        print(f"kvspec hashes: {e}; vLLM's modules need the vllm extra: pip install 'kvspec[vllm]'", file=sys.stderr)
        return EXIT_COULD_NOT_RUN
    except RuntimeError as e:
        print(f"kvspec hashes: cannot load vLLM: {e}", file=sys.stderr)
        return EXIT_COULD_NOT_RUN
    lines, fleet = ([], None) if args.no_fleet else _fleet_lines(args.version, report.version)
    if args.json:
        print(json.dumps({**report.to_json(), **({"fleet": fleet} if fleet is not None else {})}, indent=1))
    else:
        print(f"vllm=={report.version} ({report.source}) against kvspec.spec.hashing: {report.summary()}")
        for line in lines:
            print(f"  {line}")
        for r in report.results:
            if args.verbose or not r.match:
                seed = "unset" if r.seed is None else r.seed
                mark = "ok  " if r.match else "DIFF"
                print(f"  {mark} {r.hash_fn:<12} PYTHONHASHSEED={seed:<6} {r.case:<24} "
                      f"vllm {' '.join(h[:12] for h in r.vllm)}")  # fmt: skip
                if not r.match:
                    print(f"{'':>53}kvspec {' '.join(h[:12] for h in r.kvspec)}")
        for s in report.skipped:
            print(f"  skipped: {s}")
    return EXIT_OK if report.compatible else EXIT_DIVERGES


def _hashes_all(as_json: bool) -> int:
    """`kvspec hashes --all`: every release's chain and fleet answer, measured; exit 0, or 2 when a worker failed."""

    try:
        measured = measure_releases(RELEASES)
    except (RuntimeError, ImportError) as e:
        print(f"kvspec hashes: cannot measure the releases: {e}", file=sys.stderr)
        return EXIT_COULD_NOT_RUN
    if as_json:
        print(json.dumps([{"version": m.version, "hash_fn": m.hash_fn, "kvspec_chain": m.is_kvspec_chain,
                           "differences": list(m.differences), "fleet": m.fleet, "python": m.python}
                          for m in measured.values()], indent=1))  # fmt: skip
        return EXIT_OK
    python = next(iter(measured.values())).python
    print(f"vLLM's block-hash chain per release, its default hash function, two fresh processes with "
          f"PYTHONHASHSEED={FLEET_SEED} and two with it unset (Python {python}):")  # fmt: skip
    header = ("version", "hash_fn", "chain", "kvspec check --impl vllm compares hash values", "fleet-consistent")
    rows = [
        (m.version, m.hash_fn, "kvspec's" if m.is_kvspec_chain else "differs: " + ", ".join(m.differences),
         "exactly" if m.is_kvspec_chain else "exactly at the pool level, as names at the request level", m.fleet)
        for m in measured.values()
    ]  # fmt: skip
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
    for row in (header, *rows):
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    print("differences: " + "; ".join(f"{d}: {why}" for d, why in HASH_CHAIN_DIFFERENCES.items()))
    return EXIT_OK


def _fleet_lines(version: str | None, found: str) -> tuple[list[str], dict[str, Any] | None]:
    """What a fleet and the harness make of a release's chain, measured in fresh processes (text lines, JSON)."""

    try:
        measured = measure_release(version or "")
    except KeyError:
        return [f"fleet-consistent hashes: not measured: vllm=={found} is not in kvspec's release table "
                "(its default hash function is not known)"], None  # fmt: skip
    except RuntimeError as e:
        return [f"fleet-consistent hashes: not measured: {e}"], None
    hash_fn, seed = spec_hashing_for(measured.version)
    exact = (
        f"hash values compared exactly at the pool and the request level (the spec hashes with {hash_fn!r}, "
        f"seed {seed!r})"
        if measured.is_kvspec_chain
        else "hash values compared exactly at the pool level (the harness hands them over), as names at the "
        "request level (vLLM computes the chain there)"
    )
    data = {"answer": measured.fleet, "hash_fn": measured.hash_fn, "python": measured.python,
            "kvspec_chain": measured.is_kvspec_chain, "differences": list(measured.differences)}  # fmt: skip
    return [measured.fleet_line(), measured.chain_line(), f"kvspec check --impl vllm: {exact}"], data
