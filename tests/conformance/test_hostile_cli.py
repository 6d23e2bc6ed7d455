"""Hostile input through the command line: what a user's mistake, a broken adapter or an impossible setting gets.

Each is the command a user types, in a subprocess: one line and exit 2 for what kvspec cannot answer (never a
traceback, never a verdict on the implementation for kvspec's own limit or the user's setting), and the
implementation's verdict where the implementation is what is wrong.
"""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
KVSPEC = [sys.executable, "-m", "kvspec"]
# The example pool, subclassed or wrapped by each adapter below.
PRELUDE = f"import sys\nsys.path.insert(0, {str(EXAMPLES)!r})\nfrom pool_example import ExamplePool, factory as good\n"


def kvspec(*args: str, cwd: Path, timeout: int = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*KVSPEC, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)


def refused(r: subprocess.CompletedProcess[str], says: str) -> None:
    assert r.returncode == 2, r.stdout + r.stderr
    assert says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "Traceback" not in r.stdout + r.stderr


def pool_module(tmp_path: Path, body: str) -> str:
    (tmp_path / "hostile_pool.py").write_text(PRELUDE + textwrap.dedent(body))
    return "hostile_pool.py:factory"


def check(impl: str, tmp_path: Path, *more: str) -> subprocess.CompletedProcess[str]:
    return kvspec("check", "--impl", impl, "--level", "pool", "--caching", "on", "--max-examples", "20",
                  "--cover-rounds", "0", "--trace-dir", str(tmp_path / "traces"), *more, cwd=tmp_path)  # fmt: skip


@pytest.mark.parametrize("layout", ["sliding:99999999999999999999", "full,chunked:1024"])
def test_a_window_no_campaign_can_cross_is_refused_before_anything_is_built(tmp_path, layout):
    # The window rule's prompt grows with the window: a window of 1e20 tokens filled the memory and the
    # verdict blamed the implementation for the process's death.
    says = "a window or chunk of at most 352 tokens, the widest a request-level campaign can cross"
    refused(kvspec("check", "--impl", "spec", "--level", "manager", "--groups", layout, cwd=tmp_path), says)
    refused(kvspec("bench", "harness", "--groups", layout, "--jobs", "1", cwd=tmp_path), says)


def test_a_benchmark_refuses_what_it_cannot_time_before_it_times_anything(tmp_path):
    for seconds in ("nan", "inf", "1e400"):
        r = kvspec("bench", "gpu", "--quick", "--device", "cpu", "--no-content", "--seconds", seconds, cwd=tmp_path)
        refused(r, "--seconds: ")
    r = kvspec("bench", "reference", "--repeat", "5", "--sizes", "100", "--v0-evictor", "bogus", cwd=tmp_path)
    refused(r, "--v0-evictor: 'bogus' is not a release number")
    assert r.stdout == ""  # refused before the benchmark ran
    refused(kvspec("oracle", "--bench", "--bench-version", "bogus", cwd=tmp_path), "'bogus' is not a release number")
    r = kvspec("bench", "reference", "--repeat", "1e12", cwd=tmp_path)  # it ran for ever
    refused(r, "repeat must be from 1 to 1,000,000; got sizes=")


def test_a_module_that_exits_on_import_does_not_import(tmp_path):
    (tmp_path / "exits.py").write_text("import sys\nsys.exit(3)\n")
    refused(check("exits.py:factory", tmp_path), "exits.py does not import (SystemExit: 3)")


def test_a_factory_that_cannot_build_cannot_run_in_a_replay_as_in_a_check(tmp_path):
    impl = pool_module(
        tmp_path,
        """
        def factory(config):
            raise ValueError("constructor boom")
    """,
    )
    trace = ROOT / "docs" / "traces" / "inv_hash_table_consistent.trace.jsonl"
    for r in (check(impl, tmp_path), kvspec("replay", str(trace), "--impl", impl, cwd=tmp_path)):
        said = r.stdout + r.stderr
        assert r.returncode == 2, said
        assert "building the adapter failed" in said and "ValueError: constructor boom" in said
        assert "CRASHED" not in r.stdout


def test_a_build_that_crashed_in_an_example_replays_as_it_crashed(tmp_path):
    # Built for the probe's pool of 8 blocks, not for the examples' pools: each example's build is the crash,
    # and its trace replays to the same verdict.
    impl = pool_module(
        tmp_path,
        """
        def factory(config):
            if config.num_gpu_blocks != 8:
                raise ValueError("only 8 blocks")
            return good(config)
    """,
    )
    r = check(impl, tmp_path)
    assert r.returncode == 1 and "crashed at building the adapter" in r.stdout, r.stdout + r.stderr
    trace = next((tmp_path / "traces").glob("crashed-pool-*.trace.jsonl"))
    again = kvspec("replay", str(trace), "--impl", impl, cwd=tmp_path)
    assert again.returncode == 1 and "crashed at building the adapter" in again.stdout, again.stdout + again.stderr


def test_a_snapshot_of_the_wrong_types_is_the_implementation_diverging_not_kvspec_failing(tmp_path):
    impl = pool_module(
        tmp_path,
        """
        import dataclasses
        class WrongTypes(ExamplePool):
            def snapshot(self):
                s = super().snapshot()
                return dataclasses.replace(s, ref_cnt=("x",) * len(s.ref_cnt))
        def factory(config):
            return WrongTypes(config.num_gpu_blocks, config.enable_caching)
    """,
    )
    r = check(impl, tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "snapshot() returned a malformed Snapshot: its ref_cnt is ('x'," in r.stdout
    assert "kvspec itself failed" not in r.stdout + r.stderr


@pytest.mark.parametrize(
    "body, says",
    [
        (
            "def factory(config):\n    return good(config)\nfactory.levels = 5\n",
            "the factory's declarations are wrong: levels=5, where a tuple of names is read",
        ),
        (
            "class Raising(ExamplePool):\n"
            "    def __getattr__(self, name):\n"
            "        raise RuntimeError('no ' + name)\n"
            "def factory(config):\n    return Raising(config.num_gpu_blocks, config.enable_caching)\n",
            "the adapter's declarations are wrong: reading levels raised RuntimeError: no levels",
        ),
    ],
)
def test_declarations_that_cannot_be_read_are_the_adapters_fault_not_kvspecs(tmp_path, body, says):
    r = check(pool_module(tmp_path, body), tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    assert says in r.stdout and "kvspec itself failed" not in r.stdout, r.stdout


def test_the_gate_refuses_what_is_not_a_checkout_before_either_stage(tmp_path):
    (tmp_path / "base" / "vllm" / "v1" / "core").mkdir(parents=True)
    (tmp_path / "base" / "vllm" / "v1" / "core" / "block_pool.py").write_text("")
    refused(kvspec("gate", "nope", "base", "--out", "out", cwd=tmp_path), "kvspec gate: PR: no such folder nope")
    refused(kvspec("gate", "base", "base", "--out", "out", "--accept", "nope.json", cwd=tmp_path),
            "kvspec gate: --accept: no readable file nope.json")  # fmt: skip
    (tmp_path / "plain").mkdir()
    refused(kvspec("gate", "plain", "base", "--out", "out", cwd=tmp_path), "plain holds no vllm/ folder")
    assert not (tmp_path / "out").exists()


def test_ids_of_any_integer_type_are_read_as_ints(tmp_path):
    # numpy's ints, or any type with __index__: what an implementation over arrays hands back.
    impl = pool_module(
        tmp_path,
        """
        import dataclasses
        class Id:
            def __init__(self, value):
                self.value = value
            def __index__(self):
                return self.value
        class IndexIds(ExamplePool):
            def snapshot(self):
                s = super().snapshot()
                ids = lambda values: tuple(map(Id, values))
                return dataclasses.replace(s, ref_cnt=ids(s.ref_cnt), free_queue=ids(s.free_queue))
        def factory(config):
            return IndexIds(config.num_gpu_blocks, config.enable_caching)
    """,
    )
    r = check(impl, tmp_path, "--max-examples", "100")
    assert r.returncode == 0 and "malformed" not in r.stdout, r.stdout + r.stderr


def test_a_workload_simulate_cannot_read_or_finish_is_refused_before_it_runs(tmp_path):
    # An arrival past the steps a simulation runs was a traceback (WorkloadError) after the whole run; JSON nested
    # deeper than Python's recursion limit was a traceback (RecursionError).
    (tmp_path / "late.jsonl").write_text('{"prompt": [1, 2, 3], "arrival": 99999999999999999999999}\n')
    (tmp_path / "deep.jsonl").write_text('{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    simulate = ("simulate", "--jobs", "1", "--pool", "50", "--workload")
    says = "late.jsonl:1: arrival 99999999999999999999999 with 0 output tokens ends past the 1,000,000 steps"
    refused(kvspec(*simulate, "late.jsonl", cwd=tmp_path), says)
    refused(kvspec(*simulate, "deep.jsonl", cwd=tmp_path), "deep.jsonl:1: nested deeper than any request")


def test_a_pool_of_only_the_null_block_is_refused_not_simulated_to_a_table_of_zeros(tmp_path):
    # It exited 0 with "0 / 0" queries: every request rejected, nothing measured.
    r = kvspec("simulate", "--jobs", "1", "--workload", "none", "--pool", "1", cwd=tmp_path)
    refused(r, "--pool: must be at least 2, the null block and one block to allocate; got 1")


def test_an_accept_file_the_diff_cannot_read_is_refused_before_the_gate_checks_anything(tmp_path):
    # The gate ran its whole check stage first, and its diff stage then refused the file (or, nested too deep,
    # failed with a traceback); a checkout without the pool was refused once by each stage.
    (tmp_path / "bad.json").write_text("not json\n")
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000 + "\n")
    for tree in ("pr", "base"):
        (tmp_path / tree / "vllm" / "v1" / "core").mkdir(parents=True)
        (tmp_path / tree / "vllm" / "v1" / "core" / "block_pool.py").write_text("")
    (tmp_path / "empty" / "vllm").mkdir(parents=True)
    gate = ("gate", "pr", "base", "--out", "out", "--accept")
    refused(kvspec(*gate, "bad.json", cwd=tmp_path), "kvspec gate: --accept: cannot read bad.json as a list of changes")
    refused(kvspec(*gate, "deep.json", cwd=tmp_path), "cannot read deep.json as a list of changes (nested too deep)")
    refused(kvspec("diff", "vllm@0.33.0", "vllm@0.34.0", "--accept", "deep.json", cwd=tmp_path),
            "kvspec diff: --accept: cannot read deep.json as a list of changes (nested too deep)")  # fmt: skip
    refused(kvspec("gate", "empty", "base", "--out", "out", cwd=tmp_path),
            "PR: empty is not a vLLM source tree: it has no vllm/v1/core/block_pool.py")  # fmt: skip
    assert not (tmp_path / "out").exists()


def test_a_z3_timeout_is_one_z3_can_keep_and_its_timeout_is_not_read_as_vacuous_hypotheses(tmp_path):
    # z3 counts whole milliseconds in 32 bits: 0.0001 s became 0 (no limit at all) and 4294968 s wrapped to 0.7 s.
    for seconds in ("0.0001", "4294968", "1e12"):
        refused(kvspec("prove", "--lemma", "7", "--timeout", seconds, cwd=tmp_path),
                f"--timeout: must be from 0.001 (a millisecond) to 604800 seconds (a week); got {seconds}")  # fmt: skip
    pytest.importorskip("z3")
    # At a millisecond z3 may give up on whether any state satisfies the hypotheses: that was reported as
    # "vacuous" (no state satisfies them), a claim about the lemma that z3 never made.
    r = kvspec("prove", "--lemma", "7", "--profile", "vllm-v1", "--timeout", "0.001", cwd=tmp_path)
    # Proved (0) or, where z3 gave up, no verdict (2): never a wrong answer (1) for z3's own limit.
    assert r.returncode in (0, 2) and "Traceback" not in r.stderr, r.stdout + r.stderr
    assert "no state of size" not in r.stdout, r.stdout  # the reason a vacuous verdict gives


def test_mutants_refuse_a_budget_no_campaign_takes_before_the_control_runs(tmp_path):
    # The control's campaign refused it instead, and the refusal read as the reference not conforming.
    only = ("mutants", "--only", "ref_cnt_underflow")
    refused(kvspec(*only, "--time-budget", "1e12", cwd=tmp_path),
            "kvspec mutants: --time-budget: must be at most 604800 seconds (a week); got 1e+12")  # fmt: skip
    refused(kvspec(*only, "--max-examples", "1e10", cwd=tmp_path), "kvspec mutants: --max-examples: must be at most")
    assert not (tmp_path / "kvspec-traces").exists()
    # A budget too small to conclude is no verdict on the reference, and is not said as one.
    r = kvspec(*only, "--max-examples", "5", "--time-budget", "0.001", cwd=tmp_path)
    refused(r, "the check of the unmutated reference reached no verdict (inconclusive")
    assert "does not conform" not in r.stderr


def test_mutants_list_as_json_is_json(tmp_path):
    # --json was ignored with --list: the table came out where a script reads JSON.
    import json

    r = kvspec("mutants", "--list", "--json", "--only", "ref_cnt_underflow", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert [m["name"] for m in json.loads(r.stdout)] == ["ref_cnt_underflow"]


def test_the_oracle_refuses_what_each_worker_would_before_any_worker_starts(tmp_path):
    # --time-budget 1e12 overflowed a timer in a traceback; --max-examples 1e12 and a plugin's base release
    # that is no release came back as a matrix of could-not-run; --all silently outvoted --vllm.
    oracle = ("oracle", "--vllm", "0.34.0")
    refused(kvspec(*oracle, "--time-budget", "1e12", cwd=tmp_path),
            "kvspec oracle: --time-budget: must be at most 604800 seconds (a week); got 1e+12")  # fmt: skip
    refused(kvspec(*oracle, "--max-examples", "1e12", cwd=tmp_path), "kvspec oracle: --max-examples: must be at most")
    refused(kvspec(*oracle, "--all", cwd=tmp_path), "kvspec oracle: --all and --vllm each name the releases")
    refused(kvspec("oracle", "--plugins", "kvcached@bogus", cwd=tmp_path),
            "kvspec oracle: kvcached@bogus: 'bogus' is not a vLLM release number")  # fmt: skip
    refused(kvspec("oracle", "--plugins", "kvcached@", cwd=tmp_path), "unknown plugin target 'kvcached@'")
    assert not (tmp_path / "kvspec-oracle-traces").exists()


@pytest.mark.parametrize(
    "flags, says",
    [
        (("--jobs", "1000"), "--jobs: must be at most 64"),
        (("--seed", "-1"), "--seed: must be at least 0; got -1"),
        (("--max-examples", "1e12"), "--max-examples: must be at most 1000000000"),
    ],
)
def test_the_harness_benchmark_refuses_a_campaign_it_cannot_run_before_timing_any(tmp_path, flags, says):
    # Each was a table of could-not-run rows, one per layout and job count.
    r = kvspec("bench", "harness", "--groups", "full", *flags, cwd=tmp_path)
    refused(r, f"kvspec bench harness: {says}")
    assert r.stdout == ""


def test_a_cache_named_by_the_environment_that_is_no_folder_is_said_so(tmp_path, monkeypatch):
    # It was "FileExistsError: [Errno 17] File exists: '/dev/null'", said before anything was downloaded.
    monkeypatch.setenv("KVSPEC_PLUGIN_CACHE", str(tmp_path / "a-file"))
    (tmp_path / "a-file").write_text("")
    r = kvspec("check", "--impl", "kvcached", "--level", "pool", "--caching", "on", "--max-examples", "5", cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stdout + r.stderr, r.stdout + r.stderr
    assert f"NotADirectoryError: the cache {tmp_path / 'a-file'} is not a folder" in r.stdout


_ON_FREE = "class P(ExamplePool):\n    def free_blocks(self, ids):\n        super().free_blocks(ids)\n        {}\n"
_GETS = "class P(ExamplePool):\n    def get_new_blocks(self, n):\n        got = super().get_new_blocks(n)\n        {}\n"
_BUILD = "def factory(config):\n    return P(config.num_gpu_blocks, config.enable_caching)\n"


@pytest.mark.parametrize(
    "body, says",
    [
        ("class Mine(BaseException):\n    pass\n" + _ON_FREE.format("raise Mine('its own')"), "Mine: its own (at"),
        (_ON_FREE.format("raise GeneratorExit('gx')"), "GeneratorExit: gx (at"),
        ("class E(Exception):\n    def __str__(self):\n        raise E()\n" + _ON_FREE.format("raise E()"),
         "E: <its str() raised E> (at"),
        ("import signal\n" + _ON_FREE.format(
            "signal.signal(signal.SIGINT, signal.default_int_handler); raise KeyboardInterrupt"),
         "KeyboardInterrupt: raised by the implementation itself, not by a Ctrl-C"),
        (_GETS.format("return (b if b != 1 else 1 // 0 for b in got)"),
         "reading its result (generator) failed: ZeroDivisionError: integer division or modulo by zero (at"),
        ("class Bad:\n    def __index__(self):\n        raise RuntimeError('index')\n" + _GETS.format(
            "return [Bad() for b in got]"), "reading its result (list) failed: RuntimeError: index (at"),
        (_GETS.format("return [10**5000 for b in got]"), "an integer of 16610 bits is not a block id"),
        ("import dataclasses\nclass P(ExamplePool):\n    def snapshot(self):\n        s = super().snapshot()\n"
         "        return dataclasses.replace(s, ref_cnt=(10**5000,) * len(s.ref_cnt))\n",
         "its ref_cnt holds an integer past any block id or count"),
        ("import dataclasses\nclass Ids(tuple):\n    def __repr__(self):\n        raise RuntimeError('repr')\n"
         "class P(ExamplePool):\n    def snapshot(self):\n        s = super().snapshot()\n"
         "        return dataclasses.replace(s, free_queue=Ids(s.free_queue))\n",
         "malformed Snapshot: reading it raised RuntimeError: repr (at"),
    ],
)  # fmt: skip
def test_what_only_the_implementations_code_raises_is_its_verdict_and_replays_so(tmp_path, body, says):
    # Each was "kvspec itself failed (a bug in kvspec ...)": a BaseException of the implementation's own, an
    # exception whose str() raised, a KeyboardInterrupt under a SIGINT handler it set itself, a result or
    # snapshot whose reading ran its code (a generator, __index__, __repr__) or held an int too long to print.
    impl = pool_module(tmp_path, body + _BUILD)
    r = check(impl, tmp_path)
    assert r.returncode == 1 and says in r.stdout, r.stdout + r.stderr
    assert "kvspec itself failed" not in r.stdout and "Traceback" not in r.stdout + r.stderr, r.stdout + r.stderr
    trace = next((tmp_path / "traces").glob("*.trace.jsonl"))
    again = kvspec("replay", str(trace), "--impl", impl, cwd=tmp_path)
    assert again.returncode == 1 and says in again.stdout, again.stdout + again.stderr


def test_a_snapshot_of_a_subclass_is_read_by_its_fields_not_its_own_comparison(tmp_path):
    # Its __eq__ raising was "kvspec itself failed": the checks compared with the subclass's own __eq__.
    impl = pool_module(
        tmp_path,
        textwrap.dedent("""
        from kvspec.spec.state import Snapshot
        class S(Snapshot):
            def __eq__(self, other):
                raise RuntimeError("eq")
            __hash__ = None
        class P(ExamplePool):
            def snapshot(self):
                s = super().snapshot()
                return S(**{f: getattr(s, f) for f in s.__dataclass_fields__})
    """)
        + _BUILD,
    )
    r = check(impl, tmp_path)
    assert r.returncode == 0 and "conforms" in r.stdout, r.stdout + r.stderr


def test_a_factory_that_raises_a_base_exception_of_its_own_is_the_implementation_crashing(tmp_path):
    # The probe before the campaign let it through: "kvspec itself failed".
    impl = pool_module(
        tmp_path,
        """
        class Mine(BaseException):
            pass
        def factory(config):
            raise Mine("no pool today")
        factory.levels = ("pool",)
    """,
    )
    r = check(impl, tmp_path)
    assert r.returncode == 1 and "Traceback" not in r.stdout + r.stderr, r.stdout + r.stderr
    assert "building the adapter failed: Mine: no pool today" in r.stdout and "kvspec itself failed" not in r.stdout


def test_a_memory_size_no_memory_has_and_a_device_capacity_would_ignore_are_refused(tmp_path):
    layout = ("--layers", "1", "--kv-heads", "1", "--head-dim", "1")
    # It printed num_gpu_blocks of 40 digits for 1e29 TiB, and read --device cuda:0 beside --gpu-mem as nothing.
    r = kvspec("capacity", "--gpu-mem", "99999999999999999999999999999TiB", *layout, cwd=tmp_path)
    refused(r, "--gpu-mem: '99999999999999999999999999999TiB' is more than 2^63 bytes (8 EiB)")
    refused(kvspec("capacity", "--gpu-mem", "80GiB", "--weights", "1e9999TB", *layout, cwd=tmp_path), "--weights: ")
    r = kvspec("capacity", "--gpu-mem", "80GiB", "--device", "cuda:0", *layout, cwd=tmp_path)
    refused(r, "kvspec capacity: --gpu-mem gives the memory and --device reads it from a device; give one")
    r = kvspec("capacity", "--gpu-mem", "1.1GB", *layout, "--json", "-", cwd=tmp_path)
    assert r.returncode == 0 and '"memory_bytes": 1100000000,' in r.stdout, r.stdout + r.stderr


def test_an_empty_path_is_refused_not_taken_for_the_current_folder(tmp_path):
    # Path("") is "."; --json "" said "is a folder", --trace-dir "" wrote into the current folder.
    refused(kvspec("errors", "--json", "", cwd=tmp_path), "kvspec errors: --json: an empty path; give a path")
    refused(kvspec("check", "--impl", "spec", "--trace-dir", "", cwd=tmp_path), "--trace-dir: an empty path")
    r = kvspec("simulate", "--workload", "", "--pool", "100", "--jobs", "1", cwd=tmp_path)
    refused(r, "kvspec simulate: --workload '' is neither a built-in workload")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "args",
    [
        ("hashes", "--version", ""),  # loaded the installed vLLM, as if no release were named
        ("hashes", "--version", "0.34.0\n"),  # a release number with a newline read as one
        ("bench", "reference", "--sizes", "100", "--repeat", "1", "--v0-evictor", ""),  # ran without the v0 row
        ("oracle", "--bench", "--bench-version", ""),  # benchmarked the newest release instead
    ],
)
def test_a_release_that_is_no_release_number_is_refused_before_anything_is_fetched_or_timed(tmp_path, args):
    r = kvspec(*args, cwd=tmp_path)
    refused(r, f"{args[-1]!r} is not a release number such as 0.34.0 or 0.8.5.post1")
    assert r.stdout == ""


def test_a_release_number_with_a_newline_is_no_release_number():
    from kvspec.conformance.targets.archives import is_release_number

    assert is_release_number("0.34.0") and not is_release_number("0.34.0\n")


def test_the_gpu_benchmark_refuses_thread_counts_that_crash_torch_and_an_empty_content_check(tmp_path):
    pytest.importorskip("torch")
    grid = ("bench", "gpu", "--device", "cpu", "--pools", "100", "--batches", "1", "--seconds", "0.01")
    # --threads 100000 died of a segmentation fault in torch's thread pool, after the table's header
    r = kvspec(*grid, "--no-content", "--threads", "100000", cwd=tmp_path)
    refused(r, "threads at most 256; got threads=100000")
    # --content-blocks 0 ran the default 1,000 blocks; with --content-layers auto it divided by zero
    for more in ((), ("--content-layers", "auto")):
        refused(kvspec(*grid, "--content-blocks", "0", *more, cwd=tmp_path), "got threads=1 content_blocks=0")


def test_a_workload_no_pool_can_hold_measures_nothing_and_says_so(tmp_path):
    # It printed a hit rate of 0.0% over 0 / 0 queries and exited 0.
    (tmp_path / "long.jsonl").write_text('{"prompt": [' + ", ".join(["1"] * 4000) + "]}\n")
    r = kvspec("simulate", "--workload", "long.jsonl", "--pool", "100", "--jobs", "1", cwd=tmp_path)
    refused(r, "every request of long.jsonl is larger than every pool even alone, so nothing was measured")
    r = kvspec("simulate", "--workload", "long.jsonl", "--pool", "100", "1000", "--jobs", "1", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    small = next(line for line in r.stdout.splitlines() if line.startswith("vllm-v1  16     100 "))
    assert small.split()[3:7] == ["-", "0", "/", "0"], small


@pytest.mark.parametrize(
    "command",
    ["capacity", "demo", "errors", "invariants", "contracts", "simulate", "hashes", "bench", "mirror", "facts",
     "bench reference", "bench gpu", "bench harness"],
)  # fmt: skip
def test_every_command_says_its_exit_codes_in_its_help(tmp_path, command):
    r = kvspec(*command.split(), "--help", cwd=tmp_path)
    said = " ".join(r.stdout.lower().split())
    assert r.returncode == 0 and ("exit codes:" in said or "exit 0 when" in said), r.stdout


def test_a_module_that_never_finishes_loading_is_refused_at_the_build_time_limit(tmp_path):
    # Its top level ran in kvspec's own process before any campaign's time limit was in force: the command
    # hung with nothing said.
    impl = pool_module(tmp_path, "while True:\n    pass\n")
    r = check(impl, tmp_path, "--build-timeout", "1")
    refused(r, "loading it took more than 1 s (--build-timeout)")
    assert not (tmp_path / "traces").exists()
    trace = ROOT / "docs" / "traces" / "inv_ref_cnt_nonnegative.trace.jsonl"
    r = kvspec("replay", str(trace), "--impl", impl, "--build-timeout", "1", cwd=tmp_path)
    refused(r, "loading it took more than 1 s (--build-timeout)")
