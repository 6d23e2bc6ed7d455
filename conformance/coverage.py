"""What a campaign reached: the spec branches each configuration should reach, and the events of each step.

A branch is an operation's outcome as the spec distinguishes it ("touch: hit a
free block", "allocate_slots: PoolExhausted"). `expected_branches` says which
ones a configuration can reach (caching off never hits); `pool_events` and
`manager_events` name the branches and workload events one step reached, from
the snapshots before and after it and its outcome. The summary of `kvspec
check` and its coverage figures are built from these.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvspec.conformance.trace import Outcome
from kvspec.spec.state import Snapshot

__all__ = [
    "expected_branches",
    "freed_blocks",
    "manager_events",
    "pool_events",
]


_POOL_BRANCHES = (
    "get_new_blocks: taken",
    "get_new_blocks: evicted a cached block",
    "get_new_blocks: PoolExhausted",
    "get_new_blocks: InvalidRequest",
    "touch: hit a free block",
    "touch: hit a held block",
    "touch: InvalidBlock",
    "touch: InvalidRequest",
    "free_blocks: to the left end",
    "free_blocks: to the right end",
    "free_blocks: still held by another",
    "free_blocks: DoubleFree",
    "free_blocks: InvalidBlock",
    "free_blocks: InvalidRequest",
    "cache_full_blocks: registered",
    "cache_full_blocks: duplicate hash kept",
    "cache_full_blocks: AlreadyCached",
    "cache_full_blocks: InvalidBlock",
    "cache_full_blocks: InvalidRequest",
    "get_cached_block: hit",
    "get_cached_block: hit a free block",
    "get_cached_block: miss",
    "get_cached_block: InvalidRequest",
    "evict_blocks: dropped a held block's hash",
    "evict_blocks: dropped a free block's hash",
    "evict_blocks: nothing cached",
    "evict_blocks: InvalidBlock",
    "evict_blocks: InvalidRequest",
    "reset_prefix_cache: accepted",
    "reset_prefix_cache: accepted, hashes dropped",
    "reset_prefix_cache: refused, blocks held",
    "is_block_writable: yes",
    "is_block_writable: no",
    "is_block_writable: InvalidBlock",
    "get_num_free_blocks",
    "get_usage",
)
_MANAGER_BRANCHES = (
    "get_computed_blocks: miss",
    "get_computed_blocks: hit",
    "get_computed_blocks: hit a free block",
    "get_computed_blocks: hit capped at len - 1",
    "get_computed_blocks: InvalidRequest",
    "allocate_slots: admitted",
    "allocate_slots: admitted with a prefix hit",
    "allocate_slots: external tokens",
    "allocate_slots: chunked prefill",
    "allocate_slots: decode",
    "allocate_slots: registered full blocks",
    "allocate_slots: duplicate hash kept",
    "allocate_slots: evicted a cached block",
    "allocate_slots: too few free blocks",
    "allocate_slots: InvalidRequest",
    "allocate_slots: InvalidBlock",
    "free: request finished",
    "free: request preempted",
    "free: shared blocks kept",
    "free: InvalidRequest",
    "readmitted after preemption",
)
# Branches only prefix caching can reach.
_CACHING_ONLY = frozenset(
    {
        "get_new_blocks: evicted a cached block",
        "touch: hit a free block",
        "touch: hit a held block",
        "touch: InvalidRequest",
        "free_blocks: still held by another",  # only a touch shares a block
        "cache_full_blocks: registered",
        "cache_full_blocks: duplicate hash kept",
        "cache_full_blocks: AlreadyCached",
        "cache_full_blocks: InvalidBlock",
        "get_cached_block: hit",
        "get_cached_block: hit a free block",
        "evict_blocks: dropped a held block's hash",
        "evict_blocks: dropped a free block's hash",
        "reset_prefix_cache: accepted, hashes dropped",
        "get_computed_blocks: hit",
        "get_computed_blocks: hit a free block",
        "get_computed_blocks: hit capped at len - 1",
        "allocate_slots: admitted with a prefix hit",
        "allocate_slots: registered full blocks",
        "allocate_slots: duplicate hash kept",
        "allocate_slots: evicted a cached block",
        "allocate_slots: InvalidBlock",
        "free: shared blocks kept",
    }
)


def expected_branches(level: str, enable_caching: bool, profile: str) -> tuple[str, ...]:
    """The spec branches and events a campaign at this configuration should reach.

    >>> "get_cached_block: hit" in expected_branches("pool", False, "vllm-v1")
    False
    """
    names: tuple[str, ...] = _POOL_BRANCHES if level == "pool" else _MANAGER_BRANCHES
    if not enable_caching:
        names = tuple(n for n in names if n not in _CACHING_ONLY)
        # Without hashes every freed block goes to the same end.
        end = "free_blocks: to the right end" if profile == "vllm-v1" else "free_blocks: to the left end"
        names = tuple(n for n in names if n != end)
    elif profile != "vllm-v1":
        names = tuple(n for n in names if n != "free_blocks: to the left end")
    return names


def pool_events(op: str, args: Sequence[Any], before: Snapshot, after: Snapshot, out: Outcome) -> list[str]:
    if out.error is not None:
        return [f"{op}: {out.error}"]
    ev: list[str] = []
    if op == "get_new_blocks":
        ev.append("get_new_blocks: taken")
        if any(before.block_hash[b] is not None for b in out.result):
            ev.append("get_new_blocks: evicted a cached block")
    elif op == "touch":
        free = set(before.free_queue)
        ev += ["touch: hit a free block" if b in free else "touch: hit a held block" for b in args[0]]
    elif op == "free_blocks":
        ev += _freed_events(before, after, args[0])
    elif op == "cache_full_blocks":
        ev.append("cache_full_blocks: registered")
        if any(len(blocks) > 1 for _, blocks in after.hash_to_blocks):
            ev.append("cache_full_blocks: duplicate hash kept")
    elif op == "get_cached_block":
        if out.result is None:
            ev.append("get_cached_block: miss")
        else:
            ev.append("get_cached_block: hit")
            if out.result in before.free_queue:
                ev.append("get_cached_block: hit a free block")
    elif op == "evict_blocks":
        dropped = [b for b in args[0] if before.block_hash[b] is not None]
        ev += [
            "evict_blocks: dropped a held block's hash"
            if before.ref_cnt[b]
            else "evict_blocks: dropped a free block's hash"
            for b in dropped
        ]
        if not dropped:
            ev.append("evict_blocks: nothing cached")
    elif op == "reset_prefix_cache":
        if not out.result:
            ev.append("reset_prefix_cache: refused, blocks held")
        else:
            ev.append("reset_prefix_cache: accepted")
            if before.hash_to_blocks:
                ev.append("reset_prefix_cache: accepted, hashes dropped")
    elif op == "is_block_writable":
        ev.append("is_block_writable: yes" if out.result else "is_block_writable: no")
    else:
        ev.append(op)
    return ev


def _freed_events(before: Snapshot, after: Snapshot, freed: Sequence[Any]) -> list[str]:
    ev: list[str] = []
    old = set(before.free_queue)
    first_old = next((i for i, b in enumerate(after.free_queue) if b in old), len(after.free_queue))
    for i, b in enumerate(after.free_queue):
        if b not in old:
            ev.append("free_blocks: to the left end" if i < first_old else "free_blocks: to the right end")
    if any(after.ref_cnt[b] > 0 for b in freed):
        ev.append("free_blocks: still held by another")
    return ev


def manager_events(op: str, before: Snapshot, after: Snapshot, out: Outcome) -> list[str]:
    if out.error is not None:
        return [f"{op}: {out.error}"]
    ev: list[str] = []
    if op == "get_computed_blocks":
        hit = out.result[0]
        ev.append("get_computed_blocks: hit" if hit else "get_computed_blocks: miss")
        if any(b in before.free_queue for b in hit):
            ev.append("get_computed_blocks: hit a free block")
    elif op == "allocate_slots":
        if out.result is None:
            ev.append("allocate_slots: too few free blocks")
            return ev
        pairs = list(zip(before.block_hash, after.block_hash))
        if any(h0 is not None and h1 != h0 for h0, h1 in pairs):
            ev.append("allocate_slots: evicted a cached block")
        if any(h1 is not None and h1 != h0 for h0, h1 in pairs):
            ev.append("allocate_slots: registered full blocks")
        if any(len(b) > 1 for _, b in after.hash_to_blocks):
            ev.append("allocate_slots: duplicate hash kept")
    elif op == "free" and any(after.ref_cnt[b] > 0 for b in freed_blocks(before, after)):
        ev.append("free: shared blocks kept")
    return ev


def freed_blocks(before: Snapshot, after: Snapshot) -> list[int]:
    return [b for b in range(before.num_gpu_blocks) if after.ref_cnt[b] < before.ref_cnt[b]]
