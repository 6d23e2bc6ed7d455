"""Every named rule, shown holding and shown failing under its own name.

Each state invariant in `INVARIANTS`, each hit rule `check_hit` enforces and
each step rule in `STEP_RULES` gets hand-built states where it holds and where
it fails. A failing state breaks only the rule under test wherever the rules
allow it; where they do not (a rule implied by others), the test says which
others fail with it. The tables at the top are checked against the registries,
so a new rule without a failing example fails the suite.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import replace

import pytest

from kvspec.spec import manager as spec_manager
from kvspec.spec import ops
from kvspec.spec.attention import FULL, KVGroup
from kvspec.spec.errors import InvariantViolation
from kvspec.spec.invariants import (
    HIT_RULES,
    INVARIANTS,
    STEP_RULES,
    all_hold,
    check_all,
    check_hit,
    check_step,
    failing,
    hit_content_intact,
    hit_prefix_closed,
    hit_window_shape,
    hit_within_cap,
    is_block_writable,
)
from kvspec.spec.manager import Request
from kvspec.spec.state import NULL_BLOCK_ID, BlockHash, BlockId, Snapshot, canonical_hash_to_blocks

H1, H2, H3, H4 = (BlockHash(b"h1"), BlockHash(b"h2"), BlockHash(b"h3"), BlockHash(b"h4"))

# The ids docs/design.md's invariant table uses; an Invariant's design_id is one of them or "".
DESIGN_IDS = {
    "free-has-zero-ref",
    "writable",
    "hash-table-consistent",
    "only-eviction-removes",
    "hit-cap",
    "prefix-closed",
    "conservation",
    "null-block",
    "no-shared-write",
    "salt-isolation",
    "content-integrity",
    "tables-hold-refs",
    "null-where-skipped",
    "groups-disjoint",
    "hit-per-attention-type",
    "hit-agreed",
}


def base() -> Snapshot:
    """A reachable manager-level state every invariant accepts.

    Seven blocks (0 is the null block). A holds [1, 2, 3], B hit A's first two
    blocks and holds [1, 2, 4]; block 5 is free and registered under h1 too (a
    duplicate kept, registered after block 1); block 6 is free and cached
    under h3 (hittable until reallocated).
    """
    return Snapshot(
        num_gpu_blocks=7,
        enable_caching=True,
        ref_cnt=(0, 2, 2, 1, 1, 0, 0),
        block_hash=(None, H1, H2, None, None, H1, H3),
        free_queue=(BlockId(5), BlockId(6)),
        hash_to_blocks=canonical_hash_to_blocks(
            ((H1, (BlockId(1), BlockId(5))), (H2, (BlockId(2),)), (H3, (BlockId(6),)))
        ),
        block_tables=(("A", (BlockId(1), BlockId(2), BlockId(3))), ("B", (BlockId(1), BlockId(2), BlockId(4)))),
    )


def pool_base() -> Snapshot:
    """`base()` at the pool level: no block tables."""
    return replace(base(), block_tables=None)


def with_table(s: Snapshot, *entries: tuple[BlockHash, tuple[int, ...]]) -> Snapshot:
    return replace(s, hash_to_blocks=canonical_hash_to_blocks(tuple((h, tuple(map(BlockId, b))) for h, b in entries)))


def with_block_hash(s: Snapshot, block_id: int, h: BlockHash | None) -> Snapshot:
    hashes = list(s.block_hash)
    hashes[block_id] = h
    return replace(s, block_hash=tuple(hashes))


def with_ref_cnt(s: Snapshot, block_id: int, n: int) -> Snapshot:
    refs = list(s.ref_cnt)
    refs[block_id] = n
    return replace(s, ref_cnt=tuple(refs))


def quarantined_6() -> Snapshot:
    """Block 6 found corrupt: unhashed, out of the queue and the table, held by nobody."""
    s = with_table(with_block_hash(base(), 6, None), (H1, (1, 5)), (H2, (2,)))
    return replace(s, free_queue=(BlockId(5),), quarantined=(BlockId(6),))


def caching_off() -> Snapshot:
    """A caching-off pool: nothing hashed, A and B hold their own blocks."""
    return Snapshot(
        num_gpu_blocks=5,
        enable_caching=False,
        ref_cnt=(0, 1, 1, 0, 0),
        block_hash=(None,) * 5,
        free_queue=(BlockId(4), BlockId(3)),
        hash_to_blocks=(),
        block_tables=(("A", (BlockId(1),)), ("B", (BlockId(2),))),
    )


# --- states where every invariant holds ------------------------------------------------------


def _reachable() -> list[Snapshot]:
    """States the spec's own operations reach (the operations carry the contracts too)."""
    s = ops.new_pool(6)
    step = ops.get_new_blocks(s, 3)
    s, taken = step.state, step.result
    s = ops.cache_full_blocks(s, taken[:2], (H1, H2)).state
    s = ops.touch(s, taken[:2]).state
    after_touch = s
    s = ops.free_blocks(s, taken[::-1]).state
    s = ops.free_blocks(s, taken[1::-1]).state
    after_free = s
    assert after_free.free_queue == (3, 4, 5, 2, 1)
    s = ops.get_new_blocks(s, 5).state  # evicts both cached blocks
    return [ops.new_pool(1).snapshot(), after_touch.snapshot(), after_free.snapshot(), s.snapshot()]


def two_groups() -> Snapshot:
    """Full attention and a window of 8 tokens: A's 15 tokens computed, the window's first block freed and nulled."""
    state = spec_manager.new_manager(13, 4, groups="full,sliding:8")
    state = spec_manager.allocate_slots(state, Request("a", tuple(range(14))), 14).state
    state = spec_manager.allocate_slots(state, Request("a", tuple(range(15))), 1).state
    snap = state.snapshot()
    assert snap.block_tables == (("a", (1, 2, 3, 4)), ("a#1", (0, 6, 7, 8))) and snap.kv_groups == ("full", "sliding:8")
    return snap


HOLDING: dict[str, Callable[[], Snapshot]] = {
    "two KV cache groups, the window's null position": two_groups,
    "manager level, shared and duplicate cached blocks": base,
    "pool level": pool_base,
    "a quarantined block": quarantined_6,
    "caching off": caching_off,
    "a one-block pool (only the null block)": lambda: ops.new_pool(1).snapshot(),
}


@pytest.mark.parametrize("build", HOLDING.values(), ids=HOLDING.keys())
def test_every_invariant_holds(build: Callable[[], Snapshot]) -> None:
    s = build()
    assert failing(s) == []
    assert all_hold(s)
    check_all(s)


@pytest.mark.parametrize("index", range(4))
def test_every_invariant_holds_on_states_the_operations_reach(index: int) -> None:
    check_all(_reachable()[index])


def test_a_quarantined_block_out_of_the_free_queue_is_not_a_violation() -> None:
    # Regression: inv_free_queue_has_zero_ref asked every ref-0 block to be
    # queued, so any snapshot with a quarantined block failed check_all.
    # Steps: blocks 1..6, A=[1,2,3], B=[1,2,4], block 5 free (h1 duplicate),
    # block 6 quarantined; expected free queue [5], quarantined [6].
    s = quarantined_6()
    assert s.free_queue == (5,) and s.quarantined == (6,)
    check_all(s)
    # ... and a quarantined block that is also queued is still refused.
    queued = replace(s, free_queue=(BlockId(5), BlockId(6)))
    assert "inv_free_queue_has_zero_ref" in failing(queued)


# --- states where one invariant fails ---------------------------------------------------------

# name -> (description, state, every invariant the state breaks, in registry order).
# The first listed is the invariant under test; any others are broken with it
# only because the rules make it unavoidable (see the comments).
BROKEN: dict[str, list[tuple[str, Callable[[], Snapshot], list[str]]]] = {
    "inv_pool_shape": [
        ("ref_cnt has one entry too few", lambda: replace(base(), ref_cnt=base().ref_cnt[:-1]), ["inv_pool_shape"]),
        (
            "block_hash has one entry too many",
            lambda: replace(base(), block_hash=base().block_hash + (None,)),
            ["inv_pool_shape"],
        ),
        (
            "a block table names block 7 of a 7-block pool",
            lambda: replace(
                base(),
                block_tables=(
                    ("A", (BlockId(1), BlockId(2), BlockId(3), BlockId(7))),
                    ("B", (BlockId(1), BlockId(2), BlockId(4))),
                ),
            ),
            ["inv_pool_shape"],
        ),
        (
            "the free queue names block -1",
            lambda: replace(base(), free_queue=(BlockId(5), BlockId(6), BlockId(-1))),
            ["inv_pool_shape"],
        ),
        ("a pool with no block at all", lambda: Snapshot(0, True, (), (), (), ()), ["inv_pool_shape"]),
    ],
    "inv_ref_cnt_nonnegative": [
        # A block with a negative count is neither free nor held, so the count
        # of free plus held blocks comes out one short: conservation breaks too.
        (
            "block 3 held by -1 requests",
            lambda: with_ref_cnt(pool_base(), 3, -1),
            ["inv_ref_cnt_nonnegative", "inv_conservation"],
        ),
    ],
    "inv_null_block_isolated": [
        (
            "the null block is hashed and registered",
            lambda: with_table(with_block_hash(base(), 0, H4), (H1, (1, 5)), (H2, (2,)), (H3, (6,)), (H4, (0,))),
            ["inv_null_block_isolated"],
        ),
        ("the null block has a reference count", lambda: with_ref_cnt(pool_base(), 0, 1), ["inv_null_block_isolated"]),
        # Queued, the null block is also one free block too many.
        (
            "the null block is in the free queue",
            lambda: replace(base(), free_queue=(BlockId(0), BlockId(5), BlockId(6))),
            ["inv_null_block_isolated", "inv_free_queue_has_zero_ref", "inv_conservation"],
        ),
    ],
    "inv_free_queue_has_zero_ref": [
        (
            "held block 3 queued in place of free block 6",
            lambda: replace(base(), free_queue=(BlockId(5), BlockId(3))),
            ["inv_free_queue_has_zero_ref"],
        ),
        (
            "block 5 queued twice, free block 6 missing",
            lambda: replace(base(), free_queue=(BlockId(5), BlockId(5))),
            ["inv_free_queue_has_zero_ref"],
        ),
    ],
    "inv_quarantine_isolated": [
        (
            "quarantined block 6 keeps its hash",
            lambda: replace(
                with_table(base(), (H1, (1, 5)), (H2, (2,)), (H3, (6,))),
                free_queue=(BlockId(5),),
                quarantined=(BlockId(6),),
            ),
            ["inv_quarantine_isolated"],
        ),
        # Held and quarantined, block 3 is counted twice.
        (
            "quarantined block 3 is held",
            lambda: replace(base(), quarantined=(BlockId(3),)),
            ["inv_quarantine_isolated", "inv_conservation"],
        ),
    ],
    # NOTE: conservation follows from the invariants before it (every block but
    # the null block is queued once iff its count is 0 and it is not
    # quarantined; counts are non-negative; quarantined blocks are distinct,
    # unheld and unqueued), so no state breaks it alone and check_all can never
    # name it first. Its examples assert that it is among the rules broken.
    "inv_conservation": [
        (
            "block 3 held by -1 requests",
            lambda: with_ref_cnt(pool_base(), 3, -1),
            ["inv_ref_cnt_nonnegative", "inv_conservation"],
        ),
        (
            "free block 6 lost from the queue",
            lambda: replace(base(), free_queue=(BlockId(5),)),
            ["inv_free_queue_has_zero_ref", "inv_conservation"],
        ),
    ],
    "inv_hash_table_consistent": [
        (
            "block 6 hashed h3 but listed under h4",
            lambda: with_table(base(), (H1, (1, 5)), (H2, (2,)), (H4, (6,))),
            ["inv_hash_table_consistent"],
        ),
        (
            "held block 3 has a hash the table does not list",
            lambda: with_block_hash(base(), 3, H4),
            ["inv_hash_table_consistent"],
        ),
        (
            "block 5 listed under h1 twice",
            lambda: with_table(base(), (H1, (1, 5, 5)), (H2, (2,)), (H3, (6,))),
            ["inv_hash_table_consistent"],
        ),
        (
            "an entry with no block",
            lambda: with_table(base(), (H1, (1, 5)), (H2, (2,)), (H3, (6,)), (H4, ())),
            ["inv_hash_table_consistent"],
        ),
        (
            "hash h1 has two entries",
            lambda: replace(
                base(),
                hash_to_blocks=((H1, (BlockId(1),)), (H2, (BlockId(2),)), (H1, (BlockId(5),)), (H3, (BlockId(6),))),
            ),
            ["inv_hash_table_consistent"],
        ),
    ],
    "inv_caching_off_no_hash": [
        (
            "caching off, yet blocks are cached",
            lambda: replace(base(), enable_caching=False),
            ["inv_caching_off_no_hash"],
        ),
    ],
    "inv_block_tables_hold_refs": [
        (
            "block 3 has ref_cnt 1 but no table holds it",
            lambda: replace(
                base(), block_tables=(("A", (BlockId(1), BlockId(2))), ("B", (BlockId(1), BlockId(2), BlockId(4))))
            ),
            ["inv_block_tables_hold_refs"],
        ),
        (
            "B's table holds free block 5",
            lambda: replace(
                base(),
                block_tables=(
                    ("A", (BlockId(1), BlockId(2), BlockId(3))),
                    ("B", (BlockId(1), BlockId(2), BlockId(4), BlockId(5))),
                ),
            ),
            ["inv_block_tables_hold_refs"],
        ),
        (
            "A's table holds block 3 twice",
            lambda: with_ref_cnt(
                replace(
                    base(),
                    block_tables=(
                        ("A", (BlockId(1), BlockId(2), BlockId(3), BlockId(3))),
                        ("B", (BlockId(1), BlockId(2), BlockId(4))),
                    ),
                ),
                3,
                2,
            ),
            ["inv_block_tables_hold_refs"],
        ),
    ],
    "inv_null_only_where_skipped": [
        (
            "a full-attention table holds the null block",
            lambda: replace(
                base(),
                block_tables=(
                    ("A", (BlockId(1), BlockId(2), BlockId(3), BlockId(0))),
                    ("B", (BlockId(1), BlockId(2), BlockId(4))),
                ),
            ),
            ["inv_null_only_where_skipped"],
        ),
        (
            "the window's null block after a block it still holds",
            lambda: replace(
                two_groups(),
                block_tables=(
                    ("a", (BlockId(1), BlockId(2), BlockId(3), BlockId(4))),
                    ("a#1", (BlockId(6), BlockId(0), BlockId(7), BlockId(8))),
                ),
            ),
            ["inv_null_only_where_skipped"],
        ),
        (
            "a table named for a group the manager does not have",
            lambda: replace(two_groups(), block_tables=(*(two_groups().block_tables or ()), ("a#2", ()))),
            ["inv_null_only_where_skipped"],
        ),
    ],
    "inv_groups_disjoint": [
        # Held by both groups' tables, block 6's count is 2 where 1 is recorded.
        (
            "block 6 in full attention's table and the window's",
            lambda: with_ref_cnt(
                replace(
                    two_groups(),
                    block_tables=(
                        ("a", (BlockId(1), BlockId(2), BlockId(3), BlockId(4), BlockId(6))),
                        ("a#1", (BlockId(0), BlockId(6), BlockId(7), BlockId(8))),
                    ),
                ),
                6,
                2,
            ),
            ["inv_groups_disjoint"],
        ),
    ],
}

BROKEN_CASES = [
    pytest.param(name, build, expected, id=f"{name}: {description}")
    for name, cases in BROKEN.items()
    for description, build, expected in cases
]


def test_every_invariant_has_a_failing_example() -> None:
    assert list(BROKEN) == [inv.name for inv in INVARIANTS]


@pytest.mark.parametrize(("name", "build", "expected"), BROKEN_CASES)
def test_a_broken_state_is_named(name: str, build: Callable[[], Snapshot], expected: list[str]) -> None:
    s = build()
    assert name in expected
    assert failing(s) == expected
    assert not all_hold(s)
    predicate = next(inv.check for inv in INVARIANTS if inv.name == name)
    assert not predicate(s)
    with pytest.raises(InvariantViolation, match=rf"^invariant {re.escape(expected[0])} violated: ") as info:
        check_all(s)
    assert info.value.name == expected[0]
    assert info.value.rule == next(inv.rule for inv in INVARIANTS if inv.name == expected[0])
    assert str(s) in str(info.value)  # the snapshot is printed


@pytest.mark.parametrize("inv", INVARIANTS, ids=[inv.name for inv in INVARIANTS])
def test_each_invariant_is_named_by_check_all_or_is_implied(inv) -> None:
    """check_all names each invariant on some state, except conservation, which the others imply."""
    firsts = {expected[0] for _, _, expected in BROKEN[inv.name]}
    if inv.name == "inv_conservation":
        assert firsts.isdisjoint({"inv_conservation"})
    else:
        assert inv.name in firsts


@pytest.mark.parametrize("inv", INVARIANTS, ids=[inv.name for inv in INVARIANTS])
def test_each_invariant_states_its_rule_in_one_sentence(inv) -> None:
    assert inv.name.startswith("inv_")
    assert inv.design_id in DESIGN_IDS | {""}
    assert inv.rule.endswith(".") and "\n" not in inv.rule and inv.rule[0].isupper()


# --- is_block_writable (the `writable` rule) -------------------------------------------------


@pytest.mark.parametrize(
    ("block_id", "writable", "why"),
    [
        (0, False, "the null block"),
        (1, False, "shared by A and B, and hashed"),
        (2, False, "shared by A and B, and hashed"),
        (3, True, "held by A alone, no hash"),
        (4, True, "held by B alone, no hash"),
        (5, False, "free (and hashed)"),
        (6, False, "free (and hashed)"),
        (7, False, "out of range"),
        (-1, False, "out of range"),
    ],
)
def test_is_block_writable(block_id: int, writable: bool, why: str) -> None:
    assert is_block_writable(base(), block_id) is writable, why


def test_a_sole_holder_may_not_write_a_hashed_block() -> None:
    s = with_table(with_block_hash(base(), 3, H4), (H1, (1, 5)), (H2, (2,)), (H3, (6,)), (H4, (3,)))
    check_all(s)
    assert s.ref_cnt[3] == 1 and not is_block_writable(s, 3)


def test_a_free_unhashed_block_is_not_writable() -> None:
    s = caching_off()
    assert s.ref_cnt[3] == 0 and s.block_hash[3] is None and not is_block_writable(s, 3)
    assert is_block_writable(s, 1)


# --- hit rules --------------------------------------------------------------------------------

REQUEST_HASHES = (H1, H2, H4)  # A request whose first two blocks are cached (blocks 1 and 2).


def test_check_hit_accepts_a_capped_prefix_hit() -> None:
    check_hit(base(), 13, 4, REQUEST_HASHES, (BlockId(1), BlockId(2)), 8)
    check_hit(base(), 9, 4, REQUEST_HASHES, (BlockId(1), BlockId(2)), 8)  # 8 <= 9 - 1
    check_hit(base(), 1, 4, (), (), 0)  # a one-token prompt can hit nothing
    check_hit(base(), 13, 4, REQUEST_HASHES, (BlockId(5),), 4)  # a duplicate registered under h1


@pytest.mark.parametrize(
    ("num_tokens", "hit_blocks", "num_hit_tokens", "why"),
    [
        (8, (1, 2), 8, "the whole 8-token prompt hit: its last token must be computed"),
        (13, (1, 2), 6, "6 tokens is not whole blocks"),
        (13, (1, 2), 4, "two hit blocks but 4 tokens"),
    ],
)
def test_check_hit_names_hit_within_cap(
    num_tokens: int, hit_blocks: tuple[int, ...], num_hit_tokens: int, why: str
) -> None:
    with pytest.raises(InvariantViolation, match=r"^invariant hit_within_cap violated: ") as info:
        check_hit(base(), num_tokens, 4, REQUEST_HASHES, tuple(map(BlockId, hit_blocks)), num_hit_tokens)
    assert info.value.name == "hit_within_cap", why


@pytest.mark.parametrize(
    ("hit_blocks", "why"),
    [
        ((2,), "block 2 is h2, not the request's first hash"),
        ((1, 6), "a gap: block 6 is h3, the request's second hash is h2"),
        ((1, 2, 3), "block 3 has no hash"),
        ((1, 2, 5, 6), "more hits than the request has hashes"),
    ],
)
def test_check_hit_names_hit_prefix_closed(hit_blocks: tuple[int, ...], why: str) -> None:
    blocks = tuple(map(BlockId, hit_blocks))
    with pytest.raises(InvariantViolation, match=r"^invariant hit_prefix_closed violated: ") as info:
        check_hit(base(), 40, 4, REQUEST_HASHES, blocks, 4 * len(blocks))
    assert info.value.name == "hit_prefix_closed", why


def test_hit_predicates_hold_and_fail() -> None:
    assert hit_within_cap(9, 8, 4) and not hit_within_cap(8, 8, 4) and not hit_within_cap(9, -4, 4)
    assert hit_prefix_closed(base(), REQUEST_HASHES, (BlockId(1), BlockId(2)))
    assert not hit_prefix_closed(base(), REQUEST_HASHES, (BlockId(2),))


def test_hit_content_intact_holds_and_fails() -> None:
    # Not enforced by check_hit (it needs KV memory); gpu_impl's checks call it directly.
    assert hit_content_intact([3, 1, 4, 1], [3, 1, 4, 1])
    assert not hit_content_intact([3, 1, 4, 1], [3, 1, 4, 2])  # one slot overwritten
    assert not hit_content_intact([3, 1, 4, 1], [3, 1, 4])  # a slot missing


def test_a_hit_across_tenants_is_not_prefix_closed() -> None:
    # hit_salt_isolated has no predicate of its own: salted chains share no hash
    # (tests/spec/test_hashing.py), so a hit on another tenant's block is caught
    # as not prefix-closed.
    tenant_b = (H4, BlockHash(b"h5"))
    with pytest.raises(InvariantViolation, match=r"^invariant hit_prefix_closed violated: "):
        check_hit(base(), 9, 4, tenant_b, (BlockId(1), BlockId(2)), 8)


def test_hit_rules_registry() -> None:
    assert [r.name for r in HIT_RULES] == [
        "hit_within_cap",
        "hit_prefix_closed",
        "hit_window_shape",
        "hit_same_length",
        "hit_content_intact",
        "hit_salt_isolated",
    ]
    for rule in HIT_RULES:
        assert rule.design_id in DESIGN_IDS and rule.rule.endswith(".")
    assert HIT_RULES[0].rule == (hit_within_cap.__doc__ or "").strip()


# --- step rules -------------------------------------------------------------------------------


def _evicted_6() -> Snapshot:
    """`pool_base()` after get_new_blocks(2) took blocks 5 and 6, evicting both cached hashes."""
    s = pool_base()
    s = replace(s, ref_cnt=(0, 2, 2, 1, 1, 1, 1), free_queue=())
    s = with_block_hash(with_block_hash(s, 5, None), 6, None)
    return with_table(s, (H1, (1,)), (H2, (2,)))


def test_step_rules_hold_on_an_eviction() -> None:
    before, after = pool_base(), _evicted_6()
    check_all(after)
    check_step(before, after, "get_new_blocks")
    check_step(before, before, "free_blocks")


@pytest.mark.parametrize("op", ["reset_prefix_cache", "evict_blocks"])
def test_step_only_eviction_removes_allows_reset_and_evict(op: str) -> None:
    before = pool_base()
    dropped = with_table(with_block_hash(before, 1, None), (H1, (5,)), (H2, (2,)), (H3, (6,)))
    check_step(before, dropped, op)


@pytest.mark.parametrize(
    ("after", "op", "why"),
    [
        (
            lambda: with_table(with_block_hash(pool_base(), 1, None), (H1, (5,)), (H2, (2,)), (H3, (6,))),
            "free_blocks",
            "held block 1 lost its h1 entry while still held",
        ),
        (
            lambda: with_table(with_block_hash(pool_base(), 6, None), (H1, (1, 5)), (H2, (2,))),
            "touch",
            "free block 6 lost its entry but is still queued",
        ),
        (
            lambda: with_table(with_block_hash(pool_base(), 6, H4), (H1, (1, 5)), (H2, (2,)), (H4, (6,))),
            "cache_full_blocks",
            "block 6 was re-registered under another hash without being reallocated",
        ),
    ],
)
def test_check_step_names_step_only_eviction_removes(after: Callable[[], Snapshot], op: str, why: str) -> None:
    with pytest.raises(InvariantViolation, match=r"^invariant step_only_eviction_removes violated: ") as info:
        check_step(pool_base(), after(), op)
    assert info.value.name == "step_only_eviction_removes", why


def test_check_step_names_step_null_block_never_freed() -> None:
    before = pool_base()
    after = replace(before, free_queue=(BlockId(5), BlockId(6), NULL_BLOCK_ID))
    with pytest.raises(InvariantViolation, match=r"^invariant step_null_block_never_freed violated: ") as info:
        check_step(before, after, "free_blocks")
    assert info.value.name == "step_null_block_never_freed"
    assert "op=free_blocks" in str(info.value)


def test_every_step_rule_has_a_failing_example() -> None:
    tested = {"step_only_eviction_removes", "step_null_block_never_freed"}
    assert {r.name for r in STEP_RULES} == tested
    for rule in STEP_RULES:
        assert rule.design_id in DESIGN_IDS and rule.rule.endswith(".")


# --- hit rules with KV cache groups ------------------------------------------------------------


def _hit_state() -> tuple[Snapshot, tuple[BlockHash, ...], Request]:
    """A's 17 tokens computed whole on full attention (blocks 1-5) and a window of 8 (6-10), A freed: B, with
    A's tokens, may hit 4 positions."""
    state = spec_manager.new_manager(13, 4, groups="full,sliding:8")
    a = Request("a", tuple(range(17)))
    state = spec_manager.free(spec_manager.allocate_slots(state, a, 17).state, "a").state
    b = Request("b", a.token_ids)
    return state.snapshot(), spec_manager.request_block_hashes(state, b), b


def test_the_spec_hit_over_two_groups_holds_every_hit_rule() -> None:
    snap, hashes, b = _hit_state()
    assert snap.kv_groups == ("full", "sliding:8")
    blocks = (1, 2, 3, 4, 0, 0, 8, 9)  # full attention all four; the window only the two before token 16
    check_hit(snap, len(b.token_ids), 4, hashes, tuple(map(BlockId, blocks)), 16)


@pytest.mark.parametrize(
    ("blocks", "num_tokens", "rule"),
    [
        ((1, 2, 3, 4, 0, 0, 8), 16, "hit_same_length"),  # the window has a position fewer
        ((1, 2, 3, 4, 6, 7, 8, 9), 16, "hit_window_shape"),  # the window hits blocks before its window
        ((1, 2, 3, 4, 0, 0, 0, 9), 16, "hit_window_shape"),  # the window lacks a block its first token reads
        ((1, 0, 3, 4, 0, 0, 8, 9), 16, "hit_window_shape"),  # full attention with the null block
        ((1, 2, 3, 4, 0, 0, 3, 4), 16, "hit_prefix_closed"),  # full attention's blocks in the window's positions
    ],
)
def test_a_bad_hit_over_two_groups_is_named(blocks: tuple[int, ...], num_tokens: int, rule: str) -> None:
    snap, hashes, b = _hit_state()
    with pytest.raises(InvariantViolation, match=rf"^invariant {rule} violated: "):
        check_hit(snap, len(b.token_ids), 4, hashes, tuple(map(BlockId, blocks)), num_tokens)


def test_hit_window_shape_per_attention_type() -> None:
    window, chunk = KVGroup("sliding", 8), KVGroup("chunked", 8)
    assert hit_window_shape(window, tuple(map(BlockId, (0, 0, 7, 8))), 4)
    assert hit_window_shape(window, tuple(map(BlockId, (5,))), 4)  # a run from the first block, shorter than W
    assert not hit_window_shape(window, tuple(map(BlockId, (0, 6, 7, 8))), 4)
    assert hit_window_shape(chunk, tuple(map(BlockId, (0, 0, 7))), 4)  # the chunk of token 12 starts at 8
    assert not hit_window_shape(chunk, tuple(map(BlockId, (0, 6, 7))), 4)
    assert not hit_window_shape(FULL, tuple(map(BlockId, (0, 6))), 4)
