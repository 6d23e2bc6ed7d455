"""The distribution: one `kvspec` namespace, every package and data file shipped, no tests, the console script.

A wheel is built from a copy of the source tree (so the checkout gains no
build/ folder) and inspected as a zip file, then installed into a private
folder and imported from a clean process. The installed editable copy is
checked too: from outside the checkout, no bare `spec` or `reference` module
can be imported. The tests are not shipped: what the product reads (the golden
walkthrough, the mutant set) lives in its own packages.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib

from kvspec.mutants import all_mutants

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SETUPTOOLS = PYPROJECT["tool"]["setuptools"]
BARE_NAMES = ["spec", "reference", "conformance", "gpu_impl", "mutants", "tests", "benchmarks"]


def _source_folder(package: str) -> Path:
    """The folder a `kvspec...` package is built from, by pyproject's package-dir."""
    mapping: dict[str, str] = SETUPTOOLS["package-dir"]
    parts = package.split(".")
    for i in range(len(parts), 0, -1):
        prefix = ".".join(parts[:i])
        if prefix in mapping:
            return ROOT / mapping[prefix] / Path(*parts[i:])
    raise AssertionError(f"package={package} has no package-dir entry")


def _package_of(folder: Path) -> str:
    """The `kvspec...` name a source folder is shipped as."""
    mapping: dict[str, str] = SETUPTOOLS["package-dir"]
    for package, src in mapping.items():
        base = ROOT / src
        if folder == base or base in folder.parents:
            return ".".join([package, *folder.relative_to(base).parts])
    raise AssertionError(f"{folder} is under no package-dir entry")


def _shipped_folders() -> list[Path]:
    """Every folder under a package root that holds a module or a data file."""
    mapping: dict[str, str] = SETUPTOOLS["package-dir"]
    folders = []
    for src in mapping.values():
        for folder in [ROOT / src, *sorted(p for p in (ROOT / src).rglob("*") if p.is_dir())]:
            if "__pycache__" in folder.parts or any(part.startswith(".") for part in folder.parts):
                continue
            if any(f.suffix in (".py", ".json", ".jsonl") for f in folder.iterdir() if f.is_file()):
                folders.append(folder)
    return folders


def test_every_folder_that_ships_code_or_data_is_a_listed_package() -> None:
    listed = set(SETUPTOOLS["packages"])
    for folder in _shipped_folders():
        assert _package_of(folder) in listed, f"{folder.relative_to(ROOT)} is missing from pyproject's packages"
    for package in listed:
        assert _source_folder(package).is_dir(), f"{package} is listed but {_source_folder(package)} does not exist"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wheel built from a copy of the source tree (build isolation off: no network, no new downloads)."""
    work = tmp_path_factory.mktemp("build")
    src = work / "src"
    ignore = shutil.ignore_patterns(
        ".venv*",
        ".git",
        "build",
        "dist",
        "*.egg-info",
        "__pycache__",
        ".hypothesis",
        ".mypy_cache",
        ".ruff_cache",
        "kvspec-failures",
    )
    shutil.copytree(ROOT, src, ignore=ignore)
    out = work / "dist"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-q",
            "-w",
            str(out),
            str(src),
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    (built,) = out.glob("kvspec-*.whl")
    return built


def test_the_wheel_holds_only_the_kvspec_namespace(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    dist_info = {n.split("/")[0] for n in names if ".dist-info/" in n}
    assert len(dist_info) == 1
    assert {n.split("/")[0] for n in names} == {"kvspec"} | dist_info
    top_level = zipfile.ZipFile(wheel).read(f"{dist_info.pop()}/top_level.txt").decode().split()
    assert top_level == ["kvspec"]


def test_the_wheel_ships_every_module_and_data_file(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    for folder in _shipped_folders():
        package_path = _package_of(folder).replace(".", "/")
        for f in folder.iterdir():
            if f.is_file() and f.suffix in (".py", ".json", ".jsonl"):
                assert f"{package_path}/{f.name}" in names, f"{f.relative_to(ROOT)} is not in the wheel"
    assert "kvspec/conformance/data/seed_walkthrough.json" in names  # `kvspec demo` reads it
    assert "kvspec/conformance/tools/commands/demo.py" in names  # the CLI finds its commands here
    assert "kvspec/mutants/__init__.py" in names and "kvspec/mutants/manager.py" in names  # `kvspec mutants`


def test_the_wheel_ships_no_tests(wheel: Path) -> None:
    shipped_tests = [n for n in zipfile.ZipFile(wheel).namelist() if n.startswith("kvspec/tests/")]
    assert shipped_tests == [], "the tests run from a checkout; the product reads nothing from them"


def test_the_console_script_is_declared(wheel: Path) -> None:
    archive = zipfile.ZipFile(wheel)
    (entry_points,) = [n for n in archive.namelist() if n.endswith(".dist-info/entry_points.txt")]
    text = archive.read(entry_points).decode()
    assert "[console_scripts]" in text
    assert "kvspec = kvspec._entry:console_main" in text
    assert "kvspec/_entry.py" in archive.namelist()


_IMPORT_CHECK = """
import argparse, importlib.util, json, sys
import kvspec.spec, kvspec.reference, kvspec.mutants
from kvspec.reference import BlockPool, KVCacheManager
from kvspec.conformance.tools.commands import demo
with open(sys.argv[1], "w") as out:
    json.dump({
        "spec": kvspec.spec.__file__,
        "reference": kvspec.reference.__file__,
        "mutants": kvspec.mutants.__file__,
        "num_mutants": len(kvspec.mutants.all_mutants()),
        "tests": getattr(importlib.util.find_spec("kvspec.tests"), "origin", None),
        "bare": {n: getattr(importlib.util.find_spec(n), "origin", None) for n in sys.argv[2:]},
        "demo": demo.run(argparse.Namespace(impl="spec")),
    }, out)
"""


def _import_check(tmp_path: Path, pythonpath: str | None) -> dict[str, object]:
    result = tmp_path / "result.json"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    # Run from an empty folder: the checkout (which holds bare spec/, reference/ folders) is not on the path.
    subprocess.run(
        [sys.executable, "-c", _IMPORT_CHECK, str(result), *BARE_NAMES],
        cwd=tmp_path,
        env=env,
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    )
    found: dict[str, object] = json.loads(result.read_text())
    return found


def test_the_installed_wheel_imports_under_kvspec_only(wheel: Path, tmp_path: Path) -> None:
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target", str(target), str(wheel)],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    found = _import_check(run_dir, str(target))
    assert str(found["spec"]).startswith(str(target)) and str(found["reference"]).startswith(str(target))
    assert str(found["mutants"]).startswith(str(target)) and found["num_mutants"] == len(all_mutants())
    assert found["tests"] is None  # the tests are not shipped
    bare = found["bare"]
    assert isinstance(bare, dict)
    for name, origin in bare.items():
        assert origin is None or not str(origin).startswith(str(target)), f"bare module {name} installed at {origin}"
    assert found["demo"] == 0  # the golden walkthrough shipped and matches


def test_the_editable_install_has_no_bare_modules(tmp_path: Path) -> None:
    found = _import_check(tmp_path, None)
    assert found["bare"] == {name: None for name in BARE_NAMES}
    assert found["tests"] is None  # from outside the checkout the tests are not importable
    assert found["demo"] == 0
