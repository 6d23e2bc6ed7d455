"""gpu_impl conforms to the spec: the harness's own machine, pool and manager level, caching on and off.

The harness runs each campaign in a forked child. CUDA cannot be used in a
child forked from a process that has already used it (as this test process
has, on a CUDA machine, by the time it gets here), so the campaigns run
gpu_impl on the CPU; `kvspec check --impl gpu` in a fresh process (the device
check script) runs them on CUDA.
"""

from dataclasses import replace

from kvspec.conformance.adapter import AdapterConfig
from kvspec.conformance.runner import make_conformance_test
from kvspec.gpu_impl.adapter import make_adapter


def make_adapter_on_cpu(config: AdapterConfig) -> object:
    return make_adapter(replace(config, device=config.device or "cpu"))


# 50 examples per configuration keeps the four campaigns near 15 s on two cores;
# `kvspec check --impl gpu` runs the full 100.
TestGpuImplConforms = make_conformance_test(make_adapter_on_cpu, max_examples=50)
