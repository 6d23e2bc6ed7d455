"""A worker: one row of a matrix computed in a process of its own, answering one line of JSON.

The vLLM oracle runs each release in a worker, the plugin matrix each plugin
target: a release's or a plugin's import side effects (module globals such as
``NONE_HASH``, patched classes, threads, loggers) stay in its own process, a
hang costs only its row, and a release's request level runs in the virtual
environment that has it installed. Both go through `run_worker`; a module
that serves as a worker ends with `serve_worker`.

The parent gives the worker a time budget for the harness and a fixed
allowance on top for imports and start-up; a worker that runs past it, exits
non-zero, or prints no JSON result becomes a `WorkerError` whose message is
the row's one-line status (``could not run: ...``). The rejected alternative,
`runner.isolation`'s child with heartbeats, forks this interpreter: it cannot
run another environment's Python.
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["WorkerError", "run_worker", "serve_worker"]


class WorkerError(RuntimeError):
    """A worker gave no result: it ran out of time, crashed, or printed no JSON; the message says which."""


def run_worker(
    module: str,
    args: Sequence[str],
    *,
    python: Path | str = sys.executable,
    env: Mapping[str, str] | None = None,
    time_budget_s: float | None = None,
    allowance_s: float = 120.0,
) -> dict[str, Any]:
    """Run ``python -m <module> <args>`` and read its result, the JSON object on its last line of output.

    Args:
        module: The worker's module, e.g. ``"kvspec.conformance.tools.oracle"``.
        args: Its arguments (``--worker NAME ...``).
        python: The interpreter, e.g. a release's environment's; this one's by default.
        env: The worker's environment variables; this process's when None.
        time_budget_s: The harness's seconds in the worker; None: no limit at all.
        allowance_s: Seconds on top of 1.5 times the budget, for imports and start-up.

    Returns:
        The worker's result.

    Raises:
        WorkerError: no answer in time, a non-zero exit (its last line of stderr
            quoted), or no JSON object on the last line; the message is one line.
    """
    cmd = [str(python), "-m", module, *args]
    timeout = None if time_budget_s is None else time_budget_s * 1.5 + allowance_s
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise WorkerError(f"could not run: no answer within {timeout:.0f} s") from None
    if proc.returncode != 0:
        tail = [line for line in proc.stderr.strip().splitlines() if line.strip()][-1:] or ["?"]
        raise WorkerError(f"could not run: worker exited rc={proc.returncode}: {tail[0][:300]}")
    try:
        parsed = json.loads(proc.stdout.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError):
        parsed = None
    if not isinstance(parsed, dict):
        raise WorkerError(f"could not run: worker printed no result ({proc.stdout[-200:]!r})")
    return parsed


def serve_worker(
    parser: argparse.ArgumentParser, work: Callable[[argparse.Namespace], dict[str, Any]], argv: Sequence[str] | None
) -> int:
    """A worker's main: parse the arguments, do the work, print the result as one line of JSON.

    Args:
        parser: The worker's command line.
        work: Computes the result from the parsed arguments.
        argv: The arguments; ``sys.argv[1:]`` when None.

    Returns:
        0 (a crash is the exception's exit status, which `run_worker` reports).
    """
    logging.disable(logging.WARNING)  # vLLM and plugins log every refused call; the verdicts say it all
    print(json.dumps(work(parser.parse_args(argv))))
    return 0
