"""A caller's mistake: the same typed error from the spec and the reference, and no change.

Every case runs on both models through the built-in adapters: the same setup
steps, then one bad call. Both must raise the same error type with the same
message (pinned by an anchored pattern), and the snapshot afterwards must equal
the one before, exactly.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import pytest

from kvspec.conformance.core.adapter import AdapterConfig
from kvspec.conformance.targets.builtin import make_reference, make_spec
from kvspec.gpu_impl.kv_cache_manager import TensorKVCacheManager
from kvspec.reference.kv_cache_manager import KVCacheManager
from kvspec.spec import manager as spec_manager
from kvspec.spec.errors import (
    AlreadyCached,
    BlockManagerError,
    DoubleFree,
    InvalidBlock,
    InvalidRequest,
    PoolExhausted,
)
from kvspec.spec.hashing import MultiModalInput
from kvspec.spec.invariants import check_all
from kvspec.spec.manager import Request
from kvspec.spec.state import BlockHash, BlockId

IMPLS = {"spec": make_spec, "reference": make_reference}
H1, H2, H3, H4 = (BlockHash(b"h1"), BlockHash(b"h2"), BlockHash(b"h3"), BlockHash(b"h4"))

A = Request("A", tuple(range(1, 11)))  # 10 tokens: two full blocks of 4, then 2 tokens
B = Request("B", tuple(range(1, 9)) + (50, 51))  # shares A's first 8 tokens


@dataclass(frozen=True)
class Case:
    """One bad call after some setup steps."""

    id: str
    call: Callable[[Any], object]  # the bad call, on the adapter
    error: type[BlockManagerError]
    pattern: str  # anchored at both ends
    setup: Callable[[Any], None] = lambda a: None
    config: dict[str, Any] = field(default_factory=dict)
    level: str = "pool"


def a_holds_1_2_3(p: Any) -> None:
    """Pool: A took blocks [1, 2, 3] and registered 1 and 2 under h1, h2."""
    assert p.get_new_blocks(3) == [1, 2, 3]
    p.cache_full_blocks([BlockId(1), BlockId(2)], [H1, H2])


def a_freed_3(p: Any) -> None:
    a_holds_1_2_3(p)
    p.free_blocks([BlockId(3)])


def a_runs(m: Any) -> None:
    """Manager: A's 10-token prefill took [1, 2, 3]; 1 and 2 are registered."""
    assert m.allocate_slots(A, 10) == [1, 2, 3]


def a_finished(m: Any) -> None:
    a_runs(m)
    m.free("A")


def a_freed_all(p: Any) -> None:
    """Pool: A freed [3, 2, 1]; 1 and 2 stay cached in the free queue, 3 went to its left end."""
    a_holds_1_2_3(p)
    p.free_blocks([BlockId(3), BlockId(2), BlockId(1)])


def call(m: Any, op: str, request: Request) -> object:
    """`op` on a new request: a lookup, or a first step of all its tokens."""
    return m.get_computed_blocks(request) if op == "get_computed_blocks" else m.allocate_slots(request, 10)


def ids(*b: int) -> list[BlockId]:
    return [BlockId(x) for x in b]


NOT_INT = r"must be a non-negative integer; got"

POOL_CASES = [
    # allocating more than is free
    Case(
        "get_new_blocks more than free",
        lambda p: p.get_new_blocks(7),
        PoolExhausted,
        r"cannot allocate num_blocks=7: 6 free of num_gpu_blocks=7, one is the null block",
    ),
    Case(
        "get_new_blocks more than left",
        lambda p: p.get_new_blocks(4),
        PoolExhausted,
        r"cannot allocate num_blocks=4: 3 free of num_gpu_blocks=7, one is the null block",
        a_holds_1_2_3,
    ),
    # a negative, bool or non-integer count
    *[
        Case(
            f"get_new_blocks({v!r})",
            lambda p, v=v: p.get_new_blocks(v),
            InvalidRequest,
            rf"get_new_blocks: num_blocks {NOT_INT} num_blocks={pattern}",
        )
        for v, pattern in ((-1, "-1"), (True, "True"), (2.0, r"2\.0"), ("2", "'2'"), (None, "None"))
    ],
    # freeing twice, or a block no request holds
    Case(
        "free_blocks twice",
        lambda p: p.free_blocks(ids(3)),
        DoubleFree,
        r"free_blocks: block_id=3 has ref_cnt=0, no request holds it \(double free\?\)",
        a_freed_3,
    ),
    Case(
        "free_blocks a block never taken",
        lambda p: p.free_blocks(ids(5)),
        DoubleFree,
        r"free_blocks: block_id=5 has ref_cnt=0, no request holds it \(double free\?\)",
        a_holds_1_2_3,
    ),
    Case(
        "free_blocks a held block then a free one",
        lambda p: p.free_blocks(ids(3, 5)),
        DoubleFree,
        r"free_blocks: block_id=5 has ref_cnt=0, no request holds it \(double free\?\)",
        a_holds_1_2_3,
    ),
    Case(
        "free_blocks a block twice in one call",
        lambda p: p.free_blocks(ids(3, 3)),
        InvalidRequest,
        r"free_blocks: block_ids=\[3, 3\] names a block twice",
        a_holds_1_2_3,
    ),
    # freeing the null block, or a block that does not exist
    Case(
        "free_blocks the null block",
        lambda p: p.free_blocks(ids(0)),
        InvalidBlock,
        r"free_blocks: block_id=0 is the null block, whose ref_cnt is never maintained",
        a_holds_1_2_3,
    ),
    Case(
        "free_blocks a held block then the null block",
        lambda p: p.free_blocks(ids(1, 0)),
        InvalidBlock,
        r"free_blocks: block_id=0 is the null block, whose ref_cnt is never maintained",
        a_holds_1_2_3,
    ),
    Case(
        "free_blocks block 7 of 7",
        lambda p: p.free_blocks(ids(3, 7)),
        InvalidBlock,
        r"free_blocks: block_id=7 is not a block of this pool \(ids 0\.\.6\)",
        a_holds_1_2_3,
    ),
    Case(
        "free_blocks block True",
        lambda p: p.free_blocks([True]),
        InvalidBlock,
        r"free_blocks: block_id=True is not a block of this pool \(ids 0\.\.6\)",
        a_holds_1_2_3,
    ),
    Case(
        "free_blocks with evict_first=1",
        lambda p: p.free_blocks(ids(3), 1),
        InvalidRequest,
        r"free_blocks: evict_first=1 is not a bool",
        a_holds_1_2_3,
    ),
    # touching the null block, an unknown block, an unhashed block
    Case(
        "touch the null block",
        lambda p: p.touch(ids(0)),
        InvalidBlock,
        r"touch: block_id=0 is the null block, whose ref_cnt is never maintained",
        a_holds_1_2_3,
    ),
    *[
        Case(
            f"touch block {v!r}",
            lambda p, v=v: p.touch([v]),
            InvalidBlock,
            rf"touch: block_id={pattern} is not a block of this pool \(ids 0\.\.6\)",
            a_holds_1_2_3,
        )
        for v, pattern in ((9, "9"), (-1, "-1"), ("1", "'1'"), (1.0, r"1\.0"))
    ],
    Case(
        "touch a held block without a hash",
        lambda p: p.touch(ids(3)),
        InvalidBlock,
        r"touch: block_id=3 has no hash \(ref_cnt=1\), so no request can have hit it; stale block table\?",
        a_holds_1_2_3,
    ),
    Case(
        "touch a free block without a hash",
        lambda p: p.touch(ids(4)),
        InvalidBlock,
        r"touch: block_id=4 has no hash \(ref_cnt=0\), so no request can have hit it; stale block table\?",
        a_holds_1_2_3,
    ),
    Case(
        "touch a hashed block then an unhashed one",
        lambda p: p.touch(ids(1, 3)),
        InvalidBlock,
        r"touch: block_id=3 has no hash \(ref_cnt=1\), so no request can have hit it; stale block table\?",
        a_holds_1_2_3,
    ),
    Case(
        "touch a block twice in one call",
        lambda p: p.touch(ids(1, 1)),
        InvalidRequest,
        r"touch: block_ids=\[1, 1\] names a block twice",
        a_holds_1_2_3,
    ),
    # the mistake after good ids: the references taken for 1 and 2 (free, so queued) are given back
    Case(
        "touch two cached free blocks, then block 9",
        lambda p: p.touch(ids(1, 2, 9)),
        InvalidBlock,
        r"touch: block_id=9 is not a block of this pool \(ids 0\.\.6\)",
        a_freed_all,
    ),
    Case(
        "touch two cached free blocks, then the first again",
        lambda p: p.touch(ids(1, 2, 1)),
        InvalidRequest,
        r"touch: block_ids=\[1, 2, 1\] names a block twice",
        a_freed_all,
    ),
    # the spec's order: a bad id before a duplicate before a block without a hash, wherever they stand
    Case(
        "touch an unhashed block, then block 9",
        lambda p: p.touch(ids(1, 3, 9)),
        InvalidBlock,
        r"touch: block_id=9 is not a block of this pool \(ids 0\.\.6\)",
        a_freed_all,
    ),
    Case(
        "touch an unhashed block, then a cached one twice",
        lambda p: p.touch(ids(3, 2, 2)),
        InvalidRequest,
        r"touch: block_ids=\[3, 2, 2\] names a block twice",
        a_freed_all,
    ),
    # caching a block not held, already hashed, with caching off, or with a length mismatch
    Case(
        "cache_full_blocks a free block",
        lambda p: p.cache_full_blocks(ids(4), [H3]),
        InvalidBlock,
        r"cache_full_blocks: block_id=4 has ref_cnt=0; only a held, computed block is cached",
        a_holds_1_2_3,
    ),
    Case(
        "cache_full_blocks a block already hashed",
        lambda p: p.cache_full_blocks(ids(1), [H3]),
        AlreadyCached,
        r"cache_full_blocks: block_id=1 is already registered; a block is cached once",
        a_holds_1_2_3,
    ),
    Case(
        "cache_full_blocks a new block then a hashed one",
        lambda p: p.cache_full_blocks(ids(3, 1), [H3, H4]),
        AlreadyCached,
        r"cache_full_blocks: block_id=1 is already registered; a block is cached once",
        a_holds_1_2_3,
    ),
    Case(
        "cache_full_blocks with caching off",
        lambda p: p.cache_full_blocks(ids(1), [H1]),
        InvalidRequest,
        r"cache_full_blocks: prefix caching is off \(enable_caching=False\), nothing is hashed",
        lambda p: p.get_new_blocks(1),
        {"enable_caching": False},
    ),
    Case(
        "cache_full_blocks one block, two hashes",
        lambda p: p.cache_full_blocks(ids(3), [H3, H4]),
        InvalidRequest,
        r"cache_full_blocks: 1 block_ids but 2 block_hashes; one hash per block",
        a_holds_1_2_3,
    ),
    Case(
        "cache_full_blocks a str hash",
        lambda p: p.cache_full_blocks(ids(3), ["h3"]),
        InvalidRequest,
        r"cache_full_blocks: block_hash='h3' for block_id=3 is not bytes",
        a_holds_1_2_3,
    ),
    Case(
        "cache_full_blocks the null block",
        lambda p: p.cache_full_blocks(ids(0), [H3]),
        InvalidBlock,
        r"cache_full_blocks: block_id=0 is the null block, whose ref_cnt is never maintained",
        a_holds_1_2_3,
    ),
    Case(
        "cache_full_blocks a block twice",
        lambda p: p.cache_full_blocks(ids(3, 3), [H3, H4]),
        InvalidRequest,
        r"cache_full_blocks: block_ids=\[3, 3\] names a block twice",
        a_holds_1_2_3,
    ),
    # looking up something that is not a hash
    Case(
        "get_cached_block a str",
        lambda p: p.get_cached_block("h1"),
        InvalidRequest,
        r"get_cached_block: block_hash='h1' is not bytes",
        a_holds_1_2_3,
    ),
    Case(
        "get_cached_block a list",
        lambda p: p.get_cached_block([1]),
        InvalidRequest,
        r"get_cached_block: block_hash=\[1\] is not bytes",
        a_holds_1_2_3,
    ),
    # is_block_writable out of range
    *[
        Case(
            f"is_block_writable({v!r})",
            lambda p, v=v: p.is_block_writable(v),
            InvalidBlock,
            rf"is_block_writable: block_id={pattern} is not a block of this pool \(ids 0\.\.6\)",
            a_holds_1_2_3,
        )
        for v, pattern in ((7, "7"), (-1, "-1"), (True, "True"), (1.0, r"1\.0"))
    ],
    # evicting by id: the null block, an unknown block, a block twice
    Case(
        "evict_blocks the null block",
        lambda p: p.evict_blocks(ids(0)),
        InvalidBlock,
        r"evict_blocks: block_id=0 is the null block, whose ref_cnt is never maintained",
        a_holds_1_2_3,
    ),
    Case(
        "evict_blocks block 7 of 7",
        lambda p: p.evict_blocks(ids(1, 7)),
        InvalidBlock,
        r"evict_blocks: block_id=7 is not a block of this pool \(ids 0\.\.6\)",
        a_holds_1_2_3,
    ),
    Case(
        "evict_blocks a block twice",
        lambda p: p.evict_blocks(ids(1, 1)),
        InvalidRequest,
        r"evict_blocks: block_ids=\[1, 1\] names a block twice",
        a_holds_1_2_3,
    ),
]

C5 = Request("C", (1, 2, 3, 4, 5))  # shares A's first full block only

MANAGER_CASES = [
    # a request with no tokens, or no id
    Case(
        "get_computed_blocks of an empty request",
        lambda m: m.get_computed_blocks(Request("E", ())),
        InvalidRequest,
        r"get_computed_blocks: request_id='E' has no tokens; a request needs a prompt",
        a_runs,
    ),
    Case(
        "allocate_slots for an empty request",
        lambda m: m.allocate_slots(Request("E", ()), 1),
        InvalidRequest,
        r"allocate_slots: request_id='E' has no tokens; a request needs a prompt",
        a_runs,
    ),
    Case(
        "get_computed_blocks of a request without an id",
        lambda m: m.get_computed_blocks(Request("", (1,))),
        InvalidRequest,
        r"get_computed_blocks: request_id='' must be a non-empty string",
        a_runs,
    ),
    # images no input processor would place: past the tokens, empty, overlapping, out of order
    *[
        Case(
            f"{op} with images {name}",
            lambda m, op=op, mm=mm: call(m, op, replace(B, mm_inputs=mm)),
            InvalidRequest,
            rf"{op}: request_id='B' has mm_inputs=\[.*\]; each must cover one or more of its "
            r"10 token positions, in offset order, without overlapping another \(as vLLM's input processor "
            r"places them\)",
            a_runs,
        )
        for op in ("get_computed_blocks", "allocate_slots")
        for name, mm in (
            ("past the last token", (MultiModalInput("i", 9, 2),)),
            ("covering no token", (MultiModalInput("i", 0, 0),)),
            ("overlapping", (MultiModalInput("i", 0, 4), MultiModalInput("j", 3, 2))),
            ("out of order", (MultiModalInput("i", 6, 1), MultiModalInput("j", 0, 1))),
            ("at a negative offset", (MultiModalInput("i", -1, 2),)),
        )
    ],
    # bad counts
    *[
        Case(
            f"allocate_slots num_new_tokens={v!r}",
            lambda m, v=v: m.allocate_slots(B, v),
            InvalidRequest,
            rf"allocate_slots: num_new_tokens {NOT_INT} num_new_tokens={pattern}",
            a_runs,
        )
        for v, pattern in ((-1, "-1"), (True, "True"), (1.5, r"1\.5"), ("1", "'1'"))
    ],
    Case(
        "allocate_slots num_new_tokens=0",
        lambda m: m.allocate_slots(B, 0),
        InvalidRequest,
        r"allocate_slots: num_new_tokens=0; a step must schedule at least one token",
        a_runs,
    ),
    Case(
        "allocate_slots num_new_computed_tokens=-4",
        lambda m: m.allocate_slots(B, 2, -4),
        InvalidRequest,
        rf"allocate_slots: num_new_computed_tokens {NOT_INT} num_new_computed_tokens=-4",
        a_runs,
    ),
    Case(
        "allocate_slots num_external_computed_tokens=-1",
        lambda m: m.allocate_slots(B, 2, 0, (), -1),
        InvalidRequest,
        rf"allocate_slots: num_external_computed_tokens {NOT_INT} num_external_computed_tokens=-1",
        a_runs,
    ),
    Case(
        "allocate_slots hit tokens that are not the hit blocks",
        lambda m: m.allocate_slots(B, 2, 4, ids(1, 2)),
        InvalidRequest,
        r"allocate_slots: num_new_computed_tokens=4 but 2 hit blocks of block_size=4",
        a_runs,
    ),
    Case(
        "allocate_slots more tokens than the request has",
        lambda m: m.allocate_slots(B, 11),
        InvalidRequest,
        r"allocate_slots: 11 tokens would be computed but request_id='B' has 10",
        a_runs,
    ),
    Case(
        "allocate_slots decode past the request's tokens",
        lambda m: m.allocate_slots(A, 1),
        InvalidRequest,
        r"allocate_slots: 11 tokens would be computed but request_id='A' has 10",
        a_runs,
    ),
    Case(
        "allocate_slots a hit on a running request",
        lambda m: m.allocate_slots(A, 1, 4, ids(1)),
        InvalidRequest,
        r"allocate_slots: request_id='A' is running; prefix hits are only for its first step",
        a_runs,
    ),
    # hit blocks that are not the request's
    Case(
        "allocate_slots a hit on an unhashed block",
        lambda m: m.allocate_slots(B, 6, 4, ids(3)),
        InvalidBlock,
        r"allocate_slots: hit block_id=3 is not registered under the request's hash 0",
        a_runs,
    ),
    Case(
        "allocate_slots hits out of chain order",
        lambda m: m.allocate_slots(B, 2, 8, ids(2, 1)),
        InvalidBlock,
        r"allocate_slots: hit block_id=2 is not registered under the request's hash 0",
        a_runs,
    ),
    Case(
        "allocate_slots a hit on block 9 of 7",
        lambda m: m.allocate_slots(B, 6, 4, ids(9)),
        InvalidBlock,
        r"allocate_slots: hit block_id=9 is not registered under the request's hash 0",
        a_runs,
    ),
    # Regression: more hit blocks than the request has full blocks used to index
    # past its hash chain (IndexError) instead of raising a typed error.
    # Steps: A's prefill takes [1, 2, 3] (h1 -> 1, h2 -> 2); C (5 tokens, one full
    # block) claims hits [1, 2] for 8 tokens.
    Case(
        "allocate_slots more hits than full blocks",
        lambda m: m.allocate_slots(C5, 1, 8, ids(1, 2)),
        InvalidRequest,
        r"allocate_slots: 2 hit blocks but request_id='C' has only 1 full blocks",
        a_runs,
    ),
    Case(
        "allocate_slots a hit with caching off",
        lambda m: m.allocate_slots(B, 6, 4, ids(1)),
        InvalidRequest,
        r"allocate_slots: prefix caching is off, so there can be no hit blocks",
        a_runs,
        {"enable_caching": False},
    ),
    # a request that is not running, or already is
    Case(
        "free an unknown request",
        lambda m: m.free("Z"),
        InvalidRequest,
        r"free: request_id='Z' is not running \(freed twice\?\)",
        a_runs,
    ),
    Case(
        "free a request twice",
        lambda m: m.free("A"),
        InvalidRequest,
        r"free: request_id='A' is not running \(freed twice\?\)",
        a_finished,
    ),
    Case(
        "get_computed_blocks of a running request",
        lambda m: m.get_computed_blocks(A),
        InvalidRequest,
        r"get_computed_blocks: request_id='A' is already running",
        a_runs,
    ),
]

MANAGER_CASES = [replace(c, level="manager") for c in MANAGER_CASES]

ALL_CASES = [pytest.param(c, id=f"{c.level}: {c.id}") for c in POOL_CASES + MANAGER_CASES]


def build(impl: str, case: Case) -> Any:
    config = AdapterConfig(case.level, num_gpu_blocks=7, block_size=4, **case.config)  # type: ignore[arg-type]
    adapter = IMPLS[impl](config)
    case.setup(adapter)
    return adapter


def raised(impl: str, case: Case) -> tuple[BlockManagerError, Any, Any]:
    """The error the bad call raised on `impl`, and the snapshots before and after it."""
    adapter = build(impl, case)
    before = adapter.snapshot()
    with pytest.raises(case.error, match=rf"^{case.pattern}$") as info:
        case.call(adapter)
    return info.value, before, adapter


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", ALL_CASES)
def test_bad_input_raises_a_typed_error_and_changes_nothing(case: Case, impl: str) -> None:
    error, before, adapter = raised(impl, case)
    assert type(error) is case.error  # exactly this type, not a subclass or a sibling
    after = adapter.snapshot()
    assert after == before
    check_all(after)
    if impl == "reference":
        adapter.check_invariants()  # the linked queue's own count too


@pytest.mark.parametrize("case", ALL_CASES)
def test_spec_and_reference_say_the_same_thing(case: Case) -> None:
    spec_error, _, _ = raised("spec", case)
    reference_error, _, _ = raised("reference", case)
    assert (type(spec_error), str(spec_error)) == (type(reference_error), str(reference_error))


def test_every_error_inherits_its_builtin() -> None:
    # Callers that already catch ValueError / RuntimeError keep working.
    assert issubclass(InvalidRequest, ValueError) and issubclass(InvalidBlock, ValueError)
    assert issubclass(DoubleFree, ValueError) and issubclass(AlreadyCached, ValueError)
    assert issubclass(PoolExhausted, RuntimeError)


# --- construction -------------------------------------------------------------------------------

BAD_NUM_GPU_BLOCKS = r"num_gpu_blocks must be an integer >= 1 \(block 0 is the null block\); got num_gpu_blocks="


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("level", ["pool", "manager"])
@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"num_gpu_blocks": 0}, rf"{BAD_NUM_GPU_BLOCKS}0"),
        ({"num_gpu_blocks": -3}, rf"{BAD_NUM_GPU_BLOCKS}-3"),
        ({"num_gpu_blocks": True}, rf"{BAD_NUM_GPU_BLOCKS}True"),
        ({"num_gpu_blocks": 2.5}, rf"{BAD_NUM_GPU_BLOCKS}2\.5"),
        (
            {"profile": "lru"},
            r"unknown profile='lru'; known profiles: block-age, lfu, lru-timestamp, vllm-v1, vllm-v1-tail, lru-lfu:W",
        ),
    ],
)
def test_a_bad_pool_config_is_refused(impl: str, level: str, kwargs: dict[str, Any], pattern: str) -> None:
    config = AdapterConfig(level, **{"num_gpu_blocks": 7, **kwargs})  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match=rf"^{pattern}$"):
        IMPLS[impl](config)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"block_size": 0}, r"block_size must be a positive integer; got block_size=0"),
        ({"block_size": True}, r"block_size must be a positive integer; got block_size=True"),
        ({"block_size": 4.0}, r"block_size must be a positive integer; got block_size=4\.0"),
        ({"hash_fn": "md5"}, r"unknown hash_fn='md5'; known: builtin, sha256, sha256_cbor"),
    ],
)
def test_a_bad_manager_config_is_refused(impl: str, kwargs: dict[str, Any], pattern: str) -> None:
    with pytest.raises(InvalidRequest, match=rf"^{pattern}$"):
        IMPLS[impl](AdapterConfig("manager", 7, **kwargs))  # type: ignore[arg-type]


class Id(int):
    """An int subclass: still a block id (only bool, the int subclass that means a truth value, is not)."""


@pytest.mark.parametrize("impl", IMPLS)
def test_an_int_subclass_names_a_block(impl: str) -> None:
    by_subclass, by_int = IMPLS[impl](AdapterConfig("pool", 7)), IMPLS[impl](AdapterConfig("pool", 7))
    for p, name in ((by_subclass, Id), (by_int, int)):
        a_freed_all(p)
        p.touch([BlockId(name(2)), BlockId(name(1))])  # cached and free: both leave the queue
    assert by_subclass.snapshot() == by_int.snapshot()
    assert by_subclass.snapshot().ref_cnt[1:3] == (1, 1)
    for p, name in ((by_subclass, Id), (by_int, int)):
        p.free_blocks([BlockId(name(1)), BlockId(name(2))])
    assert by_subclass.snapshot() == by_int.snapshot()
    assert by_subclass.snapshot().ref_cnt[1:3] == (0, 0)


# --- writing a block that is not writable ---------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
def test_only_a_sole_holders_unhashed_block_is_writable(impl: str) -> None:
    p = IMPLS[impl](AdapterConfig("pool", 7))
    a_holds_1_2_3(p)
    p.touch(ids(1))  # B hits block 1: now shared
    p.free_blocks(ids(3))  # A gives up its unhashed last block: free
    assert [p.is_block_writable(BlockId(b)) for b in range(7)] == [
        False,  # 0: the null block
        False,  # 1: shared (ref_cnt 2) and hashed
        False,  # 2: held by A alone, but hashed: others may hit it
        False,  # 3: free
        False,  # 4: free, never used
        False,  # 5: free
        False,  # 6: free
    ]
    assert p.get_new_blocks(1) == [3]  # 3 went to the left end, unhashed
    assert p.is_block_writable(BlockId(3))  # held once, no hash: the only writable block
    p.cache_full_blocks(ids(3), [H3])
    assert not p.is_block_writable(BlockId(3))  # registered: now read-only


def _hit_allocation(make_manager: Callable[[], Any], hits_as: Callable[[list[BlockId]], Any]) -> tuple[Any, ...]:
    """A's blocks cached, then B's first step with A's first two blocks as its hit, the hit in `hits_as`."""
    m = make_manager()
    blocks = m.allocate_slots(A, 10)
    m.free("A")
    return m.allocate_slots(B, 2, 8, hits_as(blocks[:2])), m.snapshot()


class _SpecManager:
    """The spec's manager as an object, for the comparison below."""

    def __init__(self) -> None:
        self.state = spec_manager.new_manager(16, 4)

    def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        step = fn(self.state, *args)
        self.state = step.state
        return step.result

    def allocate_slots(self, *args: Any) -> Any:
        return self._run(spec_manager.allocate_slots, *args)

    def free(self, request_id: str) -> None:
        self._run(spec_manager.free, request_id)

    def snapshot(self) -> Any:
        return self.state.snapshot()


MANAGERS: dict[str, Callable[[], Any]] = {
    "spec": _SpecManager,
    "reference": lambda: KVCacheManager(16, 4),
    "gpu_impl": lambda: TensorKVCacheManager(16, 4, device="cpu"),
}


@pytest.mark.parametrize("manager", MANAGERS)
def test_hit_blocks_in_any_sequence_are_the_same_hit(manager: str) -> None:
    """`new_computed_blocks` is a Sequence: a tuple or a deque (which cannot be sliced) is the same hit as a list."""
    make = MANAGERS[manager]
    as_list = _hit_allocation(make, list)
    assert as_list[0] is not None
    assert _hit_allocation(make, tuple) == as_list
    assert _hit_allocation(make, deque) == as_list
