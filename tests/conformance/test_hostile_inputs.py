"""A corpus of hostile inputs, kept: each one through the command line, answered in one line, exit 2, nothing touched.

Every case is something a careless or hostile user gave kvspec (a trace that
is not one, flags that mean nothing together, sizes no machine holds). The
answer is one line on stderr naming what is wrong, exit 2 ("no verdict"),
no traceback, and the folder it ran in exactly as it was: no trace written,
no file replaced. The corpus grows with every report.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from kvspec.conformance.core import trace as trace_module
from kvspec.conformance.tools.cli import main

HEADER = {
    "kvspec_trace": 1,
    "level": "pool",
    "config": {"num_gpu_blocks": 4, "enable_caching": True, "profile": "vllm-v1", "block_size": 4,
               "hash_fn": "sha256_cbor", "seed": "kvspec", "device": None},
    "impl": "reference",
}  # fmt: skip


def _trace(folder: Path, *lines: str, header: dict | None = None) -> Path:
    path = folder / "given.trace.jsonl"
    path.write_text("\n".join([json.dumps(header or HEADER), *lines]) + "\n")
    return path


def _state(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def answers_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]):
    """Run kvspec in a folder of its own; assert exit 2, one line on stderr that says ``says``, nothing changed.

    With ``exits=1`` (the implementation is wrong): exit 1, nothing on stderr, and ``says`` in the story's
    line that names what failed ("what failed: ...").
    """
    monkeypatch.chdir(tmp_path)

    def check(argv: list[str], says: str, exits: int = 2) -> None:
        before = _state(tmp_path)
        code = main(argv)
        out, err = capsys.readouterr()
        assert code == exits, (argv, out, err)
        if exits == 2:
            lines = err.strip().splitlines()
            assert len(lines) == 1 and says in lines[0], err
        else:
            assert not err.strip() and [line for line in out.splitlines() if says in line], out
        assert "Traceback" not in out + err
        assert _state(tmp_path) == before, "a file was created or changed"

    return check


def test_a_trace_nested_two_hundred_thousand_deep(tmp_path: Path, answers_in_one_line: Callable) -> None:
    path = _trace(tmp_path, "[" * 200_000)
    for command in (["replay", str(path)], ["view", str(path)], ["mirror", str(path)]):
        answers_in_one_line(command, "nested deeper than any trace of kvspec's")


def test_a_trace_whose_pool_no_machine_holds(tmp_path: Path, answers_in_one_line: Callable) -> None:
    header = {**HEADER, "config": {**HEADER["config"], "num_gpu_blocks": 10**9}}
    path = _trace(tmp_path, json.dumps({"step": 1, "op": "get_new_blocks", "args": [1]}), header=header)
    for command in (["replay", str(path)], ["view", str(path)]):
        answers_in_one_line(command, "num_gpu_blocks=1000000000 is more than a trace may ask for")


def test_a_trace_file_larger_than_kvspec_reads(tmp_path, answers_in_one_line, monkeypatch) -> None:
    # The bound is 256 MiB; a test does not write that much, so it lowers the bound instead.
    monkeypatch.setattr(trace_module, "MAX_TRACE_BYTES", 64)
    path = _trace(tmp_path, json.dumps({"step": 1, "op": "get_new_blocks", "args": [1]}))
    answers_in_one_line(["replay", str(path)], "is more than kvspec reads")


def test_the_page_never_replaces_its_trace(tmp_path: Path, answers_in_one_line: Callable) -> None:
    path = _trace(tmp_path, json.dumps({"step": 1, "op": "get_new_blocks", "args": [1]}))
    answers_in_one_line(["view", str(path), "-o", str(path)], "is the trace itself")
    answers_in_one_line(["view", str(path), "-o", f"./{path.name}"], "is the trace itself")


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--port", "8080"], "--port goes with --serve"),
        (["--no-open"], "--no-open goes with --serve"),
        (["--serve", "-o", "page.html"], "-o and --serve are two ways"),
    ],
)
def test_view_flags_that_do_nothing_together(tmp_path, answers_in_one_line, flags, says) -> None:
    path = _trace(tmp_path, json.dumps({"step": 1, "op": "get_new_blocks", "args": [1]}))
    answers_in_one_line(["view", str(path), *flags], says)


def test_a_simulated_pool_no_machine_holds_is_refused_before_it_is_built(answers_in_one_line: Callable) -> None:
    answers_in_one_line(["simulate", "--pool", "100000000000000"], "is more than simulate builds (at most 10,000,000")


def test_simulated_pools_that_do_not_fit_in_memory_together(monkeypatch, answers_in_one_line) -> None:
    from kvspec.conformance.tools import simulate

    monkeypatch.setattr(simulate, "available_memory", lambda: 2**30)  # a machine with 1 GiB free
    answers_in_one_line(["simulate", "--pool", "9000000", "8000000", "--jobs", "2"], "need about 3.2 GiB")


_TINY_GPU_BENCH = ["--seconds", "0.001", "--no-hash-map", "--device", "cpu"]


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["bench", "gpu", "--pools", "100", "--batches", "1", "1e12", *_TINY_GPU_BENCH],
         "batches [1000000000000] fit no pool"),
        (["bench", "gpu", "--pools", "1e12", "--batches", "1", *_TINY_GPU_BENCH],
         "a pool of 1,000,000,000,000 blocks needs about"),
        (["bench", "gpu", "--pools", "1e400", "--batches", "1", *_TINY_GPU_BENCH],
         "'1e400' is wider than a 64-bit integer"),
        (["check", "--max-examples", "1" * 400], "'" + "1" * 37 + "...' is wider than a 64-bit integer"),
        (["bench", "gpu", "--pools", "100", "--batches", "1", "--content-blocks", "1e9", *_TINY_GPU_BENCH],
         "the content check's KV, 1,000,000,000 blocks of 1 layers, needs"),
        (["bench", "gpu", "--pools", "1.5e2.5", *_TINY_GPU_BENCH], "'1.5e2.5' is not an integer"),
        (["bench", "gpu", "--batches", "1e-3", *_TINY_GPU_BENCH], "'1e-3' is not an integer"),
        (["bench", "reference", "--sizes", "1e12"], "a pool of 1,000,000,000,000 blocks needs about"),
        (["check", "--max-examples", "1e999999999"], "'1e999999999' is not an integer"),
    ],
)  # fmt: skip
def test_a_benchmark_of_sizes_no_machine_holds_is_refused_before_it_builds(argv, says, answers_in_one_line) -> None:
    answers_in_one_line(argv, says)


def test_a_size_may_be_written_as_the_help_writes_it(capsys: pytest.CaptureFixture[str]) -> None:
    # --help says "default 1e4 1e6": the same spelling is accepted wherever an integer is asked for.
    assert main(["bench", "gpu", "--pools", "1e2", "--batches", "1e0", *_TINY_GPU_BENCH, "--no-content"]) == 0
    assert "       100        1  get_new_blocks" in capsys.readouterr().out


@pytest.mark.parametrize("command", [["mutants", "--list"], ["invariants"]])
def test_a_reader_that_stops_early_gets_no_traceback(tmp_path: Path, command: list[str]) -> None:
    # `kvspec mutants --list | head -1`: the pipe closes while kvspec still writes. `true` reads nothing and
    # is gone long before kvspec (a second of imports) writes its first line, so the pipe is always closed.
    import shutil
    import subprocess
    import sys

    kvspec = shutil.which("kvspec", path=str(Path(sys.executable).parent)) or "kvspec"
    proc = subprocess.run(
        f"{kvspec} {' '.join(command)} | true", shell=True, cwd=tmp_path, capture_output=True, text=True,
        executable="/bin/bash", env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
    )  # fmt: skip
    assert "Traceback" not in proc.stderr
    said = f"kvspec {command[0]}: the output was closed before the command finished"
    assert proc.stderr.strip().splitlines() == [said]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".cache"] or list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["check", "--impl", "vllm@abc"], "not a release number"),
        (["check", "--impl", "vllm@0.34.0; rm -rf /"], "is not a vLLM source tree"),
        (["hashes", "--version", "abc"], "not a release number"),
        (["oracle", "--vllm", "abc"], "abc is not a vLLM release number"),
    ],
)
def test_a_vllm_release_that_is_not_one(argv: list[str], says: str, answers_in_one_line: Callable) -> None:
    answers_in_one_line(argv, says)


def test_a_release_named_by_the_environment_that_is_not_one(monkeypatch, answers_in_one_line: Callable) -> None:
    monkeypatch.setenv("KVSPEC_VLLM_VERSION", "abc")
    answers_in_one_line(["check", "--impl", "vllm", "--level", "pool"], "implementation 'vllm': cannot fetch")


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["diff", "reference", "vllm@0.34.0"], "'reference' is not a vLLM"),
        (["diff", "vllm@abc", "vllm@0.34.0"], "not a release number"),
        (["diff", "vllm@0.33.0", "vllm@0.34.0", "--max-examples", "10001"], "--max-examples: at most 10000"),
    ],
)
def test_a_diff_of_what_is_not_two_vllms(argv: list[str], says: str, answers_in_one_line: Callable) -> None:
    answers_in_one_line(argv, says)


ADAPTERS = "tests.conformance.adapters"


@pytest.mark.parametrize("caching", ["off", "on"])
def test_a_wrong_pool_is_never_conforms_under_ten_jobs_of_one_example(tmp_path_factory, answers_in_one_line,
                                                                     caching) -> None:  # fmt: skip
    # It said "conforms": ten jobs of one example each ran ten trivial examples (a seed's first example is its
    # simplest). The floor of examples holds per job, so this is one job of ten examples, and it diverges.
    traces = tmp_path_factory.mktemp("traces")
    answers_in_one_line(["check", "--impl", f"{ADAPTERS}:make_takes_from_the_right_end", "--level", "pool",
                         "--caching", caching, "--jobs", "10", "--max-examples", "10", "--trace-dir", str(traces)],
                        "what failed: ", exits=1)  # fmt: skip


def _step(index: int, op: str, args: list, **more: object) -> str:
    return json.dumps({"step": index, "op": op, "args": args, **more})


@pytest.mark.parametrize(
    ("steps", "says"),
    [
        ([_step(1, "get_new_blocks", ["abc"])], "step 1 get_new_blocks(num_blocks='abc') is a caller mistake"),
        ([_step(1, "get_new_blocks", [1]), _step(2, "free_blocks", [[10**30]])], "wider than 64 bits"),
        ([_step(1, "get_new_blocks", [1]), _step(2, "touch", [[-1]])], "that the trace does not record as one"),
        ([_step(1, "get_new_blocks", [1]), _step(2, "free_blocks", [[1]]), _step(3, "free_blocks", [[1]])],
         "step 3 free_blocks(block_ids=[1]"),
        ([_step(1, "get_new_blocks", [1], mistake="get_new_blocks: bad count")],
         "records the mistake 'get_new_blocks: bad count', but the spec accepts the call"),
    ],
)  # fmt: skip
def test_replay_refuses_a_step_no_campaign_could_have_sent(tmp_path, answers_in_one_line, steps, says) -> None:
    # Checked when the trace is loaded, before the implementation is built or sent anything.
    path = _trace(tmp_path, *steps)
    answers_in_one_line(["replay", str(path)], says)


def test_replay_sends_a_mistake_the_trace_records(tmp_path: Path, monkeypatch, capsys) -> None:
    # The same double free, recorded as the caller mistake it is: sent, and the reference rejects it as the spec does.
    monkeypatch.chdir(tmp_path)
    free = _step(3, "free_blocks", [[1]], mistake="free_blocks: double free")
    path = _trace(tmp_path, _step(1, "get_new_blocks", [1]), _step(2, "free_blocks", [[1]]), free)
    assert main(["replay", str(path)]) == 0
    assert "verdict: conforms" in capsys.readouterr().out


def test_a_replay_writes_no_trace_unless_asked(tmp_path: Path, monkeypatch, capsys) -> None:
    # A replay that diverges (exit 1) leaves the folder it ran in as it was: the trace replayed is the record.
    monkeypatch.chdir(tmp_path)
    old_traces = Path(__file__).resolve().parents[1] / "data" / "traces_before_the_split"
    recorded = old_traces / "double_free_ignored.trace.jsonl"
    assert main(["replay", str(recorded)]) == 1
    assert "verdict: diverges" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []
    assert main(["replay", str(recorded), "--trace-dir", "kept"]) == 1
    assert [p.parent.name for p in tmp_path.rglob("*.trace.jsonl")] == ["kept"]


@pytest.mark.parametrize(
    ("factory", "says"),
    [
        ("make_exits_on_touch", "what failed: SystemExit(0): the implementation tried to end the process (sys.exit)"),
        ("make_os_exit_on_touch", "what failed: the process died (exit code 3) during this step"),
        ("make_kills_itself_on_touch", "what failed: the process died (signal 9 (SIGKILL)) during this step"),
        ("make_never_returns", "what failed: building the adapter (importing and constructing the implementation) "
         "did not finish within the build time limit of 1 s (--build-timeout)"),
    ],
)  # fmt: skip
def test_an_implementation_that_ends_or_hangs_is_its_fault_with_a_story(tmp_path_factory, answers_in_one_line,
                                                                       factory, says) -> None:  # fmt: skip
    # Exit 1 (the implementation is wrong), never "kvspec failed"; the trace goes where --trace-dir says.
    traces = tmp_path_factory.mktemp("traces")
    answers_in_one_line(["check", "--impl", f"{ADAPTERS}:{factory}", "--level", "pool", "--caching", "on",
                         "--max-examples", "30", "--build-timeout", "1", "--trace-dir", str(traces)],
                        says, exits=1)  # fmt: skip
    assert len(list(traces.iterdir())) == 1


def test_an_implementation_that_exits_building_one_layout_is_its_fault(tmp_path_factory, capsys) -> None:
    # `--groups auto` builds one layout of each mix before the campaign: an exit there is not kvspec's fault,
    # and the mix is drawn, so an example builds it again and tells the story.
    traces = tmp_path_factory.mktemp("traces")
    code = main(["check", "--impl", f"{ADAPTERS}:make_exits_on_chunked_groups", "--level", "manager",
                 "--caching", "on", "--max-examples", "60", "--trace-dir", str(traces)])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 1 and "Traceback" not in out, out
    assert "what failed: building the adapter failed: SystemExit(0): the implementation tried to end the process" in out
    header = r"manager level, num_gpu_blocks=\d+, block_size=\d+, KV cache groups [a-z:0-9,]*chunked:"
    assert re.search(header, out), out


def test_a_slow_import_is_not_a_step_timeout(tmp_path_factory, capsys, monkeypatch) -> None:
    # The first build takes 1.5 s, past the step limit of 1 s and within the build limit (default 300 s).
    monkeypatch.chdir(tmp_path_factory.mktemp("run"))
    code = main(["check", "--impl", f"{ADAPTERS}:make_slow_import", "--level", "pool", "--caching", "off",
                 "--max-examples", "100", "--step-timeout", "1"])  # fmt: skip
    assert code == 0, capsys.readouterr().out


@pytest.mark.parametrize("flag", ["--build-timeout", "--step-timeout"])
def test_a_time_limit_below_a_tenth_of_a_second_is_refused(answers_in_one_line: Callable, flag: str) -> None:
    # Below it, whether a call "hangs" would be the machine's scheduling, and the verdict the implementation's.
    for limit in ("0", "0.001"):
        answers_in_one_line(["check", flag, limit], f"{flag}: must be at least 0.1 seconds")
        answers_in_one_line(["replay", "no.trace.jsonl", flag, limit], f"{flag}: must be at least 0.1 seconds")


def test_a_fault_of_kvspec_itself_is_one_line_with_its_log() -> None:
    # What the child hands back when kvspec's own code raises: one line, the log's path, the traceback in the log.
    from kvspec.conformance.runner.isolation import kvspec_failed

    try:
        raise TypeError("an internal mistake\nsecond line")
    except TypeError as e:
        line = kvspec_failed(e)
    assert "\n" not in line and line.startswith("kvspec itself failed (a bug in kvspec, not in the implementation)")
    log = Path(line.rsplit("full log: ", 1)[1])
    assert "Traceback" in log.read_text() and "an internal mistake" in log.read_text()
    log.unlink()
