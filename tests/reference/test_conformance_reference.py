from kvspec.conformance import make_conformance_test
from kvspec.conformance.builtin import make_reference

TestReferenceConformance = make_conformance_test(make_reference, max_examples=40)
