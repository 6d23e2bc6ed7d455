"""The conformance harness: check an implementation of the block manager against the spec.

Three names are the public surface; everything else lives in the submodules
(`runner.run_check`, `runner.replay`, `machine.conformance_machine`, `trace`):

- `BlockManagerAdapter`: the protocol an implementation's pool adapter speaks;
- `Snapshot`: the normal form of state it reports;
- `make_conformance_test`: one line in a test suite to check an adapter factory.

    from kvspec.conformance import make_conformance_test
    TestMyPool = make_conformance_test(my_package.make_adapter)
"""

from kvspec.conformance.adapter import BlockManagerAdapter
from kvspec.conformance.runner import make_conformance_test
from kvspec.spec.state import Snapshot

__all__ = ["BlockManagerAdapter", "Snapshot", "make_conformance_test"]
