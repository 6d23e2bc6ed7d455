"""`kvspec prove`: every lemma of docs/design.md proved, bounded or refuted by z3, with timings.

A lemma is "proved" only when the negation of every obligation is unsat for
every pool size; "bounded (n <= N)" when it was only checked up to a size;
"refuted" with the counterexample printed as a pool state; "vacuous" (no
state satisfies the hypotheses) is a failure; "unknown" (z3 gave up) is no
answer at all. Each lemma's deliberately false twin must come out refuted,
and each profile is reported with the lemmas it breaks. Exit 0 when every
answer is the expected one, 1 when one is not (a wrong or vacuous answer), 2
when there is no verdict: z3 gave up on a check (and no other one failed), an
unknown profile or lemma, or nothing to check.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from typing import TYPE_CHECKING, Any

from kvspec.conformance.core.run_config import MAX_SECONDS
from kvspec.conformance.tools.commands._arguments import positive_float
from kvspec.spec.ordering import is_profile, known_profiles

if TYPE_CHECKING:
    from kvspec.spec.lemmas.report import LemmaResult, ProofReport

__all__ = ["BUDGET_S", "exit_code", "register", "render_text", "run"]

BUDGET_S = 60.0  # every lemma, every profile, on a 2-core machine


def register(subparsers: Any) -> None:
    """Add the `prove` subcommand."""
    p = subparsers.add_parser(
        "prove",
        help="prove the eviction-order lemmas and the inductive invariants with z3",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        epilog="exit codes: 0 every answer the expected one; 1 a wrong answer (a lemma refuted where it holds, a false "
        "twin proved, vacuous hypotheses); 2 no verdict: z3 gave up (unknown) and nothing else failed, z3 does not "
        "import, an unknown profile or lemma, or nothing to check",
    )
    p.add_argument(
        "--profile",
        action="append",
        metavar="P",
        help="check under this profile (repeatable; default: every named profile and lru-lfu:0.5)",
    )
    p.add_argument(
        "--lemma",
        action="append",
        metavar="NAME",
        help="check only this lemma (a name like lemma_hit_cap_within_prompt, or its number; repeatable)",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--timeout", type=_z3_timeout, default=20.0, metavar="S",
                   help="seconds per z3 call (default 20, from 0.001 to a week)")  # fmt: skip
    p.set_defaults(run=run)


def _z3_timeout(text: str) -> float:
    """Seconds per z3 call: z3 counts whole milliseconds in 32 bits, where 0 is no limit at all and a larger
    count wraps around to a small one, so either would silently be another limit than the one asked for."""
    value = positive_float(text)
    if not 0.001 <= value <= MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"must be from 0.001 (a millisecond) to {MAX_SECONDS:g} seconds (a week); "
                                         f"got {text}")  # fmt: skip
    return value


def _row(number: str, name: str, profile: str, result: str, seconds: str) -> str:
    return f"{number:>2}  {name:<44} {profile:<14} {result:<36} {seconds:>7}"


def _breaks(report: ProofReport) -> list[str]:
    """A line per profile: the lemmas it breaks, and those that do not speak of it."""
    lines = []
    for profile in report.profiles:
        named = ", ".join(f"lemma {lem.number} ({lem.name})" for lem in report.breaks(profile)) or "no lemma"
        outside = report.not_applicable(profile)
        numbers = ", ".join(str(lem.number) for lem in outside)
        verb = "lemmas {} do" if len(outside) > 1 else "lemma {} does"
        aside = f"; {verb.format(numbers)} not speak of it"
        lines.append(f"profile {profile} breaks {named}{aside if outside else ''}")
    return lines


def render_text(report: ProofReport) -> str:
    """The report as the table a person reads, counterexamples under their rows."""
    import z3  # the prover's dependency; imported here so `kvspec --help` never needs it

    lines = [
        f"kvspec prove: the lemmas of docs/design.md, checked with z3 {z3.get_version_string()} "
        f"(profiles: {', '.join(report.profiles)})",
        "  proved: the negation is unsat for every pool size; bounded (n <= N): only for sizes up to N;",
        "  refuted: z3 found a counterexample (shown); vacuous: a failure; unknown: z3 gave up, no answer.",
        "",
        _row("#", "lemma", "profile", "result", "seconds"),
    ]
    previous = None
    for r in report.results:
        lemma = r.lemma
        if r.kind == "lemma" and previous != (lemma.number, "lemma"):
            lines.append(_row(str(lemma.number), lemma.name, "", "", ""))
            lines.append(f"    claim: {lemma.claim}; holds for {lemma.holds_for_text}")
            if lemma.applies_to_text != "every profile":
                lines.append(f"    speaks of: {lemma.applies_to_text}")
        if r.kind == "twin" and previous != (lemma.number, "twin"):
            lines.append(f"    false twin: {lemma.twin}")
        previous = (lemma.number, r.kind)
        v = r.verdict
        if r.expected == "holds":
            outcome = r.status_text
        elif r.kind == "twin":
            outcome = "refuted, as it must be" if r.ok else f"{r.status_text}: MUST BE REFUTED"
        else:
            outcome = "refuted: the profile breaks it" if r.ok else f"{r.status_text}: MUST BE REFUTED"
        if not r.ok:
            outcome += "  NO ANSWER" if v.status == "unknown" else "  FAILED"
        profile = r.profile or "(any profile)"
        lines.append(_row("", "", profile, outcome, f"{v.seconds:.2f}"))
        if v.status in ("refuted", "unknown", "vacuous") and v.obligation:
            lines.append(f"      obligation: {v.obligation}")
        if v.counterexample:
            lines.append(textwrap.indent(v.counterexample, "    "))
        if v.reason and v.status != "refuted":
            lines.append(f"      z3: {v.reason}")
    lines += ["", *_breaks(report)]
    slowest = report.slowest
    within = "within" if report.seconds <= BUDGET_S else "OVER"
    failed = [r for r in report.results if not r.ok]
    lines.append(
        f"{len(report.results) - len(failed)} of {len(report.results)} checks as expected in "
        f"{report.seconds:.1f} s ({within} the {BUDGET_S:.0f} s budget); slowest: lemma {slowest.lemma.number} "
        f"{slowest.lemma.name}{'' if slowest.kind == 'lemma' else ' (twin)'}"
        f"{f' under {slowest.profile}' if slowest.profile else ''}, {slowest.verdict.seconds:.2f} s"
    )
    wrong = [r for r in failed if r.verdict.status != "unknown"]
    if wrong:
        lines.append("FAILED: " + _checks(wrong))
    if len(wrong) < len(failed):
        unanswered = _checks([r for r in failed if r.verdict.status == "unknown"])
        lines.append(f"NO ANSWER (z3 gave up; a larger --timeout may answer): {unanswered}")
    return "\n".join(lines)


def _checks(results: list[LemmaResult]) -> str:
    return "; ".join(f"lemma {r.lemma.number} {r.kind} {r.profile or ''}".strip() for r in results)


def exit_code(report: ProofReport) -> int:
    """0 when every answer is the expected one; 1 when one is wrong (a refutation where the lemma holds, a
    proof of a false twin, vacuous hypotheses); else 2 when z3 gave up on some check: no verdict, not a
    wrong answer."""
    if report.ok:
        return 0
    return 1 if any(not r.ok and r.verdict.status != "unknown" for r in report.results) else 2


def run(args: argparse.Namespace) -> int:
    """Check every lemma under the chosen profiles; exit as `exit_code` says."""
    unknown = [p for p in args.profile or () if not is_profile(p)]
    if unknown:
        print(f"kvspec prove: unknown profile={unknown[0]!r}; known profiles: {known_profiles()}", file=sys.stderr)
        return 2
    try:
        # optional dependency (the proofs extra): the lemmas import z3
        from kvspec.spec.lemmas import LEMMAS
        from kvspec.spec.lemmas.report import prove
    except ImportError as e:  # z3 is an optional dependency (the `proofs` extra)
        print(f"kvspec prove: z3 does not import ({e}); install it with pip install 'kvspec[proofs]'", file=sys.stderr)
        return 2
    chosen = list(LEMMAS)
    if args.lemma:
        wanted = set(args.lemma)
        chosen = [lem for lem in LEMMAS if lem.name in wanted or str(lem.number) in wanted]
        found = {lem.name for lem in chosen} | {str(lem.number) for lem in chosen}
        missing = sorted(wanted - found)
        if missing:
            names = ", ".join(lem.name for lem in LEMMAS)
            print(
                f"kvspec prove: unknown lemma={missing[0]!r}; known lemmas: {names} (or their numbers 1-{len(LEMMAS)})",
                file=sys.stderr,
            )
            return 2
    report = prove(args.profile, chosen, timeout_s=args.timeout)
    if not report.results:  # no verdict for work not done
        print(
            f"kvspec prove: {', '.join(f'lemma {lem.number} ({lem.applies_to_text})' for lem in chosen)} "
            f"speaks of none of the profiles {', '.join(report.profiles)}: nothing was checked",
            file=sys.stderr,
        )
        return 2
    if args.json:
        print(json.dumps(report.as_json(), indent=2))
    else:
        print(render_text(report))
    return exit_code(report)
