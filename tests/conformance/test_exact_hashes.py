"""Hash values as routers see them: compared exactly, with the hash function and seed the implementation uses.

No vLLM here (the real releases are in test_vllm_hashes.py, test_vllm_adapter.py
and test_vllm_manager.py, marked ``vllm``): the pool level runs on the miniature
vLLM release the plugin tests load (plugin_fixture/mini_vllm, light mode, no
download); the request level on the reference, hashing as a vLLM release hashes
by default; and how a release's four processes are read into its fleet answer
and its chain's differences, on processes written here.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from kvspec.conformance.core.adapter import AdapterConfig
from kvspec.conformance.core.lockstep import Factory
from kvspec.conformance.runner.run import run_check
from kvspec.conformance.targets.builtin import make_reference
from kvspec.conformance.targets.vllm import lightmode
from kvspec.conformance.targets.vllm.adapter import VllmRelease, make_pool_adapter, spec_hashing_for
from kvspec.conformance.targets.vllm.hashes import GOLDEN_CASES, ProcessChains, judge_release
from kvspec.conformance.targets.vllm.releases import RELEASES, facts_for, hash_chain_note
from kvspec.spec.hashing import DEFAULT_HASH_FN, DEFAULT_SEED, VLLM_NONE_HASH_SEED
from kvspec.spec.state import BlockHash
from tests.conformance.miniature import miniature_release
from tests.conformance.wide_keys import register_and_free, wide_group_id_factory

MINI = "0.0.1"  # the miniature release's version
H1 = BlockHash(b"h1")
FIXTURE = Path(__file__).parent / "plugin_fixture" / "mini_vllm"


@pytest.fixture(scope="module", autouse=True)
def mini_release(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The miniature release in a light-mode cache of its own, named by $KVSPEC_VLLM_CACHE."""
    yield from miniature_release(tmp_path_factory, MINI, FIXTURE)


# --- the pool level: the value handed over is the value kept ---------------------------------------


def _pool_factory(*, wide_group_id: bool, names_only: bool = False) -> Factory:
    """The miniature's BlockPool (a fresh copy) behind vLLM's pool adapter; ``wide_group_id``: its hash-table
    key carries the group id in 8 bytes where vLLM's carries 4 (a key format a router does not expect)."""
    light = lightmode.load_release(MINI, fresh=True)
    release = VllmRelease(MINI, "light", light.block_pool, light.kv_cache_utils, {}, light.module)
    if wide_group_id:
        return wide_group_id_factory(release, names_only=names_only)
    return lambda config: make_pool_adapter(release, config)


def test_the_pool_level_compares_the_hash_values_it_hands_over_exactly() -> None:
    assert register_and_free(_pool_factory(wide_group_id=False), H1) == ("conforms", None, "")
    verdict, step, message = register_and_free(_pool_factory(wide_group_id=True), H1)
    # the first registration: the key the pool made no longer carries the value it was handed
    assert (verdict, step) == ("diverges", 2), message
    assert message.startswith("block 1's hash is "), message
    assert "but the harness handed it " in message and "compared exactly" in message, message


def test_compared_as_names_the_same_key_format_passes() -> None:
    # One name per value whatever its bytes: the pool keys, finds and frees consistently, so names see nothing.
    assert register_and_free(_pool_factory(wide_group_id=True, names_only=True), H1) == ("conforms", None, "")


# --- the request level: the spec hashes with what the factory names ------------------------------


def _hashes_as_deployed(config: AdapterConfig) -> object:
    """The reference, hashing as a vLLM 0.33 deployment that sets nothing: sha256, NONE_HASH from vLLM's
    seed; whatever the harness asks for, as an implementation with its own defaults does."""
    return make_reference(replace(config, hash_fn="sha256", seed=VLLM_NONE_HASH_SEED))


def test_the_spec_hashes_with_the_hash_function_and_seed_the_factory_names(tmp_path: Path) -> None:
    def declared(config: AdapterConfig) -> object:
        return _hashes_as_deployed(config)

    declared.spec_hashing = lambda: ("sha256", VLLM_NONE_HASH_SEED)  # type: ignore[attr-defined]
    result = run_check(declared, level="manager", max_examples=100, isolate=False, trace_dir=tmp_path)
    assert result.verdict == "conforms", result.failure
    # Undeclared, the spec hashes with kvspec's defaults, and the first registered block's value differs.
    result = run_check(_hashes_as_deployed, level="manager", max_examples=100, isolate=False, trace_dir=tmp_path)
    assert result.verdict == "diverges" and result.failure is not None
    assert f"kvspec's chain (hash_fn={DEFAULT_HASH_FN!r}, seed={DEFAULT_SEED!r})" in result.failure.message


# --- the release table and what the harness makes of it --------------------------------------------


def test_the_spec_hashes_as_a_release_only_where_its_chain_is_kvspecs() -> None:
    for version in RELEASES:
        facts = facts_for(version)
        exact = not facts.hash_chain_differs
        assert (hash_chain_note(version) is None) is exact, version
        want = (facts.hash_algos[0], VLLM_NONE_HASH_SEED) if exact else (DEFAULT_HASH_FN, DEFAULT_SEED)
        assert spec_hashing_for(version) == want, version
    assert spec_hashing_for(None) == (DEFAULT_HASH_FN, DEFAULT_SEED)
    note = hash_chain_note("0.30.0")
    assert note == "vLLM 0.30.0's chain is not kvspec's (its extra keys are untagged)"


# --- a release's four processes ---------------------------------------------------------------------


PLAIN = {c.name for c in GOLDEN_CASES if not (c.lora or c.mm_inputs or c.cache_salt)}


def _process(
    seed: str | None, chains: str, *, matches: set[str] | None = None, none_hash: bool | None = True,
    tagged: bool = True,
) -> ProcessChains:  # fmt: skip
    """A process's output: every case's chain named by ``chains`` (equal strings: equal chains)."""
    names = [c.name for c in GOLDEN_CASES]
    matched = set(names) if matches is None else matches
    return ProcessChains("9.9.9", "sha256", seed, {n: [f"{chains}-{n}"] for n in names},
                         {n: n in matched for n in names}, none_hash, tagged)  # fmt: skip


def test_fleet_answers_compare_the_two_processes_of_each_setting() -> None:
    same = (_process("1", "x"), _process("1", "x"))
    other = (_process(None, "a"), _process(None, "b"))
    assert judge_release(same, (_process(None, "y"), _process(None, "y")), "3.x").fleet == "yes"
    assert judge_release(same, other, "3.x").fleet == "only with PYTHONHASHSEED set"
    assert judge_release(other, same, "3.x").fleet == "only with PYTHONHASHSEED unset"
    assert judge_release(other, other, "3.x").fleet == "no"


def test_chain_differences_name_the_first_one_found_under_the_seed_then_unset() -> None:
    def judged(seeded: ProcessChains, unset: ProcessChains) -> tuple[str, ...]:
        return judge_release((seeded, seeded), (unset, unset), "3.x").differences

    kvspec = _process(None, "k")
    assert judged(_process("1", "k"), kvspec) == ()
    assert judged(_process("1", "k", none_hash=False, matches=set()), kvspec) == ("none_hash",)
    assert judged(_process("1", "k", none_hash=None, matches=set()), kvspec) == ("chain",)
    assert judged(_process("1", "k", matches=PLAIN, tagged=False), kvspec) == ("untagged_extra_keys",)
    assert judged(_process("1", "k", matches=PLAIN), kvspec) == ("extra_keys",)
    random_unset = _process(None, "r", none_hash=False, matches=set())
    assert judged(_process("1", "k", matches=PLAIN, tagged=False), random_unset) == (
        "untagged_extra_keys",
        "unset_seed",
    )
    assert judged(_process("1", "k"), _process(None, "u", none_hash=None, matches=set())) == ("unset_seed",)


def test_the_oracle_matrix_has_a_fleet_column_and_the_whole_answer_in_its_notes() -> None:
    from kvspec.conformance.tools.oracle_matrix import ReleaseRow, format_matrix

    rows = [ReleaseRow("0.20.0", hashes="differs (8/32 vectors match)", fleet="only with PYTHONHASHSEED set",
                       fleet_detail="fleet-consistent hashes: only with PYTHONHASHSEED set (...)"),
            ReleaseRow("0.33.0", hashes="compatible (32 vectors)", fleet="yes",
                       fleet_detail="fleet-consistent hashes: yes (...)")]  # fmt: skip
    lines = format_matrix(rows, ["pool"], ["on"]).splitlines()
    assert lines[0].split() == ["version", "pool/on", "hashes", "fleet"], lines
    assert lines[1].rstrip().endswith("seed set") and lines[2].rstrip().endswith("yes"), lines
    assert "  0.20.0: fleet-consistent hashes: only with PYTHONHASHSEED set (...)" in lines, lines
    # a matrix of rows that measured no fleet answer (vLLM v0, the request level alone) has no such column
    assert "fleet" not in format_matrix([ReleaseRow("0.6.6")], ["pool"], ["on"]).splitlines()[0]
