import pytest

from kvspec.conformance import make_conformance_test
from kvspec.conformance.targets.builtin import make_reference

# Whole campaigns: the heavy stage of scripts/test.sh.
TestReferenceConformance = pytest.mark.heavy(make_conformance_test(make_reference, max_examples=100))
TestReferenceEvents = pytest.mark.heavy(
    make_conformance_test(make_reference, max_examples=100, enable_caching=True, events=True)
)
