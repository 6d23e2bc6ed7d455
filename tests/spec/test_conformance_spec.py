from kvspec.conformance import make_conformance_test
from kvspec.conformance.targets.builtin import make_spec

TestSpecConformance = make_conformance_test(make_spec, max_examples=100)
