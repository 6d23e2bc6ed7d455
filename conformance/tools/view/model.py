"""The page model: what the player draws at each step, computed from the source document.

`build_view` turns the plain source document (`kvspec.conformance.tools.view.source`)
into the page's data: hash values as short names (`h1`, `h2`, ... in order of
first appearance, an implementation's own values under the name of the spec
hash they stand for, as the text story names them) each with its colour, and
per step each side's state, the blocks that changed since the step it
follows, the fields where the implementation differs from the spec, the
operation and both results in words; for a failure, the rule it broke in
plain words and the step the page opens at.

Design choice: all of this is computed here, in Python, and the page's
script only draws it. The rejected alternative, a script that diffs raw
snapshots, would put the harness's comparison rules (hashes compared as
names, errors compared by type) in a second language, untested by the suite.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import fields
from typing import Any

from kvspec.conformance.core.kv_events import comparable, event_from_json, events_as, same_events
from kvspec.conformance.core.operations import OPERATIONS, BadResult, Operation
from kvspec.conformance.core.results import FailureKind, Verdict
from kvspec.conformance.core.wording import CallText, plural
from kvspec.spec.events import BlockStored, KVCacheEvent
from kvspec.spec.invariants import EVENT_RULES, HIT_RULES, INVARIANTS, STEP_RULES
from kvspec.spec.state import BlockHash

__all__ = ["PAGE_FORMAT", "RULES", "build_view"]

PAGE_FORMAT = 1

# The comparisons the lock-step core makes besides the named invariants: (label, plain words).
RULES: dict[str, tuple[str, str]] = {
    "same_result": (
        "same result",
        "The implementation returns what the spec returns (the same block ids in the same order), "
        "or raises the same error type.",
    ),
    "state_equals_spec": (
        "state equals spec",
        "After every step the implementation's whole state equals the spec's: ref counts, hashes "
        "(compared as names), the free queue in order, the hash table and the block tables.",
    ),
    "rejected_call_changes_nothing": (
        "a rejected call changes nothing",
        "A call refused with an error leaves the state exactly as it was before the call.",
    ),
    "no_crash": (
        "no crash",
        "The implementation raises only the spec's error types, and its process never dies.",
    ),
    "no_hang": ("no hang", "The implementation answers every call within the step time limit."),
    "spec_holds": ("the spec holds", "The spec itself runs without failing (otherwise kvspec has a bug)."),
    "kvspec_can_run": (
        "kvspec can run the call",
        "kvspec can run every call it sends to the implementation (where it cannot, it says so: its own limit, "
        "no verdict on the implementation).",
    ),
    "same_events": (
        "same events",
        "Every call publishes the KV cache events the spec publishes (hash values compared as names), in order; "
        "a run of removals in any order.",
    ),
    "same_statistics": (
        "same hit statistics",
        "After every request-level step the prefix-cache hit statistics equal the spec's: requests, queried and "
        "hit tokens, local and external apart, preempted requests apart, resets.",
    ),
}

_NAMED_RULES: dict[str, str] = {
    **{inv.name: inv.rule for inv in INVARIANTS},
    **{r.name: r.rule for r in STEP_RULES},
    **{r.name: r.rule for r in HIT_RULES},
    **{r.name: r.rule for r in EVENT_RULES},
}

# The lock-step core names the block whose memory a hit read back wrong in its message
# (hit_content_intact); the trace keeps no other record of it.
_CORRUPT_BLOCK = re.compile(r"\bhit block (\d+)\b")

_MAX_TOKENS_SHOWN = 48


class _HashNames:
    """Hash value (hex) -> short name, for the spec's side and the implementation's."""

    def __init__(self, given: Mapping[str, str], given_impl: Mapping[str, str] | None = None) -> None:
        self.spec: dict[str, str] = dict(given)  # spec hash -> "h1", ...
        self.impl: dict[str, str] = dict(given_impl or {})  # implementation hash -> its spec name, or "x1", ...
        self._taken = set(self.spec.values()) | set(self.impl.values())

    def _fresh(self, prefix: str) -> str:
        i = 1
        while f"{prefix}{i}" in self._taken:
            i += 1
        self._taken.add(f"{prefix}{i}")
        return f"{prefix}{i}"

    def of_spec(self, h: str) -> str:
        """The spec hash's name, given on first sight."""
        if h not in self.spec:
            self.spec[h] = self._fresh("h")
        return self.spec[h]

    def of_impl(self, h: str) -> str:
        """An implementation hash's name: the one it was paired with, else the same value's spec name, else its own."""
        if h in self.impl:
            return self.impl[h]
        if h in self.spec:
            return self.spec[h]
        if h not in self.impl:
            self.impl[h] = self._fresh("x")
        return self.impl[h]

    def pair(self, spec_h: str, impl_h: str) -> None:
        """Name `impl_h` after `spec_h` (they sit on the same block), unless it already has a name."""
        if impl_h not in self.spec and impl_h not in self.impl:
            self.impl[impl_h] = self.of_spec(spec_h)

    def all_names(self) -> list[str]:
        """Every name given, in natural order (h1, h2, ..., h10, then x1, ...)."""
        return sorted(set(self.spec.values()) | set(self.impl.values()), key=_natural)


def _natural(name: str) -> tuple[str, int, str]:
    m = re.fullmatch(r"([a-z]+)(\d+)", name)
    return ("~" + name, 0, name) if m is None else (m.group(1), int(m.group(2)), "")


def _colour(i: int) -> tuple[str, str]:
    """A fill and an edge colour for the i-th hash name; successive names get far-apart hues, h1 green."""
    hue = (135 + i * 137.508) % 360
    return f"hsl({hue:.0f} 70% 82%)", f"hsl({hue:.0f} 55% 38%)"


def _hashes_in(value: Any) -> list[str]:
    """The tagged hash values (`{"bytes": hex}`) in an encoded argument, in order."""
    if isinstance(value, dict) and set(value) == {"bytes"}:
        return [str(value["bytes"])]
    if isinstance(value, list):
        return [h for v in value for h in _hashes_in(v)]
    return []


def _name_hashes(doc: Mapping[str, Any]) -> _HashNames:
    # A trace's document carries the names HashNames gave (the story's); these only fill gaps.
    names = _HashNames(doc.get("hash_names") or {}, doc.get("impl_hash_names"))
    for step in doc["steps"]:
        for h in _hashes_in(step["args"]):
            names.of_spec(h)
        spec = step["spec"]
        if spec is not None:
            for h in spec["block_hash"]:
                if h is not None:
                    names.of_spec(h)
    for step in doc["steps"]:
        spec, impl = step["spec"], step["impl"]
        if spec is not None and impl is not None:
            for hs, hi in zip(spec["block_hash"], impl["block_hash"]):
                if hs is not None and hi is not None:
                    names.pair(hs, hi)
    return names


def _state(snap: Mapping[str, Any] | None, name: Callable[[str], str]) -> dict[str, Any] | None:
    if snap is None:
        return None
    tables = snap["block_tables"]
    return {
        "num_gpu_blocks": snap["num_gpu_blocks"],
        "ref_cnt": list(snap["ref_cnt"]),
        "hash": [None if h is None else name(h) for h in snap["block_hash"]],
        "free_queue": list(snap["free_queue"]),
        "hash_table": sorted(([name(h), list(b)] for h, b in snap["hash_to_blocks"]), key=lambda e: _natural(e[0])),
        "block_tables": None if tables is None else sorted([rid, list(b)] for rid, b in tables),
        "quarantined": list(snap["quarantined"]),
    }


def _changed(before: Mapping[str, Any] | None, after: Mapping[str, Any] | None) -> list[int]:
    """The blocks whose ref_cnt, hash, free-queue or quarantine membership changed."""
    if before is None or after is None:
        return []
    n = min(before["num_gpu_blocks"], after["num_gpu_blocks"])
    free_b, free_a = set(before["free_queue"]), set(after["free_queue"])
    q_b, q_a = set(before["quarantined"]), set(after["quarantined"])
    # Past the longest list only queue membership can change: an implementation's num_gpu_blocks is not trusted.
    listed = max(len(before["ref_cnt"]), len(after["ref_cnt"]), len(before["hash"]), len(after["hash"]))
    candidates = set(range(min(n, listed))) | free_b ^ free_a | q_b ^ q_a
    return [
        b
        for b in sorted(candidates)
        if 0 <= b < n
        and (
            _at(before["ref_cnt"], b) != _at(after["ref_cnt"], b)
            or _at(before["hash"], b) != _at(after["hash"], b)
            or (b in free_b) != (b in free_a)
            or (b in q_b) != (b in q_a)
        )
    ]


def _at(values: Sequence[Any], b: int) -> Any:
    """Block `b`'s entry; an implementation's snapshot may list fewer entries than it has blocks."""
    return values[b] if b < len(values) else "(none)"


def _outcome_key(o: Mapping[str, Any] | None) -> Any:
    """What the lock-step core compares of an outcome: the result, or the error's type (not its message)."""
    if o is None:
        return None
    if "result" in o:
        return ("result", o["result"])
    if "error" in o:
        return ("error", o["error"])
    return ("crash",) if "crash" in o else ("hung",)


def _same_outcome(op: str | None, spec: Mapping[str, Any] | None, impl: Mapping[str, Any] | None) -> bool:
    """Whether the lock-step core would call the two outcomes the same (results as the operation compares them)."""
    a, b = _outcome_key(spec), _outcome_key(impl)
    operation = OPERATIONS.get(op) if op is not None else None
    if operation is not None and a and b and a[0] == b[0] == "result" and not _malformed(a[1], b[1]):
        return operation.same_result(a[1], b[1])
    return bool(a == b)


def _malformed(*results: Any) -> bool:
    return any(isinstance(r, dict) and "malformed" in r for r in results)


def _differences(spec: Mapping[str, Any] | None, impl: Mapping[str, Any] | None) -> dict[str, Any]:
    """Where the implementation's state differs from the spec's: the blocks, and the fields by name."""
    if spec is None or impl is None:
        return {"blocks": [], "fields": [], "free_queue_positions": []}
    n = max(len(spec["ref_cnt"]), len(impl["ref_cnt"]), len(spec["hash"]), len(impl["hash"]))  # past them: equal
    ref = [b for b in range(n) if _at(spec["ref_cnt"], b) != _at(impl["ref_cnt"], b)]
    hashed = [b for b in range(n) if _at(spec["hash"], b) != _at(impl["hash"], b)]
    fields = [f for f in ("num_gpu_blocks",) if spec[f] != impl[f]]
    fields += ["ref_cnt"] if ref else []
    fields += ["block_hash"] if hashed else []
    fields += [f for f in ("free_queue", "hash_table", "block_tables", "quarantined") if spec[f] != impl[f]]
    fq_s, fq_i = spec["free_queue"], impl["free_queue"]
    positions = [i for i in range(max(len(fq_s), len(fq_i))) if _at(fq_s, i) != _at(fq_i, i)]
    return {"blocks": sorted(set(ref) | set(hashed)), "fields": fields, "free_queue_positions": positions}


# --- words ----------------------------------------------------------------------------------
# What each operation asks and what its result means are the operations table's (its entry's wording);
# here, only how the page shows a trace-form value: a hash by its short name, a request by its tokens.


def _request_words(r: Mapping[str, Any], block_size: int) -> str:
    tokens = list(r["token_ids"])
    shown = tokens[:_MAX_TOKENS_SHOWN]
    blocks = [shown[i : i + block_size] for i in range(0, len(shown), block_size)]
    text = "|".join(" ".join(str(t) for t in block) for block in blocks) or "-"
    if len(tokens) > len(shown):
        text += " …"
    extra = []
    if r.get("lora_name"):
        extra.append(f"lora={r['lora_name']}")
    if r.get("cache_salt"):
        extra.append(f"cache_salt={r['cache_salt']}")
    if r.get("mm_inputs"):
        extra.append("mm=" + ",".join(f"{m[0]}@{m[1]}+{m[2]}" for m in r["mm_inputs"]))
    rid = r["request_id"] or "''"
    return f"{rid}({plural(len(tokens), 'token')}: {text}{'; ' + ' '.join(extra) if extra else ''})"


def _value(v: Any, names: _HashNames, block_size: int) -> str:
    if isinstance(v, dict) and set(v) == {"bytes"}:
        return names.of_spec(str(v["bytes"]))
    if isinstance(v, dict) and set(v) == {"request"}:
        return _request_words(v["request"], block_size)
    if isinstance(v, list):
        return "[" + ", ".join(_value(x, names, block_size) for x in v) + "]"
    return repr(v)


def _call(op: str, args: Sequence[Any], names: _HashNames, block_size: int) -> str:
    operation = OPERATIONS.get(op)
    params = operation.params if operation is not None else tuple(f"arg{i}" for i in range(len(args)))
    shown = [f"{p}={_value(a, names, block_size)}" for p, a in zip(params, args)]
    if operation is not None:  # trailing arguments at their usual values say nothing (the entry's quiet tail)
        shown = shown[: operation.wording.shown_args(args)]
    return f"{op}({', '.join(shown)})"


def _rid(v: Any) -> str:
    if isinstance(v, dict) and set(v) == {"request"}:
        return str(v["request"]["request_id"] or "''")
    return str(v)


def _op_words(op: str, args: Sequence[Any], names: _HashNames) -> str:
    """What the operation asks, in a sentence (its entry's words; an operation the table lacks: its name)."""
    operation = OPERATIONS.get(op)
    if operation is None:
        return f"{op}."
    text = CallText(operation.params, args, lambda v: _value(v, names, 1), _rid)
    return operation.wording.asks(text)


def _result_words(op: str | None, o: Mapping[str, Any] | None) -> str:
    """What one side did, in words."""
    if o is None:
        return "unknown"
    if "hung" in o:
        return f"hung: {o['hung']}"
    if "crash" in o:
        return f"crashed: {o['crash']}"
    if "error" in o:
        return f"raised {o['error']}: {o.get('message', '')}".rstrip(": ")
    r = o.get("result")
    if isinstance(r, dict) and "malformed" in r:
        return f"returned a malformed value ({r['malformed']})"
    operation = OPERATIONS.get(op) if op is not None else None
    words = operation.wording.answer(r) if operation is not None and _in_normal_form(operation, r) else None
    if words is not None:
        return words
    return "done" if r is None else repr(r)


def _in_normal_form(operation: Operation, result: Any) -> bool:
    """Whether a recorded result has the shape the operation returns (a trace's outcomes are not trusted)."""
    if operation.normalize is None:
        return True
    try:
        operation.normalize(result)
    except BadResult:
        return False
    return True


# What of a stored event the page shows, and so compares: its keys and parent (the rest may be unreported).
_UNSHOWN = tuple(f.name for f in fields(BlockStored) if f.name not in ("block_hashes", "parent_block_hash"))


def _same_events(spec: Mapping[str, Any] | None, impl: Mapping[str, Any] | None, names: _HashNames) -> bool:
    """Whether the sides published the same events, compared as the lock-step core compares them
    (`same_events`: a run of removals in any order), each hash as its name on the page."""

    def named(o: Mapping[str, Any] | None, name: Callable[[str], str]) -> tuple[KVCacheEvent, ...]:
        events = tuple(event_from_json(e) for e in (o or {}).get("events") or [])
        renamed = events_as(events, lambda h: BlockHash(name(bytes(h).hex()).encode()))
        return tuple(comparable(e, "pool", _UNSHOWN) for e in renamed)

    return same_events(named(spec, names.of_spec), named(impl, names.of_impl))


def _events_words(o: Mapping[str, Any] | None, name: Callable[[str], str]) -> str:
    """The KV cache events one side published at the step (a trace recorded with --events), in words."""
    events = (o or {}).get("events") or []
    parts = []
    for e in events:
        keys = " ".join(name(k) for k in e.get("block_hashes", []))
        if e.get("type") == "BlockStored":
            parent = e.get("parent_block_hash")
            parts.append(f"stored {keys or '(no block)'} under {'-' if parent is None else name(parent)}")
        elif e.get("type") == "BlockRemoved":
            parts.append(f"removed {keys}")
        else:
            parts.append("cleared")
    return f"; published: {', '.join(parts)}" if parts else ""


# --- the failure --------------------------------------------------------------------------


def _failed_rule(failure: Mapping[str, Any], step: Mapping[str, Any] | None) -> tuple[str, str, str]:
    """(name, label, plain words) of the rule the failure broke."""
    kind = FailureKind(failure["kind"]) if failure.get("kind") else None
    inv = failure.get("invariant")
    if inv and inv in _NAMED_RULES:
        return str(inv), str(inv), _NAMED_RULES[str(inv)]
    by_kind = {
        FailureKind.CRASHED: "no_crash",
        FailureKind.HUNG: "no_hang",
        FailureKind.SPEC: "spec_holds",
        FailureKind.LIMIT: "kvspec_can_run",
    }
    if kind in by_kind:
        key = by_kind[kind]
    elif step is not None and not _same_outcome(step["op"], step["spec_outcome"], step["impl_outcome"]):
        key = "same_result"
    elif str(failure.get("message", "")).startswith("published "):  # the lock-step core's events divergence
        key = "same_events"
    elif str(failure.get("message", "")).startswith("the hit statistics differ"):
        key = "same_statistics"
    elif step is not None and step["spec_outcome"] is not None and "error" in step["spec_outcome"]:
        key = "rejected_call_changes_nothing"
    else:
        key = "state_equals_spec"
    label, words = RULES[key]
    return key, label, words


def _config_line(doc: Mapping[str, Any]) -> str:
    c = doc["config"]
    parts = [f"{c['level']} level", f"num_gpu_blocks={c['num_gpu_blocks']} (block 0 is the null block)"]
    if c["level"] == "manager" or doc["kind"] == "walkthrough":
        parts.append(f"block_size={c['block_size']}")
    parts += [f"caching {'on' if c['enable_caching'] else 'off'}", f"profile {c['profile']}"]
    if c.get("groups"):  # r1#1 is r1's table in group 1; 0 in a table: a position the group no longer reads
        parts.append(f"KV cache groups {c['groups']} (r#g: a request's table in group g; 0: a skipped position)")
    if doc.get("impl") and doc["kind"] == "trace":
        parts.append(f"implementation {doc['impl']}")
    return ", ".join(parts)


def build_view(doc: Mapping[str, Any]) -> dict[str, Any]:
    """The page's data for a source document (`trace_to_page_data`, `walkthrough_to_page_data`).

    Args:
        doc: the source document.

    Returns:
        A plain JSON object: title, configuration line, sides, hash names and
        colours, the failure (rule in words, corrupt blocks) and per step each
        side's state, changed blocks, differences, the call and results in words.

    Raises:
        ValueError: the steps are not numbered 0, 1, 2, ... in order.
    """
    steps_in = list(doc["steps"])
    if [s["index"] for s in steps_in] != list(range(len(steps_in))):
        got = [s["index"] for s in steps_in]
        raise ValueError(f"steps must be numbered 0..{len(steps_in) - 1} in order; got {got}")
    names = _name_hashes(doc)
    bs = int(doc["config"]["block_size"])
    has_impl = any(s["impl"] is not None or s["impl_outcome"] is not None for s in steps_in)
    failure_in: Mapping[str, Any] | None = doc.get("failure")
    bad = int(failure_in.get("step", -1)) if failure_in else -1
    states = [(_state(s["spec"], names.of_spec), _state(s["impl"], names.of_impl)) for s in steps_in]
    steps = [_view_step(i, s, states, names, bs, has_impl, bad) for i, s in enumerate(steps_in)]
    failure = _view_failure(failure_in, steps_in, bad) if failure_in else None
    colours = {}
    for i, n in enumerate(names.all_names()):
        fill, edge = _colour(i)
        colours[n] = {"fill": fill, "edge": edge}
    title, sides = _title_and_sides(doc, has_impl, bs)
    notices = _recorded_spec_notice(doc) + (_divergence_notices(steps_in, steps, failure) if has_impl else [])
    return {
        "kvspec_page": PAGE_FORMAT,
        "kind": doc["kind"],
        "title": title,
        "config_line": _config_line(doc),
        "level": doc["config"]["level"],
        "verdict": doc.get("verdict") or (Verdict.DIVERGES.value if failure else None),
        "sides": sides,
        "hash_colours": colours,
        "failure": failure,
        "notices": notices,
        "start_step": bad if failure is not None and 0 <= bad < len(steps) else 0,
        "requests": [
            [name, "|".join(" ".join(str(t) for t in tokens[i : i + bs]) for i in range(0, len(tokens), bs))]
            for name, tokens in (doc.get("requests") or {}).items()
        ],
        "steps": steps,
    }


def _view_step(
    i: int,
    s: Mapping[str, Any],
    states: Sequence[tuple[Any, Any]],
    names: _HashNames,
    bs: int,
    has_impl: bool,
    bad: int,
) -> dict[str, Any]:
    """One step of the page: both states, what changed, what differs, the call and results in words."""
    base = s["base"] if s["base"] is not None else (i - 1 if i > 0 else None)
    spec_state, impl_state = states[i]
    before = states[base] if base is not None else (None, None)
    op = s["op"]
    both = has_impl and spec_state is not None and impl_state is not None
    differences = _differences(spec_state if both else None, impl_state)
    impl_outcome = s["impl_outcome"]
    if (
        op is not None
        and impl_outcome is not None
        and (
            not _same_outcome(op, s["spec_outcome"], impl_outcome)
            or not _same_events(s["spec_outcome"], impl_outcome, names)
        )
    ):
        differences["fields"].insert(0, "result")
    call, words, caption = _step_text(i, s, names, bs)
    return {
        "index": i,
        "op": op,
        "caption": caption,
        "call": call,
        "words": words,
        "base": base,
        "spec": spec_state,
        "impl": impl_state,
        "spec_result": None
        if op is None
        else _result_words(op, s["spec_outcome"]) + _events_words(s["spec_outcome"], names.of_spec),
        "impl_result": None
        if op is None or impl_outcome is None
        else _result_words(op, impl_outcome) + _events_words(impl_outcome, names.of_impl),
        "spec_recomputed": bool(s.get("spec_recomputed")),
        "changed": {"spec": _changed(before[0], spec_state), "impl": _changed(before[1], impl_state)},
        "differences": differences,
        "evicted": _evicted(before, states[i]),
        "computed_tokens": dict(s.get("computed_tokens") or {}),
        "is_failure": i == bad,
    }


def _step_text(i: int, s: Mapping[str, Any], names: _HashNames, bs: int) -> tuple[str | None, str | None, str]:
    """The step's call, what it asks in words (its operation's entry), and its caption."""
    op = s["op"]
    if op is None:
        caption = s["caption"] or (
            "initial state: every block but the null block is free, in id order" if i == 0 else f"step {i}"
        )
        return None, None, caption
    call = _call(op, s["args"], names, bs)
    return call, _op_words(op, s["args"], names), s["caption"] or call


def _evicted(before: Sequence[Any], after: Sequence[Any]) -> dict[str, list[str]]:
    """Per side, the hash names the step dropped from the hash table."""
    return {
        side: sorted(
            {e[0] for e in (before[k] or {}).get("hash_table", [])}
            - {e[0] for e in (after[k] or {}).get("hash_table", [])},
            key=_natural,
        )
        for k, side in ((0, "spec"), (1, "impl"))
    }


def _view_failure(failure_in: Mapping[str, Any], steps_in: Sequence[Mapping[str, Any]], bad: int) -> dict[str, Any]:
    """The failure as the page states it: the rule in words, and the blocks whose memory is wrong."""
    at = steps_in[bad] if 0 <= bad < len(steps_in) else None
    rule_name, label, words = _failed_rule(failure_in, at)
    message = str(failure_in.get("message", ""))
    corrupt = [int(b) for b in _CORRUPT_BLOCK.findall(message)] if rule_name == "hit_content_intact" else []
    return {
        "step": bad,
        "kind": failure_in.get("kind"),
        "op": failure_in.get("op"),
        "message": message,
        "rule_name": rule_name,
        "rule_label": label,
        "rule": words,
        "corrupt_blocks": corrupt,
    }


# --- what the file records, against what kvspec computes -----------------------------------

# The rules a recorded divergence can only have broken where the recorded sides differ: the result, the
# state, and the invariants (the spec's state satisfies them all, so a state equal to it does too).
_RECORD_RULES = {"same_result", "state_equals_spec", "rejected_call_changes_nothing"} | {i.name for i in INVARIANTS}

_NOT_CHECKED = "kvspec view runs the spec but not the implementation; `kvspec replay` checks the trace again"


def _recorded_spec_notice(doc: Mapping[str, Any]) -> list[str]:
    """The page's line when the file's recorded spec side is not what the spec computes (the source says where)."""
    differs = doc.get("spec_recorded_differs")
    if not differs:
        return []
    what, verb = " and ".join(differs["what"]), "differ" if len(differs["what"]) > 1 else "differs"
    return [
        f"This trace's recorded spec {what} at step {differs['step']} {verb} from what the spec computes: the file "
        "was edited or written by another kvspec version. The spec's side drawn here is the computed one."
    ]


def _visible_differences(s: Mapping[str, Any], step: Mapping[str, Any]) -> list[str]:
    """What differs between the sides at a step, from the record alone: the result and the state fields.

    Empty where more than the record decides (a caller mistake, judged by the adapter's declared reaction)
    and where the implementation's side is not recorded. Events are left out: a run of removals may come in
    any order.
    """
    if s["op"] is None or s.get("mistake") or s["impl_outcome"] is None:
        return []
    fields = [f for f in step["differences"]["fields"] if f != "result"]
    return fields if _same_outcome(s["op"], s["spec_outcome"], s["impl_outcome"]) else ["result", *fields]


def _divergence_notices(
    steps_in: Sequence[Mapping[str, Any]], steps: Sequence[Mapping[str, Any]], failure: Mapping[str, Any] | None
) -> list[str]:
    """The page's lines where the recorded first divergence is not where the recorded sides say it is."""
    bad = failure["step"] if failure is not None else None
    first = next(((i, d) for i, s in enumerate(steps_in) if (d := _visible_differences(s, steps[i]))), None)
    if bad is not None and not 0 <= bad < len(steps):
        return [f"This trace records its first divergence at step {bad}, a step it does not have; {_NOT_CHECKED}."]
    if first is not None and (bad is None or first[0] < bad):
        recorded = "no divergence" if bad is None else f"its first divergence at step {bad}"
        return [
            f"The implementation's side as recorded already differs from the spec's at step {first[0]} "
            f"({', '.join(first[1])}), but this trace records {recorded}; {_NOT_CHECKED}."
        ]
    if failure is None or bad is None or failure["rule_name"] not in _RECORD_RULES:
        return []
    s, step = steps_in[bad], steps[bad]
    if s["op"] is not None and step["impl"] is not None and not step["differences"]["fields"]:
        return [
            f"This trace records a divergence at step {bad} ({failure['rule_label']}), but there the "
            f"implementation's recorded result and state equal the spec's; {_NOT_CHECKED}."
        ]
    return []


def _title_and_sides(doc: Mapping[str, Any], has_impl: bool, bs: int) -> tuple[str, list[dict[str, str]]]:
    if doc["kind"] == "walkthrough":
        title = f"Seed 000's walkthrough: {doc['config']['num_gpu_blocks'] - 1} blocks of {bs} tokens"
        return title, [{"key": "spec", "label": f"the {doc.get('impl') or 'reference'} model"}]
    beside = doc.get("beside")  # kvspec diff's witness: the side that follows the spec, the side that leaves it
    if isinstance(beside, Mapping) and has_impl:
        follows, leaves = str(beside.get("follows", "")), str(beside.get("leaves", ""))
        title = f"kvspec diff: {beside.get('a', '')} beside {beside.get('b', '')}"
        return title, [
            {"key": "spec", "label": f"{follows} (follows the spec: its replay is in this state at every step)",
             "short": follows},
            {"key": "impl", "label": f"{leaves} (leaves the spec)", "short": leaves},
        ]  # fmt: skip
    title = f"kvspec trace of {doc['impl']}" if doc.get("impl") else "kvspec trace"
    sides = [{"key": "spec", "label": "spec (computed: the steps run through the spec)", "short": "spec"}]
    if has_impl:
        label = f"implementation{': ' + doc['impl'] if doc.get('impl') else ''} (as the trace records it)"
        sides.append({"key": "impl", "label": label, "short": "implementation"})
    return title, sides
