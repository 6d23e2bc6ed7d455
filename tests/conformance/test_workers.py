"""A matrix row's worker process and what its parent makes of it (kvspec.conformance.runner.workers).

Each worker here is a module written to a temporary folder and run with
``python -m``, as the oracle and the plugin matrix run theirs: one that
answers, one that crashes, one that prints no result, one that never ends.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest

from kvspec.conformance.runner.workers import WorkerError, run_worker, serve_worker

_WORKERS = {
    "answers": (
        "import argparse, sys\n"
        "from kvspec.conformance.runner.workers import serve_worker\n"
        "parser = argparse.ArgumentParser()\n"
        "parser.add_argument('--worker')\n"
        "work = lambda a: {'row': a.worker, 'env': __import__('os').environ['ROW_ENV']}\n"
        "sys.exit(serve_worker(parser, work, None))\n"
    ),
    "crashes": "print('started')\nraise ValueError('the release has no BlockPool')\n",
    "prints_no_result": "print('[1, 2]')\n",
    "hangs": "import threading\nprint('{}', flush=True)\nthreading.Event().wait()\n",
}


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    for name, source in _WORKERS.items():
        (tmp_path / f"worker_{name}.py").write_text(source)
    path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, "ROW_ENV": "given"}


def test_a_worker_answers_with_one_json_object_in_the_environment_given(env: dict[str, str]) -> None:
    assert run_worker("worker_answers", ["--worker", "0.33.0"], env=env, time_budget_s=30) == {
        "row": "0.33.0",
        "env": "given",
    }


def test_a_crash_is_one_line_with_the_exit_status_and_the_last_line_of_stderr(env: dict[str, str]) -> None:
    expected = r"^could not run: worker exited rc=1: ValueError: the release has no BlockPool$"
    with pytest.raises(WorkerError, match=expected):
        run_worker("worker_crashes", [], env=env)


def test_output_that_is_no_json_object_is_no_result(env: dict[str, str]) -> None:
    with pytest.raises(WorkerError, match=r"^could not run: worker printed no result \('\[1, 2\]\\n'\)$"):
        run_worker("worker_prints_no_result", [], env=env)


def test_a_worker_past_its_budget_and_allowance_is_stopped(env: dict[str, str]) -> None:
    # 1.5 times the budget plus the allowance: 0.2 * 1.5 + 0.7 = 1 s
    with pytest.raises(WorkerError, match=r"^could not run: no answer within 1 s$"):
        run_worker("worker_hangs", [], env=env, time_budget_s=0.2, allowance_s=0.7)


def test_serve_worker_prints_the_result_as_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--level")

    def work(args: argparse.Namespace) -> dict[str, Any]:
        return {"level": args.level, "cells": {"pool/on": {"verdict": "conforms"}}}

    try:
        assert serve_worker(parser, work, ["--level", "pool"]) == 0
    finally:
        logging.disable(logging.NOTSET)  # a worker quiets logging for its whole process; this one is pytest's
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and json.loads(out) == work(argparse.Namespace(level="pool"))
