"""Deciding a lemma: every obligation's negation unsat is a proof; a model is a counterexample.

A lemma is a list of obligations (one per operation, per invariant, per case
of an induction). Each obligation builds its formula for a `Universe`, so the
same text is checked unbounded (a `ForAll` over every size: "proved") or for
every size up to a bound (unrolled: "bounded (n <= N)", never called proved).

z3's three answers are kept apart, as its own examples do: `unsat` of
hypotheses-and-not-claim proves the claim; `sat` refutes it, and the model is
printed as a pool state; `unknown` (a timeout, or a quantifier z3 gave up on)
is a failure, never a pass. A proof whose hypotheses contradict each other
would prove anything, so every proved obligation is also checked to have a
state satisfying its hypotheses (at a small size); one that has none is
reported "vacuous", a failure.

A refutation is searched for at sizes 1, 2, ... up to `max_bound` first, so
the counterexample printed is the smallest the search finds, with a handful
of blocks rather than the huge ids an unbounded model tends to pick.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import z3

from kvspec.spec.lemmas.backend import Universe

__all__ = ["Formula", "Obligation", "Status", "Verdict", "decide_false", "decide_true"]

Status = Literal["proved", "bounded", "refuted", "unknown", "vacuous"]

DEFAULT_TIMEOUT_S = 20.0  # per solver call; beyond it z3 answers unknown
DEFAULT_MAX_BOUND = 5  # sizes tried when searching for a small counterexample
_EMATCHING_TIMEOUT_S = 3.0  # each instantiation-only attempt at a quantified proof
_EMATCHING_SEEDS = (0, 1, 2)  # the attempts' random seeds


@dataclass(frozen=True)
class Formula:
    """An obligation built for one universe: hypotheses, the claim, and how to print a model."""

    hypotheses: Sequence[z3.BoolRef]  # what is assumed (the state satisfies the invariants, ...)
    claim: z3.BoolRef  # what must follow
    render: Callable[[z3.ModelRef], str]  # a counterexample as a readable pool state


@dataclass(frozen=True)
class Obligation:
    """One thing z3 must show."""

    name: str  # what it shows, in words
    build: Callable[[Universe], Formula]  # its formula for a universe
    bound: int | None = None  # None: proved for every size; n: only checked up to size n


@dataclass(frozen=True)
class Verdict:
    """What z3 said about a list of obligations."""

    status: Status  # proved / bounded / refuted / unknown / vacuous
    seconds: float  # wall time of every solver call
    num_obligations: int  # how many obligations were checked
    bound: int | None = None  # for bounded: the largest size covered
    obligation: str | None = None  # refuted / unknown / vacuous: the obligation concerned
    counterexample: str | None = None  # refuted: the model as a pool state
    reason: str | None = None  # unknown: z3's reason


def _check(obligation: Obligation, universe: Universe, timeout_s: float) -> tuple[z3.CheckSatResult, str]:
    formula = obligation.build(universe)
    query = [*universe.assumptions, *formula.hypotheses, z3.Not(formula.claim)]
    if universe.bound is None:
        # Quantified: first by instantiation on matching terms alone (the quantifiers carry
        # triggers for it), which closes these proofs in milliseconds where model-based
        # instantiation can wander off; a few seeds, since its search order is luck. Only
        # its unsat is used (it cannot answer sat); anything else goes to z3's default.
        for seed in _EMATCHING_SEEDS:
            quick = z3.Solver()
            quick.set(timeout=int(min(timeout_s, _EMATCHING_TIMEOUT_S) * 1000), mbqi=False, random_seed=seed)
            quick.add(*query)
            if quick.check() == z3.unsat:
                return z3.unsat, ""
    solver = z3.Solver()
    solver.set(timeout=int(timeout_s * 1000))
    solver.add(*query)
    result = solver.check()
    if result == z3.sat:
        return result, formula.render(solver.model())
    if result == z3.unknown:
        return result, solver.reason_unknown()
    return result, ""


def _satisfiable(obligation: Obligation, max_bound: int, timeout_s: float) -> tuple[z3.CheckSatResult, str]:
    """Whether some state of size at most `max_bound` satisfies the obligation's hypotheses: sat, unsat, or
    unknown with z3's reason when a size went unanswered (a timeout is no evidence that the hypotheses are
    vacuous)."""
    unanswered = ""
    for n in range(1, max_bound + 1):
        universe = Universe(bound=n)
        formula = obligation.build(universe)
        solver = z3.Solver()
        solver.set(timeout=int(timeout_s * 1000))
        solver.add(*universe.assumptions, *formula.hypotheses)
        result = solver.check()
        if result == z3.sat:
            return result, ""
        if result == z3.unknown and not unanswered:
            unanswered = f"at size {n}, whether any state satisfies the hypotheses: {solver.reason_unknown()}"
    return (z3.unknown, unanswered) if unanswered else (z3.unsat, "")


def _smallest_counterexample(obligation: Obligation, max_bound: int, timeout_s: float) -> tuple[z3.CheckSatResult, str]:
    """The first counterexample at sizes 1..max_bound (unsat: none up to max_bound)."""
    for n in range(1, max_bound + 1):
        result, text = _check(obligation, Universe(bound=n), timeout_s)
        if result != z3.unsat:
            return result, text
    return z3.unsat, ""


def _stopped(
    status: Status,
    obligations: Sequence[Obligation],
    obligation: Obligation,
    start: float,
    *,
    counterexample: str | None = None,
    reason: str | None = None,
) -> Verdict:
    """The verdict of a list stopped at one obligation: refuted, unknown or vacuous."""
    return Verdict(
        status=status,
        seconds=time.perf_counter() - start,
        num_obligations=len(obligations),
        obligation=obligation.name,
        counterexample=counterexample,
        reason=reason,
    )


def _held(obligations: Sequence[Obligation], start: float) -> Verdict:
    """The verdict of a list whose every obligation held: bounded by its smallest bound, if any has one, else proved."""
    seconds = time.perf_counter() - start
    bounds = [ob.bound for ob in obligations if ob.bound is not None]
    if bounds:
        return Verdict(status="bounded", seconds=seconds, num_obligations=len(obligations), bound=min(bounds))
    return Verdict(status="proved", seconds=seconds, num_obligations=len(obligations))


def decide_true(
    obligations: Sequence[Obligation],
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    max_bound: int = DEFAULT_MAX_BOUND,
) -> Verdict:
    """Prove every obligation; the first that fails decides the verdict."""
    start = time.perf_counter()
    for ob in obligations:
        # Bound to a name, so alive until the next: z3's model depends on which terms are alive in
        # its context, and this keeps the counterexamples `kvspec prove` prints as they were.
        universe = Universe(bound=ob.bound)
        result, text = _check(ob, universe, timeout_s)
        small_bound = min(max_bound, ob.bound or max_bound)
        if result == z3.sat:
            small, small_text = _smallest_counterexample(ob, small_bound, timeout_s)
            return _stopped("refuted", obligations, ob, start, counterexample=small_text if small == z3.sat else text)
        if result == z3.unknown:
            return _stopped("unknown", obligations, ob, start, reason=text)
        satisfiable, why = _satisfiable(ob, small_bound, timeout_s)
        if satisfiable == z3.unknown:
            return _stopped("unknown", obligations, ob, start, reason=why)
        if satisfiable == z3.unsat:
            reason = f"no state of size <= {small_bound} satisfies the hypotheses"
            return _stopped("vacuous", obligations, ob, start, reason=reason)
    return _held(obligations, start)


def decide_false(
    obligations: Sequence[Obligation],
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    max_bound: int = DEFAULT_MAX_BOUND,
) -> Verdict:
    """Refute a claim expected to be false: find a counterexample to one of its obligations.

    Small sizes are searched first; if none refutes it there, the unbounded
    check runs, so a claim that is in fact true comes out proved (a failure
    for a false twin), not merely unrefuted.
    """
    start = time.perf_counter()
    for ob in obligations:
        result, text = _smallest_counterexample(ob, min(max_bound, ob.bound or max_bound), timeout_s)
        if result == z3.sat:
            return _stopped("refuted", obligations, ob, start, counterexample=text)
    for ob in obligations:
        result, text = _check(ob, Universe(bound=ob.bound), timeout_s)
        if result == z3.sat:
            return _stopped("refuted", obligations, ob, start, counterexample=text)
        if result == z3.unknown:
            return _stopped("unknown", obligations, ob, start, reason=text)
    return _held(obligations, start)
