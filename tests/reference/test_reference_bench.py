"""The reference benchmark runs, end to end, on tiny pools (a smoke test, not a timing test)."""

from __future__ import annotations

import argparse

import pytest

from kvspec.benchmarks import reference_bench
from kvspec.conformance.tools.commands import bench


def test_measure_times_every_operation_at_every_size() -> None:
    results = reference_bench.measure(sizes=[40, 80], repeat=3)
    assert {(m.operation, m.num_gpu_blocks) for m in results} == {
        (op, size) for op in reference_bench.OPERATIONS for size in (40, 80)
    }
    for m in results:
        assert m.seconds > 0
        assert m.num_calls == (reference_bench.SCALE_CALLS if m.operation.startswith("snapshot") else 3)


def test_render_gives_each_size_its_ratio_to_the_first() -> None:
    results = [
        reference_bench.Measurement("touch(16)", 1000, 2e-6, 10),
        reference_bench.Measurement("touch(16)", 10_000, 3e-6, 10),
    ]
    table = reference_bench.render(results)
    header, rule, row = table.splitlines()
    assert "1,000 blocks" in header and "10,000 blocks" in header
    assert row.split() == ["touch(16)", "2.00", "us", "(", "1.00x)", "3.00", "us", "(", "1.50x)"]


def _bench_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvspec")
    bench.register(parser.add_subparsers(dest="command"))
    return parser


def test_kvspec_bench_reference_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    args = _bench_parser().parse_args(["bench", "reference", "--sizes", "40", "80", "--repeat", "2"])
    assert args.run(args) == 0
    out = capsys.readouterr().out
    for op in reference_bench.OPERATIONS:
        assert op in out
    assert " 1.00x)" in out


def test_kvspec_bench_refuses_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    args = _bench_parser().parse_args(["bench", "reference", "--sizes", "16"])
    assert args.run(args) == 2
    assert "sizes must exceed 16 blocks" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _bench_parser().parse_args(["bench", "tpu"])


def test_a_benchmark_that_cannot_load_exits_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(bench.TARGETS, "gpu", "kvspec.benchmarks.no_such_benchmark")
    args = _bench_parser().parse_args(["bench", "gpu"])
    assert args.run(args) == 2
    assert "cannot load kvspec.benchmarks.no_such_benchmark" in capsys.readouterr().err
