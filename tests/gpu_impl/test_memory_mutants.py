"""The memory mutants (tests/mutants/gpu_memory.py) are caught by checking memory where the harness does.

Each mutant keeps gpu_impl's bookkeeping exact, so a comparison of snapshots
alone never fails on it. The machine here is the lock-step manager machine
with the one memory check the harness makes, on prefix hits; every mutant
must fail it, and the same machine on unmutated gpu_impl passes
(test_manager_lockstep). A scenario per mutant shows the damage in a few
explicit steps.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.errors import Flaky
from hypothesis.stateful import run_state_machine_as_test

from kvspec.conformance.core.adapter import AdapterConfig
from kvspec.gpu_impl.kv_cache_manager import prefix_kv_source
from kvspec.mutants.gpu_memory import MUTANTS, ReuseWithoutEviction, WriteSharedBlock, WriteWrongSlot
from kvspec.spec.errors import BlockManagerError
from kvspec.spec.invariants import hit_content_intact
from kvspec.spec.manager import Request
from tests.gpu_impl.test_manager_lockstep import ManagerLockstep

SEARCH = settings(
    max_examples=300,
    stateful_step_count=30,
    deadline=None,
    derandomize=True,
    database=None,
    phases=(Phase.explicit, Phase.generate),
    suppress_health_check=list(HealthCheck),
)


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_memory_mutant_is_caught_on_prefix_hits(mutant):
    class OnMutant(ManagerLockstep):
        factory = staticmethod(mutant.factory)
        check_resident_tokens = False  # only where the harness looks: the KV a hit reads back

    with pytest.raises((AssertionError, BlockManagerError, Flaky)):
        run_state_machine_as_test(OnMutant, settings=SEARCH)


def read_hit(adapter, request: Request) -> tuple[list[int], bool]:
    hit, num_hit_tokens = adapter.get_computed_blocks(request)
    actual = [v for page in adapter.read_kv(hit) for v in page]
    return hit, hit_content_intact(prefix_kv_source(request, 0, num_hit_tokens), actual)


def schedule(adapter, request: Request) -> None:
    hit, num_hit_tokens = adapter.get_computed_blocks(request)
    assert adapter.allocate_slots(request, len(request.token_ids) - num_hit_tokens, num_hit_tokens, hit) is not None


CONFIG = AdapterConfig("manager", num_gpu_blocks=8, block_size=4)


def test_wrong_slot_scenario_a_hit_reads_rotated_kv():
    m = WriteWrongSlot(CONFIG)
    schedule(m, Request("a", tuple(range(9))))
    hit, intact = read_hit(m, Request("b", tuple(range(9))))
    assert hit == [1, 2] and not intact


def test_shared_block_scenario_the_last_hit_block_is_overwritten():
    m = WriteSharedBlock(CONFIG)
    schedule(m, Request("a", tuple(range(9))))  # token 4 lands in block 1, token 8 in block 2
    assert read_hit(m, Request("probe", tuple(range(9)))) == ([1, 2], False)
    m2 = WriteSharedBlock(CONFIG)
    schedule(m2, Request("a", tuple(range(8)) + (99,)))  # blocks 1, 2 registered and sealed
    schedule(m2, Request("b", tuple(range(8)) + (42, 43)))  # hits 1, 2; its token 8 is written into block 2
    # Block 2 is registered and shared by a and b: its checksum no longer matches,
    # so the hit the spec promises (8 tokens) comes up short and block 2 is retired.
    assert m2.get_computed_blocks(Request("c", tuple(range(8)) + (7,))) == ([1], 4)
    assert m2.snapshot().quarantined == ()  # still held by a and b: retired when they free it
    m2.free("a")
    m2.free("b")
    assert m2.snapshot().quarantined == (2,)


def test_reuse_without_eviction_scenario_a_cached_block_reads_another_prefix():
    m = ReuseWithoutEviction(CONFIG)
    schedule(m, Request("a", tuple(range(9))))  # blocks 1, 2 cached, 3 partial
    m.free("a")  # 1, 2 keep their hashes; their pages go back to the page allocator
    schedule(m, Request("b", (50, 51, 52)))  # takes block 3, whose KV lands in cached block 2's page
    hit, num_hit_tokens = m.get_computed_blocks(Request("c", tuple(range(9))))
    # Block 2's checksum no longer matches: the hit the spec promises (8 tokens) comes up short.
    assert (hit, num_hit_tokens) == ([1], 4)
    assert m.snapshot().quarantined == (2,)
