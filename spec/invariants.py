"""Every invariant of the block manager, each written once.

Each state invariant is a total, side-effect-free predicate over a `Snapshot`;
its one-sentence docstring is the rule in plain words (the text students read,
and `kvspec invariants` prints). The spec's contracts, the reference model's
`check_invariants()`, gpu_impl and the conformance machine all call these and
never restate them.

Four kinds:
- state invariants (`INVARIANTS`): hold in every reachable state;
- hit rules (`HIT_RULES`): hold for every prefix-cache hit a request gets;
- step rules (`STEP_RULES`): relate the state before an operation to the one after;
- event rules (`EVENT_RULES`): relate the KV cache events a step publishes to
  what a router that mirrors them held before and the state after (spec.events).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvspec.spec.attention import FULL, KVGroup, parse_groups, window_hit_blocks
from kvspec.spec.errors import InvariantViolation
from kvspec.spec.events import BlockStored, EventMirror, KVCacheEvent
from kvspec.spec.state import NULL_BLOCK_ID, TABLE_GROUP_MARK, BlockHash, BlockId, Snapshot, group_key

__all__ = [
    "EVENT_RULES",
    "EventRule",
    "check_events",
    "HIT_RULES",
    "INVARIANTS",
    "STEP_RULES",
    "HitRule",
    "Invariant",
    "StepRule",
    "all_hold",
    "check_all",
    "check_hit",
    "check_step",
    "failing",
    "hit_content_intact",
    "hit_prefix_closed",
    "hit_window_shape",
    "hit_within_cap",
    "is_block_writable",
]


# --- state invariants ---------------------------------------------------------------------


def inv_pool_shape(s: Snapshot) -> bool:
    """Every per-block table has one entry per block, and every block id named anywhere is in range."""
    n = s.num_gpu_blocks
    named = list(s.free_queue) + [b for _, blocks in s.hash_to_blocks for b in blocks]
    if s.block_tables is not None:
        named += [b for _, blocks in s.block_tables for b in blocks]
    return n >= 1 and len(s.ref_cnt) == n and len(s.block_hash) == n and all(0 <= b < n for b in named)


def inv_ref_cnt_nonnegative(s: Snapshot) -> bool:
    """No block is held by a negative number of requests."""
    return all(r >= 0 for r in s.ref_cnt)


def inv_free_queue_has_zero_ref(s: Snapshot) -> bool:
    """A block is in the free queue exactly once iff it is not the null block, not quarantined, and its ref_cnt is 0."""
    queued = set(s.free_queue)
    # NOTE: a quarantined block has ref_cnt 0 but must never be reused, so it is
    # the one ref-0 block (besides the null block) that stays out of the queue.
    quarantined = set(s.quarantined)
    free = {b for b, r in enumerate(s.ref_cnt) if r == 0 and b != NULL_BLOCK_ID and b not in quarantined}
    return len(queued) == len(s.free_queue) and queued == free


def inv_null_block_isolated(s: Snapshot) -> bool:
    """The null block is never free, never hashed, never in the hash table and never held (its ref_cnt stays 0)."""
    in_table = any(NULL_BLOCK_ID in blocks for _, blocks in s.hash_to_blocks)
    return (
        NULL_BLOCK_ID not in s.free_queue
        and s.block_hash[NULL_BLOCK_ID] is None
        and s.ref_cnt[NULL_BLOCK_ID] == 0
        and not in_table
    )


def snapshot_groups(s: Snapshot) -> tuple[KVGroup, ...]:
    """The KV cache groups a snapshot describes (one full-attention group when it names none)."""
    return parse_groups(",".join(s.kv_groups)) if s.kv_groups else (FULL,)


def _table_group(name: str, num_groups: int) -> int | None:
    """The group of a block table named by `spec.state.table_name`; None for a name no group has."""
    if num_groups == 1:
        return 0  # one group: every table is its own (a request id may then hold the mark)
    _, mark, group = name.rpartition(TABLE_GROUP_MARK)
    if not mark:
        return 0
    return int(group) if group.isdigit() and 0 < int(group) < num_groups else None


def inv_null_only_where_skipped(s: Snapshot) -> bool:
    """The null block stands in a table only for what a sliding or chunked group no longer reads, before its blocks."""
    if s.block_tables is None:
        return True
    groups = snapshot_groups(s)
    for name, blocks in s.block_tables:
        g = _table_group(name, len(groups))
        if g is None:
            return False
        num_null = next((i for i, b in enumerate(blocks) if b != NULL_BLOCK_ID), len(blocks))
        if NULL_BLOCK_ID in blocks[num_null:] or (num_null and not groups[g].skips):
            return False
    return True


def inv_groups_disjoint(s: Snapshot) -> bool:
    """No block is in two KV cache groups' tables: a group's blocks are its own, keyed by its group id."""
    if s.block_tables is None:
        return True
    owner: dict[int, int | None] = {}
    num_groups = len(snapshot_groups(s))
    for name, blocks in s.block_tables:
        g = _table_group(name, num_groups)
        for b in blocks:
            if b != NULL_BLOCK_ID and owner.setdefault(b, g) != g:
                return False
    return True


def inv_hash_table_consistent(s: Snapshot) -> bool:
    """Every hash-table entry h -> b has block_hash[b] == h, and every block with a hash is in the table once."""
    listed = [b for _, blocks in s.hash_to_blocks for b in blocks]
    if len(listed) != len(set(listed)) or any(not blocks for _, blocks in s.hash_to_blocks):
        return False
    if len({h for h, _ in s.hash_to_blocks}) != len(s.hash_to_blocks):
        return False
    if not all(s.block_hash[b] == h for h, blocks in s.hash_to_blocks for b in blocks):
        return False
    hashed = {b for b in range(s.num_gpu_blocks) if s.block_hash[b] is not None}
    return hashed == set(listed)


def inv_conservation(s: Snapshot) -> bool:
    """Free blocks plus blocks with ref_cnt > 0 (plus quarantined ones) add up to every block but the null block."""
    num_held = sum(1 for b in range(1, s.num_gpu_blocks) if s.ref_cnt[b] > 0)
    return len(s.free_queue) + num_held + len(s.quarantined) == s.num_gpu_blocks - 1


def inv_quarantine_isolated(s: Snapshot) -> bool:
    """A quarantined (corrupt) block is listed once, is not the null block, and is never free, hashed or held."""
    q = s.quarantined
    return len(set(q)) == len(q) and all(
        0 < b < s.num_gpu_blocks and b not in s.free_queue and s.block_hash[b] is None and s.ref_cnt[b] == 0 for b in q
    )


def inv_caching_off_no_hash(s: Snapshot) -> bool:
    """With prefix caching off, no block has a hash and the hash table is empty."""
    return s.enable_caching or (not s.hash_to_blocks and all(h is None for h in s.block_hash))


def inv_block_tables_hold_refs(s: Snapshot) -> bool:
    """A block's ref_cnt is the number of tables (of every request and group) holding it; none holds it twice."""
    if s.block_tables is None:
        return True
    holders: Counter[int] = Counter()
    for _, blocks in s.block_tables:
        real = [b for b in blocks if b != NULL_BLOCK_ID]
        if len(set(real)) != len(real):
            return False
        holders.update(real)
    return all(s.ref_cnt[b] == holders[b] for b in range(1, s.num_gpu_blocks))


@dataclass(frozen=True, slots=True)
class Invariant:
    """A named state invariant."""

    name: str  # the predicate's name, inv_<subject>_<property>
    design_id: str  # its id in docs/design.md's invariant table ("" when it only guards the others)
    check: Callable[[Snapshot], bool]  # the predicate

    @property
    def rule(self) -> str:
        """The rule in plain words: the predicate's docstring."""
        return (self.check.__doc__ or "").strip()


INVARIANTS: tuple[Invariant, ...] = (
    # Shape first: the other predicates index by block id and assume it.
    Invariant("inv_pool_shape", "", inv_pool_shape),
    Invariant("inv_ref_cnt_nonnegative", "", inv_ref_cnt_nonnegative),
    Invariant("inv_null_block_isolated", "null-block", inv_null_block_isolated),
    Invariant("inv_free_queue_has_zero_ref", "free-has-zero-ref", inv_free_queue_has_zero_ref),
    Invariant("inv_quarantine_isolated", "", inv_quarantine_isolated),
    Invariant("inv_conservation", "conservation", inv_conservation),
    Invariant("inv_hash_table_consistent", "hash-table-consistent", inv_hash_table_consistent),
    Invariant("inv_caching_off_no_hash", "", inv_caching_off_no_hash),
    Invariant("inv_block_tables_hold_refs", "tables-hold-refs", inv_block_tables_hold_refs),
    Invariant("inv_null_only_where_skipped", "null-where-skipped", inv_null_only_where_skipped),
    Invariant("inv_groups_disjoint", "groups-disjoint", inv_groups_disjoint),
)


def failing(s: Snapshot) -> list[str]:
    """The names of the state invariants `s` breaks, in registry order (shape failures stop early)."""
    if not inv_pool_shape(s):
        return ["inv_pool_shape"]
    return [inv.name for inv in INVARIANTS[1:] if not inv.check(s)]  # the shape, first, holds


def all_hold(s: Snapshot) -> bool:
    """Whether every state invariant holds."""
    return not failing(s)


def check_all(s: Snapshot) -> None:
    """Check every state invariant.

    Raises:
        InvariantViolation: naming the first invariant that fails, with the snapshot.
    """
    names = failing(s)
    if names:
        inv = next(i for i in INVARIANTS if i.name == names[0])
        raise InvariantViolation(inv.name, inv.rule, f"snapshot: {s}")


def is_block_writable(s: Snapshot, block_id: int) -> bool:
    """A block may be written iff it is not the null block, exactly one request holds it, and it has no hash.

    Anything else is shared, cached (others may hit it) or free, and a write
    would corrupt someone else's KV (the writable / no-shared-write rules).
    """
    return (
        0 <= block_id < s.num_gpu_blocks
        and block_id != NULL_BLOCK_ID
        and s.ref_cnt[block_id] == 1
        and s.block_hash[block_id] is None
    )


# --- hit rules ----------------------------------------------------------------------------


def hit_within_cap(num_tokens: int, num_hit_tokens: int, block_size: int) -> bool:
    """A request reuses at most len(prompt) - 1 tokens, in whole blocks (the last token is always computed)."""
    return 0 <= num_hit_tokens <= max(num_tokens - 1, 0) and num_hit_tokens % block_size == 0


def hit_prefix_closed(
    s: Snapshot, request_hashes: Sequence[BlockHash], hit_blocks: Sequence[BlockId], group_id: int = 0
) -> bool:
    """A hit is a prefix of the request's own chain: hit i is registered under hash i in its group, or is null."""
    return len(hit_blocks) <= len(request_hashes) and all(
        b == NULL_BLOCK_ID or s.block_hash[b] == group_key(request_hashes[i], group_id)
        for i, b in enumerate(hit_blocks)
    )


def hit_window_shape(group: KVGroup, hit_blocks: Sequence[BlockId], block_size: int) -> bool:
    """A group's hit holds what its attention type reads (all, the window, the chunk), the null block before it."""
    n = len(hit_blocks)
    if group.kind == "sliding":
        num_null = n - min(n, window_hit_blocks(group.size, block_size))
    elif group.kind == "chunked":
        num_null = n * block_size // group.size * group.size // block_size
    else:
        num_null = 0
    return all((b == NULL_BLOCK_ID) == (i < num_null) for i, b in enumerate(hit_blocks))


def hit_content_intact(expected: Sequence[int], actual: Sequence[int]) -> bool:
    """A hit block's KV content is what its own prefix computes: every slot reads back the value written for it."""
    return len(expected) == len(actual) and all(e == a for e, a in zip(expected, actual))


@dataclass(frozen=True, slots=True)
class HitRule:
    """A named rule about one prefix-cache hit."""

    name: str
    design_id: str
    rule: str


HIT_RULES: tuple[HitRule, ...] = (
    HitRule("hit_within_cap", "hit-cap", (hit_within_cap.__doc__ or "").strip()),
    HitRule("hit_prefix_closed", "prefix-closed", (hit_prefix_closed.__doc__ or "").strip()),
    HitRule("hit_window_shape", "hit-per-attention-type", (hit_window_shape.__doc__ or "").strip()),
    HitRule(
        "hit_same_length",
        "hit-agreed",
        "Every KV cache group's hit covers the same tokens: as many positions in each group, "
        "the length every group's attention type can serve (vLLM's coordinator).",
    ),
    HitRule("hit_content_intact", "content-integrity", (hit_content_intact.__doc__ or "").strip()),
    HitRule(
        "hit_salt_isolated",
        "salt-isolation",
        "Requests with different cache_salt, LoRA or multimodal inputs never share a block: "
        "their chains differ from the first differing block on, and hits are prefix-closed.",
    ),
)


def check_hit(
    s: Snapshot,
    num_tokens: int,
    block_size: int,
    request_hashes: Sequence[BlockHash],
    hit_blocks: Sequence[BlockId],
    num_hit_tokens: int,
) -> None:
    """Check one hit against every hit rule.

    Raises:
        InvariantViolation: naming the rule the hit breaks.
    """
    groups = snapshot_groups(s)
    detail = (
        f"num_tokens={num_tokens} block_size={block_size} hit_blocks={list(hit_blocks)} "
        f"num_hit_tokens={num_hit_tokens}" + (f" groups={list(s.kv_groups)}" if s.kv_groups else "")
    )
    rules = {r.name: r.rule for r in HIT_RULES}
    n = len(hit_blocks) // len(groups)
    if not hit_within_cap(num_tokens, num_hit_tokens, block_size) or (
        len(groups) == 1 and num_hit_tokens != len(hit_blocks) * block_size
    ):
        raise InvariantViolation("hit_within_cap", rules["hit_within_cap"], detail)
    if len(hit_blocks) != n * len(groups) or num_hit_tokens != n * block_size:
        raise InvariantViolation("hit_same_length", rules["hit_same_length"], detail)
    for g, group in enumerate(groups):
        blocks = hit_blocks[g * n : (g + 1) * n]
        if not hit_prefix_closed(s, request_hashes, blocks, g):
            raise InvariantViolation("hit_prefix_closed", rules["hit_prefix_closed"], detail)
        if not hit_window_shape(group, blocks, block_size):
            raise InvariantViolation("hit_window_shape", rules["hit_window_shape"], detail)


# --- step rules ---------------------------------------------------------------------------

# Operations allowed to drop a hash-table entry without reallocating its block.
_DROPS_HASHES = frozenset({"evict_blocks", "reset_prefix_cache"})


def step_only_eviction_removes(before: Snapshot, after: Snapshot, op: str) -> bool:
    """A hash-table entry disappears only when its block is reallocated, evicted by id, or the cache is reset."""
    if op in _DROPS_HASHES:
        return True
    after_entries = {(h, b) for h, blocks in after.hash_to_blocks for b in blocks}
    after_free = set(after.free_queue)
    # A block a step freed from a position its group no longer reads (now null)
    # may be taken again in the same step: an allocation frees before it takes.
    nulled = _nulled_blocks(before, after)
    for h, blocks in before.hash_to_blocks:
        for b in blocks:
            # NOTE: judged from the states alone (callers name composite steps
            # freely): a block that left the free queue was taken. A touch that
            # wrongly drops a hash passes this rule; lock-step comparison catches it.
            reallocated = (b in before.free_queue or b in nulled) and b not in after_free
            if (h, b) not in after_entries and not reallocated:
                return False
    return True


def _nulled_blocks(before: Snapshot, after: Snapshot) -> set[int]:
    """The blocks whose table position became the null block between two snapshots (freed as skipped)."""
    if before.block_tables is None or after.block_tables is None:
        return set()
    now = dict(after.block_tables)
    return {
        b for name, table in before.block_tables for i, b in enumerate(table)
        if b != NULL_BLOCK_ID and name in now and i < len(now[name]) and now[name][i] == NULL_BLOCK_ID
    }  # fmt: skip


def step_null_block_never_freed(before: Snapshot, after: Snapshot, op: str) -> bool:
    """No operation ever puts the null block into the free queue."""
    return NULL_BLOCK_ID not in after.free_queue


@dataclass(frozen=True, slots=True)
class StepRule:
    """A named rule relating the state before an operation to the state after it."""

    name: str
    design_id: str
    check: Callable[[Snapshot, Snapshot, str], bool]

    @property
    def rule(self) -> str:
        """The rule in plain words."""
        return (self.check.__doc__ or "").strip()


STEP_RULES: tuple[StepRule, ...] = (
    StepRule("step_only_eviction_removes", "only-eviction-removes", step_only_eviction_removes),
    StepRule("step_null_block_never_freed", "null-block", step_null_block_never_freed),
)


def check_step(before: Snapshot, after: Snapshot, op: str) -> None:
    """Check one transition against every step rule.

    Raises:
        InvariantViolation: naming the first step rule broken.
    """
    for rule in STEP_RULES:
        if not rule.check(before, after, op):
            raise InvariantViolation(rule.name, rule.rule, f"op={op}\nbefore: {before}\nafter:  {after}")


# --- event rules ----------------------------------------------------------------------------


def event_mirror_exact(before: EventMirror, events: Sequence[KVCacheEvent], after: Snapshot) -> bool:
    """A router that reference-counts the events holds exactly the hash table's keys, one count per block."""
    return before.apply(events).matches(after.hash_to_blocks)


def event_parent_known(before: EventMirror, events: Sequence[KVCacheEvent], after: Snapshot) -> bool:
    """A full-attention group's stored blocks name as parent nothing, or a key the stream announced before."""
    # NOTE: "announced", not "held": a parent evicted by id while its request still
    # held it (a failed external load) is gone when the child is stored. A sliding or
    # chunked group's parent is the position before, which that group may never have
    # registered (it was null there): vLLM names it all the same, so the rule leaves
    # those groups out; `spec.events.orphaned_stores` reports both as a router sees them.
    groups = snapshot_groups(after)
    mirror = before
    for event in events:
        if isinstance(event, BlockStored) and event.parent_block_hash is not None:
            full = not (0 <= event.group_idx < len(groups)) or groups[event.group_idx].kind == "full"
            if full and event.parent_block_hash not in mirror.known:
                return False
        mirror = mirror.apply([event])
    return True


@dataclass(frozen=True, slots=True)
class EventRule:
    """A named rule relating a step's KV cache events to the router's mirror before them and the state after."""

    name: str
    design_id: str
    check: Callable[[EventMirror, Sequence[KVCacheEvent], Snapshot], bool]

    @property
    def rule(self) -> str:
        """The rule in plain words."""
        return (self.check.__doc__ or "").strip()


EVENT_RULES: tuple[EventRule, ...] = (
    EventRule("event_mirror_exact", "mirror-exact", event_mirror_exact),
    EventRule("event_parent_known", "parent-known", event_parent_known),
)


def check_events(before: EventMirror, events: Sequence[KVCacheEvent], after: Snapshot) -> None:
    """Check one step's events against every event rule.

    Raises:
        InvariantViolation: naming the first event rule broken.
    """
    for rule in EVENT_RULES:
        if not rule.check(before, events, after):
            detail = f"events: {list(events)}\nmirror before: {dict(before.counts)}\nafter: {after}"
            raise InvariantViolation(rule.name, rule.rule, detail)
