from kvspec.conformance import make_conformance_test
from kvspec.conformance.targets.builtin import make_reference

TestReferenceConformance = make_conformance_test(make_reference, max_examples=100)
TestReferenceEvents = make_conformance_test(make_reference, max_examples=100, enable_caching=True, events=True)
