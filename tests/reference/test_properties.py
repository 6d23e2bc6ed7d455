"""The reference model against the spec, side by side, on random operation sequences.

Each example builds a small pool (or manager) twice, once as the spec's pure
state and once as the reference's objects, and plays the same operations on
both. Arguments are drawn from the current state, mostly valid (blocks that
are held, hashed, free) and sometimes not, so caller mistakes are compared
too. After every step: equal results or equal error types and messages, equal
snapshots (block ids and free-queue order included), every state invariant
(`check_all`, `check_invariants()`) and every step rule.

This is not the conformance harness (which drives any adapter); it is the
reference model's own test against its oracle, in the style of a stress test
against a trusted model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from kvspec.reference import BlockPool, KVCacheManager
from kvspec.spec import manager, ops
from kvspec.spec.errors import BlockManagerError
from kvspec.spec.invariants import check_all, check_step
from kvspec.spec.manager import Request
from kvspec.spec.ordering import PROFILES
from kvspec.spec.state import BlockHash, BlockId, Snapshot

T = TypeVar("T")
HASHES = [BlockHash(b"h%d" % i) for i in range(5)]  # few values, so duplicates are common


def attempt(call: Callable[..., T], *args: Any) -> tuple[T | None, tuple[type, str] | None]:
    """Call `call(*args)`; its result, or the caller-mistake error it raised (type and message)."""
    try:
        return call(*args), None
    except BlockManagerError as e:
        return None, (type(e), str(e))


def check_after(op: str, before: Snapshot, spec_snapshot: Snapshot, reference_snapshot: Snapshot) -> None:
    assert reference_snapshot == spec_snapshot, f"after {op}"
    check_all(spec_snapshot)
    check_step(before, spec_snapshot, op)


def some_of(data: st.DataObject, items: list[int], label: str) -> list[int]:
    """An ordered selection of distinct items; at least one when there is one (empty calls are rarely useful)."""
    order = data.draw(st.permutations(items), label=label)
    return list(order[: data.draw(st.integers(min(1, len(order)), len(order)), label=f"{label}: how many")])


def rarely(data: st.DataObject, label: str) -> bool:
    """True one time in ten; shrinks to False (towards valid arguments)."""
    return data.draw(st.integers(0, 9), label=label) == 9


def block_ids(data: st.DataObject, valid: list[int], n: int, label: str) -> list[BlockId]:
    """Mostly an ordered selection of `valid`; sometimes any ids, in range or not, repeated or not."""
    if rarely(data, f"{label}: any ids?"):
        ids = data.draw(st.lists(st.integers(-1, n), max_size=3), label=f"{label}: any ids")
    else:
        ids = some_of(data, valid, label)
    return [BlockId(b) for b in ids]


# --- the pool ---------------------------------------------------------------------------------

# Weighted: the operations that move blocks between held, cached and free come up most.
POOL_OPS = (
    ["get_new_blocks"] * 3
    + ["cache_full_blocks"] * 3
    + ["free_blocks"] * 3
    + ["touch"] * 2
    + [
        "get_cached_block",
        "evict_blocks",
        "reset_prefix_cache",
        "is_block_writable",
        "get_num_free_blocks",
        "get_usage",
    ]
)


@pytest.mark.parametrize("enable_caching", [True, False], ids=["caching", "no-caching"])
@pytest.mark.parametrize("profile", sorted(PROFILES))
@given(data=st.data())
def test_pool_matches_the_spec_step_by_step(profile: str, enable_caching: bool, data: st.DataObject) -> None:
    n = data.draw(st.integers(1, 9), label="num_gpu_blocks")
    # Long enough for blocks to go round: taken, cached, freed, hit, evicted.
    spec = ops.new_pool(n, enable_caching, profile)
    reference = BlockPool(n, enable_caching, profile)
    reference.check_invariants()
    assert reference.snapshot() == spec.snapshot()
    for _ in range(data.draw(st.integers(5, 30), label="steps")):
        op = data.draw(st.sampled_from(POOL_OPS), label="op")
        before = spec.snapshot()
        held = [b for b in range(1, n) if spec.ref_cnt[b] > 0]
        hashed = [b for b in range(1, n) if spec.block_hash[b] is not None]
        result: Any
        if op == "get_new_blocks":
            k: Any = data.draw(st.integers(min(1, len(spec.free_queue)), len(spec.free_queue)), label="num_blocks")
            if rarely(data, "a bad count?"):
                k = data.draw(st.sampled_from([len(spec.free_queue) + 1, -1, True, 1.0]), label="bad num_blocks")
            got, error = attempt(ops.get_new_blocks, spec, k)
            result, ref_error = attempt(reference.get_new_blocks, k)
            if got is not None:
                spec, taken = got.state, got.result
                assert result == list(taken)
        elif op in ("touch", "free_blocks", "evict_blocks"):
            valid = {"touch": hashed, "free_blocks": held, "evict_blocks": list(range(1, n))}[op]
            ids = block_ids(data, valid, n, op)
            got, error = attempt(getattr(ops, op), spec, ids)
            result, ref_error = attempt(getattr(reference, op), ids)
            spec = got.state if got is not None else spec
        elif op == "cache_full_blocks":
            ids = block_ids(data, [b for b in held if spec.block_hash[b] is None], n, op)
            num_hashes = len(ids) + rarely(data, "one hash too many?")
            hashes = data.draw(
                st.lists(st.sampled_from(HASHES), min_size=num_hashes, max_size=num_hashes), label="block_hashes"
            )
            got, error = attempt(ops.cache_full_blocks, spec, ids, hashes)
            result, ref_error = attempt(reference.cache_full_blocks, ids, hashes)
            spec = got.state if got is not None else spec
        elif op == "get_cached_block":
            h = data.draw(st.sampled_from(HASHES), label="block_hash")
            got, error = attempt(ops.get_cached_block, spec, h)
            result, ref_error = attempt(reference.get_cached_block, h)
            assert result == (None if got is None else got.result)
        elif op == "reset_prefix_cache":
            got, error = attempt(ops.reset_prefix_cache, spec)
            result, ref_error = attempt(reference.reset_prefix_cache)
            assert got is not None
            spec, done = got.state, got.result
            assert result == done
        elif op == "is_block_writable":
            b = data.draw(
                st.integers(0, n - 1) if not rarely(data, "out of range?") else st.sampled_from([-1, n]),
                label="block_id",
            )
            got, error = attempt(ops.is_block_writable, spec, BlockId(b))
            result, ref_error = attempt(reference.is_block_writable, BlockId(b))
            assert result == (None if got is None else got.result)
        elif op == "get_num_free_blocks":
            got, error = ops.get_num_free_blocks(spec).result, None
            result, ref_error = reference.get_num_free_blocks(), None
            assert result == got
        else:
            got, error = ops.get_usage(spec).result, None
            result, ref_error = reference.get_usage(), None
            assert result == got
        assert ref_error == error, op
        if error is not None:
            event(f"pool: {op} raised {error[0].__name__}")
        elif op == "get_new_blocks" and any(before.block_hash[b] for b in before.free_queue[: len(result)]):
            event("pool: get_new_blocks evicted a cached block")
        elif op == "touch" and set(before.free_queue) & set(ids):
            event("pool: touch took a cached block out of the free queue")
        check_after(op, before, spec.snapshot(), reference.snapshot())
        reference.check_invariants()
        assert [reference.is_block_writable(BlockId(b)) for b in range(n)] == [
            ops.is_block_writable(spec, BlockId(b)).result for b in range(n)
        ]


# --- the manager ------------------------------------------------------------------------------

REQUEST_IDS = [f"r{i}" for i in range(4)]
prompts = st.lists(st.integers(0, 2), min_size=1, max_size=12)  # few token values: shared prefixes are common


@pytest.mark.parametrize("enable_caching", [True, False], ids=["caching", "no-caching"])
@pytest.mark.parametrize("profile", sorted(PROFILES))
@given(data=st.data())
def test_manager_matches_the_spec_step_by_step(profile: str, enable_caching: bool, data: st.DataObject) -> None:
    n = data.draw(st.integers(2, 12), label="num_gpu_blocks")
    block_size = data.draw(st.integers(1, 4), label="block_size")
    spec = manager.new_manager(n, block_size, enable_caching, profile)
    reference = KVCacheManager(n, block_size, enable_caching, profile)
    requests: dict[str, Request] = {}  # the running requests, as last scheduled
    finished: list[Request] = []  # freed requests, which may come back (preempted, or the same prompt again)
    for _ in range(data.draw(st.integers(1, 20), label="steps")):
        waiting = [r for r in REQUEST_IDS if r not in requests]
        choices = (["arrive"] if waiting else []) + (["schedule", "free"] if requests else []) + ["free unknown"]
        op = data.draw(st.sampled_from(choices), label="op")
        before = spec.snapshot()
        if op == "arrive":
            rid = data.draw(st.sampled_from(waiting), label="request_id")
            if finished and data.draw(st.booleans(), label="come back?"):
                again = data.draw(st.sampled_from(finished), label="returning")
                request = Request(rid, again.token_ids, again.lora_name, again.cache_salt)
            else:
                request = Request(
                    rid,
                    tuple(data.draw(prompts, label="prompt")),
                    lora_name=data.draw(st.sampled_from([None, "l"]), label="lora_name"),
                    cache_salt=data.draw(st.sampled_from([None, "s"]), label="cache_salt"),
                )
            spec_hit = manager.get_computed_blocks(spec, request).result
            ref_blocks, ref_tokens = reference.get_computed_blocks(request)
            assert (list(spec_hit[0]), spec_hit[1]) == (ref_blocks, ref_tokens)
            hit_blocks, num_hit_tokens = spec_hit
            if hit_blocks:
                on_free = any(spec.pool.ref_cnt[b] == 0 for b in hit_blocks)
                event("manager: a prefix hit" + (" on free blocks" if on_free else ""))
            remaining = len(request.token_ids) - num_hit_tokens
            num_new = data.draw(st.integers(1, remaining), label="num_new_tokens")
            num_external = data.draw(st.integers(0, remaining - num_new), label="num_external_computed_tokens")
            got, error = attempt(
                manager.allocate_slots, spec, request, num_new, num_hit_tokens, hit_blocks, num_external
            )
            result, ref_error = attempt(
                reference.allocate_slots, request, num_new, num_hit_tokens, list(hit_blocks), num_external
            )
            assert got is not None and error is None and ref_error is None
            spec, new_blocks = got.state, got.result
            assert result == (None if new_blocks is None else list(new_blocks))
            if new_blocks is not None:
                requests[rid] = request
            else:
                event("manager: allocation refused")
                assert spec.snapshot() == before  # a failed allocation changes nothing
        elif op == "schedule":
            rid = data.draw(st.sampled_from(sorted(requests)), label="request_id")
            request = requests[rid]
            entry = spec.request(rid)
            assert entry is not None
            if entry.num_computed_tokens == len(request.token_ids):
                # Decode: the sampled token joins the request; one new slot.
                token = data.draw(st.integers(0, 2), label="sampled token")
                request = Request(rid, request.token_ids + (token,), request.lora_name, request.cache_salt)
                num_new = 1
            else:
                num_new = data.draw(
                    st.integers(1, len(request.token_ids) - entry.num_computed_tokens), label="prefill chunk"
                )
            got, error = attempt(manager.allocate_slots, spec, request, num_new)
            result, ref_error = attempt(reference.allocate_slots, request, num_new)
            assert got is not None and error is None and ref_error is None
            spec, new_blocks = got.state, got.result
            assert result == (None if new_blocks is None else list(new_blocks))
            if new_blocks is not None:
                requests[rid] = request
        elif op == "free":  # finished or preempted: the same call
            rid = data.draw(st.sampled_from(sorted(requests)), label="request_id")
            spec = manager.free(spec, rid).state
            reference.free(rid)
            finished.append(requests.pop(rid))
        else:
            rid = data.draw(st.sampled_from(waiting + ["never-ran"]), label="request_id")
            got, error = attempt(manager.free, spec, rid)
            _, ref_error = attempt(reference.free, rid)
            assert got is None and error is not None and ref_error == error
        check_after(op, before, spec.snapshot(), reference.snapshot())
        reference.check_invariants()
