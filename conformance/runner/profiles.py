"""Which ordering profile an implementation follows: the regression oracle's question, asked by running the harness.

`detect_profiles` runs one campaign per candidate profile (vLLM v1's two by
default); an implementation conforms to the profiles whose campaigns pass, and
for each profile it breaks there is the shortest trace that shows it.
`check_each_profile` asks the same of one configuration of a run, every other
setting of the run as it is. ``kvspec check --profile auto`` and ``kvspec
oracle`` print the answer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from kvspec.conformance.core.adapter import AdapterConfig
from kvspec.conformance.core.results import CheckResult
from kvspec.conformance.core.run_config import Configuration
from kvspec.conformance.runner.isolation import Progress
from kvspec.conformance.runner.run import check_configuration, run_check

__all__ = ["PROFILES", "check_each_profile", "detect_profiles"]

# vLLM v1's two free orders: hashless blocks to the front (0.24 on), every block to the back (0.8.0-0.23).
PROFILES: tuple[str, ...] = ("vllm-v1", "vllm-v1-tail")


def detect_profiles(
    factory: Callable[[AdapterConfig], Any] | str,
    level: str = "pool",
    enable_caching: bool = True,
    max_examples: int = 200,
    *,
    time_budget_s: float | None = None,
    trace_dir: str | None = None,
    seed: int = 0,
    profiles: Sequence[str] = PROFILES,
    jobs: int = 1,
) -> dict[str, Any]:
    """Run the harness against ``factory`` once per vLLM profile.

    Wiring ``kvspec check --impl vllm --profile auto``: call this instead of one
    ``run_check``, print one line per profile (its verdict, and for a broken
    profile the failure's story and trace path), exit 0 if some profile
    conforms, 1 if none does, 2 if none could run.

    Args:
        factory: The adapter factory, or an implementation name (``vllm@0.24.0``), which traces then record.
        level: ``"pool"`` or ``"manager"``.
        enable_caching: Prefix caching on or off.
        max_examples: Examples per profile.
        time_budget_s: Split evenly across the profiles.
        trace_dir: Where failing traces go.
        seed: The harness seed.
        profiles: The profiles to try (``PROFILES`` for v1; ``V0_PROFILES`` for v0's allocator).
        jobs: Processes each profile's campaign is shared among (``run_check``).

    Returns:
        ``{profile: CheckResult}`` for every profile tried.
    """

    budget = None if time_budget_s is None else time_budget_s / len(profiles)
    return {
        profile: run_check(
            factory,
            level=level,
            enable_caching=enable_caching,
            profile=profile,
            max_examples=max_examples,
            seed=seed,
            time_budget_s=budget,
            trace_dir=trace_dir,
            jobs=jobs,
        )
        for profile in profiles
    }




def check_each_profile(
    factory: Callable[[AdapterConfig], Any] | str,
    configuration: Configuration,
    progress: Progress | None = None,
    profiles: Sequence[str] = PROFILES,
) -> dict[str, CheckResult]:
    """`check_configuration` once per profile: the run's record with that profile, every other setting as the
    run has it (`kvspec check --profile auto`); the configuration's time budget split evenly.

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
