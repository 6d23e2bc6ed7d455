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
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvspec.conformance.core.hash_names import HashNames
from kvspec.conformance.core.kv_events import describe_events
from kvspec.conformance.core.trace import Trace
from kvspec.spec.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventMirror,
    naive_misreads,
    orphaned_stores,
    table_counts,
)
from kvspec.spec.state import BlockHash

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
    steps: int  # steps replayed (those with a snapshot)
    num_events: int  # events replayed
    counting: Drift | None = None  # the counting mirror's first drift, None if it never drifts
    naive: Drift | None = None  # the naive mirror's first drift
    orphans: list[tuple[int, str]] = field(default_factory=list)  # (step, the store and its parent) per orphan
    # (step, key) per removal of a key another block still holds: what the naive mirror drops wrongly,
    # seen even when the step's later removals take the last block too
    misreads: list[tuple[int, str]] = field(default_factory=list)


def replay_mirrors(trace: Trace, side: str = "implementation") -> MirrorReport:
    """Replay one side's events (`implementation` or `spec`) into both mirrors, against that side's snapshots.

    Raises:
        ValueError: the trace was recorded without events (its header says so), or `side` is neither.
    """
    if side not in ("implementation", "spec"):
        raise ValueError(f"side must be 'implementation' or 'spec'; got side={side!r}")
    if not trace.config.events:
        raise ValueError(
            "the trace was recorded without KV cache events; record one with `kvspec check --events` "
            "(--keep-deepest keeps a passing campaign's deepest example)"
        )
    names = HashNames.from_trace(trace.steps)
    name = names.impl_name if side == "implementation" else names.name
    report = MirrorReport(side, 0, 0)
    counting, naive = EventMirror(), set[BlockHash]()
    for step in trace.steps:
        outcome = step.impl if side == "implementation" else step.spec
        snapshot = step.impl_snapshot if side == "implementation" else step.spec_snapshot
        if outcome is None or snapshot is None:
            continue
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
    return report


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
