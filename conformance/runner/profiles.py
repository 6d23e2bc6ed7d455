"""Which ordering profile an implementation follows: the regression oracle's question, asked by running the harness.

`check_each_profile` runs one configuration of a run once per candidate
profile (vLLM v1's two by default), every other setting of the run as it is;
an implementation conforms to the profiles whose campaigns pass, and for each
profile it breaks there is the shortest trace that shows it. ``kvspec check
--profile auto`` and ``kvspec oracle`` print the answer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from kvspec.conformance.core.adapter import AdapterConfig
from kvspec.conformance.core.results import CheckResult
from kvspec.conformance.core.run_config import Configuration
from kvspec.conformance.runner.isolation import Progress
from kvspec.conformance.runner.run import check_configuration

__all__ = ["PROFILES", "check_each_profile"]

# vLLM v1's two free orders: hashless blocks to the front (0.24 on), every block to the back (0.8.0-0.23).
PROFILES: tuple[str, ...] = ("vllm-v1", "vllm-v1-tail")


def check_each_profile(
    factory: Callable[[AdapterConfig], Any] | str,
    configuration: Configuration,
    progress: Progress | None = None,
    profiles: Sequence[str] = PROFILES,
) -> dict[str, CheckResult]:
    """`check_configuration` once per profile: the run's record with that profile, every other setting as the
    run has it (`kvspec check --profile auto`, `kvspec oracle`); the configuration's time budget split evenly.

    Args:
        factory: builds an adapter from an `AdapterConfig`; or an implementation name (``vllm@0.24.0``),
            which traces then record.
        configuration: what to check and how; its profile is replaced by each of ``profiles`` in turn.
        progress: called every few seconds with (examples started, steps checked) while a campaign runs.
        profiles: the profiles to try (``PROFILES`` for v1; ``V0_PROFILES`` for vLLM v0's allocator).

    Returns:
        ``{profile: CheckResult}`` for every profile tried.
    """
    budget = None if configuration.time_budget_s is None else configuration.time_budget_s / len(profiles)
    found = {}
    for profile in profiles:
        run = dataclasses.replace(configuration.run, profile=profile)
        found[profile] = check_configuration(
            factory, dataclasses.replace(configuration, run=run, time_budget_s=budget), progress
        )
    return found
