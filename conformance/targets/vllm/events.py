"""vLLM's KV cache events and prefix-cache hit statistics, as the spec's, and what each release publishes.

From 0.9.0 a vLLM ``BlockPool`` built with ``enable_kv_cache_events=True``
queues the events of ``vllm/distributed/kv_events.py`` (``BlockStored``,
``BlockRemoved``, ``AllBlocksCleared``; msgspec structs) and hands them out
with ``take_events()``; its ``KVCacheManager`` passes them on. Both vLLM
adapters (``adapter.py`` at the pool level, ``manager.py`` at the request
level) drain that queue after every call and give the harness the spec's
event types (kvspec.spec.events) through the translation here: each key
folded into the adapter's own key form (what its snapshot holds: the bare
hash value and the KV cache group, ``fold``), every field the release
publishes copied, every field it does not left at the spec's default and
declared (``not_applicable["BlockStored.<field>"]``, with why).

What a release publishes is a declared fact per release range
(``EventFacts``, change points as in ``releases.py``), read from each
release's ``kv_events.py`` and ``block_pool.py`` and checked by the tests on
every release in light mode, never measured while a campaign runs:

- events at all: from 0.9.0 (the ``enable_kv_cache_events`` constructor flag);
- the keys: before 0.10.2 the key's own int (``hash_value``); from 0.10.2 the
  digest, which ``maybe_convert_block_hash`` publishes as its last 8 bytes
  read as an int while ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` is 1, the
  default (a router then holds 64-bit keys). The adapter keeps the default,
  as a deployment does, and maps each int back to the digest it names
  through every digest vLLM was given or computed (``remember``); two such
  digests with the same last 8 bytes would make the stream ambiguous, and
  translation then stops with ``AmbiguousEventKey`` instead of guessing;
- ``medium`` from 0.10.2, ``lora_name`` from 0.14.0 (before, ``lora_id``,
  the adapter's int id), ``extra_keys`` from 0.17.0 (with a multimodal input
  as its bare identifier until 0.19.0, where the spec and later releases
  publish ``(identifier, offset)``), ``group_idx`` from 0.20.0. Before 0.20 a
  release's engine turns the hybrid KV cache manager off when events are on
  (``block_pool.py``: "we disable hybrid kv cache manager when kv cache event
  is enabled, so there is only one group"), so its events name no group and,
  with several groups, the adapter publishes none (``groups_in_events``).

Hit statistics (``vllm/v1/metrics/stats.py``'s ``PrefixCacheStats``): a
manager built with ``log_stats=True`` keeps one interval's counters, which
``make_prefix_cache_stats()`` hands out and resets; ``StatsSum`` adds the
intervals up into the spec's counters since construction (a ``reset`` flag
per interval counts one reset: the adapter drains after every call, and a
call resets at most once).

Design choice: translate, never repair. An event is passed on as vLLM
published it (its order, its parent, one ``BlockRemoved`` per key, a key
removed while another block still holds it), so the harness's comparison and
the router's mirror rules see vLLM's stream; the rejected alternative, an
adapter that rebuilt the stream from vLLM's state, would check the adapter.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from kvspec.conformance.targets.vllm.releases import since, version_key
from kvspec.spec.events import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from kvspec.spec.state import BlockHash
from kvspec.spec.stats import CacheCounters, PrefixCacheStats

__all__ = [
    "FIRST_RELEASE_WITH_EVENTS",
    "AmbiguousEventKey",
    "EventFacts",
    "EventTranslator",
    "PoolEventRequest",
    "StatsSum",
    "event_facts",
    "fields_not_published",
]

FIRST_RELEASE_WITH_EVENTS = "0.9.0"

HashForm = Literal["hash_value", "digest"]

# The spec's BlockStored fields beyond its keys, and the first release that publishes each.
_FIELD_SINCE: dict[str, str] = {
    "parent_block_hash": "0.9.0",
    "token_ids": "0.9.0",
    "block_size": "0.9.0",
    "medium": "0.10.2",
    "lora_name": "0.14.0",
    "extra_keys": "0.17.0",
    "group_idx": "0.20.0",
}
_HASH_FORM: list[tuple[str, HashForm]] = [("0.9.0", "hash_value"), ("0.10.2", "digest")]
# Why a field is missing or differs, for the declaration the summary lists.
_WHY_NOT_PUBLISHED: dict[str, str] = {
    "medium": "its events carry no medium (added in 0.10.2; also absent from its BlockRemoved and AllBlocksCleared)",
    "lora_name": "its BlockStored names a LoRA adapter by lora_id, the int id, not by name (lora_name added in 0.14.0)",
    "extra_keys": "its BlockStored carries no extra keys (added in 0.17.0)",
    "group_idx": "its events name no KV cache group (added in 0.20.0)",
}
_EXTRA_KEYS_AS_SPEC = "0.19.0"


class AmbiguousEventKey(ValueError):
    """A 64-bit event key names two digests the adapter knows: which one vLLM meant cannot be told."""


@dataclass(frozen=True, slots=True)
class EventFacts:
    """What one release's KV cache events carry (declared; the module doc says where each fact is read).

    Attributes:
        version: The release.
        has_events: ``BlockPool`` takes ``enable_kv_cache_events`` (0.9.0 on).
        published: The spec's ``BlockStored`` fields (besides its keys) the release publishes.
        hash_form: ``"hash_value"``: a key's own int; ``"digest"``: the digest, or by default its last
            8 bytes as an int.
        extra_keys_as_spec: Its published extra keys have the spec's untagged form (0.19.0 on).
        groups_in_events: Its events name the KV cache group (0.20.0 on); before, its engine runs one
            group when events are on.
    """

    version: str
    has_events: bool
    published: tuple[str, ...]
    hash_form: HashForm | None
    extra_keys_as_spec: bool
    groups_in_events: bool


def event_facts(version: str) -> EventFacts:
    """The declared event facts of a release (any release string; a newer one gets the newest facts).

    >>> event_facts("0.9.2").published, event_facts("0.8.5").has_events
    (('parent_block_hash', 'token_ids', 'block_size'), False)
    """
    key = version_key(version)
    has = key >= version_key(FIRST_RELEASE_WITH_EVENTS)
    published = tuple(f for f, first in _FIELD_SINCE.items() if has and key >= version_key(first))
    return EventFacts(
        version=version,
        has_events=has,
        published=published,
        hash_form=since(version, _HASH_FORM) if has else None,
        extra_keys_as_spec=has and key >= version_key(_EXTRA_KEYS_AS_SPEC),
        groups_in_events="group_idx" in published,
    )


def fields_not_published(facts: EventFacts, label: str) -> dict[str, str]:
    """``not_applicable`` entries (``"BlockStored.<field>"`` -> why) for what the release does not publish as the spec.

    >>> sorted(fields_not_published(event_facts("0.17.0"), "vllm==0.17.0"))
    ['BlockStored.extra_keys', 'BlockStored.group_idx']
    """
    out: dict[str, str] = {}
    for name in _FIELD_SINCE:
        if name not in facts.published:
            out[f"BlockStored.{name}"] = f"{label}: {_WHY_NOT_PUBLISHED[name]}"
    if "extra_keys" in facts.published and not facts.extra_keys_as_spec:
        out["BlockStored.extra_keys"] = (
            f"{label}: its BlockStored names a multimodal input by its bare identifier, without the offset in "
            "the block the spec publishes ((identifier, offset) from 0.19.0)"
        )
    return out


def _untuple(value: Any) -> Any:
    """Lists (msgspec decodes tuples as lists) back to tuples, all the way down."""
    if isinstance(value, (list, tuple)):
        return tuple(_untuple(v) for v in value)
    return value


@dataclass(eq=False)
class EventTranslator:
    """Turns a release's published events into the spec's, keys in the adapter's form.

    Attributes:
        facts: What the release publishes.
        fold: The adapter's key for a bare hash value as vLLM keys its table (an int ``hash_value``
            before 0.10.2, digest bytes after) and a KV cache group.
    """

    facts: EventFacts
    fold: Callable[[Any, int], BlockHash]
    # From 0.10.2: whether keys must be 64-bit ints (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES on, vLLM's default)
    # or digests (off), as the release reads the setting; None: either form is taken.
    int_keys: bool | None = None
    _by_int64: dict[int, set[bytes]] = field(default_factory=dict)  # last 8 bytes as an int -> digests with them

    def remember(self, digests: Iterable[Any]) -> None:
        """Digests vLLM was given or computed, so a 64-bit event key can be mapped back to one (module doc)."""
        for d in digests:
            if isinstance(d, (bytes, bytearray)):
                digest = bytes(d)
                self._by_int64.setdefault(int.from_bytes(digest, "big") & ((1 << 64) - 1), set()).add(digest)

    def _bare(self, value: Any) -> Any:
        """vLLM's bare hash for a published key: the digest for a 64-bit int (from 0.10.2), else the value."""
        if self.facts.hash_form != "digest":
            return value
        if self.int_keys is not None and isinstance(value, int) != self.int_keys:
            # a router parses one form: a key in the other is one it cannot match
            raise ValueError(
                f"vllm=={self.facts.version} published the key {value!r} as {type(value).__name__}, but with "
                f"VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES={int(self.int_keys)} it publishes "
                f"{'64-bit ints' if self.int_keys else 'digests'}"
            )
        if not isinstance(value, int):
            return value
        found = self._by_int64.get(value)
        if not found:
            raise ValueError(
                f"vllm=={self.facts.version} published the 64-bit key {value:#018x}, the last 8 bytes of no "
                "digest it was given or computed"
            )
        if len(found) > 1:
            raise AmbiguousEventKey(
                f"vllm=={self.facts.version} published the 64-bit key {value:#018x}, the last 8 bytes of "
                f"{len(found)} digests ({', '.join(sorted(d.hex()[:16] for d in found))}...): ambiguous"
            )
        return next(iter(found))

    def key(self, value: Any, group: int) -> BlockHash:
        """The adapter's key for a published key of a group."""
        return self.fold(self._bare(value), group)

    def translate(self, events: Sequence[Any]) -> list[KVCacheEvent]:
        """The spec's events for vLLM's, in order; unpublished fields at the spec's defaults.

        Raises:
            ValueError: an event of a kind the spec has no type for, or a key that cannot be mapped back.
        """
        out: list[KVCacheEvent] = []
        published = self.facts.published
        for e in events:
            kind = type(e).__name__
            medium = getattr(e, "medium", None) if "medium" in published else None
            medium = medium if isinstance(medium, str) else MEDIUM_GPU
            group = int(getattr(e, "group_idx", None) or 0)
            if kind == "BlockStored":
                out.append(self._stored(e, group, medium))
            elif kind == "BlockRemoved":
                out.append(BlockRemoved(tuple(self.key(h, group) for h in e.block_hashes), medium))
            elif kind == "AllBlocksCleared":
                out.append(AllBlocksCleared(medium))
            else:
                raise ValueError(f"vllm=={self.facts.version} published a {kind}, an event the spec has no type for")
        return out

    def _stored(self, e: Any, group: int, medium: str) -> BlockStored:
        published = self.facts.published
        extra = e.extra_keys if "extra_keys" in published else None
        return BlockStored(
            block_hashes=tuple(self.key(h, group) for h in e.block_hashes),
            parent_block_hash=None if e.parent_block_hash is None else self.key(e.parent_block_hash, group),
            token_ids=tuple(e.token_ids),
            block_size=int(e.block_size),
            lora_name=getattr(e, "lora_name", None) if "lora_name" in published else None,
            extra_keys=None if extra is None else tuple(None if k is None else _untuple(k) for k in extra),
            group_idx=group,
            medium=medium,
        )


@dataclass(eq=False)
class PoolEventRequest:
    """The request ``cache_full_blocks`` reads at the pool level, as a vLLM ``Request`` carries it.

    The pool level is told blocks and hashes only, so with events on the
    request vLLM reads for the ``BlockStored`` it publishes carries what the
    pool level knows: the hashes, and for the blocks named one placeholder
    token id (0) per slot, no LoRA adapter, no multimodal input, no salt, no
    prompt embeddings, no session. The event's tokens, LoRA and extra keys
    are not pool-level facts (kvspec.conformance.core.kv_events compares the keys,
    the parent and the medium there), so they read as vLLM's code derives
    them from these. Attribute names are vLLM's ``Request``'s.
    """

    block_hashes: list[Any]  # vLLM's Request.block_hashes
    num_blocks: int  # the blocks registered by the call
    block_size: int  # tokens per block
    request_id: str = "kvspec-pool"
    lora_request: None = None
    cache_salt: None = None
    prompt_embeds: None = None
    session_id: None = None
    mm_features: list[Any] = field(default_factory=list)
    mm_positions: list[Any] = field(default_factory=list)  # before 0.11
    mm_hashes: list[Any] = field(default_factory=list)  # before 0.11
    _prompt_embeds_per_block_hashes: dict[tuple[int, int], bytes] = field(default_factory=dict)

    @property
    def all_token_ids(self) -> list[int]:
        """One placeholder token per slot of the blocks named (0.9.0 on: the event's ``token_ids``)."""
        return [0] * (self.num_blocks * self.block_size)

    @property
    def num_tokens(self) -> int:
        """The tokens ``all_token_ids`` holds."""
        return self.num_blocks * self.block_size


@dataclass
class StatsSum:
    """vLLM's hit-statistics intervals added up into the spec's counters since construction."""

    total: PrefixCacheStats = field(default_factory=PrefixCacheStats)

    def add(self, interval: Any) -> None:
        """Add one interval (vLLM's ``PrefixCacheStats``; None, as with stats off, adds nothing)."""
        if interval is None:
            return
        names = {f.name for f in fields(CacheCounters)}
        local = self.total.local
        grown = CacheCounters(**{n: getattr(local, n) + int(getattr(interval, n, 0) or 0) for n in names})
        resets = self.total.num_resets + (1 if getattr(interval, "reset", False) else 0)
        self.total = PrefixCacheStats(grown, self.total.connector, resets)
