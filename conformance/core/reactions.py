"""What an implementation does with a caller mistake, as its adapter declares it: one reaction per mistake.

The spec rejects every caller mistake the operations table lists with a
typed error and changes nothing. An implementation may do otherwise (vLLM
trusts its scheduler and checks almost nothing), so an adapter declares, for
each mistake ("<op>: <mistake>", the table's names), one reaction:

- `SPEC_ERROR`: it raises the spec's error type and changes nothing;
- `raises("ValueError")`: it raises its own exception type (the class or any
  base named so) and changes nothing; `raises("IndexError", then="...")`: it
  raises it after changing the state, as `then` says;
- `IGNORES` (or `ignores("why")`): it returns normally and the mistake
  changes nothing: the state is the spec's after the call's good part alone
  (the other blocks of a list with one bad id), nothing when it has none;
- `accepts("...")`: it returns normally and changes the state, as the words say;
- `not_expressible("...")`: its API cannot take the call at all (vLLM's pool
  takes block objects: an id that names no block has none), so it is never sent.

The harness sends every mistake that has a reaction and checks the one
declared: a release whose `ValueError` becomes an `AssertionError`, or whose
check starts to let a bad id through, diverges. A reaction that changes the
state takes the implementation outside what the spec models, so that mistake
goes to a replica (a second adapter brought to the same state by replaying
the example's calls); the example goes on from the state before it.

Declarations, read by `declared_reactions`: `mistake_reactions` (a mapping
from mistake to reaction) on the adapter; with `validates_bad_input = True`
(the default) every mistake it leaves out is `SPEC_ERROR`, with False only
the mistakes named in `mistake_reactions` or `rejected_mistakes` (which are
`SPEC_ERROR`) are sent, and the summary lists the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvspec.conformance.core.operations import OPERATIONS
from kvspec.conformance.core.results import Outcome

__all__ = [
    "IGNORES",
    "SPEC_ERROR",
    "NotExpressible",
    "Reaction",
    "ReactionDeclarationError",
    "accepts",
    "all_mistakes",
    "ignores",
    "declared_reactions",
    "not_expressible",
    "observed_reaction",
    "raises",
    "reaction_problem",
]

ReactionKind = Literal["spec error", "raises", "ignores", "accepts", "not expressible"]


class NotExpressible(Exception):
    """Raised by an adapter for a call its implementation's API cannot take (nothing was called)."""


class ReactionDeclarationError(ValueError):
    """An adapter's `mistake_reactions` names a mistake the operations table does not list, or is malformed."""


@dataclass(frozen=True, slots=True)
class Reaction:
    """What the implementation does with one caller mistake."""

    kind: ReactionKind
    error: str | None = None  # "raises": the exception type's name
    then: str | None = None  # what it does to the state ("raises" after a change, "accepts"); None: nothing
    why: str | None = None  # "not expressible": why the API cannot take the call; "ignores": how, if said

    @property
    def changes_state(self) -> bool:
        """Whether the implementation's state may change (the mistake then goes to a replica)."""
        return self.then is not None

    def describe(self) -> str:
        """In words, as the summary lists it.

        >>> raises("ValueError").describe()
        'raises ValueError'
        """
        if self.kind == "raises":
            return f"raises {self.error}" + (f", then {self.then}" if self.then else "")
        if self.kind == "accepts":
            return f"accepts: {self.then}"
        if self.kind == "not expressible":
            return f"not expressible: {self.why}"
        return self.kind + (f" ({self.why})" if self.why else "")


SPEC_ERROR = Reaction("spec error")
IGNORES = Reaction("ignores")


def raises(error: str | type[BaseException], then: str | None = None) -> Reaction:
    """The implementation raises its own exception type (`then`: after changing the state so).

    >>> raises(KeyError).error
    'KeyError'
    """
    return Reaction("raises", error if isinstance(error, str) else error.__name__, then)


def ignores(why: str) -> Reaction:
    """`IGNORES`, with the words saying how (the summary prints them)."""
    return Reaction("ignores", why=why)


def accepts(then: str) -> Reaction:
    """The implementation returns normally and changes the state as `then` says."""
    return Reaction("accepts", then=then)


def not_expressible(why: str) -> Reaction:
    """The implementation's API cannot take the call; it is never sent."""
    return Reaction("not expressible", why=why)


def all_mistakes() -> tuple[str, ...]:
    """Every caller mistake of the operations table, as "<op>: <mistake>"."""
    return tuple(f"{op.name}: {m}" for op in OPERATIONS.values() for m in op.mistakes)


def declared_reactions(adapter: object) -> dict[str, Reaction]:
    """The reaction the adapter declares for each mistake it is sent (absent: not sent).

    Raises:
        ReactionDeclarationError: a key is not a mistake of the operations table or a value not a `Reaction`.
    """
    declared = dict(getattr(adapter, "mistake_reactions", None) or {})
    known = set(all_mistakes())
    for mistake, reaction in declared.items():
        if mistake not in known:
            raise ReactionDeclarationError(
                f"mistake_reactions names {mistake!r}, which is not a caller mistake of the operations table "
                "(see `kvspec errors`)"
            )
        if not isinstance(reaction, Reaction):
            raise ReactionDeclarationError(f"mistake_reactions[{mistake!r}] is {reaction!r}, not a Reaction")
    rejected = frozenset(getattr(adapter, "rejected_mistakes", None) or ())
    validates = bool(getattr(adapter, "validates_bad_input", True))
    for mistake in known:
        if mistake not in declared and (validates or mistake in rejected):
            declared[mistake] = SPEC_ERROR
    return declared


def observed_reaction(spec: Outcome, impl: Outcome, changed: bool) -> Reaction | None:
    """The reaction an implementation's outcome on a mistake shows; None for a hang or a crash of the process."""
    if impl.hung:
        return None
    then = "changes the state" if changed else None
    if impl.error is not None:
        if impl.error == spec.error and not changed:
            return SPEC_ERROR
        return raises(impl.error, then)
    if impl.crashed:
        return raises(impl.raised, then) if impl.raised else None
    return accepts("changes the state") if changed else IGNORES


def reaction_problem(declared: Reaction, spec: Outcome, impl: Outcome, changed: bool) -> str | None:
    """What differs between the declared reaction and what the implementation did, or None.

    `changed`: whether the implementation's state differs from before the call.
    `accepts` and `raises(..., then=...)` may change the state or not (the
    words say what they do in the states the adapter's author measured);
    `raises` without `then` must change nothing; after `ignores` the state is
    compared with the spec's after the call's good part (by the lock-step).
    """
    seen = observed_reaction(spec, impl, changed)
    if seen is None:
        return f"it {impl.describe()}; the adapter declares it {declared.describe()}"
    returned = seen.kind in ("ignores", "accepts")
    if declared.kind in ("ignores", "accepts"):
        ok = returned
    elif declared.kind == "raises":
        names = impl.raised_types or ((impl.error,) if impl.error else ())
        ok = not returned and declared.error in names and (declared.changes_state or not changed)
    else:
        ok = seen == SPEC_ERROR
    if ok:
        return None
    said = f" ({impl.message[:160]})" if impl.message and not returned else ""
    did = "returned normally" if returned else f"raised {impl.raised}{said}"
    return f"it {did}{' and changed the state' if changed else ''}; the adapter declares it {declared.describe()}"
