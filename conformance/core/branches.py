"""Which spec branches one successful step reached, per operation.

A branch is an operation's outcome as the spec distinguishes it ("touch: hit
a free block"). Each function here reads one step that returned normally (a
step that raised reached the branch named after its error, which needs no
function) from its arguments, the spec's snapshots before and after it, and
its result in normal form, and names the branches it reached. The operations
table (kvspec.conformance.core.operations) lists, for each operation, the branches
it has and which of these functions names them; coverage
(kvspec.conformance.core.coverage) adds them up over a campaign.

They read only the spec's side, so what a campaign reached does not depend
on the implementation under test.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvspec.spec.invariants import snapshot_groups
from kvspec.spec.manager import Request
from kvspec.spec.state import NULL_BLOCK_ID, BlockHash, Snapshot

__all__ = [
    "EVICT_FIRST_OUTCOME",
    "freed_blocks",
    "hit_reached_get_computed_blocks",
    "reached_allocate_slots",
    "reached_cache_full_blocks",
    "reached_evict_blocks",
    "reached_free",
    "reached_free_blocks",
    "reached_get_cached_block",
    "reached_get_computed_blocks",
    "reached_get_new_blocks",
    "reached_get_num_cached_tokens",
    "reached_is_block_writable",
    "reached_itself",
    "reached_nothing",
    "reached_reset_prefix_cache",
    "reached_touch",
]


def reached_get_new_blocks(args: Sequence[Any], before: Snapshot, after: Snapshot, result: Any) -> list[str]:
    """Blocks taken; taking one that holds a hash evicts it."""
    ev = ["get_new_blocks: taken"]
    if any(before.block_hash[b] is not None for b in result):
        ev.append("get_new_blocks: evicted a cached block")
    return ev


def reached_touch(args: Sequence[Any], before: Snapshot, after: Snapshot, result: Any) -> list[str]:
    """One branch per block hit: it was free (leaves the queue) or already held."""
    free = set(before.free_queue)
    return ["touch: hit a free block" if b in free else "touch: hit a held block" for b in args[0]]


# A free with evict_first (vLLM 0.34.0 on) that released a block holding a hash: it goes before every other
# cached block, which only such a call does to a cached block.
EVICT_FIRST_OUTCOME = "cached block freed to be evicted first"


def reached_free_blocks(args: Sequence[Any], before: Snapshot, after: Snapshot, result: Any) -> list[str]:
    """Where each newly free block joined the queue, and whether a freed block is still held.

    A queue policy puts it at an end; a keyed policy where its key falls, which
    may be between blocks already free.
    """
    ev: list[str] = []
    old = set(before.free_queue)
    at_old = [i for i, b in enumerate(after.free_queue) if b in old]
    first_old, last_old = (at_old[0], at_old[-1]) if at_old else (len(after.free_queue), -1)
    for i, b in enumerate(after.free_queue):
        if b not in old:
            if i < first_old:
                ev.append("free_blocks: to the left end")
            elif i > last_old:
                ev.append("free_blocks: to the right end")
            else:
                ev.append("free_blocks: between free blocks")
    if any(after.ref_cnt[b] > 0 for b in args[0]):
        ev.append("free_blocks: still held by another")
    evict_first = len(args) > 1 and args[1] is True
    if evict_first and any(after.ref_cnt[b] == 0 and before.block_hash[b] is not None for b in args[0]):
        ev.append(f"free_blocks: {EVICT_FIRST_OUTCOME}")
    return ev


def reached_cache_full_blocks(args: Sequence[Any], before: Snapshot, after: Snapshot, result: Any) -> list[str]:
    """Registered; a hash now naming two blocks is a duplicate kept (not merged)."""
    ev = ["cache_full_blocks: registered"]
    if any(len(blocks) > 1 for _, blocks in after.hash_to_blocks):
        ev.append("cache_full_blocks: duplicate hash kept")
    return ev


def reached_get_cached_block(args: Sequence[Any], before: Snapshot, after: Snapshot, result: Any) -> list[str]:
    """A miss, or a hit (and whether the block hit is free)."""
    if result is None:
        return ["get_cached_block: miss"]
    ev = ["get_cached_block: hit"]
    if result in before.free_queue:
        ev.append("get_cached_block: hit a free block")
    return ev


def reached_evict_blocks(args: Sequence[Any], before: Snapshot, after: Snapshot, result: Any) -> list[str]:
    """One branch per hash dropped (the block held or free), or nothing cached among the blocks named."""
    dropped = [b for b in args[0] if before.block_hash[b] is not None]
    ev = [
        "evict_blocks: dropped a held block's hash"
        if before.ref_cnt[b]
        else "evict_blocks: dropped a free block's hash"
        for b in dropped
    ]
    return ev or ["evict_blocks: nothing cached"]


def reached_reset_prefix_cache(args: Sequence[Any], before: Snapshot, after: Snapshot, result: Any) -> list[str]:
    """Refused while blocks are held; accepted, and whether there were hashes to drop."""
    if not result:
        return ["reset_prefix_cache: refused, blocks held"]
    ev = ["reset_prefix_cache: accepted"]
    if before.hash_to_blocks:
        ev.append("reset_prefix_cache: accepted, hashes dropped")
    return ev


def reached_is_block_writable(args: Sequence[Any], before: Snapshot, after: Snapshot, result: Any) -> list[str]:
    """Writable or not."""
    return ["is_block_writable: yes" if result else "is_block_writable: no"]


def reached_itself(name: str) -> Any:
    """For an operation with one branch: the branch named after the operation."""

    def reached(args: Sequence[Any], before: Snapshot, after: Snapshot, result: Any) -> list[str]:
        return [name]

    return reached


def reached_nothing(args: Sequence[Any], before: Snapshot, after: Snapshot, result: Any) -> list[str]:
    """An operation whose branches the machine tags itself."""
    return []


def reached_get_computed_blocks(args: Sequence[Any], before: Snapshot, after: Snapshot, result: Any) -> list[str]:
    """A miss or a hit (and whether a hit block is free, and a group's null positions before its window or
    chunk); the cap and the coordinator's cut need the request's chain (`hit_reached_get_computed_blocks`)."""
    hit = result[0]
    ev = ["get_computed_blocks: hit" if hit else "get_computed_blocks: miss"]
    if before.enable_caching and args[0].prefix_cache_hit_limit == 0:
        ev.append("get_computed_blocks: lookup skipped by the request")
    if any(b in before.free_queue for b in hit):
        ev.append("get_computed_blocks: hit a free block")
    groups = snapshot_groups(before)
    n = len(hit) // len(groups)
    for g, group in enumerate(groups):
        if group.skips and NULL_BLOCK_ID in hit[g * n : (g + 1) * n]:
            ev.append(f"get_computed_blocks: {'sliding-window' if group.kind == 'sliding' else 'chunked-local'} hit")
    return ev


def hit_reached_get_computed_blocks(
    request: Request, block_size: int, before: Snapshot, result: Any, hashes: Sequence[BlockHash], cut: bool
) -> list[str]:
    """The branches of a returned prefix hit that need the request's chain: the hit capped at one token short
    of the request (the next block was cached), and the hit the coordinator cut (`cut`: some group alone
    would hit more)."""
    reached = []
    num_full = len(request.token_ids) // block_size
    hit = result[0]
    if (
        num_full > 0
        and len(hit) == (len(request.token_ids) - 1) // block_size
        and len(hit) < num_full
        and any(h == hashes[len(hit)] for h, _ in before.hash_to_blocks)
    ):
        reached.append("get_computed_blocks: hit capped at len - 1")
    if cut:
        reached.append("get_computed_blocks: hit cut by the coordinator")
    limit = request.prefix_cache_hit_limit
    n = len(hit) // max(len(snapshot_groups(before)), 1)  # hit positions per group
    if (
        limit
        and limit < len(request.token_ids) - 1
        and n == limit // block_size
        and n < len(hashes)
        and any(h == hashes[n] for h, _ in before.hash_to_blocks)
    ):
        reached.append("get_computed_blocks: hit capped by the request's limit")  # the next block was cached
    return reached


def reached_get_num_cached_tokens(args: Sequence[Any], before: Snapshot, after: Snapshot, result: Any) -> list[str]:
    """Whether the probe found tokens cached, none, or did not look (a hit limit of 0, caching on)."""
    if before.enable_caching and args[0].prefix_cache_hit_limit == 0:
        return ["get_num_cached_tokens: lookup skipped by the request"]
    return ["get_num_cached_tokens: cached tokens" if result else "get_num_cached_tokens: none cached"]


def reached_allocate_slots(args: Sequence[Any], before: Snapshot, after: Snapshot, result: Any) -> list[str]:
    """Refused for lack of blocks, or what the allocation did to the hash table; with groups that skip, the
    blocks freed and nulled (on a refused step too) and a new table that starts with skipped positions."""
    tables_before = dict(before.block_tables or ())
    nulled = any(
        b != NULL_BLOCK_ID and table[i] == NULL_BLOCK_ID
        for name, table in (after.block_tables or ())
        for i, b in enumerate(tables_before.get(name, ()))
    )
    if result is None:
        return ["allocate_slots: too few free blocks"] + (
            ["allocate_slots: refused after freeing skipped blocks"] if nulled else []
        )
    ev: list[str] = ["allocate_slots: skipped blocks freed"] if nulled else []
    if len(args) > 5 and args[5] is True:
        ev.append("allocate_slots: registration delayed for an external load")
    if any(name not in tables_before and table[:1] == (NULL_BLOCK_ID,) for name, table in after.block_tables or ()):
        ev.append("allocate_slots: admitted with skipped positions")
    pairs = list(zip(before.block_hash, after.block_hash))
    if any(h0 is not None and h1 != h0 for h0, h1 in pairs):
        ev.append("allocate_slots: evicted a cached block")
    if any(h1 is not None and h1 != h0 for h0, h1 in pairs):
        ev.append("allocate_slots: registered full blocks")
    if any(len(b) > 1 for _, b in after.hash_to_blocks):
        ev.append("allocate_slots: duplicate hash kept")
    return ev


def reached_cache_blocks(args: Sequence[Any], before: Snapshot, after: Snapshot, result: Any) -> list[str]:
    """Blocks registered (an asynchronous load is done), or none: every full block was registered already."""
    if any(h1 is not None and h0 is None for h0, h1 in zip(before.block_hash, after.block_hash)):
        return ["cache_blocks: loaded blocks registered"]
    return ["cache_blocks: nothing new to register"]


def reached_free(args: Sequence[Any], before: Snapshot, after: Snapshot, result: Any) -> list[str]:
    """Whether a freed block is still held by another request (finished or preempted: the machine tags it)."""
    if any(after.ref_cnt[b] > 0 for b in freed_blocks(before, after)):
        return ["free: shared blocks kept"]
    return []


def freed_blocks(before: Snapshot, after: Snapshot) -> list[int]:
    """The blocks whose ref_cnt dropped between two snapshots."""
    return [b for b in range(before.num_gpu_blocks) if after.ref_cnt[b] < before.ref_cnt[b]]
