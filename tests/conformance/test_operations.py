"""The operations table is the one description of each operation, and the harness is built on it.

A throwaway operation added through the table alone is driven, traced,
normalised, replayed, covered and reported like the real ones; the structure
the table replaced (positional splits of parallel dicts, verdicts compared as
strings, one long runner) does not come back.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from kvspec.conformance.core.adapter import AdapterConfig, capabilities
from kvspec.conformance.core.coverage import expected_branches
from kvspec.conformance.core.lockstep import ConformanceFailure, LockStep, Observer
from kvspec.conformance.core.operations import OPERATIONS, Operation, as_id, level_operations, operation_added
from kvspec.conformance.core.report import render_story
from kvspec.conformance.core.results import FailureKind, Verdict
from kvspec.conformance.core.trace import read_trace, write_trace
from kvspec.conformance.core.wording import Wording
from kvspec.conformance.runner.run import replay
from kvspec.conformance.targets.builtin import ReferencePoolAdapter
from kvspec.spec import ops as spec_ops
from kvspec.spec.events import AllBlocksCleared
from kvspec.spec.state import BlockHash, PoolState, Snapshot
from kvspec.spec.step import Step

ROOT = Path(__file__).resolve().parents[2]


def _num_hashed(state: PoolState) -> Step[PoolState, int]:
    """The throwaway operation's spec: how many blocks hold a hash (a query: the state is unchanged)."""
    return Step(state, sum(h is not None for h in state.block_hash))


def _reached(args: object, before: Snapshot, after: Snapshot, result: object) -> list[str]:
    return ["get_num_hashed_blocks: some" if result else "get_num_hashed_blocks: none"]


NUM_HASHED = Operation(
    name="get_num_hashed_blocks",
    levels=("pool",),
    params=(),
    spec=_num_hashed,
    normalize=as_id,
    branches=("get_num_hashed_blocks: none", "get_num_hashed_blocks: some"),
    wording=Wording(lambda c: "Count the blocks that hold a hash.", lambda r: f"{r} hashed"),
    reached=_reached,
    is_optional=True,
)


class _Counting(ReferencePoolAdapter):
    def get_num_hashed_blocks(self) -> int:
        return sum(h is not None for h in self.snapshot().block_hash)


class _CountingWrong(_Counting):
    def get_num_hashed_blocks(self) -> int:
        return super().get_num_hashed_blocks() + 1  # counts the null block too


H1, H2 = BlockHash(b"\x01" * 32), BlockHash(b"\x02" * 32)
STEPS = [
    ("get_num_hashed_blocks", ()),
    ("get_new_blocks", (2,)),
    ("cache_full_blocks", ([1, 2], [H1, H2])),
    ("get_num_hashed_blocks", ()),
]


def _drive(factory: type[_Counting]) -> LockStep:
    lock = LockStep(factory, AdapterConfig("pool", 4), Observer())
    lock.check()
    for op, args in STEPS:
        lock.call(op, *args)
        lock.check()
    return lock


def test_an_operation_added_through_the_table_is_driven_traced_replayed_and_covered(tmp_path):
    with operation_added(NUM_HASHED):
        assert "get_num_hashed_blocks" in capabilities(_Counting(AdapterConfig("pool", 4)))
        assert {"get_num_hashed_blocks: none", "get_num_hashed_blocks: some"} <= set(
            expected_branches("pool", True, "vllm-v1")
        )
        lock = _drive(_Counting)
        assert [r.spec.result for r in lock.records if r.op == "get_num_hashed_blocks"] == [0, 2]
        assert lock.observer.coverage["get_num_hashed_blocks: none"] == 1
        assert lock.observer.coverage["get_num_hashed_blocks: some"] == 1
        path = write_trace(tmp_path / "t.trace.jsonl", lock.trace("counting"))
        trace = read_trace(path)
        assert [s.op for s in trace.steps] == [op for op, _ in STEPS]
        assert replay(trace, _Counting, isolate=False).verdict is Verdict.CONFORMS
        wrong = replay(trace, _CountingWrong, isolate=False)
        assert wrong.verdict is Verdict.DIVERGES and wrong.failure is not None
        assert (wrong.failure.kind, wrong.failure.step, wrong.failure.op) == (
            FailureKind.DIVERGES,
            1,
            "get_num_hashed_blocks",
        )
        assert "returned 1; the spec returned 0" in wrong.failure.message
        assert "get_num_hashed_blocks()" in wrong.failure.story
    # Out of the block, the table is as it was: a trace of the operation no longer reads.
    assert "get_num_hashed_blocks" not in OPERATIONS
    with pytest.raises(Exception, match="is not a pool-level operation"):
        read_trace(path)


def test_a_wrong_implementation_of_the_added_operation_fails_in_the_lock_step_core():
    with operation_added(NUM_HASHED), pytest.raises(ConformanceFailure) as caught:
        _drive(_CountingWrong)
    failure = caught.value.failure
    assert (failure.kind, failure.step, failure.op) == (FailureKind.DIVERGES, 1, "get_num_hashed_blocks")


def test_the_story_of_a_failure_in_the_added_operation_names_it():
    with operation_added(NUM_HASHED):
        lock = LockStep(_CountingWrong, AdapterConfig("pool", 4), Observer())
        lock.check()
        lock.call("get_num_hashed_blocks")
        with pytest.raises(ConformanceFailure):
            lock.check()
        story = render_story(lock.trace("wrong"))
    assert "DIVERGES: diverges at step 1 of 1 (get_num_hashed_blocks)" in story
    assert "get_num_hashed_blocks()" in story and "impl -> 1" in story


def test_an_operation_is_added_once():
    with operation_added(NUM_HASHED), pytest.raises(ValueError, match="already has"), operation_added(NUM_HASHED):
        pass
    with pytest.raises(ValueError, match="already has 'touch'"), operation_added(OPERATIONS["touch"]):
        pass


def test_every_spec_operation_returns_one_shape():
    state = spec_ops.new_pool(4)
    for op in level_operations("pool"):
        args = {"num_blocks": 1, "block_ids": [], "block_hashes": [], "block_hash": H1, "block_id": 1}
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
