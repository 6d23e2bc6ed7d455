"""A trace's KV cache events replayed into the mirrors routers build, step by step against the pool.

A KV-aware router keeps a copy of an engine's prefix cache from its event
stream. Two kinds are replayed here, as a router author would write them:

- the counting mirror: a count per key (stored +1 per block, removed -1,
  cleared: empty), which holds exactly the pool's keys when the stream is
  right (the rule `event_mirror_exact`, kvspec.spec.invariants);
- the naive mirror: a set of keys that forgets a key on its first removal,
  and so drops a key another block still holds (vLLM keeps identical full
  blocks apart, so a key can have several blocks).

After each step each mirror is compared with the hash table of the side's
snapshot (the implementation's, or the spec's), and a `BlockStored` whose
parent the counting mirror does not hold is listed: a router that builds a
tree from parents cannot attach it. The first step where each mirror drifts
is what `kvspec mirror` prints.

Every step is replayed, the last one included: a step without the side's
outcome or state (a snapshot left out, a call that crashed) ends the replay
there, and unless the counting mirror has already drifted (a finding that
stands) the trace is refused, as is one with no steps or whose stream has no
events while the mirror holds the pool's keys: a mirror that replayed nothing
has checked nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvspec.conformance.core.hash_names import HashNames
from kvspec.conformance.core.kv_events import describe_events
from kvspec.conformance.core.results import Outcome
from kvspec.conformance.core.trace import Trace
from kvspec.conformance.core.wording import plural
from kvspec.spec.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventMirror,
    naive_misreads,
    orphaned_stores,
    table_counts,
)
from kvspec.spec.state import BlockHash, Snapshot

__all__ = ["Drift", "MirrorReport", "replay_mirrors"]


@dataclass(frozen=True, slots=True)
class Drift:
    """The first step where a mirror disagrees with the pool's hash table."""

    step: int  # 1-based, as the trace numbers it
    op: str
    events: str  # the step's events, keys by name
    holds_extra: tuple[str, ...]  # keys (with counts, for the counting mirror) it holds that the pool does not
    lacks: tuple[str, ...]  # keys the pool holds that it does not


@dataclass
class MirrorReport:
    """What replaying one side's stream into both mirrors found."""

    side: str  # "implementation" or "spec"
    steps: int  # steps replayed: all of the trace's, or those before stopped_at
    num_events: int  # events replayed
    counting: Drift | None = None  # the counting mirror's first drift, None if it never drifts
    naive: Drift | None = None  # the naive mirror's first drift
    orphans: list[tuple[int, str]] = field(default_factory=list)  # (step, the store and its parent) per orphan
    # (step, key) per removal of a key another block still holds: what the naive mirror drops wrongly,
    # seen even when the step's later removals take the last block too
    misreads: list[tuple[int, str]] = field(default_factory=list)
    # the step the replay stopped at, lacking the side's outcome or state, after the counting mirror drifted;
    # None when every step was replayed
    stopped_at: int | None = None


def replay_mirrors(trace: Trace, side: str = "implementation") -> MirrorReport:
    """Replay one side's events (`implementation` or `spec`) into both mirrors, against that side's snapshots.

    Raises:
        ValueError: the trace was recorded without events (its header says so), or `side` is neither; it
            has no steps; a step lacks the side's outcome or state before the counting mirror drifted (the
            rest of the trace cannot be checked); or the stream has no events and the mirror never drifted.
    """
    if side not in ("implementation", "spec"):
        raise ValueError(f"side must be 'implementation' or 'spec'; got side={side!r}")
    if not trace.config.events:
        raise ValueError(
            "the trace was recorded without KV cache events; record one with `kvspec check --events` "
            "(--keep-deepest keeps a passing campaign's deepest example)"
        )
    if not trace.steps:
        raise ValueError("the trace has no steps: there is no event stream to replay")
    names = HashNames.from_trace(trace.steps)
    name = names.impl_name if side == "implementation" else names.name
    report = MirrorReport(side, 0, 0)
    counting, naive = EventMirror(), set[BlockHash]()
    for step in trace.steps:
        outcome = step.impl if side == "implementation" else step.spec
        snapshot = step.impl_snapshot if side == "implementation" else step.spec_snapshot
        if outcome is None or snapshot is None:
            if report.counting is None:
                raise ValueError(
                    f"step {step.index} ({step.op}) of {len(trace.steps)} lacks the {_lacking(side, outcome, snapshot)}"
                    ": the mirror cannot be checked there or after it"
                )
            report.stopped_at = step.index
            break
        events = outcome.events
        report.steps += 1
        report.num_events += len(events)
        report.orphans += [(step.index, _orphan(e, name)) for e in orphaned_stores(counting, events)]
        report.misreads += [(step.index, name(k)) for k in naive_misreads(counting, events)]
        counting = counting.apply(events)
        naive = _naive(naive, events)
        pool = table_counts(snapshot.hash_to_blocks)
        shown = describe_events(events, name)
        if report.counting is None and dict(counting.counts) != dict(pool):
            extra = tuple(sorted(f"{name(k)} x{n}" for k, n in counting.counts.items() if pool.get(k) != n))
            lacks = tuple(sorted(f"{name(k)} x{n}" for k, n in pool.items() if counting.counts.get(k) != n))
            report.counting = Drift(step.index, step.op, shown, extra, lacks)
        if report.naive is None and naive != set(pool):
            report.naive = Drift(
                step.index, step.op, shown, _named(naive - set(pool), name), _named(set(pool) - naive, name)
            )
    if report.num_events == 0 and report.counting is None:
        raise ValueError(
            f"the {side}'s stream has no events in {plural(report.steps, 'step')}: a mirror that replays nothing "
            "checks nothing (record a trace that caches blocks with `kvspec check --events`)"
        )
    return report


def _lacking(side: str, outcome: Outcome | None, snapshot: Snapshot | None) -> str | None:
    """What of the side's record a step lacks for the mirror to be checked there, in words; None when nothing."""
    missing = [what for what, value in (("outcome", outcome), ("state (snapshot)", snapshot)) if value is None]
    return f"{side}'s {' or '.join(missing)}" if missing else None


def _naive(keys: set[BlockHash], events: tuple[object, ...]) -> set[BlockHash]:
    out = set(keys)
    for e in events:
        if isinstance(e, BlockStored):
            out.update(e.block_hashes)
        elif isinstance(e, BlockRemoved):
            out.difference_update(e.block_hashes)
        elif isinstance(e, AllBlocksCleared):
            out.clear()
    return out


def _named(keys: set[BlockHash], name: Callable[[BlockHash], str]) -> tuple[str, ...]:
    return tuple(sorted(name(k) for k in keys))


def _orphan(event: BlockStored, name: Callable[[BlockHash], str]) -> str:
    parent = "-" if event.parent_block_hash is None else name(event.parent_block_hash)
    return f"stored {' '.join(name(k) for k in event.block_hashes)} (group {event.group_idx}) under parent {parent}"
