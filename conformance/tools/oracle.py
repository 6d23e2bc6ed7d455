"""The regression oracle: the harness against vLLM releases, one isolated process each, as one matrix.

For each release, and for each level (pool, request) and caching setting
(on, off), the harness runs against every vLLM profile; a release conforms to
the profiles whose checks pass, and for each profile it breaks there is the
shortest trace that shows it. Directed probes then replay the caller mistakes
and historical bugs of vLLM's block manager on the release (a double free, the
null block freed or touched, a block registered twice, usage counting the null
block, a hash left behind by eviction, reset while blocks are held; at the
request level a request freed twice, and a block filled in decode right after
an image) and record what the release does; ``kvspec hashes`` adds hash
compatibility, and whether two engine processes started alike compute the
same chain (fleet-consistent hashes: measured in fresh processes, one
answer per release in the matrix's ``fleet`` column and its notes). What a
release lacks and the adapter declares not applicable (``cache_salt`` before
0.9.0, pre-allocation driven off in 0.8.0 to 0.8.4) is listed in the notes,
not reported as a divergence. With ``--events`` each release also runs, per
level, one campaign with its KV cache events checked (the router's mirror
rules, then the spec's events; at the request level the hit statistics
too), under the profile its state conforms to: the events column says
``ok``, ``no events`` (before 0.9.0), ``breaks <rule>`` with a trace, or the
campaign's verdict with a trace.
The rows and the printed matrix are kvspec.conformance.tools.oracle_matrix's.

Design choice: every release runs in its own worker process under a time
budget (kvspec.conformance.runner.workers). The pool level runs in this
environment in light mode (the release's real ``block_pool.py`` from its
wheel); the request level needs vLLM installed, so it runs in a virtual
environment per release, created on demand under the cache folder with the
lean recipe (kvspec.conformance.targets.vllm.venvs). The rejected
alternative, one process for all releases, would let one release's import
side effects (NONE_HASH, loggers, a hang) spill into the next one's verdict.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvspec.conformance.core.adapter import AdapterConfig
from kvspec.conformance.core.results import CheckResult, Verdict
from kvspec.conformance.core.run_config import RunConfig
from kvspec.conformance.runner.profiles import PROFILES, check_each_profile
from kvspec.conformance.runner.run import run_check
from kvspec.conformance.runner.workers import WorkerError, run_worker, serve_worker
from kvspec.conformance.targets.vllm.events import FIRST_RELEASE_WITH_EVENTS, event_facts
from kvspec.conformance.targets.vllm.factories import make_installed_adapter, make_light_adapter
from kvspec.conformance.targets.vllm.hashes import compare_release, measure_release
from kvspec.conformance.targets.vllm.lightmode import LightModeError
from kvspec.conformance.targets.vllm.probes import V0_PROBES, ProbeResult, run_probes
from kvspec.conformance.targets.vllm.releases import RELEASES
from kvspec.conformance.targets.vllm.v0 import V0_PROFILES, V0_RELEASES, make_v0_light_adapter
from kvspec.conformance.targets.vllm.venvs import WORKER_ENV, ensure_venv
from kvspec.conformance.tools.oracle_matrix import HYBRID_GROUPS, Cell, ReleaseRow

__all__ = ["all_releases", "is_v0_only", "run_oracle"]

# ---------------------------------------------------------------------------
# one release, in its own process


def _result_json(result: Any) -> dict[str, Any]:
    failure = getattr(result, "failure", None)
    out: dict[str, Any] = {"verdict": str(result.verdict), "steps_run": getattr(result, "steps_run", None)}
    if getattr(result, "message", ""):
        out["message"] = result.message  # why it could not run, or a note; a failure's own message replaces it
    if failure is not None:
        out.update(
            step=failure.step,
            op=failure.op,
            message=failure.message,
            trace=failure.trace_path,
            num_steps=failure.num_steps,
        )
    return out


def _each_profile(
    impl_name: str,
    level: str,
    caching: bool,
    args: argparse.Namespace,
    time_budget_s: float | None,
    trace_dir: str,
    profiles: Sequence[str] = PROFILES,
) -> dict[str, CheckResult]:
    """One cell: the release at one level and caching setting, once per profile, under the oracle's record
    (the one `run_oracle_cmd` refused up front, with this cell's share of the time budget)."""
    run = RunConfig(impls=(impl_name,), levels=(level,), caching=(caching,), profile=profiles[0],  # type: ignore[arg-type]
                    max_examples=args.max_examples, time_budget_s=time_budget_s, trace_dir=Path(trace_dir))  # fmt: skip
    (configuration,) = run.configurations()
    return check_each_profile(impl_name, configuration, profiles=profiles)


def _worker(args: argparse.Namespace) -> dict[str, Any]:
    """Run one release at one level, in this process; returns the row's part as JSON."""
    version: str = args.worker
    if is_v0_only(version):
        v0_row = _v0_worker(args)
        if getattr(args, "events", False):
            v0_row["events"] = {args.level: asdict(Cell("n/a", "no events: vLLM v0's allocator publishes none"))}
        return v0_row
    light = args.level == "pool"
    factory = make_light_adapter(version) if light else make_installed_adapter
    impl_name = f"vllm@{version}" if light else "vllm"
    # A request-level trace names its implementation "vllm" (the installed one): its folder names the
    # release, whose environment replays it (`<venv_root()>/<version>/bin/kvspec replay TRACE`).
    trace_dir = args.trace_dir if light else str(Path(args.trace_dir) / f"vllm-{version}")
    row: dict[str, Any] = {"version": version, "cells": {}, "probes": [], "hashes": ""}
    cachings = [True, False] if args.caching == "both" else [args.caching == "on"]
    budget = None if args.time_budget is None else args.time_budget / (len(cachings) + 1)
    for caching in cachings:
        key = f"{args.level}/{'on' if caching else 'off'}"
        start = time.monotonic()
        results = _each_profile(impl_name, args.level, caching, args, budget, trace_dir)
        elapsed = time.monotonic() - start
        steps = sum(getattr(r, "steps_run", 0) or 0 for r in results.values())
        # Declared absences (adapter.py's not_applicable), as the summary lists them.
        absent = sorted({m for r in results.values() for m in r.not_exercised if ": not applicable, " in m})
        row["cells"][key] = asdict(Cell("ran", "", {p: _result_json(r) for p, r in results.items()},
                                        steps / elapsed if elapsed > 0 else None, absent))  # fmt: skip
    if light:
        cell = row["cells"].get("pool/on")
        conforming = [p for p, r in (cell["profiles"] if cell else {}).items() if r["verdict"] == Verdict.CONFORMS]
        probe_profile = conforming[0] if conforming else PROFILES[0]
        row["probes"] = [asdict(r) for r in run_probes(factory, probe_profile, args.trace_dir, impl_name)]

        row["hashes"] = compare_release(version, seeds=(None, "0"), builtin_in_subprocess=True).summary()
        row.update(_fleet(version))
    else:
        cell = row["cells"].get("manager/on")
        conforming = [p for p, r in (cell["profiles"] if cell else {}).items() if r["verdict"] == Verdict.CONFORMS]
        # The probes free only hashed blocks, where both profiles agree; prefer a conforming one.
        probe_profile = conforming[0] if conforming else PROFILES[0]
        probes = run_probes(factory, probe_profile, trace_dir, impl_name, num_gpu_blocks=8, level="manager")
        row["probes"] = [{**asdict(r), "name": f"request level: {r.name}"} for r in probes]
        if args.caching != "off":
            row["hybrid"] = asdict(_hybrid_cell(impl_name, probe_profile, args.max_examples, budget, trace_dir))
    if getattr(args, "events", False):
        events = _events_cell(version, impl_name, args.level, row["cells"], args.max_examples, budget, trace_dir)
        row["events"] = {args.level: asdict(events)}
    return row


def _fleet(version: str) -> dict[str, str]:
    """The release's fleet answer, measured in fresh processes (kvspec.conformance.targets.vllm.hashes), for the row."""

    try:
        measured = measure_release(version)
    except RuntimeError as e:
        return {"fleet": "not measured", "fleet_detail": str(e)[:300]}
    except KeyError:  # a release the table does not declare: its default hash function is a declared fact
        return {
            "fleet": "not measured",
            "fleet_detail": f"vllm=={version} is not in kvspec's release table "
            "(its default hash function is not known)",
        }
    return {"fleet": measured.fleet, "fleet_detail": f"{measured.fleet_line()}; {measured.chain_line()}"}


# ---------------------------------------------------------------------------
# what the pool tells the world: the KV cache events column (--events)

# The event rules a router's mirror depends on (spec.invariants.EVENT_RULES): a campaign that breaks one
# is reported by the rule's name; any other failure of an events campaign by its verdict.
_EVENT_RULE_NAMES = ("event_mirror_exact", "event_parent_known")


def _events_cell(
    version: str, impl_name: str, level: str, cells: dict[str, Any], max_examples: int,
    time_budget_s: float | None, trace_dir: str,
) -> Cell:  # fmt: skip
    """One campaign with ``config.events`` (caching on) under the profile the release's state conforms to.

    It checks the release's stream against the router's mirror rules
    (``event_mirror_exact``, ``event_parent_known``) and against the spec's
    events, and at the request level the hit statistics too. A release
    without events (before 0.9.0) is "n/a": no events.
    """

    if not event_facts(version).has_events:
        why = f"no events: its BlockPool takes no enable_kv_cache_events (from {FIRST_RELEASE_WITH_EVENTS})"
        return Cell("n/a", why)
    on = cells.get(f"{level}/on", {})
    conforming = [p for p, r in on.get("profiles", {}).items() if r["verdict"] == Verdict.CONFORMS]
    profile = conforming[0] if conforming else PROFILES[0]
    start = time.monotonic()
    result = run_check(impl_name, level=level, enable_caching=True, profile=profile, events=True,
                       max_examples=max_examples, time_budget_s=time_budget_s, trace_dir=trace_dir)  # fmt: skip
    if result.verdict is Verdict.NOT_APPLICABLE:
        return Cell("n/a", getattr(result, "message", "") or "the adapter does not provide this level")
    elapsed = time.monotonic() - start
    steps = getattr(result, "steps_run", 0) or 0
    absent = sorted(m for m in result.not_exercised if ": not applicable, " in m)
    out = _result_json(result)
    failure = getattr(result, "failure", None)
    rule = getattr(failure, "invariant", None) if failure is not None else None
    if rule in _EVENT_RULE_NAMES:
        out["rule"] = rule
    return Cell("ran", "", {profile: out}, steps / elapsed if elapsed > 0 else None, absent)


def _hybrid_cell(impl_name: str, profile: str, max_examples: int, time_budget_s: float | None, trace_dir: str) -> Cell:
    """The request level with KV cache groups ``HYBRID_GROUPS`` (caching on) under one profile.

    A release whose adapter declares the groups not provided (no
    ``SlidingWindowSpec``, no hybrid coordinator, KVCacheBlocks of one group
    only) is "n/a" with the adapter's reason, never a divergence.
    """

    start = time.monotonic()
    result = run_check(impl_name, level="manager", enable_caching=True, profile=profile, groups=HYBRID_GROUPS,
                       max_examples=max_examples, time_budget_s=time_budget_s, trace_dir=trace_dir)  # fmt: skip
    if result.verdict is Verdict.NOT_APPLICABLE:
        return Cell("n/a", getattr(result, "message", "") or "the adapter does not provide these groups")
    elapsed = time.monotonic() - start
    steps = getattr(result, "steps_run", 0) or 0
    absent = sorted(m for m in result.not_exercised if ": not applicable, " in m)
    return Cell("ran", "", {profile: _result_json(result)}, steps / elapsed if elapsed > 0 else None, absent)


def is_v0_only(version: str) -> bool:
    """Whether the oracle drives ``version`` through v0's allocator: it ships one and no v1 BlockPool.

    Releases 0.8.0 to 0.10.2 ship both; the oracle drives their v1 pool (their v0
    allocator is ``kvspec check --impl vllm-v0@X``).
    """

    return version in V0_RELEASES and version not in RELEASES


def _v0_worker(args: argparse.Namespace) -> dict[str, Any]:
    """One v0 release at the pool level with caching on: v0's prefix-caching allocator under each v0 and v1 profile."""

    version: str = args.worker
    row: dict[str, Any] = {"version": version, "cells": {}, "probes": [], "hashes": ""}
    cachings = [True, False] if args.caching == "both" else [args.caching == "on"]
    for caching in cachings:
        key = f"{args.level}/{'on' if caching else 'off'}"
        if args.level != "pool":
            row["cells"][key] = asdict(Cell("n/a", "vLLM v0 is driven at the pool level only"))
            continue
        if not caching:
            why = "the v0 adapter drives the prefix-caching allocator; v0's NaiveBlockAllocator is not driven"
            row["cells"][key] = asdict(Cell("not run", why))
            continue
        try:  # a release whose allocator API the adapter does not speak: one line, not three failed campaigns
            make_v0_light_adapter(version)(AdapterConfig(level="pool", num_gpu_blocks=4))
        except (ValueError, LightModeError) as e:
            row["cells"][key] = asdict(Cell("could not run", str(e)))
            continue
        start = time.monotonic()
        results = _each_profile(f"vllm-v0@{version}", "pool", True, args, args.time_budget, args.trace_dir,
                                V0_PROFILES)  # fmt: skip
        elapsed = time.monotonic() - start
        steps = sum(getattr(r, "steps_run", 0) or 0 for r in results.values())
        row["cells"][key] = asdict(Cell("ran", "", {p: _result_json(r) for p, r in results.items()},
                                        steps / elapsed if elapsed > 0 else None))  # fmt: skip
        impl_name = f"vllm-v0@{version}"
        factory = make_v0_light_adapter(version)
        found = run_probes(factory, "lru-timestamp", args.trace_dir, impl_name, num_gpu_blocks=4, probes=V0_PROBES)
        row["probes"] = [asdict(r) for r in found]
    return row


# ---------------------------------------------------------------------------
# the matrix


def _notes(row: ReleaseRow) -> list[str]:
    """Findings in words, from the cells and probes."""
    notes: list[str] = []
    on, off = row.cells.get("pool/on"), row.cells.get("pool/off")
    if on and on.status == "ran":
        got = on.conforms_to()
        if got == ["vllm-v1-tail"]:
            notes.append("free order: every freed block to the right end (vllm-v1-tail)")
        if on and off and off.status == "ran" and got and off.conforms_to() and set(got) != set(off.conforms_to()):
            notes.append(f"free order flips when caching is off: on conforms to {', '.join(got)}, "
                         f"off to {', '.join(off.conforms_to())}")  # fmt: skip
    for key in ("manager/on", "manager/off", "hybrid"):
        cell = row.hybrid if key == "hybrid" else row.cells.get(key)
        for entry in cell.not_applicable if cell is not None and cell.status == "ran" else ():
            note = f"request level{f' with groups {HYBRID_GROUPS}' if key == 'hybrid' else ''}: {entry}"
            if note not in notes:
                notes.append(note)
    if is_v0_only(row.version):
        notes.append("v0's prefix-caching allocator (vllm/core/block); v1's probes and hash vectors not run on it")
        held = [p.name for p in row.probes if p.verdict == Verdict.CONFORMS]
        if held:
            notes.append(f"probes that found nothing (v0 as the spec under lru-timestamp): {'; '.join(held)}")
    hybrid = row.hybrid
    if hybrid is not None and hybrid.status != "ran":
        notes.append(f"request level with groups {HYBRID_GROUPS}: {hybrid.status}: {hybrid.why}")
    elif hybrid is not None:
        for profile, r in hybrid.profiles.items():
            if r["verdict"] != Verdict.CONFORMS:
                notes.append(f"request level with groups {HYBRID_GROUPS} under {profile}: {r['verdict']} at step "
                             f"{r.get('step')} ({r.get('op')}): {str(r.get('message', ''))[:160]}; "
                             f"trace {r.get('trace')}")  # fmt: skip
    for p in row.probes:
        if p.verdict != Verdict.CONFORMS:
            notes.append(f"{p.name} (step {p.step} {p.op}: {p.message[:120]}; trace {p.trace_path})")
    return notes


def run_oracle(
    versions: Sequence[str],
    *,
    levels: Sequence[str] = ("pool",),
    caching: str = "both",
    max_examples: int = 100,
    time_budget: float | None = 120.0,
    trace_dir: str = "kvspec-oracle-traces",
    log: Callable[[str], None] = lambda _: None,
    events: bool = False,
) -> list[ReleaseRow]:
    """Run the oracle over releases: one subprocess per (release, level).

    Args:
        versions: Releases, e.g. ``["0.10.2", "0.33.0"]``.
        levels: ``"pool"`` (light mode) and/or ``"manager"`` (an environment per release).
        caching: ``"on"``, ``"off"`` or ``"both"``.
        max_examples: Harness examples per (profile, caching).
        time_budget: Seconds of harness time per (release, level).
        trace_dir: Where traces go.
        log: Progress messages.
        events: Also run, per level, a campaign with the KV cache events checked (the events column).

    Returns:
        One row per release, in the order given.
    """
    Path(trace_dir).mkdir(parents=True, exist_ok=True)
    cachings = ["on", "off"] if caching == "both" else [caching]
    worker_args = ["--caching", caching, "--max-examples", str(max_examples), "--trace-dir", trace_dir,
                   *(["--time-budget", str(time_budget)] if time_budget is not None else []),
                   *(["--events"] if events else [])]  # fmt: skip
    rows: list[ReleaseRow] = []
    for version in versions:
        row = ReleaseRow(version)
        for level in levels:
            _run_level(row, level, cachings, worker_args, time_budget, log)
        row.notes = _notes(row)
        rows.append(row)
    return rows


def _run_level(
    row: ReleaseRow, level: str, cachings: Sequence[str], worker_args: Sequence[str], time_budget: float | None,
    log: Callable[[str], None],
) -> None:  # fmt: skip
    """One release at one level, in its worker (the request level in the release's environment), into its row."""
    version = row.version
    env = {**os.environ, **WORKER_ENV}
    env.pop("KVSPEC_VLLM_VERSION", None)
    python: Path | str = sys.executable
    if level == "manager" and not is_v0_only(version):
        try:
            python = ensure_venv(version, log)
        except RuntimeError as e:
            for c in cachings:
                row.cells[f"{level}/{c}"] = Cell("could not install", str(e)[:300])
            return
    log(f"vllm=={version}: {level} level")
    try:
        data = run_worker("kvspec.conformance.tools.oracle", ["--worker", version, "--level", level, *worker_args],
                          python=python, env=env, time_budget_s=time_budget)  # fmt: skip
    except WorkerError as e:
        for c in cachings:
            row.cells[f"{level}/{c}"] = Cell("could not run", str(e))
        return
    for key, cell in data["cells"].items():
        row.cells[key] = Cell(**cell)
    row.probes += [ProbeResult(**p) for p in data["probes"]]
    if data.get("hybrid"):
        row.hybrid = Cell(**data["hybrid"])
    row.events.update({lv: Cell(**cell) for lv, cell in data.get("events", {}).items()})
    if level == "pool":
        row.hashes = data["hashes"]
        row.fleet, row.fleet_detail = data.get("fleet", ""), data.get("fleet_detail", "")


def all_releases() -> tuple[str, ...]:
    """Every release the oracle knows, oldest first."""
    return RELEASES


def _main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvspec.conformance.tools.oracle")
    parser.add_argument("--worker", required=True, help="the release to check in this process")
    parser.add_argument("--level", choices=("pool", "manager"), default="pool")
    parser.add_argument("--caching", choices=("on", "off", "both"), default="both")
    parser.add_argument("--max-examples", type=int, default=100)
    parser.add_argument("--time-budget", type=float, default=None)
    parser.add_argument("--trace-dir", default="kvspec-oracle-traces")
    parser.add_argument("--events", action="store_true", help="also run the events campaign (the events column)")
    return serve_worker(parser, _worker, argv)


if __name__ == "__main__":
    sys.exit(_main())
