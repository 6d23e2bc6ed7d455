"""Declared reactions to caller mistakes: every mistake is sent, and the declared reaction is what is checked.

The adapters here are the reference pool with one mistake handled otherwise
than the spec does, and a declaration that says so (or says something else).
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvspec.conformance.core.adapter import AdapterConfig
from kvspec.conformance.core.lockstep import ConformanceFailure, LockStep, Observer
from kvspec.conformance.core.reactions import (
    IGNORES,
    SPEC_ERROR,
    NotExpressible,
    Reaction,
    accepts,
    all_mistakes,
    declared_reactions,
    not_expressible,
    raises,
    reaction_problem,
)
from kvspec.conformance.core.results import Outcome
from kvspec.conformance.core.strategies import HASH_UNIVERSE
from kvspec.conformance.core.trace import dumps_trace, parse_trace
from kvspec.conformance.runner.replaying import replay_example
from kvspec.conformance.runner.run import run_check
from kvspec.conformance.runner.survey import survey_reactions
from kvspec.conformance.targets.builtin import ReferenceManagerAdapter, ReferencePoolAdapter
from kvspec.spec.state import BlockId

N = 120


class ValueErrorOnBadId(ReferencePoolAdapter):
    """touch refuses an id out of range with its own ValueError (the spec's InvalidBlock otherwise)."""

    def touch(self, block_ids: Sequence[BlockId]) -> None:
        if any(not (type(b) is int and 0 < b < self.num_gpu_blocks) for b in block_ids):
            raise ValueError(f"bad block id in {list(block_ids)}")
        super().touch(block_ids)


class SkipsDoubleFree(ReferencePoolAdapter):
    """free_blocks drops a block no request holds and frees the rest (as vllm-ascend's patch does)."""

    def free_blocks(self, ordered_block_ids: Sequence[BlockId]) -> None:
        super().free_blocks(
            [b for b in ordered_block_ids if not (type(b) is int and 0 < b < self.num_gpu_blocks and self._free(b))]
        )

    def _free(self, b: int) -> bool:
        return self.blocks[b].ref_cnt == 0


class CountsTwice(ReferencePoolAdapter):
    """touch with a block named twice takes two references (as vLLM does)."""

    def touch(self, block_ids: Sequence[BlockId]) -> None:
        ids = list(block_ids)
        if len(set(ids)) < len(ids) and all(type(b) is int and 0 < b < self.num_gpu_blocks for b in ids):
            for b in ids:
                super().touch([b])
            return
        super().touch(ids)


class NoSuchBlock(ReferencePoolAdapter):
    """An API of block objects: an id that names no block has no translation."""

    def touch(self, block_ids: Sequence[BlockId]) -> None:
        if any(not (type(b) is int and 0 <= b < self.num_gpu_blocks) for b in block_ids):
            raise NotExpressible(f"no block object for one of {list(block_ids)}")
        super().touch(block_ids)


def _factory(cls: type[ReferencePoolAdapter], reactions: dict[str, Reaction] | None = None):
    """The pool `cls` declaring `reactions` (the reference at the request level)."""

    def factory(config: AdapterConfig) -> object:
        if config.level != "pool":
            return ReferenceManagerAdapter(config)
        adapter = cls(config)
        if reactions is not None:
            adapter.mistake_reactions = reactions  # type: ignore[attr-defined]
        return adapter

    return factory


def _check(factory, tmp_path):
    return run_check(factory, trace_dir=tmp_path, impl="under-test", max_examples=N, isolate=False)


def test_a_declared_own_error_type_conforms_and_another_type_diverges(tmp_path):
    right = _check(_factory(ValueErrorOnBadId, {"touch: bad id": raises("ValueError")}), tmp_path)
    assert right.verdict == "conforms", right.failure
    wrong = _check(_factory(ValueErrorOnBadId, {"touch: bad id": raises("KeyError")}), tmp_path)
    assert wrong.verdict == "diverges" and wrong.exit_code == 1
    assert "'touch: bad id': it raised ValueError" in wrong.failure.message
    assert "declares it raises KeyError" in wrong.failure.message
    assert wrong.failure.num_steps <= 3


def test_an_undeclared_own_error_type_is_a_wrong_error_type(tmp_path):
    r = _check(_factory(ValueErrorOnBadId), tmp_path)
    assert r.verdict == "crashed" and r.exit_code == 1 and r.failure.op == "touch"


def test_ignoring_a_mistake_is_checked_against_the_good_part_of_the_call(tmp_path):
    declared = _check(_factory(SkipsDoubleFree, {"free_blocks: double free": IGNORES}), tmp_path)
    assert declared.verdict == "conforms", declared.failure
    # Ignoring is not accepting anything: the state must be what the call without the bad block gives.
    undeclared = _check(_factory(SkipsDoubleFree), tmp_path)
    assert undeclared.verdict == "diverges" and undeclared.failure.op == "free_blocks"


def test_an_accepted_mistake_goes_to_a_replica_and_the_example_goes_on(tmp_path):
    r = _check(_factory(CountsTwice, {"touch: named twice": accepts("each copy takes a reference")}), tmp_path)
    assert r.verdict == "conforms", r.failure
    observer = Observer()
    config = AdapterConfig("pool", 4)
    lock = LockStep(
        _factory(CountsTwice, {"touch: named twice": accepts("each copy takes a reference")}), config, observer
    )
    lock.check()
    lock.call("get_new_blocks", 1)
    lock.check()
    lock.call("cache_full_blocks", [1], [HASH_UNIVERSE[0]])
    lock.check()
    lock.call("touch", [1, 1], mistake="named twice", without=([1],))
    lock.check()
    step = lock.records[-1]
    assert step.impl.replica and step.impl_snapshot.ref_cnt[1] == 3  # what the replica did
    assert lock.impl_snapshot.ref_cnt[1] == 1  # the example goes on from the state before
    assert observer.mistakes_sent["touch: named twice"] == 1
    # Declared as raising the spec's error, the same implementation diverges at that step.
    lock = LockStep(_factory(CountsTwice), config)
    lock.check()
    for op, args in [("get_new_blocks", (1,)), ("cache_full_blocks", ([1], [HASH_UNIVERSE[0]]))]:
        lock.call(op, *args)
        lock.check()
    lock.call("touch", [1, 1], mistake="named twice", without=([1],))
    with pytest.raises(ConformanceFailure, match="the spec raised InvalidRequest"):
        lock.check()


def test_a_call_the_api_cannot_express_is_counted_not_sent_and_never_excuses_a_valid_call(tmp_path):
    r = _check(_factory(NoSuchBlock), tmp_path)
    assert r.verdict == "conforms", r.failure
    lock = LockStep(_factory(NoSuchBlock), AdapterConfig("pool", 4))
    lock.check()
    lock.call("touch", [9], mistake="bad id", without=([],))
    lock.check()
    assert lock.records[-1].impl.not_sent and lock.observer.not_expressed["touch: bad id"] == 1

    class Refuses(ReferencePoolAdapter):
        def touch(self, block_ids: Sequence[BlockId]) -> None:
            raise NotExpressible("never")

    lock = LockStep(lambda c: Refuses(c), AdapterConfig("pool", 4))
    lock.check()
    lock.call("get_new_blocks", 1)
    lock.check()
    lock.call("touch", [1])
    with pytest.raises(ConformanceFailure, match="a valid call is not expressible"):
        lock.check()


def test_a_declared_reaction_that_names_no_mistake_is_refused():
    class Misdeclared(ReferencePoolAdapter):
        mistake_reactions = {"touch: bad ids": IGNORES}

    with pytest.raises(ValueError, match="not a caller mistake of the operations table"):
        declared_reactions(Misdeclared(AdapterConfig("pool", 2)))
    lock = LockStep(lambda c: Misdeclared(c), AdapterConfig("pool", 2))
    with pytest.raises(ConformanceFailure, match="declarations are wrong"):
        lock.check()


def test_defaults_every_mistake_raises_the_spec_error_unless_the_adapter_says_it_does_not_validate():
    class Trusting:
        validates_bad_input = False
        rejected_mistakes = frozenset({"free_blocks: double free"})
        mistake_reactions = {"touch: bad id": not_expressible("objects only")}

    assert declared_reactions(object()) == dict.fromkeys(all_mistakes(), SPEC_ERROR)
    assert declared_reactions(Trusting()) == {
        "free_blocks: double free": SPEC_ERROR,
        "touch: bad id": not_expressible("objects only"),
    }


@pytest.mark.parametrize(
    ("declared", "impl", "changed", "ok"),
    [
        (raises("ValueError"), Outcome(crashed=True, raised_types=("ValueError",)), False, True),
        (raises("ValueError"), Outcome(crashed=True, raised_types=("ValueError",)), True, False),
        (raises("ValueError", then="half applied"), Outcome(crashed=True, raised_types=("ValueError",)), True, True),
        (raises("LookupError"), Outcome(crashed=True, raised_types=("IndexError", "LookupError")), False, True),
        (IGNORES, Outcome(result=None), False, True),
        (IGNORES, Outcome(crashed=True, raised_types=("ValueError",)), False, False),
        (accepts("x"), Outcome(result=None), True, True),
        (SPEC_ERROR, Outcome(error="InvalidBlock"), False, True),
        (SPEC_ERROR, Outcome(error="DoubleFree"), False, False),
        (SPEC_ERROR, Outcome(result=None), False, False),
    ],
)
def test_reaction_problem(declared, impl, changed, ok):
    assert (reaction_problem(declared, Outcome(error="InvalidBlock"), impl, changed) is None) is ok


def test_a_trace_keeps_each_mistake_and_its_good_part_and_replays_them():
    factory = _factory(SkipsDoubleFree, {"free_blocks: double free": IGNORES})
    lock = LockStep(factory, AdapterConfig("pool", 4))
    lock.check()
    for op, args, kw in [
        ("get_new_blocks", (2,), {}),
        ("free_blocks", ([1],), {}),
        ("free_blocks", ([2, 1],), {"mistake": "double free", "without": ([2],)}),
    ]:
        lock.call(op, *args, **kw)
        lock.check()
    trace = parse_trace(dumps_trace(lock.trace("under-test")).splitlines())
    # every argument, the trailing evict_first at its default, as the call's own
    assert trace.steps[-1].mistake == "free_blocks: double free" and trace.steps[-1].without == ([2], False)
    again = replay_example(trace, factory, "under-test", None, None, None)
    assert again.verdict == "conforms" and again.steps == 3


def test_the_survey_of_the_reference_sees_the_spec_error_for_every_mistake_it_makes():
    seen = survey_reactions(_factory(ReferencePoolAdapter), "pool", True, max_examples=60)
    assert seen, "the survey made no mistake"
    assert all(set(c) == {"spec error"} for c in seen.values()), seen
    own_error = survey_reactions(_factory(ValueErrorOnBadId), "pool", True, max_examples=60)
    assert set(own_error["touch: bad id"]) == {"raises ValueError"}


def test_vllm_declared_reactions_name_every_mistake_of_their_level_and_only_those():
    """vLLM's tables (kvspec.conformance.targets.vllm.reactions) list every mistake of their level, so absent means
    "declared None" (no one reaction), and a table with a typo'd mistake name cannot load into an adapter."""
    from kvspec.conformance.core.operations import OPERATIONS
    from kvspec.conformance.targets.vllm import reactions as vllm_reactions
    from kvspec.conformance.targets.vllm.releases import RELEASES

    request_level = {f"{op.name}: {m}" for op in OPERATIONS.values() if "manager" in op.levels for m in op.mistakes}
    assert set(vllm_reactions._MANAGER_REACTIONS) == request_level
    pool_level = {f"{op.name}: {m}" for op in OPERATIONS.values() if "pool" in op.levels for m in op.mistakes}
    assert set(vllm_reactions._POOL_REACTIONS) <= pool_level
    for version in RELEASES:
        for caching in (True, False):

            class Declared:
                validates_bad_input = False
                mistake_reactions = vllm_reactions.manager_reactions(version, caching)

            assert declared_reactions(Declared) == Declared.mistake_reactions
    # 0.8.x without caching diverges on a valid free first: nothing can be measured there.
    assert vllm_reactions.manager_reactions("0.8.5.post1", False) == {}
    on, off = vllm_reactions.manager_reactions("0.33.0", True), vllm_reactions.manager_reactions("0.33.0", False)
    # 0.10.2's empty prompt raises ValueError; 0.33's takes the scheduler's cap, and a cap of 0 searches nothing.
    assert vllm_reactions.manager_reactions("0.10.2", True)["get_computed_blocks: no tokens"] == raises("ValueError")
    assert "get_computed_blocks: no tokens" not in on
    assert off["get_computed_blocks: no tokens"].kind == "ignores"
    assert on["evict_blocks: named twice"].kind == "ignores"
    # evict_blocks takes plain ints: a reaction per class of bad id, the pool's own (its bound check asserts).
    assert [on[f"evict_blocks: {m}"].kind for m in ("bad id", "id past the pool", "negative id")] == [
        "ignores",
        "raises",
        "accepts",
    ]
    assert on["evict_blocks: id past the pool"].error == "AssertionError"
    assert "allocate_slots: bad count" not in on and "allocate_slots: bad count" not in off


@pytest.mark.parametrize(
    "declarations, says",
    [
        ({"known_deviations": {"touch": "why"}}, "known_deviations names 'touch'"),
        ({"not_applicable": {"cache salt": "why"}}, "names 'cache salt'; the harness reads 'cache_salt'"),
        ({"not_applicable": {"Multimodal input": "why"}}, "the harness reads 'multimodal inputs'"),
        ({"not_applicable": {"BlockStored.lora": "why"}}, "not_applicable names 'BlockStored.lora'; BlockStored's"),
    ],
)
def test_a_declaration_the_harness_would_not_act_on_is_refused(declarations, says):
    # The summary would list it as left out while the harness sent or compared it all the same.
    Misdeclared = type("Misdeclared", (ReferencePoolAdapter,), declarations)
    lock = LockStep(lambda c: Misdeclared(c), AdapterConfig("pool", 2))
    with pytest.raises(ConformanceFailure, match="declarations are wrong") as failure:
        lock.check()
    assert says in str(failure.value)


def test_a_note_of_the_adapters_own_is_listed_and_changes_nothing():
    class Noted(ReferencePoolAdapter):
        not_applicable = {"exact hash values": "compared as names", "BlockStored.lora_name": "no adapters"}
        known_deviations = {"get_usage": "its own formula"}

    lock = LockStep(lambda c: Noted(c), AdapterConfig("pool", 2))
    lock.check()
    assert "get_usage" not in lock.capabilities
    assert {"exact hash values: not applicable, compared as names", "get_usage: not compared, its own formula"} <= (
        lock.observer.not_exercised
    )
