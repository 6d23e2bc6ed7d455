"""gpu_impl conforms to the spec: the harness's own machine, pool and manager level, caching on and off.

The harness runs each campaign in a forked child. CUDA cannot be used in a
child forked from a process that has already used it (as this test process
has, on a CUDA machine, by the time it gets here), so the campaigns run
gpu_impl on the CPU; `kvspec check --impl gpu` in a fresh process (the device
check script) runs them on CUDA. With events on, its KV cache events and hit
statistics are checked like its state, under a keyed profile and KV cache
groups at the request level.
"""

from dataclasses import replace

import pytest

from kvspec.conformance.core.adapter import AdapterConfig
from kvspec.conformance.core.coverage import EVENT_BRANCHES, MANAGER_EVENT_BRANCHES
from kvspec.conformance.runner.run import run_check
from kvspec.conformance.runner.testcase import make_conformance_test
from kvspec.gpu_impl.adapter import make_adapter


def make_adapter_on_cpu(config: AdapterConfig) -> object:
    return make_adapter(replace(config, device=config.device or "cpu"))


# 50 examples per configuration keeps the four campaigns near 15 s on two cores;
# `kvspec check --impl gpu` runs the full 100.
TestGpuImplConforms = pytest.mark.heavy(make_conformance_test(make_adapter_on_cpu, max_examples=50))


@pytest.mark.parametrize(
    ("level", "profile", "groups"),
    [("pool", "vllm-v1", "full"), pytest.param("manager", "lru-timestamp", "full,sliding:8", marks=pytest.mark.heavy)],
    ids=["pool", "manager-keyed-groups"],
)
def test_gpu_impl_publishes_the_specs_events_and_counts_its_hits(level, profile, groups, tmp_path):
    """`kvspec check --impl gpu --events`: every event kind and counter reached and equal to the spec's."""
    r = run_check(
        make_adapter_on_cpu,
        level=level,
        profile=profile,
        groups=groups,
        events=True,
        max_examples=60,
        cover_rounds=10,
        trace_dir=tmp_path,
        impl="gpu",
    )
    assert r.verdict == "conforms", r.failure.story if r.failure else r.message
    expected = EVENT_BRANCHES + (MANAGER_EVENT_BRANCHES if level == "manager" else ())
    assert [b for b in expected if not r.coverage.get(b)] == []
    assert not r.absent_ops and not r.not_exercised  # it has every method and declares nothing away
