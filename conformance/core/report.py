"""The short story of a failure: the steps, the first divergence, both states side by side.

A failure is only useful if a person can read it in a minute. The story
prints every step of the shrunk trace as a call with named arguments and its
result, marks the failing step with `>`, says what failed (the invariant by
name, or the comparison), and shows the spec's and the implementation's
state after that step in two columns, with the rows that differ marked.

Hash values are unreadable and, between implementations, arbitrary, so they
are shown as names: `h1`, `h2`, ... in order of first appearance in the
trace (`HashNames`, the naming the lock-step core uses, so a diff in a failure
message and the story agree). An implementation's own hash values get the name
of the spec hash they stand for (the harness compares hashes as names, not as bytes).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvspec.conformance.core.hash_names import HashNames
from kvspec.conformance.core.operations import OPERATIONS
from kvspec.conformance.core.results import FailureKind, Outcome, Verdict
from kvspec.conformance.core.trace import Trace, TraceStep
from kvspec.spec.manager import Request
from kvspec.spec.state import Snapshot

__all__ = ["describe_config", "render_call", "render_story", "side_by_side"]

_MARK = "<<"


def describe_config(trace: Trace) -> str:
    """One line: level, pool size, block size and KV cache groups, caching, profile, implementation."""
    c = trace.config
    parts = [f"{c.level} level", f"num_gpu_blocks={c.num_gpu_blocks}"]
    if c.level == "manager":
        parts.append(f"block_size={c.block_size}")
        if c.groups != "full":  # a drawn layout is the story's to tell: the example ran under it
            parts.append(f"KV cache groups {c.groups}")
    parts += [f"caching {'on' if c.enable_caching else 'off'}", f"profile {c.profile}"]
    if trace.impl:
        parts.append(f"implementation {trace.impl}")
    return ", ".join(parts)


def _value(value: Any, names: HashNames, block_size: int) -> str:
    if isinstance(value, bytes):
        return names.name(value)
    if isinstance(value, Request):
        return _request(value, block_size)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_value(v, names, block_size) for v in value) + "]"
    return repr(value)


def _request(r: Request, block_size: int) -> str:
    # Tokens grouped by block (`|` between blocks) so a hit's extent can be read off.
    blocks = [r.token_ids[i : i + block_size] for i in range(0, len(r.token_ids), block_size)]
    tokens = "|".join(" ".join(str(t) for t in block) for block in blocks)
    extra = []
    if r.lora_name:
        extra.append(f"lora={r.lora_name}")
    if r.cache_salt:
        extra.append(f"cache_salt={r.cache_salt}")
    if r.mm_inputs:
        extra.append("mm=" + ",".join(f"{m.identifier}@{m.offset}+{m.length}" for m in r.mm_inputs))
    rid = r.request_id if r.request_id else "''"
    return f"{rid}({len(r.token_ids)} tokens: {tokens or '-'}{'; ' + ' '.join(extra) if extra else ''})"


def render_call(op: str, args: Sequence[Any], names: HashNames | None = None, block_size: int = 1) -> str:
    """`op(name=value, ...)` with hashes named and requests summarised."""
    names = names if names is not None else HashNames()
    operation = OPERATIONS.get(op)
    params = operation.params if operation is not None else tuple(f"arg{i}" for i in range(len(args)))
    shown = [f"{p}={_value(a, names, block_size)}" for p, a in zip(params, args)]
    if operation is not None:  # trailing arguments at their usual values say nothing (the entry's quiet tail)
        shown = shown[: operation.wording.shown_args(args)]
    return f"{op}({', '.join(shown)})"


def _outcome(o: Outcome | None) -> str:
    return "?" if o is None else o.describe()


def _ids(values: Sequence[Any]) -> str:
    return " ".join(str(v) for v in values) if values else "-"


def _rows(s: Snapshot, name: Any, widths: Sequence[int]) -> list[tuple[str, str]]:
    def cells(values: Sequence[Any]) -> str:
        return " ".join(f"{v!s:>{w}}" for v, w in zip(values, widths))

    table = "  ".join(f"{name(bytes(h))}->[{_ids(b)}]" for h, b in s.hash_to_blocks) or "-"
    rows = [
        ("block", cells(range(1, s.num_gpu_blocks))),
        ("ref_cnt", cells(s.ref_cnt[1:])),
        ("block_hash", cells(["." if h is None else name(bytes(h)) for h in s.block_hash[1:]])),
        ("free queue (left first)", _ids(s.free_queue)),
        ("hash table", table),
    ]
    if s.block_tables is not None:
        rows.append(("block tables", "  ".join(f"{rid}:[{_ids(b)}]" for rid, b in s.block_tables) or "-"))
    if s.quarantined:
        rows.append(("quarantined", _ids(s.quarantined)))
    return rows


def side_by_side(spec: Snapshot | None, impl: Snapshot | None, names: HashNames, title: str) -> list[str]:
    """Both states in two columns; rows that differ end with `<<`."""
    spec_name = names.name
    snaps = [(s, n) for s, n in ((spec, spec_name), (impl, names.impl_name)) if s is not None]
    num_blocks = max((s.num_gpu_blocks for s, _ in snaps), default=1)
    widths = [len(str(b)) for b in range(1, num_blocks)]
    for s, n in snaps:
        for b in range(1, min(s.num_gpu_blocks, num_blocks)):
            h = s.block_hash[b]
            widths[b - 1] = max(widths[b - 1], len(str(s.ref_cnt[b])), 1 if h is None else len(n(bytes(h))))
    spec_rows = _rows(spec, spec_name, widths) if spec is not None else []
    impl_rows = _rows(impl, names.impl_name, widths) if impl is not None else []
    labels = [r[0] for r in (spec_rows or impl_rows)]
    s_map, i_map = dict(spec_rows), dict(impl_rows)
    width = max([len("spec")] + [len(v) for v in s_map.values()]) + 3
    label_w = max([len(title)] + [len(label) + 2 for label in labels]) + 2
    lines = [f"{title:<{label_w}}{'spec':<{width}}implementation"]
    for label in labels:
        sv = s_map.get(label, "(unknown)")
        iv = i_map.get(label, "(unknown)")
        mark = f"  {_MARK}" if spec is not None and impl is not None and sv != iv else ""
        lines.append(f"  {label:<{label_w - 2}}{sv:<{width}}{iv}{mark}")
    return lines


def render_story(trace: Trace, trace_path: str | None = None, replay_impl: str | None = None) -> str:
    """The short story of a trace with a failure (or a clean run when it has none)."""
    names = HashNames.from_trace(trace.steps)
    bs = trace.config.block_size
    failure = trace.failure
    bad = failure.step if failure is not None else -1
    lines = []
    if failure is not None:
        verdict = trace.verdict or failure.kind.verdict
        where = "building the adapter" if bad == 0 else f"step {bad} of {len(trace.steps)} ({failure.op})"
        # A step kvspec could not run (LockStep's harness limit) is no failure of the spec's: say whose it is.
        kind = "kvspec's limit" if failure.kind is FailureKind.LIMIT else failure.kind.value
        lines.append(f"{verdict.value.upper()}: {kind} at {where}")
    else:
        verdict_name = (trace.verdict or Verdict.CONFORMS).value
        lines.append(f"{verdict_name.upper()}: {len(trace.steps)} steps, no divergence")
    lines.append(f"  {describe_config(trace)}")
    lines.append("")
    for step in trace.steps:
        lines.append(_step_line(step, bad, names, bs))
    if failure is not None:
        lines.append("")
        inv = failure.invariant
        lines.append(f"what failed: {'invariant ' + str(inv) + ': ' if inv else ''}{failure.message}")
        at = next((s for s in trace.steps if s.index == bad), None)
        if at is not None and (at.spec_snapshot is not None or at.impl_snapshot is not None):
            lines.append("")
            lines += side_by_side(at.spec_snapshot, at.impl_snapshot, names, f"state after step {bad}")
    if trace_path:
        lines.append("")
        lines.append(f"trace: {trace_path}")
        impl = replay_impl or trace.impl
        lines.append(f"replay: kvspec replay {trace_path}" + (f" --impl {impl}" if impl else ""))
    return "\n".join(lines)


def _step_line(step: TraceStep, bad: int, names: HashNames, block_size: int) -> str:
    call = render_call(step.op, step.args, names, block_size)
    mark = ">" if step.index == bad else " "
    spec, impl = _outcome(step.spec), _outcome(step.impl)
    same = step.impl is not None and step.spec is not None and step.spec.to_json() == step.impl.to_json()
    if step.index == bad and not same:
        return f"{mark} {step.index:>3}. {call}\n          spec -> {spec}\n          impl -> {impl}"
    return f"{mark} {step.index:>3}. {call} -> {spec}"
