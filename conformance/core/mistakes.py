"""Caller mistakes as the operations table describes them: a valid call, and the change that makes each mistake.

Each operation's entry (kvspec.conformance.core.operations) carries its
`Cases`: one valid call (a small spec state built by spec calls, and its
arguments, as named fields) and, for every caller mistake the machine makes
against the operation, the `Change` to the valid call that makes it. The
mistakes' names are the table's (`Operation.mistakes` is read from here), the
machine's (`LockStep.exercises` checks the names it sends) and the error
contract's (kvspec.conformance.core.error_contract runs the spec on every case
and every pair to compute each mistake's error and the order of the checks).

Design choice: the cases are data beside the entry rather than a second table
keyed by operation name, so an operation's mistakes are described once and a
new operation's mistakes are listed by `kvspec errors` as soon as its entry is.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvspec.spec import manager as spec_manager
from kvspec.spec import ops as spec_ops
from kvspec.spec.hashing import MultiModalInput
from kvspec.spec.manager import ManagerState, Request
from kvspec.spec.state import BlockHash, BlockId, PoolState

__all__ = [
    "BAD_ID",
    "CONTRACT_HASHES",
    "PROMPT",
    "REQUEST",
    "REQUEST_MISTAKES",
    "Cases",
    "Change",
    "Fields",
    "append_to",
    "manager_state",
    "pool_state",
    "set_to",
]

Fields = Mapping[str, Any]  # a call's settings (how its state is built) and arguments, by name


@dataclass(frozen=True, slots=True)
class Change:
    """How a mistake changes the valid call: fields set to a value, and list fields with elements appended."""

    sets: Mapping[str, Any] = field(default_factory=dict)  # field -> its new value
    appends: Mapping[str, tuple[Any, ...]] = field(default_factory=dict)  # list field -> elements added at its end

    def applied(self, fields: Fields) -> dict[str, Any]:
        """The fields with this change made."""
        out = dict(fields)
        out.update(self.sets)
        for name, extra in self.appends.items():
            out[name] = tuple(out[name]) + extra
        return out

    def conflicts(self, other: Change) -> bool:
        """Whether the two changes touch one field in a way that cannot hold both (one undoes the other)."""
        mine, theirs = set(self.sets), set(other.sets)
        return bool(mine & theirs or mine & set(other.appends) or theirs & set(self.appends))


def set_to(**values: Any) -> Change:
    """A change that sets fields."""
    return Change(sets=values)


def append_to(**values: tuple[Any, ...]) -> Change:
    """A change that appends to list fields."""
    return Change(appends=values)


@dataclass(frozen=True, slots=True)
class Cases:
    """One operation's canonical cases: a valid call and, per mistake, the change that makes it."""

    state: Callable[[Fields], Any]  # fields -> the spec state the call is made in (pool_state, manager_state)
    valid: Fields  # settings and arguments of a call the spec accepts
    mistakes: Mapping[str, Change]  # every caller mistake of the operation, in the contract's order
    together: Mapping[frozenset[str], Change] = field(default_factory=dict)  # two mistakes in one argument

    def fields(self, *names: str) -> dict[str, Any]:
        """The valid call's fields with the named mistakes' changes made, in that order."""
        out = dict(self.valid)
        for name in names:
            out = self.mistakes[name].applied(out)
        return out

    def build(self, params: Sequence[str], fields: Fields) -> tuple[Any, tuple[Any, ...]]:
        """The spec state and the arguments in call order (`params`, the operation's) of a call with `fields`."""
        args = tuple(
            _request(fields) if p == "request" else list(fields[p]) if isinstance(fields[p], tuple) else fields[p]
            for p in params
        )
        return self.state(fields), args


CONTRACT_HASHES = tuple(BlockHash(b"contract-%d" % i) for i in range(8))  # block hashes of the pool-level cases
PROMPT = (0, 1, 2, 3, 4)  # two full blocks of 2 tokens, and one token after them
_BLOCK_SIZE = 2
BAD_ID = 8  # one past the cases' pool's last block


def _pool(caching: bool) -> PoolState:
    """8 blocks: 1 held with a hash, 2 and 3 held without, 4 free with a hash, 5 to 7 free (caching off: no hashes)."""
    state = spec_ops.new_pool(8, caching)
    state = spec_ops.get_new_blocks(state, 4).state
    if caching:
        state = spec_ops.cache_full_blocks(
            state, [BlockId(1), BlockId(4)], [CONTRACT_HASHES[0], CONTRACT_HASHES[1]]
        ).state
    return spec_ops.free_blocks(state, [BlockId(4)]).state


def pool_state(fields: Fields) -> PoolState:
    """The pool-level cases' state (`_pool`), with caching as the fields say."""
    return _pool(fields["caching"])


def manager_state(fields: Fields) -> ManagerState:
    """Block size 2, 8 blocks; request a ran `PROMPT` and finished (its two full blocks stay cached, free);
    with the field `running`, request r runs with one token scheduled."""
    state = spec_manager.new_manager(8, _BLOCK_SIZE, fields["caching"])
    state = spec_manager.allocate_slots(state, Request("a", PROMPT), len(PROMPT)).state
    state = spec_manager.free(state, "a").state
    if fields["running"]:
        state = spec_manager.allocate_slots(state, Request("r", PROMPT), 1).state
    return state


def _request(f: Fields) -> Request:
    return Request(
        f["request_id"], tuple(f["token_ids"]), mm_inputs=tuple(f["mm_inputs"]),
        prefix_cache_hit_limit=f["prefix_cache_hit_limit"],
    )  # fmt: skip


# The fields of a request-level call: a new request r with `PROMPT` (a's prompt: its blocks are cached).
REQUEST: Fields = {
    "caching": True, "running": False, "request_id": "r", "token_ids": PROMPT, "mm_inputs": (),
    "max_cache_hit_length": None, "prefix_cache_hit_limit": None,
}  # fmt: skip
# Request-level mistakes shared by get_computed_blocks, get_num_cached_tokens and allocate_slots.
REQUEST_MISTAKES: Mapping[str, Change] = {
    "no id": set_to(request_id=""),
    "no tokens": set_to(token_ids=()),
    "bad hit limit": set_to(prefix_cache_hit_limit=-1),
    "misplaced images": set_to(mm_inputs=(MultiModalInput("img-a", len(PROMPT) - 1, 2),)),  # past the last token
}
