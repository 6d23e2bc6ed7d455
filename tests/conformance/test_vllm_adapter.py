"""vLLM's own BlockPool (light mode, every release) behind the adapter (KVSPEC_VLLM=1).

Each release's API generation is detected from its code; these tests pin the
detection to the measured per-release facts, replay the scenarios that show
vLLM's known pool behaviours with explicit block ids, and run the harness
against the newest release.
"""

from __future__ import annotations

import logging
import shutil

import pytest

from kvspec.conformance.core.adapter import AdapterConfig, capabilities
from kvspec.conformance.core.reactions import NotExpressible, raises
from kvspec.conformance.runner.survey import survey_reactions
from kvspec.conformance.targets.vllm.adapter import VllmPoolAdapter, light_release, make_pool_adapter
from kvspec.conformance.targets.vllm.factories import factory_for, make_light_adapter
from kvspec.conformance.targets.vllm.measure import free_order_scenario
from kvspec.conformance.targets.vllm.probes import run_probes
from kvspec.conformance.targets.vllm.reactions import pool_reactions, reaction_change_points
from kvspec.conformance.targets.vllm.releases import RELEASES, facts_for, version_key
from kvspec.spec.state import BlockHash, BlockId
from tests.conformance.wide_keys import register_and_free, wide_group_id_factory

pytestmark = pytest.mark.vllm
logging.disable(logging.WARNING)

H1, H2 = BlockHash(b"\x00\x01"), BlockHash(b"\xff")


def _pool(version: str, n: int = 8, caching: bool = True) -> VllmPoolAdapter:
    return make_pool_adapter(
        light_release(version), AdapterConfig(level="pool", num_gpu_blocks=n, enable_caching=caching)
    )


@pytest.mark.parametrize("version", RELEASES)
def test_detected_api_generation_matches_the_release_facts(version: str) -> None:
    facts = facts_for(version)
    adapter = _pool(version)
    assert adapter.has_null_block == facts.has_null_block
    assert adapter.touch_shape == facts.touch_shape
    assert adapter.hash_key_kind == facts.hash_key_kind
    expected = {op for op, has in (("evict_blocks", facts.has_evict_blocks),
                                   ("is_block_writable", facts.has_is_block_writable)) if has}  # fmt: skip
    # get_num_free_blocks, get_usage and reset_prefix_cache exist in every v1 release
    assert capabilities(adapter) - {"get_num_free_blocks", "get_usage", "reset_prefix_cache"} == expected
    # the other facts, measured from the code and by scenario: tests/conformance/test_vllm_facts.py


@pytest.mark.parametrize("version", RELEASES)
def test_free_order_scenario_with_explicit_ids(version: str) -> None:
    # free [7,6] (no hash), then [3, 2h, 1h] tail first, then [5,4]: the order checks the eviction order
    facts = facts_for(version)
    pool = _pool(version)
    queue = free_order_scenario(pool)  # the scenario that measures free_order (kvspec.conformance.targets.vllm.measure)
    if facts.free_order == "all_right":
        assert queue == [7, 6, 3, 2, 1, 5, 4]
    else:
        assert queue == [5, 4, 3, 7, 6, 2, 1]
    assert pool.get_cached_block(H1) == 1 and pool.get_cached_block(H2) == 2
    snap = pool.snapshot()
    assert snap.block_hash[1] == H1 and snap.block_hash[2] == H2
    assert dict(snap.hash_to_blocks) == {H1: (1,), H2: (2,)}


@pytest.mark.parametrize("version", ["0.8.0", "0.9.1", "0.33.0"])
def test_over_allocation_reaches_vllm_and_its_value_error_changes_nothing(version: str) -> None:
    pool = _pool(version, n=4)
    before = pool.snapshot()
    with pytest.raises(ValueError, match=r"^Cannot get 4 free blocks from the pool"):
        pool.get_new_blocks(4)
    assert pool.snapshot() == before
    assert pool.mistake_reactions["get_new_blocks: more than free"] == raises("ValueError")


def test_release_without_null_block_shifts_ids_and_names_no_block_0() -> None:
    pool = _pool("0.8.0", n=4)
    assert list(pool.snapshot().free_queue) == [1, 2, 3]
    with pytest.raises(NotExpressible, match=r"^free_blocks takes KVCacheBlock objects, and block_id=0 names none"):
        pool.free_blocks([BlockId(0)])


@pytest.mark.parametrize("version", RELEASES)
def test_double_free_is_accepted_silently_in_every_release(version: str, tmp_path: object) -> None:
    # vLLM never checks: ref_cnt goes to -1 and the harness reports the divergence with a trace
    profile = "vllm-v1" if facts_for(version).matches_seed_order else "vllm-v1-tail"
    results = {r.name: r for r in run_probes(make_light_adapter(version), profile, str(tmp_path), f"vllm@{version}")}
    double = results["double free accepted silently"]
    assert (double.verdict, double.step, double.op) == ("diverges", 3, "free_blocks")
    assert double.trace_path is not None
    assert results["hash left behind by eviction"].verdict == "conforms"
    assert results["reset accepted while blocks are held"].verdict == "conforms"
    usage = results["usage counts the null block"].verdict
    assert usage == ("conforms" if not facts_for(version).usage_counts_null or not facts_for(version).has_null_block
                     else "diverges")  # fmt: skip


def test_factory_names() -> None:
    assert factory_for("vllm@0.24.0").__name__ == "vllm@0.24.0"
    with pytest.raises(ValueError, match=r"^impl='vllm@' is not"):
        factory_for("vllm@")


def _profile(version: str, caching: bool) -> str:
    facts = facts_for(version)
    end = facts.free_end_without_caching if not caching else ("left" if facts.matches_seed_order else "right")
    return "vllm-v1" if end == "left" else "vllm-v1-tail"


# Every release where a declared reaction changes (releases.py), and the newest.
REACTION_CHANGES = sorted({*reaction_change_points(), RELEASES[-1]}, key=version_key)


@pytest.mark.parametrize("version", REACTION_CHANGES)
@pytest.mark.parametrize("caching", [True, False])
def test_harness_conforms_under_the_release_profile_with_every_declared_reaction(version: str, caching: bool) -> None:
    # Every caller mistake with a declared reaction is sent to vLLM, and the reaction checked.
    from kvspec.conformance.runner.run import run_check

    result = run_check(make_light_adapter(version), level="pool", enable_caching=caching,
                       profile=_profile(version, caching), max_examples=100)  # fmt: skip
    assert result.verdict == "conforms", result.failure
    sent = {m for m, r in pool_reactions(version).items() if r.kind != "not expressible"}
    assert set(result.mistakes_checked) <= sent
    assert len(result.mistakes_checked) >= len(sent) // 2, (sorted(sent), result.mistakes_checked)


# Mistakes a survey sends although nothing is declared for them (it sends every mistake): from
# 0.24, "already cached" is refused or taken as a promotion depending on the block's place.
UNDECLARED = {v: ("cache_full_blocks: already cached",) for v in REACTION_CHANGES if version_key(v) >= (0, 24)}


@pytest.mark.parametrize("version", REACTION_CHANGES)
def test_the_survey_sees_the_declared_reactions(version: str) -> None:
    # The declared facts are what a survey measures (reactions.py: accepting is also changing nothing).
    declared = pool_reactions(version)
    for caching in (True, False):
        seen = survey_reactions(make_light_adapter(version), "pool", caching, max_examples=60,
                                profile=_profile(version, caching))  # fmt: skip
        for mistake, reactions in seen.items():
            kinds = {r.split(":")[0].split(" (")[0] for r in reactions}
            assert mistake in declared or mistake in UNDECLARED.get(version, ()), (mistake, reactions)
            if mistake not in declared:
                continue
            expected = declared[mistake].kind
            allowed = {"accepts", "ignores"} if expected == "accepts" else {expected}
            if expected == "raises":
                kinds = {k.split(" ")[0] for k in kinds}
            assert kinds <= allowed, (mistake, reactions, declared[mistake])


# Hash values at the pool level: the harness hands them over and every release must keep them exactly,
# not only which blocks share one (tests/conformance/wide_keys.py).
@pytest.mark.parametrize("names_only", [False, True])
def test_a_pool_that_changes_the_value_it_was_handed_diverges_where_values_are_compared(names_only: bool) -> None:
    release = light_release("0.33.0", fresh=True)  # its own module globals: the patch reaches no other test
    verdict, step, message = register_and_free(wide_group_id_factory(release, names_only=names_only), H1)
    if names_only:
        assert verdict == "conforms", message
        return
    assert (verdict, step) == ("diverges", 2), message  # at cache_full_blocks
    # H1 with 4 more zero bytes: the adapter takes vLLM's 4 bytes of group id off the key
    assert message.startswith("block 1's hash is 00010000, but the harness handed it 0001 "), message


def test_the_spec_hashes_as_the_release_where_its_chain_is_kvspecs() -> None:
    assert factory_for("vllm@0.33.0").spec_hashing() == ("sha256", "vllm-none-hash")  # type: ignore[attr-defined]
    assert factory_for("vllm@0.30.0").spec_hashing() == ("sha256_cbor", "kvspec")  # type: ignore[attr-defined]
    # every pool adapter compares hash values exactly: at the pool level they are the harness's own
    assert _pool("0.8.0").uses_kvspec_hash_chain and _pool("0.33.0").uses_kvspec_hash_chain


def test_a_release_the_table_does_not_declare_is_loaded_and_checked(tmp_path, monkeypatch, capsys) -> None:
    # The newest release's files under a number no table has: what a release newer than kvspec is.
    import shutil

    from kvspec.conformance.targets.vllm.lightmode import fetch_release
    from kvspec.conformance.tools.cli import main

    shutil.copytree(fetch_release(RELEASES[-1]), tmp_path / "cache" / "99.0.0")
    monkeypatch.setenv("KVSPEC_VLLM_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    assert factory_for("vllm@99.0.0").min_num_gpu_blocks == 2  # its null block is not known before it loads
    code = main(["check", "--impl", "vllm@99.0.0", "--level", "pool", "--max-examples", "30"])
    out = capsys.readouterr().out
    assert code == 0 and "result: 2 conforms" in out, out


@pytest.mark.parametrize("version", [v for v in RELEASES if facts_for(v).blocks_know_their_pool][-2:])
def test_one_free_of_blocks_of_two_pools_is_each_pool_freeing_its_own(version: str) -> None:
    # vLLM's free_blocks hands a block another pool made to that pool (0.34.0's scheduler frees a host
    # tier's blocks and the device pool's in one deferred call). Each pool then frees exactly its own
    # blocks, in the order given, as if they had been freed alone: so kvspec's model of one pool, whose
    # free is checked in every campaign, is the model of each pool such a call reaches.
    from kvspec.conformance.targets.builtin import make_reference

    config = AdapterConfig(level="pool", num_gpu_blocks=8, enable_caching=True)
    device, host = _pool(version), _pool(version)
    alone = [make_reference(config), make_reference(config)]  # the same steps, each pool freed alone
    for pool in (device, host, *alone):
        assert pool.get_new_blocks(5) == [1, 2, 3, 4, 5]
        pool.cache_full_blocks([BlockId(1), BlockId(2)], [H1, H2])
    mine, theirs = [BlockId(5), BlockId(4), BlockId(1)], [BlockId(3), BlockId(2)]
    mixed = [device._block(mine[0], "free_blocks"), host._block(theirs[0], "free_blocks"),
             device._block(mine[1], "free_blocks"), host._block(theirs[1], "free_blocks"),
             device._block(mine[2], "free_blocks")]  # fmt: skip
    device.pool.free_blocks(mixed)
    alone[0].free_blocks(mine)
    alone[1].free_blocks(theirs)
    assert device.snapshot() == alone[0].snapshot()
    assert host.snapshot() == alone[1].snapshot()
    assert list(device.snapshot().free_queue) == [5, 4, 6, 7, 1]  # hashless 5, 4 in front, hashed 1 last


def test_a_source_tree_checks_exactly_like_the_release_it_was_made_from(tmp_path) -> None:
    # A pull request's checkout is a folder holding vllm/: here the newest release's files, copied.
    import shutil

    from kvspec.conformance.runner.run import run_check
    from kvspec.conformance.targets.vllm.lightmode import fetch_release

    version = RELEASES[-1]
    tree = tmp_path / "checkout"
    shutil.copytree(fetch_release(version) / "vllm", tree / "vllm")
    from_tree = factory_for(f"vllm@{tree}")
    config = AdapterConfig(level="pool", num_gpu_blocks=8, enable_caching=True)
    built, released = from_tree(config), _pool(version)
    assert built.release.label == f"vllm=={version}.dev0+tree (tree {tree})"
    for fact in ("has_null_block", "touch_shape", "hash_key_kind"):
        assert getattr(built, fact) == getattr(released, fact), fact
    assert built.mistake_reactions == released.mistake_reactions
    for caching in (True, False):
        runs = [run_check(factory, level="pool", enable_caching=caching, max_examples=30, seed=7)
                for factory in (from_tree, make_light_adapter(version))]  # fmt: skip
        assert [r.verdict for r in runs] == ["conforms", "conforms"], [r.failure for r in runs]
        # The same examples, the same branches. (The spec hashes the tree's blocks with kvspec's defaults, its
        # chain not declared, where it hashes the release's as the release does: hashes are names here.)
        assert (runs[0].steps_run, runs[0].coverage) == (runs[1].steps_run, runs[1].coverage)


def test_a_fork_of_a_release_under_its_own_name_importing_torch_checks_like_the_release(tmp_path) -> None:
    # A fork as forks ship: the package renamed (its imports with it), torch imported at module level.
    import re

    from kvspec.conformance.runner.run import run_check
    from kvspec.conformance.targets.vllm.lightmode import fetch_release

    version = RELEASES[-1]
    fork = tmp_path / "fork"
    shutil.copytree(fetch_release(version) / "vllm", fork / "myfork")
    for path in (fork / "myfork").rglob("*.py"):
        path.write_text(re.sub(r"\b(from|import) vllm\b", r"\1 myfork", path.read_text()))
    pool = fork / "myfork" / "v1" / "core" / "block_pool.py"
    pool.write_text("import torch\nimport triton\n_DTYPE = torch.bfloat16\n" + pool.read_text())
    from_fork = factory_for(f"vllm@{fork}")
    built, released = from_fork(AdapterConfig(level="pool", num_gpu_blocks=8)), _pool(version)
    assert built.mistake_reactions == released.mistake_reactions
    for caching in (True, False):
        runs = [run_check(factory, level="pool", enable_caching=caching, max_examples=30, seed=7)
                for factory in (from_fork, make_light_adapter(version))]  # fmt: skip
        assert [r.verdict for r in runs] == ["conforms", "conforms"], [r.failure for r in runs]
        assert (runs[0].steps_run, runs[0].coverage) == (runs[1].steps_run, runs[1].coverage)


def test_evict_blocks_gets_each_class_of_bad_id_and_a_copy_without_vllms_bound_check_is_killed(tmp_path) -> None:
    # evict_blocks takes plain ints: the id at the pool's end, -1 and the null block are sent as they are.
    from kvspec.conformance.runner.run import run_check
    from kvspec.conformance.targets.vllm.lightmode import fetch_release

    released = run_check(make_light_adapter("0.34.0"), level="pool", max_examples=100, trace_dir=tmp_path)
    assert released.verdict == "conforms", released.failure
    for mistake in ("bad id", "id past the pool", "negative id"):
        assert released.mistakes_checked[f"evict_blocks: {mistake}"] > 0, released.mistakes_checked
    # 0.34.0's own pool without its bound check: an id past the end raises IndexError, not its AssertionError.
    tree = tmp_path / "mutant"
    shutil.copytree(fetch_release("0.34.0") / "vllm", tree / "vllm")
    pool = tree / "vllm" / "v1" / "core" / "block_pool.py"
    text = pool.read_text()
    check = text[text.index("            assert block_id < len(self.blocks), (") :]
    check = check[: check.index("            )\n") + len("            )\n")]
    pool.write_text(text.replace(check, ""))
    mutant = run_check(factory_for(f"vllm@{tree}"), level="pool", max_examples=100, trace_dir=tmp_path)
    assert mutant.verdict == "diverges" and mutant.failure is not None
    assert mutant.failure.op == "evict_blocks", mutant.failure.story
    assert "'evict_blocks: id past the pool': it raised IndexError" in mutant.failure.message, mutant.failure.story


def test_a_folder_that_is_not_a_source_tree_is_refused_in_one_line(tmp_path, capsys) -> None:
    from kvspec.conformance.tools.cli import main

    assert main(["check", "--impl", f"vllm@{tmp_path}", "--level", "pool"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"kvspec check: implementation 'vllm@{tmp_path}': {tmp_path} is not a vLLM source tree: "
                   "it has no vllm/v1/core/block_pool.py"]  # fmt: skip


def test_0_34_draws_evict_first_and_a_copy_that_sends_those_blocks_to_the_back_is_killed(tmp_path) -> None:
    from kvspec.conformance.runner.run import run_check
    from kvspec.conformance.targets.vllm.lightmode import fetch_release

    released = run_check(make_light_adapter("0.34.0"), level="pool", max_examples=100, trace_dir=tmp_path)
    assert released.verdict == "conforms", released.failure
    assert released.coverage["free_blocks: cached block freed to be evicted first"] > 0
    # 0.34.0's own pool with one change: a freed cached block goes to the back even when asked to go first.
    tree = tmp_path / "mutant"
    shutil.copytree(fetch_release("0.34.0") / "vllm", tree / "vllm")
    pool = tree / "vllm" / "v1" / "core" / "block_pool.py"
    text = pool.read_text()
    assert text.count(" or evict_first:") == 1
    pool.write_text(text.replace(" or evict_first:", ":"))
    mutant = run_check(factory_for(f"vllm@{tree}"), level="pool", max_examples=100, trace_dir=tmp_path)
    assert mutant.verdict == "diverges" and mutant.failure is not None
    # The step that fails is a free sent evict_first, and what differs is the free queue. (How short the story is
    # depends on where shrinking stops: three steps suffice, a shrunk campaign has stopped at six.)
    failing = next(line for line in mutant.failure.story.splitlines() if line.lstrip().startswith(">"))
    assert mutant.failure.op == "free_blocks" and "evict_first=True" in failing, mutant.failure.story
    assert "free_queue: spec" in mutant.failure.message and mutant.failure.num_steps <= 8, mutant.failure.story
