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
