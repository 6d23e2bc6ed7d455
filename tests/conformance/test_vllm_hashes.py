"""kvspec's block-hash chain against vLLM's.

The unmarked test needs no vLLM: it checks kvspec's chain against the vectors
vLLM 0.33.0's own hasher produced (``conformance/targets/vllm/golden_hashes.json``).
The ``vllm`` tests recompute vLLM's side (KVSPEC_VLLM=1), and measure every
release's fleet answer and whether its chain is kvspec's in fresh processes.
"""

from __future__ import annotations

import json
import logging
import platform
import sys
from pathlib import Path

import pytest

from kvspec.conformance.targets.vllm.hashes import (
    GOLDEN_CASES,
    compare_release,
    golden_vectors,
    kvspec_chain,
    measure_release,
    measure_releases,
)
from kvspec.conformance.targets.vllm.releases import RELEASES, facts_for, version_key


def test_kvspec_chain_equals_vllm_0_33_golden_vectors() -> None:
    cases = {c.name: c for c in GOLDEN_CASES}
    vectors = golden_vectors()
    assert {(v["case"], v["hash_fn"]) for v in vectors} == {(c, f) for c in cases for f in ("sha256", "sha256_cbor")}
    for v in vectors:
        ours = [h.hex() for h in kvspec_chain(cases[v["case"]], v["hash_fn"], v["pythonhashseed"])]
        assert ours == v["block_hashes"], (v["case"], v["hash_fn"], v["pythonhashseed"])


def test_without_lora_path_the_lora_chain_differs_from_vllm() -> None:
    # The LoRA path is part of vLLM 0.31+'s key: leaving it out must change the chain.
    lora = next(c for c in GOLDEN_CASES if c.name == "lora")
    vector = next(v for v in golden_vectors() if v["case"] == "lora" and v["hash_fn"] == "sha256")
    ours = [h.hex() for h in kvspec_chain(lora, "sha256", vector["pythonhashseed"], lora_path=False)]
    assert ours != vector["block_hashes"]


@pytest.mark.vllm
def test_newest_release_matches_every_vector_in_light_mode() -> None:
    logging.disable(logging.WARNING)
    report = compare_release("0.33.0")
    assert report.compatible, report.summary()
    assert {r.hash_fn for r in report.results} == {"sha256", "sha256_cbor"}
    assert len(report.results) == len(GOLDEN_CASES) * 2 * 3


@pytest.mark.vllm
def test_builtin_hash_agrees_under_the_same_pythonhashseed() -> None:
    # 0.10.1.1 is the last release with builtin hash(); without extra keys its
    # chain is kvspec's (NONE_HASH = hash(seed), chained on ints).
    plain = [c for c in GOLDEN_CASES if not (c.lora or c.mm_inputs or c.cache_salt)]
    report = compare_release("0.10.1.1", hash_fns=["builtin"], seeds=("0", "12345"), cases=plain)
    assert len(report.results) == 2 * len(plain)
    assert report.compatible, report.summary()


@pytest.mark.vllm
def test_an_older_scheme_is_reported_with_its_difference() -> None:
    logging.disable(logging.WARNING)
    report = compare_release("0.30.0", hash_fns=["sha256"], seeds=("0",))
    assert not report.compatible
    # plain chains agree; only requests with extra keys differ (untagged keys before 0.31)
    assert all(r.match for r in report.results if r.case in ("plain", "partial-last-block"))
    assert any("extra-key format" in d for d in report.differences), report.differences


# What a fleet needs, measured for every release in fresh interpreters (hashes.measure_releases: four
# processes, each loading every release; about 20 s with the wheels cached). The fleet answers recorded
# here are the measured ones. sha256 (the default from 0.10.2) is the same in every interpreter, so two
# processes differ only where NONE_HASH does: drawn from os.urandom with PYTHONHASHSEED unset before 0.29.
_SEED_SET_ONLY = "only with PYTHONHASHSEED set"


def _expected_fleet(version: str) -> set[str]:
    if facts_for(version).hash_algos[0] == "builtin":
        # The builtin hash of a block without extra keys hashes None, whose hash before Python 3.12 is its
        # address: two processes differ even under the same PYTHONHASHSEED. Unset, the string keys (an image's
        # identifier) are hashed with a per-process key on any interpreter, so never "yes" there.
        return {"no"} if sys.version_info < (3, 12) else {"no", _SEED_SET_ONLY}
    return {"yes"} if version_key(version) >= version_key("0.29.0") else {_SEED_SET_ONLY}


@pytest.mark.vllm
def test_every_release_s_hash_facts_are_what_fresh_processes_measure() -> None:
    measured = measure_releases(RELEASES)
    assert list(measured) == list(RELEASES)
    for version, m in measured.items():
        # the table the harness decides exact comparison from (releases.py) cannot go stale
        assert facts_for(version).hash_chain_differs == m.differences, (version, m)
        assert m.hash_fn == facts_for(version).hash_algos[0]
        assert m.fleet in _expected_fleet(version), (version, m.fleet)
    # asked again in the same process run, the answers are the ones kept, no process is started
    assert measure_release("0.33.0") is measured["0.33.0"]
    exact = [v for v, m in measured.items() if m.is_kvspec_chain]
    assert exact == ["0.31.0", "0.32.0", "0.33.0", "0.34.0"], exact


@pytest.mark.vllm
def test_kvspec_hashes_prints_the_fleet_answer_and_what_the_harness_compares(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from kvspec.conformance.tools.cli import main

    logging.disable(logging.WARNING)
    assert main(["hashes", "--version", "0.33.0"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith("  fleet-consistent hashes: yes (vllm==0.33.0, sha256, two processes with "), out
    assert out[2] == "  chain: kvspec's (sha256, PYTHONHASHSEED set and unset)", out
    assert "compared exactly at the pool and the request level" in out[3], out
    assert main(["hashes", "--version", "0.30.0", "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["fleet"] == {"answer": "yes", "hash_fn": "sha256", "python": platform.python_version(),
                             "kvspec_chain": False, "differences": ["untagged_extra_keys"]}  # fmt: skip


@pytest.mark.vllm
def test_the_oracle_reports_each_release_s_fleet_answer(tmp_path: Path) -> None:
    from kvspec.conformance.tools.oracle import run_oracle
    from kvspec.conformance.tools.oracle_matrix import format_matrix

    (row,) = run_oracle(["0.30.0"], levels=("pool",), caching="on", max_examples=10, trace_dir=str(tmp_path))
    assert row.fleet == "yes", row
    assert "chain: not kvspec's (sha256: its extra keys are untagged)" in row.fleet_detail, row.fleet_detail
    text = format_matrix([row], ["pool"], ["on"])
    assert text.splitlines()[0].split()[-1] == "fleet" and text.splitlines()[1].split()[-1] == "yes", text
    assert "0.30.0: fleet-consistent hashes: yes (vllm==0.30.0, sha256, " in text, text
