"""What a campaign reached: the spec branches each configuration should reach, and those of each step.

A branch is an operation's outcome as the spec distinguishes it ("touch: hit a
free block", "allocate_slots: InvalidBlock"). The operations table
(kvspec.conformance.core.operations) lists each operation's branches;
`expected_branches` says which ones a configuration can reach (caching off
never hits), `step_branches` which ones one step reached, from the spec's
snapshots before and after it and its outcome. The summary of `kvspec check`
and its coverage figures are built from these.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from kvspec.conformance.core.operations import OPERATIONS, REQUEST_FEATURES, Operation, level_operations
from kvspec.conformance.core.results import Outcome
from kvspec.conformance.core.strategies import KIND_COMBINATIONS
from kvspec.spec.attention import parse_groups
from kvspec.spec.errors import InvalidRequest
from kvspec.spec.state import Snapshot

__all__ = [
    "EVENT_BRANCHES",
    "MANAGER_EVENT_BRANCHES",
    "branch_operation",
    "expected_branches",
    "is_error_branch",
    "reachable_branches",
    "step_branches",
]


# What the pool tells the world, when a campaign checks it (AdapterConfig.events): each kind of event,
# the two ways a router that does not count references misreads the stream, and the hit statistics.
EVENT_BRANCHES = (
    "events: BlockStored",
    "events: BlockRemoved",
    "events: AllBlocksCleared",
    "events: a key removed while another block still holds it",
)
MANAGER_EVENT_BRANCHES = (
    "events: a stored block's parent not held",
    "stats: local hit counted",
    "stats: preempted request counted apart",
    "stats: external tokens counted apart",
    "stats: reset recorded",
)
_EVENTS_CACHING_ONLY = frozenset({
    "events: BlockStored", "events: BlockRemoved", "events: a key removed while another block still holds it",
    "events: a stored block's parent not held", "stats: local hit counted",
})  # fmt: skip
# The adapter method each of them is read through: absent, its branches cannot be reached.
_READ_THROUGH = {"events": "take_events", "stats": "prefix_cache_stats"}


def expected_branches(
    level: str,
    enable_caching: bool,
    profile: str,
    groups: str = "full",
    events: bool = False,
    group_kinds: frozenset[frozenset[str]] | None = None,
) -> tuple[str, ...]:
    """The spec branches and events a campaign at this configuration should reach.

    A branch of KV cache groups is expected only of a layout that has it
    (`groups`: the manager's layout, or "drawn": every layout, or those mixing
    one of `group_kinds` where given); the events' and statistics' only when
    they are checked (`events`).

    >>> "get_cached_block: hit" in expected_branches("pool", False, "vllm-v1")
    False
    >>> "allocate_slots: skipped blocks freed" in expected_branches("manager", True, "vllm-v1", "full,sliding:8")
    True
    >>> "events: AllBlocksCleared" in expected_branches("pool", False, "vllm-v1", events=True)
    True
    """
    names = _operation_branches(level, enable_caching, profile, groups, group_kinds)
    if not events:
        return names
    extra = EVENT_BRANCHES + (MANAGER_EVENT_BRANCHES if level == "manager" else ())
    return names + tuple(b for b in extra if enable_caching or b not in _EVENTS_CACHING_ONLY)


def _operation_branches(
    level: str, enable_caching: bool, profile: str, groups: str, group_kinds: frozenset[frozenset[str]] | None
) -> tuple[str, ...]:
    """The operations' branches a configuration should reach (`expected_branches` without the events)."""
    if groups != "drawn" and not _is_layout(groups):
        groups = "full"  # a run refused for its layout expects what one full-attention group reaches
    # Drawn layouts: each combination of attention types drawn stands for its layouts.
    drawn = None if groups != "drawn" or group_kinds is None else [KIND_COMBINATIONS[k] for k in group_kinds]

    def has_layout(op: Operation, branch: str) -> bool:
        if groups != "drawn":
            return op.layout_only[branch](groups)
        return drawn is None or any(op.layout_only[branch](layout) for layout in drawn)

    names = tuple(
        b for op in level_operations(level) for b in op.all_branches()
        if (b not in op.layout_only or has_layout(op, b))
        and (b not in op.profile_only or op.profile_only[b](profile, enable_caching))
    )  # fmt: skip
    if not enable_caching:
        caching_only = {b for op in level_operations(level) for b in op.caching_only}
        names = tuple(n for n in names if n not in caching_only)
    return names


def _is_layout(groups: str) -> bool:
    try:
        parse_groups(groups)
    except InvalidRequest:
        return False
    return True


def step_branches(op: str, args: Sequence[Any], before: Snapshot, after: Snapshot, out: Outcome) -> list[str]:
    """The branches one step reached on the spec's side: its error's, or what its operation names."""
    if out.error is not None:
        return [f"{op}: {out.error}"]
    return OPERATIONS[op].reached(args, before, after, out.result)


def branch_operation(branch: str, level: str) -> str | None:
    """The operation a branch belongs to, or None.

    >>> branch_operation("readmitted after preemption", "manager"), branch_operation("events: BlockStored", "pool")
    ('free', 'take_events')
    """
    owner = next((op.name for op in level_operations(level) if branch in op.all_branches()), None)
    return owner or _READ_THROUGH.get(branch.partition(": ")[0])


def is_error_branch(branch: str, level: str) -> bool:
    """Whether a branch is an operation's error (reached only by a caller mistake).

    >>> is_error_branch("touch: InvalidBlock", "pool"), is_error_branch("touch: hit a free block", "pool")
    (True, False)
    """
    return any(branch in op.all_branches()[len(op.branches) :] for op in level_operations(level))


def reachable_branches(
    level: str,
    branches: Sequence[str],
    coverage: Mapping[str, int],
    not_exercised: Iterable[str],
    absent_ops: Iterable[str],
) -> tuple[str, ...]:
    """The expected branches this adapter can reach: all, less what its declarations rule out (or reached anyway).

    An error branch of an operation whose mistakes are not made against the
    adapter cannot be reached, nor can any branch of an optional operation
    the adapter lacks.
    """
    skipped_ops = {m.split(": ", 1)[0] for m in not_exercised}
    absent = set(absent_ops)
    # Branches only a feature reaches (a parameter an adapter may not take, the table's `features`, or a field of
    # the request, `REQUEST_FEATURES`): one the adapter does not take ("<feature>: not applicable, ...") rules
    # them out.
    features = [f for op in level_operations(level) for f in op.features]
    features += REQUEST_FEATURES if level == "manager" else ()
    without = {b for f in features if f.name in skipped_ops for b in f.branches}

    def ruled_out(branch: str) -> bool:
        op = branch_operation(branch, level)
        return (op in skipped_ops and is_error_branch(branch, level)) or op in absent or branch in without

    return tuple(b for b in branches if coverage.get(b) or not ruled_out(b))
