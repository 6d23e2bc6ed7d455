"""Every operation the harness drives, described once.

One `Operation` per adapter method: its level, its parameters in call order
(vLLM's names), the spec function that defines it, how a returned value is
put in normal form and compared, whether an adapter may lack it, the trailing
parameters an adapter may not take (`features`), the spec branches it has
(outcomes and the errors it raises for caller mistakes), which of those only
prefix caching, some profiles or some KV cache group layouts reach, how a
step's branches are named (kvspec.conformance.core.branches), its caller
mistakes (a valid call and the change that makes each one,
kvspec.conformance.core.mistakes), how the machine draws a call where its
rule is only that (`draw`), and what the player and the stories say of a
call and its result (`wording`, kvspec.conformance.core.wording). An
operation's one real special case is a property of its entry too: a
returned prefix hit (`hit_reached`), a count asked of a replica
(`is_count`).

The trace format (parameter names and counts), the lock-step core (the spec
call and the result comparison), coverage (the branches a configuration
should reach), adapter capabilities (the optional operations), the
runner's method checks, the machines' generated rules, the error contract
(`kvspec errors`), the player and the stories are all read from
`OPERATIONS`; nothing else switches on an operation's name. Adding an
operation is one entry here plus its spec function and its implementations
(tests/conformance/test_operations.py adds one that way).

Design choice: a table of plain records rather than a class per operation
with methods to override; every column is data or a small pure function, so
the table reads as one page and no behaviour hides in a subclass.
"""

from __future__ import annotations

import operator
import reprlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

from hypothesis import strategies as st

from kvspec.conformance.core import branches as br
from kvspec.conformance.core import strategies as strat
from kvspec.conformance.core.mistakes import (
    BAD_ID,
    CONTRACT_HASHES,
    REQUEST,
    REQUEST_MISTAKES,
    Cases,
    Change,
    append_to,
    manager_state,
    pool_state,
    set_to,
)
from kvspec.conformance.core.wording import CallText, Wording, blocks, plural
from kvspec.spec import manager as spec_manager
from kvspec.spec import ops as spec_ops
from kvspec.spec.attention import parse_groups
from kvspec.spec.manager import Request
from kvspec.spec.ordering import is_profile, profile_rule
from kvspec.spec.state import BlockHash, PoolState, Snapshot
from kvspec.spec.step import Step

__all__ = [
    "HIT_LIMIT",
    "OPERATIONS",
    "REQUEST_FEATURES",
    "BadResult",
    "ID_BOUND",
    "Draw",
    "Feature",
    "HitReached",
    "Level",
    "Operation",
    "all_args",
    "draw_block_id",
    "level_operations",
    "operation_added",
    "optional_operations",
    "required_methods",
]

Level = Literal["pool", "manager"]
Reached = Callable[[Sequence[Any], Snapshot, Snapshot, Any], list[str]]
# (request, block size, the spec before, the hit in normal form, the request's chain, whether the coordinator cut it)
HitReached = Callable[[Request, int, Snapshot, Any, Sequence[BlockHash], bool], list[str]]


# Past any id or count a pool can hold (an int64's): an integer the checks refuse instead of printing.
ID_BOUND = 2**63
# The most blocks of any pool kvspec builds (a campaign draws far fewer; a trace may ask for this many,
# trace.MAX_TRACE_NUM_GPU_BLOCKS). A result of more block ids is no pool's answer, and is refused as malformed
# before it is kept: ten million ids returned were a 177 MB story and a trace too large to replay.
MAX_NUM_GPU_BLOCKS = 100_000
# What a message about a returned value shows of it: a value of megabytes would otherwise be copied whole
# into the story and the trace.
_SHOWN = reprlib.Repr()
_SHOWN.maxstring = _SHOWN.maxother = 200
_SHOWN.maxlist = _SHOWN.maxtuple = _SHOWN.maxdict = _SHOWN.maxset = 20


def _shown(v: Any) -> str:
    """`repr(v)`, cut short where it is long.

    >>> _shown([1, 2])
    '[1, 2]'
    >>> _shown("x" * 1000)[-8:]
    "...xxxx'"
    """
    return _SHOWN.repr(v)


class BadResult(Exception):
    """An implementation returned a value that cannot be put in normal form (the message says why)."""


# --- results in normal form ---------------------------------------------------------------


def as_id(v: Any) -> int:
    """A block id as a plain int (numpy ints and other index types accepted, bools refused).

    >>> as_id(3)
    3
    """
    if isinstance(v, bool):
        raise BadResult(f"{_shown(v)} is a bool, not a block id")
    try:
        i = operator.index(v)
    except TypeError:
        raise BadResult(f"{_shown(v)} is not an integer block id") from None
    if not -ID_BOUND < i < ID_BOUND:  # no pool's, and past 4,300 digits Python cannot even print it to say so
        raise BadResult(f"an integer of {i.bit_length()} bits is not a block id")
    return i


def as_ids(v: Any) -> list[int]:
    """A list of block ids as plain ints, from any iterable (not a string).

    >>> as_ids((1, 2))
    [1, 2]
    """
    if isinstance(v, (str, bytes)) or not isinstance(v, Sequence):
        try:
            v = list(v)
        except TypeError:
            raise BadResult(f"{_shown(v)} is not a list of block ids") from None
    if len(v) > MAX_NUM_GPU_BLOCKS:
        raise BadResult(
            f"a list of {len(v):,} block ids: more than any pool kvspec checks holds ({MAX_NUM_GPU_BLOCKS:,})"
        )
    return [as_id(b) for b in v]


def _as_bool(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    raise BadResult(f"{_shown(v)} is not a bool")


def _as_id_or_none(v: Any) -> int | None:
    return None if v is None else as_id(v)


def _as_ids_or_none(v: Any) -> list[int] | None:
    return None if v is None else as_ids(v)


def _as_hit(v: Any) -> list[Any]:
    if not isinstance(v, (tuple, list)) or len(v) != 2:
        raise BadResult(f"{_shown(v)} is not (hit blocks, num_hit_tokens)")
    return [as_ids(v[0]), as_id(v[1])]


def _as_float(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise BadResult(f"{_shown(v)} is not a number")
    return float(v)


def _close(a: Any, b: Any) -> bool:
    """Two numbers within rounding (anything else: equal), as a fraction computed two ways may differ.

    >>> _close(0.1 + 0.2, 0.3), _close(None, 0.3)
    (True, False)
    """
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return bool(abs(a - b) <= 1e-9)
    return bool(a == b)


# --- the table ----------------------------------------------------------------------------


def _always(state: Any, enable_caching: bool) -> bool:
    return True


def _no_mistakes(state: Any) -> tuple[str, ...]:
    return ()


@dataclass(frozen=True, slots=True)
class Draw:
    """How the machine draws a call of an operation whose rule is only "draw the arguments, call".

    The machine of each level the operation belongs to gets a rule named
    after it, generated from this (kvspec.conformance.core.machine); a level
    whose machine has a hand-written rule of that name (one that carries
    logic of its own: a scheduler's sequence of calls, a bundle) keeps it.
    The rule runs while the adapter has the operation and `when` holds;
    it draws the kind of call (valid about three times in four, else one of
    `mistakes`, each checked against the adapter's declared reaction), then
    the arguments for that kind.
    """

    when: Callable[[Any, bool], bool] = _always  # (spec state, caching on) -> whether the rule may run
    mistakes: Callable[[Any], tuple[str, ...]] = _no_mistakes  # spec state -> the mistakes that can be made in it
    # (spec state, kind of call drawn, Hypothesis data) -> the arguments; None: no arguments, nothing drawn.
    args: Callable[[Any, str, st.DataObject], tuple[Any, ...]] | None = None


def draw_block_id(state: PoolState, kind: str, data: st.DataObject) -> tuple[Any, ...]:
    """One block id: a held block or any block for a valid call, else one that names no usable block
    (any but the null block, which some questions accept)."""
    n = state.num_gpu_blocks
    held = [b for b in range(1, n) if state.ref_cnt[b] > 0]
    valid = strat.one_of(strat.sampled(held), st.integers(0, n - 1)) if held else st.integers(0, n - 1)
    bad = strat.sampled(tuple(b for b in strat.bad_block_id_values(n) if b != 0))
    return (data.draw(valid if kind == strat.VALID else bad, label="block_id"),)


@dataclass(frozen=True, slots=True)
class Feature:
    """A trailing parameter some adapters do not take (one vLLM added later, or an external connector's), or a
    field of the request some cannot set (`REQUEST_FEATURES`)."""

    param: str  # the parameter's name
    default: Any  # its value when left out: a call without it, a trace written before it existed
    name: str  # what the summary calls it when the adapter does not take it ("connector hit cap")
    branches: tuple[str, ...] = ()  # branches only a call that uses it reaches


@dataclass(frozen=True, slots=True, kw_only=True)
class Operation:
    """One adapter method, as the harness drives, records, compares and covers it."""

    name: str  # the adapter method, vLLM's name
    # "pool" (BlockPool), "manager" (KVCacheManager), or both: vLLM's KVCacheManager has some
    # of its pool's operations under the same names (evict_blocks, reset_prefix_cache).
    levels: tuple[Level, ...]
    params: tuple[str, ...]  # parameter names in call order; a trace step records one argument for each
    spec: Callable[..., Step[Any, Any]]  # the spec's definition: (state, *args) -> Step, for a state of each level
    normalize: Callable[[Any], Any] | None  # a returned value in normal (JSON) form; None: nothing to compare
    branches: tuple[str, ...]  # the outcomes the spec distinguishes, as coverage names them
    wording: Wording  # what the player and the stories say of a call and its result
    errors: tuple[str, ...] = ()  # the spec error types a caller mistake raises ("<name>: <error>" branches)
    reached: Reached = br.reached_nothing  # which branches a step that returned normally reached
    caching_only: frozenset[str] = frozenset()  # branches (outcomes or errors) only prefix caching reaches
    # The caller mistakes the machine makes ("<name>: <mistake>"): a valid call and the change that makes each
    # mistake, from which the error contract is computed (kvspec.conformance.core.mistakes); None: every call is valid.
    cases: Cases | None = None
    is_optional: bool = False  # an adapter may lack it (an old vLLM has no evict_blocks)
    same_result: Callable[[Any, Any], bool] = operator.eq  # spec and implementation results in normal form
    # Branches only some KV cache group layouts reach: branch -> whether a layout ("full,sliding:8") does.
    layout_only: Mapping[str, Callable[[str], bool]] = field(default_factory=lambda: MappingProxyType({}))
    # Branches only some eviction profiles reach: branch -> whether (profile, caching on) does.
    profile_only: Mapping[str, Callable[[str, bool], bool]] = field(default_factory=lambda: MappingProxyType({}))
    # Trailing parameters some adapters do not take (each with its default, in parameter order).
    features: tuple[Feature, ...] = ()
    # For an operation that returns a prefix hit: the hit's branches that need the request's chain. The lock-step
    # core also checks the hit rules on its result and reads its blocks' KV back.
    hit_reached: HitReached | None = None
    # It answers from a count an implementation may keep beside its queue: a replica is asked it before and
    # after a state-changing mistake, since such a count can go wrong alone.
    is_count: bool = False
    draw: Draw | None = None  # how the machine draws it, where its rule is only "draw the arguments, call"

    @property
    def defaults(self) -> tuple[Any, ...]:
        """The values of the trailing parameters an adapter may not take (a trace written before they existed
        leaves them out; they are read back as these)."""
        return tuple(f.default for f in self.features)

    @property
    def mistakes(self) -> tuple[str, ...]:
        """The names of the operation's caller mistakes (its cases'), in the contract's order."""
        return () if self.cases is None else tuple(self.cases.mistakes)

    def all_branches(self) -> tuple[str, ...]:
        """Every branch of the operation: its outcomes, then one per error type."""
        return self.branches + tuple(f"{self.name}: {e}" for e in self.errors)


def _by_level(pool_op: Callable[..., Step[Any, Any]], manager_op: Callable[..., Step[Any, Any]]) -> Callable[..., Any]:
    """One spec definition for an operation of both levels: the pool's on a pool state, the manager's on a manager's."""

    def spec(state: Any, *args: Any) -> Step[Any, Any]:
        operation = manager_op if isinstance(state, spec_manager.ManagerState) else pool_op
        return operation(state, *args)

    spec.__name__ = spec.__qualname__ = pool_op.__name__
    spec.__doc__ = pool_op.__doc__
    return spec


def _branches(name: str, *outcomes: str) -> tuple[str, ...]:
    return tuple(f"{name}: {o}" for o in outcomes)


def _with_kind(*kinds: str) -> Callable[[str], bool]:
    """Whether a layout has a group of one of these attention types."""
    return lambda groups: any(g.kind in kinds for g in parse_groups(groups))


def _hybrid(groups: str) -> bool:
    """Whether a layout has two attention types, one of them skipping: the coordinator can cut a hit."""
    kinds = set(parse_groups(groups))
    return len(kinds) > 1 and any(g.skips for g in kinds)


def _keyed(profile: str) -> bool:
    """Whether a profile orders the free blocks by a key (first fit): a freed block may land anywhere."""
    return is_profile(profile) and profile_rule(profile).keyed


# Where a freed block joins the free queue: a keyed profile puts it where its key falls, so anywhere; a queue
# policy at one of the ends, and which ends a configuration reaches depends on its profile and on caching
# (without hashes every freed block goes to the same end).
_FREE_ENDS = MappingProxyType({
    "free_blocks: to the left end": lambda profile, enable_caching: _keyed(profile) or profile == "vllm-v1",
    "free_blocks: to the right end": (
        lambda profile, enable_caching: _keyed(profile) or enable_caching or profile != "vllm-v1"
    ),
    "free_blocks: between free blocks": lambda profile, enable_caching: _keyed(profile),
})  # fmt: skip


# A request's own bound on its prefix hit (vLLM 0.34's Request.prefix_cache_hit_limit; 0: the request skips the
# cache). A field of the request, not a parameter: an implementation whose requests cannot carry it declares it
# `not_applicable[HIT_LIMIT.name]` (kvspec.conformance.core.adapter); the machine then draws no limit, and these
# branches are not expected of it.
HIT_LIMIT = Feature(
    "prefix_cache_hit_limit",
    None,  # None: no bound but the last token
    "prefix cache hit limit",
    (
        "get_computed_blocks: lookup skipped by the request",
        "get_computed_blocks: hit capped by the request's limit",
        "get_num_cached_tokens: lookup skipped by the request",
    ),
)
# The request's fields some adapters cannot set, as `Feature`s (an operation's `features` are its parameters').
REQUEST_FEATURES: tuple[Feature, ...] = (HIT_LIMIT,)


_GROUP_HITS = MappingProxyType({
    "get_computed_blocks: sliding-window hit": _with_kind("sliding"),
    "get_computed_blocks: chunked-local hit": _with_kind("chunked"),
    "get_computed_blocks: hit cut by the coordinator": _hybrid,
})  # fmt: skip
_GROUP_STEPS = MappingProxyType({
    "allocate_slots: skipped blocks freed": _with_kind("sliding", "chunked"),
    "allocate_slots: admitted with skipped positions": _with_kind("sliding", "chunked"),
    "allocate_slots: refused after freeing skipped blocks": _with_kind("sliding", "chunked"),
})  # fmt: skip


def _allocate_slots_asks(c: CallText) -> str:
    words = f"Allocate slots for {c.count('num_new_tokens', 'new token')} of request {c.request_id('request')}"
    if c["num_new_computed_tokens"]:
        hit = plural(c["num_new_computed_tokens"], "token")
        words += f", after a hit of {hit} on {c.blocks('new_computed_blocks')}"
    if c["num_external_computed_tokens"]:
        words += f", {plural(c['num_external_computed_tokens'], 'token')} from an external connector"
    return words + "."


def _allocate_slots_answer(r: Any) -> str | None:
    if r is None:
        return "refused: too few free blocks (None)"
    if isinstance(r, list):
        return f"new {blocks(r)}" if r else "no new block needed"
    return None


_TABLE: tuple[Operation, ...] = (
    Operation(
        name="get_new_blocks",
        levels=("pool",),
        params=("num_blocks",),
        spec=spec_ops.get_new_blocks,
        normalize=as_ids,
        branches=_branches("get_new_blocks", "taken", "evicted a cached block"),
        errors=("PoolExhausted", "InvalidRequest"),
        reached=br.reached_get_new_blocks,
        caching_only=frozenset({"get_new_blocks: evicted a cached block"}),
        cases=Cases(
            pool_state,
            {"caching": True, "num_blocks": 2},
            {"bad count": set_to(num_blocks=-1), "more than free": set_to(num_blocks=5)},
            {frozenset({"bad count", "more than free"}): set_to(num_blocks=9.5)},
        ),
        wording=Wording(
            lambda c: (
                f"Take {c.count('num_blocks', 'block')} from the left end of the free queue "
                "(a cached block taken this way is evicted from the hash table)."
            ),
            lambda r: (f"got {blocks(r)}" if r else "got no blocks") if isinstance(r, list) else None,
        ),
    ),
    Operation(
        name="touch",
        levels=("pool",),
        params=("block_ids",),
        spec=spec_ops.touch,
        normalize=None,
        branches=_branches("touch", "hit a free block", "hit a held block"),
        errors=("InvalidBlock", "InvalidRequest"),
        reached=br.reached_touch,
        caching_only=frozenset({"touch: hit a free block", "touch: hit a held block", "touch: InvalidRequest"}),
        cases=Cases(
            pool_state,
            {"caching": True, "block_ids": (1,)},
            {
                "bad id": append_to(block_ids=(BAD_ID,)),
                "named twice": append_to(block_ids=(1,)),
                "no hash": append_to(block_ids=(2,)),
            },
        ),
        wording=Wording(
            lambda c: f"A prefix hit takes a reference on {c.blocks('block_ids')}; a free one leaves the free queue."
        ),
    ),
    Operation(
        name="free_blocks",
        levels=("pool",),
        params=("block_ids", "evict_first"),
        spec=spec_ops.free_blocks,
        normalize=None,
        branches=_branches(
            "free_blocks",
            "to the left end",
            "to the right end",
            "between free blocks",
            "still held by another",
            br.EVICT_FIRST_OUTCOME,
        ),
        errors=("DoubleFree", "InvalidBlock", "InvalidRequest"),
        reached=br.reached_free_blocks,
        # only a touch shares a block; only a registration gives one a hash
        caching_only=frozenset({"free_blocks: still held by another", f"free_blocks: {br.EVICT_FIRST_OUTCOME}"}),
        profile_only=_FREE_ENDS,
        # vLLM 0.34.0 on: blocks whose content another tier holds go before every other cached block
        features=(Feature("evict_first", False, "evict first", (f"free_blocks: {br.EVICT_FIRST_OUTCOME}",)),),
        cases=Cases(
            pool_state,
            {"caching": True, "block_ids": (2,), "evict_first": False},
            {
                "bad id": append_to(block_ids=(BAD_ID,)),
                "named twice": append_to(block_ids=(2,)),
                "double free": append_to(block_ids=(5,)),
            },
        ),
        wording=Wording(
            lambda c: (
                f"Release {c.blocks('block_ids')} in this order (a request's blocks come tail first); "
                "a block whose ref_cnt reaches 0 returns to the free queue"
                + (", to be evicted before every other cached block." if c["evict_first"] else ".")
            ),
            quiet_tail=(False,),
        ),
    ),
    Operation(
        name="cache_full_blocks",
        levels=("pool",),
        params=("block_ids", "block_hashes"),
        spec=spec_ops.cache_full_blocks,
        normalize=None,
        branches=_branches("cache_full_blocks", "registered", "duplicate hash kept"),
        errors=("AlreadyCached", "InvalidBlock", "InvalidRequest"),
        reached=br.reached_cache_full_blocks,
        caching_only=frozenset(
            _branches("cache_full_blocks", "registered", "duplicate hash kept", "AlreadyCached", "InvalidBlock")
        ),
        cases=Cases(
            pool_state,
            {"caching": True, "block_ids": (2,), "block_hashes": (CONTRACT_HASHES[2],)},
            {
                "caching off": set_to(caching=False),
                "length mismatch": append_to(block_hashes=(CONTRACT_HASHES[3],)),
                "bad id": append_to(block_ids=(BAD_ID,), block_hashes=(CONTRACT_HASHES[4],)),
                "named twice": append_to(block_ids=(2,), block_hashes=(CONTRACT_HASHES[5],)),
                "hash not bytes": append_to(block_ids=(3,), block_hashes=("contract-6",)),
                "not held": append_to(block_ids=(5,), block_hashes=(CONTRACT_HASHES[6],)),
                "already cached": append_to(block_ids=(1,), block_hashes=(CONTRACT_HASHES[7],)),
            },
            {
                frozenset({"hash not bytes", "not held"}): append_to(block_ids=(5,), block_hashes=("contract-6",)),
                frozenset({"hash not bytes", "already cached"}): append_to(
                    block_ids=(1,), block_hashes=("contract-6",)
                ),
                # block 4 is free and has a hash
                frozenset({"not held", "already cached"}): append_to(
                    block_ids=(4,), block_hashes=(CONTRACT_HASHES[6],)
                ),
            },
        ),
        wording=Wording(
            lambda c: f"Register full {c.blocks('block_ids')} in the hash table under {c.values('block_hashes')}."
        ),
    ),
    Operation(
        name="get_cached_block",
        levels=("pool",),
        params=("block_hash",),
        spec=spec_ops.get_cached_block,
        normalize=_as_id_or_none,
        branches=_branches("get_cached_block", "hit", "hit a free block", "miss"),
        errors=("InvalidRequest",),
        reached=br.reached_get_cached_block,
        caching_only=frozenset(_branches("get_cached_block", "hit", "hit a free block")),
        cases=Cases(
            pool_state,
            {"caching": True, "block_hash": CONTRACT_HASHES[0]},
            {"hash not bytes": set_to(block_hash="contract-0")},
        ),
        wording=Wording(
            lambda c: f"Look up {c.value('block_hash')} in the hash table.",
            lambda r: "miss: no block has this hash" if r is None else f"hit: block {r}",
        ),
    ),
    Operation(
        name="evict_blocks",
        # the manager's: the blocks whose external load failed (KVCacheManager.evict_blocks)
        levels=("pool", "manager"),
        params=("block_ids",),
        spec=_by_level(spec_ops.evict_blocks, spec_manager.evict_blocks),
        normalize=None,
        branches=_branches(
            "evict_blocks", "dropped a held block's hash", "dropped a free block's hash", "nothing cached"
        ),
        errors=("InvalidBlock", "InvalidRequest"),
        reached=br.reached_evict_blocks,
        caching_only=frozenset(_branches("evict_blocks", "dropped a held block's hash", "dropped a free block's hash")),
        cases=Cases(
            pool_state,
            {"caching": True, "block_ids": (1,)},
            # Plain ids: a class of bad id per mistake (strategies.PLAIN_ID_MISTAKES); "bad id" is the null block.
            {
                "bad id": append_to(block_ids=(0,)),
                "id past the pool": append_to(block_ids=(BAD_ID,)),
                "negative id": append_to(block_ids=(-1,)),
                "named twice": append_to(block_ids=(1,)),
            },
        ),
        is_optional=True,
        wording=Wording(lambda c: f"Evict {c.blocks('block_ids')} from the prefix cache: their hashes are dropped."),
    ),
    Operation(
        name="reset_prefix_cache",
        levels=("pool", "manager"),  # the manager's also records the reset in its statistics
        params=(),
        spec=_by_level(spec_ops.reset_prefix_cache, spec_manager.reset_prefix_cache),
        normalize=_as_bool,
        branches=_branches("reset_prefix_cache", "accepted", "accepted, hashes dropped", "refused, blocks held"),
        reached=br.reached_reset_prefix_cache,
        caching_only=frozenset({"reset_prefix_cache: accepted, hashes dropped"}),
        is_optional=True,  # vLLM v0's allocator has none before 0.7.0
        # A reset of an empty cache changes nothing whatever the answer; skipping it keeps resets from crowding
        # out the rules that build state. Without caching the answer (refused while blocks are held) is all there
        # is to check. (The request level's rule finishes every request first: hand-written.)
        draw=Draw(when=lambda state, enable_caching: not enable_caching or bool(state.hash_to_blocks)),
        wording=Wording(
            lambda c: "Drop every hash from the prefix cache (refused while any block is held).",
            lambda r: "accepted: every hash dropped" if r is True else "refused: a block is still held",
        ),
    ),
    Operation(
        name="is_block_writable",
        levels=("pool",),
        params=("block_id",),
        spec=spec_ops.is_block_writable,
        normalize=_as_bool,
        branches=_branches("is_block_writable", "yes", "no"),
        errors=("InvalidBlock",),
        reached=br.reached_is_block_writable,
        draw=Draw(mistakes=lambda state: ("bad id",), args=draw_block_id),
        cases=Cases(pool_state, {"caching": True, "block_id": 2}, {"bad id": set_to(block_id=BAD_ID)}),
        is_optional=True,
        wording=Wording(
            lambda c: f"Ask whether block {c['block_id']} may be written.",
            lambda r: "yes, writable" if r is True else "no, not writable",
        ),
    ),
    Operation(
        name="get_num_free_blocks",
        levels=("pool",),
        params=(),
        spec=spec_ops.get_num_free_blocks,
        normalize=as_id,
        branches=("get_num_free_blocks",),
        reached=br.reached_itself("get_num_free_blocks"),
        is_count=True,
        is_optional=True,
        wording=Wording(lambda c: "Count the free blocks.", lambda r: f"{r} free"),
    ),
    Operation(
        name="get_usage",
        levels=("pool",),
        params=(),
        spec=spec_ops.get_usage,
        normalize=_as_float,
        branches=("get_usage",),
        reached=br.reached_itself("get_usage"),
        is_optional=True,
        same_result=_close,
        is_count=True,
        wording=Wording(
            lambda c: "Ask what fraction of the pool is in use.",
            lambda r: f"{r:.6g} in use" if isinstance(r, (int, float)) else None,
        ),
    ),
    Operation(
        name="get_computed_blocks",
        levels=("manager",),
        params=("request", "max_cache_hit_length"),
        spec=spec_manager.get_computed_blocks,
        normalize=_as_hit,
        branches=(
            *_branches("get_computed_blocks", "miss", "hit", "hit a free block", "hit capped at len - 1"),
            *_GROUP_HITS,
            *_branches("get_computed_blocks", "lookup skipped by the request", "hit capped by the request's limit"),
        ),
        errors=("InvalidRequest",),
        reached=br.reached_get_computed_blocks,
        caching_only=frozenset(
            (
                *_branches("get_computed_blocks", "hit", "hit a free block", "hit capped at len - 1"),
                *_GROUP_HITS,
                *_branches("get_computed_blocks", "lookup skipped by the request", "hit capped by the request's limit"),
            )
        ),  # fmt: skip
        cases=Cases(
            manager_state,
            REQUEST,
            {
                **REQUEST_MISTAKES,
                "already running": set_to(running=True),
                "bad hit cap": set_to(max_cache_hit_length=-1),
            },
        ),
        layout_only=_GROUP_HITS,
        features=(Feature("max_cache_hit_length", None, "connector hit cap"),),  # None: no cap but the last token
        hit_reached=br.hit_reached_get_computed_blocks,
        wording=Wording(
            lambda c: f"Look up the longest cached prefix of request {c.request_id('request')}.",
            lambda r: (
                (f"hit {blocks(r[0])}: {plural(r[1], 'token')}" if r[0] else "no hit")
                if isinstance(r, list) and len(r) == 2
                else None
            ),
        ),
    ),
    Operation(
        name="get_num_cached_tokens",
        levels=("manager",),
        params=("request",),
        spec=spec_manager.get_num_cached_tokens,
        normalize=as_id,
        branches=_branches("get_num_cached_tokens", "none cached", "cached tokens", "lookup skipped by the request"),
        errors=("InvalidRequest",),
        reached=br.reached_get_num_cached_tokens,
        caching_only=frozenset(_branches("get_num_cached_tokens", "cached tokens", "lookup skipped by the request")),
        cases=Cases(manager_state, REQUEST, REQUEST_MISTAKES),
        is_optional=True,  # vLLM 0.34.0 added it
        wording=Wording(
            lambda c: f"Ask how many tokens of request {c.request_id('request')} are cached (nothing is taken).",
            lambda r: f"{plural(r, 'token')} cached" if isinstance(r, int) else None,
        ),
    ),
    Operation(
        name="allocate_slots",
        levels=("manager",),
        params=(
            "request",
            "num_new_tokens",
            "num_new_computed_tokens",
            "new_computed_blocks",
            "num_external_computed_tokens",
            "delay_cache_blocks",
        ),  # fmt: skip
        spec=spec_manager.allocate_slots,
        normalize=_as_ids_or_none,
        branches=_branches(
            "allocate_slots",
            "admitted",
            "admitted with a prefix hit",
            "external tokens",
            "chunked prefill",
            "decode",
            "registered full blocks",
            "duplicate hash kept",
            "evicted a cached block",
            "too few free blocks",
            "registration delayed for an external load",
        )
        + tuple(_GROUP_STEPS),
        errors=("InvalidRequest", "InvalidBlock"),
        reached=br.reached_allocate_slots,
        caching_only=frozenset(
            _branches(
                "allocate_slots",
                "admitted with a prefix hit",
                "registered full blocks",
                "duplicate hash kept",
                "evicted a cached block",
                "InvalidBlock",
            )
        ),
        cases=Cases(
            manager_state,
            # r's first step: its hit on a's two cached blocks, and its last token
            {
                **REQUEST,
                "num_new_tokens": 1,
                "num_new_computed_tokens": 4,
                "new_computed_blocks": (1, 2),
                "num_external_computed_tokens": 0,
                "delay_cache_blocks": False,
            },
            {
                **REQUEST_MISTAKES,
                "bad count": set_to(num_external_computed_tokens=-1),
                "delay without an external load": set_to(delay_cache_blocks=True),
                "no tokens scheduled": set_to(num_new_tokens=0),
                "hit on a running request": set_to(running=True),
                "hit count mismatch": set_to(num_new_computed_tokens=2),
                "hit without caching": set_to(caching=False),
                "hit longer than the request": Change(
                    sets={"num_new_computed_tokens": 6}, appends={"new_computed_blocks": (3,)}
                ),
                "wrong hit block": set_to(new_computed_blocks=(2, 1)),
                "more tokens than the request has": set_to(num_new_tokens=2),
            },
            {
                # three hit blocks, the first of them wrong
                frozenset({"hit longer than the request", "wrong hit block"}): set_to(
                    num_new_computed_tokens=6, new_computed_blocks=(2, 1, 3)
                ),
            },
        ),
        layout_only=_GROUP_STEPS,
        # False: the external tokens (if any) are loaded within the step
        features=(
            Feature(
                "delay_cache_blocks",
                False,
                "asynchronous external load",
                # cache_blocks is called only for a request whose registration was delayed (the machine's
                # rule needs a loading request): without the feature none of its branches can be reached.
                (
                    "allocate_slots: registration delayed for an external load",
                    "cache_blocks: loaded blocks registered",
                    "cache_blocks: nothing new to register",
                    "cache_blocks: InvalidRequest",
                ),
            ),
        ),
        # A running request's step: no hit, no external tokens, nothing delayed.
        wording=Wording(_allocate_slots_asks, _allocate_slots_answer, quiet_tail=(0, [], 0, False)),
    ),
    Operation(
        name="cache_blocks",
        levels=("manager",),  # the scheduler's, once an asynchronous external load is done
        params=("request", "num_computed_tokens"),
        spec=spec_manager.cache_blocks,
        normalize=None,
        branches=_branches("cache_blocks", "loaded blocks registered", "nothing new to register"),
        errors=("InvalidRequest",),
        reached=br.reached_cache_blocks,
        caching_only=frozenset({"cache_blocks: loaded blocks registered"}),
        cases=Cases(
            manager_state,
            # r runs with one token computed, none of it registered
            {**REQUEST, "running": True, "num_computed_tokens": 1},
            # a finished
            {"not running": set_to(request_id="a"), "tokens out of range": set_to(num_computed_tokens=2)},
        ),
        is_optional=True,
        wording=Wording(
            lambda c: (
                f"Request {c.request_id('request')}'s external load is done: its blocks full within its first "
                f"{c.count('num_computed_tokens', 'token')} are registered in the hash table."
            )
        ),
    ),
    Operation(
        name="free",
        levels=("manager",),
        params=("request_id",),
        spec=spec_manager.free,
        normalize=None,
        branches=(
            *_branches("free", "request finished", "request preempted", "shared blocks kept"),
            "readmitted after preemption",
        ),
        errors=("InvalidRequest",),
        reached=br.reached_free,
        caching_only=frozenset({"free: shared blocks kept"}),
        cases=Cases(
            manager_state,
            {"caching": True, "running": True, "request_id": "r"},
            {"not running": set_to(request_id="a")},  # a finished
        ),
        wording=Wording(
            lambda c: f"Request {c['request_id']} finishes (or is preempted): its blocks are released tail first."
        ),
    ),
)

_BY_NAME: dict[str, Operation] = {op.name: op for op in _TABLE}
# Every operation by name, in table order (a read-only view: `operation_added` is the one way to extend it).
OPERATIONS: Mapping[str, Operation] = MappingProxyType(_BY_NAME)


@contextmanager
def operation_added(operation: Operation) -> Iterator[Operation]:
    """The table with one more operation while the block runs: how a test or a prototype adds one.

    Everything that reads the table (traces, the lock-step core, coverage,
    capabilities, the error contract, the player, stories) sees it, and a
    machine class built while it is in the table (`conformance_machine`)
    draws it when its entry says how (`draw`).

    Raises:
        ValueError: an operation of that name is already in the table.
    """
    if operation.name in _BY_NAME:
        raise ValueError(f"the operations table already has {operation.name!r}")
    _BY_NAME[operation.name] = operation
    try:
        yield operation
    finally:
        del _BY_NAME[operation.name]


def all_args(operation: Operation, args: Sequence[Any]) -> tuple[Any, ...]:
    """Every argument of a call, the trailing ones left out at their defaults (a trace records them all).

    >>> all_args(OPERATIONS["get_computed_blocks"], ("r",))
    ('r', None)
    """
    missing = len(operation.params) - len(args)
    if 0 < missing <= len(operation.defaults):  # trailing parameters with defaults may be left out
        args = (*args, *operation.defaults[len(operation.defaults) - missing :])
    assert len(args) == len(operation.params), f"{operation.name} takes {operation.params}; got {len(args)} arguments"
    return tuple(args)


def level_operations(level: str) -> tuple[Operation, ...]:
    """The operations of one level, in table order.

    >>> [op.name for op in level_operations("manager")][2:]
    ['get_computed_blocks', 'get_num_cached_tokens', 'allocate_slots', 'cache_blocks', 'free']
    """
    return tuple(op for op in _BY_NAME.values() if level in op.levels)


def optional_operations(level: str = "pool") -> tuple[str, ...]:
    """The operations of a level an adapter may lack.

    >>> optional_operations()
    ('evict_blocks', 'reset_prefix_cache', 'is_block_writable', 'get_num_free_blocks', 'get_usage')
    >>> optional_operations("manager")
    ('evict_blocks', 'reset_prefix_cache', 'get_num_cached_tokens', 'cache_blocks')
    """
    return tuple(op.name for op in level_operations(level) if op.is_optional)


def required_methods(level: str) -> tuple[str, ...]:
    """The methods an adapter of a level must have: every operation that is not optional, and `snapshot`.

    >>> required_methods("manager")
    ('get_computed_blocks', 'allocate_slots', 'free', 'snapshot')
    """
    return tuple(op.name for op in level_operations(level) if not op.is_optional) + ("snapshot",)
