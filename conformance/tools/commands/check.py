"""`kvspec check`: the CI gate. Run the conformance machines against implementations.

Without `--impl` it checks every built-in implementation whose module imports
(reference, spec, gpu), at both levels, with prefix caching on and off, and
prints one screen: a row per configuration (verdict, examples, steps,
steps per second, distinct states, invariant checks, spec branches reached),
what the whole run reached, then the story of each failure. A configuration
that leaves a spec branch unreached runs up to `--cover-rounds` more rounds of
examples on the next seeds; a branch still unreached is listed. Exit 0 when
everything conforms (a level an implementation does not provide is n/a); 1
when an implementation is wrong (it diverged, crashed or hung, with its
trace); 2 when no verdict was reached (bad arguments, an implementation that
cannot be loaded or built, an inconclusive run, or nothing checked at all).

`--profile auto` asks which ordering profile an implementation follows (the
vLLM regression oracle's question): every configuration is checked once per
vLLM profile, every other setting as the run has it, and each profile's line
says conforms, or gives the shortest trace that breaks it. Exit 0 when some profile conforms in every
configuration, 1 when in some configuration none does, 2 when one could not run.

`--impl vllm` is the installed vLLM (or, with KVSPEC_VLLM_VERSION=X.Y.Z set,
that release in light mode); `--impl vllm@X.Y.Z` is release X.Y.Z's own pool
modules, loaded from its wheel (fetched once, then cached), pool level only.
`--impl vllm-mlx`, `kvcached[@X]`, `tpu-inference[@X]`, `vllm-ascend[@X]` and
`overlay:vllm@X+module:function` are plugins of vLLM's block manager, loaded
from their own distributions as they load in production (kvspec.conformance.targets.plugins).
`--device cpu|cuda:0` is passed to device-backed implementations (gpu).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from hypothesis.database import DirectoryBasedExampleDatabase

from kvspec.conformance.core.files import shown
from kvspec.conformance.core.results import EXIT_COULD_NOT_RUN, CheckResult, Verdict
from kvspec.conformance.core.run_config import (
    AUTO,
    DEFAULT_COVER_ROUNDS,
    LIMITS,
    ConfigError,
    Configuration,
    RunConfig,
)
from kvspec.conformance.runner.isolation import Progress
from kvspec.conformance.runner.profiles import PROFILES as VLLM_PROFILES
from kvspec.conformance.runner.profiles import check_each_profile
from kvspec.conformance.runner.registry import FactoryError, default_targets, load_factory, target_names
from kvspec.conformance.runner.run import check_configuration
from kvspec.conformance.tools.commands._arguments import (
    DEFAULT_TRACE_DIR,
    add_timeouts,
    check_device,
    integer,
    json_output,
    number,
    output_dir,
    output_file,
    refuse,
    text_for_people,
)
from kvspec.conformance.tools.commands._check_output import (
    ProfilesFound,
    auto_exit_code,
    auto_summary_json,
    exit_code,
    header,
    render_summary,
    row,
    summary_json,
    write_json,
    write_junit,
    write_junit_auto,
)
from kvspec.conformance.tools.view import attach_page
from kvspec.spec.ordering import known_profiles

__all__ = ["register", "render_summary", "run", "write_junit"]

DEFAULT_MAX_EXAMPLES = 100
# Rare branches (a duplicate id, an eviction by the manager) can go unreached by
# one seed's 100 examples; a few more rounds reach them, and the summary says so.
# With a time budget and no example count, the budget alone decides.
UNBOUNDED_EXAMPLES = 10**9


def register(subparsers: Any) -> None:
    """Add the `check` subcommand."""
    p = subparsers.add_parser(
        "check",
        help="check implementations against the spec (exit 0 conforms, 1 wrong, 2 no verdict)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    names = target_names()
    p.add_argument(
        "--impl",
        action="append",
        metavar="NAME|module:function",
        help=f"an implementation: a registered target ({names}) or a factory module:function or "
        "path/file.py:function; repeatable "
        "(default: every built-in whose module imports, vllm excepted)",
    )
    p.add_argument("--level", choices=("pool", "manager", "both"), default="both", help="adapter level (default both)")
    p.add_argument(
        "--profile",
        default="vllm-v1",
        help=f"eviction policy claimed ({known_profiles()}; default vllm-v1), "
        "or auto: find which vLLM profiles the implementation conforms to",
    )
    p.add_argument(
        "--groups",
        default=None,
        metavar="LAYOUT",
        help="the KV cache groups of the manager level, in vLLM's group order: full, sliding:W (a window of W "
        "tokens), chunked:C (chunked local attention), comma-separated, e.g. full,sliding:8; drawn: one to three "
        "groups drawn per example; auto (the default): drawn for an implementation that declares "
        "kv_cache_groups, one full group for one that does not",
    )
    p.add_argument(
        "--events",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="check what the pool tells the world too (the default; --no-events leaves it out): the KV cache "
        "events every call publishes (BlockStored, BlockRemoved, AllBlocksCleared; compared with the spec's, and "
        "the router's mirror rules) and, at the manager level, the prefix-cache hit statistics",
    )
    p.add_argument(
        "--device",
        default=None,
        metavar="DEVICE",
        help="device for device-backed implementations: cpu, cuda, cuda:0 (default: the implementation picks)",
    )
    p.add_argument("--caching", choices=("on", "off", "both"), default="both", help="prefix caching (default both)")
    _add_budget_arguments(p)
    p.set_defaults(run=run)


def _add_budget_arguments(p: argparse.ArgumentParser) -> None:
    """How much to run, how long to wait, and where the outputs go."""
    _add_campaign_arguments(p)
    p.add_argument(
        "--time-budget",
        type=number,
        default=None,
        metavar="SECONDS",
        help="wall-clock budget for the whole run, shared among configurations (at most a week)",
    )
    add_timeouts(p)
    p.add_argument("--junit", type=output_file, metavar="PATH", help="also write a JUnit XML report")
    p.add_argument(
        "--json", type=json_output, metavar="PATH", help="also write the whole summary as JSON (- for stdout)"
    )
    p.add_argument(
        "--trace-dir",
        type=output_dir,
        default=DEFAULT_TRACE_DIR,
        metavar="DIR",
        help=f"where failure traces are written (default ./{DEFAULT_TRACE_DIR}, created when one is written)",
    )
    p.add_argument(
        "--html-dir", type=output_dir, metavar="DIR", help="also write a step-through page of each failure trace here"
    )
    p.add_argument(
        "--keep-deepest",
        action="store_true",
        help="also save each configuration's deepest example (it replays to conforms)",
    )
    p.add_argument(
        "--database",
        type=output_dir,
        metavar="DIR",
        help="a Hypothesis example database directory, shared by campaigns and machines",
    )


def _add_campaign_arguments(p: argparse.ArgumentParser) -> None:
    """The size and seeds of each configuration's campaign, and the processes it is shared among."""
    p.add_argument(
        "--max-examples",
        type=integer,
        default=None,
        metavar="N",
        help=f"examples per configuration (default {DEFAULT_MAX_EXAMPLES}, at most {LIMITS['max_examples'].most}; "
        "unbounded with --time-budget)",
    )
    p.add_argument(
        "--steps",
        type=integer,
        default=50,
        metavar="N",
        help=f"rules per example (default 50, at most {LIMITS['steps'].most})",
    )
    p.add_argument(
        "--cover-rounds",
        type=integer,
        default=DEFAULT_COVER_ROUNDS,
        metavar="N",
        help="while a branch is unreached after the examples, up to N more rounds of as many examples on the "
        f"next seeds (default {DEFAULT_COVER_ROUNDS}; 0: none; at most {LIMITS['cover_rounds'].most})",
    )
    p.add_argument("--seed", type=integer, default=0, help="random seed (default 0); same seed and jobs, same campaign")
    p.add_argument(
        "--jobs",
        type=integer,
        default=1,
        metavar="N",
        help="processes per campaign: its examples are shared among N forked children, each on its own seeds, "
        f"run at once (one per core is fastest; default 1, at most {LIMITS['jobs'].most})",
    )


def _default_impls(timeout_s: float | None, folder: Path | None = None) -> tuple[list[str], list[str]]:
    chosen, skipped = [], []
    for name in (target.name for target in default_targets()):
        try:
            load_factory(name, timeout_s, folder)
        except FactoryError as e:
            skipped.append(f"{name}: not checked ({e})")
            continue
        chosen.append(name)
    return chosen, skipped


def _named_impls(names: Sequence[str], timeout_s: float | None, folder: Path) -> tuple[list[str], list[str]]:
    """The implementations that load, and one line for each that does not (said once, not per configuration)."""
    chosen, problems = [], []
    for name in names:
        try:
            load_factory(name, timeout_s, folder)
        except FactoryError as e:
            problems.append(str(e))
            continue
        chosen.append(name)
    return chosen, problems


def run(args: argparse.Namespace) -> int:
    """Run every configuration, print the summary and stories; the exit code is the worst verdict's."""
    try:
        config = _record(args, args.impl or ())
    except ConfigError as e:
        return refuse("kvspec check", e)
    # Loaded here, each under the build time limit, so one that does not load is one line before any work.
    impls, notes = _default_impls(config.build_timeout_s, config.folder) if not args.impl else (args.impl, [])
    if args.impl:
        impls, problems = _named_impls(args.impl, config.build_timeout_s, config.folder)
        for problem in problems:
            print(f"kvspec check: {problem}", file=sys.stderr)
        if problems:
            return 2
    config = dataclasses.replace(config, impls=tuple(impls))
    # vLLM logs a warning for every refused reset, and any implementation may load vLLM, whatever its
    # name (a user's module that imports it); the verdicts and the summary say it all. Errors still show.
    logging.disable(logging.WARNING)
    with text_for_people(config.json):
        _print_header(config, notes)
        start = time.monotonic()
        found: list[ProfilesFound] | None = None  # --profile auto: each configuration's profiles
        results: list[CheckResult] = []
        if config.profile == AUTO:
            found = _run_auto(config, start)
            seconds = time.monotonic() - start
            code, document = auto_exit_code(found), auto_summary_json(found, seconds)
            _print_auto_summary(found, seconds)
        else:
            print(header(list(config.impls)))
            results = _run_configs(config, start)
            seconds = time.monotonic() - start
            code, document = exit_code(results), summary_json(results, seconds)
            print(render_summary(results, seconds))
        if config.junit:
            if found is not None:
                failed = write_junit_auto(found, config.junit, prog="kvspec check")
            else:
                failed = write_junit(results, config.junit, prog="kvspec check")
            if failed:
                return EXIT_COULD_NOT_RUN
            print(f"JUnit report: {shown(config.junit, config.folder)}")
    if config.json is not None:
        if write_json(document, config.json, prog="kvspec check"):
            return EXIT_COULD_NOT_RUN
        if str(config.json) != "-":
            print(f"JSON report: {shown(config.json, config.folder)}")
    return code


def _record(args: argparse.Namespace, impls: Sequence[str]) -> RunConfig:
    """The run's record from the command line: built once, here, and checked by `RunConfig` and the device's runtime.

    Raises:
        ConfigError: a value the record refuses, or a device this machine does not have.
    """
    if args.max_examples is not None:
        max_examples = args.max_examples
    else:
        max_examples = UNBOUNDED_EXAMPLES if args.time_budget is not None else DEFAULT_MAX_EXAMPLES
    config = RunConfig(
        impls=tuple(impls),
        levels=("pool", "manager") if args.level == "both" else (args.level,),
        caching={"on": (True,), "off": (False,), "both": (True, False)}[args.caching],
        profile=args.profile,
        # By default everything the implementation provides (--profile auto: under each profile).
        groups=args.groups if args.groups is not None else AUTO,
        events=args.events if args.events is not None else True,
        device=args.device,
        max_examples=max_examples,
        steps=args.steps,
        cover_rounds=args.cover_rounds,
        time_budget_s=args.time_budget,
        step_timeout_s=args.step_timeout,
        build_timeout_s=args.build_timeout,
        seed=args.seed,
        jobs=args.jobs,
        trace_dir=args.trace_dir,
        html_dir=args.html_dir,
        junit=args.junit,
        json=args.json,
        keep_deepest=args.keep_deepest,
        # absolute, as the record makes its paths: an implementation that changes folder moves nothing of the run
        database=DirectoryBasedExampleDatabase(str(Path(args.database).absolute())) if args.database else None,
    )
    check_device(config.device)
    return config


def _print_header(config: RunConfig, notes: Sequence[str]) -> None:
    """The run's first line: what every configuration checks, and why a default implementation is left out."""
    per = "time budget" if config.time_budget_s else f"{config.max_examples} examples"
    # The defaults (groups as each implementation provides them, events checked) go unsaid; a narrower run says so.
    shown = config.groups not in ("full", AUTO) and "manager" in config.levels
    layout = f", KV cache groups {config.groups}" if shown else ""
    layout += ", KV cache groups full only" if config.groups == "full" and "manager" in config.levels else ""
    layout += "" if config.events else ", KV cache events not checked"
    layout += f", each campaign over {config.jobs} jobs" if config.jobs > 1 else ""
    print(
        f"kvspec check: profile {config.profile}, seed {config.seed}{layout}, {per} x up to {config.steps} steps "
        "per configuration"
    )
    for note in notes:
        print(f"  {note}")


def _shares(config: RunConfig, start: float) -> Iterator[tuple[int, Configuration]]:
    """Each configuration with its share of the run's time budget: the time left, split among those left."""
    # No implementation loaded (every default one missing): nothing to check, and the summary says so.
    configurations = list(config.configurations()) if config.impls else []
    for i, c in enumerate(configurations):
        budget = None
        if config.time_budget_s is not None:
            left = config.time_budget_s - (time.monotonic() - start)
            budget = max(left / (len(configurations) - i), 1.0)
        yield i, dataclasses.replace(c, time_budget_s=budget)


def _run_configs(config: RunConfig, start: float) -> list[CheckResult]:
    """Each configuration in turn, its row printed as it ends; a time budget is shared among those left."""
    results: list[CheckResult] = []
    for _, c in _shares(config, start):
        where = f"{c.impl} {c.level} caching {'on' if c.enable_caching else 'off'}"
        result = check_configuration(c.impl or "", c, _progress_line(where, c.time_budget_s))
        _clear_progress_line()
        attach_page(result, config.html_dir, config.folder)  # the story, printed below and in JUnit, names the page
        results.append(result)
        print(row(result, list(config.impls)), flush=True)
    return results


# A line every this many seconds while a configuration runs, where stderr is not a terminal (a CI log).
_LOG_PROGRESS_EVERY_S = 10.0


def _progress_line(where: str, budget: float | None) -> Progress:
    """What a long configuration prints while it runs, on stderr: a live line on a terminal, else a line now
    and then (examples, steps, elapsed, budget left)."""
    start, last = time.monotonic(), [0.0]
    live = sys.stderr.isatty()

    def show(examples: int, steps: int) -> None:
        elapsed = time.monotonic() - start
        left = f", {max(budget - elapsed, 0.0):.0f} s of its budget left" if budget is not None else ""
        line = f"  running {where}: {examples} examples, {steps} steps, {elapsed:.0f} s{left}"
        if live:
            sys.stderr.write("\r" + line.ljust(_LIVE_WIDTH)[:_LIVE_WIDTH])
            sys.stderr.flush()
        elif elapsed - last[0] >= _LOG_PROGRESS_EVERY_S:
            print(line, file=sys.stderr, flush=True)
            last[0] = elapsed

    return show


_LIVE_WIDTH = 110


def _clear_progress_line() -> None:
    if sys.stderr.isatty():
        sys.stderr.write("\r" + " " * _LIVE_WIDTH + "\r")
        sys.stderr.flush()


def _run_auto(config: RunConfig, start: float) -> list[ProfilesFound]:
    """`--profile auto`: every configuration once per vLLM profile, every other setting as the run has it."""
    print(f"profiles tried per configuration: {', '.join(VLLM_PROFILES)}")
    found: list[ProfilesFound] = []
    for _, c in _shares(config, start):
        where = f"{c.impl} {c.level} caching {'on' if c.enable_caching else 'off'}"
        each = ProfilesFound(check_each_profile(c.impl or "", c, _progress_line(where, c.time_budget_s)))
        _clear_progress_line()
        for r in each.results.values():
            attach_page(r, config.html_dir, config.folder)
        _print_profiles(where, each)
        found.append(each)
    return found


def _print_auto_summary(found: Sequence[ProfilesFound], seconds: float) -> None:
    print(render_summary([r for f in found for r in f.results.values()], seconds, per_profile=True))
    meaning = {0: "some profile conforms in every configuration", 1: "in some configuration no profile conforms"}
    code = auto_exit_code(found)
    print(f"result of profile auto: {meaning.get(code, 'some configuration could not be checked')} (exit {code})")


def _print_profiles(where: str, found: ProfilesFound) -> None:
    """One configuration's profiles, a line each."""
    conforming = found.conforms_to
    if found.exit_code is None:
        print(f"\n{where}: n/a ({found.first.message})")
        return
    print(f"\n{where}: " + (f"conforms to {', '.join(conforming)}" if conforming else "conforms to no profile"))
    for profile, r in found.results.items():
        if r.verdict is Verdict.CONFORMS:
            print(f"  {profile:<14} conforms ({r.examples_run} examples, {r.steps_run} steps)")
        elif r.failure is not None:
            f = r.failure
            print(
                f"  {profile:<14} {r.verdict}: shortest trace {f.num_steps} steps, "
                f"first bad step {f.step} ({f.op}): {f.message[:200]}"
            )
            print(f"  {'':<14} trace: {f.trace_path}")
        else:
            print(f"  {profile:<14} {r.verdict}: {r.message[:300]}")
