"""Named scenarios with explicit steps and exact block ids, on the spec and the reference.

In the style of vLLM's block-pool tests: each step's expected block-id lists
are written out, and where a list is a free queue or an allocation, its order
is the point: it checks the eviction order.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvspec.conformance.core.adapter import AdapterConfig
from kvspec.conformance.targets.builtin import make_reference, make_spec
from kvspec.spec.hashing import hash_request_blocks
from kvspec.spec.invariants import check_all
from kvspec.spec.manager import Request
from kvspec.spec.state import BlockHash, BlockId, Snapshot

IMPLS = {"spec": make_spec, "reference": make_reference}
BLOCK_SIZE = 4
H1, H2 = BlockHash(b"h1"), BlockHash(b"h2")


def manager(impl: str, num_gpu_blocks: int, **kwargs: Any) -> Any:
    return IMPLS[impl](AdapterConfig("manager", num_gpu_blocks, block_size=BLOCK_SIZE, **kwargs))


def pool(impl: str, num_gpu_blocks: int, **kwargs: Any) -> Any:
    return IMPLS[impl](AdapterConfig("pool", num_gpu_blocks, **kwargs))


def table(s: Snapshot, names: dict[BlockHash, str]) -> dict[str, list[int]]:
    """The hash table with hashes named: name -> its blocks, first registered first."""
    return {names.get(h, h.hex()[:8]): list(blocks) for h, blocks in s.hash_to_blocks}


def chain_names(request: Request, prefix: str) -> dict[BlockHash, str]:
    return {h: f"{prefix}{i + 1}" for i, h in enumerate(hash_request_blocks(request.token_ids, BLOCK_SIZE))}


def refs(s: Snapshot) -> list[int]:
    return list(s.ref_cnt[1:])  # blocks 1.. (the null block's count is not maintained)


@pytest.fixture(params=sorted(IMPLS))
def impl(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


def checked(adapter: Any) -> Snapshot:
    s: Snapshot = adapter.snapshot()
    check_all(s)
    return s


def test_prefix_hit_then_eviction(impl: str) -> None:
    m = manager(impl, 7)
    a = Request("A", tuple(range(1, 11)))  # 10 tokens: 2 full blocks + 2 tokens
    names = chain_names(a, "a")
    assert m.get_computed_blocks(a) == ([], 0)
    assert m.allocate_slots(a, 10) == [1, 2, 3]
    assert table(checked(m), names) == {"a1": [1], "a2": [2]}
    m.free("A")
    # Tail first: 3 (no hash) to the left end; 2 then 1 (hashed) to the right end.
    assert list(checked(m).free_queue) == [3, 4, 5, 6, 2, 1]

    b = Request("B", tuple(range(1, 9)) + (20, 21, 22))  # A's 8-token prefix, then 3 tokens of its own
    assert m.get_computed_blocks(b) == ([1, 2], 8)  # both hit blocks are free, still cached
    assert m.allocate_slots(b, 3, 8, [BlockId(1), BlockId(2)]) == [3]  # 3 is leftmost: reused first
    s = checked(m)
    assert refs(s) == [1, 1, 1, 0, 0, 0] and list(s.free_queue) == [4, 5, 6]
    m.free("B")
    assert list(checked(m).free_queue) == [3, 4, 5, 6, 2, 1]

    e = Request("E", tuple(range(100, 117)))  # 17 fresh tokens: 5 blocks
    assert m.get_computed_blocks(e) == ([], 0)
    # The eviction order: the unhashed block, the never-used ones, then 2 (the
    # deeper block, a2) before its ancestor 1 (a1).
    assert m.allocate_slots(e, 17) == [3, 4, 5, 6, 2]
    s = checked(m)
    assert list(s.free_queue) == [1]
    assert table(s, names | chain_names(e, "e")) == {"a1": [1], "e1": [3], "e2": [4], "e3": [5], "e4": [6]}
    # A comes back: only its first block survived, and a hit is a prefix of its chain.
    assert m.get_computed_blocks(Request("A2", a.token_ids)) == ([1], 4)


def test_duplicate_full_blocks_are_kept(impl: str) -> None:
    m = manager(impl, 9)
    prompt = tuple(range(1, 10))  # 9 tokens: 2 full blocks + 1 token
    a, b = Request("A", prompt), Request("B", prompt)
    names = chain_names(a, "h")
    # Both look up their prefix before either is scheduled: neither hits the other.
    assert m.get_computed_blocks(a) == ([], 0)
    assert m.get_computed_blocks(b) == ([], 0)
    assert m.allocate_slots(a, 9) == [1, 2, 3]
    assert m.allocate_slots(b, 9) == [4, 5, 6]
    # B's identical blocks are registered after A's, not merged into them: B's
    # block table stays [4, 5, 6] (append-only).
    s = checked(m)
    assert table(s, names) == {"h1": [1, 4], "h2": [2, 5]}
    assert dict(s.block_tables or ()) == {"A": (1, 2, 3), "B": (4, 5, 6)}
    c = Request("C", prompt)
    assert m.get_computed_blocks(c) == ([1, 2], 8)  # the first registered
    m.free("A")
    assert list(checked(m).free_queue) == [3, 7, 8, 2, 1]
    assert m.get_computed_blocks(c) == ([1, 2], 8)  # A's blocks: free, but still first
    assert m.allocate_slots(Request("F", tuple(range(100, 113))), 13) == [3, 7, 8, 2]  # evicts block 2
    s = checked(m)
    assert table(s, names)["h1"] == [1, 4] and table(s, names)["h2"] == [5]
    # C now hits A's first block and B's second: each is the first left under its hash.
    assert m.get_computed_blocks(c) == ([1, 5], 8)


def test_get_cached_block_returns_the_first_registered(impl: str) -> None:
    p = pool(impl, 7)
    assert p.get_new_blocks(2) == [1, 2]
    p.cache_full_blocks([BlockId(1)], [H1])
    p.cache_full_blocks([BlockId(2)], [H1])
    assert p.get_cached_block(H1) == 1
    p.free_blocks([BlockId(1)])
    assert list(checked(p).free_queue) == [3, 4, 5, 6, 1]
    assert p.get_cached_block(H1) == 1  # free, still registered, still first
    # Taking every free block evicts 1 (last in the queue); 2 is left under h1.
    assert p.get_new_blocks(5) == [3, 4, 5, 6, 1]
    assert p.get_cached_block(H1) == 2
    assert checked(p).hash_to_blocks == ((H1, (2,)),)


def test_reset_prefix_cache_is_refused_while_blocks_are_held(impl: str) -> None:
    p = pool(impl, 7)
    assert p.get_new_blocks(2) == [1, 2]
    p.cache_full_blocks([BlockId(1), BlockId(2)], [H1, H2])
    before = checked(p)
    assert p.reset_prefix_cache() is False
    assert checked(p) == before
    p.free_blocks([BlockId(2), BlockId(1)])
    assert p.reset_prefix_cache() is True
    s = checked(p)
    assert s.hash_to_blocks == () and all(h is None for h in s.block_hash)
    assert list(s.free_queue) == [3, 4, 5, 6, 2, 1]  # the order is kept
    assert p.get_cached_block(H1) is None
    assert p.reset_prefix_cache() is True  # nothing held: accepted again


@pytest.mark.parametrize(
    ("profile", "after_a", "after_b"),
    [
        # Nothing is hashed, so under vllm-v1 every freed block goes to the left end, tail first.
        ("vllm-v1", [3, 2, 1, 6], [5, 4, 3, 2, 1, 6]),
        # Under vllm-v1-tail every freed block goes to the right end.
        ("vllm-v1-tail", [6, 3, 2, 1], [6, 3, 2, 1, 5, 4]),
    ],
)
def test_caching_off_the_profile_still_orders_freed_blocks(
    impl: str, profile: str, after_a: list[int], after_b: list[int]
) -> None:
    m = manager(impl, 7, enable_caching=False, profile=profile)
    a = Request("A", tuple(range(1, 11)))
    assert m.allocate_slots(a, 10) == [1, 2, 3]
    assert m.allocate_slots(Request("B", tuple(range(1, 7))), 6) == [4, 5]
    assert checked(m).hash_to_blocks == ()
    m.free("A")
    assert list(checked(m).free_queue) == after_a
    m.free("B")
    s = checked(m)
    assert list(s.free_queue) == after_b and s.hash_to_blocks == ()
    assert m.get_computed_blocks(Request("A2", a.token_ids)) == ([], 0)  # nothing hits
    assert m.allocate_slots(Request("C", tuple(range(1, 5))), 4) == after_b[:1]  # the left end is taken first


def test_a_failed_allocation_changes_nothing(impl: str) -> None:
    m = manager(impl, 7)
    a = Request("A", tuple(range(1, 11)))
    assert m.allocate_slots(a, 10) == [1, 2, 3]
    m.free("A")  # queue [3, 4, 5, 6, 2, 1]; a1 -> 1, a2 -> 2
    assert m.allocate_slots(Request("Y", tuple(range(100, 108))), 8) == [3, 4]
    before = checked(m)
    assert list(before.free_queue) == [5, 6, 2, 1]
    b = Request("B", tuple(range(1, 9)) + tuple(range(30, 39)))  # A's 8 tokens + 9: 5 blocks in all
    hit = m.get_computed_blocks(b)
    assert hit == ([1, 2], 8)
    # 3 new blocks + 2 hit blocks that sit in the free queue = 5 > 4 free: refused.
    assert m.allocate_slots(b, 9, 8, hit[0]) is None
    after = checked(m)
    assert after == before  # the hit blocks were not touched: still free, still in place
    assert refs(after)[:2] == [0, 0] and list(after.free_queue) == [5, 6, 2, 1]
    m.free("Y")  # Y's two blocks are full and hashed: tail first to the right end
    assert list(checked(m).free_queue) == [5, 6, 2, 1, 4, 3]
    # Now it fits: the hit takes 1 and 2 out of the queue, then 3 new from the left end.
    assert m.allocate_slots(b, 9, 8, hit[0]) == [5, 6, 4]
    s = checked(m)
    assert dict(s.block_tables or ()) == {"B": (1, 2, 5, 6, 4)} and list(s.free_queue) == [3]


def test_preempting_a_request_keeps_the_blocks_it_shares(impl: str) -> None:
    m = manager(impl, 9)
    a = Request("A", tuple(range(1, 11)))
    b = Request("B", tuple(range(1, 9)) + (30, 31))
    assert m.allocate_slots(a, 10) == [1, 2, 3]
    assert m.get_computed_blocks(b) == ([1, 2], 8)
    assert m.allocate_slots(b, 2, 8, [BlockId(1), BlockId(2)]) == [4]
    assert refs(checked(m))[:4] == [2, 2, 1, 1]
    m.free("B")  # preempted: it drops its references, tail first
    s = checked(m)
    assert refs(s)[:4] == [1, 1, 1, 0]  # A still holds 1, 2 (and 3)
    assert list(s.free_queue) == [4, 5, 6, 7, 8]  # only B's own block was freed, to the left end
    assert dict(s.block_tables or ()) == {"A": (1, 2, 3)}
    # B is scheduled again: it hits the shared blocks and gets its own block back.
    assert m.get_computed_blocks(b) == ([1, 2], 8)
    assert m.allocate_slots(b, 2, 8, [BlockId(1), BlockId(2)]) == [4]
    assert dict(checked(m).block_tables or ()) == {"A": (1, 2, 3), "B": (1, 2, 4)}


def test_a_salted_request_does_not_hit_a_lora_requests_blocks(impl: str) -> None:
    # Regression: untagged extra keys gave LoRA "t" and cache_salt "t" the same
    # first-block hash, so Y hit X's block 1 (KV computed with X's LoRA).
    m = manager(impl, 8)
    prompt = tuple(range(1, 10))
    assert m.allocate_slots(Request("X", prompt, lora_name="t"), 9) == [1, 2, 3]
    assert m.get_computed_blocks(Request("Y", prompt, cache_salt="t")) == ([], 0)
    assert m.allocate_slots(Request("Y", prompt, cache_salt="t"), 9) == [4, 5, 6]
    assert m.get_computed_blocks(Request("Z", prompt, lora_name="t")) == ([1, 2], 8)
    assert m.get_computed_blocks(Request("W", prompt, cache_salt="t")) == ([4, 5], 8)


def test_decode_registers_a_block_when_it_fills(impl: str) -> None:
    m = manager(impl, 5)
    a = Request("A", (1, 2, 3, 4, 5, 6))
    assert m.allocate_slots(a, 6) == [1, 2]
    assert [len(e) for _, e in checked(m).hash_to_blocks] == [1]  # only the full first block
    a = Request("A", a.token_ids + (7,))
    assert m.allocate_slots(a, 1) == []  # slot 7 is in block 2: no new block
    a = Request("A", a.token_ids + (8,))
    assert m.allocate_slots(a, 1) == []
    s = checked(m)
    names = chain_names(a, "a")
    assert table(s, names) == {"a1": [1], "a2": [2]}  # block 2 is full now: registered
    a = Request("A", a.token_ids + (9,))
    assert m.allocate_slots(a, 1) == [3]  # the ninth token needs a third block
