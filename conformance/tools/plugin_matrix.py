"""`kvspec oracle --plugins`: every plugin target checked, one matrix, each divergence with its trace and its meaning.

For each target (kvspec.conformance.targets.plugins.targets), in its own process:
the harness's campaigns at each level it provides, prefix caching on and
off, under the profile it claims; then its directed probes. Every failure
is matched against the target's known divergences (`Finding`): the matrix
prints the finding's sentence (what the plugin does, what vLLM and the spec
do instead) and what it can affect, or says that a divergence is new.
A campaign's trace is shrunk; a probe's is written short; both replay with
``kvspec replay TRACE`` to the same verdict.

Design choice: one subprocess per target, as the vLLM oracle runs one per
release: a plugin's patches, threads (kvcached starts one per pool) and
loggers stay in its own process, and a plugin that hangs costs only its row.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvspec.conformance.core.adapter import AdapterConfig
from kvspec.conformance.core.results import Verdict
from kvspec.conformance.runner.registry import load_factory
from kvspec.conformance.runner.run import run_check
from kvspec.conformance.runner.workers import WorkerError, run_worker, serve_worker
from kvspec.conformance.targets.plugins.findings import EFFECTS, match_finding, run_probe
from kvspec.conformance.targets.plugins.targets import TARGETS, PluginTarget

__all__ = ["PluginRow", "default_rows", "format_plugin_matrix", "run_plugin_matrix", "rows_to_json"]

# The rows `kvspec oracle --plugins` prints: each target on the release it claims, and kvcached on the newest.
DEFAULT_ROWS: tuple[tuple[str, str | None], ...] = (
    ("vllm-mlx", None),
    ("kvcached", None),
    ("kvcached", "0.33.0"),
    ("tpu-inference", None),
    ("vllm-ascend", None),
)
_KEYS = ("pool/on", "pool/off", "manager/on", "manager/off")


@dataclass(slots=True)
class PluginRow:
    """What the matrix found on one target."""

    target: str  # the target's name
    impl: str  # the name traces carry, e.g. "kvcached@0.30.0"
    plugin: str  # e.g. "kvcached==0.1.6"
    base: str  # "vllm 0.30.0", or "own pool"
    profile: str  # the profile it claims
    cells: dict[str, dict[str, Any]] = field(default_factory=dict)  # "pool/on" -> verdict, finding, trace, ...
    probes: list[dict[str, Any]] = field(default_factory=list)  # each probe's result and finding
    not_compared: list[str] = field(default_factory=list)  # what the campaigns leave out, declared
    error: str = ""  # why the row could not run


def default_rows() -> list[tuple[str, str | None]]:
    """(target, vLLM release or None for its default) for every row of the default matrix."""
    return list(DEFAULT_ROWS)


def _finding_json(target: PluginTarget, failure: Any, caching: bool) -> dict[str, Any]:
    found = match_finding(target.findings, failure, caching)
    if found is None:
        return {"finding": None}
    return {"finding": found.key, "does": found.plugin_does, "effect": found.effect, "is_bug": found.is_bug}


def _cell(target: PluginTarget, impl: str, level: str, caching: bool, args: argparse.Namespace) -> dict[str, Any]:
    """One campaign under the claimed profile, as JSON."""

    if level not in target.levels:
        return {"verdict": Verdict.NOT_APPLICABLE.value}
    r = run_check(impl, level=level, enable_caching=caching, profile=target.profile, max_examples=args.max_examples,
                  time_budget_s=args.time_budget, trace_dir=args.trace_dir, impl=impl)  # fmt: skip
    out: dict[str, Any] = {"verdict": r.verdict.value, "examples": r.examples_run, "steps": r.steps_run}
    if r.message:
        out["message"] = r.message
    f = r.failure
    if f is not None:
        out.update(step=f.step, op=f.op, kind=f.kind.value, message=f.message, trace=f.trace_path,
                   num_steps=f.num_steps, **_finding_json(target, f, caching))  # fmt: skip
    return out


def _worker(args: argparse.Namespace) -> dict[str, Any]:
    """One target's row, in this process."""
    target = TARGETS[args.worker]
    base = args.base or None
    impl = target.impl_name(base)
    row = PluginRow(target.name, impl, target.dist.label, f"vllm {base or target.base}" if target.base else "own pool",
                    target.profile)  # fmt: skip

    factory = load_factory(impl)
    levels = [lv for lv in ("pool", "manager") if lv in args.levels.split(",")]
    for level in levels:
        for caching in [c == "on" for c in args.caching.split(",")]:
            row.cells[f"{level}/{'on' if caching else 'off'}"] = _cell(target, impl, level, caching, args)
    for probe in target.probes:
        if probe.level not in levels:
            continue
        result = run_probe(factory, probe, target.profile, args.trace_dir, impl)
        if result is not None:
            row.probes.append({**asdict(result), "level": probe.level, "caching": probe.caching,
                               **_finding_json(target, None if result.verdict == Verdict.CONFORMS.value else result,
                                               probe.caching)})  # fmt: skip
    row.not_compared = sorted(_declared_absences(factory))
    return asdict(row)


def _declared_absences(factory: Callable[[Any], object]) -> set[str]:
    """What the target's pool adapter declares the campaigns leave out (known deviations)."""

    adapter = factory(AdapterConfig(level="pool", num_gpu_blocks=4))
    found = {f"{op}: {why}" for op, why in (getattr(adapter, "known_deviations", None) or {}).items()}
    return found


def _worker_args(name: str, base: str | None, args: argparse.Namespace) -> list[str]:
    """The worker's command line for one target."""
    return ["--worker", name, "--levels", args.levels, "--caching", args.caching,
            "--max-examples", str(args.max_examples), "--trace-dir", args.trace_dir,
            *(["--base", base] if base else []),
            *(["--time-budget", str(args.time_budget)] if args.time_budget is not None else [])]  # fmt: skip


def run_plugin_matrix(
    rows: Sequence[tuple[str, str | None]],
    *,
    levels: Sequence[str] = ("pool", "manager"),
    cachings: Sequence[str] = ("on", "off"),
    max_examples: int = 100,
    time_budget: float | None = 60.0,
    trace_dir: str = "kvspec-oracle-traces",
    log: Callable[[str], None] = lambda _: None,
) -> list[PluginRow]:
    """Check every target of `rows`, each in its own process.

    Args:
        rows: (target name, vLLM release or None for the target's default).
        levels: The levels to run (a target that lacks one shows n/a).
        cachings: ``"on"`` and/or ``"off"``.
        max_examples: Harness examples per cell.
        time_budget: Harness seconds per cell.
        trace_dir: Where traces go.
        log: Progress messages.

    Returns:
        One row per target, in order.
    """
    Path(trace_dir).mkdir(parents=True, exist_ok=True)
    args = argparse.Namespace(levels=",".join(levels), caching=",".join(cachings), max_examples=max_examples,
                              time_budget=time_budget, trace_dir=trace_dir)  # fmt: skip
    out: list[PluginRow] = []
    for name, base in rows:
        target = TARGETS[name]
        log(f"plugins: {target.impl_name(base)}")
        # the budget is per cell; import and start-up get a fixed allowance on top
        cells = len(levels) * len(cachings)
        budget = None if time_budget is None else time_budget * cells
        try:
            data = run_worker("kvspec.conformance.tools.plugin_matrix", _worker_args(name, base, args),
                              time_budget_s=budget, allowance_s=180.0)  # fmt: skip
        except WorkerError as e:
            base_label = f"vllm {base or target.base}" if target.base else "own pool"
            out.append(PluginRow(name, target.impl_name(base), target.dist.label, base_label, target.profile,
                                 error=str(e)))  # fmt: skip
            continue
        out.append(PluginRow(**data))
    return out


def rows_to_json(rows: Sequence[PluginRow]) -> list[dict[str, Any]]:
    """The rows as plain data, for ``--json``."""
    return [asdict(row) for row in rows]


def _cell_text(cell: dict[str, Any] | None, notes: list[str], where: str) -> str:
    if cell is None:
        return "-"
    verdict = Verdict(cell["verdict"])
    if verdict in (Verdict.CONFORMS, Verdict.NOT_APPLICABLE):
        return "ok" if verdict is Verdict.CONFORMS else "n/a"
    if cell.get("step") is None:
        notes.append(f"{where}: {verdict}: {cell.get('message', '')[:300]}")
    else:
        notes.append(f"{where}: {_failure_text(cell)}")
    return f"{verdict}[{len(notes)}]"


def _failure_text(entry: dict[str, Any]) -> str:
    """A failure in words: where it is, what the plugin does, what it can affect, and its trace."""
    head = f"step {entry['step']} {entry['op']}"
    if entry.get("num_steps"):
        head += f" of a {entry['num_steps']}-step trace"
    if entry.get("finding"):
        bug = "; breaks an invariant" if entry.get("is_bug") else ""
        text = f"{head}: {entry['finding']} ({entry['effect']}{bug}): {entry['does']}"
    else:
        text = f"{head}: a divergence not described yet: {entry['message'][:200]}"
    _, ignored, note = str(entry.get("message", "")).partition("; declared ignored")
    if ignored:
        text += f"\n      declared ignored{note}"
    return f"{text}\n      trace: {entry.get('trace') or entry.get('trace_path')}"


def format_plugin_matrix(rows: Sequence[PluginRow]) -> str:
    """The matrix as text: one line per target, then each divergence, the probes, and the legend."""
    notes: list[str] = []
    header = ["plugin", "runs on", "profile", "pool/on", "pool/off", "request/on", "request/off"]
    table: list[list[str]] = []
    for row in rows:
        if row.error:
            notes.append(f"{row.impl}: {row.error}")
            table.append([row.plugin, row.base, row.profile, *[f"could not run[{len(notes)}]"] * 4])
            continue
        cells = [_cell_text(row.cells.get(k), notes, f"{row.impl} {k.replace('manager', 'request')}") for k in _KEYS]
        table.append([row.plugin, row.base, row.profile, *cells])
    widths = [max(len(r[i]) for r in [header, *table]) for i in range(len(header))]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in table]
    lines += ["", *[f"[{i}] {text}" for i, text in enumerate(notes, 1)]]
    lines += _probe_lines(rows)
    lines += ["", "effects:", *[f"  {name}: {meaning}" for name, meaning in EFFECTS.items()]]
    return "\n".join(lines)


def _probe_lines(rows: Sequence[PluginRow]) -> list[str]:
    lines = ["", "directed probes (each trace replays with `kvspec replay TRACE`):"]
    for row in rows:
        if not row.probes and not row.not_compared:
            continue
        lines.append(f"  {row.impl}:")
        for p in row.probes:
            where = f"{'request' if p['level'] == 'manager' else 'pool'}/{'on' if p['caching'] else 'off'}"
            if p["verdict"] == Verdict.CONFORMS.value:  # a probe's verdict is "conforms" or the failure's kind
                lines.append(f"    {p['name']} ({where}): conforms")
            else:
                lines.append(f"    {p['name']} ({where}): {p['verdict']} at {_failure_text(p)}")
        lines += [f"    not compared in the campaigns: {entry}" for entry in row.not_compared]
    return lines


def _main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvspec.conformance.tools.plugin_matrix")
    parser.add_argument("--worker", required=True, choices=sorted(TARGETS), help="the target to check here")
    parser.add_argument("--base", default=None, help="the vLLM release (default: the target's)")
    parser.add_argument("--levels", default="pool,manager")
    parser.add_argument("--caching", default="on,off")
    parser.add_argument("--max-examples", type=int, default=100)
    parser.add_argument("--time-budget", type=float, default=None)
    parser.add_argument("--trace-dir", default="kvspec-oracle-traces")
    return serve_worker(parser, _worker, argv)


if __name__ == "__main__":
    sys.exit(_main())
