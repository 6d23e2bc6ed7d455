"""Traces: written and read back unchanged, replayed to their recorded verdict, malformed files refused clearly."""

import json

import pytest

from kvspec.conformance.core.adapter import AdapterConfig
from kvspec.conformance.core.results import HARNESS_LIMIT, Failure, FailureKind, Verdict
from kvspec.conformance.core.trace import (
    MalformedTrace,
    Outcome,
    Trace,
    TraceStep,
    dumps_trace,
    parse_trace,
    read_trace,
    write_trace,
)
from kvspec.conformance.runner.run import replay
from kvspec.conformance.targets.builtin import make_reference, make_spec
from kvspec.conformance.tools.cli import main
from kvspec.spec.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvspec.spec.hashing import MultiModalInput
from kvspec.spec.manager import Request
from kvspec.spec.state import BlockHash, BlockId, Snapshot

SNAP = Snapshot(
    num_gpu_blocks=3,
    enable_caching=True,
    ref_cnt=(0, 1, 0),
    block_hash=(None, BlockHash(b"\x01\x02"), None),
    free_queue=(BlockId(2),),
    hash_to_blocks=((BlockHash(b"\x01\x02"), (BlockId(1),)),),
    block_tables=(("r1", (BlockId(1),)),),
)


def test_every_kind_of_value_survives_a_round_trip(tmp_path):
    request = Request("r1", (1, 2, 3), "lora-a", "tenant-1", (MultiModalInput("img-a", 1, 2),), num_preemptions=2)
    stored = BlockStored(
        (BlockHash(b"\x01\x02"),), BlockHash(b"\x09"), (1, 2), 2, "lora-a", (("lora-a", ("img-a", 1), "t"),), 1
    )
    events = (stored, BlockRemoved((BlockHash(b"\x03"),)), AllBlocksCleared())
    steps = (
        TraceStep(1, "get_computed_blocks", (request, 2), Outcome(result=[[], 0]), Outcome(result=[[], 0]), SNAP, SNAP),
        TraceStep(
            2,
            "allocate_slots",
            (request, 3, 0, [], 0, False),
            Outcome(result=[1], events=events),
            Outcome(result=[1], events=events[:1]),
            SNAP,
            SNAP,
        ),
        TraceStep(
            3,
            "free",
            ("r9",),
            Outcome(error="InvalidRequest", message="free: r9"),
            Outcome(crashed=True, message="KeyError: 'r9'"),
        ),
    )
    trace = Trace(
        AdapterConfig("manager", 3, True, "vllm-v1", 2, events=True),
        steps,
        "reference",
        Verdict.CRASHED,
        Failure(FailureKind.CRASHED, 3, "free", "KeyError: 'r9'"),
    )
    path = write_trace(tmp_path / "t.trace.jsonl", trace)
    assert read_trace(path) == trace


def test_a_step_written_before_a_parameter_existed_reads_with_its_default(tmp_path):
    """get_computed_blocks gained max_cache_hit_length; a trace that has the request alone reads as no cap."""
    step = TraceStep(1, "get_computed_blocks", (Request("r1", (1, 2, 3)), None))
    trace = Trace(AdapterConfig("manager", 3, True, "vllm-v1", 2), (step,))
    text = dumps_trace(trace).replace(", null]", "]")
    assert '"args": [{"request"' in text and "null]" not in text.splitlines()[1]
    path = tmp_path / "old.trace.jsonl"
    path.write_text(text)
    assert read_trace(path).steps[0].args == (Request("r1", (1, 2, 3)), None)


def test_bad_arguments_keep_their_types_in_a_trace():
    # 1.0, True, "1" and None are all mistakes of different kinds; JSON must not merge them with 1.
    args = ([1, 1.0, True, "1", None, -1],)
    trace = Trace(AdapterConfig("pool", 4), (TraceStep(1, "free_blocks", args),))
    back = parse_trace(dumps_trace(trace).splitlines())
    assert [type(v) for v in back.steps[0].args[0]] == [int, float, bool, str, type(None), int]


def _write(tmp_path, lines):
    path = tmp_path / "bad.trace.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


HEADER = json.dumps(
    {
        "kvspec_trace": 1,
        "level": "pool",
        "config": {
            "num_gpu_blocks": 4,
            "enable_caching": True,
            "profile": "vllm-v1",
            "block_size": 4,
            "hash_fn": "sha256_cbor",
            "seed": "kvspec",
            "device": None,
        },
        "impl": "reference",
    }
)


@pytest.mark.parametrize(
    "lines, where, says",
    [
        ([], "", "empty file"),
        (['{"step": 1}'], ":1:", "the first line must be the header"),
        ([HEADER.replace('"kvspec_trace": 1', '"kvspec_trace": 9')], ":1:", "trace format 9 is not supported"),
        ([HEADER.replace('"pool"', '"rack"', 1)], ":1:", "header level must be 'pool' or 'manager'"),
        ([HEADER, "{not json"], ":2:", "not JSON"),
        ([HEADER, '{"step": 1, "op": "allocate", "args": []}'], ":2:", "op='allocate' is not a pool-level operation"),
        (
            [HEADER, '{"step": 1, "op": "touch", "args": [[1], [2]]}'],
            ":2:",
            r"touch takes 1 arguments \('block_ids',\); got 2",
        ),
        ([HEADER, '{"step": 2, "op": "touch", "args": [[1]]}'], ":2:", "expected step 1, got 2"),
        ([HEADER, '{"step": 1, "op": "touch"}'], ":2:", "a step needs 'args'"),
        ([HEADER, '{"step": 1, "op": "get_cached_block", "args": [{"sha": "00"}]}'], ":2:", "unknown tagged value"),
        (
            [HEADER, '{"step": 1, "op": "touch", "args": [[1]], "spec_snapshot": {"ref_cnt": []}}'],
            ":2:",
            "a snapshot has the keys",
        ),
        (
            [HEADER, '{"verdict": "conforms"}', '{"step": 1, "op": "touch", "args": [[1]]}'],
            ":3:",
            "nothing may follow the verdict",
        ),
    ],
)
def test_a_malformed_trace_names_the_line_and_the_problem(tmp_path, lines, where, says):
    path = _write(tmp_path, lines)
    with pytest.raises(MalformedTrace, match=says) as e:
        read_trace(path)
    assert f"{path}{where}" in str(e.value)


def test_a_missing_trace_file_is_a_malformed_trace(tmp_path):
    with pytest.raises(MalformedTrace, match="no such file"):
        read_trace(tmp_path / "nope.trace.jsonl")


def test_kvspec_replay_on_a_malformed_trace_exits_2_without_a_traceback(tmp_path, capsys):
    path = _write(tmp_path, [HEADER, "{not json"])
    assert main(["replay", str(path), "--impl", "reference"]) == 2
    out = capsys.readouterr().err
    assert out.startswith(f"kvspec replay: cannot read the trace: {path}:2: not JSON")
    assert "Traceback" not in out


def _pool_trace(*steps):
    return Trace(AdapterConfig("pool", 4), tuple(TraceStep(i + 1, op, args) for i, (op, args) in enumerate(steps)))


def test_a_hand_written_trace_replays_on_the_spec_and_the_reference():
    # Seed 000's first moves on a 3-block pool: the block ids and queue order are fixed by the spec.
    trace = _pool_trace(
        ("get_new_blocks", (3,)),
        ("cache_full_blocks", ([1, 2], [b"h-a", b"h-b"])),
        ("free_blocks", ([3, 2, 1],)),
        ("get_new_blocks", (1,)),
        ("get_cached_block", (b"h-a",)),
    )
    for factory in (make_reference, make_spec):
        r = replay(trace, factory, isolate=False)
        assert r.verdict == "conforms" and r.steps_run == 5
    # The spec's own outcomes, step by step: block 3 (unhashed) was freed to the left end, so it is taken first.
    from kvspec.conformance.core.lockstep import run_spec

    outcomes = run_spec(trace.config, [(s.op, s.args) for s in trace.steps])
    assert [o.result for o, _ in outcomes] == [[1, 2, 3], None, None, [3], 1]
    assert outcomes[2][1].free_queue == (3, 2, 1)


def test_a_pool_of_only_the_null_block_refuses_every_block():
    trace = Trace(
        AdapterConfig("pool", 1),
        (
            TraceStep(1, "get_new_blocks", (0,)),
            TraceStep(2, "get_new_blocks", (1,)),
            TraceStep(3, "reset_prefix_cache", ()),
            TraceStep(4, "free_blocks", ([0],)),
        ),
    )
    r = replay(trace, make_reference, isolate=False)
    assert r.verdict == "conforms"
    assert r.coverage["get_new_blocks: PoolExhausted"] == 1 and r.coverage["free_blocks: InvalidBlock"] == 1


def test_a_failure_written_as_the_spec_s_when_it_was_kvspec_s_limit_reads_as_the_limit():
    """Traces written before `limit` was a failure kind recorded kvspec's limit as kind `spec`, told apart
    only by the message; read now, it is a limit (no bug in the spec), and a spec failure stays one."""
    limit = {"kind": "spec", "step": 1, "op": "get_new_blocks", "message": f"{HARNESS_LIMIT} 1 (get_new_blocks) x"}
    assert Failure.from_json(limit).kind is FailureKind.LIMIT
    assert Failure.from_json({**limit, "message": "a contract failed"}).kind is FailureKind.SPEC
    assert FailureKind.LIMIT.verdict is Verdict.COULD_NOT_RUN
    assert Failure.from_json(Failure.from_json(limit).to_json()).kind is FailureKind.LIMIT


def test_a_replay_builds_the_implementation_once_and_a_replica_anew(tmp_path):
    # The probe's adapter is the one the steps run on; a caller mistake the adapter accepts goes to a replica,
    # which must be a new adapter, not the probe's again.
    from kvspec.conformance.core.reactions import accepts
    from kvspec.conformance.runner.replaying import replay_example
    from tests.conformance.test_reactions import SkipsDoubleFree, _factory

    built: list[object] = []

    def counting(config):
        adapter = make_reference(config)
        built.append(adapter)
        return adapter

    trace = _pool_trace(("get_new_blocks", (2,)), ("free_blocks", ([2, 1],)), ("get_new_blocks", (1,)))
    assert replay_example(trace, counting, "reference", None, None, None).verdict == "conforms"
    assert len(built) == 1

    skipping = _factory(SkipsDoubleFree, {"free_blocks: double free": accepts("skips it")})

    def accepting(config):
        adapter = skipping(config)
        built.append(adapter)
        return adapter

    built.clear()
    mistaken = TraceStep(3, "free_blocks", ([1],), mistake="free_blocks: double free", without=([],))
    trace = Trace(trace.config, (*trace.steps[:2], mistaken))
    report = replay_example(trace, accepting, "reference", None, None, None)
    assert report.verdict == "conforms", report.failure
    assert len(built) >= 2 and len({id(a) for a in built}) == len(built)


def test_a_replay_that_cannot_build_is_refused_before_any_step_and_builds_nothing_more():
    from kvspec.conformance.runner.replaying import replay_example

    calls: list[AdapterConfig] = []

    def refusing(config):
        calls.append(config)
        raise ValueError("no pool today")

    report = replay_example(
        _pool_trace(
            ("get_new_blocks", (1,)),
        ),
        refusing,
        "x",
        None,
        None,
        None,
    )
    assert report.verdict == "could-not-run" and "no pool today" in report.message
    assert len(calls) == 1 and report.trace is None


def test_a_trace_whose_implementation_ignored_a_caller_mistake_replays_and_is_sendable(tmp_path):
    # After an ignored double free the state is the good part's (block 2 freed too): get_new_blocks(3) fits.
    from kvspec.conformance.core.lockstep import LockStep
    from kvspec.conformance.core.reactions import IGNORES
    from kvspec.conformance.runner.replaying import unsendable_step
    from tests.conformance.test_reactions import SkipsDoubleFree, _factory

    skips_double_free = _factory(SkipsDoubleFree, {"free_blocks: double free": IGNORES})
    lock = LockStep(skips_double_free, AdapterConfig("pool", 4))
    lock.check()
    for op, args, kw in [("get_new_blocks", (2,), {}), ("free_blocks", ([1],), {}),
                         ("free_blocks", ([2, 1],), {"mistake": "double free", "without": ([2],)}),
                         ("get_new_blocks", (3,), {})]:  # fmt: skip
        lock.call(op, *args, **kw)
        lock.check()
    path = write_trace(tmp_path / "ignored.trace.jsonl", lock.trace("under-test"))
    assert unsendable_step(read_trace(path)) is None
    assert replay(read_trace(path), skips_double_free, isolate=False).verdict == "conforms"
