"""Install a target the way a third-party distribution does: an entry point in the ``kvspec.targets`` group.

The fixture `register_target` writes a distribution's metadata
(``<dist>-1.0.dist-info`` with ``METADATA`` and ``entry_points.txt``) and its
module into a folder put on ``sys.path``, as pip leaves them in site-packages;
``importlib.metadata`` finds it like any installed distribution. Nothing of
kvspec is patched: the registry reads the entry points afresh (its cache is
cleared before and after the test). tests/conftest.py loads it as a plugin,
so every test can ask for it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvspec.conformance.runner.registry import known_targets

Register = Callable[[str, str, str, str], None]


@pytest.fixture
def register_target(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Register]:
    """``register(dist, entry, value, source)``: distribution ``dist`` declares ``entry = value`` under
    ``kvspec.targets``; ``source`` is the module ``value`` names (its module part, written beside it)."""
    modules: list[str] = []

    def register(dist: str, entry: str, value: str, source: str) -> None:
        folder = tmp_path / dist
        folder.mkdir()
        module = value.partition(":")[0]
        (folder / f"{module}.py").write_text(source)
        info = folder / f"{dist}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
        (info / "entry_points.txt").write_text(f"[kvspec.targets]\n{entry} = {value}\n")
        monkeypatch.syspath_prepend(str(folder))
        modules.append(module)
        known_targets.cache_clear()

    yield register
    for module in modules:
        sys.modules.pop(module, None)
    known_targets.cache_clear()
