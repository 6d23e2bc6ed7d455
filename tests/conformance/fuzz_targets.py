"""Fuzz targets: the conformance machines as plain Hypothesis tests, for long campaigns under HypoFuzz.

Not collected by the default test run (the file name does not start with
`test_`); name it explicitly:

    hypothesis fuzz --no-dashboard -n 2 -- tests/conformance/fuzz_targets.py

Environment:
    KVSPEC_FUZZ_IMPL  the implementation, a built-in name or module:function (default: reference)
    KVSPEC_FUZZ_DB    the example database directory, shared by every worker and machine
                      that points at it (default: .hypothesis/kvspec-fuzz)
    KVSPEC_FUZZ_PROFILE  the ordering profile the implementation claims (default: vllm-v1)
"""

import os

from hypothesis import HealthCheck, settings
from hypothesis.database import DirectoryBasedExampleDatabase

from kvspec.conformance.machine import conformance_machine
from kvspec.conformance.runner import load_factory

_FACTORY = load_factory(os.environ.get("KVSPEC_FUZZ_IMPL", "reference"))
_PROFILE = os.environ.get("KVSPEC_FUZZ_PROFILE", "vllm-v1")
# A profile, not per-test settings: HypoFuzz saves what it finds to the active
# profile's database, and that is what every worker must share.
settings.register_profile(
    "kvspec-fuzz",
    database=DirectoryBasedExampleDatabase(os.environ.get("KVSPEC_FUZZ_DB", ".hypothesis/kvspec-fuzz")),
    deadline=None,
    # HypoFuzz refuses tests that suppress nested_given; only the cost checks go.
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    stateful_step_count=50,
)
settings.load_profile("kvspec-fuzz")


def _target(level, enable_caching):
    test_case = conformance_machine(_FACTORY, level, enable_caching, _PROFILE).TestCase
    test_case.settings = settings()
    return test_case


TestPoolCachingOn = _target("pool", True)
TestPoolCachingOff = _target("pool", False)
TestManagerCachingOn = _target("manager", True)
TestManagerCachingOff = _target("manager", False)
