"""A crash or hang is reported on a trace the campaign could have sent: shrinking keeps every step legal.

An implementation that trusts its caller (``validates_bad_input = False``) is
never sent a caller mistake. Cutting steps out of its crash trace can make a
later call a mistake (the free of a block the trace no longer takes); such a
shorter trace is not what the campaign sent, and blaming the implementation
for it would be kvspec's fault. Shrinking by replay keeps every step as it
was sent (kvspec.conformance.runner.minimize).
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Sequence

from kvspec.conformance.core.adapter import AdapterConfig
from kvspec.conformance.core.lockstep import run_spec
from kvspec.conformance.core.reactions import IGNORES
from kvspec.conformance.core.trace import Trace, TraceStep, read_trace
from kvspec.conformance.runner.isolation import Death, run_isolated
from kvspec.conformance.runner.minimize import shrink_by_replay, trace_from_death
from kvspec.conformance.runner.replaying import replay_example, spec_side, unsendable_step
from kvspec.conformance.runner.run import run_check
from kvspec.conformance.targets.builtin import ReferencePoolAdapter
from kvspec.spec.state import BlockId


class _TrustsItsCaller(ReferencePoolAdapter):
    validates_bad_input = False  # the harness sends it no caller mistake


class SegfaultOnFreeingBlockOne(_TrustsItsCaller):
    """Dies whenever block 1 is freed: legal only after block 1 was taken."""

    def free_blocks(self, block_ids: Sequence[BlockId]) -> None:
        if 1 in block_ids:
            ctypes.string_at(0)
        super().free_blocks(block_ids)


class HangOnTouchingBlockOne(_TrustsItsCaller):
    """Never returns from a touch of block 1: legal only while block 1 holds a hash or is held."""

    def touch(self, block_ids: Sequence[BlockId]) -> None:
        while 1 in block_ids:
            time.sleep(0.01)
        super().touch(block_ids)


def make_segfault(config: AdapterConfig) -> object:
    return SegfaultOnFreeingBlockOne(config)


def make_hang(config: AdapterConfig) -> object:
    return HangOnTouchingBlockOne(config)


def _every_step_legal(path: str) -> tuple[int, list[str]]:
    trace = read_trace(path)
    outcomes = run_spec(trace.config, [(s.op, s.args) for s in trace.steps])
    return len(trace.steps), [
        f"step {s.index} {s.op}{list(s.args)}: {o.error}" for s, (o, _) in zip(trace.steps, outcomes) if o.error
    ]


def test_a_segfault_is_reported_on_legal_steps_only(tmp_path) -> None:
    result = run_check(make_segfault, level="pool", enable_caching=True, max_examples=50, trace_dir=tmp_path)
    assert result.verdict == "crashed" and result.failure is not None and result.failure.trace_path
    steps, mistakes = _every_step_legal(result.failure.trace_path)
    assert mistakes == [] and steps >= 2  # block 1 taken, then freed: never a free of a block not held
    assert result.failure.op == "free_blocks"


def test_a_hang_is_reported_on_legal_steps_only(tmp_path) -> None:
    result = run_check(
        make_hang, level="pool", enable_caching=True, max_examples=50, step_timeout_s=1.0, trace_dir=tmp_path
    )
    assert result.verdict == "hung" and result.failure is not None and result.failure.trace_path
    steps, mistakes = _every_step_legal(result.failure.trace_path)
    assert mistakes == [] and steps >= 2
    assert result.failure.op == "touch"


class SegfaultTakingThreeAfterIgnoringDoubleFree(ReferencePoolAdapter):
    """Ignores a double free, freeing the blocks still held (declared), and dies taking three blocks."""

    def __init__(self, config: AdapterConfig) -> None:
        super().__init__(config)
        self.mistake_reactions = {"free_blocks: double free": IGNORES}

    def free_blocks(self, block_ids: Sequence[BlockId]) -> None:
        super().free_blocks([b for b in block_ids if self.blocks[b].ref_cnt > 0])

    def get_new_blocks(self, num_blocks: int) -> list[BlockId]:
        if num_blocks == 3:
            ctypes.string_at(0)
        return super().get_new_blocks(num_blocks)


def make_ignoring(config: AdapterConfig) -> object:
    return SegfaultTakingThreeAfterIgnoringDoubleFree(config)


def test_a_death_after_an_ignored_caller_mistake_keeps_the_mistake_and_its_good_part_s_state() -> None:
    # get_new_blocks(3) is legal only because the double free's good part freed block 2 too; the stream of the
    # dead process must say the step was that mistake, and the spec's side must be computed as a replay does.
    steps = (TraceStep(1, "get_new_blocks", (2,)), TraceStep(2, "free_blocks", ([1],)),
             TraceStep(3, "free_blocks", ([2, 1],), mistake="free_blocks: double free", without=([2],)),
             TraceStep(4, "get_new_blocks", (3,)))  # fmt: skip
    trace = Trace(AdapterConfig("pool", 4), steps, impl="x")
    death = run_isolated(lambda fd, hb: replay_example(trace, make_ignoring, "x", None, fd, hb), None, True)
    assert isinstance(death, Death) and not death.hung
    rebuilt = trace_from_death(death, "x", None)
    assert rebuilt is not None and [s.mistake for s in rebuilt.steps] == [None, None, "free_blocks: double free", None]
    assert rebuilt.steps[3].spec is not None and rebuilt.steps[3].spec.result == [2, 1, 3]
    assert unsendable_step(rebuilt) is None
    shrunk, finished = shrink_by_replay(rebuilt, make_ignoring, "x", None, 30)
    assert finished and shrunk.failure is not None and shrunk.failure.op == "get_new_blocks"
    # Every call legal when it was sent stays legal; the double free stays one whose good part the spec takes.
    assert [(s.op, s.mistake) for s in shrunk.steps if s.mistake] in ([], [("free_blocks", "free_blocks: double free")])
    assert all(o.error is None for s, (o, _) in zip(shrunk.steps, spec_side(shrunk)) if s.mistake is None)
