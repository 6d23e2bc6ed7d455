"""The harness reports each kind of wrong implementation the way it promises.

Each case runs a real campaign (a child process, Hypothesis, the spec) against
an adapter from tests/conformance/adapters.py that is wrong in one way, and
checks the verdict, the failure's kind and step, the saved trace, and that
replaying the trace gives the same verdict.
"""

import subprocess
import sys

import pytest

from kvspec.conformance.core.trace import read_trace
from kvspec.conformance.runner.run import FactoryError, load_factory, replay, run_check
from kvspec.conformance.targets.builtin import make_reference, make_spec
from tests.conformance import adapters

# Small campaigns: every wrong adapter here is caught within a few dozen examples.
N = 150


def check(factory, tmp_path, **kw):
    kw.setdefault("max_examples", N)
    return run_check(factory, trace_dir=tmp_path, impl="under-test", **kw)


@pytest.fixture(scope="module")
def head_first(tmp_path_factory):
    return check(adapters.make_free_head_first, tmp_path_factory.mktemp("traces"), level="pool")


def test_head_first_free_diverges_with_a_short_replayable_trace(head_first):
    r = head_first
    assert r.verdict == "diverges" and r.exit_code == 1
    f = r.failure
    assert f.kind == "diverges" and f.op == "free_blocks"
    # Shrunk to the essence: allocate two blocks, free them.
    assert f.num_steps == 2, f.story
    trace = read_trace(f.trace_path)
    assert len(trace.steps) == f.num_steps and trace.verdict == "diverges"
    # The two freed blocks in front of the queue (the pool may have more), in the opposite order.
    spec_queue, impl_queue = trace.steps[-1].spec_snapshot.free_queue, trace.steps[-1].impl_snapshot.free_queue
    assert (spec_queue[:2], impl_queue[:2], spec_queue[2:]) == ((2, 1), (1, 2), impl_queue[2:])
    assert f"free_queue: spec {spec_queue} vs implementation {impl_queue}" in f.message
    again = replay(f.trace_path, adapters.make_free_head_first)
    assert again.verdict == "diverges"
    assert (again.failure.step, again.failure.op, again.failure.message) == (f.step, f.op, f.message)
    assert replay(f.trace_path, make_reference).verdict == "conforms"


def test_the_story_shows_steps_the_failing_step_and_both_states(head_first):
    f = head_first.failure
    lines = f.story.splitlines()
    assert lines[0] == "DIVERGES: diverges at step 2 of 2 (free_blocks)"
    assert "    1. get_new_blocks(num_blocks=2) -> [1, 2]" in lines
    assert ">   2. free_blocks(block_ids=[2, 1]) -> None" in lines
    queue = next(line for line in lines if line.lstrip().startswith("free queue (left first)"))
    assert queue.split()[-1] == "<<"  # the implementation's column, marked as differing
    assert "  2 1" in queue and "  1 2" in queue  # the spec's queue starts 2 1, the implementation's 1 2
    assert f"replay: kvspec replay {f.trace_path} --impl under-test" in lines


def test_a_block_both_held_and_free_is_named_by_its_invariant(tmp_path):
    r = check(adapters.make_taken_blocks_stay_queued, tmp_path, level="pool")
    assert r.verdict == "diverges"
    assert (r.failure.kind, r.failure.op, r.failure.num_steps) == ("invariant", "get_new_blocks", 1)
    assert r.failure.invariant == "inv_free_queue_has_zero_ref"
    assert "invariant inv_free_queue_has_zero_ref" in r.failure.story


def test_an_accepted_double_free_is_a_divergence_on_the_error_type(tmp_path):
    r = check(adapters.make_accepts_double_free, tmp_path, level="pool")
    assert r.verdict == "diverges" and r.failure.op == "free_blocks"
    assert "the spec raised DoubleFree" in r.failure.message


def test_a_rejected_call_that_changed_the_state_is_caught(tmp_path):
    r = check(adapters.make_takes_before_refusing, tmp_path, level="pool")
    assert r.verdict == "diverges" and r.failure.op == "get_new_blocks"
    assert "the caller mistake 'get_new_blocks: more than free' changed the state" in r.failure.message


def test_a_hit_past_the_len_minus_one_cap_is_named_hit_within_cap(tmp_path):
    r = check(adapters.make_hit_past_cap, tmp_path, level="manager", max_examples=300)
    assert r.verdict == "diverges"
    assert (r.failure.kind, r.failure.invariant, r.failure.op) == ("invariant", "hit_within_cap", "get_computed_blocks")


@pytest.mark.heavy
def test_another_hash_function_conforms_because_hashes_are_compared_as_names(tmp_path):
    r = check(adapters.make_other_hash_function, tmp_path, level="manager", max_examples=60)
    assert r.verdict == "conforms", r.failure and r.failure.story
    assert r.coverage["get_computed_blocks: hit"] > 0  # hits happened, under the other hash


def test_hashes_renamed_between_steps_diverge(tmp_path):
    r = check(adapters.make_drifting_hashes, tmp_path, level="pool")
    assert r.verdict == "diverges"
    assert "the same spec hash must keep the same name" in r.failure.message


def test_a_python_exception_is_a_shrunk_crash(tmp_path):
    r = check(adapters.make_crash_on_long_free, tmp_path, level="pool")
    assert r.verdict == "crashed" and r.exit_code == 1  # the implementation is wrong: exit 1, with its trace
    assert r.failure.kind == "crashed" and r.failure.op == "free_blocks"
    assert "KeyError" in r.failure.message and "adapters.py" in r.failure.message
    assert r.failure.num_steps == 2  # get_new_blocks(3), free_blocks of the three
    assert replay(r.failure.trace_path, adapters.make_crash_on_long_free).verdict == "crashed"


def test_a_hang_in_python_is_reported_at_the_step_time_limit(tmp_path):
    r = check(adapters.make_hang_on_reset, tmp_path, level="pool", step_timeout_s=0.3, minimize_s=3)
    assert r.verdict == "hung" and r.exit_code == 1
    assert r.failure.op == "reset_prefix_cache" and "0.3 s" in r.failure.message
    assert read_trace(r.failure.trace_path).steps[-1].impl.hung


def test_a_hang_in_c_that_ignores_the_alarm_is_killed_by_the_parent(tmp_path):
    r = check(adapters.make_hang_in_c, tmp_path, level="pool", step_timeout_s=0.3, minimize_s=0)
    assert r.verdict == "hung"
    assert r.failure.op == "reset_prefix_cache" and "killed" in r.failure.message


def test_a_factory_that_cannot_build_could_not_run(tmp_path):
    r = check(adapters.broken_factory, tmp_path, level="pool")
    assert r.verdict == "could-not-run" and r.exit_code == 2
    assert "RuntimeError: no device for num_gpu_blocks=8" in r.message


def test_an_adapter_missing_a_method_could_not_run(tmp_path):
    r = check(adapters.make_no_free_blocks, tmp_path, level="pool")
    assert r.verdict == "could-not-run"
    assert "lacks free_blocks()" in r.message


@pytest.mark.parametrize(
    "name, says",
    [
        ("nonsense", "neither a registered target"),
        ("kvspec.no_such_module:make", "module kvspec.no_such_module does not import"),
        ("tests.conformance.adapters:no_such_factory", "has no attribute 'no_such_factory'"),
        ("tests.conformance.adapters:NOT_CALLABLE", "is a int, not a callable factory"),
        ("tests.conformance.adapters:", "expected module:function"),
    ],
)
def test_load_factory_names_what_is_wrong(name, says):
    with pytest.raises(FactoryError, match=says):
        load_factory(name)


def test_load_factory_resolves_builtin_names_and_module_paths():
    assert load_factory("reference") is make_reference
    assert load_factory("kvspec.conformance.targets.builtin:make_spec") is make_spec


def test_a_registered_implementation_whose_module_is_missing_could_not_run(register_target, tmp_path):
    register_target(
        "later-pool",
        "later",
        "later_targets:LATER",
        "from kvspec.conformance import Target\n"
        "LATER = Target(name='later', summary='not written yet',\n"
        "               factory='kvspec.not_written_yet.adapter:make_adapter')\n",
    )
    r = run_check("later", level="pool", max_examples=5, trace_dir=tmp_path)
    assert r.verdict == "could-not-run" and r.impl == "later"
    assert "kvspec.not_written_yet.adapter does not import" in r.message


def test_bad_arguments_could_not_run(tmp_path):
    assert run_check(make_reference, profile="lru", trace_dir=tmp_path).message.startswith("unknown profile='lru'")
    assert "level must be" in run_check(make_reference, level="request", trace_dir=tmp_path).message
    assert "max_examples" in run_check(make_reference, max_examples=0, trace_dir=tmp_path).message
    assert "cover_rounds" in run_check(make_reference, cover_rounds=-1, trace_dir=tmp_path).message


def test_unreached_branches_get_more_rounds_on_the_next_seeds(tmp_path):
    # Five examples cannot reach the pool's 37 branches: every extra round runs, each a seed further.
    one = run_check(make_reference, level="pool", max_examples=5, cover_rounds=0, trace_dir=tmp_path)
    more = run_check(make_reference, level="pool", max_examples=5, cover_rounds=2, trace_dir=tmp_path)
    assert one.extra_rounds == 0 and one.unreached
    # A branch it can reach and did not: no "conforms", and the verdict names it and the way to reach it.
    assert one.verdict == "inconclusive" and one.unreached[0] in one.message and "--cover-rounds" in one.message
    assert more.extra_rounds == 2 and (more.verdict == "conforms") == (not more.unreached)
    assert more.examples_run > one.examples_run and more.steps_run > one.steps_run
    assert len(more.unreached) < len(one.unreached)
    # The rounds are the campaign's next seeds: seed 1's campaign is the first extra round.
    seed_1 = run_check(make_reference, level="pool", max_examples=5, seed=1, cover_rounds=0, trace_dir=tmp_path)
    assert set(more.unreached) <= set(one.unreached) & set(seed_1.unreached)


def test_extra_rounds_stop_at_the_time_budget(tmp_path):
    # One example a round never covers everything: only the budget ends the rounds.
    r = run_check(make_reference, level="pool", max_examples=1, cover_rounds=10**6, time_budget_s=2, trace_dir=tmp_path)
    assert r.verdict == "inconclusive" and "not reached" in r.message and "time budget" in r.message
    assert 0 < r.extra_rounds < 10**6 and r.seconds < 20


@pytest.mark.heavy
def test_a_campaign_that_reached_every_branch_runs_no_extra_round(tmp_path):
    r = run_check(
        make_reference, level="pool", enable_caching=False, max_examples=300, cover_rounds=3, trace_dir=tmp_path
    )
    assert r.verdict == "conforms" and not r.unreached and r.extra_rounds == 0


def test_the_same_seed_gives_the_same_campaign(tmp_path):
    a = check(adapters.make_drifting_hashes, tmp_path / "a", level="pool", seed=5)
    b = check(adapters.make_drifting_hashes, tmp_path / "b", level="pool", seed=5)
    assert (a.examples_run, a.steps_run) == (b.examples_run, b.steps_run)
    assert read_trace(a.failure.trace_path).steps == read_trace(b.failure.trace_path).steps


_LOADED_MODULES_SCRIPT = """
import sys
from hypothesis.internal.conjecture import providers
from kvspec.conformance.targets.builtin import make_reference
from kvspec.conformance.runner.run import run_check

def campaign():
    r = run_check(make_reference, level="manager", groups="full,sliding:4", max_examples=30, isolate=False,
                  trace_dir=sys.argv[1])
    return r.examples_run, r.steps_run, r.states_reached, r.coverage

before = campaign()
known = len(providers._get_local_constants())
sys.path.insert(0, sys.argv[1])
import lots_of_literals  # a first-party module: not a library's, not a test's
assert len(providers._get_local_constants()) > known, "Hypothesis did not pick its literals up"
print("same" if campaign() == before else "differs")
"""


@pytest.mark.heavy
def test_a_seed_draws_the_same_campaign_whatever_modules_the_process_has_loaded(tmp_path):
    # Hypothesis mixes literals of loaded first-party modules into its draws; a campaign draws without them.
    # In a process of its own: the suite's other Hypothesis tests keep the modules they see.
    (tmp_path / "lots_of_literals.py").write_text(
        "NUMBERS = (" + ", ".join(str(n) for n in range(3, 4000, 7)) + ")\nBYTES = (b'\\x01\\x02',)\n"
    )
    done = subprocess.run([sys.executable, "-c", _LOADED_MODULES_SCRIPT, str(tmp_path)], capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["same"]


def test_a_time_budget_stops_a_campaign_that_would_run_forever(tmp_path):
    r = run_check(make_reference, level="pool", max_examples=10**9, time_budget_s=1.5, trace_dir=tmp_path)
    assert (r.verdict == "conforms") == (not r.unreached) and "time budget" in r.message
    assert r.seconds < 20 and r.steps_run > 0


def test_the_campaign_reaches_deep_states_and_counts_them(tmp_path):
    r = run_check(make_reference, level="pool", max_examples=120, trace_dir=tmp_path, keep_deepest=True)
    assert r.verdict == "conforms"
    for event in (
        "get_new_blocks: evicted a cached block",
        "touch: hit a free block",
        "free_blocks: to the left end",
        "free_blocks: to the right end",
        "reset_prefix_cache: accepted, hashes dropped",
        "reset_prefix_cache: refused, blocks held",
        "free_blocks: DoubleFree",
    ):
        assert r.coverage[event] > 0, event
    assert r.states_reached > 50 and r.invariants_checked > r.steps_run
    # The deepest example is a trace like any other: it replays to conforms.
    assert replay(r.deepest_trace_path, make_reference).verdict == "conforms"


@pytest.mark.heavy
def test_the_request_level_reaches_preemption_chunking_and_capped_hits(tmp_path):
    # An eviction by the manager is the rarest of these: one seed's 50 examples can miss it.
    r = run_check(make_reference, level="manager", max_examples=100, trace_dir=tmp_path)
    assert r.verdict == "conforms"
    for event in (
        "free: request preempted",
        "readmitted after preemption",
        "allocate_slots: chunked prefill",
        "allocate_slots: decode",
        "allocate_slots: external tokens",
        "allocate_slots: too few free blocks",
        "get_computed_blocks: hit capped at len - 1",
        "allocate_slots: evicted a cached block",
    ):
        assert r.coverage[event] > 0, event


def test_make_conformance_test_gives_one_test_per_configuration_that_fails_with_the_story():
    import unittest

    from kvspec.conformance import make_conformance_test

    case = make_conformance_test(adapters.make_free_head_first, level="pool", enable_caching=True, max_examples=50)
    assert issubclass(case, unittest.TestCase)
    assert [n for n in dir(case) if n.startswith("test_")] == ["test_pool_caching_on"]
    result = unittest.TestResult()
    case("test_pool_caching_on").run(result)
    ((_, message),) = result.failures
    assert "DIVERGES: diverges at step 2 of 2 (free_blocks)" in message
    both = make_conformance_test(make_reference)
    assert sorted(n for n in dir(both) if n.startswith("test_")) == [
        "test_manager_caching_off",
        "test_manager_caching_on",
        "test_pool_caching_off",
        "test_pool_caching_on",
    ]
    with pytest.raises(ValueError, match="level must be"):
        make_conformance_test(make_reference, level="rack")


# --- what an adapter declares, and KV content ----------------------------------------------


def test_the_prefix_kv_source_names_each_prefix_once():
    from kvspec.conformance.core.lockstep import PrefixKVSource
    from kvspec.spec.hashing import MultiModalInput
    from kvspec.spec.manager import Request

    src = PrefixKVSource(2)
    base = Request("a", (1, 2, 3, 4))
    values = src(base, 0, 4)
    assert len(set(values)) == 4 and all(0 < v < 1 << 63 for v in values)
    assert src(Request("b", (1, 2, 3, 4)), 1, 3) == values[1:3]  # same prefix, same values, any request
    assert src(Request("c", (1, 2, 9, 4)), 0, 4)[:2] == values[:2]  # shared up to the first different token
    assert set(src(Request("c", (1, 2, 9, 4)), 2, 4)).isdisjoint(values)
    for other in (
        Request("d", (1, 2, 3, 4), cache_salt="t"),
        Request("e", (1, 2, 3, 4), lora_name="l"),
        Request("f", (1, 2, 3, 4), mm_inputs=(MultiModalInput("img", 0, 1),)),
    ):
        assert set(src(other, 0, 4)).isdisjoint(values), other
    # An image in block 1 changes block 1's values only.
    late = src(Request("g", (1, 2, 3, 4), mm_inputs=(MultiModalInput("img", 3, 1),)), 0, 4)
    assert late[:2] == values[:2] and set(late[2:]).isdisjoint(values)


def test_a_kv_write_into_the_wrong_slot_is_caught_by_reading_the_hit_back(tmp_path):
    from kvspec.mutants.gpu_memory import MUTANTS as GPU_MUTANTS

    mutant = next(m for m in GPU_MUTANTS if m.name == "gpu_write_wrong_slot")
    # Unshrunk: shrinking is checked elsewhere, and this mutant's took thirty seconds of torch on the CPU.
    r = check(mutant.factory, tmp_path, level="manager", max_examples=100, shrink=False)
    assert r.verdict == "diverges"
    f = r.failure
    assert (f.kind, f.invariant, f.op) == ("invariant", "hit_content_intact", "get_computed_blocks")
    assert "does not hold its prefix's KV" in r.failure.message
    assert replay(r.failure.trace_path, mutant.factory).verdict == "diverges"


@pytest.mark.heavy
def test_gpu_impl_conforms_with_its_content_checked_on_the_device_asked_for(tmp_path):
    r = check("gpu", tmp_path, level="manager", max_examples=100, device="cpu")
    assert r.verdict == "conforms", r.failure and r.failure.story
    assert r.device == "cpu" and r.coverage["get_computed_blocks: hit"] > 0
    bad = check("gpu", tmp_path, level="manager", max_examples=5, device="tpu:3")
    assert bad.verdict == "could-not-run" and "device='tpu:3'" in bad.message


@pytest.mark.heavy
def test_an_adapter_on_kvspecs_chain_has_its_hash_values_compared_exactly(tmp_path):
    from kvspec.mutants.hashing import MUTANTS as HASH_MUTANTS

    salted = next(m for m in HASH_MUTANTS if m.name == "cache_salt_on_every_block")
    r = check(salted.factory, tmp_path, level="manager", max_examples=100)
    assert r.verdict == "diverges" and r.failure.op == "allocate_slots"
    assert "but kvspec's chain (hash_fn='sha256_cbor', seed='kvspec') gives" in r.failure.message

    class Undeclared(salted.factory):  # the same bug, hash values compared as names only
        uses_kvspec_hash_chain = False

    assert check(Undeclared, tmp_path, level="manager", max_examples=60).verdict == "conforms"


def test_isolation_bugs_are_reached_by_resending_a_prompt_under_other_keys(tmp_path):
    from kvspec.mutants.hashing import MUTANTS as HASH_MUTANTS

    for name in ("cache_salt_ignored", "lora_ignored", "multimodal_ignored"):
        mutant = next(m for m in HASH_MUTANTS if m.name == name)

        class AsNames(mutant.factory):  # found by sharing, not by hash values
            uses_kvspec_hash_chain = False

        # Before the rule that re-sends a prompt under other keys, these took 200 to 2,000 examples.
        r = check(AsNames, tmp_path, level="manager", max_examples=300, shrink=False)
        assert r.verdict == "diverges", name


class _TrustsItsCaller(adapters.AcceptsDoubleFree):
    validates_bad_input = False
    rejected_mistakes = frozenset({"get_new_blocks: more than free"})


class _RejectsDoubleFreesOnly(adapters.AcceptsDoubleFree):
    validates_bad_input = False
    rejected_mistakes = frozenset({"free_blocks: double free"})


def test_mistakes_an_adapter_declares_it_does_not_reject_are_not_made_and_are_listed(tmp_path):
    r = check(_TrustsItsCaller, tmp_path, level="pool", max_examples=60, cover_rounds=10)
    assert r.verdict == "conforms", r.failure and r.failure.story
    assert "free_blocks: double free" in r.not_exercised and "get_new_blocks: more than free" not in r.not_exercised
    assert r.coverage["get_new_blocks: PoolExhausted"] > 0
    assert "free_blocks: DoubleFree" not in r.branches  # no mistake could raise it: not expected
    # A mistake it declares it rejects is made, and the lie is caught.
    lied = check(_RejectsDoubleFreesOnly, tmp_path, level="pool", max_examples=100)
    assert lied.verdict == "diverges" and "the spec raised DoubleFree" in lied.failure.message


def test_without_shrinking_the_first_failing_example_is_reported(tmp_path):
    r = check(adapters.make_free_head_first, tmp_path, level="pool", shrink=False)
    assert r.verdict == "diverges" and r.failure.num_steps >= 2
    assert replay(r.failure.trace_path, adapters.make_free_head_first).verdict == "diverges"


def test_a_request_level_failure_trace_with_decode_steps_reads_back_and_replays(tmp_path):
    from kvspec.mutants.gpu_memory import MUTANTS as GPU_MUTANTS

    mutant = next(m for m in GPU_MUTANTS if m.name == "gpu_write_shared_block")
    for seed in (0, 1):
        r = check(mutant.factory, tmp_path, level="manager", max_examples=100, seed=seed, shrink=False)
        assert r.verdict in ("diverges", "crashed"), r.message
        trace = read_trace(r.failure.trace_path)
        assert all(len(s.args) == 6 for s in trace.steps if s.op == "allocate_slots")
        assert replay(trace, mutant.factory).verdict == r.verdict


def test_vllm_release_names_resolve_without_fetching_anything():
    factory = load_factory("vllm@0.33.0")
    assert callable(factory) and factory.__name__ == "vllm@0.33.0"
    with pytest.raises(FactoryError, match=r"^implementation 'vllm@': "):
        load_factory("vllm@")
