"""A miniature vLLM release for the default suite: a few modules in vLLM's names, zipped into a wheel.

Light mode loads it as it loads a real release's wheel, from a cache of its
own that $KVSPEC_VLLM_CACHE names while the tests use it (children of the
harness inherit the variable), so no test downloads anything.
"""

from __future__ import annotations

import os
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvspec.conformance.targets.vllm import lightmode

__all__ = ["miniature_release"]


def miniature_release(
    tmp_path_factory: pytest.TempPathFactory, version: str, source: Path, layout: lightmode.Layout = lightmode.V1
) -> Iterator[Path]:
    """Build release `version` from the modules under `source` and name its cache while the caller yields.

    A generator for a module-scoped fixture to `yield from`.
    """
    cache = tmp_path_factory.mktemp("vllm-cache")
    wheel = cache / f"vllm-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for path in sorted(source.rglob("*.py")):
            zf.write(path, path.relative_to(source).as_posix())
    lightmode.fetch_release(version, cache=cache, wheel=wheel, layout=layout)
    old = os.environ.get("KVSPEC_VLLM_CACHE")
    os.environ["KVSPEC_VLLM_CACHE"] = str(cache)
    try:
        yield cache
    finally:
        if old is None:
            os.environ.pop("KVSPEC_VLLM_CACHE", None)
        else:
            os.environ["KVSPEC_VLLM_CACHE"] = old
