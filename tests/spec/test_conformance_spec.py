import pytest

from kvspec.conformance import make_conformance_test
from kvspec.conformance.targets.builtin import make_spec

# Four whole campaigns: the heavy stage of scripts/test.sh.
TestSpecConformance = pytest.mark.heavy(make_conformance_test(make_spec, max_examples=100))
