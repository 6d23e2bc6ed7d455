"""The operations table is the one description of each operation, and the harness is built on it.

A throwaway operation added through the table alone (its spec, an
implementation, and one entry) is drawn by the machine with its caller
mistake, compared in lock-step, traced, replayed, covered, shown by the
player, told in the story and listed by `kvspec errors` like the real ones; the structure
the table replaced (positional splits of parallel dicts, verdicts compared as
strings, one long runner) does not come back.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from kvspec.conformance.core.adapter import AdapterConfig, capabilities
from kvspec.conformance.core.coverage import expected_branches
from kvspec.conformance.core.error_contract import build_contract, render_text
from kvspec.conformance.core.lockstep import ConformanceFailure, LockStep, Observer
from kvspec.conformance.core.machine import conformance_machine
from kvspec.conformance.core.mistakes import BAD_ID, Cases, pool_state, set_to
from kvspec.conformance.core.operations import (
    OPERATIONS,
    Draw,
    Operation,
    draw_block_id,
    level_operations,
    operation_added,
)
from kvspec.conformance.core.report import render_story
from kvspec.conformance.core.results import FailureKind, Verdict
from kvspec.conformance.core.trace import read_trace, write_trace
from kvspec.conformance.core.wording import CallText, Wording
from kvspec.conformance.runner.run import replay
from kvspec.conformance.targets.builtin import ReferencePoolAdapter
from kvspec.conformance.tools.view.model import build_view
from kvspec.conformance.tools.view.source import trace_to_page_data
from kvspec.spec import ops as spec_ops
from kvspec.spec.errors import InvalidBlock
from kvspec.spec.events import AllBlocksCleared
from kvspec.spec.state import BlockHash, PoolState, Snapshot
from kvspec.spec.step import Step

ROOT = Path(__file__).resolve().parents[2]


def _is_block_hashed(state: PoolState, block_id: int) -> Step[PoolState, bool]:
    """The throwaway operation's spec: whether a block holds a hash (a query: the state is unchanged)."""
    if isinstance(block_id, bool) or not isinstance(block_id, int) or not 0 <= block_id < state.num_gpu_blocks:
        raise InvalidBlock(
            f"is_block_hashed: block_id={block_id!r} is not a block of this pool (0..{state.num_gpu_blocks - 1})"
        )
    return Step(state, state.block_hash[block_id] is not None)


def _reached(args: object, before: Snapshot, after: Snapshot, result: object) -> list[str]:
    return ["is_block_hashed: yes" if result else "is_block_hashed: no"]


# The one description of the new operation: its spec, how results compare, its branches, what the player says
# of it, its caller mistake (from which `kvspec errors` computes its row), and how the machine draws it.
IS_HASHED = Operation(
    name="is_block_hashed",
    levels=("pool",),
    params=("block_id",),
    spec=_is_block_hashed,
    normalize=bool,
    branches=("is_block_hashed: yes", "is_block_hashed: no"),
    errors=("InvalidBlock",),
    wording=Wording(
        lambda c: f"Ask whether block {c['block_id']} holds a hash.",
        lambda r: "yes, hashed" if r is True else "no hash",
    ),
    reached=_reached,
    cases=Cases(pool_state, {"caching": True, "block_id": 1}, {"bad id": set_to(block_id=BAD_ID)}),
    draw=Draw(mistakes=lambda state: ("bad id",), args=draw_block_id),
    is_optional=True,
)


class _Hashing(ReferencePoolAdapter):
    """An implementation of the new operation: the reference pool's own answer."""

    def is_block_hashed(self, block_id: int) -> bool:
        n = self.snapshot().num_gpu_blocks
        if isinstance(block_id, bool) or not isinstance(block_id, int) or not 0 <= block_id < n:
            raise InvalidBlock(f"is_block_hashed: block_id={block_id!r} is not a block of this pool (0..{n - 1})")
        return self.snapshot().block_hash[block_id] is not None


class _HashingWrong(_Hashing):
    def is_block_hashed(self, block_id: int) -> bool:
        super().is_block_hashed(block_id)  # the same errors
        return self.snapshot().block_hash[block_id - 1] is not None  # off by one: the block before it


H1, H2 = BlockHash(b"\x01" * 32), BlockHash(b"\x02" * 32)
STEPS = [
    ("is_block_hashed", (1,)),
    ("get_new_blocks", (2,)),
    ("cache_full_blocks", ([1, 2], [H1, H2])),
    ("free_blocks", ([2],)),
    ("is_block_hashed", (1,)),
]


def _drive(factory: type[_Hashing]) -> LockStep:
    lock = LockStep(factory, AdapterConfig("pool", 4), Observer())
    lock.check()
    for op, args in STEPS:
        lock.call(op, *args)
        lock.check()
    return lock


def _run_machine(factory: type[_Hashing], observer: Observer) -> None:
    machine = conformance_machine(factory, "pool", observer=observer)
    run_state_machine_as_test(
        machine,
        settings=settings(max_examples=40, derandomize=True, deadline=None, database=None,
                          phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck)),
    )  # fmt: skip


def test_an_operation_added_through_the_table_is_drawn_by_the_machine_and_compared_in_lock_step():
    with operation_added(IS_HASHED):
        observer = Observer()
        _run_machine(_Hashing, observer)
        # Drawn (both answers), with its caller mistake, against an implementation that conforms.
        drawn = {"is_block_hashed: yes", "is_block_hashed: no", "is_block_hashed: InvalidBlock"}
        assert drawn <= set(observer.coverage)
        assert observer.mistakes_sent["is_block_hashed: bad id"] > 0
        with pytest.raises(ConformanceFailure) as caught:
            _run_machine(_HashingWrong, Observer())
        assert caught.value.failure.op == "is_block_hashed"
        # Off by one block: which way round the campaign meets first depends on its draws.
        assert re.search(r"returned (True|False); the spec returned (?!\1)", caught.value.failure.message)
    # Out of the block, the machines built are as they were: no rule for it.
    assert "is_block_hashed" not in {r.function.__name__ for r in conformance_machine(_Hashing).setup_state().rules}


def test_an_operation_added_through_the_table_is_traced_replayed_shown_and_covered(tmp_path):
    with operation_added(IS_HASHED):
        assert "is_block_hashed" in capabilities(_Hashing(AdapterConfig("pool", 4)))
        assert {"is_block_hashed: yes", "is_block_hashed: no", "is_block_hashed: InvalidBlock"} <= set(
            expected_branches("pool", True, "vllm-v1")
        )
        lock = _drive(_Hashing)
        assert [r.spec.result for r in lock.records if r.op == "is_block_hashed"] == [False, True]
        assert lock.observer.coverage["is_block_hashed: no"] == 1
        assert lock.observer.coverage["is_block_hashed: yes"] == 1
        path = write_trace(tmp_path / "t.trace.jsonl", lock.trace("hashing"))
        trace = read_trace(path)
        assert [s.op for s in trace.steps] == [op for op, _ in STEPS]
        assert replay(trace, _Hashing, isolate=False).verdict is Verdict.CONFORMS
        wrong = replay(trace, _HashingWrong, isolate=False)
        assert wrong.verdict is Verdict.DIVERGES and wrong.failure is not None
        failure = wrong.failure
        assert (failure.kind, failure.step, failure.op) == (FailureKind.DIVERGES, 5, "is_block_hashed")
        assert "returned False; the spec returned True" in wrong.failure.message
        assert "is_block_hashed(block_id=1)" in wrong.failure.story
        # The player's words are the entry's.
        steps = build_view(trace_to_page_data(trace))["steps"]
        assert steps[5]["call"] == "is_block_hashed(block_id=1)"
        assert steps[5]["words"] == "Ask whether block 1 holds a hash."
        assert (steps[1]["spec_result"], steps[5]["spec_result"]) == ("no hash", "yes, hashed")
    # Out of the block, the table is as it was: a trace of the operation no longer reads.
    assert "is_block_hashed" not in OPERATIONS
    with pytest.raises(Exception, match="is not a pool-level operation"):
        read_trace(path)


def test_an_operation_added_through_the_table_is_listed_by_kvspec_errors():
    with operation_added(IS_HASHED):
        contract = build_contract()
        text = render_text(contract)
    (oc,) = [oc for oc in contract.operations if oc.operation == "is_block_hashed"]
    assert [(r.mistake, r.error, r.order) for r in oc.rows] == [("bad id", "InvalidBlock", "1")]
    assert oc.rows[0].message == "is_block_hashed: block_id=8 is not a block of this pool (0..7)"
    assert oc.valid_call == "is_block_hashed(1)"
    assert "\nis_block_hashed(block_id)\n" in text
    assert "is_block_hashed" not in render_text(build_contract())


def test_a_wrong_implementation_of_the_added_operation_fails_in_the_lock_step_core():
    with operation_added(IS_HASHED), pytest.raises(ConformanceFailure) as caught:
        _drive(_HashingWrong)
    failure = caught.value.failure
    assert (failure.kind, failure.step, failure.op) == (FailureKind.DIVERGES, 5, "is_block_hashed")


def test_the_story_of_a_failure_in_the_added_operation_names_it():
    with operation_added(IS_HASHED):
        lock = _drive_until_failure(_HashingWrong)
        story = render_story(lock.trace("wrong"))
    assert "DIVERGES: diverges at step 5 of 5 (is_block_hashed)" in story
    assert "is_block_hashed(block_id=1)" in story and "impl -> False" in story


def _drive_until_failure(factory: type[_Hashing]) -> LockStep:
    lock = LockStep(factory, AdapterConfig("pool", 4), Observer())
    lock.check()
    with pytest.raises(ConformanceFailure):
        for op, args in STEPS:
            lock.call(op, *args)
            lock.check()
    return lock


def test_an_operation_is_added_once():
    with operation_added(IS_HASHED), pytest.raises(ValueError, match="already has"), operation_added(IS_HASHED):
        pass
    with pytest.raises(ValueError, match="already has 'touch'"), operation_added(OPERATIONS["touch"]):
        pass


def test_every_spec_operation_returns_one_shape():
    state = spec_ops.new_pool(4)
    for op in level_operations("pool"):
        args = {"num_blocks": 1, "block_ids": [], "block_hashes": [], "block_hash": H1, "block_id": 1}
        args["evict_first"] = False
        step = op.spec(state, *(args[p] for p in op.params))
        assert isinstance(step, Step), op.name
        # Nothing cached, nothing registered: only a reset publishes (vLLM's AllBlocksCleared, even when empty).
        expected = (AllBlocksCleared(),) if op.name == "reset_prefix_cache" else ()
        assert isinstance(step.state, PoolState) and step.events == expected, op.name


# --- the structure the table replaced does not come back ------------------------------------------


def _sources(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def test_no_module_indexes_the_operation_tables_by_position():
    pattern = re.compile(r"list\((OPERATIONS|OP_PARAMS|_NORMALIZE|_TABLE)\)\s*\[")
    offenders = [str(p) for p in _sources("conformance") if pattern.search(p.read_text())]
    assert offenders == []


def test_no_verdict_or_failure_kind_is_compared_as_a_string_outside_its_enum():
    names = "|".join(re.escape(v.value) for v in [*Verdict, *FailureKind])
    pattern = re.compile(rf"""(==|!=|\bin)\s*\(?["']({names})["']|["']({names})["']\s*(==|!=)""")
    offenders = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in _sources("conformance") + _sources("benchmarks")
        if p.name != "results.py"
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert offenders == []


def _function_lengths(path: Path) -> list[tuple[int, str]]:
    """Each function's length in lines, its docstring not counted (documenting every argument is wanted)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            first = node.body[0]
            is_docstring = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
            if is_docstring and isinstance(first.value.value, str):
                length -= first.end_lineno - first.lineno + 1
            out.append((length, f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"))
    return out


def test_every_function_of_the_harness_is_under_60_lines():
    long = sorted((n, where) for p in _sources("conformance") for n, where in _function_lengths(p) if n >= 60)
    assert long == []


def test_the_runner_parts_are_each_under_400_lines():
    sizes = {p.name: len(p.read_text().splitlines()) for p in _sources("conformance/runner")}
    assert {"run.py", "registry.py", "isolation.py", "campaign.py", "jobs.py", "minimize.py"} <= set(sizes)
    assert all(n < 400 for n in sizes.values()), sizes


# Arguments of each parameter, as a trace holds them, for putting every operation in words.
_SAMPLE_ARGS = {
    "num_blocks": 2, "block_ids": [3, 1], "block_hashes": [{"bytes": "01"}, {"bytes": "02"}],
    "block_hash": {"bytes": "01"}, "block_id": 3, "request": {"request": {"request_id": "r1"}},
    "max_cache_hit_length": None, "num_new_tokens": 4, "num_new_computed_tokens": 2, "new_computed_blocks": [1],
    "num_external_computed_tokens": 0, "delay_cache_blocks": False, "num_computed_tokens": 8, "request_id": "r1",
    "evict_first": True,
}  # fmt: skip


def test_every_operation_of_the_table_says_what_a_call_asks_in_its_own_words():
    said = {}
    for op in OPERATIONS.values():
        text = CallText(op.params, [_SAMPLE_ARGS[p] for p in op.params], lambda v: f"h{v['bytes'][-1]}",
                        lambda v: v["request"]["request_id"])  # fmt: skip
        said[op.name] = op.wording.asks(text)
        assert said[op.name].endswith(".") and said[op.name] != f"{op.name}.", op.name
    assert len(set(said.values())) == len(said)  # no two operations are told alike
    assert said["cache_blocks"] == (
        "Request r1's external load is done: its blocks full within its first 8 tokens are registered in the hash "
        "table."
    )
    assert said["cache_full_blocks"] == "Register full blocks 3, 1 in the hash table under h1, h2."
    assert said["free_blocks"].endswith("returns to the free queue, to be evicted before every other cached block.")
    assert said["allocate_slots"] == (
        "Allocate slots for 4 new tokens of request r1, after a hit of 2 tokens on block 1."
    )


def test_a_printed_call_leaves_out_a_quiet_tail_only_when_all_of_it_is_quiet():
    wording = OPERATIONS["allocate_slots"].wording
    assert wording.shown_args(["r", 1, 0, [], 0, False]) == 2
    assert wording.shown_args(["r", 1, 0, [], 0, True]) == 6
    assert wording.shown_args(["r", 1, 2, [1], 0, False]) == 6
    assert OPERATIONS["touch"].wording.shown_args([[1]]) == 1
    assert OPERATIONS["free_blocks"].wording.shown_args([[1], False]) == 1  # a free without evict_first
    assert OPERATIONS["free_blocks"].wording.shown_args([[1], True]) == 2
