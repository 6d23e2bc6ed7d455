"""KV cache events in the harness: their JSON form, what is compared at each level, and a short text.

The spec's events (kvspec.spec.events) are what an adapter's `take_events()`
returns: the events its implementation published since the last call, in
the spec's types, keys as its hash table holds them. The lock-step core
drains them after every call and compares them with the spec's, hash values
renamed as for the state (kvspec.conformance.core.hash_names).

What is compared:
- at the pool level, the kind, the keys and the parent: the spec's
  `cache_full_blocks` is told no request, so tokens, block size, LoRA and
  extra keys are not pool-level facts;
- at the request level, every field, less those the adapter declares its
  implementation does not report (`not_applicable["BlockStored.<field>"]`);
- a run of consecutive `BlockRemoved` events as a multiset: removals
  commute (a router holds the same keys after them in any order), and
  vLLM evicts by id in the order of a set, not of the call.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import fields, replace
from typing import Any

from kvspec.spec.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from kvspec.spec.state import BlockHash

__all__ = [
    "EVENT_FIELDS",
    "MalformedEvents",
    "comparable",
    "describe_events",
    "event_from_json",
    "event_to_json",
    "events_as",
    "same_events",
    "take_events_result",
]

# The BlockStored fields an adapter may declare its implementation does not report.
EVENT_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(BlockStored) if f.name not in ("block_hashes",))
_REQUEST_FACTS = ("token_ids", "block_size", "lora_name", "extra_keys", "group_idx")


class MalformedEvents(ValueError):
    """An adapter's `take_events()` returned something that is not a list of the spec's events."""


def take_events_result(value: Any) -> tuple[KVCacheEvent, ...]:
    """What `take_events()` returned, checked: a sequence of spec events with bytes keys.

    Raises:
        MalformedEvents: naming what is wrong.
    """
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise MalformedEvents(f"take_events() returned {type(value).__name__}, not a list of events")
    out = []
    for e in value:
        if not isinstance(e, (BlockStored, BlockRemoved, AllBlocksCleared)):
            raise MalformedEvents(
                f"take_events() returned a {type(e).__name__}; events are kvspec.spec.events "
                "BlockStored, BlockRemoved or AllBlocksCleared"
            )
        keys = getattr(e, "block_hashes", ())
        parent = getattr(e, "parent_block_hash", None)
        if not all(isinstance(k, bytes) for k in keys) or not (parent is None or isinstance(parent, bytes)):
            raise MalformedEvents(f"an event's keys must be bytes, as the hash table's: {e!r}")
        out.append(e)
    return tuple(out)


def comparable(event: KVCacheEvent, level: str, not_reported: Iterable[str] = ()) -> KVCacheEvent:
    """The part of an event compared at `level`: the rest set to its default (module doc)."""
    if not isinstance(event, BlockStored):
        return event
    dropped = set(not_reported) | (set(_REQUEST_FACTS) if level == "pool" else set())
    defaults: dict[str, Any] = {f.name: f.default for f in fields(BlockStored) if f.name in dropped}
    return replace(event, **defaults) if defaults else event


def events_as(events: Sequence[KVCacheEvent], rename: Callable[[BlockHash], BlockHash]) -> tuple[KVCacheEvent, ...]:
    """The events with every key (and parent) renamed."""
    out: list[KVCacheEvent] = []
    for e in events:
        if isinstance(e, BlockStored):
            parent = None if e.parent_block_hash is None else rename(e.parent_block_hash)
            out.append(replace(e, block_hashes=tuple(rename(k) for k in e.block_hashes), parent_block_hash=parent))
        elif isinstance(e, BlockRemoved):
            out.append(replace(e, block_hashes=tuple(rename(k) for k in e.block_hashes)))
        else:
            out.append(e)
    return tuple(out)


def same_events(a: Sequence[KVCacheEvent], b: Sequence[KVCacheEvent]) -> bool:
    """Whether two streams are the same, each run of removals compared as a multiset (module doc).

    >>> r = lambda k: BlockRemoved((BlockHash(k),))
    >>> same_events([r(b"a"), r(b"b")], [r(b"b"), r(b"a")]), same_events([r(b"a")], [r(b"a"), r(b"a")])
    (True, False)
    """
    return _runs(a) == _runs(b)


def _runs(events: Sequence[KVCacheEvent]) -> list[Any]:
    out: list[Any] = []
    for e in events:
        if isinstance(e, BlockRemoved) and out and isinstance(out[-1], Counter):
            out[-1][e] += 1
        else:
            out.append(Counter([e]) if isinstance(e, BlockRemoved) else e)
    return out


def describe_events(events: Sequence[KVCacheEvent], name: Callable[[BlockHash], str]) -> str:
    """The events in one line, keys by name: `stored h1 h2 (parent h0, group 1); removed h3; cleared`."""
    if not events:
        return "none"
    parts = []
    for e in events:
        if isinstance(e, BlockStored):
            parent = "-" if e.parent_block_hash is None else name(e.parent_block_hash)
            keys = " ".join(name(k) for k in e.block_hashes) or "(no block)"
            facts = [f"parent {parent}"]
            if e.group_idx:
                facts.append(f"group {e.group_idx}")
            if e.token_ids is not None:
                facts.append(f"tokens {list(e.token_ids)}")
            if e.lora_name is not None:
                facts.append(f"LoRA {e.lora_name}")
            if e.extra_keys is not None:
                facts.append(f"extra keys {[list(k) if k else None for k in e.extra_keys]}")
            parts.append(f"stored {keys} ({', '.join(facts)})")
        elif isinstance(e, BlockRemoved):
            parts.append("removed " + " ".join(name(k) for k in e.block_hashes))
        else:
            parts.append("cleared")
    return "; ".join(parts)


# --- JSON ---------------------------------------------------------------------------------


def event_to_json(e: KVCacheEvent) -> dict[str, Any]:
    """One event as a JSON object (keys as hex)."""
    if isinstance(e, BlockStored):
        return {
            "type": "BlockStored",
            "block_hashes": [bytes(k).hex() for k in e.block_hashes],
            "parent_block_hash": None if e.parent_block_hash is None else bytes(e.parent_block_hash).hex(),
            "token_ids": None if e.token_ids is None else list(e.token_ids),
            "block_size": e.block_size,
            "lora_name": e.lora_name,
            "extra_keys": None if e.extra_keys is None else [None if k is None else list(k) for k in e.extra_keys],
            "group_idx": e.group_idx,
            "medium": e.medium,
        }
    if isinstance(e, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": [bytes(k).hex() for k in e.block_hashes], "medium": e.medium}
    return {"type": "AllBlocksCleared", "medium": e.medium}


def event_from_json(obj: Any) -> KVCacheEvent:
    """The inverse of `event_to_json`.

    Raises:
        ValueError: the object is not an event of a known type, or a field has the wrong shape.
    """
    if not isinstance(obj, Mapping) or obj.get("type") not in ("BlockStored", "BlockRemoved", "AllBlocksCleared"):
        raise ValueError("an event must be an object whose type is BlockStored, BlockRemoved or AllBlocksCleared")
    medium = obj.get("medium", "GPU")
    if not isinstance(medium, str):
        raise ValueError("an event's medium must be a string")
    if obj["type"] == "AllBlocksCleared":
        return AllBlocksCleared(medium)
    keys = _hex_list(obj.get("block_hashes"))
    if obj["type"] == "BlockRemoved":
        return BlockRemoved(keys, medium)
    parent = obj.get("parent_block_hash")
    tokens = obj.get("token_ids")
    extra = obj.get("extra_keys")
    if tokens is not None and not (isinstance(tokens, list) and all(isinstance(t, int) for t in tokens)):
        raise ValueError("a BlockStored's token_ids must be null or a list of integers")
    if extra is not None and not (isinstance(extra, list) and all(k is None or isinstance(k, list) for k in extra)):
        raise ValueError("a BlockStored's extra_keys must be null or a list of null or lists")
    group = obj.get("group_idx", 0)
    size = obj.get("block_size")
    lora = obj.get("lora_name")
    if not isinstance(group, int) or not (size is None or isinstance(size, int)):
        raise ValueError("a BlockStored's group_idx and block_size must be integers")
    if not (lora is None or isinstance(lora, str)):
        raise ValueError("a BlockStored's lora_name must be null or a string")
    return BlockStored(
        block_hashes=keys,
        parent_block_hash=None if parent is None else _hex(parent),
        token_ids=None if tokens is None else tuple(tokens),
        block_size=size,
        lora_name=lora,
        extra_keys=None if extra is None else tuple(None if k is None else tuple(_untuple(k)) for k in extra),
        group_idx=group,
        medium=medium,
    )


def _untuple(values: list[Any]) -> list[Any]:
    """JSON lists back to the tuples an extra key holds ((identifier, offset) pairs)."""
    return [tuple(v) if isinstance(v, list) else v for v in values]


def _hex(value: Any) -> BlockHash:
    if not isinstance(value, str):
        raise ValueError("an event's keys must be hex strings")
    try:
        return BlockHash(bytes.fromhex(value))
    except ValueError:
        raise ValueError(f"an event's key {value[:16]!r} is not hex") from None


def _hex_list(value: Any) -> tuple[BlockHash, ...]:
    if not isinstance(value, list):
        raise ValueError("an event's block_hashes must be a list of hex strings")
    return tuple(_hex(v) for v in value)
