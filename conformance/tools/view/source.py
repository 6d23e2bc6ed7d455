"""Where a page's plain data comes from: a trace, or seed 000's walkthrough.

Everything the player shows is built from one plain JSON document (the
"source document"): the configuration, and per step the operation with its
arguments in trace form, each side's outcome and each side's state as
`snapshot_to_json` writes it. The two functions here are the only code of
the player that reads the harness's own classes (`Trace`, `TraceStep`,
`Outcome`, `Snapshot`, `WalkthroughStep`); the page model
(`kvspec.conformance.tools.view.model`) and the page itself read nothing but the
document, so a change to those classes changes one function here.

Design choice: the spec's side is always computed, by running the trace's
operations through the spec alone as a replay checks them (`spec_side`),
never read from the file; where the file records a spec side that differs,
the document says at which step, and the page says so. The rejected
alternative, drawing what the file records, drew a trace edited by hand, or
written by another kvspec version, as if kvspec had found it. The
implementation's side can only be what the file records: nothing here runs
the implementation.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvspec.conformance.core.adapter import AdapterConfig
from kvspec.conformance.core.hash_names import HashNames
from kvspec.conformance.core.lockstep import spec_initial_state
from kvspec.conformance.core.results import Outcome
from kvspec.conformance.core.trace import Trace, TraceStep, encode_value, snapshot_to_json
from kvspec.conformance.runner.replaying import spec_side
from kvspec.conformance.tools.walkthrough import WalkthroughStep, load_golden
from kvspec.spec.state import Snapshot

__all__ = ["SOURCE_FORMAT", "trace_to_page_data", "walkthrough_to_page_data"]

SOURCE_FORMAT = 1


def _initial_snapshot(config: AdapterConfig) -> Snapshot:
    """The spec's state before the first operation (step 0)."""
    return spec_initial_state(config).snapshot()


def trace_to_page_data(trace: Trace) -> dict[str, Any]:
    """A trace as the player's source document (plain JSON), the spec's side computed, never read from the file.

    Args:
        trace: a trace as `read_trace` returns it.

    Returns:
        The source document: `config`, `impl`, `verdict`, `failure`, `steps`
        (step 0 being the state before the first operation) and
        `spec_recorded_differs`: the first step whose recorded spec outcome or
        state is not what the spec computes, with what differs (None: none).
    """
    c = trace.config
    # The story's names (HashNames, as the lock-step core gives them), so page and story agree.
    spec_names, impl_names = HashNames.from_trace(trace.steps).given()
    computed = spec_side(trace)
    failure = trace.failure.to_json() if trace.failure is not None else None
    initial = snapshot_to_json(_initial_snapshot(c))
    has_impl = any(s.impl_snapshot is not None for s in trace.steps)
    # NOTE: the harness checks the built adapter's state against the spec's before
    # the first step, so past step 0 both started from the same state.
    impl_initial = initial if has_impl and (failure is None or failure.get("step") != 0) else None
    steps: list[dict[str, Any]] = [
        {
            "index": 0,
            "op": None,
            "args": [],
            "spec_outcome": None,
            "impl_outcome": None,
            "spec": initial,
            "impl": impl_initial,
            "spec_recomputed": False,
            "caption": None,
            "base": None,
        }
    ]
    steps += [_trace_step(s, computed[i]) for i, s in enumerate(trace.steps)]
    return {
        "kvspec_page_source": SOURCE_FORMAT,
        "kind": "trace",
        "config": {
            "level": c.level,
            "num_gpu_blocks": c.num_gpu_blocks,
            "block_size": c.block_size,
            "enable_caching": c.enable_caching,
            "profile": c.profile,
            **({"groups": c.groups} if c.groups != "full" else {}),
        },
        "impl": trace.impl,
        "verdict": None if trace.verdict is None else trace.verdict.value,
        "failure": failure,
        "hash_names": spec_names,
        "impl_hash_names": impl_names,
        "spec_recorded_differs": _recorded_spec_differs(trace, computed),
        "steps": steps,
    }


def _recorded_spec_differs(trace: Trace, computed: Sequence[tuple[Outcome, Snapshot]]) -> dict[str, Any] | None:
    """The first step whose recorded spec side is not the computed one, and what differs; None when none is.

    Outcomes are compared as the lock-step core compares them (an error by its type, not its message; events
    only where the trace checked them), so a reworded message is no difference.
    """
    before = _initial_snapshot(trace.config)
    for s, (outcome, after) in zip(trace.steps, computed):
        what = []
        if s.spec is not None and _compared(s.spec, trace.config.events) != _compared(outcome, trace.config.events):
            what.append("outcome")
        # NOTE: a hung step's spec state is recorded before the call where the lock-step core caught the hang,
        # after it where the process was killed and the runner rebuilt the story: either is the spec's.
        expected = (before, after) if s.impl is not None and s.impl.hung else (after,)
        if s.spec_snapshot is not None and s.spec_snapshot not in expected:
            what.append("state")
        if what:
            return {"step": s.index, "what": what}
        before = after
    return None


def _compared(o: Outcome, events: bool) -> dict[str, Any]:
    """What of an outcome the lock-step core compares, as JSON: its kind and result, no message."""
    said = ("message", "crash", "hung", "not_sent")  # the words, which carry no verdict
    return {k: None if k in said else v for k, v in o.to_json().items() if events or k != "events"}


def _trace_step(s: TraceStep, computed: tuple[Outcome, Snapshot]) -> dict[str, Any]:
    """One trace step in the source document: the spec's side computed, the implementation's as recorded."""
    return {
        "index": s.index,
        "op": s.op,
        "args": encode_value(list(s.args)),
        "mistake": s.mistake,
        "spec_outcome": computed[0].to_json(),
        "impl_outcome": None if s.impl is None else s.impl.to_json(),
        "spec": snapshot_to_json(computed[1]),
        "impl": None if s.impl_snapshot is None else snapshot_to_json(s.impl_snapshot),
        "spec_recomputed": s.spec_snapshot is None,
        "caption": None,
        "base": None,
    }


def walkthrough_to_page_data(
    steps: Sequence[WalkthroughStep], model: str, golden: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Seed 000's walkthrough (as `run_walkthrough` plays it) as the player's source document.

    Steps keep the golden file's numbers and captions; each is drawn against
    the state it follows (`after`): step 7, request D's eviction, branches
    from step 5, not from step 6.

    Args:
        steps: the walkthrough's states, one per golden step.
        model: which model played it ("reference", "spec"), for the title.
        golden: the golden walkthrough; default `load_golden()`.

    Returns:
        The source document, one side (the model), the request block tables
        the walkthrough keeps, and the hash names h1, h2 of the seed.
    """
    golden = golden if golden is not None else load_golden()
    after = {int(g["step"]): g["after"] for g in golden["steps"]}
    names: dict[str, str] = {}
    out: list[dict[str, Any]] = []
    for step in steps:
        names.update({bytes(h).hex(): n for h, n in step.hash_names.items()})
        out.append(_walkthrough_step(step, after.get(step.step)))
    cfg = golden["config"]
    return {
        "kvspec_page_source": SOURCE_FORMAT,
        "kind": "walkthrough",
        "config": {
            "level": "pool",
            "num_gpu_blocks": cfg["num_gpu_blocks"],
            "block_size": cfg["block_size"],
            "enable_caching": cfg["enable_caching"],
            "profile": "vllm-v1",
        },
        "impl": model,
        "verdict": None,
        "failure": None,
        "hash_names": names,
        "requests": {name: list(tokens) for name, tokens in golden["requests"].items()},
        "steps": out,
    }


def _walkthrough_step(step: WalkthroughStep, base: int | None) -> dict[str, Any]:
    """One walkthrough step in the source document, drawn against step `base` (None: the one before)."""
    snapshot = snapshot_to_json(step.snapshot)
    # The walkthrough drives a pool; the request block tables are its own bookkeeping.
    snapshot["block_tables"] = [[rid, list(blocks)] for rid, blocks in sorted(step.block_tables.items())]
    return {
        "index": step.step,
        "op": None,
        "args": [],
        "spec_outcome": None,
        "impl_outcome": None,
        "spec": snapshot,
        "impl": None,
        "spec_recomputed": False,
        "caption": step.action,
        "base": base,
        "computed_tokens": dict(step.num_computed_tokens),
    }
