"""vLLM's KV cache events at the pool level (kvspec.conformance.targets.vllm.events, the pool adapter's take_events).

The unmarked tests need no vLLM: they translate event objects shaped as
vLLM's (same class names and fields) and check the declared facts and the
statistics sum. The ``vllm`` tests (KVSPEC_VLLM=1) load every release from
0.9.0 in light mode: each builds with events on, publishes the fields its
facts declare, and replays one short scenario whose events are written out;
a campaign with events runs on one release per API generation of the
events (the key form, medium, lora_name, extra keys, group_idx), and a
translation that drops removals is caught.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import pytest

from kvspec.conformance.core.adapter import AdapterConfig
from kvspec.conformance.targets.vllm.events import (
    AmbiguousEventKey,
    EventTranslator,
    PoolEventRequest,
    StatsSum,
    event_facts,
    fields_not_published,
)
from kvspec.conformance.targets.vllm.releases import RELEASES, version_key
from kvspec.spec.events import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, event_extra_keys
from kvspec.spec.hashing import MultiModalInput
from kvspec.spec.state import BlockHash, BlockId
from kvspec.spec.stats import CacheCounters, PrefixCacheStats

# --- no vLLM: event objects shaped as vLLM's --------------------------------------------------------


@dataclass
class BlockStored_:  # noqa: N801 - renamed below to vLLM's class name, which translation reads
    block_hashes: list[Any]
    parent_block_hash: Any
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


@dataclass
class BlockRemoved_:  # noqa: N801
    block_hashes: list[Any]
    medium: str | None = None
    group_idx: int | None = None


@dataclass
class AllBlocksCleared_:  # noqa: N801
    extra: dict[str, Any] = field(default_factory=dict)


BlockStored_.__name__, BlockRemoved_.__name__, AllBlocksCleared_.__name__ = (
    "BlockStored", "BlockRemoved", "AllBlocksCleared"
)  # fmt: skip


def _fold(value: Any, group: int) -> BlockHash:
    """A key form as an adapter's: the hash's bytes, then the group as 4 bytes."""
    raw = value if isinstance(value, bytes) else value.to_bytes(8, "big")
    return BlockHash(raw + group.to_bytes(4, "big"))


def test_every_field_a_release_publishes_is_copied_and_keys_are_folded_with_their_group() -> None:
    translator = EventTranslator(event_facts("0.33.0"), _fold)
    d1, d2 = b"\x11" * 32, b"\x22" * 32
    translator.remember([d1, d2])
    low64 = int.from_bytes(d2[-8:], "big")
    stored = BlockStored_([d1, low64], d1, [1, 2, 3, 4], 2, 7, "GPU", "lora-a", [["lora-a", ["img", 0]], None], 1)
    got = translator.translate([stored, BlockRemoved_([low64], "GPU", 1), AllBlocksCleared_()])
    assert got == [
        BlockStored(
            (_fold(d1, 1), _fold(d2, 1)), _fold(d1, 1), (1, 2, 3, 4), 2, "lora-a", (("lora-a", ("img", 0)), None), 1
        ),
        BlockRemoved((_fold(d2, 1),)),
        AllBlocksCleared(),
    ]


def test_fields_a_release_does_not_publish_stay_at_the_spec_default_and_are_declared() -> None:
    facts = event_facts("0.9.2")
    translator = EventTranslator(facts, _fold)
    # 0.9.x: a key's own int, no medium, lora_id only: the event object has no later fields at all
    stored = BlockStored_([5], None, [0, 0], 2, lora_id=3)
    (got,) = translator.translate([stored])
    assert got == BlockStored((_fold(5, 0),), None, (0, 0), 2, None, None, 0, MEDIUM_GPU)
    assert sorted(fields_not_published(facts, "vllm==0.9.2")) == [
        "BlockStored.extra_keys", "BlockStored.group_idx", "BlockStored.lora_name", "BlockStored.medium",
    ]  # fmt: skip
    assert fields_not_published(event_facts("0.33.0"), "vllm==0.33.0") == {}
    # 0.17 and 0.18 publish extra keys, with an image as its bare identifier: declared, with why
    assert "bare identifier" in fields_not_published(event_facts("0.18.1"), "x")["BlockStored.extra_keys"]


def test_a_64_bit_key_that_names_two_digests_or_none_is_refused_not_guessed() -> None:
    translator = EventTranslator(event_facts("0.10.2"), _fold)
    a, b = b"\x01" * 24 + b"\x99" * 8, b"\x02" * 24 + b"\x99" * 8
    translator.remember([a])
    low64 = int.from_bytes(b"\x99" * 8, "big")
    assert translator.translate([BlockRemoved_([low64])]) == [BlockRemoved((_fold(a, 0),))]
    translator.remember([b])
    with pytest.raises(AmbiguousEventKey, match=r"^vllm==0\.10\.2 published the 64-bit key 0x9999999999999999"):
        translator.translate([BlockRemoved_([low64])])
    with pytest.raises(ValueError, match=r"the last 8 bytes of no digest it was given or computed$"):
        translator.translate([BlockRemoved_([7])])


@pytest.mark.parametrize("int_keys", [True, False])
def test_a_key_in_the_other_form_than_the_setting_asks_for_is_refused(int_keys: bool) -> None:
    # VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES picks the one key form a router parses: a pool that publishes the
    # digest while it is on (or the 64-bit int while it is off) diverges; a translator told nothing takes both.
    digest = b"\x11" * 32
    low64 = int.from_bytes(digest[-8:], "big")
    right, wrong = (low64, digest) if int_keys else (digest, low64)
    translator = EventTranslator(event_facts("0.33.0"), _fold, int_keys)
    translator.remember([digest])
    assert translator.translate([BlockRemoved_([right])]) == [BlockRemoved((_fold(digest, 0),))]
    with pytest.raises(
        ValueError, match=rf"^vllm==0\.33\.0 published the key .* VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES={int(int_keys)}"
    ):
        translator.translate([BlockRemoved_([wrong])])
    either = EventTranslator(event_facts("0.33.0"), _fold)
    either.remember([digest])
    assert either.translate([BlockRemoved_([wrong])]) == [BlockRemoved((_fold(digest, 0),))]


def test_an_event_the_spec_has_no_type_for_is_refused() -> None:
    class KVConnectorEvent:
        pass

    with pytest.raises(ValueError, match=r"^vllm==0\.33\.0 published a KVConnectorEvent, an event the spec"):
        EventTranslator(event_facts("0.33.0"), _fold).translate([KVConnectorEvent()])


def test_event_facts_change_points() -> None:
    assert not event_facts("0.8.5.post1").has_events
    assert event_facts("0.9.0").hash_form == "hash_value" and event_facts("0.10.2").hash_form == "digest"
    assert "medium" in event_facts("0.10.2").published and "medium" not in event_facts("0.10.1.1").published
    assert event_facts("0.19.1").groups_in_events is False and event_facts("0.20.0").groups_in_events
    assert not event_facts("0.18.1").extra_keys_as_spec and event_facts("0.19.0").extra_keys_as_spec


def test_stats_intervals_add_up_and_each_reset_flag_counts_one_reset() -> None:
    @dataclass
    class Interval:  # vLLM's PrefixCacheStats, as 0.33 has it
        reset: bool = False
        requests: int = 0
        queries: int = 0
        hits: int = 0
        preempted_requests: int = 0
        preempted_queries: int = 0
        preempted_hits: int = 0

    total = StatsSum()
    total.add(Interval(False, 1, 10, 4))
    total.add(None)  # stats off: nothing
    total.add(Interval(True, 1, 8, 0, 1, 8, 8))
    total.add(Interval(True))
    assert total.total == PrefixCacheStats(CacheCounters(2, 18, 4, 1, 8, 8), CacheCounters(), 2)


def test_the_pool_level_request_carries_one_placeholder_token_per_slot() -> None:
    request = PoolEventRequest(["h1", "h2"], 2, 4)
    assert request.all_token_ids == [0] * 8 and request.num_tokens == 8
    assert request.lora_request is None and request.mm_features == [] and request.session_id is None


# --- every release from 0.9.0, in light mode -----------------------------------------------------------

EVENT_RELEASES = [v for v in RELEASES if event_facts(v).has_events]
H1, H2, H3 = BlockHash(b"\x00\x01"), BlockHash(b"\xff"), BlockHash(b"hash-3")


def _pool(version: str, events: bool = True, n: int = 6) -> Any:
    from kvspec.conformance.targets.vllm.adapter import light_release, make_pool_adapter

    logging.disable(logging.WARNING)
    return make_pool_adapter(light_release(version), AdapterConfig("pool", n, events=events))


@pytest.mark.vllm
@pytest.mark.parametrize("version", RELEASES)
def test_every_release_from_0_9_builds_with_events_and_publishes_the_declared_fields(version: str) -> None:
    from kvspec.conformance.targets.vllm.adapter import light_release

    facts = event_facts(version)
    pool = _pool(version)
    assert callable(getattr(pool, "take_events", None)) == facts.has_events
    assert not hasattr(_pool(version, events=False), "take_events")
    if not facts.has_events:
        return
    assert pool.pool.enable_kv_cache_events is True
    # The declared facts are the release's own BlockStored struct: each spec field it has, it publishes.
    vllm_fields = set(light_release(version).module("vllm.distributed.kv_events").BlockStored.__struct_fields__)
    spec_fields = ("parent_block_hash", "token_ids", "block_size", "medium", "lora_name", "extra_keys", "group_idx")
    assert {f for f in spec_fields if f in vllm_fields} == set(facts.published)
    assert set(pool.not_applicable) == set(fields_not_published(facts, pool.release.label))


@pytest.mark.vllm
@pytest.mark.parametrize("version", EVENT_RELEASES)
def test_the_events_of_a_registration_an_eviction_and_a_reset(version: str) -> None:
    pool = _pool(version)
    assert pool.get_new_blocks(3) == [1, 2, 3]
    pool.cache_full_blocks([BlockId(1), BlockId(2)], [H1, H2])
    pool.cache_full_blocks([BlockId(3)], [H1])  # the same key again, on another block
    (stored, again) = pool.take_events()
    assert (stored.block_hashes, stored.parent_block_hash) == ((H1, H2), None)
    assert (again.block_hashes, again.parent_block_hash) == ((H1,), None)
    assert stored.medium == MEDIUM_GPU and pool.take_events() == []  # drained
    pool.free_blocks([BlockId(3), BlockId(2), BlockId(1)])
    assert pool.take_events() == []  # a freed block stays cached: nothing to tell
    # every freed block is hashed, so each release puts it at the right end: [4, 5] then 3, 2, 1
    assert pool.get_new_blocks(5) == [4, 5, 3, 2, 1]
    removed = pool.take_events()
    # one BlockRemoved per key a block loses, in eviction order: H1 twice (block 3, then block 1)
    assert removed == [BlockRemoved((H1,)), BlockRemoved((H2,)), BlockRemoved((H1,))]
    pool.free_blocks([BlockId(b) for b in (1, 2, 3, 5, 4)])
    assert pool.reset_prefix_cache() is True
    assert pool.take_events() == [AllBlocksCleared()]


@pytest.mark.vllm
@pytest.mark.parametrize("version", [v for v in EVENT_RELEASES if "extra_keys" in event_facts(v).published])
def test_published_extra_keys_are_the_spec_s_untagged_keys_from_0_19(version: str) -> None:
    # A request with a LoRA adapter, an image over tokens 2..4 and a salt registers two blocks of 4 tokens.
    import inspect

    pool = _pool(version)
    blocks = pool.pool.get_new_blocks(2)
    request = PoolEventRequest([pool._key(H1), pool._key(H2)], 2, 4)
    request.lora_request = _LoRA()  # type: ignore[assignment]
    request.mm_features = [_Feature()]
    request.mm_positions, request.mm_hashes = [_Position()], ["img"]
    request.cache_salt = "tenant"  # type: ignore[assignment]
    kwargs: dict[str, Any] = {"request": request, "blocks": blocks, "num_cached_blocks": 0, "num_full_blocks": 2,
                              "block_size": 4, "kv_cache_group_id": 0, "block_hashes": request.block_hashes,
                              "hash_fn": hash}  # fmt: skip
    params = inspect.signature(pool.pool.cache_full_blocks).parameters
    pool.pool.cache_full_blocks(**{k: v for k, v in kwargs.items() if k in params})
    (stored,) = pool.take_events()
    spec = event_extra_keys([0, 1], 4, "lora-a", [MultiModalInput("img", 2, 3)], "tenant")
    assert (stored.extra_keys == spec) == event_facts(version).extra_keys_as_spec, (stored.extra_keys, spec)


class _Position:
    """An image's placeholder range (tokens 2 to 4) as vLLM's ``PlaceholderRange``."""

    offset, length = 2, 3


class _Feature:
    """The image as vLLM's ``MultiModalFeatureSpec`` (0.11+) shows it to the extra keys."""

    identifier = mm_hash = "img"
    mm_position = _Position()


class _LoRA:
    """The LoRA adapter as vLLM's ``LoRARequest`` shows it to events and extra keys."""

    lora_name = name = "lora-a"
    lora_path = path = "/lora/a"
    lora_int_id = adapter_id = id = 1


# One release per API generation of the events: the key's int (0.9.0), the digest as a 64-bit int with a
# medium (0.10.2), lora_name and a flat touch (0.14.0), group_idx (0.20.0), the newest (0.33.0).
CAMPAIGN_RELEASES = ("0.9.0", "0.10.2", "0.14.0", "0.20.0", "0.33.0")


def _profile(version: str) -> str:
    return "vllm-v1" if version_key(version) >= (0, 24) else "vllm-v1-tail"


@pytest.mark.vllm
@pytest.mark.parametrize("version", CAMPAIGN_RELEASES)
def test_a_pool_campaign_with_events_conforms(version: str) -> None:
    from kvspec.conformance.runner.run import run_check
    from kvspec.conformance.targets.vllm.factories import make_light_adapter

    # An eviction (BlockRemoved) needs a full pool of cached blocks: rounds on the next seeds while it is unreached.
    result = run_check(make_light_adapter(version), level="pool", enable_caching=True, profile=_profile(version),
                       max_examples=60, events=True, cover_rounds=3)  # fmt: skip
    assert result.verdict == "conforms", result.failure
    for kind in ("BlockStored", "BlockRemoved", "AllBlocksCleared"):
        assert result.coverage[f"events: {kind}"] > 0, kind


@pytest.mark.vllm
def test_a_translation_that_drops_removals_is_caught_by_the_mirror_rule(tmp_path: Any) -> None:
    # The check can fail: the same adapter with every BlockRemoved dropped breaks event_mirror_exact.
    from kvspec.conformance.runner.run import run_check
    from kvspec.conformance.targets.vllm.factories import make_light_adapter

    base = make_light_adapter("0.33.0")

    def dropping(config: AdapterConfig) -> Any:
        adapter = base(config)
        take = adapter.take_events
        adapter.take_events = lambda: [e for e in take() if not isinstance(e, BlockRemoved)]
        return adapter

    result = run_check(dropping, level="pool", profile="vllm-v1", max_examples=60, events=True,
                       trace_dir=str(tmp_path))  # fmt: skip
    assert result.verdict == "diverges", result
    assert result.failure is not None and result.failure.invariant == "event_mirror_exact", result.failure


# --- the oracle's events column ------------------------------------------------------------------------


def test_the_events_column_says_ok_no_events_the_rule_broken_or_the_verdict() -> None:
    from kvspec.conformance.tools.oracle_matrix import Cell, ReleaseRow, format_matrix

    def ran(verdict: str, **extra: Any) -> Cell:
        return Cell("ran", "", {"vllm-v1": {"verdict": verdict, "step": 3, "op": "evict_blocks", "message": "m",
                                            "trace": "t.jsonl", **extra}})  # fmt: skip

    rows = [
        ReleaseRow("0.8.5", events={"pool": Cell("n/a", "no events: its BlockPool takes no enable_kv_cache_events")}),
        ReleaseRow("0.9.0", events={"pool": ran("conforms")}),
        ReleaseRow("0.9.1", events={"pool": ran("diverges", rule="event_mirror_exact")}),
        ReleaseRow("0.9.2", events={"pool": ran("diverges")}),
    ]
    text = format_matrix(rows, ["pool"], [])
    lines = {line.split()[0]: line.split()[1:] for line in text.splitlines()[1:5]}
    assert text.splitlines()[0].split() == ["version", "pool/events", "hashes"]
    assert lines == {"0.8.5": ["no", "events", "n/a"], "0.9.0": ["ok", "n/a"],
                     "0.9.1": ["breaks", "event_mirror_exact[1]", "n/a"], "0.9.2": ["diverges[2]", "n/a"]}  # fmt: skip
    assert "[1] 0.9.1 pool events under vllm-v1: diverges at step 3 (evict_blocks): m  trace: t.jsonl" in text


@pytest.mark.vllm
def test_the_oracle_events_column_on_a_release_without_events_and_two_with(tmp_path: Any) -> None:
    from kvspec.conformance.tools.oracle import run_oracle
    from kvspec.conformance.tools.oracle_matrix import format_matrix

    rows = run_oracle(["0.8.5", "0.9.0", "0.33.0"], levels=("pool",), caching="on", max_examples=20,
                      time_budget=40.0, trace_dir=str(tmp_path), events=True)  # fmt: skip
    cells = {row.version: row.events["pool"] for row in rows}
    assert cells["0.8.5"].status == "n/a" and cells["0.8.5"].why.startswith("no events")
    for version in ("0.9.0", "0.33.0"):
        ((profile, result),) = cells[version].profiles.items()
        assert (profile, result["verdict"]) == (_profile(version), "conforms"), (version, result)
    header, *lines = format_matrix(rows, ["pool"], ["on"]).splitlines()
    start, end = header.index("pool/events"), header.index("hashes")
    assert [line[start:end].strip() for line in lines[:3]] == ["no events", "ok", "ok"]
