"""What changed between two vLLMs: the answer a regression oracle exists to give (`kvspec diff A B`).

A and B are any two vLLMs kvspec loads: released versions (``vllm@0.33.0``),
source trees (``vllm@path/to/checkout``), the installed build (``vllm``). Three
kinds of change are reported, pool level:

- **API**: the public methods of vLLM's ``BlockPool`` and their parameters,
  added, removed or changed (read from the code);
- **facts**: what the adapter reads from each (a null block, the shape of
  ``touch``, the hash-table key), the caller-mistake reactions each is
  checked against, and each probe's verdict (the scenarios that show vLLM's
  known pool behaviours, `kvspec.conformance.targets.vllm.probes`);
- **behaviour**: a campaign per eviction profile and caching setting on each;
  where one conforms and the other does not, the shrunk trace of the one that
  does not is a call sequence on which the two give different results. It is
  replayed on both, and kept only when it conforms on one and not on the
  other: a witness, not a guess. With a folder for pages, each witness is a
  step-through page with A beside B: the side that follows the spec is the
  spec's column (its replay equals the spec's state at every step), the side
  that leaves it the implementation's.

Why through the spec rather than A against B directly: a trace that conforms
on A follows the spec step by step, so where B leaves the spec on that trace,
B leaves A; and every witness replays with `kvspec replay` on each side
alone, the story naming the step. Differences where both leave the spec (each
its own way) are not behaviour changes this can witness; they show in the
probes and the facts.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal

from kvspec.conformance.core.adapter import AdapterConfig
from kvspec.conformance.core.results import Verdict
from kvspec.conformance.core.trace import read_trace
from kvspec.conformance.runner.registry import load_factory
from kvspec.conformance.runner.run import replay, run_check
from kvspec.conformance.targets.vllm.probes import run_probes
from kvspec.conformance.tools.view.files import page_path_for
from kvspec.conformance.tools.view.page import write_page
from kvspec.conformance.tools.view.source import trace_to_page_data

__all__ = ["PROFILES", "Change", "diff_vllm", "format_changes"]

PROFILES: tuple[str, ...] = ("vllm-v1", "vllm-v1-tail")  # the orders vLLM's releases follow
_ADAPTER_FACTS = ("has_null_block", "touch_shape", "hash_key_kind")

ChangeKind = Literal["api", "fact", "behaviour"]


@dataclass(frozen=True, slots=True)
class Change:
    """One difference between A and B."""

    kind: ChangeKind
    what: str  # what differs ("BlockPool.free_blocks parameters", "caching on, profile vllm-v1")
    a: str  # A's side, in words
    b: str  # B's side
    trace: str | None = None  # a behaviour change's witness: conforms on one side, not on the other
    steps: int | None = None  # its length
    page: str | None = None  # the witness as a step-through page, A beside B (with a folder for pages)


def diff_vllm(
    a: str,
    b: str,
    *,
    max_examples: int = 100,
    trace_dir: Path,
    html_dir: Path | None = None,
    log: Callable[[str], None] = lambda _: None,
) -> list[Change]:
    """Every change from A to B (vLLM implementation names as ``--impl`` takes them), API, facts, behaviour.

    ``html_dir``: where each behaviour change's witness is written as a page with A beside B (None: no pages).

    Raises:
        kvspec.conformance.runner.registry.FactoryError: a name that loads no vLLM (the message says why).
    """
    factories = {name: load_factory(name) for name in (a, b)}
    adapters: dict[str, Any] = {name: factories[name](AdapterConfig(level="pool", num_gpu_blocks=8)) for name in (a, b)}
    changes = _api_changes(_api(adapters[a].release), _api(adapters[b].release))
    changes += _fact_changes(adapters[a], adapters[b])
    own_profile = {a: PROFILES[0], b: PROFILES[0]}  # the order each follows with caching on, where one
    for caching in (True, False):
        for profile in PROFILES:
            log(f"caching {'on' if caching else 'off'}, profile {profile}")
            found, conforming = _behaviour_change(a, b, factories, caching, profile, max_examples, trace_dir)
            if found is not None and html_dir is not None:
                found = _with_page(found, a, b, html_dir, log)
            changes += [found] if found else []
            own_profile.update(dict.fromkeys(conforming if caching else (), profile))
    log("probes")
    return changes + _probe_changes(a, b, factories, own_profile, trace_dir)


def _api(release: Any) -> dict[str, tuple[str, ...]]:
    """Each public method of the release's BlockPool, and its parameters after ``self``."""
    cls = release.block_pool.BlockPool
    return {
        name: tuple(p for p in inspect.signature(fn).parameters if p != "self")
        for name, fn in inspect.getmembers(cls, inspect.isfunction)
        if not name.startswith("_")
    }


def _api_changes(api_a: dict[str, tuple[str, ...]], api_b: dict[str, tuple[str, ...]]) -> list[Change]:

    def side(api: dict[str, tuple[str, ...]], name: str) -> str:
        return "absent" if name not in api else f"({', '.join(api[name])})"

    return [
        Change("api", f"BlockPool.{name}", side(api_a, name), side(api_b, name))
        for name in sorted(api_a.keys() | api_b.keys())
        if api_a.get(name) != api_b.get(name)
    ]


def _fact_changes(adapter_a: Any, adapter_b: Any) -> list[Change]:
    changes = [
        Change("fact", fact, str(getattr(adapter_a, fact)), str(getattr(adapter_b, fact)))
        for fact in _ADAPTER_FACTS
        if getattr(adapter_a, fact) != getattr(adapter_b, fact)
    ]
    reactions_a, reactions_b = adapter_a.mistake_reactions, adapter_b.mistake_reactions
    for mistake in sorted(reactions_a.keys() | reactions_b.keys()):
        said = [r.describe() if (r := reactions.get(mistake)) else "not declared"
                for reactions in (reactions_a, reactions_b)]  # fmt: skip
        if said[0] != said[1]:
            changes.append(Change("fact", f"declared reaction to {mistake}", said[0], said[1]))
    return changes


def _probe_changes(
    a: str, b: str, factories: dict[str, Any], own_profile: dict[str, str], trace_dir: Path
) -> list[Change]:
    """Probes whose verdict differs, each side under the order it follows (so a changed free order does not
    show as every probe changed), with the trace of the side the probe fails on (replayed on that side)."""
    results = {name: {p.name: p for p in run_probes(factories[name], own_profile[name], str(trace_dir), name)}
               for name in (a, b)}  # fmt: skip
    changes = []
    for probe in results[a]:
        pa, pb = results[a][probe], results[b].get(probe)
        if pb is None or pa.verdict == pb.verdict:
            continue
        trace = pa.trace_path or pb.trace_path
        steps = len(read_trace(trace).steps) if trace else None
        changes.append(Change("fact", f"probe: {probe}", pa.verdict, pb.verdict, trace, steps))
    return changes


def _behaviour_change(
    a: str, b: str, factories: dict[str, Any], caching: bool, profile: str, max_examples: int, trace_dir: Path
) -> tuple[Change | None, list[str]]:
    """One campaign per side under ``profile``: a witness where exactly one side conforms, and the sides that do."""
    results = {
        name: run_check(
            factories[name],
            impl=name,
            level="pool",
            enable_caching=caching,
            profile=profile,
            max_examples=max_examples,
            trace_dir=trace_dir,
            isolate=False,
        )  # fmt: skip
        for name in (a, b)
    }
    conforming = [name for name in (a, b) if results[name].verdict is Verdict.CONFORMS]
    if len(conforming) != 1:
        return None, conforming
    leaving = b if conforming == [a] else a
    failure = results[leaving].failure
    if failure is None or failure.trace_path is None:
        return None, conforming
    again = {name: replay(failure.trace_path, factories[name], impl=name, isolate=False, trace_dir=trace_dir)
             for name in (a, b)}  # fmt: skip
    if again[conforming[0]].verdict is not Verdict.CONFORMS or again[leaving].verdict is Verdict.CONFORMS:
        return None, conforming  # not a witness: both sides agree on it after all
    where = f"caching {'on' if caching else 'off'}, profile {profile}"
    said = {conforming[0]: "follows the spec", leaving: f"step {failure.step} {failure.op}: {failure.message}"}
    change = Change("behaviour", where, said[a], said[b], failure.trace_path, failure.num_steps or failure.step)
    return change, conforming


def _with_page(change: Change, a: str, b: str, html_dir: Path, log: Callable[[str], None]) -> Change:
    """The change with its witness written as a page, A beside B, named ``diff-<trace>.html`` (a check's page of
    the same trace keeps its name). A page that cannot be written is logged; the change stands either way."""
    assert change.trace is not None, f"change={change.what!r} has no witness"
    follows, leaves = (a, b) if change.a == "follows the spec" else (b, a)
    try:
        doc = trace_to_page_data(read_trace(change.trace))
        doc["beside"] = {"a": a, "b": b, "follows": follows, "leaves": leaves}
        page = write_page(html_dir / f"diff-{page_path_for(change.trace, html_dir).name}", doc)
    except (OSError, ValueError) as e:  # MalformedTrace is a ValueError
        log(f"page of {change.trace} not written ({type(e).__name__}: {e})")
        return change
    return replace(change, page=str(page))


def format_changes(a: str, b: str, changes: Sequence[Change]) -> str:
    """The changes as text: one paragraph per kind, each change on a line, its witness under it."""
    if not changes:
        return f"{a} -> {b}: no change found (API, facts, probes, and campaigns under {', '.join(PROFILES)})"
    lines = [f"{a} -> {b}: {len(changes)} change(s)"]
    for kind in ("api", "fact", "behaviour"):
        chosen = [c for c in changes if c.kind == kind]
        if chosen:
            lines.append(f"\n{kind}:")
        for c in chosen:
            lines.append(f"  {c.what}: {c.a}  ->  {c.b}")
            if c.trace and c.kind == "behaviour":
                lines.append(f"    witness ({c.steps} steps): kvspec replay {c.trace} --impl {a}  (and --impl {b})")
                if c.page:
                    lines.append(f"    page, {a} beside {b}: {c.page}")
            elif c.trace:
                lines.append(f"    trace ({c.steps} steps) of the side it fails on: kvspec replay {c.trace}")
    return "\n".join(lines)


def changes_json(a: str, b: str, changes: Sequence[Change]) -> dict[str, Any]:
    """The changes in JSON form."""
    return {"a": a, "b": b, "changes": [asdict(c) for c in changes]}
