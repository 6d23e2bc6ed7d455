"""What `kvspec check` writes: the table for people, JUnit XML and JSON for tools.

Every form says how much was checked for every verdict (examples, steps,
branches reached of the spec's), so a green line is never empty work; a level
the implementation does not provide is "n/a" (JUnit: skipped), and the
branches of operations it does not provide are named, not silently dropped
from the count.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvspec.conformance.core.coverage import is_error_branch
from kvspec.conformance.core.lockstep import NOT_EXERCISED_WHY
from kvspec.conformance.core.results import CheckResult, Verdict
from kvspec.conformance.tools.commands._arguments import write_output

__all__ = [
    "ProfilesFound",
    "auto_exit_code",
    "auto_summary_json",
    "header",
    "render_summary",
    "row",
    "summary_json",
    "write_json",
    "write_junit",
    "write_junit_auto",
]

_COLUMNS = ("verdict", "examples", "steps", "steps/s", "states", "invariants", "branches")


def _where(r: CheckResult) -> str:
    return f"{r.impl} {r.level} caching {'on' if r.enable_caching else 'off'}"


def _namer(results: Sequence[CheckResult]) -> Callable[[CheckResult], str]:
    """How the summary's lines name a configuration: by its profile too where the results are of several
    (`--profile auto`)."""
    if len({r.profile for r in results}) > 1:
        return lambda r: f"{_where(r)} profile {r.profile}"
    return _where


def header(results_or_impls: Sequence[str]) -> str:
    """The table's header; the implementation column is as wide as the longest name (never truncated)."""
    width = max([len("implementation"), *(len(i) for i in results_or_impls)]) + 2
    return (
        f"{'implementation':<{width}}{'level':<9}{'caching':<9}{'verdict':<15}{'examples':>9}{'steps':>8}"
        f"{'steps/s':>9}{'states':>8}{'invariants':>12}{'branches':>10}"
    )


def row(r: CheckResult, impls: Sequence[str]) -> str:
    """One configuration's line: its verdict and how much was checked (n/a: nothing to check)."""
    width = max([len("implementation"), *(len(i) for i in impls)]) + 2
    start = f"{r.impl:<{width}}{r.level:<9}{'on' if r.enable_caching else 'off':<9}{r.verdict.value:<15}"
    if r.verdict is Verdict.NOT_APPLICABLE:
        return start + f"{'-':>9}{'-':>8}{'-':>9}{'-':>8}{'-':>12}{'-':>10}"
    reached = sum(1 for b in r.spec_branches if r.coverage.get(b))
    total = len(r.spec_branches) or len(r.branches)
    return start + (
        f"{r.examples_run:>9}{r.steps_run:>8}{r.steps_per_second:>9.0f}{r.states_reached:>8}"
        f"{r.invariants_checked:>12}{f'{reached}/{total}':>10}"
    )


# Workload events worth a number on the summary line: (label, level, coverage keys summed; () = bad inputs).
_HEADLINE = (
    (
        "cached blocks evicted",
        None,
        ("get_new_blocks: evicted a cached block", "allocate_slots: evicted a cached block"),
    ),  # noqa: E501
    ("prefix hits", None, ("get_cached_block: hit", "get_computed_blocks: hit")),
    ("hits capped at len-1", "manager", ("get_computed_blocks: hit capped at len - 1",)),
    ("failed allocations", None, ("get_new_blocks: PoolExhausted", "allocate_slots: too few free blocks")),
    ("resets accepted", "pool", ("reset_prefix_cache: accepted",)),
    ("resets refused", "pool", ("reset_prefix_cache: refused, blocks held",)),
    ("double frees", "pool", ("free_blocks: DoubleFree",)),
    ("preemptions", "manager", ("free: request preempted",)),
    ("decode steps", "manager", ("allocate_slots: decode",)),
    ("bad inputs rejected", None, ()),
)


def _reached_line(results: Sequence[CheckResult]) -> str:
    """The headline counts, only those of the levels that ran (no request counters for a pool-only run)."""
    total: Counter[str] = Counter()
    for r in results:
        total.update(r.coverage)
    ran = {r.level for r in results if r.verdict is not Verdict.NOT_APPLICABLE}
    bad_inputs = sum(n for k, n in total.items() if any(is_error_branch(k, lv) for lv in ran))
    parts = [
        f"{label} {bad_inputs if not keys else sum(total.get(k, 0) for k in keys)}"
        for label, level, keys in _HEADLINE
        if level is None or level in ran
    ]
    line = "reached: " + ", ".join(parts)
    if any(r.events for r in results):
        steps = {k: total.get(f"events: {k}", 0) for k in ("BlockStored", "BlockRemoved", "AllBlocksCleared")}
        misread = total.get("events: a key removed while another block still holds it", 0)
        orphaned = total.get("events: a stored block's parent not held", 0)
        line += (
            f"\nevents (steps that published them): stored {steps['BlockStored']}, removed {steps['BlockRemoved']}, "
            f"cleared {steps['AllBlocksCleared']}; what a router must handle: a key removed while another block "
            f"still holds it {misread}, a stored block whose parent it does not hold {orphaned}"
        )
    return line


def _notes(results: Sequence[CheckResult]) -> list[str]:
    """Extra rounds, branches not reached, operations not provided, mistakes not exercised, notes."""
    where = _namer(results)
    lines = []
    more = [f"{where(r)} +{r.extra_rounds}" for r in results if r.extra_rounds]
    if more:
        lines.append(f"more rounds to reach every branch: {', '.join(more)}")
    for r in results:
        if r.unreached and r.verdict is Verdict.CONFORMS:
            lines.append(f"not reached ({where(r)}): {'; '.join(r.unreached)}")
        if r.absent_ops and r.verdict is not Verdict.NOT_APPLICABLE:
            left_out = [b for b in r.spec_branches if b not in r.branches and not r.coverage.get(b)]
            lines.append(
                f"not provided ({where(r)}): {', '.join(r.absent_ops)} ({len(left_out)} of the spec's "
                f"{len(r.spec_branches)} branches not checked)"
            )
    not_exercised: dict[str, set[str]] = {}
    for r in results:
        if r.not_exercised:
            not_exercised.setdefault(where(r), set()).update(r.not_exercised)
    lines += _mistake_lines(results)
    for place, mistakes in not_exercised.items():
        lines.append(f"not exercised ({place}): {'; '.join(sorted(mistakes))}")
    if not_exercised:
        lines.append(f"  (why: {NOT_EXERCISED_WHY})")
    lines += [f"note ({where(r)}): {r.message}" for r in results if r.message]
    lines += [f"examples ({where(r)}): {why}" for r in results if (why := _more_examples_why(r))]
    return lines


def _mistake_lines(results: Sequence[CheckResult]) -> list[str]:
    """How many caller mistakes were checked, and against which declared reactions."""
    where = _namer(results)
    lines = []
    for r in results:
        if not r.mistakes_checked and not r.not_expressed:
            continue
        declared = [f"{m}: {r.reactions[m]} ({n}x)" for m, n in sorted(r.mistakes_checked.items()) if m in r.reactions]
        total = sum(r.mistakes_checked.values())
        line = f"caller mistakes ({where(r)}): {total} checked, {len(r.mistakes_checked)} kinds"
        lines.append(line + (f"; declared reactions: {'; '.join(declared)}" if declared else ""))
        if r.not_expressed:
            calls = [f"{m} ({n}x)" for m, n in sorted(r.not_expressed.items())]
            lines.append(f"not expressible in its API, not sent ({where(r)}): {'; '.join(calls)}")
    return lines


def _more_examples_why(r: CheckResult) -> str | None:
    """Why a configuration ran more examples than asked for, or None when it did not."""
    if r.examples_asked is None or r.examples_run <= r.examples_asked:
        return None
    rounds = r.examples_asked * (1 + r.extra_rounds)
    parts = [f"{r.examples_run} run for --max-examples {r.examples_asked}"]
    if r.extra_rounds and r.jobs > 1:
        parts.append(
            f"up to {r.extra_rounds} more round(s) of {r.examples_asked} to reach every branch (--cover-rounds; "
            f"each of the {r.jobs} jobs runs its share of a round while a branch is unreached in it)"
        )
    elif r.extra_rounds:
        parts.append(f"{r.extra_rounds} more round(s) of {r.examples_asked} to reach every branch (--cover-rounds)")
    if r.examples_run > rounds:
        parts.append(
            f"{r.examples_run - rounds} that Hypothesis does not count toward max_examples "
            "(discarded as invalid or overrun, and replaced)"
        )
    return "; ".join(parts)


def exit_code(results: Sequence[CheckResult]) -> int:
    """The worst verdict's code; 2 when nothing was checked (no result, or every one n/a)."""
    if not results or all(r.verdict is Verdict.NOT_APPLICABLE for r in results):
        return 2
    return max(r.exit_code for r in results)


def render_summary(results: Sequence[CheckResult], seconds: float, per_profile: bool = False) -> str:
    """Totals, coverage of the whole run, unreached branches, then every failure's story.

    `per_profile` (`--profile auto`): the results are one per profile tried, so
    their tally is no verdict of the run; the caller says which profile held.
    """
    steps = sum(r.steps_run for r in results)
    lines = [
        "",
        f"total: {len(results)} configurations, {steps} steps in {seconds:.1f} s "
        f"({steps / seconds if seconds > 0 else 0:.0f} steps/s), "
        f"{sum(r.states_reached for r in results)} distinct states, "
        f"{sum(r.invariants_checked for r in results)} invariant checks",
        _reached_line(results),
        *_notes(results),
    ]
    for r in results:
        if r.failure is not None:
            lines += ["", "-" * 100, r.failure.story]
    verdicts = Counter(r.verdict.value for r in results)
    code = exit_code(results)
    all_na = all(r.verdict is Verdict.NOT_APPLICABLE for r in results)
    nothing = " (nothing was checked)" if all_na else ""
    tally = ", ".join(f"{n} {v}" for v, n in sorted(verdicts.items()))
    lines += ["", f"profiles tried: {tally}" if per_profile else f"result: {tally}{nothing} (exit {code})"]
    left_out = list(dict.fromkeys(item for r in results for item in r.left_out))
    if left_out:
        lines.append(f"left out of this verdict: {'; '.join(left_out)}")
    return "\n".join(lines)


def _result_json(r: CheckResult) -> dict[str, Any]:
    f = r.failure
    return {
        "impl": r.impl,
        "level": r.level,
        "enable_caching": r.enable_caching,
        "profile": r.profile,
        "groups": r.groups,
        "events": r.events,
        "left_out": list(r.left_out),
        "verdict": r.verdict.value,
        "exit_code": r.exit_code,
        "message": r.message,
        "examples": r.examples_run,
        "steps": r.steps_run,
        "seconds": round(r.seconds, 3),
        "states": r.states_reached,
        "invariants_checked": r.invariants_checked,
        "branches_reached": sorted(b for b in r.spec_branches if r.coverage.get(b)),
        "branches_unreached": r.unreached,
        "spec_branches": len(r.spec_branches),
        "not_provided": list(r.absent_ops),
        "not_exercised": list(r.not_exercised),
        "mistakes_checked": dict(r.mistakes_checked),
        "reactions": dict(r.reactions),
        "not_expressed": dict(r.not_expressed),
        "extra_rounds": r.extra_rounds,
        "seed": r.seed,
        "jobs": r.jobs,
        "failure": None
        if f is None
        else {**f.to_json(), "trace": f.trace_path, "num_steps": f.num_steps, "is_shrunk": f.is_shrunk},
    }


def summary_json(results: Sequence[CheckResult], seconds: float) -> dict[str, Any]:
    """The whole summary as one JSON object: every configuration and the exit code."""
    return {"kvspec": "check", "exit_code": exit_code(results), "seconds": round(seconds, 3),
            "results": [_result_json(r) for r in results]}  # fmt: skip


@dataclass(frozen=True)
class ProfilesFound:
    """One configuration under `--profile auto`: each vLLM profile's result."""

    results: dict[str, CheckResult]  # profile -> its result, in the order tried

    @property
    def first(self) -> CheckResult:
        return next(iter(self.results.values()))

    @property
    def impl(self) -> str:
        return self.first.impl or "impl"

    @property
    def seconds(self) -> float:
        return sum(r.seconds for r in self.results.values())

    @property
    def conforms_to(self) -> list[str]:
        return [p for p, r in self.results.items() if r.verdict is Verdict.CONFORMS]

    @property
    def exit_code(self) -> int | None:
        """0 some profile conforms, 1 none does and one found the implementation wrong, 2 none could say;
        None: n/a (the configuration is not provided)."""
        if all(r.verdict is Verdict.NOT_APPLICABLE for r in self.results.values()):
            return None
        if self.conforms_to:
            return 0
        return 1 if any(r.exit_code == 1 for r in self.results.values()) else 2


def auto_exit_code(found: Sequence[ProfilesFound]) -> int:
    """`--profile auto`'s exit code: the worst configuration's; 2 where every one is n/a or none ran."""
    return max((code for f in found if (code := f.exit_code) is not None), default=2)


def auto_summary_json(found: Sequence[ProfilesFound], seconds: float) -> dict[str, Any]:
    """`--profile auto`'s summary as one JSON object: `summary_json`'s, every profile's result in `results`,
    with `profiles`, which profiles each configuration conforms to."""
    every = [r for f in found for r in f.results.values()]
    configurations = [
        {"impl": f.first.impl, "level": f.first.level, "enable_caching": f.first.enable_caching,
         "profiles_tried": list(f.results), "conforms_to": f.conforms_to, "exit_code": f.exit_code}
        for f in found
    ]  # fmt: skip
    return {**summary_json(every, seconds), "exit_code": auto_exit_code(found), "profiles": configurations}


def _junit_auto_case(suite: ET.Element, found: ProfilesFound, counts: Counter[str]) -> None:
    r = found.first
    case = _testcase(suite, r, "auto", found.seconds, counts)
    verdicts = "; ".join(f"{p}: {x.verdict.value}" for p, x in found.results.items())
    if found.exit_code is None:
        _skipped(case, r, counts)
    elif found.exit_code == 1:
        stories = "\n\n".join(f"{p}:\n{x.failure.story if x.failure else x.message}" for p, x in found.results.items())
        message = f"conforms to no profile ({verdicts})"
        ET.SubElement(case, "failure", message=message[:500], type="diverges").text = stories
        counts["failures"] += 1
    elif found.exit_code == 2:
        message = f"no profile conforms, and none could say the implementation is wrong ({verdicts})"
        ET.SubElement(case, "error", message=message[:500], type="could-not-run").text = message
        counts["errors"] += 1
    ET.SubElement(case, "system-out").text = f"conforms to: {', '.join(found.conforms_to) or 'none'} ({verdicts})"


def write_json(document: Any, where: str | Path, *, prog: str) -> int:
    """Write a JSON document to a path, or to stdout for `-` (`write_output`): 0, or 2 after one line."""
    return write_output(prog, where, json.dumps(document, indent=2) + "\n")


def _testcase(suite: ET.Element, r: CheckResult, profile: str, seconds: float, counts: Counter[str]) -> ET.Element:
    """The test case of `r`'s configuration under `profile` (or "auto"), counted."""
    counts["tests"] += 1
    return ET.SubElement(
        suite,
        "testcase",
        classname=f"kvspec.{r.impl or 'impl'}",
        name=f"{r.level}-caching-{'on' if r.enable_caching else 'off'}-{profile}",
        time=f"{seconds:.3f}",
    )


def _skipped(case: ET.Element, r: CheckResult, counts: Counter[str]) -> None:
    ET.SubElement(case, "skipped", message=f"{r.level} level not provided: {r.message}"[:500])
    counts["skipped"] += 1


def _junit_case(suite: ET.Element, r: CheckResult, counts: Counter[str]) -> None:
    case = _testcase(suite, r, r.profile, r.seconds, counts)
    if r.verdict is Verdict.NOT_APPLICABLE:
        _skipped(case, r, counts)
    elif r.verdict in (Verdict.COULD_NOT_RUN, Verdict.INCONCLUSIVE):
        ET.SubElement(case, "error", message=r.message[:500], type=r.verdict.value).text = r.message
        counts["errors"] += 1
    elif r.verdict is not Verdict.CONFORMS:
        f = r.failure
        message = f"{r.verdict} at step {f.step} ({f.op}): {f.message}" if f else r.verdict.value
        element = ET.SubElement(case, "failure", message=message[:500], type=r.verdict.value)
        element.text = f.story if f else r.message
        counts["failures"] += 1
    out = ET.SubElement(case, "system-out")
    reached = sum(1 for b in r.spec_branches if r.coverage.get(b))
    out.text = (
        f"examples={r.examples_run} steps={r.steps_run} steps_per_second={r.steps_per_second:.0f} "
        f"states={r.states_reached} invariants_checked={r.invariants_checked} "
        f"branches={reached}/{len(r.spec_branches)} extra_rounds={r.extra_rounds}"
    )


def write_junit(results: Sequence[CheckResult], path: str | Path, *, prog: str = "kvspec check") -> int:
    """A JUnit XML report: one test case per configuration, grouped by implementation (`write_output`: 0, or
    2 after one line)."""
    cases = [(r.impl or "impl", r.seconds, lambda suite, counts, r=r: _junit_case(suite, r, counts)) for r in results]
    return write_output(prog, path, _junit_document(cases))


def write_junit_auto(found: Sequence[ProfilesFound], path: str | Path, *, prog: str = "kvspec check") -> int:
    """`--profile auto`'s JUnit XML report: one test case per configuration, which passes where some profile
    conforms (a profile it breaks is that search's answer, not a failure), grouped by implementation."""
    cases = [(f.impl, f.seconds, lambda suite, counts, f=f: _junit_auto_case(suite, f, counts)) for f in found]
    return write_output(prog, path, _junit_document(cases))


# A test case: its implementation (the suite it goes in), its seconds, and what adds it to a suite.
_JUnitCase = tuple[str, float, Callable[[ET.Element, Counter[str]], None]]


def _junit_document(cases: Sequence[_JUnitCase]) -> bytes:
    root = ET.Element("testsuites", name="kvspec check")
    by_impl: dict[str, list[_JUnitCase]] = {}
    for case in cases:
        by_impl.setdefault(case[0], []).append(case)
    totals = Counter[str]()
    for impl, impl_cases in by_impl.items():
        suite = ET.SubElement(root, "testsuite", name=f"kvspec.{impl}")
        counts = Counter[str]()
        for _, _, add in impl_cases:
            add(suite, counts)
        for key in ("tests", "failures", "errors", "skipped"):
            suite.set(key, str(counts[key]))
        suite.set("time", f"{sum(seconds for _, seconds, _ in impl_cases):.3f}")
        totals.update(counts)
    for key in ("tests", "failures", "errors", "skipped"):
        root.set(key, str(totals[key]))
    document: bytes = ET.tostring(root, encoding="utf-8", xml_declaration=True)
    return document
