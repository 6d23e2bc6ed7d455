"""What each vLLM release does with each caller mistake of the operations table: declared, measured facts.

One reaction per mistake (kvspec.conformance.core.reactions), as change points
(the first release where a reaction holds, as in releases.py); a mistake
absent here, or None from a release on, is not sent and the summary lists it.
Every entry was measured with kvspec.conformance.runner.survey (every mistake sent to
a replica, counted by the reaction seen) and, where the words say how, read
in the release's code. A mistake seen with two reactions (it raises in some
states and returns in others) cannot be declared: it is None, with the two
named, so a campaign never sends it and never excuses it.

Pool level: every release 0.8.0 to 0.33.0, in light mode, both caching
settings. Request level: the six releases the request level is tested on
(0.8.0, 0.8.4, 0.8.5.post1, 0.9.2, 0.10.2, 0.33.0, one per API generation),
so a change point there is the first of those releases that shows it (the
change itself may lie in a release between); a release between them gets
the older one's reactions and diverges, naming the mistake, where it differs.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvspec.conformance.core.reactions import Reaction, accepts, ignores, not_expressible, raises
from kvspec.conformance.targets.vllm.releases import since, version_key

__all__ = ["ByCaching", "manager_reactions", "pool_reactions", "reaction_change_points"]


@dataclass(frozen=True, slots=True)
class ByCaching:
    """A reaction that depends on whether prefix caching is on (None: not declared for that setting)."""

    on: Reaction | None
    off: Reaction | None


_Entry = Reaction | ByCaching | None

# --- the BlockPool -----------------------------------------------------------------------------------

# "bad id": the only bad id vLLM's API can take is block 0, the null block (the
# others name no block object), so before 0.8.3 (no null block) none can be sent.
_NULL_BLOCK = "the only bad id the harness sends that names a block object is 0, the null block"
_EVICT_NULL = "block 0, the null block, has no hash and is skipped (an id that is not an int is not sent)"
_EVICT_PAST = "its bound check (assert block_id < len(self.blocks)) fires after evicting the ids the set yields first"
_EVICT_NEGATIVE = "a Python index: -1 is the last block, whose hash, if it has one, is dropped"
_POOL_REACTIONS: dict[str, list[tuple[str, _Entry]]] = {
    "get_new_blocks: more than free": [("0.8.0", raises("ValueError"))],
    "get_new_blocks: bad count": [
        ("0.8.0", ignores("a negative count takes no block")),
        ("0.10.0", accepts("a negative count takes no block but raises the free-block count (popleft_n)")),
    ],
    "touch: named twice": [("0.8.0", accepts("each copy takes a reference"))],
    "touch: no hash": [("0.8.0", accepts("taken like a hit: out of the free queue, ref_cnt + 1"))],
    "touch: bad id": [
        ("0.8.0", not_expressible("no block 0: the release has no null block")),
        ("0.8.3", accepts(f"the null block takes a reference ({_NULL_BLOCK})")),
        ("0.33.0", ignores(f"the null block is skipped ({_NULL_BLOCK})")),
    ],
    "free_blocks: double free": [("0.8.0", accepts("ref_cnt goes below 0"))],
    "free_blocks: named twice": [("0.8.0", accepts("each copy drops a reference"))],
    "free_blocks: bad id": [
        ("0.8.0", not_expressible("no block 0: the release has no null block")),
        ("0.8.3", accepts(f"the null block's ref_cnt goes down ({_NULL_BLOCK})")),
        ("0.33.0", ignores(f"the null block is skipped ({_NULL_BLOCK})")),
    ],
    "cache_full_blocks: already cached": [
        ("0.8.0", raises("AssertionError", then="the blocks before it in the list are registered")),
        # From 0.24 a hashed block is re-registered when it comes later in the list than it was
        # registered at (a partial block promoted to full), else the assert fires: no one reaction.
        ("0.24.0", None),
    ],
    "cache_full_blocks: named twice": [
        ("0.8.0", raises("AssertionError", then="the first copy is registered")),
        ("0.24.0", accepts("the second copy registers the block again under its own hash (a promotion)")),
    ],
    "cache_full_blocks: caching off": [("0.8.0", accepts("the hashes are registered although caching is off"))],
    "cache_full_blocks: length mismatch": [("0.8.0", ignores("a hash beyond the blocks is not read"))],
    "cache_full_blocks: not held": [("0.8.0", accepts("a free block gets the hash and stays in the free queue"))],
    "cache_full_blocks: bad id": [
        ("0.8.0", not_expressible("no block 0: the release has no null block")),
        ("0.8.3", accepts(f"the null block gets a hash ({_NULL_BLOCK})")),
        # From 0.14 cache_full_blocks skips null blocks (a sliding-window table holds them). Declared, not
        # left at "accepts", which forgives any change: a null block in the prefix cache must diverge.
        ("0.14.0", ignores(f"the null block is skipped ({_NULL_BLOCK})")),
    ],
    "cache_full_blocks: hash not bytes": [("0.8.0", not_expressible("the release's hash keys are made of bytes"))],
    "get_cached_block: hash not bytes": [("0.8.0", not_expressible("the release's hash keys are made of bytes"))],
    # evict_blocks takes plain ints (0.13.0 on; the adapter sends the int, nothing translated): each class
    # of bad id is its own mistake (strategies.PLAIN_ID_MISTAKES), and each has one reaction in every release.
    "evict_blocks: bad id": [("0.13.0", ignores(_EVICT_NULL))],
    "evict_blocks: id past the pool": [("0.13.0", raises("AssertionError", then=_EVICT_PAST))],
    "evict_blocks: negative id": [("0.13.0", accepts(_EVICT_NEGATIVE))],
    "evict_blocks: named twice": [("0.13.0", ignores("the ids are a set: the copy is dropped"))],
    "is_block_writable: bad id": [
        ("0.29.0", not_expressible("it takes a block object, and no bad id the harness sends names one"))
    ],
}

# --- the KVCacheManager ------------------------------------------------------------------------------

_TAKEN = "the blocks asked for are taken"
# allocate_slots asserts on the hit and the token count in some states and not in others (0.8.x, 0.9.x).
_ASSERTS_BY_STATE = None
_MANAGER_REACTIONS: dict[str, list[tuple[str, _Entry]]] = {
    "get_computed_blocks: no tokens": [
        ("0.8.0", ignores("an empty prompt has no block to look up")),
        # From 0.8.3 the manager caps the hit itself and reads the last token (at -1) of an empty prompt.
        ("0.8.4", ByCaching(raises("IndexError"), None)),
        ("0.9.2", ignores("an empty prompt has no block to look up")),
        ("0.10.2", ByCaching(raises("ValueError"), ignores("nothing is looked up without caching"))),
        # 0.33's get_computed_blocks takes the scheduler's cap, which the machine draws with the mistake too:
        # without one the search reads up to len - 1 = -1 tokens (a ValueError), a cap of 0 searches nothing.
        ("0.33.0", ByCaching(None, ignores("nothing is looked up without caching"))),
    ],
    "get_computed_blocks: no id": [("0.8.0", ignores("a lookup does not read the id"))],
    "get_computed_blocks: misplaced images": [("0.8.0", ignores("a lookup does not check the positions"))],
    "get_computed_blocks: already running": [("0.8.0", ignores("a lookup changes no block"))],
    "allocate_slots: no id": [("0.8.0", accepts(f"{_TAKEN}, under the empty id"))],
    "allocate_slots: no tokens": [
        # 0.8.x registers the blocks a step fills by reading the request's tokens: a step of a full block or
        # more asserts (len(block_tokens) == block_size) after taking the blocks, a shorter one does not.
        ("0.8.0", _ASSERTS_BY_STATE),
        ("0.9.2", ByCaching(_ASSERTS_BY_STATE, accepts(_TAKEN))),
        ("0.10.2", accepts(_TAKEN)),
    ],
    "allocate_slots: misplaced images": [("0.8.0", accepts(f"the positions are not checked; {_TAKEN}"))],
    "allocate_slots: no tokens scheduled": [("0.8.0", raises("ValueError"))],
    # A TypeError for a count that is not an int, a ValueError or nothing for a negative one, by state.
    "allocate_slots: bad count": [("0.8.0", None)],
    "allocate_slots: more tokens than the request has": [
        ("0.8.0", _ASSERTS_BY_STATE),  # 0.8.x too: an AssertionError after the blocks are taken, or not
        ("0.9.2", ByCaching(_ASSERTS_BY_STATE, accepts("blocks for every token asked for are taken"))),
        ("0.10.2", accepts("blocks for every token asked for are taken")),
    ],
    "allocate_slots: hit count mismatch": [
        ("0.8.0", accepts("the blocks given or the count given win, by generation")),
        ("0.9.2", ByCaching(_ASSERTS_BY_STATE, accepts("the count given wins"))),
        ("0.10.2", accepts("the count given wins")),
    ],
    "allocate_slots: hit longer than the request": [
        ("0.8.0", accepts("the hit blocks are touched and kept")),
        ("0.9.2", _ASSERTS_BY_STATE),
        ("0.10.2", accepts("the hit blocks are touched and kept")),
    ],
    # The assert fires after the hit blocks are touched when the step fits; with too few free blocks the
    # step is refused (None) before, and nothing changes: two ways by state, caching on or off.
    "allocate_slots: hit on a running request": [("0.8.0", None)],
    "allocate_slots: wrong hit block": [
        # 0.8.x hashes a request in get_computed_blocks: a hit passed for a request it has no hashes for
        # trips cache_full_blocks' `assert len(block_hashes) >= num_cached_blocks`; else the block is taken.
        ("0.8.0", _ASSERTS_BY_STATE),
        ("0.9.2", _ASSERTS_BY_STATE),
        ("0.10.2", accepts("the block is taken as the hit")),
    ],
    # An assert fires in some states and the hit is dropped in others (0.9.2 to 0.33.0).
    "allocate_slots: hit without caching": [("0.8.0", None)],
    "free: not running": [("0.8.0", ignores("vLLM's free pops an empty block table"))],
    # Of the six releases only 0.33's get_computed_blocks takes max_cache_hit_length, and only 0.24's and
    # 0.33's KVCacheManager have evict_blocks (0.24, measured for its groups, is not among the six: nothing
    # declared there, nothing sent); before, the adapter has neither, and nothing is sent.
    # The cap is read as a number: a negative one raises ValueError (the search's islice), text raises
    # TypeError, and True or 1.5 search as 1 or 0 tokens and return normally, by value (caching on).
    "get_computed_blocks: bad hit cap": [
        ("0.33.0", ByCaching(None, ignores("nothing is looked up without caching, so the cap is not read")))
    ],
    # KVCacheManager.evict_blocks hands the set to its BlockPool's: the pool's reaction to each class of bad id.
    "evict_blocks: bad id": [("0.33.0", ignores(_EVICT_NULL))],
    "evict_blocks: id past the pool": [("0.33.0", raises("AssertionError", then=_EVICT_PAST))],
    "evict_blocks: negative id": [("0.33.0", accepts(_EVICT_NEGATIVE))],
    "evict_blocks: named twice": [("0.33.0", ignores("the ids are a set: the copy is dropped"))],
    # Not measured: the adapter does not delay a registration or call cache_blocks (an asynchronous load is
    # declared not applicable), so these are never sent to it.
    "allocate_slots: delay without an external load": [("0.8.0", None)],
    "cache_blocks: not running": [("0.8.0", None)],
    "cache_blocks: tokens out of range": [("0.8.0", None)],
    # Not measured: a negative hit limit (a request's prefix_cache_hit_limit, 0.34 on; vLLM derives it from
    # its sampling parameters, which refuse a negative start) and the mistakes of 0.34's get_num_cached_tokens
    # are not declared, so none of them is sent.
    "get_computed_blocks: bad hit limit": [("0.8.0", None)],
    "allocate_slots: bad hit limit": [("0.8.0", None)],
    "get_num_cached_tokens: no id": [("0.8.0", None)],
    "get_num_cached_tokens: no tokens": [("0.8.0", None)],
    "get_num_cached_tokens: bad hit limit": [("0.8.0", None)],
    "get_num_cached_tokens: misplaced images": [("0.8.0", None)],
}
# 0.8.x with caching off frees a request's blocks head first, a divergence every
# campaign reaches before its mistakes (test_vllm_manager.py): nothing measured, nothing declared.
_MEASURED_WITHOUT_CACHING_FROM = "0.9.0"


def reaction_change_points(level: str = "pool") -> tuple[str, ...]:
    """The releases where a declared reaction of the level ("pool" or "manager") changes, oldest first."""
    table = _POOL_REACTIONS if level == "pool" else _MANAGER_REACTIONS
    return tuple(sorted({first for changes in table.values() for first, _ in changes}, key=version_key))


def _declared(table: dict[str, list[tuple[str, _Entry]]], version: str, enable_caching: bool) -> dict[str, Reaction]:
    key = version_key(version)
    found: dict[str, Reaction] = {}
    for mistake, changes in table.items():
        if version_key(changes[0][0]) > key:
            continue
        entry = since(version, changes)
        reaction = (entry.on if enable_caching else entry.off) if isinstance(entry, ByCaching) else entry
        if reaction is not None:
            found[mistake] = reaction
    return found


def pool_reactions(version: str) -> dict[str, Reaction]:
    """What the release's BlockPool does with each caller mistake, as declared above (both caching settings).

    A release newer than the table gets the newest reactions: behaviour that
    changes after them diverges until the table says so.
    """
    return _declared(_POOL_REACTIONS, version, True)


def manager_reactions(version: str, enable_caching: bool, groups: str = "full") -> dict[str, Reaction]:
    """What the release's KVCacheManager does with each request-level caller mistake, as declared above.

    ``groups`` is the layout of KV cache groups (``"full,sliding:8"``): the
    ValueError for an empty prompt comes from the full-attention search
    (``itertools.islice`` of the hashes up to ``(len - 1) // block_size``, -1
    here); a layout without a full-attention group searches with the sliding
    window's and chunked local attention's loops, which take the negative
    length as no blocks and return normally, changing nothing. 0.33's
    scheduler may pass a cap, and a cap past the empty prompt makes those
    loops read a hash it does not have (an IndexError): not one reaction
    there, as with full attention, so nothing is sent.

    A layout with a sliding-window or chunked local attention group counts
    the blocks a step needs net of those its window skips: a hit given as a
    token count with fewer blocks than it claims passes that count and then
    asks the pool for every block the hit did not give, a ValueError where
    the pool has fewer free (measured on 0.33: ``chunked:8``, one free block,
    a count of 8 with no block) and taken where it has enough: not one
    reaction, so it is not sent there.

    >>> manager_reactions("0.10.2", True)["get_computed_blocks: no tokens"].describe()
    'raises ValueError'
    >>> manager_reactions("0.10.2", True, "sliding:4")["get_computed_blocks: no tokens"].kind
    'ignores'
    >>> "get_computed_blocks: no tokens" in manager_reactions("0.33.0", True, "sliding:4")
    False
    >>> "free: not running" in manager_reactions("0.8.4", False)
    False
    >>> "allocate_slots: hit count mismatch" in manager_reactions("0.33.0", True, "full,chunked:8")
    False
    """
    if not enable_caching and version_key(version) < version_key(_MEASURED_WITHOUT_CACHING_FROM):
        return {}
    found = _declared(_MANAGER_REACTIONS, version, enable_caching)
    empty = found.get("get_computed_blocks: no tokens")
    if empty is not None and empty.kind == "raises" and not _has_full_attention(groups):
        found["get_computed_blocks: no tokens"] = ignores(
            "an empty prompt: no full-attention group, and the sliding-window and chunked searches find no block"
        )
    if _has_window(groups):
        found.pop("allocate_slots: hit count mismatch", None)
    return found


def _has_window(groups: str) -> bool:
    """Whether a layout of KV cache groups (``"full,sliding:8"``) has a sliding-window or chunked local group."""
    return any(name.strip().split(":")[0] in ("sliding", "chunked") for name in groups.split(","))


def _has_full_attention(groups: str) -> bool:
    """Whether a layout of KV cache groups (``"full,sliding:8"``) has a full-attention group."""
    return any(name.strip() == "full" for name in groups.split(","))
