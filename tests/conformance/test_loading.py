"""The loader light mode and the overlay share, on packages written here (kvspec.conformance.targets.loader, .archives).

A fork whose package folder is ``vllm_fork`` but whose code imports ``vllm``
is served from a `SourceTree` by a small `PrivateFinder`: the step after
light mode's wheels (a source tree, a renamed fork) is one more tree.
"""

from __future__ import annotations

import importlib
import itertools
import sys
import types
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvspec.conformance.targets.archives import MARKER, cached_folder, extract_zip, is_release_number
from kvspec.conformance.targets.loader import (
    PlaceholderModule,
    PrivateFinder,
    SourceTree,
    is_placeholder,
    placeholder,
    redirecting_builtins,
)

_names = itertools.count(1)


class _ForkFinder(PrivateFinder):
    """Serves a tree's ``vllm.*`` as ``<private>.*``; a module without a file is a placeholder package."""

    def __init__(self, tree: SourceTree, private: str) -> None:
        rename = lambda name: private + name[len("vllm") :] if name.partition(".")[0] == "vllm" else name  # noqa: E731
        super().__init__(redirecting_builtins(rename, refused={"torch"}, refused_why="left out of this test"))
        self.tree, self.private = tree, private
        self.used: set[str] = set()
        self.loaded: dict[str, types.ModuleType] = {}

    def real_name(self, fullname: str) -> str | None:
        head, dot, rest = fullname.partition(".")
        return "vllm" + dot + rest if head == self.private else None

    def locate(self, real: str) -> tuple[Path | None, bool, Path | None]:
        path = self.tree.module_file(real) or self.tree.init_file(real)
        return path, path is None or path.name == "__init__.py", None

    def new_module(self, real: str, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        if spec.origin is not None:
            return None
        return PlaceholderModule(spec.name, real, self.used, lambda sub: None)

    def register(self, real: str, module: types.ModuleType) -> None:
        self.loaded[real] = module


@pytest.fixture
def fork(tmp_path: Path) -> Iterator[_ForkFinder]:
    package = tmp_path / "vllm_fork"
    (package / "core").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "core" / "__init__.py").write_text("")
    (package / "core" / "pool.py").write_text(
        "import importlib\n"
        "from vllm.core.blocks import BLOCK\n"
        "from vllm.config import CacheConfig\n"
        "AGAIN = importlib.import_module('vllm.core.blocks').BLOCK\n"
        "class Pool(CacheConfig):\n"
        "    def lazy(self):\n"
        "        from vllm.core import blocks\n"
        "        return blocks.BLOCK\n"
    )
    (package / "core" / "blocks.py").write_text("BLOCK = object()\n")
    (package / "core" / "device.py").write_text("import torch\n")
    finder = _ForkFinder(SourceTree(tmp_path, "vllm", folder="vllm_fork"), f"_kvspec_test_fork_{next(_names)}")
    sys.meta_path.insert(0, finder)
    yield finder
    sys.meta_path.remove(finder)
    for name in [m for m in sys.modules if m.split(".")[0] == finder.private]:
        del sys.modules[name]


def test_a_fork_under_another_folder_name_loads_with_its_vllm_imports_mapped(fork: _ForkFinder) -> None:
    pool = importlib.import_module(f"{fork.private}.core.pool")
    blocks = fork.loaded["vllm.core.blocks"]
    assert pool.BLOCK is blocks.BLOCK
    assert pool.AGAIN is blocks.BLOCK  # importlib.import_module inside loaded code is mapped as import is
    assert pool.Pool().lazy() is blocks.BLOCK  # an import that runs inside a function is mapped too
    assert pool.__file__ == str(fork.tree.root / "vllm_fork" / "core" / "pool.py")
    assert sorted(fork.loaded) == ["vllm", "vllm.config", "vllm.core", "vllm.core.blocks", "vllm.core.pool"]


def test_a_module_with_no_file_is_a_placeholder_that_records_what_was_used(fork: _ForkFinder) -> None:
    pool = importlib.import_module(f"{fork.private}.core.pool")
    assert is_placeholder(pool.Pool.__mro__[1])
    assert fork.used == {"vllm.config:CacheConfig"}
    assert not is_placeholder(pool.BLOCK)


def test_a_refused_runtime_does_not_import_inside_loaded_code(fork: _ForkFinder) -> None:
    with pytest.raises(ImportError, match=r"^torch is a device runtime, left out of this test$"):
        importlib.import_module(f"{fork.private}.core.device")


def test_a_placeholder_is_callable_subclassable_and_hands_out_more() -> None:
    used: set[str] = set()
    config = placeholder("vllm.config:VllmConfig", used)
    instance = config(1, key=2)
    assert instance() is instance
    assert is_placeholder(config.model_config) and is_placeholder(instance.cache_config)
    assert type("Sub", (config,), {})().anything is not None
    assert used == {"vllm.config:VllmConfig", "vllm.config:VllmConfig.model_config"} | {
        "vllm.config:VllmConfig().cache_config",
        "vllm.config:VllmConfig().anything",
    }


def test_source_tree_finds_modules_and_packages_by_their_imported_name(tmp_path: Path) -> None:
    (tmp_path / "vllm_fork" / "v1").mkdir(parents=True)
    (tmp_path / "vllm_fork" / "v1" / "__init__.py").write_text("")
    (tmp_path / "vllm_fork" / "envs.py").write_text("")
    tree = SourceTree(tmp_path, "vllm", folder="vllm_fork")
    assert tree.module_file("vllm.envs") == tmp_path / "vllm_fork" / "envs.py"
    assert tree.init_file("vllm.v1") == tmp_path / "vllm_fork" / "v1" / "__init__.py"
    assert tree.package_dir("vllm.v1") == tmp_path / "vllm_fork" / "v1"
    assert tree.module_file("vllm.v1") is None and tree.package_dir("vllm.envs") is None
    with pytest.raises(AssertionError, match=r"^module='other\.x' is not in package='vllm'$"):
        tree.module_file("other.x")


# ---------------------------------------------------------------------------
# archives


def test_release_numbers_are_checked_before_any_pip_call() -> None:
    assert is_release_number("0.8.5.post1") and is_release_number("0.10.0rc2")
    assert not is_release_number("0.8; rm -rf /") and not is_release_number("latest")


def test_a_cache_folder_is_filled_once_and_a_failed_fill_leaves_nothing(tmp_path: Path) -> None:
    calls: list[Path] = []

    def fill(work: Path, target: Path) -> str:
        calls.append(work)
        (target / "kept.py").write_text("X = 1\n")
        return "from a test\n"

    def broken(work: Path, target: Path) -> str:
        (target / "half.py").write_text("")
        raise RuntimeError("the download failed")

    with pytest.raises(RuntimeError, match=r"^the download failed$"):
        cached_folder(tmp_path, "1.0.0", broken)
    assert list(tmp_path.iterdir()) == []  # neither the entry nor the scratch folder is left
    root = cached_folder(tmp_path, "1.0.0", fill)
    assert root == tmp_path / "1.0.0" and (root / "kept.py").read_text() == "X = 1\n"
    assert (root / MARKER).read_text() == "from a test\n"
    assert cached_folder(tmp_path, "1.0.0", broken) == root  # complete: not filled again
    assert len(calls) == 1 and not calls[0].exists()


def test_extract_zip_keeps_the_wanted_members_at_their_paths(tmp_path: Path) -> None:
    wheel = tmp_path / "pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("pkg/core/", "")
        zf.writestr("pkg/core/pool.py", "POOL = 1\n")
        zf.writestr("pkg/heavy.py", "import torch\n")
    names, kept = extract_zip(wheel, tmp_path / "out", lambda name: name.startswith("pkg/core/"))
    assert names == {"pkg/core/", "pkg/core/pool.py", "pkg/heavy.py"} and kept == 1
    assert (tmp_path / "out" / "pkg" / "core" / "pool.py").read_text() == "POOL = 1\n"
    assert not (tmp_path / "out" / "pkg" / "heavy.py").exists()


def test_a_cache_folder_filled_under_another_stamp_is_filled_again(tmp_path: Path) -> None:
    # A kvspec that keeps more of a release's files than an older kvspec did (light mode's file
    # list is the stamp) must not read the older, shorter extraction.
    def fill_with(files: tuple[str, ...]) -> Callable[[Path, Path], str]:
        def fill(work: Path, target: Path) -> str:
            for name in files:
                (target / name).write_text("")
            return "wheel\n"

        return fill

    old = cached_folder(tmp_path, "1.0.0", fill_with(("a.py",)), stamp="files 1")
    assert cached_folder(tmp_path, "1.0.0", fill_with(("never.py",)), stamp="files 1") == old
    new = cached_folder(tmp_path, "1.0.0", fill_with(("a.py", "b.py")), stamp="files 2")
    assert new == old and sorted(p.name for p in new.iterdir()) == [MARKER, "a.py", "b.py"]
    assert (new / MARKER).read_text() == "wheel\nstamp: files 2\n"
