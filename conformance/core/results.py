"""What a step, a failure and a campaign come to: one type each, from where it is made to the report.

- `Outcome`: what one side (the spec or the implementation) did on one step.
- `FailureKind` and `Failure`: the first thing that went wrong in an example,
  made when the lock-step core finds it, carried by the exception that stops
  the example, written into the trace, and, with its saved trace and story
  filled in, handed to the caller.
- `Verdict`: what a whole check concludes, and the exit code that says it.
- `CampaignReport`: what a campaign hands back across the process boundary
  (the campaign runs in a child process), typed rather than a dict of strings.
- `CheckResult`: what `run_check` and `replay` return.

Verdicts and failure kinds are enums, compared as members: a misspelt
verdict is an AttributeError at once, not a comparison that is quietly
False. They are `str` enums so that they print and serialise as their value.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

from kvspec.conformance.core.kv_events import event_to_json

__all__ = [
    "HARNESS_LIMIT",
    "CampaignReport",
    "CheckResult",
    "EXIT_COULD_NOT_RUN",
    "EXIT_DIVERGES",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "Failure",
    "FailureKind",
    "Outcome",
    "Verdict",
    "inconclusive_why",
    "unreached_why",
]


class Verdict(str, Enum):
    """What a check concludes."""

    CONFORMS = "conforms"  # every step agreed with the spec
    DIVERGES = "diverges"  # a result, an error, the state or an invariant differs from the spec's
    CRASHED = "crashed"  # the implementation raised something that is not a spec error, or its process died
    HUNG = "hung"  # an implementation call did not return within the step time limit
    COULD_NOT_RUN = "could-not-run"  # no verdict: the implementation could not be built, or bad arguments
    INCONCLUSIVE = "inconclusive"  # it ran, but too little to say anything (no step, too few examples)
    NOT_APPLICABLE = "n/a"  # the implementation does not provide this level (declared, or plainly built so)

    def __str__(self) -> str:
        return self.value

    def __hash__(self) -> int:
        # As its value's, so a member and its string find the same set entry or dict key.
        return hash(self.value)

    @property
    def exit_code(self) -> int:
        """One meaning per code: 0 conforms; 1 the implementation is wrong (it diverged, crashed or hung,
        with a shrunk trace); 2 kvspec reached no verdict (could not run, or inconclusive)."""
        return _EXIT_CODES[self]


# Every command's exit codes: 0 conforms / proved / killed them all; 1 the implementation is wrong (it
# diverged, crashed or hung) / a lemma refuted / a mutant survived; 2 no verdict (bad arguments, an
# implementation that cannot be built, a malformed trace, an inconclusive run).
EXIT_OK = 0
EXIT_DIVERGES = 1
EXIT_COULD_NOT_RUN = 2
EXIT_INTERRUPTED = 130  # a Ctrl-C ended the command (128 + SIGINT, as a shell reports it): no verdict

# How a failure's message starts where kvspec itself could not run a step (a light-mode stand-in for a device
# runtime was called): a LIMIT-kind failure, no verdict on the implementation and no bug in the spec either.
HARNESS_LIMIT = "kvspec cannot run step"

_EXIT_CODES = {
    Verdict.CONFORMS: EXIT_OK,
    Verdict.DIVERGES: EXIT_DIVERGES,
    Verdict.CRASHED: EXIT_DIVERGES,
    Verdict.HUNG: EXIT_DIVERGES,
    Verdict.COULD_NOT_RUN: EXIT_COULD_NOT_RUN,
    Verdict.INCONCLUSIVE: EXIT_COULD_NOT_RUN,
    Verdict.NOT_APPLICABLE: EXIT_OK,  # nothing wrong; a run where everything is n/a checked nothing, and exits 2
}

# The fewest examples a campaign must run before it may say "conforms" (fewer when fewer
# were asked for): a time budget that lets two examples run has checked almost nothing.
EXAMPLE_FLOOR = 10


def inconclusive_why(examples: int, steps: int, max_examples: int | None) -> str | None:
    """Why a run that found nothing wrong still may not say "conforms", or None when it may.

    `max_examples` is what was asked for (None for a replay, which runs one example).

    >>> inconclusive_why(0, 0, 100)
    'no example ran (0 steps): the time budget is too small, or the adapter could not start an example'
    >>> inconclusive_why(3, 40, 100), inconclusive_why(3, 40, 3) is None
    ('3 examples ran, fewer than the floor of 10 (a larger time budget runs more)', True)
    """
    if examples == 0:
        return "no example ran (0 steps): the time budget is too small, or the adapter could not start an example"
    if steps == 0:
        return f"{examples} examples ran but no step was checked: every example was rejected, or nothing applies"
    floor = EXAMPLE_FLOOR if max_examples is None else min(EXAMPLE_FLOOR, max_examples)
    if max_examples is not None and examples < floor:
        return f"{examples} examples ran, fewer than the floor of {floor} (a larger time budget runs more)"
    return None


def unreached_why(reachable: Sequence[str], coverage: Mapping[str, int]) -> str | None:
    """Why a campaign that found nothing wrong still may not say "conforms": the branches the implementation
    can reach (`reachable`) that it did not reach, and how to reach them; or None.

    >>> unreached_why(["touch: hit a free block", "touch: InvalidBlock"], {"touch: hit a free block": 3})[:59]
    '1 branch(es) this implementation can reach were not reached'
    """
    unreached = [b for b in reachable if not coverage.get(b)]
    if not unreached:
        return None
    return (
        f"{len(unreached)} branch(es) this implementation can reach were not reached: {'; '.join(unreached)} "
        "(more examples reach them: a larger --max-examples, --cover-rounds or --time-budget)"
    )


class FailureKind(str, Enum):
    """What went wrong at the failing step."""

    DIVERGES = "diverges"  # a different result, error type or state
    INVARIANT = "invariant"  # a named invariant or step rule broke on the implementation's state
    CRASHED = "crashed"  # the implementation raised or died
    HUNG = "hung"  # the implementation did not answer in time
    SPEC = "spec"  # the spec itself failed: a bug in kvspec, not in the implementation
    LIMIT = "limit"  # kvspec could not run the step (its own limit): no verdict on the implementation, no bug

    def __str__(self) -> str:
        return self.value

    def __hash__(self) -> int:
        # As its value's, so a member and its string find the same set entry or dict key.
        return hash(self.value)

    @property
    def verdict(self) -> Verdict:
        """The verdict a failure of this kind gives the whole check."""
        return _VERDICT_OF_KIND[self]


_VERDICT_OF_KIND = {
    FailureKind.DIVERGES: Verdict.DIVERGES,
    FailureKind.INVARIANT: Verdict.DIVERGES,
    FailureKind.CRASHED: Verdict.CRASHED,
    FailureKind.HUNG: Verdict.HUNG,
    FailureKind.SPEC: Verdict.COULD_NOT_RUN,
    FailureKind.LIMIT: Verdict.COULD_NOT_RUN,
}


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one side (spec or implementation) did on one step."""

    result: Any = None  # the return value in normal (JSON) form: lists of ids, int, bool, float, None
    error: str | None = None  # the spec error type's name, when a caller mistake was reported
    message: str = ""  # the error's message, or what crashed or hung
    crashed: bool = False  # raised something that is not a spec error, or the process died
    hung: bool = False  # did not return within the step time limit
    events: tuple[Any, ...] = ()  # the KV cache events the step published (kvspec.spec.events), when checked
    raised_types: tuple[str, ...] = ()  # for an exception: its class and base class names, most specific first
    replica: bool = False  # the implementation's side ran on a replica (a mistake that changes the state)
    not_sent: str | None = None  # why a caller mistake was not sent to the implementation (its side only)

    @property
    def raised(self) -> str | None:
        """The name of the exception type the side raised, if it raised one."""
        return self.raised_types[0] if self.raised_types else self.error

    def describe(self) -> str:
        """One line: the result, or the error and its message."""
        if self.replica:
            on_replica = " (on a replica; the example goes on from the state before)"
            return replace(self, replica=False).describe() + on_replica
        if self.not_sent is not None:
            return f"not sent ({self.not_sent})"
        if self.hung:
            return f"hung ({self.message})"
        if self.crashed:
            return f"crashed: {self.message}"
        if self.error is not None:
            return f"raised {self.error}"
        return _short(self.result)

    def to_json(self) -> dict[str, Any]:
        """The outcome as a JSON object."""
        extra: dict[str, Any] = {}
        if self.replica:
            extra["replica"] = True
        if self.raised_types and self.error is None:
            extra["raised"] = list(self.raised_types)
        if self.not_sent is not None:
            return {"not_sent": self.not_sent, **extra}
        if self.hung:
            return {"hung": self.message, **extra}
        if self.crashed:
            return {"crash": self.message, **extra}
        if self.events:
            extra["events"] = [event_to_json(e) for e in self.events]
        if self.error is not None:
            return {"error": self.error, "message": self.message, **extra}
        return {"result": self.result, **extra}


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return json.dumps(value) if isinstance(value, list) else repr(value)


@dataclass(frozen=True, slots=True)
class Failure:
    """The first thing that went wrong in an example, and, once reported, where its trace and story are."""

    kind: FailureKind
    step: int  # the failing step, 1-based; 0 is building the adapter
    op: str  # the operation at that step ("init" for building the adapter)
    message: str  # what differed, which rule broke, or what the implementation raised
    invariant: str | None = None  # the rule's name, for kind INVARIANT
    trace_path: str | None = None  # the saved JSON-lines trace, once reported
    num_steps: int = 0  # the reported trace's length
    story: str = ""  # the printed short story, once reported
    is_shrunk: bool = True  # False when a dead or hung process left a trace that could not be cut down

    def to_json(self) -> dict[str, Any]:
        """The failure as a trace's last line records it."""
        return {
            "kind": self.kind.value,
            "step": self.step,
            "op": self.op,
            "message": self.message,
            "invariant": self.invariant,
        }

    @staticmethod
    def from_json(obj: Mapping[str, Any]) -> Failure:
        """The inverse of `to_json`.

        Raises:
            ValueError: a field is missing or has the wrong type.
        """
        try:
            kind = FailureKind(obj["kind"])
        except (KeyError, ValueError):
            raise ValueError(f"failure kind must be one of {[k.value for k in FailureKind]}") from None
        step, op, message, invariant = obj.get("step"), obj.get("op"), obj.get("message"), obj.get("invariant")
        if not isinstance(step, int) or isinstance(step, bool) or not isinstance(op, str):
            raise ValueError("failure step must be an integer and op a string")
        if not isinstance(message, str) or not (invariant is None or isinstance(invariant, str)):
            raise ValueError("failure message must be a string and invariant a string or null")
        if kind is FailureKind.SPEC and message.startswith(HARNESS_LIMIT):  # written before LIMIT was a kind
            kind = FailureKind.LIMIT
        return Failure(kind, step, op, message, invariant)


@dataclass(frozen=True, slots=True)
class CampaignReport:
    """What a campaign or a replay hands back from its process: how much ran, what it reached, what failed."""

    verdict: Verdict
    message: str = ""  # a note: why it could not run, time budget spent, flaky failure
    examples: int = 0
    steps: int = 0
    coverage: Mapping[str, int] = field(default_factory=dict)  # branch -> times reached
    state_hashes: frozenset[int] = frozenset()  # the distinct spec states reached (their hashes, up to renaming)
    invariants_checked: int = 0
    seconds: float = 0.0
    not_exercised: tuple[str, ...] = ()  # what the adapter's declarations left out
    mistakes_checked: Mapping[str, int] = field(default_factory=dict)  # mistake -> times its reaction was checked
    reactions: Mapping[str, str] = field(default_factory=dict)  # mistake -> declared reaction (not the spec error)
    not_expressed: Mapping[str, int] = field(default_factory=dict)  # mistake -> calls the implementation cannot take
    absent_ops: tuple[str, ...] = ()  # optional operations the adapter lacks or declares deviant
    extra_rounds: int = 0  # rounds run after max_examples to reach a branch
    groups: str | None = None  # the KV cache groups checked, resolved for the adapter (None: as configured)
    declares_groups: bool = False  # the adapter declares kv_cache_groups = True
    group_kinds: frozenset[frozenset[str]] | None = None  # the attention types drawn layouts mix (None: any)
    failure: Failure | None = None
    trace: Any = None  # the failing (or replayed) example as a Trace
    deepest: Any = None  # the example that reached the most branches, as a Trace, when kept
    deepest_score: tuple[int, int] = (0, 0)  # the deepest example's (branches reached, steps)

    @property
    def states(self) -> int:
        """How many distinct spec states were reached."""
        return len(self.state_hashes)


@dataclass
class CheckResult:
    """What one campaign (one implementation, level, caching mode, profile) found."""

    verdict: Verdict
    level: str
    enable_caching: bool
    profile: str
    examples_run: int
    steps_run: int
    seconds: float
    failure: Failure | None
    coverage: dict[str, int]  # spec branches and workload events reached, with counts (0: not reached)
    impl: str = ""  # the implementation's name, as given
    states_reached: int = 0  # distinct spec states (hash values up to renaming)
    invariants_checked: int = 0  # invariant and rule evaluations on the implementation's states
    branches: tuple[str, ...] = ()  # the branches this configuration is expected to reach
    message: str = ""  # why it could not run, or a note (time budget spent, flaky failure)
    deepest_trace_path: str | None = None  # the example that reached the most events, when kept
    seed: int = 0
    not_exercised: tuple[str, ...] = ()  # caller mistakes ("<op>: <mistake>") the adapter declares it does not reject
    mistakes_checked: dict[str, int] = field(default_factory=dict)  # mistake -> times its reaction was checked
    reactions: dict[str, str] = field(default_factory=dict)  # mistake -> declared reaction, where not the spec's error
    not_expressed: dict[str, int] = field(default_factory=dict)  # mistake -> calls the implementation cannot take
    device: str | None = None  # AdapterConfig.device the adapters were built with
    extra_rounds: int = 0  # rounds run after max_examples because a branch was unreached (see cover_rounds)
    spec_branches: tuple[str, ...] = ()  # every branch the spec has at this configuration, provided or not
    absent_ops: tuple[str, ...] = ()  # optional operations the implementation does not provide (or excuses)
    examples_asked: int | None = None  # max_examples as asked for; None for a replay
    groups: str = "full"  # the KV cache groups at the manager level ("drawn": a layout per example)
    events: bool = False  # the KV cache events and hit statistics were checked too
    jobs: int = 1  # processes the campaign's examples were shared among (kvspec.conformance.runner.jobs)
    left_out: tuple[str, ...] = ()  # what the implementation provides that this run did not check, and the flag

    @property
    def exit_code(self) -> int:
        """0 conforms (or n/a), 1 the implementation is wrong, 2 no verdict (`Verdict.exit_code`)."""
        return self.verdict.exit_code

    @property
    def steps_per_second(self) -> float:
        """Lock-step operations checked per second of the campaign."""
        return self.steps_run / self.seconds if self.seconds > 0 else 0.0

    @property
    def unreached(self) -> list[str]:
        """Expected branches this campaign did not reach."""
        return [b for b in self.branches if not self.coverage.get(b)]
