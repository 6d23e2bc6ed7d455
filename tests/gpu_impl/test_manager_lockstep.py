"""gpu_impl's TensorKVCacheManager against the reference KVCacheManager, with its KV memory checked.

Each example draws its KV cache groups (the single full-attention group half
the time; else one to three of full attention, sliding windows that are and
are not multiples of the block size, and chunks). Requests share prefixes (a
two-letter token alphabet), carry LoRA names and cache salts, run chunked
prefills, long prompts and runs of decode steps that slide windows past many
blocks, and are freed in any order. Every step must give the reference's
result (or error type) and snapshot; on top of that the KV memory must hold
what the model would compute: every prefix hit reads back, from each group's
own store, the values of its own prefix (hit_content_intact; a null position
reads as []), every resident token of every running request reads back its
own value through each group's block table, and no store ever holds anything
in the null block.

Half the managers publish KV cache events. Requests are also preempted and
admitted again (counted apart), looked up under the scheduler's cap on the
hit, and blocks are evicted by id (held or free) and the cache reset. A first
step with external tokens may load them asynchronously (delay_cache_blocks:
its blocks registered only by a later cache_blocks, which may report a failed
load whose tokens after its valid prefix are computed again; the checks above
then read what the recomputation wrote, and what a hit on the loaded blocks
reads). After
every step both must have published the same events in the same order (none
with events off) and report the same hit statistics, and a router's mirror
of gpu_impl's stream must hold exactly its hash table's keys.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kvspec.conformance.core.adapter import AdapterConfig
from kvspec.gpu_impl.adapter import make_adapter
from kvspec.gpu_impl.kv_cache_manager import prefix_kv_source
from kvspec.reference import KVCacheManager
from kvspec.spec.events import EventMirror
from kvspec.spec.invariants import check_events, hit_content_intact
from kvspec.spec.manager import Request
from kvspec.spec.ordering import PROFILES
from kvspec.spec.state import NULL_BLOCK_ID
from tests.gpu_impl._lockstep import group_layouts, same_call

TOKENS = st.lists(st.integers(0, 1), min_size=1, max_size=14)
LONG_TOKENS = st.lists(st.integers(0, 1), min_size=15, max_size=40)


class ManagerLockstep(RuleBasedStateMachine):
    """The reference and a manager from `factory` (gpu_impl's), driven by the same request steps."""

    factory: Callable[[AdapterConfig], Any] = staticmethod(make_adapter)  # the memory mutants' tests swap it
    check_resident_tokens = True  # False: check memory only where the harness does, on prefix hits
    python_path_max: int | None = None  # the pool's longest host-face batch (None: its default)
    skipping_groups = False  # True: every layout has a sliding-window or chunked group

    def __init__(self) -> None:
        super().__init__()
        self.running: dict[str, Request] = {}
        self.preempted: dict[str, Request] = {}  # freed by the scheduler, waiting to be admitted again
        self.history: list[Request] = []  # every request seen, so new ones can repeat their prefixes
        self.loading: set[str] = set()  # running requests whose asynchronous load is not reported done yet
        self.num_requests = 0

    @initialize(
        block_size=st.integers(1, 4),
        enable_caching=st.sampled_from([True, True, True, False]),
        profile=st.sampled_from([*sorted(PROFILES), "lru-lfu:0.5"]),  # every policy, one weighted
        events=st.booleans(),
        data=st.data(),
    )
    def build(self, block_size: int, enable_caching: bool, profile: str, events: bool, data: st.DataObject) -> None:
        self.block_size = block_size
        groups = data.draw(group_layouts(block_size, self.skipping_groups), label="groups")
        self.num_groups = groups.count(",") + 1
        num_gpu_blocks = data.draw(st.integers(1, 6 + 8 * self.num_groups), label="num_gpu_blocks")
        event(f"{self.num_groups} KV cache group(s)")
        self.ref = KVCacheManager(
            num_gpu_blocks, block_size, enable_caching, profile, groups=groups, enable_kv_cache_events=events
        )
        config = AdapterConfig(
            "manager", num_gpu_blocks, enable_caching, profile, block_size, groups=groups, events=events
        )
        self.gpu = self.factory(config)
        self.events = events
        self.mirror = EventMirror()  # what a router holds from gpu_impl's stream so far
        if self.python_path_max is not None:
            self.gpu.block_pool.python_path_max = self.python_path_max
        self.gpu.set_kv_source(prefix_kv_source)

    # --- rules --------------------------------------------------------------------------------

    @rule(
        tokens=TOKENS,
        lora_name=st.sampled_from([None, "a"]),
        cache_salt=st.sampled_from([None, "t"]),
        data=st.data(),
    )
    def add_request(
        self, tokens: list[int], lora_name: str | None, cache_salt: str | None, data: st.DataObject
    ) -> None:
        self.num_requests += 1
        self.schedule(Request(f"r{self.num_requests}", tuple(tokens), lora_name, cache_salt), data)

    @rule(tokens=LONG_TOKENS, data=st.data())
    def add_long_request(self, tokens: list[int], data: st.DataObject) -> None:
        # A long prompt, prefilled in chunks by later steps: windows slide past many blocks.
        self.num_requests += 1
        self.schedule(Request(f"r{self.num_requests}", tuple(tokens)), data)

    @precondition(lambda self: self.history)
    @rule(data=st.data(), tail=st.lists(st.integers(0, 1), max_size=3))
    def add_request_sharing_prefix(self, data: st.DataObject, tail: list[int]) -> None:
        # Repeat part of an earlier request (running or finished), so that hits are common.
        other = data.draw(st.sampled_from(self.history))
        cut = data.draw(st.integers(1, len(other.token_ids)))
        self.num_requests += 1
        tokens = other.token_ids[:cut] + tuple(tail)
        self.schedule(Request(f"r{self.num_requests}", tokens, other.lora_name, other.cache_salt), data)

    def schedule(self, request: Request, data: st.DataObject) -> None:
        """A new request's first step: look up its prefix (capped a third of the time), check the hit's KV,
        allocate the rest."""
        self.history.append(request)
        cap = data.draw(st.one_of(st.none(), st.none(), st.integers(0, len(request.token_ids))), label="cap")
        outcome = same_call(self.ref, self.gpu, "get_computed_blocks", request, cap)
        hit_blocks, num_hit_tokens = outcome[1]
        event("prefix hit" if hit_blocks else "no prefix hit")
        self.check_hit_content(request, hit_blocks, num_hit_tokens)
        left = len(request.token_ids) - num_hit_tokens
        num_external = data.draw(st.integers(0, left - 1))
        # An asynchronous load: its blocks taken now, registered by cache_blocks; mostly no token computed with it.
        delayed = num_external > 0 and data.draw(st.booleans(), label="load in background")
        low = 0 if delayed else 1
        num_new = data.draw(st.one_of(st.just(low), st.integers(low, left - num_external)), label="num_new")
        outcome = same_call(
            self.ref, self.gpu, "allocate_slots", request, num_new, num_hit_tokens, hit_blocks, num_external, delayed
        )
        if outcome[1] is not None:
            self.running[request.request_id] = request
            if delayed:
                self.loading.add(request.request_id)
                event("asynchronous load")
            if any(NULL_BLOCK_ID in m.req_to_blocks[request.request_id] for m in self.ref.managers):
                event("admitted with skipped positions")

    @precondition(lambda self: self.running)
    @rule(data=st.data(), token=st.integers(0, 1))
    def allocate_slots(self, data: st.DataObject, token: int) -> None:
        rid = data.draw(st.sampled_from(sorted(self.running)))
        self.maybe_finish_load(rid, data)
        request = self.running[rid]
        num_computed = self.ref.num_computed_tokens[rid]
        if num_computed == len(request.token_ids):
            # Decode: the sampled token joins the request.
            request = Request(rid, request.token_ids + (token,), request.lora_name, request.cache_salt)
        num_new = data.draw(st.integers(1, len(request.token_ids) - num_computed))
        if self.running_step(request, num_new):
            self.history.append(request)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), tokens=st.lists(st.integers(0, 1), min_size=1, max_size=12))
    def decode_run(self, data: st.DataObject, tokens: list[int]) -> None:
        # Decode steps one after the other (the rest of the prompt first): a window slides a block at a time.
        rid = data.draw(st.sampled_from(sorted(self.running)))
        self.maybe_finish_load(rid, data)
        request = self.running[rid]
        for token in tokens:
            num_computed = self.ref.num_computed_tokens[rid]
            if num_computed == len(request.token_ids):
                request = Request(rid, request.token_ids + (token,), request.lora_name, request.cache_salt)
            if not self.running_step(request, len(request.token_ids) - num_computed):
                return
        self.history.append(request)

    def running_step(self, request: Request, num_new: int) -> bool:
        """A running request's next step on both; whether it was admitted. Names what it did with skipped blocks."""
        rid = request.request_id
        nulls = sum(m.req_to_blocks[rid].count(NULL_BLOCK_ID) for m in self.ref.managers)
        admitted = same_call(self.ref, self.gpu, "allocate_slots", request, num_new)[1] is not None
        if sum(m.req_to_blocks[rid].count(NULL_BLOCK_ID) for m in self.ref.managers) > nulls:
            event("skipped blocks freed" if admitted else "refused after freeing skipped blocks")
        if admitted:
            self.running[rid] = request
        return admitted

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.running)))
        same_call(self.ref, self.gpu, "free", rid)
        del self.running[rid]
        self.loading.discard(rid)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        # The scheduler frees a running request to make room and counts the preemption.
        rid = data.draw(st.sampled_from(sorted(self.running)))
        same_call(self.ref, self.gpu, "free", rid)
        request = self.running.pop(rid)
        self.loading.discard(rid)
        self.preempted[rid] = replace(request, num_preemptions=request.num_preemptions + 1)

    @precondition(lambda self: self.preempted)
    @rule(data=st.data())
    def readmit(self, data: st.DataObject) -> None:
        # Its tokens so far (prompt and decoded) are looked up again: hits count apart from first admissions.
        request = self.preempted.pop(data.draw(st.sampled_from(sorted(self.preempted))))
        self.schedule(request, data)
        if request.request_id not in self.running:
            self.preempted[request.request_id] = request  # refused for want of blocks: it waits on
        else:
            event("readmitted after preemption")

    @precondition(lambda self: self.loading)
    @rule(data=st.data())
    def cache_blocks(self, data: st.DataObject) -> None:
        # The load is done: mostly whole; else it failed partway and the tokens after its valid prefix are
        # computed again by the request's next steps.
        self.finish_load(data.draw(st.sampled_from(sorted(self.loading))), data)

    def finish_load(self, rid: str, data: st.DataObject) -> None:
        """Report a request's asynchronous load done (cache_blocks), whole or failed partway."""
        self.loading.discard(rid)
        num_computed, low = self.ref.num_computed_tokens[rid], self.registered_tokens(rid)
        failed = st.integers(low, num_computed - 1) if low < num_computed else st.nothing()
        valid = data.draw(st.one_of(st.just(num_computed), failed), label="tokens loaded")
        same_call(self.ref, self.gpu, "cache_blocks", self.running[rid], valid)
        event("load done" if valid == num_computed else "load failed partway")

    @rule(data=st.data(), count=st.sampled_from(["below", "above", -1, True, 1.5, None]))
    def bad_cache_blocks(self, data: st.DataObject, count: object) -> None:
        # A count outside [registered, computed] or no count, or a request that is not running (or no request).
        rid = data.draw(st.sampled_from([*sorted(self.running), "", "nobody", *self.marked_ids()]))
        request = self.running.get(rid) or Request(rid, (0, 1))
        if count in ("below", "above") and rid in self.running:
            count = self.registered_tokens(rid) - 1 if count == "below" else self.ref.num_computed_tokens[rid] + 1
        elif count in ("below", "above"):
            count = 0
        same_call(self.ref, self.gpu, "cache_blocks", request, count)

    def maybe_finish_load(self, rid: str, data: st.DataObject) -> None:
        # vLLM's scheduler steps a request again once its load is done; the spec lets it step before, too.
        if rid in self.loading and data.draw(st.booleans(), label="load done before the step"):
            self.finish_load(rid, data)

    def registered_tokens(self, rid: str) -> int:
        """The fewest tokens cache_blocks may leave a running request: what some group has registered (or null)."""
        return max(m.num_cached_block.get(rid, 0) for m in self.ref.managers) * self.block_size

    @rule(data=st.data())
    def evict_blocks(self, data: st.DataObject) -> None:
        # The connector's failed loads: cached blocks, held or free, mostly; sometimes a bad id or a repeat.
        n = self.ref.block_pool.num_gpu_blocks
        cached = [b for b in range(1, n) if self.ref.block_pool.blocks[b].block_hash is not None]
        good = st.sampled_from(cached) if cached else st.integers(1, max(n - 1, 1))
        ids = data.draw(st.lists(st.one_of(good, good, good, st.integers(-1, n)), max_size=4))
        same_call(self.ref, self.gpu, "evict_blocks", ids)

    @rule()
    def reset_prefix_cache(self) -> None:
        same_call(self.ref, self.gpu, "reset_prefix_cache")

    @rule(
        num_new=st.integers(-1, 3),
        num_hit=st.integers(-1, 5),
        hit_blocks=st.lists(st.one_of(st.integers(-1, 15), st.just(NULL_BLOCK_ID), st.booleans()), max_size=4),
        num_external=st.integers(-1, 2),
        delay=st.sampled_from([False, False, True, 1, None]),
        tokens=st.lists(st.integers(0, 1), max_size=5),
        data=st.data(),
    )
    def bad_allocate_slots(
        self,
        num_new: int,
        num_hit: int,
        hit_blocks: list[int],
        num_external: int,
        delay: Any,
        tokens: list[int],
        data: st.DataObject,
    ) -> None:
        # A running request (hits are refused), an empty id, one nobody scheduled, or one with the table mark;
        # a delay that is no bool, or one without external tokens.
        rid = data.draw(st.sampled_from([*sorted(self.running), "", "nobody", *self.marked_ids()]))
        request = self.running.get(rid) or Request(rid, tuple(tokens))
        outcome = same_call(
            self.ref, self.gpu, "allocate_slots", request, num_new, num_hit, hit_blocks, num_external, delay
        )
        if outcome[0] == "ok" and outcome[1] is not None:
            self.running[rid] = request
            if delay is True:
                self.loading.add(rid)

    @rule(data=st.data())
    def bad_free_or_lookup(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from([*sorted(self.running), "", "nobody", *self.marked_ids()]))
        if rid not in self.running:
            same_call(self.ref, self.gpu, "free", rid)
        same_call(self.ref, self.gpu, "get_computed_blocks", self.running.get(rid) or Request(rid, (0,)))

    @rule(
        num_preemptions=st.sampled_from([-1, True, 1.5, None]),
        cap=st.sampled_from([None, -1, True, 2.0, 1]),
        op=st.sampled_from(["get_computed_blocks", "allocate_slots"]),
    )
    def bad_request_counts(self, num_preemptions: Any, cap: Any, op: str) -> None:
        # A preemption count that is no count, or a hit cap that is none: refused, nothing changes.
        request = Request(f"bad{self.num_requests}", (0, 1), num_preemptions=num_preemptions)
        if op == "get_computed_blocks":
            same_call(self.ref, self.gpu, op, request, cap)
            same_call(self.ref, self.gpu, op, Request(f"bad{self.num_requests}", (0, 1)), cap)
        else:
            same_call(self.ref, self.gpu, op, request, 1)

    def marked_ids(self) -> list[str]:
        # With several groups, an id containing the table-name mark is refused (InvalidRequest).
        # NOTE: with one group the spec accepts it, and its invariants then read "a#1" as group 1's
        # table of "a" (inv_null_only_where_skipped fails on the reference too), so it is not sent.
        return ["a#1"] if self.num_groups > 1 else []

    # --- checks -------------------------------------------------------------------------------

    def check_hit_content(self, request: Request, hit_blocks: list[int], num_hit_tokens: int) -> None:
        # The hit is group by group, as many positions each; read_kv reads each part from its group's store.
        pages = self.gpu.read_kv(hit_blocks)
        assert len(pages) == len(hit_blocks), f"read_kv({hit_blocks}) gave {len(pages)} pages"
        n, bs = len(hit_blocks) // self.num_groups, self.block_size
        for j, (b, page) in enumerate(zip(hit_blocks, pages)):
            i = j % n
            expected = [] if b == NULL_BLOCK_ID else prefix_kv_source(request, i * bs, (i + 1) * bs)
            assert hit_content_intact(expected, page), f"hit {hit_blocks} of {request} reads back other KV at {j}"
        assert num_hit_tokens == n * bs

    @invariant()
    def same_snapshot(self) -> None:
        snapshot = self.gpu.snapshot()
        assert snapshot == self.ref.snapshot()
        self.gpu.check_invariants()
        if any(table.count(NULL_BLOCK_ID) >= 5 for _, table in snapshot.block_tables or ()):
            event("a block table with 5 or more null positions")

    @invariant()
    def same_events_and_stats(self) -> None:
        # Every step's events, refused calls' (none) included: the invariant runs after each rule.
        got, want = self.gpu.take_events(), self.ref.take_events()
        assert got == want, f"gpu_impl published {got}, the reference {want}"
        assert self.gpu.prefix_cache_stats() == self.ref.prefix_cache_stats()
        if self.events:  # off, both publish nothing (checked above), and there is no mirror to keep
            check_events(self.mirror, got, self.gpu.snapshot())
            self.mirror = self.mirror.apply(got)
            for kind in {type(e).__name__ for e in got}:
                event(f"published {kind}")

    @invariant()
    def resident_tokens_intact(self) -> None:
        if not self.check_resident_tokens:
            return
        bs = self.block_size
        for rid, request in self.running.items():
            num_computed = self.ref.num_computed_tokens[rid]
            values = prefix_kv_source(request, 0, num_computed)
            for g, manager in enumerate(self.ref.managers):
                table = manager.req_to_blocks[rid]
                pages = self.gpu.kv_caches[g].read_blocks(table).tolist() if table else []
                for p in range(num_computed):
                    if table[p // bs] != NULL_BLOCK_ID:  # a null position holds nothing: nobody reads it
                        assert pages[p // bs][p % bs] == values[p], f"{rid}'s KV at {p} in group {g} was overwritten"

    @invariant()
    def null_block_never_written(self) -> None:
        for g, kv in enumerate(self.gpu.kv_caches):
            assert not bool(kv.kv[NULL_BLOCK_ID].any()), f"group {g}'s store holds KV in the null block"


ManagerLockstep.TestCase.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)
test_manager_lockstep = ManagerLockstep.TestCase


class ManagerLockstepOnTheTensorPath(ManagerLockstep):
    """The same machine with every pool batch and writability check run through the tensor path (python_path_max=0)."""

    python_path_max = 0


ManagerLockstepOnTheTensorPath.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
test_manager_lockstep_on_the_tensor_path = ManagerLockstepOnTheTensorPath.TestCase


class ManagerLockstepWithSkippingGroups(ManagerLockstep):
    """The same machine, every layout with a sliding-window or chunked group (skipped blocks, null positions)."""

    skipping_groups = True


ManagerLockstepWithSkippingGroups.TestCase.settings = settings(max_examples=120, stateful_step_count=30, deadline=None)
test_manager_lockstep_with_skipping_groups = ManagerLockstepWithSkippingGroups.TestCase


@pytest.mark.slow
def test_manager_lockstep_long_campaign() -> None:
    """The same machine with a budget that reaches rarer interleavings (KVSPEC_SLOW=1)."""
    long_run = settings(max_examples=3000, stateful_step_count=60, deadline=None)
    run_state_machine_as_test(ManagerLockstep, settings=long_run)


def test_a_bool_hit_block_is_no_block_id_as_in_the_spec() -> None:
    # Found by the lock-step above: True named block 1 in gpu_impl, where the spec and the reference refuse it.
    gpu = make_adapter(AdapterConfig("manager", 4, True, "vllm-v1", 1))
    gpu.set_kv_source(prefix_kv_source)
    ref = KVCacheManager(4, 1, True, "vllm-v1")
    prompt = Request("r1", (1,))
    for manager in (gpu, ref):
        manager.allocate_slots(prompt, 1)
        manager.free("r1")
    same_call(ref, gpu, "allocate_slots", Request("r2", (1,)), 1, 1, [True], 0)
