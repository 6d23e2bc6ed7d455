"""gpu_impl/device_check.sh runs on the CPU with KVSPEC_DEVICE=cpu and prints its table."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import kvspec.gpu_impl

SCRIPT = Path(kvspec.gpu_impl.__file__).parent / "device_check.sh"


def run(env_extra: dict[str, str]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHON": sys.executable, **env_extra}
    return subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=300, check=False)


def test_quick_cpu_mode_passes_every_step_and_prints_the_table():
    done = run({"KVSPEC_DEVICE": "cpu", "KVSPEC_DEVICE_CHECK_QUICK": "1"})
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert "gpu_impl device check on cpu (quick)" in lines
    for step in ("conformance", "corruption", "benchmark"):
        row = next(line for line in lines if line.startswith(step))
        assert row.split()[1] == "pass", row
    assert any("get_new_blocks" in line for line in lines)
    assert any(line.startswith("CPU target") for line in lines)


def test_an_unusable_device_exits_2_with_the_reason():
    done = run({"KVSPEC_DEVICE": "tpu"})
    assert done.returncode == 2
    assert "cannot use KVSPEC_DEVICE=tpu" in done.stderr


@pytest.mark.slow
def test_full_cpu_mode_passes_every_step():
    """The whole device check (state machines, the harness, the full benchmark grid) on the CPU."""
    done = run({"KVSPEC_DEVICE": "cpu"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "kvspec check --impl gpu" in done.stdout
