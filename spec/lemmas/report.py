"""Checking every lemma for some profiles: the results `kvspec prove` prints.

For each profile, a lemma that holds for it must come out proved (or bounded,
said so); one that does not must come out refuted, and the profile is said to
break it. Every lemma's false twin must come out refuted. A lemma that does not
mention the ordering rule is checked once, not once per profile.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import z3

from kvspec.spec.lemmas import LEMMAS, Lemma
from kvspec.spec.lemmas.prover import DEFAULT_MAX_BOUND, DEFAULT_TIMEOUT_S, Verdict, decide_false, decide_true
from kvspec.spec.ordering import DEFAULT_PROFILE, PROFILES, profile_rule

__all__ = ["DEFAULT_PROFILES", "LemmaResult", "ProofReport", "prove"]

# Every named profile, and one weighted hybrid (lru-lfu:W takes any W >= 0; `--profile` picks others).
DEFAULT_PROFILES: tuple[str, ...] = (*PROFILES, "lru-lfu:0.5")

JsonValue = None | bool | int | float | str | list["JsonValue"] | dict[str, "JsonValue"]


@dataclass(frozen=True)
class LemmaResult:
    """One check: a lemma (or its twin) under one profile, what was expected and what z3 said."""

    lemma: Lemma  # the lemma
    profile: str | None  # the profile; None for a check that does not depend on it
    kind: Literal["lemma", "twin"]  # the lemma itself, or its deliberately false twin
    expected: Literal["holds", "fails"]  # what must come out: proved/bounded, or refuted
    verdict: Verdict  # what z3 said

    @property
    def ok(self) -> bool:
        """Whether z3's answer is the expected one (unknown and vacuous never are)."""
        if self.expected == "holds":
            return self.verdict.status in ("proved", "bounded")
        return self.verdict.status == "refuted"

    @property
    def status_text(self) -> str:
        """The verdict as printed: bounded results name their bound."""
        v = self.verdict
        plural = "s" if v.num_obligations != 1 else ""
        if v.status == "bounded":
            return f"bounded (n <= {v.bound}), {v.num_obligations} obligation{plural}"
        if v.status == "proved":
            return f"proved, {v.num_obligations} obligation{plural}"
        return v.status

    def as_json(self) -> dict[str, JsonValue]:
        """This result as plain JSON values."""
        v = self.verdict
        return {
            "number": self.lemma.number,
            "lemma": self.lemma.name,
            "profile": self.profile,
            "kind": self.kind,
            "expected": self.expected,
            "status": v.status,
            "bound": v.bound,
            "ok": self.ok,
            "seconds": round(v.seconds, 4),
            "obligations": v.num_obligations,
            "obligation": v.obligation,
            "counterexample": v.counterexample,
            "reason": v.reason,
        }


@dataclass(frozen=True)
class ProofReport:
    """Every check of one `kvspec prove` run."""

    profiles: tuple[str, ...]  # the profiles checked
    results: tuple[LemmaResult, ...]  # in lemma order, the lemma's checks before its twin's
    seconds: float  # wall time of the whole run

    @property
    def ok(self) -> bool:
        """Whether every check gave the expected answer."""
        return all(r.ok for r in self.results)

    @property
    def slowest(self) -> LemmaResult:
        """The check that took longest."""
        return max(self.results, key=lambda r: r.verdict.seconds)

    def not_applicable(self, profile: str) -> list[Lemma]:
        """The lemmas whose claim does not speak of `profile` (checked for other profiles only)."""
        rule = profile_rule(profile)
        return [lem for lem in LEMMAS if lem.profile_sensitive and not lem.applies_to(rule)]

    def breaks(self, profile: str) -> list[Lemma]:
        """The lemmas `profile` breaks (refuted under it, as they declare)."""
        return [
            r.lemma
            for r in self.results
            if r.kind == "lemma" and r.profile == profile and r.expected == "fails" and r.ok
        ]

    def as_json(self) -> dict[str, JsonValue]:
        """The whole report as plain JSON values."""
        slowest = self.slowest
        return {
            "z3_version": z3.get_version_string(),
            "profiles": list(self.profiles),
            "ok": self.ok,
            "seconds": round(self.seconds, 3),
            "slowest": {
                "lemma": slowest.lemma.name,
                "profile": slowest.profile,
                "kind": slowest.kind,
                "seconds": round(slowest.verdict.seconds, 4),
            },
            "breaks": {p: [lem.name for lem in self.breaks(p)] for p in self.profiles},
            "not_applicable": {p: [lem.name for lem in self.not_applicable(p)] for p in self.profiles},
            "lemmas": [
                {
                    "number": lem.number,
                    "lemma": lem.name,
                    "claim": lem.claim,
                    "holds_for": lem.holds_for_text,
                    "applies_to": lem.applies_to_text,
                    "twin": lem.twin,
                }
                for lem in LEMMAS
            ],
            "results": [r.as_json() for r in self.results],
        }


def prove(
    profiles: Sequence[str] | None = None,
    lemmas: Sequence[Lemma] = LEMMAS,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    max_bound: int = DEFAULT_MAX_BOUND,
) -> ProofReport:
    """Check `lemmas` (and their twins) under each of `profiles` that each lemma applies to.

    Default profiles: DEFAULT_PROFILES.

    Raises:
        ValueError: a profile is unknown.
    """
    names = tuple(profiles) if profiles is not None else DEFAULT_PROFILES
    rules = [profile_rule(name) for name in names]  # raises on an unknown profile first
    start = time.perf_counter()
    results: list[LemmaResult] = []
    for lemma in lemmas:
        checked = (
            [(name, rule) for name, rule in zip(names, rules) if lemma.applies_to(rule)]
            if lemma.profile_sensitive
            else [(None, profile_rule(DEFAULT_PROFILE))]
        )
        for name, rule in checked:
            holds = lemma.holds_for(rule)
            decide = decide_true if holds else decide_false
            verdict = decide(lemma.obligations(rule), timeout_s=timeout_s, max_bound=max_bound)
            results.append(LemmaResult(lemma, name, "lemma", "holds" if holds else "fails", verdict))
        twin_checked = checked if lemma.twin_profile_sensitive else checked[:1]
        for name, rule in twin_checked:
            verdict = decide_false(lemma.twin_obligations(rule), timeout_s=timeout_s, max_bound=max_bound)
            profile = name if lemma.twin_profile_sensitive else None
            results.append(LemmaResult(lemma, profile, "twin", "fails", verdict))
    return ProofReport(names, tuple(results), time.perf_counter() - start)
