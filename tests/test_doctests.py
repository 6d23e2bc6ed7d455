"""Every example in kvspec's docstrings is a test: each module of the package, its doctests run here.

One runner for the whole package, walking it as installed, so a module added
anywhere has its examples run without a list kept by hand. The lemmas are
left to their own tests (they import z3 and prove).
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

PACKAGES = ("spec", "reference", "gpu_impl", "conformance", "benchmarks", "mutants")


def _modules() -> list[str]:
    names = []
    for package in PACKAGES:
        root = importlib.import_module(f"kvspec.{package}")
        names.append(root.__name__)
        names += [info.name for info in pkgutil.walk_packages(root.__path__, f"{root.__name__}.")]
    return sorted(name for name in names if not name.startswith("kvspec.spec.lemmas"))


MODULES = _modules()


@pytest.mark.parametrize("name", MODULES)
def test_the_modules_examples_hold(name: str) -> None:
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS, verbose=False)
    assert result.failed == 0


def test_the_walk_finds_the_modules_that_carry_examples() -> None:
    """The walk reaches every package (an editable install maps each to its own folder), and the helpers
    known to carry examples have them: a walk that found nothing would pass the test above vacuously."""
    attempted = {name: doctest.testmod(importlib.import_module(name), verbose=False).attempted for name in MODULES}
    for name in (
        "kvspec.spec.state",
        "kvspec.spec.ops",
        "kvspec.spec.ordering",
        "kvspec.spec.hashing",
        "kvspec.gpu_impl.stamped_free",
        "kvspec.gpu_impl.sizing",
        "kvspec.conformance.core.operations",
        "kvspec.conformance.targets.vllm.releases",
        "kvspec.conformance.targets.vllm.adapter",
        "kvspec.conformance.tools.vllm_facts",
    ):
        assert attempted[name] > 0, name
    assert sum(attempted.values()) >= 150  # 162 today
