"""The examples in a test suite: one line per implementation (both levels, caching on and off)."""

from manager_example import factory

from kvspec.conformance import make_conformance_test

TestExamples = make_conformance_test(factory)
