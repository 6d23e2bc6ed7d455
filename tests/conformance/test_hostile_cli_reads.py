"""What kvspec reads from outside, through the command line: an implementation's exception message, copied
only so far; a path to read that is a device or a folder, refused in one line before it is opened, and a
pipe, read as `cat` reads it once something writes to it.

Each is the command a user types, in a subprocess, as in test_hostile_cli.py.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvspec.conformance.core.files import PIPE_WAIT_S, NotAFile, read_text_file
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


TRACE = ROOT / "docs" / "traces" / "event_mirror_exact.trace.jsonl"  # with events: mirror reads it too


@pytest.mark.parametrize(
    ("command", "says"),
    [
        (["replay", "{}", "--impl", "reference"], "replaying /dev/fd/"),
        (["view", "{}", "-o", "page.html"], "page: page.html"),
        (["mirror", "{}"], "mirror"),
    ],
)
def test_a_trace_through_a_pipe_is_read_as_cat_reads_it(tmp_path, command, says):
    # A shell's <(command) names a pipe: it was refused as "a FIFO, not a regular file".
    line = " ".join(part.format(f"<(cat {TRACE})") for part in command)
    r = subprocess.run(["bash", "-c", f"{sys.executable} -m kvspec {line}"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=120)  # fmt: skip
    assert r.returncode in (0, 1) and says in r.stdout and "Traceback" not in r.stderr, r.stdout + r.stderr


def test_a_page_of_a_trace_through_a_pipe_is_written_where_it_is_told(tmp_path):
    # Beside the trace, the default, is no folder: it was "cannot write /dev/fd/63.html", after the read.
    r = subprocess.run(["bash", "-c", f"{sys.executable} -m kvspec view <(cat {TRACE})"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    refused(r, "is a pipe, with no folder to write the page beside; give -o PAGE.html or --serve")


def test_a_fifo_nobody_writes_to_is_refused_after_the_wait_not_waited_on_for_ever(tmp_path, fifo):
    r = kvspec("replay", str(fifo), "--impl", "reference", cwd=tmp_path, timeout=60)
    refused(r, f"{fifo}: cannot read it (a FIFO nobody wrote to within {PIPE_WAIT_S:g} s)")


def test_a_pipe_is_read_once_written_to_and_only_so_far(tmp_path, fifo):
    with pytest.raises(NotAFile, match=r"^a FIFO nobody wrote to within 0.2 s$"):
        read_text_file(fifo, pipe_wait_s=0.2)
    writer = subprocess.Popen(["bash", "-c", f"sleep 0.3; printf 0123456789 > {fifo}"])
    assert read_text_file(fifo) == "0123456789"  # a writer slower than the reader opened it
    writer.wait(timeout=30)
    writer = subprocess.Popen(["bash", "-c", f"printf 0123456789 > {fifo}"])
    with pytest.raises(NotAFile, match=r"^a pipe that carries more than 9 bytes, the most kvspec reads$"):
        read_text_file(fifo, max_bytes=9)
    writer.wait(timeout=30)


def test_a_device_or_a_folder_as_a_trace_is_refused_in_one_line(tmp_path):
    refused(kvspec("replay", "/dev/zero", "--impl", "reference", cwd=tmp_path, timeout=60),
            "/dev/zero: cannot read it (a device, not a regular file: reading it need never end)")  # fmt: skip
    refused(kvspec("mirror", str(tmp_path), cwd=tmp_path, timeout=60), "(a folder, not a regular file)")


def test_every_other_file_a_command_reads_refuses_a_device(tmp_path, fifo):
    # Through the same reader as a trace (a pipe nobody writes to is refused there after its wait, above).
    r = kvspec("simulate", "--workload", "/dev/zero", cwd=tmp_path, timeout=60)
    refused(r, "/dev/zero: cannot read the workload: a device, not a regular file")
    r = kvspec("diff", "vllm@0.8.0", "vllm@0.9.0", "--accept", "/dev/zero", cwd=tmp_path, timeout=60)
    refused(r, "--accept: cannot read /dev/zero as a list of changes (NotAFile: a device, not a regular file")
    refused(kvspec("gate", "--accept", str(fifo), cwd=tmp_path, timeout=60), f"no readable file {fifo}")
    r = kvspec("check", "--impl", f"{fifo}:factory", "--level", "pool", cwd=tmp_path, timeout=60)
    refused(r, f"{fifo} is not a regular file")
