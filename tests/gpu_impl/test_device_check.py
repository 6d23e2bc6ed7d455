"""gpu_impl/device_check.sh runs on the CPU with KVSPEC_DEVICE=cpu and prints its table; it says why it cannot run."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import kvspec.gpu_impl

SCRIPT = Path(kvspec.gpu_impl.__file__).parent / "device_check.sh"


def run(env_extra: dict[str, str], timeout: int = 300) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHON": sys.executable, **env_extra}
    return subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=timeout, check=False)


def row(lines: list[str], step: str) -> list[str]:
    return next(line for line in lines if line.startswith(step)).split()


@pytest.mark.heavy
def test_quick_cpu_mode_passes_every_step_and_prints_the_table(tmp_path):
    done = run({"KVSPEC_DEVICE": "cpu", "KVSPEC_DEVICE_CHECK_QUICK": "1", "KVSPEC_DEVICE_CHECK_LOGS": str(tmp_path)})
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert any(line.startswith("gpu_impl device check on cpu (") and line.endswith(", quick") for line in lines)
    steps = ["conformance", "kvspec check, cpu", "same verdict, cpu and cpu", "corruption", "benchmark"]
    for step in [*steps, "benchmark, keyed policy", "benchmark, events", "all"]:
        assert "pass" in row(lines, step), step
    # Quick mode checks the pool level (caching on and off); the same seed gave the same campaign.
    assert "2 rows equal: pool on conforms, pool off conforms" in " ".join(row(lines, "same verdict"))
    largest = lines[lines.index(next(line for line in lines if line.startswith("benchmark, the largest batch"))) + 1 :]
    assert largest[0] == "gpu_impl on cpu against the reference, profile vllm-v1"  # each run's title, its header
    assert "calls" in largest[1] and "(tensors)" in largest[1]  # the counts, beside the timings
    assert any("get_new_blocks" in line and re.search(r" \d+/\d+/\d+ +\d+/\d+/\d+$", line) for line in largest)
    assert any(line.startswith("CPU target") for line in lines)
    # the keyed policy's and the events' largest batch too, each under its run's title
    assert any(line.startswith("gpu_impl on cpu against the reference, profile lru-timestamp") for line in largest)
    assert any(line.endswith("profile vllm-v1, KV cache events on") for line in largest)
    assert any(line.startswith("the floor of events, 1,000 BlockRemoved built") for line in lines)
    assert any("every hit block read back: intact" in line for line in lines)
    assert {"check-cpu.log", "check-device.log", "benchmark.log"} <= {p.name for p in tmp_path.iterdir()}


def test_an_unusable_device_exits_2_with_the_reason():
    done = run({"KVSPEC_DEVICE": "tpu"})
    assert done.returncode == 2
    assert "cannot use KVSPEC_DEVICE=tpu" in done.stderr


def test_an_interpreter_without_kvspec_exits_2_saying_what_to_install(tmp_path):
    bare = tmp_path / "bare-python"
    bare.write_text(f'#!/bin/sh\nexec {sys.executable} -I -S "$@"\n')  # no site-packages: no kvspec, torch or pytest
    bare.chmod(0o755)
    done = run({"PYTHON": str(bare), "KVSPEC_DEVICE": "cpu"})
    assert done.returncode == 2
    assert "lacks kvspec torch pytest hypothesis" in done.stderr and "pip install" in done.stderr


def test_a_spent_budget_skips_the_steps_left_and_fails():
    done = run({"KVSPEC_DEVICE": "cpu", "KVSPEC_DEVICE_CHECK_QUICK": "1", "KVSPEC_DEVICE_CHECK_BUDGET": "4"})
    assert done.returncode == 1
    assert "SKIPPED" in row(done.stdout.splitlines(), "benchmark")


@pytest.mark.slow
def test_full_cpu_mode_passes_every_step():
    """The whole device check (state machines, the harness, the full benchmark grid) on the CPU."""
    done = run({"KVSPEC_DEVICE": "cpu"}, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "kvspec check, cpu" in done.stdout and " 100,000  " in done.stdout
