"""Fuzz targets: the conformance machines as plain Hypothesis tests, for long campaigns under HypoFuzz.

Not collected by the default test run (the file name does not start with
`test_`); name it explicitly:

    hypothesis fuzz --no-dashboard -n 2 -- tests/conformance/fuzz_targets.py

A failure is reported twice over. HypoFuzz saves the shrunk example in the
database under the test's own key, where `pytest tests/conformance/fuzz_targets.py`
replays it and prints the story. And the worker that found it writes the
failing example as a kvspec trace, `fuzz-<Target>-<pid>.trace.jsonl` in
KVSPEC_FUZZ_TRACE_DIR, each time it runs a failing example no longer than the
one kept (so the file ends as the shrunk one), and says so on stderr once;
`kvspec replay` re-runs that file without Hypothesis.

Environment:
    KVSPEC_FUZZ_IMPL  the implementation, a built-in name or module:function (default: reference)
    KVSPEC_FUZZ_DB    the example database directory, shared by every worker and machine
                      that points at it (default: .hypothesis/kvspec-fuzz)
    KVSPEC_FUZZ_PROFILE  the ordering profile the implementation claims (default: vllm-v1)
    KVSPEC_FUZZ_TRACE_DIR  where workers write failure traces (default: ./kvspec-traces)
    KVSPEC_FUZZ_REPLAY  "1": pytest only replays what the database holds, generating nothing new
"""

import os
import sys
from pathlib import Path

from hypothesis import HealthCheck, Phase, settings
from hypothesis.database import DirectoryBasedExampleDatabase

from kvspec.conformance.core.machine import conformance_machine
from kvspec.conformance.core.trace import dumps_trace
from kvspec.conformance.runner.run import DEFAULT_TRACE_DIR, load_factory

_IMPL = os.environ.get("KVSPEC_FUZZ_IMPL", "reference")
_FACTORY = load_factory(_IMPL)
_PROFILE = os.environ.get("KVSPEC_FUZZ_PROFILE", "vllm-v1")
_TRACE_DIR = Path(os.environ.get("KVSPEC_FUZZ_TRACE_DIR", str(DEFAULT_TRACE_DIR)))
# Replaying only, for checking what a campaign saved: without generation a
# pass means the database holds no failure, not that none was found anew.
_PHASES = (Phase.explicit, Phase.reuse) if os.environ.get("KVSPEC_FUZZ_REPLAY") == "1" else tuple(Phase)
# A profile, not per-test settings: HypoFuzz saves what it finds to the active
# profile's database, and that is what every worker must share. Its parent is
# Hypothesis's default, named: without one it inherits the profile loaded when
# it is registered, which under CI=1 is tests/conftest.py's derandomized `ci`,
# and HypoFuzz refuses derandomized tests ("sets_derandomize").
settings.register_profile(
    "kvspec-fuzz",
    parent=settings.get_profile("default"),
    derandomize=False,
    database=DirectoryBasedExampleDatabase(os.environ.get("KVSPEC_FUZZ_DB", ".hypothesis/kvspec-fuzz")),
    deadline=None,
    # HypoFuzz refuses tests that suppress nested_given; only the cost checks go.
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    stateful_step_count=50,
    phases=_PHASES,
    print_blob=True,
)
settings.load_profile("kvspec-fuzz")


def _target(name, level, enable_caching):
    machine = conformance_machine(_FACTORY, level, enable_caching, _PROFILE)
    # Per worker process: the steps of the shortest failing example written so far.
    kept: dict[str, int] = {}

    def teardown(self):
        lock = self.lock
        try:
            machine.teardown(self)
        finally:
            if lock is not None and lock.failure is not None:
                _keep_trace(name, lock.trace(_IMPL), kept)

    # NOTE: the trace is written from the machine's teardown, not by the engine:
    # HypoFuzz prints nothing when a worker finds a failure (its dashboard shows
    # it), and shrinking runs many failing examples, so the file is rewritten
    # while they get no longer and the shrunk example, run last, is what stays.
    fuzzed = type(name, (machine,), {"teardown": teardown, "__module__": __name__})
    test_case = fuzzed.TestCase
    test_case.settings = settings()
    return test_case


def _keep_trace(name, trace, kept):
    """Write `trace` over this worker's trace of target `name` unless a shorter failure was kept."""
    num_steps = len(trace.steps)
    if name in kept and num_steps > kept[name]:
        return
    first = name not in kept
    kept[name] = num_steps
    _TRACE_DIR.mkdir(parents=True, exist_ok=True)
    path = _TRACE_DIR / f"fuzz-{name}-{os.getpid()}.trace.jsonl"
    partial = path.with_suffix(".partial")
    partial.write_text(dumps_trace(trace), encoding="utf-8")
    partial.replace(path)  # a reader never sees half a trace
    if first:
        failure = trace.failure
        print(
            f"kvspec fuzz: {name} found a failure ({failure.kind.value} at step {failure.step}, {failure.op}) "
            f"on {_IMPL}; the shortest failing example this worker runs is kept in {path} "
            f"(kvspec replay {path})",
            file=sys.stderr,
            flush=True,
        )


TestPoolCachingOn = _target("TestPoolCachingOn", "pool", True)
TestPoolCachingOff = _target("TestPoolCachingOff", "pool", False)
TestManagerCachingOn = _target("TestManagerCachingOn", "manager", True)
TestManagerCachingOff = _target("TestManagerCachingOff", "manager", False)
