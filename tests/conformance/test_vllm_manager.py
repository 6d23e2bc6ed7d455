"""vLLM's KVCacheManager (installed, in its own environment) at the request level (KVSPEC_VLLM=1).

The request level needs vLLM installed; each release runs in the environment
the oracle creates for it (``ensure_venv``), through the harness's own
lock-step, so every comparison is the harness's, not this file's. One
subprocess per release runs seed 000's requests three ways: caching on,
caching off, and with the last request under a cache_salt (where the
release's Request takes one); then the oracle's request-level probe (a
request freed twice), whose trace is replayed to the same verdict.

The verdicts asserted are the ones measured on each release; where a release
diverges, the divergence is vLLM's own behaviour (named below with its step),
not the adapter's. What the adapter declares not applicable (a feature the
release lacks, or drives another way) is asserted too, so a declaration
cannot silently appear or vanish.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvspec.conformance.targets.vllm import venvs
from kvspec.conformance.targets.vllm.releases import facts_for, version_key
from kvspec.conformance.targets.vllm.venvs import WORKER_ENV, ensure_venv

pytestmark = pytest.mark.vllm

# Seed 000's requests at the request level: A (10 tokens) runs, B shares A's
# first two blocks, A decodes one token, both finish, C (8 tokens) hits only
# one block (len - 1 cap). Steps, counted as the lock-step counts them:
# 1-2 admit A, 3-4 admit B, 5 decode A, 6 free A, 7 free B, 8-9 admit C.
_SCRIPT = r"""
import json, logging, sys, tempfile
logging.disable(logging.WARNING)
from kvspec.conformance.core.adapter import AdapterConfig
from kvspec.conformance.core.lockstep import ConformanceFailure, LockStep
from kvspec.conformance.runner.run import replay
from kvspec.conformance.targets.vllm.factories import make_installed_adapter
from kvspec.conformance.targets.vllm.probes import run_probes
from kvspec.spec.manager import Request

A = Request("A", tuple(range(10)))
B = Request("B", tuple(range(8)) + (99, 98))


def scenario(profile, caching, salt, events=False):
    config = AdapterConfig(level="manager", num_gpu_blocks=7, block_size=4, profile=profile, enable_caching=caching,
                           events=events)
    lock = LockStep(make_installed_adapter, config)
    adapter = lock.adapter
    out = {"steps": [], "generation": [adapter.constructor, adapter.blocks, adapter.hashes],
            "not_applicable": sorted(adapter.not_applicable), "exact": lock.uses_kvspec_hash_chain,
            "provides": sorted(m for m in ("take_events", "prefix_cache_stats", "evict_blocks", "reset_prefix_cache")
                               if callable(getattr(adapter, m, None))),
            "hit_cap": lock.takes("max_cache_hit_length")}
    if salt is not None and "cache_salt" in adapter.not_applicable:
        out["verdict"] = "not applicable"
        return out

    def step(op, *args):
        spec = lock.call(op, *args)
        lock.check()
        out["steps"].append([op, spec.result])
        return spec.result

    try:
        lock.check()
        for r in (A, B):
            blocks, n = step("get_computed_blocks", r)
            step("allocate_slots", r, len(r.token_ids) - n, n, blocks, 0)
        step("allocate_slots", Request("A", A.token_ids + (7,)), 1, 0, [], 0)
        step("free", "A")
        step("free", "B")
        if salt is None:
            # vLLM's manager alone, outside the lock-step (a lookup changes no block): where the
            # adapter declares the len-1 cap its scheduler's, the manager gives the whole hit.
            raw = adapter.manager.get_computed_blocks(adapter._vllm_request(Request("C0", tuple(range(8)))))
            out["manager_hit_tokens"] = raw[1]
        C = Request("C", tuple(range(8)), cache_salt=salt)
        blocks, n = step("get_computed_blocks", C)
        step("allocate_slots", C, 8 - n, n, blocks, 0)
        out["queue"] = list(lock.impl_snapshot.free_queue)
        out["verdict"] = "conforms"
    except ConformanceFailure as f:
        e = f.failure
        out.update(verdict=e.kind.value, step=e.step, op=e.op, message=e.message)
    return out


profile = sys.argv[1]
out = {"on": scenario(profile, True, None), "off": scenario(profile, False, None),
       "salt": scenario(profile, True, "tenant-1"), "events": scenario(profile, True, None, events=True)}
with tempfile.TemporaryDirectory() as tmp:
    out["probes"] = {}
    for probe in run_probes(make_installed_adapter, profile, tmp, "vllm", num_gpu_blocks=8, level="manager"):
        got = {"verdict": probe.verdict, "step": probe.step, "op": probe.op, "message": probe.message}
        if probe.trace_path is not None:
            again = replay(probe.trace_path, make_installed_adapter, impl="vllm", isolate=False)
            got["replayed"] = [again.verdict, again.failure.step if again.failure else None]
        out["probes"][probe.name] = got
print(json.dumps(out))
"""

_CONFORMS: dict[str, Any] = {"verdict": "conforms"}

# With caching off 0.8.x frees a request's blocks head first (the reversal
# sits under `if self.enable_caching`): A's blocks 1, 2, 3 join the queue as
# 1, 2, 3 where the spec frees tail first (3, 2, 1).
_HEAD_FIRST_WITHOUT_CACHING: dict[str, Any] = {
    "verdict": "diverges",
    "step": 6,
    "op": "free",
    "message": "spec (3, 2, 1) vs implementation (1, 2, 3)",
}
# 0.8.x's Request has no cache_salt: declared, so no salted request is sent.
_NOT_APPLICABLE: dict[str, Any] = {"verdict": "not applicable"}
# With the pool's events and hit statistics checked (config.events): up to 0.24 (of the releases measured)
# the manager counts a request in get_computed_blocks, at the lookup; vLLM 0.33 and the spec count it at
# admission (the scheduler's record_prefix_cache_stats after a successful allocate_slots), so a lookup
# whose allocation is refused and retried is counted once. A's lookup is step 1.
_STATS_AT_LOOKUP: dict[str, Any] = {
    "verdict": "diverges",
    "step": 1,
    "op": "get_computed_blocks",
    "message": "the hit statistics differ from the spec's: local.requests: spec 0 vs implementation 1",
}
_PRE_ALLOCATION = "allocate_slots: pre-allocation"
_SCHEDULER_CAP = "get_computed_blocks: len-1 cap in the manager"
# Every release before 0.31: its chain is not kvspec's (releases.py, measured), hash values compared as names.
_NAMES = "exact hash values"
# Before 0.34 a Request carries no prefix_cache_hit_limit: no request with a hit limit is sent.
_HIT_LIMIT = "prefix cache hit limit"

# Per release: whether a block filled in decode after an image is keyed by it
# (the oracle's probe; fixed in 0.19), the API generation the adapter detected
# (constructor, what get_computed_blocks returns, where hashes come from), what
# it declares not applicable, then the verdict per scenario, as measured.
EXPECTED: dict[str, dict[str, Any]] = {
    # Built from the pool's sizes with num_preallocate_tokens=0, no null block
    # (ids shifted by one), the len-1 cap applied as its scheduler applies it.
    "0.8.0": {
        "image_end_keyed": True,
        "generation": ["sizes", "list", "manager"],
        "not_applicable": [_PRE_ALLOCATION, "cache_salt", _NAMES, _SCHEDULER_CAP, _HIT_LIMIT],
        "on": _CONFORMS,
        "off": _HEAD_FIRST_WITHOUT_CACHING,
        "salt": _NOT_APPLICABLE,
        "events": _STATS_AT_LOOKUP,
        "events_provides": ["prefix_cache_stats", "reset_prefix_cache"],
    },
    "0.8.4": {
        "image_end_keyed": True,
        "generation": ["kv_cache_config", "list", "manager"],
        "not_applicable": [_PRE_ALLOCATION, "cache_salt", _NAMES, _HIT_LIMIT],
        "on": _CONFORMS,
        "off": _HEAD_FIRST_WITHOUT_CACHING,
        "salt": _NOT_APPLICABLE,
        "events": _STATS_AT_LOOKUP,
        "events_provides": ["prefix_cache_stats", "reset_prefix_cache"],
    },
    "0.8.5.post1": {
        "image_end_keyed": True,
        "generation": ["kv_cache_config", "list", "manager"],
        "not_applicable": ["cache_salt", _NAMES, _HIT_LIMIT],
        "on": _CONFORMS,
        "off": _HEAD_FIRST_WITHOUT_CACHING,
        "salt": _NOT_APPLICABLE,
        "events": _STATS_AT_LOOKUP,
        "events_provides": ["prefix_cache_stats", "reset_prefix_cache"],
    },
    "0.9.2": {
        "image_end_keyed": True,
        "generation": ["kv_cache_config", "KVCacheBlocks", "manager"],
        "not_applicable": [_NAMES, _HIT_LIMIT],
        "on": _CONFORMS,
        "off": _CONFORMS,
        "salt": _CONFORMS,
        "events": _STATS_AT_LOOKUP,
        "events_provides": ["prefix_cache_stats", "reset_prefix_cache", "take_events"],
    },
    "0.10.2": {
        "image_end_keyed": True,
        "generation": ["kv_cache_config", "KVCacheBlocks", "request"],
        "not_applicable": [_NAMES, _HIT_LIMIT],
        "on": _CONFORMS,
        "off": _CONFORMS,
        "salt": _CONFORMS,
        "events": _STATS_AT_LOOKUP,
        "events_provides": ["prefix_cache_stats", "reset_prefix_cache", "take_events"],
    },
    "0.33.0": {
        "image_end_keyed": False,
        "generation": ["kv_cache_config", "KVCacheBlocks", "request"],
        "not_applicable": [_HIT_LIMIT],
        "on": _CONFORMS,
        "off": _CONFORMS,
        "salt": _CONFORMS,
        "events": _CONFORMS,
        "events_provides": ["evict_blocks", "prefix_cache_stats", "reset_prefix_cache", "take_events"],
    },
    "0.34.0": {
        "image_end_keyed": False,
        "generation": ["kv_cache_config", "KVCacheBlocks", "request"],
        "not_applicable": [],
        "on": _CONFORMS,
        "off": _CONFORMS,
        "salt": _CONFORMS,
        "events": _CONFORMS,
        "events_provides": ["evict_blocks", "prefix_cache_stats", "reset_prefix_cache", "take_events"],
    },
}


@pytest.mark.parametrize("version", list(EXPECTED))
def test_seed_requests_at_the_request_level(version: str) -> None:
    python = ensure_venv(version, lambda msg: print(msg, file=sys.stderr))
    profile = "vllm-v1" if facts_for(version).matches_seed_order else "vllm-v1-tail"
    env = {**os.environ, **WORKER_ENV}
    proc = subprocess.run(
        [str(python), "-c", _SCRIPT, profile], capture_output=True, text=True, timeout=600, check=False, env=env
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    expected = EXPECTED[version]
    for scenario in ("on", "off", "salt"):
        got = out[scenario]
        assert got["generation"] == expected["generation"], (scenario, got)
        assert got["not_applicable"] == expected["not_applicable"], (scenario, got)
        # hash values compared exactly exactly where they are not declared compared as names
        assert got["exact"] is (_NAMES not in expected["not_applicable"]), (scenario, got)
        want = expected[scenario]
        assert got["verdict"] == want["verdict"], (scenario, got)
        if want["verdict"] == "diverges":
            assert (got["step"], got["op"]) == (want["step"], want["op"]), (scenario, got)
            assert want["message"] in got["message"], (scenario, got)
    # With events and statistics: what the adapter provides is what the release's manager has (from 0.33 it
    # takes the scheduler's hit cap), and what vLLM counts and publishes is checked against the spec.
    events = out["events"]
    assert events["provides"] == expected["events_provides"], events
    assert events["hit_cap"] == (version_key(version) >= version_key("0.33.0")), events
    assert "connector statistics" in events["not_applicable"], events
    assert events["verdict"] == expected["events"]["verdict"], events
    if expected["events"]["verdict"] == "diverges":
        assert (events["step"], events["op"]) == (expected["events"]["step"], expected["events"]["op"]), events
        assert expected["events"]["message"] in events["message"], events
    # C hits block 1 only: 8 tokens, the last one must be computed (len - 1 cap) ...
    assert out["on"]["steps"][-2] == ["get_computed_blocks", [[1], 4]]
    # ... which 0.8.0 to 0.8.2 leave to the scheduler: their manager hits both blocks.
    assert out["on"]["manager_hit_tokens"] == (8 if _SCHEDULER_CAP in expected["not_applicable"] else 4)
    # under a cache_salt C's chain is another one: no hit, where the release takes a salt
    if expected["salt"]["verdict"] == "conforms":
        assert out["salt"]["steps"][-2] == ["get_computed_blocks", [[], 0]]
    # Every release: freeing a request that is no longer running is a silent no-op
    # (vLLM's free pops an empty table), where the spec raises InvalidRequest.
    probes = out["probes"]
    freed_twice = probes["free of a request that is not running accepted silently"]
    assert (freed_twice["verdict"], freed_twice["step"], freed_twice["op"]) == ("diverges", 4, "free"), freed_twice
    assert "the spec raised InvalidRequest" in freed_twice["message"], freed_twice
    assert "the implementation returned None" in freed_twice["message"], freed_twice
    assert freed_twice["replayed"] == ["diverges", 4], freed_twice
    # Before 0.19 a block that fills in decode right after an image is keyed by
    # that image (the overlap test was `start > offset + length`), so the same
    # prefix, hashed as a prompt, hits only the image's block.
    image_end = probes["block filled in decode after an image keyed by that image"]
    if expected["image_end_keyed"]:
        assert (image_end["verdict"], image_end["step"], image_end["op"]) == ("diverges", 4, "get_computed_blocks")
        assert "returned [[1], 4]; the spec returned [[1, 2], 8]" in image_end["message"], image_end
        assert image_end["replayed"] == ["diverges", 4], image_end
    else:
        assert image_end["verdict"] == "conforms", image_end


# Exact hash values at the request level, on vLLM 0.33 (its chain is kvspec's: releases.py, measured). The
# spec hashes with what the factory names (0.33's default sha256, NONE_HASH from "vllm-none-hash" with
# PYTHONHASHSEED unset). A: 8 tokens under a cache_salt, B: A's tokens and one more, no salt; block size 4.
# Steps, as the lock-step counts them: 1-2 admit A (its two blocks registered), 3-4 admit B.
_EXACT_SCRIPT = r"""
import json, logging
logging.disable(logging.WARNING)
from kvspec.conformance.core.adapter import AdapterConfig
from kvspec.conformance.core.lockstep import ConformanceFailure, LockStep
from kvspec.conformance.targets.vllm.adapter import installed_release
from kvspec.conformance.targets.vllm.factories import make_installed_adapter
from kvspec.spec.hashing import hash_request_blocks
from kvspec.spec.manager import Request

ku = installed_release().kv_cache_utils
hash_fn, seed = make_installed_adapter.spec_hashing()
CONFIG = AdapterConfig(level="manager", num_gpu_blocks=8, block_size=4, hash_fn=hash_fn, seed=seed)
A = Request("A", tuple(range(8)), cache_salt="tenant-a")
B = Request("B", tuple(range(8)) + (9,))


def names_only(config):
    adapter = make_installed_adapter(config)
    adapter.uses_kvspec_hash_chain = False
    return adapter


def admit_a_and_b(factory):
    lock = LockStep(factory, CONFIG)
    try:
        lock.check()
        for r in (A, B):
            blocks, n = lock.call("get_computed_blocks", r).result
            lock.check()
            lock.call("allocate_slots", r, len(r.token_ids) - n, n, blocks, 0)
            lock.check()
        return {"verdict": "conforms", "exact": lock.uses_kvspec_hash_chain}
    except ConformanceFailure as f:
        e = f.failure
        return {"verdict": e.kind.value, "step": e.step, "op": e.op, "message": e.message,
                "exact": lock.uses_kvspec_hash_chain}


out = {"hashing": [hash_fn, seed], "vllm": admit_a_and_b(make_installed_adapter)}

# vLLM's own extra-key helper, patched to put the salt on the second block instead of the first.
original = ku.generate_block_hash_extra_keys


def salt_on_the_second_block(request, start, end, mm_idx):
    salt, request.cache_salt = request.cache_salt, None
    try:
        keys, mm_idx = original(request, start, end, mm_idx)
    finally:
        request.cache_salt = salt
    if salt and start == end - start:
        keys = (*(keys or ()), ("cache_salt", salt))
    return keys, mm_idx


ku.generate_block_hash_extra_keys = salt_on_the_second_block
out["moved"] = admit_a_and_b(make_installed_adapter)
out["moved, names only"] = admit_a_and_b(names_only)
ku.generate_block_hash_extra_keys = original

# A LoRA request: vLLM keys the LoRA by name and path (the adapter gives /lora/<name>), the harness by name.
L = Request("L", tuple(range(8)), lora_name="lora-a")
lock = LockStep(make_installed_adapter, CONFIG)
lock.check()
lock.call("get_computed_blocks", L)
lock.check()
lock.call("allocate_slots", L, 8, 0, [], 0)
lock.check()
vllm_hashes = [bytes(h) for h in lock.adapter._vllm_request(L).block_hashes]
with_path = hash_request_blocks(L.token_ids, 4, "lora-a", (), None, hash_fn, seed, lora_path="/lora/lora-a")
spec = [bytes(lock.spec_snapshot.block_hash[b]) for b in (1, 2)]
out["lora"] = {
    "vllm_is_kvspec_with_path": vllm_hashes == [bytes(h) for h in with_path],
    "vllm_is_not_the_spec_value": vllm_hashes != spec,
    "reported_is_spec": [bytes(lock.impl_snapshot.block_hash[b]) for b in (1, 2)] == spec,
}
print(json.dumps(out))
"""


def test_request_level_hash_values_are_compared_exactly_on_0_33() -> None:
    python = ensure_venv("0.33.0", lambda msg: print(msg, file=sys.stderr))
    proc = subprocess.run([str(python), "-c", _EXACT_SCRIPT], capture_output=True, text=True, timeout=600,
                          check=False, env={**os.environ, **WORKER_ENV})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    # the spec hashes as a deployment of 0.33 that sets nothing: its default hash function, its unset seed
    assert out["hashing"] == ["sha256", "vllm-none-hash"]
    assert out["vllm"] == {"verdict": "conforms", "exact": True}, out["vllm"]
    # A salt on the wrong block diverges at once: the first registration (A's allocate_slots) ...
    moved = out["moved"]
    assert (moved["verdict"], moved["step"], moved["op"]) == ("diverges", 2, "allocate_slots"), moved
    assert moved["message"].startswith("block 1's hash is "), moved
    assert "but kvspec's chain (hash_fn='sha256', seed='vllm-none-hash') gives" in moved["message"], moved
    # ... where hash values compared as names pass that step (A's two hashes are two names either way),
    # and only B's hit on A's salted block, a step later, shows it.
    late = out["moved, names only"]
    assert (late["verdict"], late["step"], late["op"]) == ("invariant", 3, "get_computed_blocks"), late
    assert not late["exact"]
    # A LoRA block's hash: vLLM's is kvspec's chain with the LoRA path; the snapshot names it as the spec does.
    assert out["lora"] == {"vllm_is_kvspec_with_path": True, "vllm_is_not_the_spec_value": True,
                           "reported_is_spec": True}  # fmt: skip


def test_an_environment_made_from_another_checkout_runs_this_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The per-release environments are shared by every checkout: one made elsewhere is re-pointed here.

    A real environment and a real ``pip install -e``; only the release in it is
    missing, which this step does not look at.
    """
    monkeypatch.setenv("KVSPEC_VLLM_CACHE", str(tmp_path / "vllm-wheels"))
    env = tmp_path / "vllm-venvs" / "0.0.0"
    subprocess.run([sys.executable, "-m", "venv", str(env)], check=True)
    (env / "KVSPEC_READY").write_text("0.0.0\n/another/checkout\n")
    python = ensure_venv("0.0.0")
    source = Path(venvs.__file__).resolve().parents[3]
    assert (env / "KVSPEC_READY").read_text() == f"0.0.0\n{source}\n"
    where = subprocess.run(
        [str(python), "-c", "import importlib.util; print(importlib.util.find_spec('kvspec').origin)"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert Path(where.stdout.strip()) == source / "kvspec" / "__init__.py"
    ensure_venv("0.0.0")  # already this checkout's: nothing to do
    assert (env / "KVSPEC_READY").read_text() == f"0.0.0\n{source}\n"


# The request level's declared reactions, per release and caching setting
# (kvspec.conformance.targets.vllm.reactions): a campaign sends every declared mistake
# and checks its reaction, and a survey (every mistake, to a replica) sees only
# the declared reactions. A mistake declared None ("no one reaction") is never
# sent and the survey may see anything for it.
_REACTIONS_SCRIPT = r"""
import json, logging, sys
logging.disable(logging.WARNING)
from kvspec.conformance.core.adapter import AdapterConfig
from kvspec.conformance.runner.run import run_check
from kvspec.conformance.runner.survey import survey_reactions
from kvspec.conformance.targets.vllm.factories import make_installed_adapter
from kvspec.conformance.targets.vllm.reactions import manager_reactions

version, profile, caching = sys.argv[1], sys.argv[2], sys.argv[3] == "on"
declared = manager_reactions(version, caching)
# vLLM's first import takes longer than a step may: build one manager before the campaign times steps.
make_installed_adapter(AdapterConfig(level="manager", num_gpu_blocks=4, enable_caching=caching, profile=profile))


def text_only(config):
    # Releases before 0.19 key a block filled in decode right after an image by that image (the
    # oracle's probe): the campaign, which stops at the first divergence, and the survey, which stops
    # at a valid call that diverges, leave images out there.
    adapter = make_installed_adapter(config)
    adapter.not_applicable = {**adapter.not_applicable, "multimodal inputs": "the known image-end keying"}
    return adapter


checked = text_only if sys.argv[4] == "text-only" else make_installed_adapter
result = run_check(checked, level="manager", enable_caching=caching, profile=profile, max_examples=60, isolate=False)
seen = survey_reactions(checked, "manager", caching, max_examples=60, profile=profile)
print(json.dumps({
    "verdict": result.verdict, "failure": result.failure.message if result.failure else None,
    "declared": {m: [r.kind, r.error] for m, r in declared.items()},
    "checked": dict(result.mistakes_checked),
    "seen": {m: dict(c) for m, c in seen.items()},
}))
"""


def _kind(seen: str) -> str:
    """The kind of a reaction as a survey describes it: "raises ValueError, then ..." -> "raises ValueError"."""
    return seen.split(",")[0].split(":")[0].split(" (")[0]


@pytest.mark.parametrize("caching", ["on", "off"])
@pytest.mark.parametrize("version", list(EXPECTED))
def test_every_declared_request_level_reaction_is_sent_and_is_what_a_survey_sees(version: str, caching: str) -> None:
    if caching == "off" and EXPECTED[version]["off"]["verdict"] != "conforms":
        # 0.8.x frees head first without caching: every campaign diverges before a mistake counts.
        from kvspec.conformance.targets.vllm.reactions import manager_reactions

        assert manager_reactions(version, False) == {}
        return
    python = ensure_venv(version, lambda msg: print(msg, file=sys.stderr))
    profile = "vllm-v1" if facts_for(version).matches_seed_order else "vllm-v1-tail"
    images = "text-only" if EXPECTED[version]["image_end_keyed"] else "images"
    proc = subprocess.run([str(python), "-c", _REACTIONS_SCRIPT, version, profile, caching, images],
                          capture_output=True, text=True, timeout=600, check=False,
                          env={**os.environ, **WORKER_ENV})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["verdict"] == "conforms", out["failure"]
    declared = {m: kind for m, (kind, _) in out["declared"].items()}
    sendable = {m for m, kind in declared.items() if kind != "not expressible"}
    assert set(out["checked"]) <= sendable
    assert len(out["checked"]) >= len(sendable) // 2, (sorted(sendable), out["checked"])
    for mistake, reactions in out["seen"].items():
        if mistake not in declared:
            continue  # declared None: no one reaction
        kind, error = out["declared"][mistake]
        allowed = {"accepts", "ignores"} if kind == "accepts" else {kind if kind != "raises" else f"raises {error}"}
        assert {_kind(r) for r in reactions} <= allowed, (mistake, reactions, out["declared"][mistake])


# `kvspec simulate` replays a workload through the reference; the same scheduler driving vLLM
# 0.33's own KVCacheManager (through its adapter) must count the same hits, queries, preemptions
# and peak blocks, with and without pool pressure.
_SIMULATE_SCRIPT = r"""
import json, logging
logging.disable(logging.WARNING)
from kvspec.conformance.core.adapter import AdapterConfig
from kvspec.conformance.tools.simulate import simulate
from kvspec.conformance.targets.vllm.factories import make_installed_adapter
from kvspec.conformance.tools.workloads import builtin_workload

out = []
for name, block_size, pool in (("chat", 16, 300), ("chat", 32, 2000), ("rag", 16, 400)):
    workload = builtin_workload(name, 0)
    ref = simulate(workload, block_size=block_size, num_gpu_blocks=pool)
    config = AdapterConfig(level="manager", num_gpu_blocks=pool, block_size=block_size, profile="vllm-v1")
    got = simulate(workload, block_size=block_size, num_gpu_blocks=pool, manager=lambda: make_installed_adapter(config))
    out.append([name, block_size, pool] + [[r.queries, r.hits, r.preemptions, r.finished, r.peak_blocks_held]
                                           for r in (ref, got)])
print(json.dumps(out))
"""


def test_simulate_counts_the_hits_vllm_0_33_s_own_manager_gives_on_the_same_workload() -> None:
    python = ensure_venv("0.33.0", lambda msg: print(msg, file=sys.stderr))
    proc = subprocess.run([str(python), "-c", _SIMULATE_SCRIPT], capture_output=True, text=True, timeout=600,
                          check=False, env={**os.environ, **WORKER_ENV})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, block_size, pool, ref, got in rows:
        assert got == ref, (name, block_size, pool)
    assert rows[0][3][2] > 0, "the small pool preempts: the comparison covers recomputation"
    assert all(ref[1] > 0 for *_, ref, _ in rows)


# KV cache groups at the request level (AdapterConfig.groups): vLLM's KVCacheManager built from a
# KVCacheConfig of one KVCacheGroupSpec per group, driven through the harness's lock-step on one
# scenario per layout and caching setting (block size 4, 12 blocks a group). Steps, counted as the
# lock-step counts them: 1-2 admit A (16 tokens); 3 A decodes one token, so a sliding window or a
# chunk boundary frees A's skipped blocks; 4-5 admit B (A's 16 tokens and 3 more), whose hit has the
# null block where a group no longer reads; 6-7 admit C (20 other tokens, 12 of them external);
# 8-9 free A and B (those admitted); 10-11 admit D (A's tokens and one more).
_GROUPS_SCRIPT = r"""
import json, logging, sys
logging.disable(logging.WARNING)
from kvspec.conformance.core.adapter import AdapterConfig, LevelNotProvided
from kvspec.conformance.core.lockstep import ConformanceFailure, LockStep
from kvspec.conformance.targets.vllm.factories import make_installed_adapter
from kvspec.spec.manager import Request

A = Request("A", tuple(range(16)))
B = Request("B", tuple(range(16)) + (90, 91, 92))
C = Request("C", tuple(range(100, 120)))
D = Request("D", tuple(range(17)))


def scenario(profile, groups, caching):
    config = AdapterConfig(level="manager", num_gpu_blocks=12 * len(groups.split(",")), block_size=4,
                           profile=profile, enable_caching=caching, groups=groups)
    try:
        make_installed_adapter(config)
    except LevelNotProvided as e:
        return {"verdict": "n/a", "why": str(e)}
    lock = LockStep(make_installed_adapter, config)
    out = {"steps": []}
    admitted = set()

    def step(op, *args):
        spec = lock.call(op, *args)
        lock.check()
        out["steps"].append([op, spec.result])
        return spec.result

    def admit(r, external=0):
        blocks, n = step("get_computed_blocks", r)
        if step("allocate_slots", r, len(r.token_ids) - n - external, n, blocks, external) is not None:
            admitted.add(r.request_id)

    try:
        lock.check()
        admit(A)
        step("allocate_slots", Request("A", A.token_ids + (7,)), 1, 0, [], 0)
        admit(B)
        admit(C, external=12)
        for rid in ("A", "B"):
            if rid in admitted:
                step("free", rid)
        admit(D)
        out["tables"] = [name for name, _ in lock.impl_snapshot.block_tables]
        out["kv_groups"] = list(lock.impl_snapshot.kv_groups)
        out["verdict"] = "conforms"
    except ConformanceFailure as f:
        e = f.failure
        out.update(verdict=e.kind.value, step=e.step, op=e.op, message=e.message)
    return out


profile, layouts = sys.argv[1], sys.argv[2].split(";")
print(json.dumps({f"{g}/{c}": scenario(profile, g, c == "on") for g in layouts for c in ("on", "off")}))
"""

_LAYOUTS = ("full,sliding:8", "full,chunked:16", "sliding:4", "full,sliding:6,chunked:8")
_ONE_TABLE = {"verdict": "n/a", "why": "keeps one block table per request"}
_NO_CHUNKED = {"verdict": "n/a", "why": "has no ChunkedLocalAttentionSpec"}
# Before 0.33 the null block's ref_cnt is not kept at 0 at the request level: vLLM's free passes a
# request's whole table, null positions included, to free_blocks, which decrements every block it
# is given (null_on_free "decrements_ref_cnt", releases.py), so freeing A (whose sliding window or
# chunk left nulls) takes the null block's ref_cnt below 0 (inv_ref_cnt_nonnegative).
_NULL_FREED = {"verdict": "invariant", "step": 8, "op": "free", "message": "negative number of requests"}
# In 0.9.2 and 0.10.2 (not 0.24.0) the hit's null positions are touched too (ref_cnt + 1 per
# null): B's admission leaves the null block held (inv_null_block_isolated).
_NULL_TOUCHED = {"verdict": "invariant", "step": 5, "op": "allocate_slots", "message": "never held"}
# In 0.9.2 and 0.10.2 (not 0.24.0) allocate_slots takes no num_external_computed_tokens: the
# scheduler passed external tokens as new ones, so vLLM wants blocks for all of C's 20 tokens (5)
# where the spec, counting the 12 external tokens as computed, leaves the two blocks outside the
# window of 4 null and takes 3.
_EXTERNAL_AS_NEW = {"verdict": "diverges", "step": 7, "op": "allocate_slots",
                    "message": "returned None; the spec returned [11, 3, 2]"}  # fmt: skip
_CONFORMS_EVERY_LAYOUT = {f"{g}/{c}": _CONFORMS for g in _LAYOUTS for c in ("on", "off")}

# Per release, per layout and caching setting, as measured.
GROUPS_EXPECTED: dict[str, dict[str, dict[str, Any]]] = {
    # 0.8.x: get_computed_blocks returns a plain list, one table per request: no KV cache groups.
    "0.8.0": {f"{g}/{c}": _ONE_TABLE for g in _LAYOUTS for c in ("on", "off")},
    "0.8.4": {f"{g}/{c}": _ONE_TABLE for g in _LAYOUTS for c in ("on", "off")},
    "0.9.2": {
        "full,sliding:8/on": _NULL_TOUCHED,
        "full,sliding:8/off": _NULL_FREED,
        "full,chunked:16/on": _NO_CHUNKED,
        "full,chunked:16/off": _NO_CHUNKED,
        "sliding:4/on": _NULL_TOUCHED,
        "sliding:4/off": _EXTERNAL_AS_NEW,
        "full,sliding:6,chunked:8/on": _NO_CHUNKED,
        "full,sliding:6,chunked:8/off": _NO_CHUNKED,
    },
    "0.10.2": {
        "full,sliding:8/on": _NULL_TOUCHED,
        "full,sliding:8/off": _NULL_FREED,
        # ChunkedLocalAttentionManager.remove_skipped_blocks keeps the last cached block ("to get
        # the previous hash key"): A's decode at the chunk boundary frees 3 of its 4 chunked
        # blocks where the spec frees all 4 (block 8 stays held).
        "full,chunked:16/on": {
            "verdict": "diverges",
            "step": 3,
            "op": "allocate_slots",
            "message": "block_tables: spec (('A', (1, 2, 3, 4, 9)), ('A#1', (0, 0, 0, 0, 10)))",
        },
        "full,chunked:16/off": _NULL_FREED,
        "sliding:4/on": _NULL_TOUCHED,
        "sliding:4/off": _EXTERNAL_AS_NEW,
        # With caching on HybridKVCacheCoordinator asserts one full-attention type and one other.
        "full,sliding:6,chunked:8/on": {"verdict": "n/a", "why": "assumes exactly one other type of groups"},
        "full,sliding:6,chunked:8/off": _NULL_FREED,
    },
    "0.24.0": {f"{g}/{c}": _NULL_FREED for g in _LAYOUTS for c in ("on", "off")},
    "0.33.0": _CONFORMS_EVERY_LAYOUT,
    "0.34.0": _CONFORMS_EVERY_LAYOUT,
}


@pytest.mark.parametrize("version", list(GROUPS_EXPECTED))
def test_kv_cache_groups_at_the_request_level(version: str) -> None:
    python = ensure_venv(version, lambda msg: print(msg, file=sys.stderr))
    profile = "vllm-v1" if facts_for(version).matches_seed_order else "vllm-v1-tail"
    proc = subprocess.run([str(python), "-c", _GROUPS_SCRIPT, profile, ";".join(_LAYOUTS)], capture_output=True,
                          text=True, timeout=600, check=False, env={**os.environ, **WORKER_ENV})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for key, want in GROUPS_EXPECTED[version].items():
        got = out[key]
        assert got["verdict"] == want["verdict"], (key, got)
        if want["verdict"] == "n/a":
            assert want["why"] in got["why"], (key, got)
        elif want["verdict"] != "conforms":
            assert (got["step"], got["op"]) == (want["step"], want["op"]), (key, got)
            assert want["message"] in got["message"], (key, got)
    if version_key(version) < version_key("0.33.0"):
        return
    # Every group's table under its own name, the groups named in the snapshot.
    three = out["full,sliding:6,chunked:8/on"]
    assert three["tables"] == ["C", "C#1", "C#2", "D", "D#1", "D#2"], three
    assert three["kv_groups"] == ["full", "sliding:6", "chunked:8"], three
    # B's hit, group by group: full attention's 4 blocks; the window of 8 reads the last 2 blocks
    # (the first 2 are the null block, freed by A's decode); the chunk of 8 at 16 tokens reads none.
    assert three["steps"][3] == ["get_computed_blocks", [[1, 2, 3, 4, 0, 0, 7, 8, 0, 0, 0, 0], 16]], three
    sliding = out["sliding:4/on"]
    assert sliding["steps"][3] == ["get_computed_blocks", [[0, 0, 0, 4], 16]], sliding
    # C's new blocks, group by group, its external tokens' blocks included: the full group's 5
    # (13, 14, 15 for the external tokens, taken in the first phase, then 16, 17) ...
    assert out["full,sliding:8/on"]["steps"][6] == ["allocate_slots", [13, 14, 15, 18, 19, 16, 17, 20, 21]]


# A short campaign per layout and caching setting on vLLM 0.33 (the harness's own machine, its
# shrinking, its caller mistakes), seed 0: each conforms.
_GROUPS_CAMPAIGN_SCRIPT = r"""
import json, logging, sys, tempfile
logging.disable(logging.WARNING)
from kvspec.conformance.core.adapter import AdapterConfig
from kvspec.conformance.runner.run import run_check
from kvspec.conformance.targets.vllm.factories import make_installed_adapter

# vLLM's first import takes longer than a step may: build one manager before the campaign times steps.
make_installed_adapter(AdapterConfig(level="manager", num_gpu_blocks=4))
out = {}
with tempfile.TemporaryDirectory() as tmp:
    for groups in sys.argv[1].split(";"):
        for caching in ("on", "off"):
            r = run_check(make_installed_adapter, level="manager", enable_caching=caching == "on",
                          profile="vllm-v1", groups=groups, max_examples=30, isolate=False, trace_dir=tmp)
            out[f"{groups}/{caching}"] = [str(r.verdict), r.failure.message if r.failure else r.message]
print(json.dumps(out))
"""


def test_kv_cache_groups_campaigns_on_vllm_0_33_conform() -> None:
    python = ensure_venv("0.33.0", lambda msg: print(msg, file=sys.stderr))
    layouts = (*_LAYOUTS, "chunked:8", "sliding:5,full")
    proc = subprocess.run([str(python), "-c", _GROUPS_CAMPAIGN_SCRIPT, ";".join(layouts)], capture_output=True,
                          text=True, timeout=600, check=False, env={**os.environ, **WORKER_ENV})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for key, (verdict, message) in out.items():
        assert verdict == "conforms", (key, message)


# What the pool tells the world at the request level (config.events), on vLLM 0.33: every step's KV cache
# events and the hit statistics are compared with the spec's by the lock-step (the router's mirror rules
# first); the script lists what the implementation published, by hash name. Block size 4, 10 blocks.
# Steps: 1-2 admit A (10 tokens), 3-4 admit B (A's 8 tokens and 2 more: a 2-block hit), 5 free A,
# 6 preempt B (free), 7-8 re-admit B (num_preemptions 1: counted apart), 9 a lookup capped at 4 tokens
# (the scheduler's max_cache_hit_length), 10 admit D (A's 8 tokens and 4 more) without its hit: it
# registers A's keys again on other blocks, 11 evict block 1 (held by B, keyed like D's first block),
# 12-13 free B and D, 14 reset.
_EVENTS_SCRIPT = r"""
import json, logging, sys, tempfile
logging.disable(logging.WARNING)
from dataclasses import replace
from kvspec.conformance.core.adapter import AdapterConfig
from kvspec.conformance.core.kv_events import describe_events
from kvspec.conformance.core.lockstep import ConformanceFailure, LockStep
from kvspec.conformance.runner.run import replay
from kvspec.conformance.core.trace import write_trace
from kvspec.conformance.targets.vllm.factories import make_installed_adapter
from kvspec.conformance.targets.vllm.manager import make_full_report_adapter
from kvspec.spec.manager import Request

A = Request("A", tuple(range(10)))
B = Request("B", tuple(range(8)) + (99, 98))
D = Request("D", tuple(range(8)) + (5, 5, 5, 5))


def run(factory, impl, caching, steps, tmp, name):
    config = AdapterConfig(level="manager", num_gpu_blocks=10, block_size=4, profile="vllm-v1",
                           enable_caching=caching, events=True)
    lock = LockStep(factory, config)
    out = {"published": []}
    try:
        lock.check()
        for op, *args in steps:
            lock.call(op, *args)
            lock.check()
            record = lock.records[-1]
            out["published"].append(describe_events(record.impl.events, lock.hash_names.impl_name))
        out["verdict"] = "conforms"
        out["stats"] = repr(lock.adapter.prefix_cache_stats())
    except ConformanceFailure as f:
        e = f.failure
        path = write_trace(f"{tmp}/{name}.trace.jsonl", lock.trace(impl))
        again = replay(str(path), factory, impl=impl, isolate=False)
        out.update(verdict=e.kind.value, step=e.step, op=e.op, message=e.message, rule=e.invariant,
                   replayed=[str(again.verdict), again.failure.step if again.failure else None])
    return out


with tempfile.TemporaryDirectory() as tmp:
    story = [
        ("get_computed_blocks", A, None), ("allocate_slots", A, 10, 0, [], 0),
        ("get_computed_blocks", B, None), ("allocate_slots", B, 2, 8, [1, 2], 0),
        ("free", "A"),
        ("free", "B"),
        ("get_computed_blocks", replace(B, num_preemptions=1), None),
        ("allocate_slots", replace(B, num_preemptions=1), 2, 8, [1, 2], 0),
        ("get_computed_blocks", Request("E", tuple(range(10))), 4),
        ("allocate_slots", D, 12, 0, [], 0),
        ("evict_blocks", [1]),
        ("free", "B"), ("free", "D"),
        ("reset_prefix_cache",),
    ]
    admit_then_hit = [("get_computed_blocks", A, None), ("allocate_slots", A, 10, 0, [], 0),
                      ("get_computed_blocks", B, None)]
    print(json.dumps({
        "story": run(make_installed_adapter, "vllm", True, story, tmp, "story"),
        "caching_off": run(make_installed_adapter, "vllm", False, admit_then_hit[:2], tmp, "caching-off"),
        "full_report": run(make_full_report_adapter, "kvspec.conformance.targets.vllm.manager:make_full_report_adapter",
                           True, admit_then_hit, tmp, "full-report"),
    }))
"""


def test_events_and_hit_statistics_at_the_request_level_on_vllm_0_33() -> None:
    python = ensure_venv("0.33.0", lambda msg: print(msg, file=sys.stderr))
    proc = subprocess.run([str(python), "-c", _EVENTS_SCRIPT], capture_output=True, text=True, timeout=600,
                          check=False, env={**os.environ, **WORKER_ENV})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    story = out["story"]
    assert story["verdict"] == "conforms", story
    published = story["published"]
    # A's admission registers its two full blocks, a chain from the first (parent none), with their tokens.
    assert published[1] == "stored h1 h2 (parent -, tokens [0, 1, 2, 3, 4, 5, 6, 7], extra keys [None, None])"
    assert published[2:9] == ["none"] * 7  # B's hit, the frees, the preemption, the capped lookup: nothing
    # D registers A's keys on new blocks (identical full blocks are kept apart) and one more, chained.
    assert published[9] == (
        "stored h1 h2 h3 (parent -, tokens [0, 1, 2, 3, 4, 5, 6, 7, 5, 5, 5, 5], extra keys [None, None, None])"
    )
    # Evicting block 1 removes h1 while D's block still holds it: a router must count references.
    assert published[10] == "removed h1"
    assert published[13] == "cleared"
    # Counted at admission: A (10 tokens, no hit), B (10 tokens, 8 hit), D (12 tokens, its hit not taken);
    # B again after its preemption apart; the capped lookup E is never admitted; one reset.
    assert story["stats"] == (
        "PrefixCacheStats(local=CacheCounters(requests=3, queries=32, hits=8, preempted_requests=1, "
        "preempted_queries=10, preempted_hits=8), connector=CacheCounters(requests=0, queries=0, hits=0, "
        "preempted_requests=0, preempted_queries=0, preempted_hits=0), num_resets=1)"
    )
    # With caching off no lookup runs, and neither vLLM 0.33 (prefix_cache_lookup_enabled is False, so the
    # scheduler's record_prefix_cache_stats returns) nor the spec counts the request locally.
    off = out["caching_off"]
    assert off["verdict"] == "conforms", off
    assert "local=CacheCounters(requests=0, queries=0, hits=0," in off["stats"], off
    # Finding: a request in kv_cache_report_mode "full" (read with getattr; nothing in vLLM 0.33 sets it)
    # makes B's lookup publish its hit blocks as stored again: a reference-counting router then holds each
    # of them twice, with one block each in the table (event_mirror_exact breaks).
    full = out["full_report"]
    assert (full["verdict"], full["step"], full["op"], full["rule"]) == (
        "invariant",
        3,
        "get_computed_blocks",
        "event_mirror_exact",
    ), full
    assert "stored h1 h2 (parent -" in full["message"], full
    assert full["replayed"] == ["diverges", 3], full


# vLLM 0.34's request hit limit and get_num_cached_tokens, in lock-step with the spec (events and hit
# statistics checked), caching on and off. Block size 4, 10 blocks: A (10 tokens) runs; a probe of its tokens
# with no limit, a limit of 4 and a limit of 0; L (A's tokens, limit 5) is admitted on a one-block hit; Z (limit
# 0: it skips the cache) is admitted with no lookup, and is not counted in the local statistics.
_HIT_LIMIT_SCRIPT = r"""
import json, logging
logging.disable(logging.WARNING)
from kvspec.conformance.core.adapter import AdapterConfig
from kvspec.conformance.core.lockstep import ConformanceFailure, LockStep
from kvspec.conformance.targets.vllm.factories import make_installed_adapter
from kvspec.spec.manager import Request

TOKENS = tuple(range(10))


def run(caching):
    config = AdapterConfig(level="manager", num_gpu_blocks=10, block_size=4, enable_caching=caching, events=True)
    lock = LockStep(make_installed_adapter, config)
    out = {"results": [], "not_applicable": sorted(lock.adapter.not_applicable)}

    def step(op, *args):
        result = lock.call(op, *args).result
        lock.check()
        out["results"].append(result)
        return result

    def admit(request):
        blocks, n = step("get_computed_blocks", request)
        step("allocate_slots", request, len(request.token_ids) - n, n, blocks, 0)

    try:
        lock.check()
        admit(Request("A", TOKENS))
        for limit in (None, 4, 0):
            step("get_num_cached_tokens", Request("P", TOKENS, prefix_cache_hit_limit=limit))
        admit(Request("L", TOKENS, prefix_cache_hit_limit=5))
        admit(Request("Z", TOKENS, prefix_cache_hit_limit=0))
        out["verdict"] = "conforms"
        out["stats"] = repr(lock.adapter.prefix_cache_stats().local)
    except ConformanceFailure as f:
        out.update(verdict=f.failure.kind.value, step=f.failure.step, message=f.failure.message)
    return out


print(json.dumps({"on": run(True), "off": run(False)}))
"""


def test_the_request_hit_limit_and_get_num_cached_tokens_on_vllm_0_34() -> None:
    python = ensure_venv("0.34.0", lambda msg: print(msg, file=sys.stderr))
    proc = subprocess.run([str(python), "-c", _HIT_LIMIT_SCRIPT], capture_output=True, text=True, timeout=600,
                          check=False, env={**os.environ, **WORKER_ENV})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    on, off = out["on"], out["off"]
    assert on["verdict"] == "conforms" and off["verdict"] == "conforms", out
    assert _HIT_LIMIT not in on["not_applicable"], on
    # A misses; the probe reads 8 cached tokens, with a limit of 4 too (vLLM bounds it by len - 1 alone), none
    # with a limit of 0; L's limit of 5 lets one block hit; Z skips the lookup.
    assert on["results"][0] == [[], 0] and on["results"][2:5] == [8, 8, 0], on
    assert on["results"][5] == [[1], 4] and on["results"][7] == [[], 0], on
    # Counted locally: A (no hit) and L (4 hit tokens); not Z, whose lookup did not run.
    assert on["stats"].startswith("CacheCounters(requests=2, queries=20, hits=4,"), on
    assert off["results"][2:5] == [0, 0, 0] and off["stats"].startswith("CacheCounters(requests=0,"), off


# The findings' traces kept in tests/data/vllm_events (docs/reference/findings-vllm.md names each with its
# replay command), each replayed in its release's environment to the verdict it shows.
_REPLAY_SCRIPT = r"""
import json, logging, sys, tempfile
logging.disable(logging.WARNING)
from kvspec.conformance.runner.registry import load_factory
from kvspec.conformance.runner.run import replay

out = {}
with tempfile.TemporaryDirectory() as tmp:
    for path, impl in zip(sys.argv[1::2], sys.argv[2::2]):
        r = replay(path, load_factory(impl), impl=impl, isolate=False, trace_dir=tmp, step_timeout_s=120)
        f = r.failure
        got = [str(r.verdict), f.step, f.op, f.invariant, f.message[:300]] if f else [str(r.verdict)]
        out[path.rsplit("/", 1)[-1]] = got
print(json.dumps(out))
"""
_EVENTS_DATA = Path(__file__).resolve().parents[1] / "data" / "vllm_events"
_EVENTS_ONLY = "kvspec.conformance.targets.vllm.manager:make_events_only_adapter"
_FULL_REPORT = "kvspec.conformance.targets.vllm.manager:make_full_report_adapter"
FINDING_TRACES: dict[str, list[tuple[str, str, list[Any]]]] = {
    # Up to 0.24 a request is counted at its lookup (step 1); the spec counts it at admission.
    "0.10.2": [
        (
            "stats_at_lookup-0.10.2.trace.jsonl",
            "vllm",
            ["diverges", 1, "get_computed_blocks", None, "local.requests: spec 0 vs implementation 1"],
        ),
        # With events on, registering a block of a single sliding-window group whose parent position the
        # window has left (the null block there) trips `assert parent_block.block_hash is not None`.
        (
            "sliding_parent_assert-0.10.2.trace.jsonl",
            _EVENTS_ONLY,
            ["crashed", 6, "allocate_slots", None, "AssertionError"],
        ),
        # With events on, a LoRA request's BlockStored reads lora_request.id (0.9.0 to 0.11.0), which vLLM's
        # LoRARequest does not have (lora_int_id, adapter_id): the registration raises AttributeError.
        (
            "lora_event_crash-0.10.2.trace.jsonl",
            _EVENTS_ONLY,
            ["crashed", 2, "allocate_slots", None, "'LoRARequest' object has no attribute 'id'"],
        ),
    ],  # fmt: skip
    "0.33.0": [
        # Without caching vLLM 0.33 counts no request in its local statistics. Kept from when the spec counted
        # the admission (a finding then): the spec counts only a request whose lookup ran, and it conforms.
        ("stats_without_caching-0.33.0.trace.jsonl", "vllm", ["conforms"]),
        # kv_cache_report_mode "full": a lookup's hit blocks are published as stored again.
        (
            "full_report_mode-0.33.0.trace.jsonl",
            _FULL_REPORT,
            ["diverges", 3, "get_computed_blocks", "event_mirror_exact", "published: stored h1 h2"],
        ),
    ],  # fmt: skip
}


@pytest.mark.parametrize("version", list(FINDING_TRACES))
def test_the_events_findings_traces_replay_to_their_verdict(version: str) -> None:
    python = ensure_venv(version, lambda msg: print(msg, file=sys.stderr))
    args = [a for name, impl, _ in FINDING_TRACES[version] for a in (str(_EVENTS_DATA / name), impl)]
    proc = subprocess.run([str(python), "-c", _REPLAY_SCRIPT, *args], capture_output=True, text=True, timeout=600,
                          check=False, env={**os.environ, **WORKER_ENV})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, _, expected in FINDING_TRACES[version]:
        got = out[name]
        if expected == ["conforms"]:
            assert got == expected, (name, got)
            continue
        verdict, step, op, rule, words = expected
        assert got[:4] == [verdict, step, op, rule], (name, got)
        assert words in got[4], (name, got)
