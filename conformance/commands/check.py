"""`kvspec check`: the CI gate. Run the conformance machines against implementations.

Without `--impl` it checks every built-in implementation whose module imports
(reference, spec, gpu), at both levels, with prefix caching on and off, and
prints one screen: a row per configuration (verdict, examples, steps,
steps per second, distinct states, invariant checks, spec branches reached),
what the whole run reached, then the story of each failure. A configuration
that leaves a spec branch unreached runs up to `--cover-rounds` more rounds of
examples on the next seeds; a branch still unreached is listed. Exit 0 when
everything conforms, 1 when something diverges, 2 when something could not
be checked (it crashed, hung, could not be loaded or built, bad arguments).

`--profile auto` asks which ordering profile an implementation follows (the
vLLM regression oracle's question): every configuration is checked once per
vLLM profile, and each profile's line says conforms, or gives the shortest
trace that breaks it. Exit 0 when some profile conforms in every
configuration, 1 when in some configuration none does, 2 when one could not run.

`--impl vllm` is the installed vLLM (or, with KVSPEC_VLLM_VERSION=X.Y.Z set,
that release in light mode); `--impl vllm@X.Y.Z` is release X.Y.Z's own pool
modules, loaded from its wheel (fetched once, then cached), pool level only.
`--device cpu|cuda:0` is passed to device-backed implementations (gpu).
"""

from __future__ import annotations

import argparse
import logging
import time
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvspec.conformance.commands._arguments import (
    DEFAULT_TRACE_DIR,
    json_output,
    non_negative_int,
    output_dir,
    output_file,
    positive_float,
    positive_int,
)
from kvspec.conformance.lockstep import NOT_EXERCISED_WHY
from kvspec.conformance.registry import BUILTIN_IMPLS, DEFAULT_IMPLS, FactoryError, load_factory
from kvspec.conformance.results import CheckResult, Verdict
from kvspec.conformance.runner import run_check
from kvspec.conformance.view import attach_page
from kvspec.spec.ordering import PROFILES

__all__ = ["register", "render_summary", "run", "write_junit"]

DEFAULT_MAX_EXAMPLES = 100
# Rare branches (a duplicate id, an eviction by the manager) can go unreached by
# one seed's 100 examples; a few more rounds reach them, and the summary says so.
DEFAULT_COVER_ROUNDS = 3
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
    names = ", ".join(sorted(BUILTIN_IMPLS)) + ", vllm@X.Y.Z"
    p.add_argument(
        "--impl",
        action="append",
        metavar="NAME|module:function",
        help=f"an implementation: a built-in name ({names}) or a factory module:function; repeatable "
        "(default: every built-in whose module imports, vllm excepted)",
    )
    p.add_argument("--level", choices=("pool", "manager", "both"), default="both", help="adapter level (default both)")
    p.add_argument(
        "--profile",
        default="vllm-v1",
        help=f"ordering profile claimed ({', '.join(PROFILES)}; default vllm-v1), "
        "or auto: find which vLLM profiles the implementation conforms to",
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
    p.add_argument(
        "--max-examples",
        type=positive_int,
        default=None,
        metavar="N",
        help=f"examples per configuration (default {DEFAULT_MAX_EXAMPLES}; unbounded with --time-budget)",
    )
    p.add_argument("--steps", type=positive_int, default=50, metavar="N", help="rules per example (default 50)")
    p.add_argument(
        "--cover-rounds",
        type=non_negative_int,
        default=DEFAULT_COVER_ROUNDS,
        metavar="N",
        help="while a branch is unreached after the examples, up to N more rounds of as many examples on the "
        f"next seeds (default {DEFAULT_COVER_ROUNDS}; 0: none)",
    )
    p.add_argument("--seed", type=non_negative_int, default=0, help="random seed (default 0); same seed, same campaign")
    p.add_argument(
        "--time-budget",
        type=positive_float,
        default=None,
        metavar="SECONDS",
        help="wall-clock budget for the whole run, shared among configurations",
    )
    p.add_argument(
        "--step-timeout",
        type=positive_float,
        default=10.0,
        metavar="SECONDS",
        help="the most one implementation call may take (default 10)",
    )
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


def _default_impls() -> tuple[list[str], list[str]]:
    chosen, skipped = [], []
    for name in DEFAULT_IMPLS:
        try:
            load_factory(name)
        except FactoryError as e:
            skipped.append(f"{name}: not checked ({e})")
            continue
        chosen.append(name)
    return chosen, skipped


def _argument_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the arguments, in one line, or None."""
    if args.profile != AUTO and args.profile not in PROFILES:
        known = ", ".join(sorted(PROFILES))
        return f"unknown profile {args.profile!r}; known profiles: {known}, or {AUTO}"
    for name in ("max_examples", "steps"):
        value = getattr(args, name)
        if value is not None and value < 1:
            return f"--{name.replace('_', '-')} must be at least 1; got {value}"
    if args.cover_rounds < 0:
        return f"--cover-rounds must be at least 0; got {args.cover_rounds}"
    return None


def run(args: argparse.Namespace) -> int:
    """Run every configuration, print the summary and stories; the exit code is the worst verdict's."""
    problem = _argument_problem(args)
    if problem is not None:
        print(f"kvspec check: {problem}")
        return 2
    impls, notes = (args.impl, []) if args.impl else _default_impls()
    if any(name == "vllm" or name.startswith("vllm@") for name in impls):
        # vLLM logs a warning for every refused reset; the verdicts and the summary say it all.
        logging.disable(logging.WARNING)
    levels = ("pool", "manager") if args.level == "both" else (args.level,)
    modes = {"on": (True,), "off": (False,), "both": (True, False)}[args.caching]
    configs = [(impl, lv, caching) for impl in impls for lv in levels for caching in modes]
    max_examples = args.max_examples or (UNBOUNDED_EXAMPLES if args.time_budget else DEFAULT_MAX_EXAMPLES)
    database = None
    if args.database:
        from hypothesis.database import DirectoryBasedExampleDatabase

        database = DirectoryBasedExampleDatabase(args.database)
    per = "time budget" if args.time_budget else f"{max_examples} examples"
    print(f"kvspec check: profile {args.profile}, seed {args.seed}, {per} x up to {args.steps} steps per configuration")
    for note in notes:
        print(f"  {note}")
    if args.profile == AUTO:
        return _run_auto(args, configs, max_examples, database)
    print(_HEADER)
    start = time.monotonic()
    results = _run_configs(args, configs, max_examples, database, start)
    print(render_summary(results, time.monotonic() - start))
    if args.junit:
        write_junit(results, args.junit)
        print(f"JUnit report: {args.junit}")
    return max((r.exit_code for r in results), default=2)


def _run_configs(
    args: argparse.Namespace, configs: Sequence[tuple[str, str, bool]], max_examples: int, database: Any, start: float
) -> list[CheckResult]:
    """Each configuration in turn, its row printed as it ends; a time budget is shared among those left."""
    results: list[CheckResult] = []
    for i, (impl, lv, caching) in enumerate(configs):
        budget = None
        if args.time_budget is not None:
            left = args.time_budget - (time.monotonic() - start)
            budget = max(left / (len(configs) - i), 1.0)
        result = run_check(
            impl,
            level=lv,
            enable_caching=caching,
            profile=args.profile,
            max_examples=max_examples,
            seed=args.seed,
            time_budget_s=budget,
            step_timeout_s=args.step_timeout,
            trace_dir=args.trace_dir,
            impl=impl,
            steps_per_example=args.steps,
            keep_deepest=args.keep_deepest,
            database=database,
            device=args.device,
            cover_rounds=args.cover_rounds,
        )
        attach_page(result, args.html_dir)  # the story, printed below and in JUnit, names the page
        results.append(result)
        print(_row(result), flush=True)
    return results


AUTO = "auto"


def _run_auto(
    args: argparse.Namespace, configs: Sequence[tuple[str, str, bool]], max_examples: int, database: Any
) -> int:
    """`--profile auto`: every configuration once per vLLM profile; which ones it conforms to."""
    from kvspec.conformance.vllm.oracle import PROFILES as VLLM_PROFILES
    from kvspec.conformance.vllm.oracle import detect_profiles

    print(f"profiles tried per configuration: {', '.join(VLLM_PROFILES)}")
    start = time.monotonic()
    codes: list[int] = []
    everything: list[CheckResult] = []
    for i, (impl, lv, caching) in enumerate(configs):
        budget = None
        if args.time_budget is not None:
            left = args.time_budget - (time.monotonic() - start)
            budget = max(left / (len(configs) - i), 1.0)
        found = detect_profiles(
            impl, lv, caching, max_examples, time_budget_s=budget, trace_dir=args.trace_dir, seed=args.seed
        )
        for r in found.values():
            attach_page(r, args.html_dir)
        where = f"{impl} {lv} caching {'on' if caching else 'off'}"
        conforming = [p for p, r in found.items() if r.verdict is Verdict.CONFORMS]
        ran = [r for r in found.values() if r.verdict is not Verdict.COULD_NOT_RUN]
        code = 0 if conforming else (1 if ran else 2)
        codes.append(code)
        print(f"\n{where}: " + (f"conforms to {', '.join(conforming)}" if conforming else "conforms to no profile"))
        for profile, r in found.items():
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
        everything += found.values()
    print(render_summary(everything, time.monotonic() - start))
    worst = max(codes, default=2)
    print(f"profile auto: exit {worst} (0: some profile conforms everywhere; 1: none in some configuration)")
    return worst


_HEADER = (
    f"{'implementation':<16}{'level':<9}{'caching':<9}{'verdict':<15}{'examples':>9}{'steps':>8}"
    f"{'steps/s':>9}{'states':>8}{'invariants':>12}{'branches':>10}"
)


def _row(r: CheckResult) -> str:
    reached = len(r.branches) - len(r.unreached)
    return (
        f"{r.impl[:15]:<16}{r.level:<9}{'on' if r.enable_caching else 'off':<9}{r.verdict.value:<15}{r.examples_run:>9}"
        f"{r.steps_run:>8}{r.steps_per_second:>9.0f}{r.states_reached:>8}{r.invariants_checked:>12}"
        f"{f'{reached}/{len(r.branches)}':>10}"
    )


# Workload events worth a number on the summary line: (label, coverage keys summed).
_HEADLINE = (
    ("cached blocks evicted", ("get_new_blocks: evicted a cached block", "allocate_slots: evicted a cached block")),
    ("prefix hits", ("get_cached_block: hit", "get_computed_blocks: hit")),
    ("hits capped at len-1", ("get_computed_blocks: hit capped at len - 1",)),
    ("failed allocations", ("get_new_blocks: PoolExhausted", "allocate_slots: too few free blocks")),
    ("resets accepted", ("reset_prefix_cache: accepted",)),
    ("resets refused", ("reset_prefix_cache: refused, blocks held",)),
    ("double frees", ("free_blocks: DoubleFree",)),
    ("preemptions", ("free: request preempted",)),
    ("decode steps", ("allocate_slots: decode",)),
    ("bad inputs rejected", ()),
)


def render_summary(results: Sequence[CheckResult], seconds: float) -> str:
    """Totals, coverage of the whole run, unreached branches, then every failure's story."""
    total: Counter[str] = Counter()
    for r in results:
        total.update(r.coverage)
    steps = sum(r.steps_run for r in results)
    lines = [
        "",
        f"total: {len(results)} configurations, {steps} steps in {seconds:.1f} s "
        f"({steps / seconds if seconds > 0 else 0:.0f} steps/s), "
        f"{sum(r.states_reached for r in results)} distinct states, "
        f"{sum(r.invariants_checked for r in results)} invariant checks",
    ]
    bad_inputs = sum(n for k, n in total.items() if ": " in k and k.split(": ", 1)[1] in _ERROR_NAMES)
    parts = []
    for label, keys in _HEADLINE:
        n = bad_inputs if not keys else sum(total.get(k, 0) for k in keys)
        parts.append(f"{label} {n}")
    lines.append("reached: " + ", ".join(parts))
    more = [
        f"{r.impl} {r.level} caching {'on' if r.enable_caching else 'off'} +{r.extra_rounds}"
        for r in results
        if r.extra_rounds
    ]
    if more:
        lines.append(f"more rounds to reach every branch: {', '.join(more)}")
    for r in results:
        if r.unreached and r.verdict is Verdict.CONFORMS:
            where = f"{r.impl} {r.level} caching {'on' if r.enable_caching else 'off'}"
            lines.append(f"not reached ({where}): {'; '.join(r.unreached)}")
    not_exercised: dict[str, set[str]] = {}
    for r in results:
        if r.not_exercised:
            where = f"{r.impl} {r.level} caching {'on' if r.enable_caching else 'off'}"
            not_exercised.setdefault(where, set()).update(r.not_exercised)
    for where, mistakes in not_exercised.items():
        lines.append(f"not exercised ({where}): {'; '.join(sorted(mistakes))}")
    if any(r.not_exercised for r in results):
        lines.append(f"  (why: {NOT_EXERCISED_WHY})")
    for r in results:
        if r.message:
            lines.append(f"note ({r.impl} {r.level} caching {'on' if r.enable_caching else 'off'}): {r.message}")
    for r in results:
        if r.failure is not None:
            lines += ["", "-" * 100, r.failure.story]
    verdicts = Counter(r.verdict for r in results)
    worst = max((r.exit_code for r in results), default=2)
    lines.append("")
    lines.append("result: " + ", ".join(f"{n} {v}" for v, n in sorted(verdicts.items())) + f" (exit {worst})")
    return "\n".join(lines)


_ERROR_NAMES = frozenset(
    {"InvalidRequest", "InvalidBlock", "DoubleFree", "AlreadyCached", "PoolExhausted", "NotWritable"}
)


def write_junit(results: Sequence[CheckResult], path: str | Path) -> None:
    """A JUnit XML report: one test case per configuration, grouped by implementation."""
    root = ET.Element("testsuites", name="kvspec check")
    by_impl: dict[str, list[CheckResult]] = {}
    for r in results:
        by_impl.setdefault(r.impl or "impl", []).append(r)
    totals = Counter[str]()
    for impl, rs in by_impl.items():
        suite = ET.SubElement(root, "testsuite", name=f"kvspec.{impl}")
        counts = Counter[str]()
        for r in rs:
            case = ET.SubElement(
                suite,
                "testcase",
                classname=f"kvspec.{impl}",
                name=f"{r.level}-caching-{'on' if r.enable_caching else 'off'}-{r.profile}",
                time=f"{r.seconds:.3f}",
            )
            counts["tests"] += 1
            if r.verdict is Verdict.COULD_NOT_RUN:
                ET.SubElement(case, "error", message=r.message[:500], type=Verdict.COULD_NOT_RUN.value).text = r.message
                counts["errors"] += 1
            elif r.verdict is not Verdict.CONFORMS:
                f = r.failure
                message = f"{r.verdict} at step {f.step} ({f.op}): {f.message}" if f else r.verdict.value
                element = ET.SubElement(case, "failure", message=message[:500], type=r.verdict.value)
                element.text = f.story if f else r.message
                counts["failures"] += 1
            out = ET.SubElement(case, "system-out")
            out.text = (
                f"examples={r.examples_run} steps={r.steps_run} steps_per_second={r.steps_per_second:.0f} "
                f"states={r.states_reached} invariants_checked={r.invariants_checked} "
                f"branches={len(r.branches) - len(r.unreached)}/{len(r.branches)} extra_rounds={r.extra_rounds}"
            )
        for key in ("tests", "failures", "errors"):
            suite.set(key, str(counts[key]))
        suite.set("time", f"{sum(r.seconds for r in rs):.3f}")
        totals.update(counts)
    for key in ("tests", "failures", "errors"):
        root.set(key, str(totals[key]))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    ET.ElementTree(root).write(path, encoding="utf-8", xml_declaration=True)
