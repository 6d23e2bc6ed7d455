"""vLLM's KVCacheManager (installed, in its own environment) at the request level (KVSPEC_VLLM=1).

The request level needs vLLM installed; each release runs in the environment
the oracle creates for it (``ensure_venv``), through the harness's own
lock-step, so every comparison is the harness's, not this file's. One
subprocess per release runs seed 000's requests three ways: caching on,
caching off, and with the last request under a cache_salt.

The verdicts asserted are the ones measured on each release; where a release
diverges, the divergence is vLLM's own behaviour (named below with its step),
not the adapter's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from kvspec.conformance.vllm.oracle import WORKER_ENV, ensure_venv
from kvspec.conformance.vllm.releases import facts_for

pytestmark = pytest.mark.vllm

# Seed 000's requests at the request level: A (10 tokens) runs, B shares A's
# first two blocks, A decodes one token, both finish, C (8 tokens) hits only
# one block (len - 1 cap). Steps, counted as the lock-step counts them:
# 1-2 admit A, 3-4 admit B, 5 decode A, 6 free A, 7 free B, 8-9 admit C.
_SCRIPT = r"""
import json, logging, sys
logging.disable(logging.WARNING)
from kvspec.conformance.adapter import AdapterConfig
from kvspec.conformance.machine import ConformanceFailure, LockStep
from kvspec.conformance.vllm.adapter import make_installed_adapter
from kvspec.spec.manager import Request

A = Request("A", tuple(range(10)))
B = Request("B", tuple(range(8)) + (99, 98))


def scenario(profile, caching, salt):
    config = AdapterConfig(level="manager", num_gpu_blocks=7, block_size=4, profile=profile, enable_caching=caching)
    lock = LockStep(make_installed_adapter, config)
    out = {"steps": [], "generation": [lock.adapter.blocks, lock.adapter.hashes]}

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
        C = Request("C", tuple(range(8)), cache_salt=salt)
        blocks, n = step("get_computed_blocks", C)
        step("allocate_slots", C, 8 - n, n, blocks, 0)
        out["queue"] = list(lock.impl_snapshot.free_queue)
        out["verdict"] = "conforms"
    except ConformanceFailure as f:
        out.update(verdict=f.kind, step=f.step_index, op=f.op, message=f.message)
    return out


profile = sys.argv[1]
print(json.dumps({"on": scenario(profile, True, None), "off": scenario(profile, False, None),
                  "salt": scenario(profile, True, "tenant-1")}))
"""

_CONFORMS: dict[str, Any] = {"verdict": "conforms"}

# Per release: the API generation the adapter detected (what get_computed_blocks
# returns, where hashes come from), then the verdict per scenario, as measured.
EXPECTED: dict[str, dict[str, Any]] = {
    "0.8.5.post1": {
        "generation": ["list", "manager"],
        "on": _CONFORMS,
        # With caching off 0.8.x frees a request's blocks head first (the
        # reversal sits under `if self.enable_caching`): A's blocks 1, 2, 3
        # join the queue as 1, 2, 3 where the spec frees tail first (3, 2, 1).
        "off": {
            "verdict": "diverges",
            "step": 6,
            "op": "free",
            "message": "spec (3, 2, 1) vs implementation (1, 2, 3)",
        },
        # 0.8.x's Request has no cache_salt: a salted request cannot be sent.
        "salt": {"verdict": "diverges", "step": 8, "op": "get_computed_blocks", "message": "takes no cache_salt"},
    },
    "0.9.2": {"generation": ["KVCacheBlocks", "manager"], "on": _CONFORMS, "off": _CONFORMS, "salt": _CONFORMS},
    "0.10.2": {"generation": ["KVCacheBlocks", "request"], "on": _CONFORMS, "off": _CONFORMS, "salt": _CONFORMS},
    "0.33.0": {"generation": ["KVCacheBlocks", "request"], "on": _CONFORMS, "off": _CONFORMS, "salt": _CONFORMS},
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
        want = expected[scenario]
        assert got["verdict"] == want["verdict"], (scenario, got)
        if want["verdict"] != "conforms":
            assert (got["step"], got["op"]) == (want["step"], want["op"]), (scenario, got)
            assert want["message"] in got["message"], (scenario, got)
    # C hits block 1 only: 8 tokens, the last one must be computed (len - 1 cap)
    assert out["on"]["steps"][-2] == ["get_computed_blocks", [[1], 4]]
    # under a cache_salt C's chain is another one: no hit, where the release takes a salt
    if expected["salt"]["verdict"] == "conforms":
        assert out["salt"]["steps"][-2] == ["get_computed_blocks", [[], 0]]
