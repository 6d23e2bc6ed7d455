"""Every operation the harness drives, described once.

One `Operation` per adapter method: its level, its parameters in call order
(vLLM's names), the spec function that defines it, how a returned value is
put in normal form, whether an adapter may lack it, the spec branches it has
(outcomes and the errors it raises for caller mistakes), which of those only
prefix caching reaches, and the caller mistakes the machine makes against it.
The trace format (parameter names and counts), the lock-step core (the spec
call and the result comparison), coverage (the branches a configuration
should reach), adapter capabilities (the optional operations) and the
runner's method checks are all read from `OPERATIONS`; adding an operation
is one entry here plus its spec function and its implementations.

Design choice: a table of plain records rather than a class per operation
with methods to override; every column is data or a small pure function, so
the table reads as one page and no behaviour hides in a subclass.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

from kvspec.conformance.core import branches as br
from kvspec.spec import manager as spec_manager
from kvspec.spec import ops as spec_ops
from kvspec.spec.attention import parse_groups
from kvspec.spec.state import Snapshot
from kvspec.spec.step import Step

__all__ = [
    "OPERATIONS",
    "BadResult",
    "Level",
    "Operation",
    "level_operations",
    "operation_added",
    "optional_operations",
    "required_methods",
]

Level = Literal["pool", "manager"]
Reached = Callable[[Sequence[Any], Snapshot, Snapshot, Any], list[str]]


class BadResult(Exception):
    """An implementation returned a value that cannot be put in normal form (the message says why)."""


# --- results in normal form ---------------------------------------------------------------


def as_id(v: Any) -> int:
    """A block id as a plain int (numpy ints and other index types accepted, bools refused).

    >>> as_id(3)
    3
    """
    if isinstance(v, bool):
        raise BadResult(f"{v!r} is a bool, not a block id")
    try:
        return operator.index(v)
    except TypeError:
        raise BadResult(f"{v!r} is not an integer block id") from None


def as_ids(v: Any) -> list[int]:
    """A list of block ids as plain ints, from any iterable (not a string).

    >>> as_ids((1, 2))
    [1, 2]
    """
    if isinstance(v, (str, bytes)) or not isinstance(v, Sequence):
        try:
            v = list(v)
        except TypeError:
            raise BadResult(f"{v!r} is not a list of block ids") from None
    return [as_id(b) for b in v]


def _as_bool(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    raise BadResult(f"{v!r} is not a bool")


def _as_id_or_none(v: Any) -> int | None:
    return None if v is None else as_id(v)


def _as_ids_or_none(v: Any) -> list[int] | None:
    return None if v is None else as_ids(v)


def _as_hit(v: Any) -> list[Any]:
    if not isinstance(v, (tuple, list)) or len(v) != 2:
        raise BadResult(f"{v!r} is not (hit blocks, num_hit_tokens)")
    return [as_ids(v[0]), as_id(v[1])]


def _as_float(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise BadResult(f"{v!r} is not a number")
    return float(v)


def _close(a: Any, b: Any) -> bool:
    return bool(abs(a - b) <= 1e-9)


# --- the table ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
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
    errors: tuple[str, ...] = ()  # the spec error types a caller mistake raises ("<name>: <error>" branches)
    reached: Reached = br.reached_nothing  # which branches a step that returned normally reached
    caching_only: frozenset[str] = frozenset()  # branches (outcomes or errors) only prefix caching reaches
    mistakes: tuple[str, ...] = ()  # the caller mistakes the machine makes ("<name>: <mistake>")
    is_optional: bool = False  # an adapter may lack it (an old vLLM has no evict_blocks)
    same_result: Callable[[Any, Any], bool] = operator.eq  # spec and implementation results in normal form
    # Branches only some KV cache group layouts reach: branch -> whether a layout ("full,sliding:8") does.
    layout_only: Mapping[str, Callable[[str], bool]] = field(default_factory=lambda: MappingProxyType({}))
    # Values of trailing parameters a trace written before they existed leaves out (read back as these).
    defaults: tuple[Any, ...] = ()

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


_TABLE: tuple[Operation, ...] = (
    Operation(
        "get_new_blocks",
        ("pool",),
        ("num_blocks",),
        spec_ops.get_new_blocks,
        as_ids,
        _branches("get_new_blocks", "taken", "evicted a cached block"),
        ("PoolExhausted", "InvalidRequest"),
        br.reached_get_new_blocks,
        frozenset({"get_new_blocks: evicted a cached block"}),
        ("more than free", "bad count"),
    ),
    Operation(
        "touch",
        ("pool",),
        ("block_ids",),
        spec_ops.touch,
        None,
        _branches("touch", "hit a free block", "hit a held block"),
        ("InvalidBlock", "InvalidRequest"),
        br.reached_touch,
        frozenset({"touch: hit a free block", "touch: hit a held block", "touch: InvalidRequest"}),
        ("named twice", "bad id", "no hash"),
    ),
    Operation(
        "free_blocks",
        ("pool",),
        ("block_ids",),
        spec_ops.free_blocks,
        None,
        _branches("free_blocks", "to the left end", "to the right end", "between free blocks", "still held by another"),
        ("DoubleFree", "InvalidBlock", "InvalidRequest"),
        br.reached_free_blocks,
        frozenset({"free_blocks: still held by another"}),  # only a touch shares a block
        ("double free", "bad id", "named twice"),
    ),
    Operation(
        "cache_full_blocks",
        ("pool",),
        ("block_ids", "block_hashes"),
        spec_ops.cache_full_blocks,
        None,
        _branches("cache_full_blocks", "registered", "duplicate hash kept"),
        ("AlreadyCached", "InvalidBlock", "InvalidRequest"),
        br.reached_cache_full_blocks,
        frozenset(_branches("cache_full_blocks", "registered", "duplicate hash kept", "AlreadyCached", "InvalidBlock")),
        ("caching off", "bad id", "length mismatch", "named twice", "hash not bytes", "already cached", "not held"),
    ),
    Operation(
        "get_cached_block",
        ("pool",),
        ("block_hash",),
        spec_ops.get_cached_block,
        _as_id_or_none,
        _branches("get_cached_block", "hit", "hit a free block", "miss"),
        ("InvalidRequest",),
        br.reached_get_cached_block,
        frozenset(_branches("get_cached_block", "hit", "hit a free block")),
        ("hash not bytes",),
    ),
    Operation(
        "evict_blocks",
        ("pool", "manager"),  # the manager's: the blocks whose external load failed (KVCacheManager.evict_blocks)
        ("block_ids",),
        _by_level(spec_ops.evict_blocks, spec_manager.evict_blocks),
        None,
        _branches("evict_blocks", "dropped a held block's hash", "dropped a free block's hash", "nothing cached"),
        ("InvalidBlock", "InvalidRequest"),
        br.reached_evict_blocks,
        frozenset(_branches("evict_blocks", "dropped a held block's hash", "dropped a free block's hash")),
        ("bad id", "named twice"),
        is_optional=True,
    ),
    Operation(
        "reset_prefix_cache",
        ("pool", "manager"),  # the manager's also records the reset in its statistics
        (),
        _by_level(spec_ops.reset_prefix_cache, spec_manager.reset_prefix_cache),
        _as_bool,
        _branches("reset_prefix_cache", "accepted", "accepted, hashes dropped", "refused, blocks held"),
        (),
        br.reached_reset_prefix_cache,
        frozenset({"reset_prefix_cache: accepted, hashes dropped"}),
        # vLLM v0's allocator has none before 0.7.0
        is_optional=True,
    ),
    Operation(
        "is_block_writable",
        ("pool",),
        ("block_id",),
        spec_ops.is_block_writable,
        _as_bool,
        _branches("is_block_writable", "yes", "no"),
        ("InvalidBlock",),
        br.reached_is_block_writable,
        mistakes=("bad id",),
        is_optional=True,
    ),
    Operation(
        "get_num_free_blocks",
        ("pool",),
        (),
        spec_ops.get_num_free_blocks,
        as_id,
        ("get_num_free_blocks",),
        reached=br.reached_itself("get_num_free_blocks"),
        is_optional=True,
    ),
    Operation(
        "get_usage",
        ("pool",),
        (),
        spec_ops.get_usage,
        _as_float,
        ("get_usage",),
        reached=br.reached_itself("get_usage"),
        is_optional=True,
        same_result=_close,
    ),
    Operation(
        "get_computed_blocks",
        ("manager",),
        ("request", "max_cache_hit_length"),
        spec_manager.get_computed_blocks,
        _as_hit,
        (
            *_branches("get_computed_blocks", "miss", "hit", "hit a free block", "hit capped at len - 1"),
            *_GROUP_HITS,
        ),
        ("InvalidRequest",),
        br.reached_get_computed_blocks,
        frozenset(
            (*_branches("get_computed_blocks", "hit", "hit a free block", "hit capped at len - 1"), *_GROUP_HITS)
        ),
        ("no tokens", "no id", "misplaced images", "already running", "bad hit cap"),
        layout_only=_GROUP_HITS,
        defaults=(None,),  # max_cache_hit_length: no cap but the last token
    ),
    Operation(
        "allocate_slots",
        ("manager",),
        (
            "request", "num_new_tokens", "num_new_computed_tokens", "new_computed_blocks",
            "num_external_computed_tokens", "delay_cache_blocks",
        ),
        spec_manager.allocate_slots,
        _as_ids_or_none,
        _branches(
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
        ) + tuple(_GROUP_STEPS),
        ("InvalidRequest", "InvalidBlock"),
        br.reached_allocate_slots,
        frozenset(
            _branches(
                "allocate_slots",
                "admitted with a prefix hit",
                "registered full blocks",
                "duplicate hash kept",
                "evicted a cached block",
                "InvalidBlock",
            )
        ),
        (
            "no tokens",
            "no id",
            "misplaced images",
            "no tokens scheduled",
            "bad count",
            "more tokens than the request has",
            "hit count mismatch",
            "hit longer than the request",
            "hit on a running request",
            "wrong hit block",
            "hit without caching",
            "delay without an external load",
        ),
        layout_only=_GROUP_STEPS,
        defaults=(False,),  # delay_cache_blocks: the external tokens (if any) are loaded within the step
    ),
    Operation(
        "cache_blocks",
        ("manager",),  # the scheduler's, once an asynchronous external load is done
        ("request", "num_computed_tokens"),
        spec_manager.cache_blocks,
        None,
        _branches("cache_blocks", "loaded blocks registered", "nothing new to register"),
        ("InvalidRequest",),
        br.reached_cache_blocks,
        frozenset({"cache_blocks: loaded blocks registered"}),
        ("not running", "tokens out of range"),
        is_optional=True,
    ),
    Operation(
        "free",
        ("manager",),
        ("request_id",),
        spec_manager.free,
        None,
        (
            *_branches("free", "request finished", "request preempted", "shared blocks kept"),
            "readmitted after preemption",
        ),
        ("InvalidRequest",),
        br.reached_free,
        frozenset({"free: shared blocks kept"}),
        ("not running",),
    ),
)

_BY_NAME: dict[str, Operation] = {op.name: op for op in _TABLE}
# Every operation by name, in table order (a read-only view: `operation_added` is the one way to extend it).
OPERATIONS: Mapping[str, Operation] = MappingProxyType(_BY_NAME)


@contextmanager
def operation_added(operation: Operation) -> Iterator[Operation]:
    """The table with one more operation while the block runs: how a test or a prototype adds one.

    Everything that reads the table (traces, the lock-step core, coverage,
    capabilities, stories) sees it; the machines do not draw it, since they
    have no rule for it.

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


def level_operations(level: str) -> tuple[Operation, ...]:
    """The operations of one level, in table order.

    >>> [op.name for op in level_operations("manager")]
    ['evict_blocks', 'reset_prefix_cache', 'get_computed_blocks', 'allocate_slots', 'cache_blocks', 'free']
    """
    return tuple(op for op in _BY_NAME.values() if level in op.levels)


def optional_operations(level: str = "pool") -> tuple[str, ...]:
    """The operations of a level an adapter may lack.

    >>> optional_operations()
    ('evict_blocks', 'reset_prefix_cache', 'is_block_writable', 'get_num_free_blocks', 'get_usage')
    >>> optional_operations("manager")
    ('evict_blocks', 'reset_prefix_cache', 'cache_blocks')
    """
    return tuple(op.name for op in level_operations(level) if op.is_optional)


def required_methods(level: str) -> tuple[str, ...]:
    """The methods an adapter of a level must have: every operation that is not optional, and `snapshot`.

    >>> required_methods("manager")
    ('get_computed_blocks', 'allocate_slots', 'free', 'snapshot')
    """
    return tuple(op.name for op in level_operations(level) if not op.is_optional) + ("snapshot",)
