"""What kvspec reads from outside, through the command line: an implementation's exception message, copied
only so far, and a path to read that is no regular file, refused in one line before it is opened.

Each is the command a user types, in a subprocess, as in test_hostile_cli.py.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvspec.conformance.core.watch import SAID_AT_MOST

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
KVSPEC = [sys.executable, "-m", "kvspec"]
PRELUDE = f"import sys\nsys.path.insert(0, {str(EXAMPLES)!r})\nfrom pool_example import ExamplePool\n"
HUGE = 10_000_000  # characters of the implementation's message


def kvspec(*args: str, cwd: Path, timeout: int = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*KVSPEC, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)


def refused(r: subprocess.CompletedProcess[str], says: str) -> None:
    assert r.returncode == 2, r.stdout + r.stderr
    assert says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "Traceback" not in r.stdout + r.stderr


def test_a_huge_exception_message_is_cut_in_the_story_the_trace_and_its_replay(tmp_path):
    # A 10 MB message was copied whole into the story printed and into the saved trace: 20 MB of each.
    (tmp_path / "loud_pool.py").write_text(
        PRELUDE
        + textwrap.dedent(f"""
        class P(ExamplePool):
            def get_new_blocks(self, n):
                raise ValueError("x" * {HUGE})

        def factory(config):
            return P(config.num_gpu_blocks, config.enable_caching)
    """)
    )
    traces = tmp_path / "traces"
    r = kvspec("check", "--impl", "loud_pool.py:factory", "--level", "pool", "--caching", "on", "--max-examples",
               "20", "--cover-rounds", "0", "--trace-dir", str(traces), cwd=tmp_path)  # fmt: skip
    left_out = f"x... [{HUGE - SAID_AT_MOST:,} more characters] (at loud_pool.py:"
    assert r.returncode == 1 and "crashed" in r.stdout and "Traceback" not in r.stderr, r.stderr
    assert left_out in r.stdout and len(r.stdout) < 10 * SAID_AT_MOST, r.stdout[:2000]
    (trace,) = traces.glob("*.trace.jsonl")
    assert trace.stat().st_size < 10 * SAID_AT_MOST
    steps = [json.loads(line) for line in trace.read_text().splitlines()]
    assert any(left_out in json.dumps(step) for step in steps)
    # The replay cuts the message where the check did, so the outcomes it compares are the same.
    again = kvspec("replay", str(trace), "--impl", "loud_pool.py:factory", cwd=tmp_path)
    assert again.returncode == 1 and "CRASHED" in again.stdout, again.stdout[:2000] + again.stderr
    assert left_out in again.stdout and len(again.stdout) < 10 * SAID_AT_MOST


def test_a_huge_message_of_the_right_error_type_is_no_divergence(tmp_path):
    # Errors are compared by type: the spec's short message beside a cut one of the same type is no divergence.
    (tmp_path / "wordy_pool.py").write_text(
        textwrap.dedent(f"""
        from kvspec.conformance.targets.builtin import make_reference
        from kvspec.spec.errors import BlockManagerError

        def wordy(method):
            def call(*args):
                try:
                    return method(*args)
                except BlockManagerError as e:
                    raise type(e)(str(e) + "!" * {HUGE}) from None
            return call

        def factory(config):
            adapter = make_reference(config)
            for name in ("get_new_blocks", "free_blocks", "touch", "cache_full_blocks"):
                setattr(adapter, name, wordy(getattr(adapter, name)))
            return adapter
    """)
    )
    r = kvspec("check", "--impl", "wordy_pool.py:factory", "--level", "pool", "--caching", "on", "--max-examples",
               "20", "--cover-rounds", "0", "--trace-dir", str(tmp_path / "traces"), cwd=tmp_path)  # fmt: skip
    assert r.returncode in (0, 2) and "diverges" not in r.stdout and "crashed" not in r.stdout, r.stdout + r.stderr
    assert "bad inputs rejected 0," not in r.stdout and "failed allocations 0," not in r.stdout  # errors were met
    assert len(r.stdout) < 10 * SAID_AT_MOST


@pytest.fixture
def fifo(tmp_path: Path) -> Path:
    path = tmp_path / "pipe.trace.jsonl"
    os.mkfifo(path)  # no writer ever opens it: a read that opened it would wait for ever
    return path


@pytest.mark.parametrize("command", [["replay", "{}", "--impl", "reference"], ["view", "{}"], ["mirror", "{}"]])
def test_a_trace_that_is_a_fifo_is_refused_not_waited_on(tmp_path, fifo, command):
    r = kvspec(*[part.format(fifo) for part in command], cwd=tmp_path, timeout=60)
    refused(r, f"{fifo}: cannot read it (a FIFO, not a regular file: reading it would wait for a writer)")


def test_a_device_or_a_folder_as_a_trace_is_refused_in_one_line(tmp_path):
    refused(kvspec("replay", "/dev/zero", "--impl", "reference", cwd=tmp_path, timeout=60),
            "/dev/zero: cannot read it (a device, not a regular file: reading it need never end)")  # fmt: skip
    refused(kvspec("mirror", str(tmp_path), cwd=tmp_path, timeout=60), "(a folder, not a regular file)")


def test_every_other_file_a_command_reads_refuses_a_fifo(tmp_path, fifo):
    r = kvspec("simulate", "--workload", str(fifo), cwd=tmp_path, timeout=60)
    refused(r, f"{fifo}: cannot read the workload: a FIFO, not a regular file")
    r = kvspec("diff", "vllm@0.8.0", "vllm@0.9.0", "--accept", str(fifo), cwd=tmp_path, timeout=60)
    refused(r, f"--accept: cannot read {fifo} as a list of changes (NotAFile: a FIFO, not a regular file")
    refused(kvspec("gate", "--accept", str(fifo), cwd=tmp_path, timeout=60), f"no readable file {fifo}")
    r = kvspec("check", "--impl", f"{fifo}:factory", "--level", "pool", cwd=tmp_path, timeout=60)
    refused(r, f"{fifo} is not a regular file")
