"""The conformance harness: check an implementation of the block manager against the spec.

The harness is four layers, each importing only from the ones before it:

- ``core``: the lock-step core. The operation table, results, traces, the
  Hypothesis machines, the lock-step call that runs the spec beside an
  adapter, strategies, coverage, the stories a failure is told in.
- ``runner``: a run. The registry of targets (found through the
  ``kvspec.targets`` entry points), campaigns, jobs, isolation of a crash or
  hang in a child process, minimisation, replay, `run_check`.
- ``targets``: what is checked. The built-ins (spec, reference; gpu_impl
  lives in its own package), vLLM's releases, plugins of vLLM's block
  manager; the catalog that registers them.
- ``tools``: what people run. The command line, the step-through player,
  simulate and its workloads, the walkthroughs, CrossHair's contracts, the
  router's mirror, the vLLM oracle, the mutant table.

The public surface, for an implementation's own tests and adapters:

- `BlockManagerAdapter`, `KVCacheManagerAdapter`: the protocols an
  implementation's adapters speak; `AdapterConfig`: what its factory is given;
- `Snapshot`: the normal form of state it reports;
- `Target`: the record a third-party pool registers under ``kvspec.targets``;
- `make_conformance_test`: one line in a test suite to check an adapter factory.

    from kvspec.conformance import make_conformance_test
    TestMyPool = make_conformance_test(my_package.make_adapter)
"""

from kvspec.conformance.core.adapter import AdapterConfig, BlockManagerAdapter, KVCacheManagerAdapter
from kvspec.conformance.runner.registry import Target
from kvspec.conformance.runner.testcase import make_conformance_test
from kvspec.spec.state import Snapshot

__all__ = [
    "AdapterConfig",
    "BlockManagerAdapter",
    "KVCacheManagerAdapter",
    "Snapshot",
    "Target",
    "make_conformance_test",
]
