"""Suite-wide settings: Hypothesis profiles, and the opt-in stages.

Profiles: `ci` (derandomized, no deadline; the default when CI is set) and
`dev` (random, 200 examples); HYPOTHESIS_PROFILE overrides.

Tests marked `slow` run only with KVSPEC_SLOW=1, tests marked `heavy` (about
12 s or more each: scripts/test.sh runs them after the default suite) only
with KVSPEC_HEAVY=1, tests marked `vllm`
(the real vLLM package) only with KVSPEC_VLLM=1, and tests marked `fuzz`
(a HypoFuzz campaign) only with KVSPEC_FUZZ=1; otherwise they are
deselected, not skipped, so the default run reports only what it ran.
"""

import os
import sys

import pytest
from hypothesis import HealthCheck, settings

# Fixtures shared across test folders: `register_target` installs a target through an entry point.
pytest_plugins = ["tests.conformance.entry_points"]

settings.register_profile(
    "ci", derandomize=True, deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", deadline=None, max_examples=200)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))

_OPT_IN = {"slow": "KVSPEC_SLOW", "vllm": "KVSPEC_VLLM", "fuzz": "KVSPEC_FUZZ", "heavy": "KVSPEC_HEAVY"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    enabled = {marker for marker, var in _OPT_IN.items() if os.environ.get(var) == "1"}
    kept, dropped = [], []
    for item in items:
        gated = {m.name for m in item.iter_markers()} & set(_OPT_IN)
        (dropped if gated - enabled else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def _in_hypofuzz_run() -> bool:
    """Whether HypoFuzz runs these tests (`hypothesis fuzz`); it is imported by then, so no import here."""
    detection = sys.modules.get("hypofuzz.detection")
    return detection is not None and bool(detection.in_hypofuzz_run())


@pytest.fixture(autouse=True, scope="session")
def _traces_out_of_the_checkout(request: pytest.FixtureRequest):
    """Failure traces of tests that name no trace folder go to the session's temporary folder, not ./kvspec-traces."""
    # NOTE: HypoFuzz sets fixtures up on the config of a pytest session that has
    # ended, which no longer has tmp_path_factory: asking for it there fails every
    # fuzz target fatally. The fuzz targets name their own trace folder anyway.
    if _in_hypofuzz_run():
        yield
        return
    from kvspec.conformance.runner import run as runner

    saved = runner.DEFAULT_TRACE_DIR
    tmp_path_factory: pytest.TempPathFactory = request.getfixturevalue("tmp_path_factory")
    runner.DEFAULT_TRACE_DIR = tmp_path_factory.mktemp("kvspec-traces")
    yield
    runner.DEFAULT_TRACE_DIR = saved
