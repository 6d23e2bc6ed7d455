"""`kvspec simulate`: the scheduler's counts on workloads small enough to check by hand, workload files, the CLI."""

from __future__ import annotations

import json
import re

import pytest

from kvspec.conformance.tools.cli import main
from kvspec.conformance.tools.simulate import SimRequest, WorkloadError, read_workload, simulate
from kvspec.conformance.tools.workloads import WORKLOADS, builtin_workload
from kvspec.reference.kv_cache_manager import KVCacheManager

# A (10 tokens) generates 2; B arrives after A finished and shares A's first 8 tokens.
A = SimRequest(tuple(range(10)), (50, 51), arrival=0)
B = SimRequest(tuple(range(8)) + (90, 91, 92), (60,), arrival=5)


def test_a_shared_prefix_is_counted_as_vllm_counts_hits():
    r = simulate([A, B], block_size=4, num_gpu_blocks=10)
    # A: 10 tokens looked up, none cached. B: 11 tokens, its first two blocks (8 tokens) cached by A.
    assert (r.queries, r.hits, r.finished, r.rejected, r.preemptions, r.evictions) == (21, 8, 2, 0, 0, 0)
    assert r.hit_rate == pytest.approx(8 / 21)
    assert r.counted_by == "manager"  # the reference's own prefix_cache_stats, as an operator reads them
    assert r.peak_blocks_held == 3  # A's 12 tokens, in 3 blocks
    # A holds 3 blocks (12 slots) for 10 tokens at admission, 11 after one decode step, then frees.
    assert 0 < r.tail_share < 0.25


def test_without_caching_nothing_hits_and_a_small_pool_evicts():
    assert simulate([A, B], block_size=4, num_gpu_blocks=10, enable_caching=False).hits == 0
    # A pool of 3 usable blocks: B's admission reallocates A's cached tail block.
    r = simulate([A, B], block_size=4, num_gpu_blocks=4)
    assert r.hits == 8 and r.evictions == 1


def test_a_decode_that_finds_no_block_preempts_the_newest_request_and_every_request_finishes():
    long_a = SimRequest(tuple(range(4)), tuple(range(100, 108)), arrival=0)
    long_b = SimRequest(tuple(range(200, 204)), tuple(range(300, 308)), arrival=0)
    built: list[KVCacheManager] = []

    def manager() -> KVCacheManager:
        built.append(KVCacheManager(5, 4))
        return built[-1]

    r = simulate([long_a, long_b], block_size=4, num_gpu_blocks=5, manager=manager)
    assert r.finished == 2 and r.preemptions >= 1 and r.rejected == 0
    # the preempted request is looked up (and counted) again when it is recomputed
    assert r.queries > 8
    assert built[0].req_to_blocks == {}  # everything freed at the end
    built[0].check_invariants()


def test_a_request_larger_than_the_pool_is_rejected_and_the_rest_go_on():
    huge = SimRequest(tuple(range(100)), (), arrival=0)
    r = simulate([huge, A], block_size=4, num_gpu_blocks=6)
    assert (r.rejected, r.finished) == (1, 1)
    # one that fits but outgrows the pool while it decodes, alone: rejected, not recomputed forever
    grows = SimRequest(tuple(range(4)), tuple(range(100, 140)), arrival=0)
    r = simulate([grows, A], block_size=4, num_gpu_blocks=6, max_steps=500)
    assert (r.rejected, r.finished, r.preemptions) == (1, 1, 0)


def test_builtin_workloads_are_seeded_and_each_shares_what_it_says():
    for name in WORKLOADS:
        assert builtin_workload(name, 3) == builtin_workload(name, 3)
        assert builtin_workload(name, 3) != builtin_workload(name, 4)
    none = simulate(builtin_workload("none")[:40], block_size=64, num_gpu_blocks=4000)
    assert none.hits == 0
    few = simulate(builtin_workload("few-shot")[:40], block_size=64, num_gpu_blocks=4000)
    assert few.hit_rate > 0.5  # a 400-token template ahead of every short question
    with pytest.raises(KeyError, match="built in: chat, rag, few-shot, none"):
        builtin_workload("nope")


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{", "not JSON"),
        ("[1, 2]", "a request is a JSON object"),
        ('{"output": [1]}', "no prompt"),
        ('{"prompt": []}', "prompt must be a non-empty list"),
        ('{"prompt": [1, -2]}', "not a non-negative integer token id"),
        ('{"prompt": [1, true]}', "not a non-negative integer token id"),
        ('{"prompt": [1], "arrival": -1}', "arrival must be a non-negative integer"),
        ('{"prompt": [1], "lora": 3}', "lora must be a non-empty string"),
        ('{"prompt": [1], "salt": "x"}', "unknown field(s) salt"),
    ],
)
def test_a_bad_workload_line_is_named_by_its_number(tmp_path, line, message):
    path = tmp_path / "w.jsonl"
    path.write_text('{"prompt": [1, 2, 3]}\n\n' + line + "\n")
    with pytest.raises(WorkloadError, match=r"w\.jsonl:3: .*" + re.escape(message)):
        read_workload(path)


def _write_workload(path):
    lines = [
        {"prompt": list(range(10)), "output": [50, 51]},
        {"prompt": list(range(8)) + [90, 91, 92], "output": [60], "arrival": 5, "lora": "a", "cache_salt": "t"},
        {"prompt": list(range(8)) + [7], "arrival": 6},
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_the_cli_prints_a_row_per_configuration_and_writes_json_and_a_plot(tmp_path, capsys):
    workload = _write_workload(tmp_path / "mine.jsonl")
    out, png = tmp_path / "out.json", tmp_path / "hit.png"
    argv = ["simulate", "--workload", str(workload), "--block-size", "4", "8", "--pool", "4", "32",
            "--profile", "vllm-v1", "vllm-v1-tail", "--json", str(out), "--plot", str(png), "--jobs", "2"]  # fmt: skip
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "3 requests" in text and text.count("vllm-v1-tail") == 4
    data = json.loads(out.read_text())
    assert len(data["results"]) == 8 and data["requests"] == 3
    one = next(r for r in data["results"] if (r["profile"], r["block_size"], r["num_gpu_blocks"]) == ("vllm-v1", 4, 32))
    # the salted, LoRA request shares nothing with A; the third hits A's first two blocks (8 of its 9 tokens)
    assert (one["queries"], one["hits"]) == (10 + 11 + 9, 8)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # one process gives the same numbers
    again = tmp_path / "again.json"
    assert main([*argv[: argv.index("--json")], "--json", str(again), "--jobs", "1"]) == 0
    assert json.loads(again.read_text())["results"] == data["results"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--workload", "nope"], "neither a built-in workload"),
        (["--block-size", "0"], "--block-size: must be at least 1"),
        (["--pool", "-3"], "--pool"),
        (["--profile", "lru"], "unknown profile 'lru'"),
        (["--plot", "/nonexistent/dir/x.png"], "does not exist"),
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(capsys, argv, message):
    assert main(["simulate", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_a_bad_workload_file_is_one_line_with_its_line_number(tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": [1]}\n{"prompt": "abc"}\n')
    assert main(["simulate", "--workload", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}:2: prompt must be a non-empty list" in err and "Traceback" not in err


def test_the_cli_names_requests_too_large_for_the_pool(tmp_path, capsys):
    path = tmp_path / "w.jsonl"
    path.write_text('{"prompt": [1, 2, 3]}\n{"prompt": ' + json.dumps(list(range(40))) + "}\n")
    assert main(["simulate", "--workload", str(path), "--block-size", "4", "--pool", "5", "--jobs", "1"]) == 0
    assert "block 4, pool 5: 1 request(s) rejected, larger than the pool" in capsys.readouterr().out


def test_the_managers_counters_agree_with_what_the_scheduler_saw_preemptions_included():
    """The counters count a re-admission apart (its num_preemptions is raised), and add up to the scheduler's."""
    long_a = SimRequest(tuple(range(4)), tuple(range(100, 108)), arrival=0)
    long_b = SimRequest(tuple(range(200, 204)), tuple(range(300, 308)), arrival=0)
    built: list[KVCacheManager] = []

    def manager() -> KVCacheManager:
        built.append(KVCacheManager(5, 2))
        return built[-1]

    r = simulate([long_a, long_b], block_size=2, num_gpu_blocks=5, manager=manager)
    assert r.preemptions > 0 and r.counted_by == "manager"
    stats = built[0].prefix_cache_stats()
    assert stats.local.preempted_requests == r.preemptions and stats.local.requests == 2

    class NoCounters:
        """The same manager without its counters: the scheduler counts."""

        def __init__(self) -> None:
            self._m = KVCacheManager(5, 2)
            self.get_computed_blocks, self.allocate_slots, self.free = (
                self._m.get_computed_blocks, self._m.allocate_slots, self._m.free,
            )  # fmt: skip
            self.snapshot = self._m.snapshot

    counted = simulate([long_a, long_b], block_size=2, num_gpu_blocks=5, manager=NoCounters)
    assert counted.counted_by == "scheduler" and (counted.queries, counted.hits) == (r.queries, r.hits)
