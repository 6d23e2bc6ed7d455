"""gpu_impl's TensorBlockPool against the reference BlockPool, in lock-step, snapshot by snapshot.

Every step runs one operation on both and requires the same result or the
same error type, then the same snapshot (block ids, free-queue order, hash
table), every spec invariant, and gpu_impl's own representation checks.
Pools are small so that every corner is reached; the key index is sometimes
at its minimum length so that relabels happen all the time (and a keyed
policy's packed keys start narrow, so that they are repacked all the time). Each pool runs
its batches as Python loops, as tensor operations, or either by length
(`python_path_max`), all on the host face, with the device face in the same
memory or in its own kept equal (`share_host_memory=False`: what CUDA does),
so each path and the synchronisation are checked alone; the device face is
read (and the faces compared) when a rule does, so a call's writes may wait
on the host across calls, as on CUDA. Half the pools publish KV cache events:
after every step both must have published the same events in the same
order (none with events off), and a router's mirror of gpu_impl's stream
must hold exactly its hash table's keys (the spec's event rules).
"""

from __future__ import annotations

import random

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kvspec.gpu_impl.block_pool import TensorBlockPool
from kvspec.gpu_impl.device import pick_device
from kvspec.reference import BlockPool
from kvspec.spec.events import BlockRemoved, EventMirror
from kvspec.spec.invariants import check_events
from kvspec.spec.ordering import PROFILES, QUEUE_PROFILES
from kvspec.spec.state import BlockHash
from tests.gpu_impl._lockstep import same_call

HASHES = [BlockHash(bytes([i]) * 4) for i in range(6)]  # few, so duplicates and re-hits are common


class PoolLockstep(RuleBasedStateMachine):
    """The reference and gpu_impl pools, driven by the same operations."""

    def __init__(self) -> None:
        super().__init__()
        self.ref: BlockPool
        self.gpu: TensorBlockPool

    @initialize(
        num_gpu_blocks=st.one_of(st.integers(1, 10), st.sampled_from([70, 130])),
        enable_caching=st.booleans(),
        profile=st.sampled_from([*sorted(PROFILES), "lru-lfu:0.5"]),  # every policy, one weighted
        tight_keys=st.booleans(),
        python_path_max=st.sampled_from([None, 0, 3]),
        two_faces=st.booleans(),
        events=st.booleans(),
    )
    def build(
        self,
        num_gpu_blocks: int,
        enable_caching: bool,
        profile: str,
        tight_keys: bool,
        python_path_max: int | None,
        two_faces: bool,
        events: bool,
    ) -> None:
        self.n = num_gpu_blocks
        self.ref = BlockPool(num_gpu_blocks, enable_caching, profile, enable_kv_cache_events=events)
        capacity = 2 * num_gpu_blocks if tight_keys else None
        self.gpu = TensorBlockPool(
            num_gpu_blocks,
            enable_caching,
            profile,
            pick_device(),
            key_capacity=capacity,
            python_path_max=python_path_max,
            share_host_memory=False if two_faces else None,
            enable_kv_cache_events=events,
        )
        if tight_keys and self.gpu._stamped is not None:
            # A keyed policy's packed keys start with one-bit stamp and access fields (widened a bit at a time):
            # the keys are repacked all the time, as the key index is relabelled all the time above.
            self.gpu._stamped._set_widths(1, 1)
        self.events = events
        self.mirror = EventMirror()  # what a router holds from gpu_impl's stream so far

    # --- helpers drawing from the current state ---------------------------------------------

    def _held(self) -> list[int]:
        return [b for b in range(1, self.n) if self.ref.blocks[b].ref_cnt > 0]

    def _hashed(self) -> list[int]:
        return [b for b in range(1, self.n) if self.ref.blocks[b].block_hash is not None]

    # --- rules --------------------------------------------------------------------------------

    @rule(num_blocks=st.integers(-1, 12), data=st.data())
    def get_new_blocks(self, num_blocks: int, data: st.DataObject) -> None:
        if data.draw(st.booleans()) and self.ref.get_num_free_blocks():
            num_blocks = data.draw(st.integers(1, self.ref.get_num_free_blocks()))  # large batches too
        same_call(self.ref, self.gpu, "get_new_blocks", num_blocks)

    @precondition(lambda self: self._hashed())
    @rule(data=st.data())
    def touch(self, data: st.DataObject) -> None:
        blocks = data.draw(st.lists(st.sampled_from(self._hashed()), unique=True, max_size=8))
        same_call(self.ref, self.gpu, "touch", blocks)

    @precondition(lambda self: self._held())
    @rule(data=st.data())
    def free_blocks(self, data: st.DataObject) -> None:
        blocks = data.draw(st.lists(st.sampled_from(self._held()), unique=True, min_size=1))
        # evict_first (vLLM 0.34.0 on): every freed block before every other cached block
        same_call(self.ref, self.gpu, "free_blocks", blocks, data.draw(st.booleans(), label="evict_first"))

    @precondition(lambda self: self._held())
    @rule(data=st.data(), evict_first=st.sampled_from([0, 1, None, "yes"]))
    def bad_evict_first(self, data: st.DataObject, evict_first: object) -> None:
        blocks = data.draw(st.lists(st.sampled_from(self._held()), unique=True, min_size=1))
        same_call(self.ref, self.gpu, "free_blocks", blocks, evict_first)  # InvalidRequest on both, nothing freed

    @precondition(lambda self: self._held())
    @rule(data=st.data())
    def cache_full_blocks(self, data: st.DataObject) -> None:
        candidates = [b for b in self._held() if self.ref.blocks[b].block_hash is None] or self._held()
        blocks = data.draw(st.lists(st.sampled_from(candidates), unique=True, max_size=5))
        hashes = data.draw(st.lists(st.sampled_from(HASHES), min_size=len(blocks), max_size=len(blocks)))
        same_call(self.ref, self.gpu, "cache_full_blocks", blocks, hashes)

    @rule(block_hash=st.sampled_from(HASHES))
    def get_cached_block(self, block_hash: BlockHash) -> None:
        same_call(self.ref, self.gpu, "get_cached_block", block_hash)

    @rule(data=st.data())
    def evict_blocks(self, data: st.DataObject) -> None:
        blocks = data.draw(st.lists(st.integers(1, max(self.n - 1, 1)), unique=True, max_size=4))
        same_call(self.ref, self.gpu, "evict_blocks", blocks)

    @rule()
    def reset_prefix_cache(self) -> None:
        same_call(self.ref, self.gpu, "reset_prefix_cache")

    @rule(block_id=st.integers(-1, 12))
    def is_block_writable(self, block_id: int) -> None:
        same_call(self.ref, self.gpu, "is_block_writable", block_id)

    @rule()
    def counts(self) -> None:
        same_call(self.ref, self.gpu, "get_num_free_blocks")
        same_call(self.ref, self.gpu, "get_usage")

    @rule(
        op=st.sampled_from(["touch", "free_blocks", "evict_blocks"]),
        ids=st.lists(st.one_of(st.integers(-2, 12), st.booleans(), st.none(), st.floats(0, 3)), max_size=4),
    )
    def bad_block_ids(self, op: str, ids: list[object]) -> None:
        # Anything at all: out of range, the null block, repeats, bools, floats, None.
        same_call(self.ref, self.gpu, op, ids)

    @precondition(lambda self: self._held())
    @rule(data=st.data())
    def double_free(self, data: st.DataObject) -> None:
        free = [b for b in range(1, self.n) if self.ref.blocks[b].ref_cnt == 0]
        held = data.draw(st.lists(st.sampled_from(self._held()), unique=True, min_size=1))
        blocks = held + data.draw(st.lists(st.sampled_from(free or [0]), unique=True, max_size=2))
        same_call(self.ref, self.gpu, "free_blocks", data.draw(st.permutations(blocks)))

    @rule(data=st.data())
    def bad_cache_full_blocks(self, data: st.DataObject) -> None:
        blocks = data.draw(st.lists(st.integers(0, max(self.n - 1, 0)), max_size=3))
        hashes = data.draw(st.lists(st.one_of(st.sampled_from(HASHES), st.just("not-bytes")), max_size=3))
        same_call(self.ref, self.gpu, "cache_full_blocks", blocks, hashes)

    # --- the comparison ---------------------------------------------------------------------------

    @rule()
    def read_the_device_face(self) -> None:
        # check_invariants reads the device face (and requires both faces equal): a rule, not an invariant,
        # so runs of calls also go by with their writes still waiting on the host (gpu_impl.mirror) until
        # this read needs the device face.
        self.gpu.check_invariants()

    @invariant()
    def same_snapshot(self) -> None:
        assert self.gpu.snapshot() == self.ref.snapshot()  # the host face: reading it leaves the device face be

    def teardown(self) -> None:
        if hasattr(self, "gpu"):
            self.gpu.check_invariants()

    @invariant()
    def same_events(self) -> None:
        # Every step's events, refused calls' (none) included: the invariant runs after each rule.
        got, want = self.gpu.take_events(), self.ref.take_events()
        assert got == want, f"gpu_impl published {got}, the reference {want}"
        if self.events:  # off, both publish nothing (checked above), and there is no mirror to keep
            check_events(self.mirror, got, self.gpu.snapshot())
            self.mirror = self.mirror.apply(got)


PoolLockstep.TestCase.settings = settings(max_examples=120, stateful_step_count=40, deadline=None)
test_pool_lockstep = PoolLockstep.TestCase


@pytest.mark.parametrize("profile", [*sorted(PROFILES), "lru-lfu:0.5"])
@pytest.mark.parametrize(
    ("python_path_max", "two_faces"),
    [(None, False), (0, False), (40, True)],
    ids=["default", "tensor-path-only", "both-paths-two-faces"],
)
def test_large_pool_random_batches_match_reference(profile: str, python_path_max: int | None, two_faces: bool) -> None:
    """Whole-request batches of hundreds of blocks (the device-side checks and gap scans), seeded.

    Events on: a long take or eviction picks its hashed blocks on the device; every step's
    events must be the reference's.
    """
    rng = random.Random(6)
    n = 600
    ref = BlockPool(n, True, profile, enable_kv_cache_events=True)
    gpu = TensorBlockPool(
        n,
        True,
        profile,
        pick_device(),
        key_capacity=2 * n,
        python_path_max=python_path_max,
        share_host_memory=False if two_faces else None,
        enable_kv_cache_events=True,
    )
    num_removed = 0
    requests: list[list[int]] = []
    for step in range(300):
        action = rng.random()
        if action < 0.35 or not requests:
            k = rng.randint(1, 150)
            got = same_call(ref, gpu, "get_new_blocks", k)
            if got[0] == "ok":
                blocks = got[1]
                cached = blocks[: rng.randint(0, len(blocks))]
                hashes = [BlockHash(rng.randrange(40).to_bytes(2, "big")) for _ in cached]
                same_call(ref, gpu, "cache_full_blocks", cached, hashes)
                requests.append(blocks)
        elif action < 0.7:
            blocks = requests.pop(rng.randrange(len(requests)))
            same_call(ref, gpu, "free_blocks", blocks[::-1])
        else:
            hashed = [b for b in range(1, n) if ref.blocks[b].block_hash is not None]
            hit = rng.sample(hashed, min(len(hashed), rng.randint(1, 120)))
            same_call(ref, gpu, "touch", hit)
            requests.append(hit)
        if action > 0.95:
            evicted = rng.sample(range(1, n), rng.randint(1, 300))  # held and free, hashed and not
            same_call(ref, gpu, "evict_blocks", evicted)
        events = gpu.take_events()
        assert events == ref.take_events(), f"step {step}"
        num_removed += sum(isinstance(e, BlockRemoved) for e in events)
        if step % 25 == 0:
            assert gpu.snapshot() == ref.snapshot(), f"step {step}"
    assert gpu.snapshot() == ref.snapshot()
    gpu.check_invariants()
    if profile in QUEUE_PROFILES:
        assert gpu.free_block_queue.num_relabels > 0, "the minimum key index should have forced relabels"
    assert num_removed > 100, "long takes and evictions should have removed many keys"


@pytest.mark.slow
def test_pool_lockstep_long_campaign() -> None:
    """The same machine with a budget that reaches rarer interleavings (KVSPEC_SLOW=1)."""
    run_state_machine_as_test(PoolLockstep, settings=settings(max_examples=3000, stateful_step_count=80, deadline=None))
