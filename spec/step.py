"""What every spec operation returns: one shape for every step.

Every operation of the spec, at the pool level (`kvspec.spec.ops`) and at the
request level (`kvspec.spec.manager`), returns a `Step`: the state after the
call, the call's result (None for an operation that returns nothing in vLLM,
such as `touch`), and what the world sees of the call besides its result
(`events`: the KV cache events vLLM publishes for it, spec.events). A query
(`get_cached_block`, `get_usage`) returns the state it was given.

Design choice: one shape, rather than each operation returning what vLLM's
method returns (a state, a state and a list, a bare value), so that whoever
steps the spec (the conformance harness, a trace replay, a lemma's test) has
one call path, and a third output (events) is a field, not a new shape for
every caller to special-case.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

from kvspec.spec.events import KVCacheEvent

__all__ = ["Step"]

S = TypeVar("S")
R = TypeVar("R")


@dataclass(frozen=True, slots=True)
class Step(Generic[S, R]):
    """The state after one operation, its result, and its events.

    >>> Step("state", 3)
    Step(state='state', result=3, events=())
    """

    state: S  # the state after the call (the same object for a query)
    result: R  # the value vLLM's method returns; None where it returns nothing
    events: tuple[KVCacheEvent, ...] = ()  # the KV cache events the call publishes, in order (spec.events)
