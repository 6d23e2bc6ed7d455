"""The overlay mechanism on a plugin written here, without downloads (kvspec.conformance.targets.plugins).

The base is a miniature vLLM release (plugin_fixture/mini_vllm: a pool with
vLLM 0.33's shapes and free order), zipped into a wheel and loaded by light
mode as any release is. The plugin (plugin_fixture/tailfree) replaces vLLM's
free_blocks on import, as vLLM plugins do; plugin_fixture/plugin.py is the
`module:function` a user writes from the overlay's documentation.
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import tarfile
import types
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvspec.conformance.core.adapter import AdapterConfig
from kvspec.conformance.core.results import Failure, FailureKind, Verdict
from kvspec.conformance.runner.registry import FactoryError, find_target, load_factory
from kvspec.conformance.runner.run import replay, run_check
from kvspec.conformance.targets.plugins import kvcached_device
from kvspec.conformance.targets.plugins.dist import PluginDist, fetch_dist
from kvspec.conformance.targets.plugins.findings import Finding, PluginProbe, match_finding, run_probe
from kvspec.conformance.targets.plugins.overlay import Overlay, OverlayError, load_overlay
from kvspec.conformance.targets.plugins.targets import TARGETS, factory_for
from kvspec.conformance.targets.vllm import lightmode
from kvspec.conformance.targets.vllm.adapter import make_pool_adapter
from kvspec.conformance.tools.plugin_matrix import PluginRow, format_plugin_matrix
from tests.conformance.miniature import miniature_release

FIXTURE = Path(__file__).parent / "plugin_fixture"
MINI = "0.0.1"  # the miniature release's version
OVERLAY = f"overlay:vllm@{MINI}+tests.conformance.plugin_fixture.plugin:apply"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", autouse=True)
def mini_release(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The miniature release in a light-mode cache of its own, named by $KVSPEC_VLLM_CACHE (children inherit it)."""
    yield from miniature_release(tmp_path_factory, MINI, FIXTURE / "mini_vllm")


def _overlay(placeholders: dict[str, object] | None = None) -> Overlay:
    return load_overlay(MINI, {"tailfree": FIXTURE}, label="tailfree on the miniature", placeholders=placeholders)


def _pool_adapter(overlay: Overlay, n: int = 6) -> object:
    return make_pool_adapter(overlay.vllm_release(), AdapterConfig(level="pool", num_gpu_blocks=n))


# --- the overlay ---------------------------------------------------------------------------


def test_a_plugin_module_patches_its_own_copy_of_the_release_only() -> None:
    overlay = _overlay()
    patch = overlay.import_plugin("tailfree.patch")
    assert overlay.module("vllm.v1.core.block_pool").BlockPool.free_blocks is patch.free_blocks
    # the release as every other check loads it keeps vLLM's own method
    assert lightmode.load_release(MINI).BlockPool.free_blocks is not patch.free_blocks
    assert "tailfree" not in sys.modules and "vllm" not in sys.modules


def test_freed_blocks_go_where_the_patch_puts_them() -> None:
    adapter = _pool_adapter(_overlay_applied())
    ids = adapter.get_new_blocks(3)
    assert ids == [1, 2, 3]
    adapter.free_blocks([3, 2])
    # vLLM (and the miniature) put blocks without a hash at the left end; the patch appends them
    assert adapter.snapshot().free_queue == (4, 5, 3, 2)


def _overlay_applied() -> Overlay:
    overlay = _overlay()
    overlay.import_plugin("tailfree.patch")
    return overlay


def test_device_runtimes_do_not_import_in_plugin_code_and_package_inits_do_not_run() -> None:
    overlay = _overlay()
    patch = overlay.import_plugin("tailfree.patch")  # tailfree/__init__.py raises if run
    assert patch.HAS_DEVICE is False  # whether or not torch is installed here


def test_a_placeholder_stands_in_for_a_device_module_and_importlib_is_bound_to_the_release() -> None:
    def device(_: Overlay) -> types.ModuleType:
        module = types.ModuleType("tailfree.device")
        module.__dict__["allocator_name"] = lambda: "the placeholder"
        return module

    overlay = _overlay({"tailfree.device": device})
    probe = overlay.import_plugin("tailfree.probe")
    assert probe.ALLOCATOR == "the placeholder"
    assert probe.block_pool is overlay.module("vllm.v1.core.block_pool")


def test_a_missing_plugin_module_is_named() -> None:
    overlay = _overlay()
    with pytest.raises(OverlayError, match=r"importing tailfree\.probe failed: .*no module 'tailfree\.device'"):
        overlay.import_plugin("tailfree.probe")
    with pytest.raises(OverlayError, match=r"'elsewhere\.x' is not in a plugin package"):
        overlay.import_plugin("elsewhere.x")


def test_a_hook_runs_after_every_pool_constructor_and_a_pool_class_replaces_the_release_s() -> None:
    overlay = _overlay()
    seen: list[int] = []
    overlay.after_pool_init(lambda pool: seen.append(pool.num_gpu_blocks))
    _pool_adapter(overlay, n=5)
    assert 5 in seen  # the adapter also probes a 2-block pool for a null block
    base = overlay.release.BlockPool

    def smaller(num_gpu_blocks: int, enable_caching: bool, hash_block_size: int = 16) -> object:
        return base(num_gpu_blocks, enable_caching, hash_block_size)

    overlay.use_pool_class(smaller)
    assert _pool_adapter(overlay, n=4).snapshot().free_queue == (1, 2, 3)


# --- the plugin checked by name -------------------------------------------------------------


def test_the_overlay_s_function_may_be_named_by_its_file(tmp_path: Path) -> None:
    # As --impl names a factory elsewhere: path/to/file.py:function, the file's folder first on the path.
    by_file = f"overlay:vllm@{MINI}+{FIXTURE / 'plugin.py'}:apply"
    tail = run_check(by_file, level="pool", profile="vllm-v1-tail", max_examples=30, isolate=False, trace_dir=tmp_path)
    assert tail.verdict is Verdict.CONFORMS, tail.failure.story if tail.failure else tail.message
    with pytest.raises(FactoryError, match=r"cannot find .*nowhere\.py:apply \(implementation .*: no such file"):
        load_factory(f"overlay:vllm@{MINI}+{tmp_path / 'nowhere.py'}:apply")


def test_the_documented_module_function_conforms_to_the_profile_the_patch_gives(tmp_path: Path) -> None:
    tail = run_check(OVERLAY, level="pool", profile="vllm-v1-tail", max_examples=30, isolate=False, trace_dir=tmp_path)
    assert tail.verdict is Verdict.CONFORMS, tail.failure.story if tail.failure else tail.message
    v1 = run_check(OVERLAY, level="pool", profile="vllm-v1", max_examples=30, isolate=False, trace_dir=tmp_path)
    assert v1.verdict is Verdict.DIVERGES and v1.failure is not None
    assert v1.failure.op == "free_blocks" and "free_queue" in v1.failure.message
    # the trace names the overlay, and replays to the same verdict from that name
    again = replay(v1.failure.trace_path, OVERLAY, isolate=False, trace_dir=tmp_path)
    assert again.verdict is Verdict.DIVERGES


def test_the_release_without_the_plugin_conforms_to_vllm_v1(tmp_path: Path) -> None:
    overlay = _overlay()  # nothing applied: the release itself

    def plain(config: AdapterConfig) -> object:
        return make_pool_adapter(overlay.vllm_release(), config)

    result = run_check(plain, level="pool", profile="vllm-v1", max_examples=30, isolate=False, trace_dir=tmp_path)
    assert result.verdict is Verdict.CONFORMS, result.failure.story if result.failure else result.message


def test_an_overlay_provides_the_pool_level_only(tmp_path: Path) -> None:
    result = run_check(OVERLAY, level="manager", max_examples=5, isolate=False, trace_dir=tmp_path)
    assert result.verdict is Verdict.NOT_APPLICABLE


def test_kvspec_check_runs_an_overlay_from_the_command_line(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "kvspec.conformance.tools.cli", "check", "--impl", OVERLAY, "--level", "pool",
           "--profile", "vllm-v1-tail", "--max-examples", "20", "--trace-dir", str(tmp_path)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "result: 2 conforms (exit 0)" in proc.stdout


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("overlay:vllm@0.0.1", r"expected overlay:vllm@<release>\+<module>:<function>"),
        ("overlay:vllm@0.0.1+nowhere.at.all:apply", r"cannot find nowhere\.at\.all:apply"),
        ("kvcached@", r"not a plugin target"),
        ("vllm-mlx@0.33.0", r"vllm-mlx has its own pool and runs on no vLLM release"),
    ],
)
def test_a_malformed_plugin_name_is_one_line(name: str, why: str) -> None:
    with pytest.raises(FactoryError, match=rf"^implementation {re.escape(repr(name))}: {why}"):
        load_factory(name)


def test_the_registry_knows_every_target() -> None:
    # every plugin target is registered through its entry point, and resolves to its factory
    assert {name for name in TARGETS if (target := find_target(name)) and target.name == name} == set(TARGETS)
    for name in TARGETS:
        factory = factory_for(name)
        assert factory.__name__ == name and set(factory.levels) <= {"pool", "manager"}  # type: ignore[attr-defined]


# --- distributions --------------------------------------------------------------------------


def _archive(tmp_path: Path, kind: str) -> Path:
    files = {"pkg/pool.py": b"X = 1\n", "pkg/heavy.py": b"import torch\n", "pkg-1.0.dist-info/METADATA": b""}
    if kind == "wheel":
        path = tmp_path / "pkg-1.0-py3-none-any.whl"
        with zipfile.ZipFile(path, "w") as zf:
            for name, data in files.items():
                zf.writestr(name, data)
        return path
    path = tmp_path / "pkg-1.0.tar.gz"
    with tarfile.open(path, "w:gz") as tf:
        for name, data in {"PKG-INFO": b"Name: pkg\nVersion: 1.0\n", **files}.items():
            info = tarfile.TarInfo(f"pkg-1.0/{name}")
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path


@pytest.mark.parametrize("kind", ["wheel", "sdist"])
def test_a_distribution_keeps_only_the_files_named_and_is_cached(tmp_path: Path, kind: str) -> None:
    dist = PluginDist("pkg", "1.0", ("pkg/pool.py",), kind=kind)  # type: ignore[arg-type]
    root = fetch_dist(dist, cache=tmp_path / "cache", archive=_archive(tmp_path, kind))
    kept = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
    assert kept == ["KVSPEC_EXTRACTED", "pkg/pool.py"]
    assert fetch_dist(dist, cache=tmp_path / "cache") == root  # no archive, no download: the cache answers


# --- kvcached's device placeholders, as page_allocator.cpp behaves ---------------------------


def test_internal_page_is_a_fifo_free_list_of_its_block_range() -> None:
    page = kvcached_device.InternalPage(1, 4 * 100)
    page.init(100)
    assert (page.start_block, page.end_block) == (4, 8)
    assert page.alloc(2) == [4, 5]
    page.free_batch([5, 4])
    assert page.get_free_blocks() == [6, 7, 5, 4] and page.empty()  # every block of the page free again
    with pytest.raises(RuntimeError, match="^Not enough free blocks in page$"):
        page.alloc(5)
    assert kvcached_device.InternalPage.get_block_range(0, 250, 100) == (0, 2)  # block 2 straddles the edge


def test_page_allocator_reuses_reserved_pages_first_and_refills_up_to_the_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVCACHED_MAX_RESERVED_PAGES", "1")
    allocator = kvcached_device.PageAllocator(1, 4 * 10, 10)
    pages = [allocator.alloc_page().page_id for _ in range(3)]
    assert pages == [0, 1, 2] and allocator.get_num_free_pages() == 1
    allocator.free_pages([1, 0])  # one goes to the reserved list, the other back to the free list
    assert [allocator.alloc_page().page_id for _ in range(3)] == [1, 3, 0]
    with pytest.raises(RuntimeError, match="^No free pages left$"):
        allocator.alloc_page()


# --- findings and the matrix ----------------------------------------------------------------


def test_a_failure_is_matched_to_its_finding_by_operation_message_and_caching() -> None:
    off_only = Finding("k", "reset_prefix_cache", r"returned True", "does a thing", "result", caching=False)
    failure = Failure(FailureKind.DIVERGES, 2, "reset_prefix_cache", "returned True; the spec returned False")
    assert match_finding([off_only], failure, caching=False) is off_only
    assert match_finding([off_only], failure, caching=True) is None
    assert match_finding([off_only], None) is None


def test_a_probe_of_an_ignored_mistake_checks_that_only_the_good_part_applied() -> None:
    steps = (("get_new_blocks", (2,)), ("free_blocks", ([1, 1],)))
    probe = PluginProbe("named twice", steps, ignored_as=(("get_new_blocks", (2,)), ("free_blocks", ([1],))))
    factory = factory_for(OVERLAY)
    found = run_probe(factory, probe, "vllm-v1-tail", None, OVERLAY)
    # the miniature takes both references (ref_cnt -1): that is not ignoring the mistake
    assert found is not None and found.verdict == FailureKind.DIVERGES.value
    assert found.message.endswith("declared ignored, but the state is not what ['get_new_blocks', 'free_blocks'] "
                                  "alone gives")  # fmt: skip


def test_the_matrix_prints_each_divergence_with_its_meaning_and_trace() -> None:
    cell = {"verdict": "diverges", "step": 2, "op": "free_blocks", "message": "m", "trace": "/t/a.trace.jsonl",
            "num_steps": 2, "finding": "hashless-reused-oldest-first", "does": "goes to the end", "effect": "order",
            "is_bug": False}  # fmt: skip
    cells = {"pool/on": cell, "pool/off": {"verdict": "conforms"}, "manager/on": {"verdict": "n/a"}}
    row = PluginRow("kvcached", "kvcached@0.30.0", "kvcached==0.1.6", "vllm 0.30.0", "vllm-v1", cells=cells)
    text = format_plugin_matrix([row])
    assert "kvcached==0.1.6  vllm 0.30.0  vllm-v1  diverges[1]  ok        n/a" in text
    where = "[1] kvcached@0.30.0 pool/on: step 2 free_blocks of a 2-step trace"
    assert f"{where}: hashless-reused-oldest-first (order): goes to the end" in text
    assert "trace: /t/a.trace.jsonl" in text and "order: which free block" in text


def test_a_user_s_apply_stands_in_for_a_plugin_module_that_needs_a_device(tmp_path: Path) -> None:
    # As the guide says: the folder that holds the package, and a stand-in registered before the import.
    package = tmp_path / "src" / "mypl"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "native.py").write_text("import torch\nLEFT = torch.tensor(1)\n")
    (package / "patch.py").write_text("from mypl.native import LEFT\nSEEN = LEFT\n")

    def stand_in(overlay: Overlay) -> types.ModuleType:
        module = types.ModuleType("mypl.native")
        module.LEFT = 1  # type: ignore[attr-defined]
        return module

    overlay = _overlay()
    overlay.add_package("mypl", tmp_path / "src")
    with pytest.raises(OverlayError, match=r"ImportError: torch is a device runtime, left out of the overlay"):
        overlay.import_plugin("mypl.patch")
    overlay = _overlay()
    overlay.add_package("mypl", tmp_path / "src")
    overlay.placeholders["mypl.native"] = stand_in
    assert overlay.import_plugin("mypl.patch").SEEN == 1
