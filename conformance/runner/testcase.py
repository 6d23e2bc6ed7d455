"""The test-suite hook: `make_conformance_test`, a unittest class whose tests are `run_check` campaigns.

One line in an implementation's own test suite checks its adapter factory at
each level and caching mode; a level it does not provide is a skipped test.
"""

from __future__ import annotations

import unittest
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hypothesis import settings

from kvspec.conformance.core.results import Verdict
from kvspec.conformance.runner.registry import Factory, factory_name
from kvspec.conformance.runner.run import run_check

__all__ = ["make_conformance_test"]


def make_conformance_test(
    factory: Factory,
    level: str = "both",
    enable_caching: bool | None = None,
    profile: str = "vllm-v1",
    max_examples: int | None = None,
    seed: int = 0,
    step_timeout_s: float | None = 10.0,
    trace_dir: str | Path | None = None,
    events: bool = False,
) -> type[unittest.TestCase]:
    """A `unittest.TestCase` class that checks `factory`'s adapters against the spec.

    One test per level and caching mode (`test_pool_caching_on`, ...). Each runs
    `run_check` in a child process; a failure fails the test with the short
    story, and the trace is saved (in `trace_dir`, default ./kvspec-traces).
    A level the adapter does not provide is a skipped test; a run that checked
    too little to conclude fails with the reason. The story's replay line names
    the factory (`registry.factory_name`: "file.py:function" for a top-level
    module's function), so pasted in the folder the tests ran in, it replays.

    Args:
        factory: builds an adapter from an `AdapterConfig`.
        level: "pool", "manager" or "both".
        enable_caching: True or False for one mode; None for both.
        profile: the ordering profile the implementation claims.
        max_examples: per test; None takes the active Hypothesis profile's.
        seed: the campaign's seed.
        step_timeout_s: the most one implementation call may take.
        trace_dir: where failure traces are saved.
        events: check the KV cache events and hit statistics too (`kvspec check --events`).

    Raises:
        ValueError: level is not "pool", "manager" or "both".
    """
    if level not in ("pool", "manager", "both"):
        raise ValueError(f"level must be 'pool', 'manager' or 'both'; got level={level!r}")
    levels = ("pool", "manager") if level == "both" else (level,)
    modes = (True, False) if enable_caching is None else (enable_caching,)
    impl = factory_name(factory)

    def make_test(lv: str, caching: bool) -> Callable[[unittest.TestCase], None]:
        def test(self: unittest.TestCase) -> None:
            n = max_examples if max_examples is not None else settings().max_examples
            result = run_check(factory, level=lv, enable_caching=caching, profile=profile, max_examples=n,
                               seed=seed, step_timeout_s=step_timeout_s, trace_dir=trace_dir, impl=impl,
                               events=events)  # fmt: skip
            if result.verdict is Verdict.NOT_APPLICABLE:
                self.skipTest(f"{lv} level not provided: {result.message}")
            if result.verdict is not Verdict.CONFORMS:
                self.fail(result.failure.story if result.failure is not None else f"{result.verdict}: {result.message}")

        test.__name__ = f"test_{lv}_caching_{'on' if caching else 'off'}"
        test.__doc__ = f"The {lv} level conforms to the spec (profile {profile}, caching {'on' if caching else 'off'})."
        return test

    attrs: dict[str, Any] = {make_test(lv, c).__name__: make_test(lv, c) for lv in levels for c in modes}
    name = getattr(factory, "__name__", type(factory).__name__)
    return type(f"Conformance_{name}", (unittest.TestCase,), attrs)
