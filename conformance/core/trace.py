"""Traces: one conformance example as JSON lines, written, read back and replayed.

A trace is what a failure is reported as and what `kvspec replay` runs. It is
plain JSON lines so that it survives a crash half-way (every line is complete
on its own), diffs well, and can be read by tools in any language:

- line 1, the header: `{"kvspec_trace": 1, "level": ..., "config": {...}, "impl": ...}`,
  the `AdapterConfig` the example was built with;
- one line per step, numbered from 1: `{"step", "op", "args", "spec", "impl",
  "spec_snapshot", "impl_snapshot"}`, where `spec` and `impl` are outcomes
  (`{"result": ...}`, `{"error": "DoubleFree", "message": ...}`, `{"crash": ...}`
  or `{"hung": ...}`) and a snapshot is null where it is unknown;
- optionally a last line `{"verdict": ..., "failure": {...}}`.

Values that JSON lacks are tagged: bytes as `{"bytes": "<hex>"}`, a request as
`{"request": {...}}`. Replay needs only the header and each step's `op` and
`args`; outcomes and snapshots are there for people (the story) and are
recomputed, never trusted, when a trace is replayed.

Design choice: a step records the operation with literal arguments (block ids,
hash values), not the rule that produced it, so a trace replays on any
implementation without Hypothesis and without this version of the machine.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvspec.conformance.core.adapter import AdapterConfig
from kvspec.conformance.core.files import read_text_file, write_whole
from kvspec.conformance.core.kv_events import event_from_json
from kvspec.conformance.core.operations import MAX_NUM_GPU_BLOCKS, OPERATIONS
from kvspec.conformance.core.results import Failure, Outcome, Verdict
from kvspec.spec import errors as spec_errors
from kvspec.spec.attention import format_groups
from kvspec.spec.errors import InvalidRequest, is_int
from kvspec.spec.hashing import HASH_FUNCTIONS, MultiModalInput
from kvspec.spec.manager import Request, check_groups
from kvspec.spec.ordering import is_profile, known_profiles
from kvspec.spec.state import BlockHash, BlockId, Snapshot

__all__ = [
    "MAX_TRACE_BYTES",
    "MAX_TRACE_NUM_GPU_BLOCKS",
    "TRACE_FORMAT",
    "MalformedTrace",
    "Outcome",
    "Trace",
    "TraceStep",
    "decode_value",
    "dumps_trace",
    "encode_value",
    "error_type",
    "read_trace",
    "snapshot_from_json",
    "snapshot_to_json",
    "write_trace",
]

TRACE_FORMAT = 1
# Bounds on what a trace may ask of kvspec, so that no file makes it run out of memory or time.
# A trace file is read whole: one of kvspec's own is a few KiB (shrunk) to tens of MiB (a kept deepest example).
MAX_TRACE_BYTES = 256 * 1024 * 1024
# The spec rebuilds its pool state (tuples of num_gpu_blocks entries) at every step: 100,000 blocks take about
# 2 s to build and milliseconds a step; a pool ten thousand times larger would take hours before the first step.
MAX_TRACE_NUM_GPU_BLOCKS = MAX_NUM_GPU_BLOCKS


class MalformedTrace(ValueError):
    """A trace file that cannot be read: names the file, the line and what is wrong there."""


def error_type(name: str) -> type[spec_errors.BlockManagerError] | None:
    """The spec error class called `name`, or None when there is none.

    >>> error_type("DoubleFree").__name__, error_type("KeyError")
    ('DoubleFree', None)
    """
    cls = getattr(spec_errors, name, None)
    if isinstance(cls, type) and issubclass(cls, spec_errors.BlockManagerError):
        return cls
    return None


@dataclass(frozen=True, slots=True)
class TraceStep:
    """One operation of a trace and, where known, what each side did."""

    index: int  # 1-based position in the trace
    op: str  # the adapter method (an entry of kvspec.conformance.core.operations.OPERATIONS)
    args: tuple[Any, ...]  # positional arguments, decoded (bytes, Request, ...)
    spec: Outcome | None = None  # the spec's outcome
    impl: Outcome | None = None  # the implementation's outcome
    spec_snapshot: Snapshot | None = None  # the spec's state after the step
    impl_snapshot: Snapshot | None = None  # the implementation's state after the step
    mistake: str | None = None  # the caller mistake the call makes ("<op>: <mistake>"), None for a valid call
    without: tuple[Any, ...] | None = None  # a mistaken call's arguments with the mistake taken out (its good part)


@dataclass(frozen=True, slots=True)
class Trace:
    """A whole example: how the adapter was built, every step, and the verdict if recorded."""

    config: AdapterConfig  # what the factory was called with
    steps: tuple[TraceStep, ...]  # in order, numbered from 1
    impl: str | None = None  # the implementation's name as given to `kvspec check`, if any
    verdict: Verdict | None = None  # when recorded
    failure: Failure | None = None  # the first failure, when the example failed


# --- values -------------------------------------------------------------------------------


def encode_value(value: Any) -> Any:
    """A value as JSON: bytes and requests tagged, tuples as lists.

    >>> encode_value((1, b"\\x01", None))
    [1, {'bytes': '01'}, None]
    """
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, bytes):
        return {"bytes": value.hex()}
    if isinstance(value, Request):
        return {
            "request": {
                "request_id": value.request_id,
                "token_ids": list(value.token_ids),
                "lora_name": value.lora_name,
                "cache_salt": value.cache_salt,
                "mm_inputs": [[m.identifier, m.offset, m.length] for m in value.mm_inputs],
                **({"num_preemptions": value.num_preemptions} if value.num_preemptions else {}),
                # only for a request with a hit limit: a trace written before it existed reads as None
                **(
                    {"prefix_cache_hit_limit": value.prefix_cache_hit_limit}
                    if value.prefix_cache_hit_limit is not None
                    else {}
                ),  # fmt: skip
            }
        }
    if isinstance(value, (list, tuple)):
        return [encode_value(v) for v in value]
    raise TypeError(f"cannot put value={value!r} of type {type(value).__name__} in a trace")


def decode_value(value: Any) -> Any:
    """The inverse of `encode_value` (lists stay lists).

    Raises:
        ValueError: a tagged value is malformed.

    >>> decode_value([1, {"bytes": "01"}])
    [1, b'\\x01']
    """
    if isinstance(value, list):
        return [decode_value(v) for v in value]
    if isinstance(value, dict):
        if set(value) == {"bytes"} and isinstance(value["bytes"], str):
            return bytes.fromhex(value["bytes"])
        if set(value) == {"request"} and isinstance(value["request"], dict):
            return _decode_request(value["request"])
        raise ValueError(f"unknown tagged value {json.dumps(value)[:80]}")
    return value


def _decode_request(r: dict[str, Any]) -> Request:
    keys = {"request_id", "token_ids", "lora_name", "cache_salt", "mm_inputs"}
    optional = {"num_preemptions", "prefix_cache_hit_limit"}  # only for a request admitted again, or limited
    if set(r) - optional != keys:
        raise ValueError(
            f"a request has the keys {sorted(keys)} (and num_preemptions, prefix_cache_hit_limit); got {sorted(r)}"
        )
    if not is_int(r.get("num_preemptions", 0)):
        raise ValueError("request num_preemptions must be an integer")
    if r.get("prefix_cache_hit_limit") is not None and not is_int(r["prefix_cache_hit_limit"]):
        raise ValueError("request prefix_cache_hit_limit must be an integer or null")
    if not isinstance(r["token_ids"], list) or not all(is_int(t) for t in r["token_ids"]):
        raise ValueError("request token_ids must be a list of integers")
    mm = r["mm_inputs"]
    if not isinstance(mm, list) or not all(
        isinstance(m, list) and len(m) == 3 and isinstance(m[0], str) and is_int(m[1]) and is_int(m[2]) for m in mm
    ):
        raise ValueError("request mm_inputs must be a list of [identifier, offset, length]")
    for name in ("lora_name", "cache_salt"):
        if r[name] is not None and not isinstance(r[name], str):
            raise ValueError(f"request {name} must be a string or null")
    return Request(
        request_id=r["request_id"],
        token_ids=tuple(r["token_ids"]),
        lora_name=r["lora_name"],
        cache_salt=r["cache_salt"],
        mm_inputs=tuple(MultiModalInput(m[0], m[1], m[2]) for m in mm),
        num_preemptions=r.get("num_preemptions", 0),
        prefix_cache_hit_limit=r.get("prefix_cache_hit_limit"),
    )


# --- snapshots ----------------------------------------------------------------------------


def snapshot_to_json(s: Snapshot) -> dict[str, Any]:
    """A snapshot as a JSON object (hashes as hex)."""
    return {
        "num_gpu_blocks": s.num_gpu_blocks,
        "enable_caching": s.enable_caching,
        "ref_cnt": [int(r) for r in s.ref_cnt],
        "block_hash": [None if h is None else bytes(h).hex() for h in s.block_hash],
        "free_queue": [int(b) for b in s.free_queue],
        "hash_to_blocks": [[bytes(h).hex(), [int(b) for b in blocks]] for h, blocks in s.hash_to_blocks],
        "block_tables": None
        if s.block_tables is None
        else [[rid, [int(b) for b in blocks]] for rid, blocks in s.block_tables],
        "quarantined": [int(b) for b in s.quarantined],
        **({"kv_groups": list(s.kv_groups)} if s.kv_groups else {}),
    }


def snapshot_from_json(obj: Any) -> Snapshot:
    """The inverse of `snapshot_to_json`.

    Raises:
        ValueError: a field is missing or has the wrong shape.
    """
    if not isinstance(obj, dict):
        raise ValueError("a snapshot must be a JSON object")
    want = {
        "num_gpu_blocks",
        "enable_caching",
        "ref_cnt",
        "block_hash",
        "free_queue",
        "hash_to_blocks",
        "block_tables",
        "quarantined",
    }
    if set(obj) - {"kv_groups"} != want:  # kv_groups: only with several KV cache groups (or one that skips)
        raise ValueError(f"a snapshot has the keys {sorted(want)} (and kv_groups); got {sorted(obj)}")
    groups = obj.get("kv_groups", [])
    if not isinstance(groups, list) or not all(isinstance(g, str) for g in groups):
        raise ValueError("snapshot kv_groups must be a list of group names")

    def ids(v: Any, what: str) -> tuple[BlockId, ...]:
        if not isinstance(v, list) or not all(is_int(b) for b in v):
            raise ValueError(f"snapshot {what} must be a list of block ids")
        return tuple(BlockId(b) for b in v)

    def digest(v: Any, what: str) -> BlockHash:
        if not isinstance(v, str):
            raise ValueError(f"snapshot {what} must be hex strings")
        return BlockHash(bytes.fromhex(v))

    if not is_int(obj["num_gpu_blocks"]) or not isinstance(obj["enable_caching"], bool):
        raise ValueError("snapshot num_gpu_blocks must be an integer and enable_caching a boolean")
    if not isinstance(obj["block_hash"], list) or not isinstance(obj["hash_to_blocks"], list):
        raise ValueError("snapshot block_hash and hash_to_blocks must be lists")
    tables = obj["block_tables"]
    if tables is not None and not (
        isinstance(tables, list) and all(isinstance(t, list) and len(t) == 2 and isinstance(t[0], str) for t in tables)
    ):
        raise ValueError("snapshot block_tables must be null or a list of [request_id, block ids]")
    for entry in obj["hash_to_blocks"]:
        if not (isinstance(entry, list) and len(entry) == 2):
            raise ValueError("snapshot hash_to_blocks entries must be [hash, block ids]")
    return Snapshot(
        num_gpu_blocks=obj["num_gpu_blocks"],
        enable_caching=obj["enable_caching"],
        ref_cnt=tuple(int(r) for r in ids(obj["ref_cnt"], "ref_cnt")),
        block_hash=tuple(None if h is None else digest(h, "block_hash") for h in obj["block_hash"]),
        free_queue=ids(obj["free_queue"], "free_queue"),
        hash_to_blocks=tuple((digest(h, "hash_to_blocks"), ids(b, "hash_to_blocks")) for h, b in obj["hash_to_blocks"]),
        block_tables=None if tables is None else tuple((rid, ids(b, "block_tables")) for rid, b in tables),
        quarantined=ids(obj["quarantined"], "quarantined"),
        kv_groups=tuple(groups),
    )


# --- writing ------------------------------------------------------------------------------


def _config_to_json(c: AdapterConfig) -> dict[str, Any]:
    return {
        "num_gpu_blocks": c.num_gpu_blocks,
        "enable_caching": c.enable_caching,
        "profile": c.profile,
        "block_size": c.block_size,
        "hash_fn": c.hash_fn,
        "seed": c.seed,
        "device": c.device,
        **({"groups": c.groups} if c.groups != "full" else {}),
        **({"events": True} if c.events else {}),
    }


def header_line(config: AdapterConfig, impl: str | None = None) -> str:
    """The first line of a trace."""
    return json.dumps(
        {"kvspec_trace": TRACE_FORMAT, "level": config.level, "config": _config_to_json(config), "impl": impl}
    )


def step_line(step: TraceStep) -> str:
    """One step as a line (no newline)."""
    return json.dumps(
        {
            "step": step.index,
            "op": step.op,
            "args": encode_value(list(step.args)),
            "spec": None if step.spec is None else step.spec.to_json(),
            "impl": None if step.impl is None else step.impl.to_json(),
            "spec_snapshot": None if step.spec_snapshot is None else snapshot_to_json(step.spec_snapshot),
            "impl_snapshot": None if step.impl_snapshot is None else snapshot_to_json(step.impl_snapshot),
            **({"mistake": step.mistake} if step.mistake else {}),
            **({"without": encode_value(list(step.without))} if step.without is not None else {}),
        }
    )


def dumps_trace(trace: Trace) -> str:
    """The whole trace as JSON-lines text."""
    lines = [header_line(trace.config, trace.impl)]
    lines += [step_line(s) for s in trace.steps]
    if trace.verdict is not None:
        failure = None if trace.failure is None else trace.failure.to_json()
        lines.append(json.dumps({"verdict": trace.verdict.value, "failure": failure}))
    return "\n".join(lines) + "\n"


def write_trace(path: str | Path, trace: Trace) -> Path:
    """Write `trace` to `path` (parents created), whole or not at all (`files.write_whole`); returns the path.

    Raises:
        OSError: it cannot be written.
    """
    return write_whole(path, dumps_trace(trace))


# --- reading ------------------------------------------------------------------------------


def _outcome(obj: Any) -> Outcome | None:
    if obj is None:
        return None
    if not isinstance(obj, dict) or len(obj) == 0:
        raise ValueError("an outcome must be an object with result, error, crash or hung")
    raised = obj.get("raised", [])
    if not (isinstance(raised, list) and all(isinstance(r, str) for r in raised)):
        raise ValueError("an outcome's raised must be a list of exception type names")
    events = obj.get("events", [])
    if not isinstance(events, list):
        raise ValueError("an outcome's events must be a list")
    extra: dict[str, Any] = {
        "replica": bool(obj.get("replica", False)),
        "raised_types": tuple(raised),
        "events": tuple(event_from_json(e) for e in events),
    }
    if "result" in obj:
        return Outcome(result=obj["result"], **extra)
    if "error" in obj:
        if not isinstance(obj["error"], str):
            raise ValueError("an outcome's error must be an error type name")
        return Outcome(error=obj["error"], message=str(obj.get("message", "")), **extra)
    if "crash" in obj:
        return Outcome(crashed=True, message=str(obj["crash"]), **extra)
    if "hung" in obj:
        return Outcome(hung=True, message=str(obj["hung"]), **extra)
    if "not_sent" in obj:
        return Outcome(not_sent=str(obj["not_sent"]), **extra)
    raise ValueError(f"unknown outcome keys {sorted(obj)}")


def _header(obj: Any) -> tuple[AdapterConfig, str | None]:
    if not isinstance(obj, dict) or "kvspec_trace" not in obj:
        raise ValueError('the first line must be the header {"kvspec_trace": 1, ...}; is this a kvspec trace?')
    if obj["kvspec_trace"] != TRACE_FORMAT:
        raise ValueError(f"trace format {obj['kvspec_trace']!r} is not supported (this kvspec reads {TRACE_FORMAT})")
    level = obj.get("level")
    if level not in ("pool", "manager"):
        raise ValueError(f"header level must be 'pool' or 'manager'; got level={level!r}")
    cfg = obj.get("config")
    if not isinstance(cfg, dict):
        raise ValueError("header config must be an object")
    _check_header_config(cfg)
    return _configured(obj, level, cfg)


def _check_header_config(cfg: dict[str, Any]) -> None:
    """Every field of a header's config present, of its type and within its range."""
    want = {"num_gpu_blocks", "enable_caching", "profile", "block_size", "hash_fn", "seed", "device"}
    missing = want - set(cfg)
    if missing:
        raise ValueError(f"header config lacks {sorted(missing)}")
    if (
        not is_int(cfg["num_gpu_blocks"])
        or not is_int(cfg["block_size"])
        or not isinstance(cfg["enable_caching"], bool)
    ):
        raise ValueError("header config num_gpu_blocks and block_size must be integers, enable_caching a boolean")
    for name in ("profile", "hash_fn", "seed"):
        if not isinstance(cfg[name], str):
            raise ValueError(f"header config {name} must be a string")
    for name in ("num_gpu_blocks", "block_size"):
        if cfg[name] < 1:
            raise ValueError(f"header config {name} must be at least 1; got {name}={cfg[name]}")
    if cfg["num_gpu_blocks"] > MAX_TRACE_NUM_GPU_BLOCKS:
        raise ValueError(
            f"header config num_gpu_blocks={cfg['num_gpu_blocks']} is more than a trace may ask for "
            f"(at most {MAX_TRACE_NUM_GPU_BLOCKS:,}: the spec rebuilds the pool's state at every step)"
        )
    if cfg["hash_fn"] not in HASH_FUNCTIONS:
        raise ValueError(f"header config hash_fn={cfg['hash_fn']!r} is not one of {', '.join(sorted(HASH_FUNCTIONS))}")
    if not is_profile(cfg["profile"]):
        raise ValueError(f"header config profile={cfg['profile']!r} is not a profile ({known_profiles()})")


def _header_groups_and_events(cfg: dict[str, Any]) -> tuple[str, bool]:
    """The header's KV cache groups in normal form and whether events were checked (older traces have neither)."""
    groups = cfg.get("groups", "full")  # traces before KV cache groups have none: one full-attention group
    try:
        groups = format_groups(check_groups(groups, cfg["block_size"])) if isinstance(groups, str) else None
    except InvalidRequest as e:
        raise ValueError(f"header config groups: {e}") from None
    if groups is None:
        raise ValueError("header config groups must be a string such as 'full,sliding:8'")
    events = cfg.get("events", False)  # traces before KV cache events were checked have none
    if not isinstance(events, bool):
        raise ValueError("header config events must be a boolean")
    return groups, events


def _configured(obj: dict[str, Any], level: Any, cfg: dict[str, Any]) -> tuple[AdapterConfig, str | None]:
    """The adapter configuration a checked header describes, and the implementation it names (if any)."""
    groups, events = _header_groups_and_events(cfg)
    impl = obj.get("impl")
    config = AdapterConfig(
        level=level,
        num_gpu_blocks=cfg["num_gpu_blocks"],
        enable_caching=cfg["enable_caching"],
        profile=cfg["profile"],
        block_size=cfg["block_size"],
        hash_fn=cfg["hash_fn"],
        seed=cfg["seed"],
        device=cfg["device"] if isinstance(cfg["device"], str) else None,
        groups=groups,
        events=events,
    )
    return config, impl if isinstance(impl, str) else None


def _step(obj: Any, expected_index: int, level: str) -> TraceStep:
    if not isinstance(obj, dict):
        raise ValueError("a step must be a JSON object")
    for key in ("step", "op", "args"):
        if key not in obj:
            raise ValueError(f"a step needs {key!r}")
    if obj["step"] != expected_index:
        raise ValueError(f"steps are numbered 1, 2, ... in order: expected step {expected_index}, got {obj['step']!r}")
    op = obj["op"]
    operation = OPERATIONS.get(op) if isinstance(op, str) else None
    if operation is None or level not in operation.levels:
        known = sorted(o.name for o in OPERATIONS.values() if level in o.levels)
        raise ValueError(f"op={op!r} is not a {level}-level operation (known: {', '.join(known)})")
    if not isinstance(obj["args"], list):
        raise ValueError("step args must be a list")
    args = _with_defaults(decode_value(obj["args"]), operation)
    if len(args) != len(operation.params):
        raise ValueError(f"{op} takes {len(operation.params)} arguments {operation.params}; got {len(args)}")
    spec_snap = obj.get("spec_snapshot")
    impl_snap = obj.get("impl_snapshot")
    mistake = obj.get("mistake")
    if mistake is not None and (not isinstance(mistake, str) or mistake.partition(": ")[2] not in operation.mistakes):
        raise ValueError(f"mistake={mistake!r} is not a caller mistake of {op} (see `kvspec errors`)")
    return TraceStep(
        index=expected_index,
        op=op,
        args=tuple(args),
        spec=_outcome(obj.get("spec")),
        impl=_outcome(obj.get("impl")),
        spec_snapshot=None if spec_snap is None else snapshot_from_json(spec_snap),
        impl_snapshot=None if impl_snap is None else snapshot_from_json(impl_snap),
        mistake=mistake,
        without=_without(obj.get("without"), operation),
    )


def _with_defaults(args: list[Any], operation: Any) -> list[Any]:
    """A step's arguments, with the defaults of trailing parameters a trace written before them leaves out."""
    missing = len(operation.params) - len(args)
    if 0 < missing <= len(operation.defaults):
        return args + list(operation.defaults[len(operation.defaults) - missing :])
    return args


def _without(value: Any, operation: Any) -> tuple[Any, ...] | None:
    if value is None:
        return None
    args = _with_defaults(decode_value(value), operation) if isinstance(value, list) else value
    if not isinstance(args, list) or len(args) != len(operation.params):
        raise ValueError(f"a step's without must list {len(operation.params)} arguments {operation.params}")
    return tuple(args)


def _verdict_line(obj: dict[str, Any]) -> tuple[Verdict, Failure | None]:
    try:
        verdict = Verdict(obj["verdict"])
    except ValueError:
        raise ValueError(f"verdict must be one of {[v.value for v in Verdict]}; got {obj['verdict']!r}") from None
    f = obj.get("failure")
    if f is not None and not isinstance(f, dict):
        raise ValueError("failure must be an object or null")
    return verdict, None if f is None else Failure.from_json(f)


def parse_trace(lines: Iterable[str], source: str = "<trace>") -> Trace:
    """Parse JSON-lines text into a `Trace`.

    Raises:
        MalformedTrace: naming the source, the line number and the problem.
    """
    config: AdapterConfig | None = None
    impl: str | None = None
    steps: list[TraceStep] = []
    verdict: Verdict | None = None
    failure: Failure | None = None
    for lineno, raw in enumerate(lines, start=1):
        text = raw.strip()
        if not text:
            continue
        where = f"{source}:{lineno}"
        if verdict is not None:
            raise MalformedTrace(f"{where}: nothing may follow the verdict line")
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise MalformedTrace(f"{where}: not JSON ({e.msg} at column {e.colno})") from None
        except RecursionError:
            raise MalformedTrace(f"{where}: nested deeper than any trace of kvspec's") from None
        try:
            if config is None:
                config, impl = _header(obj)
            elif isinstance(obj, dict) and "verdict" in obj:
                verdict, failure = _verdict_line(obj)
            else:
                steps.append(_step(obj, len(steps) + 1, config.level))
        except (ValueError, TypeError, KeyError) as e:
            raise MalformedTrace(f"{where}: {e}") from None
        except RecursionError:
            raise MalformedTrace(f"{where}: a value nested deeper than any trace of kvspec's") from None
    if config is None:
        raise MalformedTrace(f"{source}: empty file; a trace starts with a header line")
    return Trace(config=config, steps=tuple(steps), impl=impl, verdict=verdict, failure=failure)


def read_trace(path: str | Path) -> Trace:
    """Read a trace file.

    Raises:
        MalformedTrace: the file is missing, unreadable, or not a well-formed trace.
    """
    p = Path(path)
    try:
        size = p.stat().st_size
        if size > MAX_TRACE_BYTES:
            raise MalformedTrace(
                f"{p}: {size / 2**20:.0f} MiB is more than kvspec reads ({MAX_TRACE_BYTES // 2**20} MiB at most); "
                "a failure's shrunk trace is a few KiB"
            )
        text = read_text_file(p, MAX_TRACE_BYTES)
    except FileNotFoundError:
        raise MalformedTrace(f"{p}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise MalformedTrace(f"{p}: cannot read it ({e})") from None
    return parse_trace(text.splitlines(), str(p))


def args_dict(op: str, args: Sequence[Any]) -> dict[str, Any]:
    """Arguments by parameter name, for display."""
    operation = OPERATIONS.get(op)
    return dict(zip(operation.params if operation is not None else (), args))
