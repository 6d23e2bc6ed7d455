"""Running the harness: a campaign against one implementation, a replay, and the test-suite hook.

`run_check` runs the state machine of one level against one implementation
and returns a `CheckResult`: the verdict, how much was run, what the run
reached, and for a failure the shrunk trace (saved as a file) and its story.

Design choice: the campaign runs in a child process (forked, so the factory
need not be importable by name) that writes each step to a file before the
implementation runs it, while the parent watches a heartbeat. An
implementation that segfaults, calls `os._exit`, or hangs inside C code
therefore ends only the child; the parent reports it as crashed or hung with
the steps that led there (re-checked on the spec, then cut down by replaying
shorter traces), and the harness itself never hangs. Inside the child a
per-step alarm turns a hang in Python code into a clean report at once. The
rejected alternative, running in-process with a watchdog thread, cannot stop
a thread stuck in C and dies with a segfaulting implementation; it remains
the fallback where `fork` does not exist.

Exit codes (the CLI's): 0 conforms, 1 diverges, 2 could not complete: the
implementation crashed or hung (with its trace), or could not be built or
loaded, or the arguments were wrong.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import hashlib
import importlib
import multiprocessing
import os
import signal
import sys
import tempfile
import time
import traceback
import unittest
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, Phase, Verbosity, settings
from hypothesis import seed as hypothesis_seed
from hypothesis.errors import Flaky
from hypothesis.stateful import run_state_machine_as_test

from kvspec.conformance.adapter import AdapterConfig
from kvspec.conformance.coverage import expected_branches
from kvspec.conformance.lockstep import ConformanceFailure, LockStep, Observer, SpecFailure, StepTimeout, run_spec
from kvspec.conformance.machine import conformance_machine
from kvspec.conformance.report import render_story
from kvspec.conformance.trace import (
    MalformedTrace,
    Outcome,
    Trace,
    TraceStep,
    dumps_trace,
    parse_trace,
    read_trace,
)
from kvspec.spec.ordering import PROFILES

__all__ = [
    "BUILTIN_IMPLS",
    "DEFAULT_IMPLS",
    "EXIT_CODES",
    "CheckResult",
    "Failure",
    "FactoryError",
    "load_factory",
    "make_conformance_test",
    "replay",
    "run_check",
]

Factory = Callable[[AdapterConfig], object]

# Built-in implementations by name -> "module:function". Others add entries here
# as they land; a name whose module does not import gives a clean could-not-run.
BUILTIN_IMPLS: dict[str, str] = {
    "reference": "kvspec.conformance.builtin:make_reference",
    "spec": "kvspec.conformance.builtin:make_spec",
    "gpu": "kvspec.gpu_impl.adapter:make_adapter",
    "vllm": "kvspec.conformance.vllm.adapter:make_adapter",
}
# What `kvspec check` runs without --impl (those whose module imports); vllm is
# the regression oracle's business and runs only when named.
DEFAULT_IMPLS: tuple[str, ...] = ("reference", "spec", "gpu")

# The spec's caller-mistake errors, as coverage names them ("free_blocks: DoubleFree").
_ERROR_TYPES = frozenset(
    {"InvalidRequest", "InvalidBlock", "DoubleFree", "AlreadyCached", "PoolExhausted", "NotWritable"}
)

EXIT_CODES: dict[str, int] = {"conforms": 0, "diverges": 1, "crashed": 2, "hung": 2, "could-not-run": 2}

_POOL_METHODS = (
    "get_new_blocks",
    "touch",
    "get_cached_block",
    "cache_full_blocks",
    "free_blocks",
    "reset_prefix_cache",
    "snapshot",
)
_MANAGER_METHODS = ("get_computed_blocks", "allocate_slots", "free", "snapshot")
# How long past the step limit the parent waits before it kills the child: the
# child's own alarm usually reports first, with a cleaner trace.
_KILL_GRACE_S = 2.0


class FactoryError(ValueError):
    """An implementation name that cannot be turned into a factory: unknown, not importable, not callable."""


# "vllm@0.24.0": that vLLM release's real pool, loaded from its wheel (light mode, fetched on first use).
VLLM_RELEASE_PREFIX = "vllm@"


def _vllm_release_factory(name: str) -> Factory:
    """The factory for `vllm@<release>`; the release itself is fetched and loaded when an adapter is built."""
    try:
        from kvspec.conformance.vllm.adapter import factory_for
    except Exception as e:  # an import can fail any way the module's top level can
        raise FactoryError(
            f"implementation {name!r}: the vLLM adapter does not import ({type(e).__name__}: {e})"
        ) from None
    try:
        factory: Factory = factory_for(name)
    except ValueError as e:
        raise FactoryError(f"implementation {name!r}: {e}") from None
    return factory


def load_factory(name: str) -> Factory:
    """The factory a name stands for: a built-in name ("reference", ...), "vllm@<release>" or "module:function".

    Raises:
        FactoryError: the name is malformed, the module does not import, the
            attribute is missing, or it is not callable; the message says which.
    """
    if name.startswith(VLLM_RELEASE_PREFIX):
        return _vllm_release_factory(name)
    target = BUILTIN_IMPLS.get(name, name)
    if ":" not in target:
        known = ", ".join(sorted(BUILTIN_IMPLS))
        raise FactoryError(f"implementation {name!r} is neither a built-in name ({known}) nor module:function")
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise FactoryError(f"implementation {name!r}: expected module:function, got {target!r}")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as e:  # an import can fail any way the module's top level can
        raise FactoryError(
            f"implementation {name!r}: module {module_name} does not import ({type(e).__name__}: {e})"
        ) from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise FactoryError(f"implementation {name!r}: module {module_name} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise FactoryError(f"implementation {name!r}: {target} is a {type(obj).__name__}, not a callable factory")
    factory: Factory = obj
    return factory


@dataclass
class Failure:
    """The shrunk counterexample of a failed check."""

    kind: str  # "diverges" | "invariant" | "crashed" | "hung"
    step_index: int  # the first bad step in the shrunk trace (1-based; 0: building the adapter)
    op: str  # the operation at that step
    message: str  # what differed / which invariant (by name) / the exception
    invariant: str | None  # the invariant or rule's name, for kind "invariant"
    trace_path: str | None  # the saved JSON-lines trace of the shrunk failure
    num_steps: int  # length of the shrunk trace
    story: str  # the printed short story
    is_shrunk: bool = True  # False when a dead or hung process left an unshrunk trace that could not be cut


@dataclass
class CheckResult:
    """What one campaign (one implementation, level, caching mode, profile) found."""

    verdict: str  # "conforms" | "diverges" | "crashed" | "hung" | "could-not-run"
    level: str
    enable_caching: bool
    profile: str
    examples_run: int
    steps_run: int
    seconds: float
    failure: Failure | None
    coverage: dict[str, int]  # spec branches and workload events reached, with counts (0: not reached)
    impl: str = ""  # the implementation's name, as given
    states_reached: int = 0  # distinct spec states (hash values up to renaming)
    invariants_checked: int = 0  # invariant and rule evaluations on the implementation's states
    branches: tuple[str, ...] = ()  # the branches this configuration is expected to reach
    message: str = ""  # why it could not run, or a note (time budget spent, flaky failure)
    deepest_trace_path: str | None = None  # the example that reached the most events, when kept
    seed: int = 0
    not_exercised: tuple[str, ...] = ()  # caller mistakes ("<op>: <mistake>") the adapter declares it does not reject
    device: str | None = None  # AdapterConfig.device the adapters were built with
    extra_rounds: int = 0  # rounds run after max_examples because a branch was unreached (see cover_rounds)

    @property
    def exit_code(self) -> int:
        """0 conforms, 1 diverges, 2 crashed / hung / could not run."""
        return EXIT_CODES[self.verdict]

    @property
    def steps_per_second(self) -> float:
        """Lock-step operations checked per second of the campaign."""
        return self.steps_run / self.seconds if self.seconds > 0 else 0.0

    @property
    def unreached(self) -> list[str]:
        """Expected branches this campaign did not reach."""
        return [b for b in self.branches if not self.coverage.get(b)]


# --- the child process --------------------------------------------------------------------


@dataclass
class _Death:
    """How a child process ended without handing back a result."""

    hung: bool  # killed by the parent for not answering
    exitcode: int | None
    stream: list[str] = field(default_factory=list)  # the steps it had started, as written


def _isolated(
    work: Callable[[int | None, Any], dict[str, Any]], step_timeout_s: float | None
) -> dict[str, Any] | _Death:
    """Run `work(stream_fd, heartbeat)` in a forked child; its result, or how it died.

    The child turns off the traceback dump on a fatal signal that test runners
    enable (faulthandler): the report names the step, and the replays that cut a
    crash trace down would each print one.
    """
    ctx = multiprocessing.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    heartbeat = ctx.RawValue("d", 0.0)
    fd, stream_path = tempfile.mkstemp(prefix="kvspec-steps-", suffix=".jsonl")
    os.close(fd)
    proc = ctx.Process(target=_child_main, args=(work, send, heartbeat, stream_path), daemon=True)
    try:
        proc.start()
        send.close()
        result: dict[str, Any] | None = None
        hung = False
        while True:
            if recv.poll(0.05):
                try:
                    result = recv.recv()
                except EOFError:
                    result = None
                break
            if not proc.is_alive():
                if recv.poll(0.2):
                    try:
                        result = recv.recv()
                    except EOFError:
                        result = None
                break
            started = heartbeat.value
            if step_timeout_s is not None and started and time.monotonic() - started > step_timeout_s + _KILL_GRACE_S:
                proc.kill()
                hung = True
                break
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join()
        if result is not None:
            return result
        stream = Path(stream_path).read_text(encoding="utf-8", errors="replace").splitlines()
        return _Death(hung=hung, exitcode=proc.exitcode, stream=stream)
    finally:
        recv.close()
        Path(stream_path).unlink(missing_ok=True)


def _child_main(work: Callable[[int | None, Any], dict[str, Any]], conn: Any, heartbeat: Any, stream_path: str) -> None:
    faulthandler.disable()
    fd = os.open(stream_path, os.O_WRONLY | os.O_TRUNC)
    try:
        result = work(fd, heartbeat)
    except BaseException as e:  # the harness itself failed: report it, never hang the parent
        result = {
            "verdict": "could-not-run",
            "message": f"the harness failed: {type(e).__name__}: {e}\n{traceback.format_exc()}",
        }
    conn.send(result)
    conn.close()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip the exit handlers this child inherited from its parent (a test runner's, say).
    os._exit(0)


def _cuda_started_here() -> bool:
    """Whether this process has started CUDA (through torch): a forked child could then not use it.

    Asks only torch's own flag, which starts nothing; a process that never
    imported torch has not started CUDA through it.
    """
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    is_initialized = getattr(cuda, "is_initialized", None)
    return bool(is_initialized()) if callable(is_initialized) else False


def _run(
    work: Callable[[int | None, Any], dict[str, Any]], step_timeout_s: float | None, isolate: bool
) -> dict[str, Any] | _Death:
    # NOTE: CUDA cannot be started again in a child forked from a process that
    # started it. The harness never touches CUDA itself (gpu_impl picks and
    # starts its device inside the child); if the calling process did, the
    # campaign runs here instead, without the child's crash protection.
    if isolate and "fork" in multiprocessing.get_all_start_methods() and not _cuda_started_here():
        return _isolated(work, step_timeout_s)
    return work(None, None)


# --- one campaign, inside the child -------------------------------------------------------


def _probe(factory: Factory, config: AdapterConfig) -> str | None:
    """Why no campaign can run on this factory at this level, or None."""
    try:
        adapter = factory(config)
    except Exception as e:
        return f"building the adapter failed for {config}: {type(e).__name__}: {e}"
    needed = _POOL_METHODS if config.level == "pool" else _MANAGER_METHODS
    missing = [m for m in needed if not callable(getattr(adapter, m, None))]
    if missing:
        return f"the {config.level}-level adapter {type(adapter).__name__} lacks {', '.join(m + '()' for m in missing)}"
    return None


def _failure_dict(failure: ConformanceFailure | SpecFailure, lock: LockStep | None) -> dict[str, Any]:
    if isinstance(failure, SpecFailure):
        return {
            "kind": "spec",
            "step": len(lock.records) if lock else 0,
            "op": "?",
            "message": str(failure),
            "invariant": None,
        }
    return {
        "kind": failure.kind,
        "step": failure.step_index,
        "op": failure.op,
        "message": failure.message,
        "invariant": failure.invariant,
    }


_VERDICT_OF_KIND = {
    "diverges": "diverges",
    "invariant": "diverges",
    "crashed": "crashed",
    "hung": "hung",
    "spec": "could-not-run",
}


def _example_trace(lock: LockStep, impl: str | None, verdict: str | None, failure: dict[str, Any] | None) -> str:
    return dumps_trace(
        Trace(config=lock.config, steps=tuple(lock.records), impl=impl, verdict=verdict, failure=failure)
    )


def _campaign(
    factory: Factory,
    *,
    level: str,
    enable_caching: bool,
    profile: str,
    max_examples: int,
    seed: int,
    time_budget_s: float | None,
    step_timeout_s: float | None,
    steps_per_example: int,
    keep_deepest: bool,
    impl: str | None,
    database: Any,
    stream_fd: int | None,
    heartbeat: Any,
    device: str | None = None,
    shrink: bool = True,
    cover_rounds: int = 0,
) -> dict[str, Any]:
    start = time.monotonic()
    deadline = start + time_budget_s if time_budget_s is not None else None
    observer = Observer(step_timeout_s, stream_fd, heartbeat, keep_deepest, impl, device)
    base: dict[str, Any] = {"examples": 0, "steps": 0, "coverage": {}, "states": 0, "invariants_checked": 0}
    verdict, message, extra_rounds = "conforms", "", 0
    failure: tuple[ConformanceFailure | SpecFailure, LockStep | None] | None = None
    undo = observer.install_alarm()
    try:
        observer.impl_started()
        try:
            why = _probe(factory, AdapterConfig(level, 8, enable_caching, profile, device=device))  # type: ignore[arg-type]
        finally:
            observer.impl_finished()
        if why is not None:
            return {**base, "verdict": "could-not-run", "message": why, "seconds": time.monotonic() - start}
        # A time budget runs the campaign in chunks (seed, seed + 1, ...) sized to
        # the time left: Hypothesis has no time limit of its own, and an exception
        # raised inside a test to stop it would be taken for flaky data generation.
        # One seed can also miss a rare branch: while one is unreached, up to
        # `cover_rounds` more rounds of as many examples run on the next seeds, so
        # the coverage reported is the campaign's rather than one seed's luck.
        branches = expected_branches(level, enable_caching, profile)
        remaining, chunk_seed = max_examples, seed
        while failure is None:
            if remaining <= 0:
                reachable = _reachable(branches, observer.coverage, observer.not_exercised, observer.absent_ops)
                if extra_rounds == cover_rounds or all(observer.coverage.get(b) for b in reachable):
                    break
                remaining, extra_rounds = max_examples, extra_rounds + 1
            n = remaining
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    message = f"time budget of {time_budget_s:g} s spent"
                    break
                per_example = (time.monotonic() - start) / observer.examples if observer.examples else None
                n = min(remaining, 20 if per_example is None else max(10, int(left / per_example)))
            failure, message = _run_chunk(
                factory, observer, level, enable_caching, profile, n, chunk_seed, steps_per_example, database, shrink
            )
            remaining -= n
            chunk_seed += 1
        if failure is not None:
            found = failure[0]
            verdict = _VERDICT_OF_KIND["spec" if isinstance(found, SpecFailure) else found.kind]
    finally:
        undo()
    result: dict[str, Any] = {
        "verdict": verdict,
        "message": message,
        "examples": observer.examples,
        "steps": observer.steps,
        "coverage": dict(observer.coverage),
        "states": len(observer.states),
        "invariants_checked": observer.invariants_checked,
        "seconds": time.monotonic() - start,
        "not_exercised": sorted(observer.not_exercised),
        "absent_ops": sorted(observer.absent_ops),
        "extra_rounds": extra_rounds,
    }
    if failure is not None:
        found, lock = failure
        fd = _failure_dict(found, lock)
        result["failure"] = fd
        result["trace"] = _example_trace(lock, impl, verdict, fd) if lock is not None else None
    if observer.deepest is not None:
        result["deepest"] = _example_trace(observer.deepest[1], impl, "conforms", None)
    return result


def _run_chunk(
    factory: Factory,
    observer: Observer,
    level: str,
    enable_caching: bool,
    profile: str,
    max_examples: int,
    seed: int,
    steps_per_example: int,
    database: Any,
    shrink: bool = True,
) -> tuple[tuple[ConformanceFailure | SpecFailure, LockStep | None] | None, str]:
    """One Hypothesis run of the machine; the failure it found (shrunk unless `shrink` is False) and a note."""
    machine = conformance_machine(factory, level, enable_caching, profile, observer)
    hypothesis_seed(seed)(machine)
    # Targeting (hill-climbing on the reuse of cached blocks) pays off only in
    # long runs; in a short one it spends the examples on one example's neighbours.
    phases = [Phase.explicit, Phase.reuse, Phase.generate] + ([Phase.shrink] if shrink else [])
    if max_examples >= 1000:
        phases.append(Phase.target)
    run_settings = settings(
        max_examples=max_examples,
        stateful_step_count=steps_per_example,
        deadline=None,
        database=database,
        derandomize=False,
        suppress_health_check=list(HealthCheck),
        verbosity=Verbosity.quiet,
        report_multiple_bugs=False,
        phases=phases,
        print_blob=False,
    )
    try:
        run_state_machine_as_test(machine, settings=run_settings)
    except StepTimeout:
        lock = observer.current
        hung = lock.hung() if lock is not None else ConformanceFailure("hung", 0, "?", "no answer")
        return (hung, lock), ""
    except (ConformanceFailure, SpecFailure, Flaky) as e:
        if observer.failure is None:
            raise
        found, lock = observer.failure
        message = ""
        if isinstance(e, Flaky):
            message = "the failure did not reproduce every time (the implementation is not deterministic?)"
        if isinstance(found, SpecFailure):
            message = f"the spec itself failed; a bug in kvspec: {found}"
        return (found, lock), message
    return None, ""


# --- replay, inside the child --------------------------------------------------------------


def _replay_work(
    trace: Trace,
    factory: Factory,
    impl: str | None,
    step_timeout_s: float | None,
    stream_fd: int | None,
    heartbeat: Any,
) -> dict[str, Any]:
    start = time.monotonic()
    observer = Observer(step_timeout_s, stream_fd, heartbeat, False, impl)
    undo = observer.install_alarm()
    lock: LockStep | None = None
    verdict, found = "conforms", None
    try:
        try:
            lock = LockStep(factory, trace.config, observer)
            lock.check()
            for step in trace.steps:
                lock.call(step.op, *step.args)
                lock.check()
        except (ConformanceFailure, SpecFailure) as e:
            found = e
            verdict = _VERDICT_OF_KIND["spec" if isinstance(e, SpecFailure) else e.kind]
        except StepTimeout:
            verdict = "hung"
            found = lock.hung() if lock is not None else ConformanceFailure("hung", 0, "init", "no answer")
    finally:
        undo()
    result: dict[str, Any] = {
        "verdict": verdict,
        "message": "",
        "examples": 1,
        "steps": observer.steps,
        "coverage": dict(observer.coverage),
        "states": len(observer.states),
        "invariants_checked": observer.invariants_checked,
        "seconds": time.monotonic() - start,
    }
    fd = _failure_dict(found, lock) if found is not None else None
    if fd is not None:
        result["failure"] = fd
    if lock is not None:
        result["trace"] = _example_trace(lock, impl, verdict, fd)
    return result


# --- a process that died: rebuild its trace from the stream ---------------------------------


def _trace_from_death(
    death: _Death, impl: str | None, step_timeout_s: float | None
) -> tuple[Trace, dict[str, Any]] | None:
    """The steps a dead child had started, checked on the spec, with the last one marked crashed or hung."""
    if not death.stream:
        return None
    try:
        partial = parse_trace(death.stream, "<steps of the dead process>")
    except MalformedTrace:
        return None
    if death.hung:
        what = f"no answer within the step time limit of {step_timeout_s:g} s; the process was killed"
        kind = "hung"
    else:
        code = death.exitcode
        sig = f"signal {-code} ({signal.Signals(-code).name})" if code is not None and code < 0 else f"exit code {code}"
        what = f"the process died ({sig}) during this step"
        kind = "crashed"
    steps = _spec_side(partial)
    last = len(steps)
    op = steps[-1].op if steps else "init"
    outcome = Outcome(hung=True, message=what) if kind == "hung" else Outcome(crashed=True, message=what)
    if steps:
        s = steps[-1]
        steps[-1] = TraceStep(s.index, s.op, s.args, s.spec, outcome, s.spec_snapshot, None)
    failure = {"kind": kind, "step": last, "op": op, "message": what, "invariant": None}
    trace = Trace(config=partial.config, steps=tuple(steps), impl=impl, verdict=kind, failure=failure)
    return trace, failure


def _spec_side(trace: Trace) -> list[TraceStep]:
    """Each step's spec outcome and state (the implementation matched them up to its last step)."""
    outcomes = run_spec(trace.config, [(s.op, s.args) for s in trace.steps])
    return [TraceStep(s.index, s.op, s.args, o, None, snap, None) for s, (o, snap) in zip(trace.steps, outcomes)]


def _minimize(
    trace: Trace, factory: Factory, kind: str, step_timeout_s: float | None, budget_s: float
) -> tuple[Trace, bool]:
    """Cut steps from a crash or hang trace while it still crashes or hangs (delta debugging by replay).

    Returns the shortest trace found and whether the search finished within `budget_s`.
    """
    deadline = time.monotonic() + budget_s
    steps = list(trace.steps)

    def still_fails(candidate: list[TraceStep]) -> bool:
        t = Trace(config=trace.config, steps=tuple(_renumber(candidate)), impl=trace.impl)
        outcome = _run(
            lambda fd, hb: _replay_work(t, factory, trace.impl, step_timeout_s, fd, hb), step_timeout_s, True
        )
        if isinstance(outcome, _Death):
            return (kind == "hung") == outcome.hung
        return bool(outcome["verdict"] == kind)

    chunk = max(len(steps) // 2, 1)
    while chunk >= 1 and len(steps) > 1:
        i, changed = 0, False
        while i < len(steps) - 1:
            if time.monotonic() > deadline:
                return Trace(config=trace.config, steps=tuple(_renumber(steps)), impl=trace.impl), False
            # The failing step is the last one; it always stays.
            candidate = steps[:i] + steps[i + chunk :]
            if candidate and candidate[-1] is steps[-1] and still_fails(candidate):
                steps, changed = candidate, True
            else:
                i += chunk
        if not changed:
            chunk //= 2
    return Trace(config=trace.config, steps=tuple(_renumber(steps)), impl=trace.impl), True


def _renumber(steps: Sequence[TraceStep]) -> list[TraceStep]:
    return [TraceStep(i + 1, s.op, s.args) for i, s in enumerate(steps)]


# --- results ------------------------------------------------------------------------------


def _save(text: str, trace_dir: str | Path | None, stem: str) -> str:
    digest = hashlib.sha256(text.encode()).hexdigest()[:6]
    directory = Path(trace_dir) if trace_dir is not None else Path(tempfile.mkdtemp(prefix="kvspec-traces-"))
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{stem}-{digest}.trace.jsonl"
    path.write_text(text, encoding="utf-8")
    return str(path)


def _failure_of(trace: Trace, fd: dict[str, Any], path: str, impl: str | None, is_shrunk: bool) -> Failure:
    story = render_story(trace, path, impl)
    if not is_shrunk:
        story += "\n(not shrunk: the process died or hung, and no shorter trace reproduced it in time)"
    return Failure(
        kind=str(fd["kind"]),
        step_index=int(fd["step"]),
        op=str(fd["op"]),
        message=str(fd["message"]),
        invariant=fd.get("invariant"),
        trace_path=path,
        num_steps=len(trace.steps),
        story=story,
        is_shrunk=is_shrunk,
    )


def _reachable(
    branches: Sequence[str], coverage: Mapping[str, int], not_exercised: Iterable[str], absent_ops: Iterable[str]
) -> tuple[str, ...]:
    """The expected branches this adapter can reach: all, less what its declarations rule out (or reached anyway)."""
    # An error no mistake made against this adapter could raise is not a branch it should reach.
    skipped_ops = {m.split(": ", 1)[0] for m in not_exercised}
    # Nor is any branch of an optional operation the adapter does not have.
    absent = set(absent_ops)
    return tuple(
        b
        for b in branches
        if coverage.get(b)
        or not (
            (b.split(": ", 1)[0] in skipped_ops and b.split(": ", 1)[-1] in _ERROR_TYPES)
            or b.split(": ", 1)[0] in absent
        )
    )


def _result(
    raw: dict[str, Any] | _Death,
    *,
    factory: Factory,
    level: str,
    enable_caching: bool,
    profile: str,
    impl: str | None,
    trace_dir: str | Path | None,
    step_timeout_s: float | None,
    seed: int,
    started: float,
    minimize_s: float,
    device: str | None = None,
) -> CheckResult:
    branches = expected_branches(level, enable_caching, profile)

    def make(verdict: str, failure: Failure | None, message: str, data: dict[str, Any]) -> CheckResult:
        coverage = {b: 0 for b in branches}
        coverage.update(data.get("coverage", {}))
        not_exercised = tuple(data.get("not_exercised", ()))
        expected = _reachable(branches, coverage, not_exercised, data.get("absent_ops", ()))
        return CheckResult(
            verdict=verdict,
            level=level,
            enable_caching=enable_caching,
            profile=profile,
            examples_run=int(data.get("examples", 0)),
            steps_run=int(data.get("steps", 0)),
            seconds=float(data.get("seconds", time.monotonic() - started)),
            failure=failure,
            coverage=coverage,
            impl=impl or "",
            states_reached=int(data.get("states", 0)),
            invariants_checked=int(data.get("invariants_checked", 0)),
            branches=expected,
            message=message,
            seed=seed,
            not_exercised=not_exercised,
            device=device,
            extra_rounds=int(data.get("extra_rounds", 0)),
        )

    trace: Trace | None = None
    fd: dict[str, Any] = {}
    if isinstance(raw, _Death):
        verdict = "hung" if raw.hung else "crashed"
        rebuilt = _trace_from_death(raw, impl, step_timeout_s)
        if rebuilt is None:
            return make(verdict, None, "the process died before its first step was written", {})
        trace, fd = rebuilt
        data: dict[str, Any] = {"seconds": time.monotonic() - started}
    else:
        verdict, data = str(raw["verdict"]), raw
        if raw.get("failure") is not None and raw.get("trace"):
            trace, fd = parse_trace(raw["trace"].splitlines()), raw["failure"]
    is_shrunk = True
    # Hypothesis shrinks what raises; a death or a hang it never saw (or must not
    # retry at a full time limit per attempt) is cut down here by replaying.
    if trace is not None and verdict in ("crashed", "hung") and (isinstance(raw, _Death) or verdict == "hung"):
        trace, fd, is_shrunk = _shrink_by_replay(trace, fd, factory, verdict, impl, step_timeout_s, minimize_s)
        data = {**data, "seconds": time.monotonic() - started}
    failure = None
    if trace is not None:
        stem = f"{verdict}-{level}" if verdict in ("crashed", "hung") else f"failure-{level}"
        path = _save(dumps_trace(trace), trace_dir, stem)
        failure = _failure_of(trace, fd, path, impl, is_shrunk)
    result = make(verdict, failure, str(data.get("message", "")), data)
    if isinstance(raw, dict) and raw.get("deepest"):
        result.deepest_trace_path = _save(
            raw["deepest"], trace_dir, f"deepest-{level}-caching-{'on' if enable_caching else 'off'}"
        )
    return result


def _shrink_by_replay(
    trace: Trace,
    fd: dict[str, Any],
    factory: Factory,
    verdict: str,
    impl: str | None,
    step_timeout_s: float | None,
    budget_s: float,
) -> tuple[Trace, dict[str, Any], bool]:
    """The shortest trace that still crashes or hangs the same way, replayed for its outcomes.

    Returns the trace, its failure, and whether the search finished within the budget.
    """
    if budget_s <= 0:
        return trace, fd, len(trace.steps) <= 1
    shorter, finished = _minimize(trace, factory, verdict, step_timeout_s, budget_s)
    if len(shorter.steps) == len(trace.steps):
        return trace, fd, finished
    again = _run(lambda f, hb: _replay_work(shorter, factory, impl, step_timeout_s, f, hb), step_timeout_s, True)
    if isinstance(again, _Death):
        rebuilt = _trace_from_death(again, impl, step_timeout_s)
        if rebuilt is not None:
            return rebuilt[0], rebuilt[1], finished
    elif again.get("verdict") == verdict and again.get("failure") and again.get("trace"):
        return parse_trace(again["trace"].splitlines()), again["failure"], finished
    return trace, fd, False  # the shorter trace did not fail again: keep the one that did


def run_check(
    factory: Factory | str,
    *,
    level: str = "pool",
    enable_caching: bool = True,
    profile: str = "vllm-v1",
    max_examples: int = 200,
    seed: int = 0,
    time_budget_s: float | None = None,
    step_timeout_s: float | None = 10.0,
    trace_dir: str | Path | None = None,
    impl: str | None = None,
    steps_per_example: int = 50,
    keep_deepest: bool = False,
    isolate: bool = True,
    database: Any = None,
    minimize_s: float = 30.0,
    device: str | None = None,
    shrink: bool = True,
    cover_rounds: int = 0,
) -> CheckResult:
    """Check one implementation at one level against the spec.

    Args:
        factory: builds an adapter from an `AdapterConfig`; or a name for `load_factory`.
        level: "pool" (BlockPool) or "manager" (KVCacheManager).
        enable_caching: prefix caching on or off.
        profile: the ordering profile the implementation claims (spec.ordering.PROFILES).
        max_examples: Hypothesis examples (each up to `steps_per_example` rules).
        seed: the random seed; the same seed gives the same campaign in the same program. Hypothesis
            also mixes constants from the loaded first-party modules into its draws, so a program
            that has imported other modules of its own (a test suite) may draw a different campaign.
        time_budget_s: stop starting new examples after this long (a failure is still shrunk).
        step_timeout_s: the most one implementation call may take; None: no limit.
        trace_dir: where failure traces go (default: a new temporary directory).
        impl: the implementation's name, for reports and trace headers.
        steps_per_example: Hypothesis's stateful_step_count.
        keep_deepest: also save the example that reached the most events (it replays to conforms).
        isolate: run in a child process (crash- and hang-proof); False runs in this process.
        database: a Hypothesis example database (e.g. a shared directory for long campaigns).
        minimize_s: time allowed for cutting down a trace that a dead or hung process left.
        device: `AdapterConfig.device` for every adapter built ("cpu", "cuda:0"; None: the adapter picks).
            The device is first used inside the campaign's child process.
        shrink: shrink a failure found by Hypothesis (False: report the first failing example as found).
        cover_rounds: while an expected branch is unreached after `max_examples`, up to this many
            more rounds of `max_examples` each, on the next seeds (within the time budget).

    Returns:
        The verdict, what ran and was reached, and the failure with its saved trace and story.
    """
    started = time.monotonic()

    def could_not_run(message: str) -> CheckResult:
        return _could_not_run(message, impl, level=level, enable_caching=enable_caching, profile=profile, seed=seed)

    if isinstance(factory, str):
        impl = impl or factory
        try:
            factory = load_factory(factory)
        except FactoryError as e:
            return could_not_run(str(e))
    if level not in ("pool", "manager"):
        return could_not_run(f"level must be 'pool' or 'manager'; got level={level!r}")
    if profile not in PROFILES:
        return could_not_run(f"unknown profile={profile!r}; known profiles: {', '.join(sorted(PROFILES))}")
    if isinstance(max_examples, bool) or not isinstance(max_examples, int) or max_examples < 1:
        return could_not_run(f"max_examples must be a positive integer; got max_examples={max_examples!r}")
    if isinstance(cover_rounds, bool) or not isinstance(cover_rounds, int) or cover_rounds < 0:
        return could_not_run(f"cover_rounds must be a non-negative integer; got cover_rounds={cover_rounds!r}")
    chosen: Factory = factory

    def work(stream_fd: int | None, heartbeat: Any) -> dict[str, Any]:
        return _campaign(
            chosen,
            level=level,
            enable_caching=enable_caching,
            profile=profile,
            max_examples=max_examples,
            seed=seed,
            time_budget_s=time_budget_s,
            step_timeout_s=step_timeout_s,
            steps_per_example=steps_per_example,
            keep_deepest=keep_deepest,
            impl=impl,
            database=database,
            stream_fd=stream_fd,
            heartbeat=heartbeat,
            device=device,
            shrink=shrink,
            cover_rounds=cover_rounds,
        )

    raw = _run(work, step_timeout_s, isolate)
    return _result(
        raw,
        factory=chosen,
        level=level,
        enable_caching=enable_caching,
        profile=profile,
        impl=impl,
        trace_dir=trace_dir,
        step_timeout_s=step_timeout_s,
        seed=seed,
        started=started,
        minimize_s=minimize_s if shrink else 0.0,
        device=device,
    )


def _could_not_run(
    message: str, impl: str | None, *, level: str, enable_caching: bool, profile: str, seed: int = 0
) -> CheckResult:
    branches = expected_branches(level, enable_caching, profile) if level in ("pool", "manager") else ()
    return CheckResult(
        verdict="could-not-run",
        level=level,
        enable_caching=enable_caching,
        profile=profile,
        examples_run=0,
        steps_run=0,
        seconds=0.0,
        failure=None,
        coverage={b: 0 for b in branches},
        impl=impl or "",
        branches=branches,
        message=message,
        seed=seed,
    )


def replay(
    trace: Trace | str | Path,
    factory: Factory | str,
    *,
    impl: str | None = None,
    step_timeout_s: float | None = 10.0,
    trace_dir: str | Path | None = None,
    isolate: bool = True,
    device: str | None = None,
) -> CheckResult:
    """Re-run a recorded trace on an implementation, checking every step as the machine does.

    `device`, when given, replaces the device the trace was recorded on.

    Raises:
        MalformedTrace: the trace file cannot be read.
    """
    started = time.monotonic()
    t = trace if isinstance(trace, Trace) else read_trace(trace)
    if device is not None:
        t = dataclasses.replace(t, config=dataclasses.replace(t.config, device=device))
    if isinstance(factory, str):
        impl = impl or factory
        try:
            factory = load_factory(factory)
        except FactoryError as e:
            c = t.config
            return _could_not_run(str(e), impl, level=c.level, enable_caching=c.enable_caching, profile=c.profile)
    chosen: Factory = factory
    raw = _run(lambda fd, hb: _replay_work(t, chosen, impl, step_timeout_s, fd, hb), step_timeout_s, isolate)
    return _result(
        raw,
        factory=chosen,
        level=t.config.level,
        enable_caching=t.config.enable_caching,
        profile=t.config.profile,
        impl=impl,
        trace_dir=trace_dir,
        step_timeout_s=step_timeout_s,
        seed=0,
        started=started,
        minimize_s=0.0,
        device=t.config.device,
    )


def make_conformance_test(
    factory: Factory,
    level: str = "both",
    enable_caching: bool | None = None,
    profile: str = "vllm-v1",
    max_examples: int | None = None,
    seed: int = 0,
    step_timeout_s: float | None = 10.0,
    trace_dir: str | Path | None = None,
) -> type[unittest.TestCase]:
    """A `unittest.TestCase` class that checks `factory`'s adapters against the spec.

    One test per level and caching mode (`test_pool_caching_on`, ...). Each runs
    `run_check` in a child process; a failure fails the test with the short
    story, and the trace is saved (in `trace_dir`, or a temporary directory).

    Args:
        factory: builds an adapter from an `AdapterConfig`.
        level: "pool", "manager" or "both".
        enable_caching: True or False for one mode; None for both.
        profile: the ordering profile the implementation claims.
        max_examples: per test; None takes the active Hypothesis profile's.
        seed: the campaign's seed.
        step_timeout_s: the most one implementation call may take.
        trace_dir: where failure traces are saved.

    Raises:
        ValueError: level is not "pool", "manager" or "both".
    """
    if level not in ("pool", "manager", "both"):
        raise ValueError(f"level must be 'pool', 'manager' or 'both'; got level={level!r}")
    levels = ("pool", "manager") if level == "both" else (level,)
    modes = (True, False) if enable_caching is None else (enable_caching,)

    def make_test(lv: str, caching: bool) -> Callable[[unittest.TestCase], None]:
        def test(self: unittest.TestCase) -> None:
            n = max_examples if max_examples is not None else settings().max_examples
            result = run_check(
                factory,
                level=lv,
                enable_caching=caching,
                profile=profile,
                max_examples=n,
                seed=seed,
                step_timeout_s=step_timeout_s,
                trace_dir=trace_dir,
            )
            if result.verdict != "conforms":
                self.fail(result.failure.story if result.failure is not None else f"{result.verdict}: {result.message}")

        test.__name__ = f"test_{lv}_caching_{'on' if caching else 'off'}"
        test.__doc__ = f"The {lv} level conforms to the spec (profile {profile}, caching {'on' if caching else 'off'})."
        return test

    attrs: dict[str, Any] = {make_test(lv, c).__name__: make_test(lv, c) for lv in levels for c in modes}
    name = getattr(factory, "__name__", type(factory).__name__)
    return type(f"Conformance_{name}", (unittest.TestCase,), attrs)
