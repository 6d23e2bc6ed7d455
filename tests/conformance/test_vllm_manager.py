"""vLLM's KVCacheManager (installed, in its own environment) at the request level (KVSPEC_VLLM=1).

The request level needs vLLM installed; the test runs in the environment the
oracle creates for a release (``ensure_venv``), through the harness's own
lock-step, so the comparison is the harness's, not this file's.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvspec.conformance.vllm.oracle import ensure_venv
from kvspec.conformance.vllm.releases import facts_for

pytestmark = pytest.mark.vllm

# Seed 000's requests at the request level: A (10 tokens) runs, B shares A's
# first two blocks, both finish, C (8 tokens) hits only one block (len - 1 cap).
_SCRIPT = r"""
import json, logging
logging.disable(logging.WARNING)
from kvspec.conformance.adapter import AdapterConfig
from kvspec.conformance.machine import ConformanceFailure, LockStep
from kvspec.conformance.vllm.adapter import make_installed_adapter
from kvspec.spec.manager import Request

import sys
lock = LockStep(make_installed_adapter, AdapterConfig(level="manager", num_gpu_blocks=7, block_size=4,
                                                      profile=sys.argv[1], enable_caching=True))
out = {"steps": []}
def step(op, *args):
    spec = lock.call(op, *args)
    lock.check()
    out["steps"].append([op, spec.result])
    return spec.result
try:
    lock.check()
    A = Request("A", tuple(range(10)))
    B = Request("B", tuple(range(8)) + (99, 98))
    C = Request("C", tuple(range(8)))
    for r in (A, B):
        blocks, n = step("get_computed_blocks", r)
        step("allocate_slots", r, len(r.token_ids) - n, n, blocks)
    A2 = Request("A", A.token_ids + (7,))
    step("allocate_slots", A2, 1)
    step("free", "A")
    step("free", "B")
    blocks, n = step("get_computed_blocks", C)
    step("allocate_slots", C, 8 - n, n, blocks)
    out["queue"] = list(lock.impl_snapshot.free_queue)
    out["verdict"] = "conforms"
except ConformanceFailure as f:
    out["verdict"] = f"{f.kind} at step {f.step_index} ({f.op}): {f.message}"
print(json.dumps(out))
"""


@pytest.mark.parametrize("version", ["0.33.0", "0.10.2"])
def test_seed_requests_conform_at_the_request_level(version: str) -> None:
    python = ensure_venv(version, lambda msg: print(msg, file=sys.stderr))
    profile = "vllm-v1" if facts_for(version).matches_seed_order else "vllm-v1-tail"
    proc = subprocess.run(
        [str(python), "-c", _SCRIPT, profile], capture_output=True, text=True, timeout=600, check=False
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["verdict"] == "conforms", out
    # C hits block 1 only: 8 tokens, the last one must be computed (len - 1 cap)
    assert out["steps"][-2] == ["get_computed_blocks", [[1], 4]]
