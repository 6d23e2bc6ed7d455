"""The z3 logic backend, and how a lemma's quantifiers over index ranges are built.

`Z3` is `spec.ordering.Backend` with z3's connectives, so the ordering and
arithmetic predicates of `spec.ordering` run unchanged on symbolic values: the
proofs use the spec's own definitions, not a transcription of them.

`Universe` decides what "for every index i in [lo, hi)" becomes. Unbounded, it
is a z3 `ForAll`: a proof then holds for every pool size. Bounded by `n`, every
size is at most `n` and the quantifier is unrolled into a finite conjunction:
quantifier-free, so z3 always decides it and a counterexample has a handful of
blocks, small enough to print as a pool state. With concrete bounds (a sampled
state) the unrolling is exact, which is how the tests evaluate an encoding on
a concrete state and compare it with the Python predicate.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeAlias

import z3

from kvspec.spec.ordering import Backend

__all__ = ["Z3", "Index", "Universe", "z3_lex_lt"]

# An index into an array-valued field: a concrete int (unrolled) or a z3 integer term.
Index: TypeAlias = int | z3.ArithRef


def _and(*xs: object) -> z3.BoolRef:
    return z3.And(*xs) if xs else z3.BoolVal(True)


def _or(*xs: object) -> z3.BoolRef:
    return z3.Or(*xs) if xs else z3.BoolVal(False)


def z3_lex_lt(a: Sequence[object], b: Sequence[object]) -> z3.BoolRef:
    """Strict lexicographic order on two sequences of concrete length, as z3 terms.

    `a < b` iff at the first position where they differ a's element is
    smaller, or a is a proper prefix of b (Python's tuple order).
    """
    cases = []
    for k in range(min(len(a), len(b))):
        same_before = [a[i] == b[i] for i in range(k)]
        cases.append(_and(*same_before, a[k] < b[k]))  # type: ignore[operator]
    if len(a) < len(b):
        cases.append(_and(*(a[i] == b[i] for i in range(len(a)))))
    return _or(*cases)


Z3: Backend[z3.BoolRef] = Backend(
    and_=_and,
    or_=_or,
    not_=z3.Not,
    implies=z3.Implies,
    ite=z3.If,
    lex_lt=z3_lex_lt,
)

_fresh = itertools.count()


@dataclass
class Universe:
    """How quantifiers over index ranges are built, and the size bound of a bounded check.

    Unbounded (`bound=None`): quantifiers are `ForAll`. Bounded: the builder
    declares every size with `size()`, which confines it to `[lo, bound]`, and
    every index range lies within `[0, cap)`; the quantifier is unrolled over
    that window. A range whose ends are both Python ints is unrolled exactly.
    """

    bound: int | None = None  # None: every size; n: every size up to n
    assumptions: list[z3.BoolRef] = field(default_factory=list)  # the size bounds added by size()

    @property
    def cap(self) -> int:
        """The unrolling window: room for a queue of `bound` blocks plus a batch of `bound`."""
        assert self.bound is not None, "cap of an unbounded universe"
        return 2 * self.bound + 2

    def size(self, name: str, lo: int = 0) -> z3.ArithRef:
        """A fresh size variable, at least `lo` (and at most the bound, when bounded)."""
        v = z3.Int(name)
        self.assumptions.append(v >= lo)
        if self.bound is not None:
            self.assumptions.append(v <= self.bound)
        return v

    def forall(
        self,
        lo: Index,
        hi: Index,
        body: Callable[[Index], z3.BoolRef],
        limit: Index | None = None,
        trigger: Callable[[z3.ArithRef], z3.ExprRef] | None = None,
    ) -> z3.BoolRef:
        """`body(i)` for every integer i with lo <= i < hi.

        `limit`, when given, is known to be at least `hi`: a concrete one
        narrows the unrolling window. `trigger(i)`, when given, is the term
        whose appearance makes z3 instantiate the unbounded quantifier.
        """
        if isinstance(lo, int) and isinstance(hi, int):
            return _and(*(body(i) for i in range(lo, hi)))
        if self.bound is None:
            i = z3.Int(f"i!{next(_fresh)}")
            patterns = [trigger(i)] if trigger is not None else []
            return z3.ForAll([i], z3.Implies(z3.And(lo <= i, i < hi), body(i)), patterns=patterns)
        window = limit if isinstance(limit, int) else self.cap
        return _and(*(z3.Implies(z3.And(lo <= i, i < hi), body(i)) for i in range(window)))

    def forall_pairs(self, lo: Index, hi: Index, body: Callable[[Index, Index], z3.BoolRef]) -> z3.BoolRef:
        """`body(i, j)` for every pair lo <= i < j < hi."""
        if isinstance(lo, int) and isinstance(hi, int):
            return _and(*(body(i, j) for i in range(lo, hi) for j in range(i + 1, hi)))
        if self.bound is None:
            n = next(_fresh)
            i, j = z3.Int(f"i!{n}"), z3.Int(f"j!{n}")
            return z3.ForAll([i, j], z3.Implies(z3.And(lo <= i, i < j, j < hi), body(i, j)))
        return _and(
            *(z3.Implies(z3.And(lo <= i, j < hi), body(i, j)) for i in range(self.cap) for j in range(i + 1, self.cap))
        )
