"""A fork of vLLM as its users have one: its own package name, torch imported at module level, no file edited.

`vllm@DIR` loads a source tree in light mode (kvspec.conformance.targets.vllm.lightmode.load_tree);
a fork's package (``minifork/v1/core/block_pool.py``, importing ``minifork.*``) is
found and loaded as an alias of ``vllm``, and a device runtime it imports is a
stand-in whose names can be read but not run (kvspec.conformance.targets.loader.DeviceRuntimeModule).
The trees here are the default suite's miniature vLLM (no download); the same on
a real release is in test_vllm_adapter.py.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from kvspec.conformance.core.results import FailureKind
from kvspec.conformance.core.trace import read_trace
from kvspec.conformance.runner.run import run_check
from kvspec.conformance.tools.cli import main
from kvspec.conformance.tools.view import build_view, trace_to_page_data
from kvspec.conformance.tools.view.model import RULES

MINI = Path(__file__).parent / "plugin_fixture" / "mini_vllm" / "vllm"

# What a fork's pool module adds at its top: device runtimes imported, a dtype held, a type tested.
DEVICE_IMPORTS = """\
import torch
import triton.language as tl
from torch.cuda import is_available as _cuda_available

_CACHE_DTYPE = torch.float16


def _is_tensor(x: object) -> bool:
    return isinstance(x, torch.Tensor)
"""


def _fork(folder: Path, name: str = "minifork", *, body: str = "") -> Path:
    """The miniature vLLM as a fork ships it: package ``name``, imports renamed, device runtimes imported.

    ``body``: a statement put first in ``BlockPool.get_new_blocks``.
    """
    shutil.copytree(MINI, folder / name)
    for path in (folder / name).rglob("*.py"):
        text = re.sub(r"\b(from|import) vllm\b", rf"\1 {name}", path.read_text())
        if path.name == "block_pool.py":
            text = text.replace("from __future__ import annotations\n", "from __future__ import annotations\n"
                                + DEVICE_IMPORTS, 1)  # fmt: skip
            if body:
                head = "    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:\n"
                assert head in text
                text = text.replace(head, head + f"        {body}\n", 1)
        path.write_text(text)
    assert "vllm" not in (folder / name / "v1" / "core" / "block_pool.py").read_text()
    return folder


def _tree(folder: Path) -> Path:
    shutil.copytree(MINI, folder / "vllm")
    return folder


@pytest.mark.heavy
def test_a_fork_with_its_own_package_name_checks_exactly_like_the_tree_it_was_made_from(tmp_path) -> None:
    fork, tree = _fork(tmp_path / "fork"), _tree(tmp_path / "tree")
    for caching in (True, False):
        runs = [run_check(f"vllm@{where}", level="pool", enable_caching=caching, max_examples=20, seed=3,
                          trace_dir=tmp_path / "traces", minimize_s=0)
                for where in (fork, tree)]  # fmt: skip
        # The miniature is not a release (it answers some caller mistakes its own way): what matters is
        # that the fork gets the tree's verdict, on the same steps, for the same reason.
        assert runs[0].verdict == runs[1].verdict, [r.failure for r in runs]
        assert runs[0].steps_run == runs[1].steps_run and runs[0].coverage == runs[1].coverage
        failures = [(r.failure.op, r.failure.message) if r.failure else None for r in runs]
        assert failures[0] == failures[1]


def test_a_fork_named_by_its_package_folder_has_the_facts_of_the_tree_it_was_made_from(tmp_path, capsys) -> None:
    # Naming the package's own folder picks one package (a tree may hold several); the facts are the tree's.
    fork, tree = _fork(tmp_path / "fork"), _tree(tmp_path / "tree")
    printed = []
    for name, where in ((fork / "minifork", fork), (tree, tree)):
        code = main(["facts", f"vllm@{name}"])
        out, err = capsys.readouterr()
        assert code == 1 and not err.strip(), err  # the miniature differs from the release it is set beside
        printed.append(out.replace(str(where), "TREE").replace("minifork/", "vllm/"))  # a file it names is its own
    assert printed[0] == printed[1]
    assert "* has_evict_blocks             False" in printed[0]


def test_a_fork_that_runs_a_device_runtime_on_a_pool_path_gets_no_verdict(tmp_path, monkeypatch, capsys) -> None:
    # The stand-in cannot say what torch.cuda.synchronize() would do: kvspec's limit, exit 2, not a crash.
    fork = _fork(tmp_path / "fork", body="torch.cuda.synchronize()")
    monkeypatch.chdir(tmp_path)
    code = main(["check", "--impl", f"vllm@{fork}", "--level", "pool", "--caching", "on", "--max-examples", "5"])
    out, err = capsys.readouterr()
    assert code == 2, out
    assert "could-not-run" in out and "crashed" not in out.lower()
    assert "kvspec cannot run step" in out and "torch.cuda.synchronize() was called" in out
    assert "COULD-NOT-RUN: kvspec's limit at step 1 of 1 (get_new_blocks)" in out, out
    assert "a bug in kvspec" not in out and "Traceback" not in out + err
    # Its trace ends with the call kvspec could not run, its failure of kind `limit` (kvspec's, no bug in the
    # spec), which the page names as such; a replay meets the same limit, never "conforms".
    (trace,) = (tmp_path / "kvspec-traces").glob("*.trace.jsonl")
    recorded = read_trace(trace)
    assert recorded.failure is not None and recorded.failure.kind is FailureKind.LIMIT
    assert json.loads(trace.read_text().splitlines()[-1])["failure"]["kind"] == "limit"
    page = build_view(trace_to_page_data(recorded))
    assert (page["failure"]["rule_label"], page["failure"]["rule"]) == RULES["kvspec_can_run"]
    assert main(["replay", str(trace), "--impl", f"vllm@{fork}"]) == 2
    out, err = capsys.readouterr()
    assert "not sent (kvspec cannot run it: torch.cuda.synchronize() was called" in out
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvspec replay: kvspec cannot run step 1 (get_new_blocks)"), err
    assert "Traceback" not in out + err


@pytest.mark.parametrize(
    ("make", "says"),
    [
        # A device call at import: the tree does not load, and the line says where and what.
        (lambda d: _fork(d, body="").joinpath("minifork", "v1", "core", "block_pool.py").write_text(
            "import torch\nON_GPU = torch.cuda.is_available()\n"), "(at minifork/v1/core/block_pool.py:2)"),
        (lambda d: (_fork(d, "fork_a"), _fork(d, "fork_b")), "holds several vLLM packages (fork_a, fork_b)"),
        (lambda d: _fork(d).joinpath("minifork", "v1", "core", "block_pool.py").write_text("def broken(:\n"),
         "SyntaxError"),
        (lambda d: _fork(d).joinpath("minifork", "v1", "core", "block_pool.py").write_text("X = 1\n"),
         "minifork/v1/core/block_pool.py defines no BlockPool"),
        # A tree that exits as it loads: it was an exit 0 with nothing said, as a conforming run's.
        (lambda d: _fork(d).joinpath("minifork", "v1", "core", "block_pool.py").write_text(
            "import sys\nsys.exit(0)\n"), "does not load (SystemExit: 0)"),
    ],
    ids=["device-call-at-import", "two-packages", "syntax-error", "no-block-pool", "exits-as-it-loads"],
)  # fmt: skip
def test_a_tree_that_does_not_load_is_refused_in_one_line(tmp_path, monkeypatch, capsys, make, says) -> None:
    tree = tmp_path / "tree"
    tree.mkdir()
    make(tree)
    monkeypatch.chdir(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(["check", "--impl", f"vllm@{tree}", "--level", "pool", "--max-examples", "5"]) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and says in lines[0] and "Traceback" not in out + err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no trace folder, nothing written


@pytest.mark.parametrize("has_limit", [True, False, None], ids=["with-hit-limit", "without", "no-request-module"])
def test_a_trees_request_hit_limit_is_read_from_its_files(tmp_path, has_limit) -> None:
    # Light mode runs neither Request nor KVCacheManager, but a tree holds their files: the fact is read from them.
    from kvspec.conformance.targets.vllm.adapter import tree_release
    from kvspec.conformance.targets.vllm.measure import measure_facts

    fork = _fork(tmp_path)
    if has_limit is not None:
        method = "get_max_cache_hit_length" if has_limit else "get_num_computed_tokens"
        request = f"class Request:\n    def {method}(self):\n        return 0\n"
        (fork / "minifork" / "v1" / "request.py").write_text(request)
        (fork / "minifork" / "v1" / "core" / "kv_cache_manager.py").write_text(
            "class KVCacheManager:\n    def get_num_cached_tokens(self, request):\n        return 0\n"
        )
    measured = measure_facts(tree_release(fork))
    if has_limit is None:
        assert "has no minifork/v1/request.py" in measured.not_measured["request_hit_limit"]
    else:
        assert measured.values["request_hit_limit"] is has_limit


# vLLM 0.14 on: cache_full_blocks skips null blocks (a sliding-window table holds them) and with events on
# still publishes the call's BlockStored, of no keys when it named only the null block.
NULL_SKIP = """
    def cache_full_blocks(self, request: Any, blocks: list[KVCacheBlock], num_cached_blocks: int,
                          num_full_blocks: int, block_size: int, kv_cache_group_id: int) -> None:
        if num_cached_blocks >= num_full_blocks:
            return
        keys = []
        for i in range(num_cached_blocks, num_full_blocks):
            if blocks[i].is_null:
                continue
            key = make_block_hash_with_group_id(request.block_hashes[i], kv_cache_group_id)
            blocks[i].block_hash = key
            self.cached_block_hash_to_block.setdefault(key, {})[blocks[i].block_id] = blocks[i]
            keys.append(request.block_hashes[i])
        if self.enable_kv_cache_events:
            toks = request.all_token_ids[num_cached_blocks * block_size : num_full_blocks * block_size]
            self.kv_event_queue.append(BlockStored(keys, None, toks, block_size, None, None, kv_cache_group_id, "GPU"))

    def take_events(self) -> list[Any]:
        events, self.kv_event_queue = self.kv_event_queue, []
        return events
"""
WITH_EVENTS = """
BlockStored = collections.namedtuple(
    "BlockStored", "block_hashes parent_block_hash token_ids block_size lora_name extra_keys group_idx medium")


class BlockPool:
    def __init__(self, num_gpu_blocks: int, enable_caching: bool, hash_block_size: int,
                 enable_kv_cache_events: bool = False) -> None:
        self.enable_kv_cache_events = enable_kv_cache_events
        self.kv_event_queue: list[Any] = []
"""


def _null_block_tree(folder: Path, *, skips_null: bool, touch_null: str = "continue") -> Path:
    """The miniature as a tree of the newest release: it gives the null block a hash and a reference, or,
    with ``skips_null``, skips it as vLLM does (touch and free_blocks from 0.33, cache_full_blocks from 0.14,
    which also publishes its BlockStored); ``touch_null``: what touch does on meeting it."""
    tree = _tree(folder)
    if not skips_null:
        return tree
    path = tree / "vllm" / "v1" / "core" / "block_pool.py"
    text = path.read_text().replace("from collections.abc", "import collections\nfrom collections.abc", 1)
    start, end = text.index("    def cache_full_blocks("), text.index("    def get_new_blocks(")
    text = text[:start] + NULL_SKIP.lstrip("\n") + "\n" + text[end:]
    init = (
        "\n\nclass BlockPool:\n    def __init__(self, num_gpu_blocks: int, enable_caching: bool, hash_block_size: int)"
    )
    init += " -> None:\n"
    remove = "                self.free_block_queue.remove(block)\n"
    touch = "            if block.ref_cnt == 0 and not block.is_null:\n" + remove
    free = "        for block in ordered_blocks:\n"
    null = "            if block.is_null:\n                {}\n"
    for old, new in (
        (init, WITH_EVENTS),
        (touch, null.format(touch_null) + "            if block.ref_cnt == 0:\n" + remove),
        (free, free + null.format("continue")),
    ):
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    path.write_text(text)
    return tree


@pytest.mark.parametrize("skips_null", [True, False], ids=["skips-null", "hashes-null"])
def test_a_tree_that_gives_the_null_block_a_hash_diverges_where_the_release_skips_it(tmp_path, skips_null) -> None:
    # From 0.14 vLLM ignores the null block in cache_full_blocks, declared as such: a change that registers it
    # (a prefix hit could then hand out the null block) diverges instead of being taken for "accepts".
    from kvspec.conformance.core.adapter import AdapterConfig
    from kvspec.conformance.core.lockstep import ConformanceFailure, LockStep
    from kvspec.conformance.targets.vllm.factories import factory_for
    from kvspec.spec.state import BlockHash, BlockId

    h1, h2 = BlockHash(b"hash-1"), BlockHash(b"hash-2")
    null, one = BlockId(0), BlockId(1)
    tree = _null_block_tree(tmp_path, skips_null=skips_null)
    lock = LockStep(factory_for(f"vllm@{tree}"), AdapterConfig("pool", 4, events=True))
    assert lock.checks_events is skips_null
    steps = [
        ("get_new_blocks", (1,), None),
        ("cache_full_blocks", ([null, one], [h2, h1]), ([one], [h1])),
        # named alone: with events on, a BlockStored of no keys, which tells a router nothing
        ("cache_full_blocks", ([null], [h2]), ([], [])),
    ]
    try:
        lock.check()
        for op, args, without in steps:
            lock.call(op, *args, mistake=None if without is None else "bad id", without=without)
            lock.check()
    except ConformanceFailure as f:
        assert not skips_null
        assert (f.failure.step, f.failure.invariant) == (2, "inv_null_block_isolated"), f.failure.message
    else:
        assert skips_null


@pytest.mark.parametrize("touch_null", ["continue", "return"])
def test_a_tree_whose_touch_stops_at_the_null_block_diverges_in_a_short_campaign(tmp_path, touch_null) -> None:
    # The null block is the one bad id a vLLM pool can be sent (the others name no block object), so the
    # harness draws it often enough that a touch which stops at it, leaving the hits after it untaken, shows.
    tree = _null_block_tree(tmp_path, skips_null=True, touch_null=touch_null)
    result = run_check(f"vllm@{tree}", level="pool", enable_caching=True, max_examples=100, seed=3,
                       trace_dir=tmp_path / "traces", minimize_s=0)  # fmt: skip
    if touch_null == "continue":
        assert result.verdict == "conforms", result.failure
    else:
        assert result.verdict == "diverges" and result.failure is not None and result.failure.op == "touch"


@pytest.mark.parametrize("event_group", ["kv_cache_group_id", "0"])
def test_a_tree_whose_events_name_the_wrong_kv_cache_group_diverges(tmp_path, event_group) -> None:
    # The pool level drives a group other than 0 (POOL_GROUP), so an event that drops or zeroes the group id
    # names another key; with group 0 every encoding of the id is four zero bytes and the fault hid.
    from kvspec.conformance.core.adapter import AdapterConfig
    from kvspec.conformance.core.lockstep import ConformanceFailure, LockStep
    from kvspec.conformance.targets.vllm.adapter import POOL_GROUP
    from kvspec.conformance.targets.vllm.factories import factory_for
    from kvspec.spec.state import BlockHash, BlockId

    assert POOL_GROUP != 0
    tree = _null_block_tree(tmp_path, skips_null=True)
    path = tree / "vllm" / "v1" / "core" / "block_pool.py"
    path.write_text(path.read_text().replace('kv_cache_group_id, "GPU"', f'{event_group}, "GPU"'))
    lock = LockStep(factory_for(f"vllm@{tree}"), AdapterConfig("pool", 4, events=True))
    h1 = BlockHash(b"hash-1")
    try:
        lock.check()
        for op, args in (
            ("get_new_blocks", (1,)),
            ("cache_full_blocks", ([BlockId(1)], [h1])),
            ("get_cached_block", (h1,)),
        ):
            lock.call(op, *args)
            lock.check()
    except ConformanceFailure as f:
        assert event_group == "0"
        assert (f.failure.step, f.failure.op) == (2, "cache_full_blocks"), f.failure.message
    else:
        assert event_group == "kv_cache_group_id"


def test_a_tree_that_publishes_a_stored_event_for_a_call_of_no_blocks_diverges(tmp_path) -> None:
    # A keyless BlockStored is forgiven only over positions a mistaken call named (the null block, skipped):
    # one for a call of no blocks is what a pool without its early return publishes at every decode step.
    from kvspec.conformance.core.adapter import AdapterConfig
    from kvspec.conformance.core.lockstep import ConformanceFailure, LockStep
    from kvspec.conformance.targets.vllm.factories import factory_for
    from kvspec.spec.state import BlockHash

    tree = _null_block_tree(tmp_path, skips_null=True)
    path = tree / "vllm" / "v1" / "core" / "block_pool.py"
    path.write_text(path.read_text().replace("if num_cached_blocks >= num_full_blocks:", "if False:", 1))
    lock = LockStep(factory_for(f"vllm@{tree}"), AdapterConfig("pool", 4, events=True))
    lock.check()
    lock.call("cache_full_blocks", [], [BlockHash(b"hash-2")], mistake="length mismatch", without=([], []))
    with pytest.raises(ConformanceFailure, match="published stored"):
        lock.check()
