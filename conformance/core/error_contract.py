"""The error contract: every caller mistake of every operation, the error the spec raises, and the order of the checks.

For each operation of the operations table (kvspec.conformance.core.operations)
and each caller mistake it lists, one canonical case: a valid call (a small
spec state built by spec calls, and its arguments) and the change to it that
makes the mistake. Everything the contract says is read from the spec by
running it on those cases:

- the error type and message: the spec's, on the single-mistake case;
- the check: where in the spec's source the error was raised (each mistake
  must have a check of its own);
- the order: every pair of mistakes of an operation is made in one call,
  both ways round (the first mistake's change applied first, then the
  second's, and the reverse; for a list of blocks, which one comes first in
  the list). A mistake reported both ways runs before the other; one that is
  reported whichever comes first in the list is checked in the same pass
  over the list (the first bad block is reported). Two mistakes that can only
  meet in one argument (a count that is both fractional and too large, a
  block that is both free and hashed) get one case of their own, which says
  which check looks first at that argument.

Design choice: the cases (inputs) are written by hand and every output is
computed, so the table cannot drift from the spec; the rejected alternative,
a table of error types and orders written beside the spec, would be one more
copy to keep true (and `kvspec errors` would print it whether or not the spec
still did that). The test (tests/conformance/test_errors.py) checks that the
valid call of each operation succeeds, that each case raises a type the
operations table lists, and that the table and the cases name the same
mistakes.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import combinations
from types import MappingProxyType
from typing import Any

from kvspec.conformance.core.operations import OPERATIONS
from kvspec.spec import manager as spec_manager
from kvspec.spec import ops as spec_ops
from kvspec.spec.errors import BlockManagerError
from kvspec.spec.hashing import MultiModalInput
from kvspec.spec.manager import ManagerState, Request
from kvspec.spec.state import BlockHash, BlockId, PoolState

__all__ = [
    "CASES",
    "Cases",
    "Change",
    "Contract",
    "OperationContract",
    "Precedence",
    "Row",
    "build_contract",
    "call",
    "contract_json",
    "describe_state",
    "render_text",
]

Fields = Mapping[str, Any]  # a call's settings (how its state is built) and arguments, by name


# --- the cases (inputs, written by hand) ------------------------------------------------------------------


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


def _set(**values: Any) -> Change:
    return Change(sets=values)


def _append(**values: tuple[Any, ...]) -> Change:
    return Change(appends=values)


@dataclass(frozen=True, slots=True)
class Cases:
    """One operation's canonical cases: a valid call and, per mistake, the change that makes it."""

    operation: str  # the operations table's name
    valid: Fields  # settings and arguments of a call the spec accepts
    build: Callable[[Fields], tuple[Any, tuple[Any, ...]]]  # fields -> (spec state, arguments in call order)
    mistakes: Mapping[str, Change]  # every mistake the operations table lists for the operation
    together: Mapping[frozenset[str], Change] = field(default_factory=dict)  # two mistakes in one argument

    def fields(self, *names: str) -> dict[str, Any]:
        """The valid call's fields with the named mistakes' changes made, in that order."""
        out = dict(self.valid)
        for name in names:
            out = self.mistakes[name].applied(out)
        return out


_H = tuple(BlockHash(b"contract-%d" % i) for i in range(8))  # block hashes of the pool-level cases
_PROMPT = (0, 1, 2, 3, 4)  # two full blocks of 2 tokens, and one token after them
_BLOCK_SIZE = 2


def _pool(caching: bool) -> PoolState:
    """8 blocks: 1 held with a hash, 2 and 3 held without, 4 free with a hash, 5 to 7 free (caching off: no hashes)."""
    state = spec_ops.new_pool(8, caching)
    state = spec_ops.get_new_blocks(state, 4).state
    if caching:
        state = spec_ops.cache_full_blocks(state, [BlockId(1), BlockId(4)], [_H[0], _H[1]]).state
    return spec_ops.free_blocks(state, [BlockId(4)]).state


def _manager(caching: bool, running: bool) -> ManagerState:
    """Block size 2, 8 blocks; request a ran `_PROMPT` and finished (its two full blocks stay cached, free);
    with `running`, request r runs with one token scheduled."""
    state = spec_manager.new_manager(8, _BLOCK_SIZE, caching)
    state = spec_manager.allocate_slots(state, Request("a", _PROMPT), len(_PROMPT)).state
    state = spec_manager.free(state, "a").state
    if running:
        state = spec_manager.allocate_slots(state, Request("r", _PROMPT), 1).state
    return state


def _request(f: Fields) -> Request:
    return Request(f["request_id"], tuple(f["token_ids"]), mm_inputs=tuple(f["mm_inputs"]))


def _pool_call(*params: str) -> Callable[[Fields], tuple[Any, tuple[Any, ...]]]:
    def build(f: Fields) -> tuple[Any, tuple[Any, ...]]:
        args = tuple(list(f[p]) if isinstance(f[p], tuple) else f[p] for p in params)
        return _pool(f["caching"]), args

    return build


def _manager_call(*params: str) -> Callable[[Fields], tuple[Any, tuple[Any, ...]]]:
    def build(f: Fields) -> tuple[Any, tuple[Any, ...]]:
        args = tuple(
            _request(f) if p == "request" else list(f[p]) if isinstance(f[p], tuple) else f[p] for p in params
        )
        return _manager(f["caching"], f["running"]), args

    return build


_REQUEST = {
    "caching": True, "running": False, "request_id": "r", "token_ids": _PROMPT, "mm_inputs": (),
    "max_cache_hit_length": None,
}  # fmt: skip
_BAD_ID = 8  # one past the pool's last block
# Request-level mistakes shared by get_computed_blocks and allocate_slots.
_REQUEST_MISTAKES = {
    "no id": _set(request_id=""),
    "no tokens": _set(token_ids=()),
    "misplaced images": _set(mm_inputs=(MultiModalInput("img-a", len(_PROMPT) - 1, 2),)),  # past the last token
}

_CASES: tuple[Cases, ...] = (
    Cases(
        "get_new_blocks",
        {"caching": True, "num_blocks": 2},
        _pool_call("num_blocks"),
        {"bad count": _set(num_blocks=-1), "more than free": _set(num_blocks=5)},
        {frozenset({"bad count", "more than free"}): _set(num_blocks=9.5)},
    ),
    Cases(
        "touch",
        {"caching": True, "block_ids": (1,)},
        _pool_call("block_ids"),
        {"bad id": _append(block_ids=(_BAD_ID,)), "named twice": _append(block_ids=(1,)),
         "no hash": _append(block_ids=(2,))},
    ),
    Cases(
        "free_blocks",
        {"caching": True, "block_ids": (2,)},
        _pool_call("block_ids"),
        {"bad id": _append(block_ids=(_BAD_ID,)), "named twice": _append(block_ids=(2,)),
         "double free": _append(block_ids=(5,))},
    ),
    Cases(
        "cache_full_blocks",
        {"caching": True, "block_ids": (2,), "block_hashes": (_H[2],)},
        _pool_call("block_ids", "block_hashes"),
        {
            "caching off": _set(caching=False),
            "length mismatch": _append(block_hashes=(_H[3],)),
            "bad id": _append(block_ids=(_BAD_ID,), block_hashes=(_H[4],)),
            "named twice": _append(block_ids=(2,), block_hashes=(_H[5],)),
            "hash not bytes": _append(block_ids=(3,), block_hashes=("contract-6",)),
            "not held": _append(block_ids=(5,), block_hashes=(_H[6],)),
            "already cached": _append(block_ids=(1,), block_hashes=(_H[7],)),
        },
        {
            frozenset({"hash not bytes", "not held"}): _append(block_ids=(5,), block_hashes=("contract-6",)),
            frozenset({"hash not bytes", "already cached"}): _append(block_ids=(1,), block_hashes=("contract-6",)),
            # block 4 is free and has a hash
            frozenset({"not held", "already cached"}): _append(block_ids=(4,), block_hashes=(_H[6],)),
        },
    ),
    Cases(
        "get_cached_block",
        {"caching": True, "block_hash": _H[0]},
        _pool_call("block_hash"),
        {"hash not bytes": _set(block_hash="contract-0")},
    ),
    Cases(
        "evict_blocks",
        {"caching": True, "block_ids": (1,)},
        _pool_call("block_ids"),
        {"bad id": _append(block_ids=(_BAD_ID,)), "named twice": _append(block_ids=(1,))},
    ),
    Cases(
        "is_block_writable",
        {"caching": True, "block_id": 2},
        _pool_call("block_id"),
        {"bad id": _set(block_id=_BAD_ID)},
    ),
    Cases(
        "get_computed_blocks",
        _REQUEST,
        _manager_call(*OPERATIONS["get_computed_blocks"].params),
        {**_REQUEST_MISTAKES, "already running": _set(running=True), "bad hit cap": _set(max_cache_hit_length=-1)},
    ),
    Cases(
        "allocate_slots",
        # r's first step: its hit on a's two cached blocks, and its last token
        {**_REQUEST, "num_new_tokens": 1, "num_new_computed_tokens": 4, "new_computed_blocks": (1, 2),
         "num_external_computed_tokens": 0, "delay_cache_blocks": False},
        _manager_call(*OPERATIONS["allocate_slots"].params),
        {
            **_REQUEST_MISTAKES,
            "bad count": _set(num_external_computed_tokens=-1),
            "delay without an external load": _set(delay_cache_blocks=True),
            "no tokens scheduled": _set(num_new_tokens=0),
            "hit on a running request": _set(running=True),
            "hit count mismatch": _set(num_new_computed_tokens=2),
            "hit without caching": _set(caching=False),
            "hit longer than the request": Change(
                sets={"num_new_computed_tokens": 6}, appends={"new_computed_blocks": (3,)}
            ),
            "wrong hit block": _set(new_computed_blocks=(2, 1)),
            "more tokens than the request has": _set(num_new_tokens=2),
        },
        {
            # three hit blocks, the first of them wrong
            frozenset({"hit longer than the request", "wrong hit block"}): _set(
                num_new_computed_tokens=6, new_computed_blocks=(2, 1, 3)
            ),
        },
    ),
    Cases(
        "cache_blocks",
        # r runs with one token computed, none of it registered
        {**_REQUEST, "running": True, "num_computed_tokens": 1},
        _manager_call(*OPERATIONS["cache_blocks"].params),
        {"not running": _set(request_id="a"), "tokens out of range": _set(num_computed_tokens=2)},  # a finished
    ),
    Cases(
        "free",
        {"caching": True, "running": True, "request_id": "r"},
        _manager_call("request_id"),
        {"not running": _set(request_id="a")},  # a finished
    ),
)

# The canonical cases of every operation with caller mistakes, in table order.
CASES: Mapping[str, Cases] = MappingProxyType({c.operation: c for c in _CASES})


# --- running the spec ---------------------------------------------------------------------------------------


def call(operation: str, fields: Fields) -> tuple[Any, tuple[Any, ...], BlockManagerError | None]:
    """Build the case's state, call the spec; returns (state, arguments, the error raised or None)."""
    state, args = CASES[operation].build(fields)
    try:
        OPERATIONS[operation].spec(state, *args)
    except BlockManagerError as error:
        return state, args, error
    return state, args, None


def _site(error: BaseException) -> tuple[str, int]:
    """Where the spec raised the error: the check, as (function, line) of the innermost frame."""
    tb = error.__traceback__
    assert tb is not None, "an error caught from a call has a traceback"
    while tb.tb_next is not None:
        tb = tb.tb_next
    return tb.tb_frame.f_code.co_name, tb.tb_lineno


def describe_state(state: Any) -> str:
    """A spec state in one line: the free queue, held and hashed blocks, and running requests.

    >>> describe_state(spec_ops.new_pool(3))
    '3 blocks; free queue [1, 2]; held -; hashed -'
    """
    pool: PoolState = state.pool if isinstance(state, ManagerState) else state
    held = [b for b in range(1, pool.num_gpu_blocks) if pool.ref_cnt[b] > 0]
    hashed = [b for b in range(pool.num_gpu_blocks) if pool.block_hash[b] is not None]
    text = (
        f"{pool.num_gpu_blocks} blocks{'' if pool.config.enable_caching else ', caching off'}; "
        f"free queue {list(pool.free_queue)}; held {', '.join(map(str, held)) or '-'}; "
        f"hashed {', '.join(map(str, hashed)) or '-'}"
    )
    if isinstance(state, ManagerState):
        running = ", ".join(f"{rid} {list(e.tables[0])}" for rid, e in state.requests) or "-"  # one group
        text = f"block_size={state.config.block_size}, {text}; running {running}"
    return text


def _show(value: Any) -> str:
    if isinstance(value, Request):
        images = [(m.identifier, m.offset, m.length) for m in value.mm_inputs]
        extra = f", mm_inputs={images}" if images else ""
        return f"Request({value.request_id!r}, {value.token_ids}{extra})"
    if isinstance(value, list):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    return repr(value)


# --- the contract (outputs, computed) -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Row:
    """One caller mistake of one operation, as the spec answers its canonical case."""

    mistake: str  # the operations table's name for it
    error: str  # the spec error type raised
    order: str  # "1" runs first; "5.2": the second check of the 5th step, a pass over a list (see render_text)
    call: str  # the canonical call
    state: str  # the state it is made in (describe_state)
    message: str  # what the spec says


@dataclass(frozen=True, slots=True)
class Precedence:
    """What one call with two mistakes showed."""

    first: str  # the mistake reported
    then: str  # the one not reported
    how: str  # "always": whichever is made first; "same pass": the one earlier in the list; "one argument"


@dataclass(frozen=True, slots=True)
class OperationContract:
    """One operation's mistakes, in the order the spec checks them."""

    operation: str
    level: str
    params: tuple[str, ...]
    state: str  # the valid call's state
    valid_call: str
    rows: tuple[Row, ...]  # by order
    precedence: tuple[Precedence, ...]  # the evidence for the order


@dataclass(frozen=True, slots=True)
class Contract:
    """Every operation of the table, in table order (those without mistakes have no rows)."""

    operations: tuple[OperationContract, ...]


class _Order:
    """The order of an operation's checks, from which mistake each two-mistake call reported."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = list(names)
        self.before: set[tuple[str, str]] = set()  # (a, b): a is reported when both are made
        self.group = {n: n for n in names}  # union-find: mistakes checked in one pass over a list
        self.evidence: list[Precedence] = []

    def _root(self, name: str) -> str:
        while self.group[name] != name:
            name = self.group[name]
        return name

    def same_pass(self, a: str, b: str) -> None:
        self.group[self._root(a)] = self._root(b)

    def ranks(self) -> dict[str, str]:
        """'n' per mistake, or 'n.k' within a pass over a list; longest-path layers of the precedence graph.

        Raises:
            ValueError: the calls disagree (a cycle): the checks have no order.
        """
        groups = {n: self._root(n) for n in self.names}
        between = {(groups[a], groups[b]) for a, b in self.before if groups[a] != groups[b]}
        within = {(a, b) for a, b in self.before if groups[a] == groups[b]}
        outer = _layers(sorted(set(groups.values())), between)
        result: dict[str, str] = {}
        for root, rank in outer.items():
            members = sorted(n for n in self.names if groups[n] == root)
            if len(members) == 1:
                result[members[0]] = str(rank)
                continue
            inner = _layers(members, {(a, b) for a, b in within if a in members})
            for name in members:
                result[name] = f"{rank}.{inner[name]}"
        return result


def _layers(nodes: Sequence[str], edges: set[tuple[str, str]]) -> dict[str, int]:
    """1 + the longest chain of predecessors, per node.

    >>> _layers(["a", "b", "c"], {("a", "b"), ("b", "c")})
    {'a': 1, 'b': 2, 'c': 3}
    """
    rank: dict[str, int] = {}
    remaining = list(nodes)
    while remaining:
        ready = [n for n in remaining if all(a in rank for a, b in edges if b == n)]
        if not ready:
            raise ValueError(f"the checks of {remaining} have no order: two-mistake calls disagree")
        for n in ready:
            rank[n] = 1 + max((rank[a] for a, b in edges if b == n), default=0)
            remaining.remove(n)
    return rank


def _pairs(cases: Cases, sites: Mapping[tuple[str, int], str]) -> _Order:
    """Every two of an operation's mistakes made in one call: which check reports, and so the order."""
    name_of = cases.operation

    def reported(fields: Fields, a: str, b: str) -> str:
        _, _, error = call(name_of, fields)
        name = sites.get(_site(error)) if error is not None else None
        if name not in (a, b):
            raise ValueError(f"{name_of}: the call with {a!r} and {b!r} was refused for neither")
        assert name is not None
        return name

    order = _Order(list(cases.mistakes))
    for a, b in combinations(cases.mistakes, 2):
        other = {a: b, b: a}
        both = cases.together.get(frozenset({a, b}))
        if both is not None:
            won = reported(both.applied(cases.valid), a, b)
            order.before.add((won, other[won]))
            order.evidence.append(Precedence(won, other[won], "one argument"))
        if cases.mistakes[a].conflicts(cases.mistakes[b]):
            continue
        first, second = reported(cases.fields(a, b), a, b), reported(cases.fields(b, a), a, b)
        if first == second:
            order.before.add((first, other[first]))
            order.evidence.append(Precedence(first, other[first], "always"))
        else:
            order.same_pass(a, b)
            order.evidence.append(Precedence(first, other[first], "same pass"))
    return order


def _operation_contract(cases: Cases) -> OperationContract:
    op = OPERATIONS[cases.operation]
    valid_state, valid_args, valid_error = call(op.name, cases.valid)
    if valid_error is not None:
        raise ValueError(f"{op.name}: the valid call of its cases raised {valid_error!r}")
    singles: dict[str, tuple[Any, tuple[Any, ...], BlockManagerError]] = {}
    sites: dict[tuple[str, int], str] = {}
    for name in cases.mistakes:
        state, args, error = call(op.name, cases.fields(name))
        if error is None:
            raise ValueError(f"{op.name}: the case of {name!r} raised nothing")
        site = _site(error)
        if site in sites:
            raise ValueError(f"{op.name}: {sites[site]!r} and {name!r} are one check ({site[0]}, line {site[1]})")
        sites[site] = name
        singles[name] = (state, args, error)

    order = _pairs(cases, sites)
    ranks = order.ranks()
    rows = [
        Row(
            name,
            type(error).__name__,
            ranks[name],
            f"{op.name}({', '.join(_show(a) for a in args)})",
            describe_state(state),
            str(error),
        )
        for name, (state, args, error) in singles.items()
    ]
    rows.sort(key=lambda r: (tuple(int(p) for p in r.order.split(".")), r.mistake))
    return OperationContract(
        op.name,
        ", ".join(op.levels),
        op.params,
        describe_state(valid_state),
        f"{op.name}({', '.join(_show(a) for a in valid_args)})",
        tuple(rows),
        tuple(order.evidence),
    )


def build_contract() -> Contract:
    """The contract, computed by running the spec on every case.

    Raises:
        ValueError: an operation of the table lists a mistake with no case (or a case names a mistake the table
            does not list), a valid call is refused, a case is not, two mistakes share one check, or the
            two-mistake calls give no order.
    """
    out = []
    for op in OPERATIONS.values():
        cases = CASES.get(op.name)
        listed = set(op.mistakes)
        covered = set(cases.mistakes) if cases is not None else set()
        if listed != covered:
            raise ValueError(
                f"{op.name}: the operations table lists mistakes {sorted(listed)}, the cases {sorted(covered)}"
            )
        if cases is None:
            out.append(OperationContract(op.name, ", ".join(op.levels), op.params, "", "", (), ()))
        else:
            out.append(_operation_contract(cases))
    return Contract(tuple(out))


def contract_json(contract: Contract) -> dict[str, Any]:
    """The contract as a JSON document (what `kvspec errors --json` writes)."""
    return {
        "operations": [
            {
                "operation": oc.operation,
                "level": oc.level,
                "params": list(oc.params),
                "state": oc.state,
                "valid_call": oc.valid_call,
                "mistakes": [
                    {"mistake": r.mistake, "error": r.error, "order": r.order, "call": r.call, "state": r.state,
                     "message": r.message}
                    for r in oc.rows
                ],
                "precedence": [{"first": p.first, "then": p.then, "how": p.how} for p in oc.precedence],
            }
            for oc in contract.operations
        ]
    }


def render_text(contract: Contract, width: int = 120) -> str:
    """One compact table per operation: order, mistake, error type, and the canonical call with the spec's answer."""

    lines = [
        "The error contract: each caller mistake of each operation, the error type the spec raises for it, and the",
        "order of the checks, computed by running the spec on one call per mistake and on every pair of mistakes",
        "(kvspec.conformance.core.error_contract). Order 1 is checked first: of two mistakes in one call, the lower",
        "order is reported. n.1, n.2: one pass over a list of blocks, so the mistake at the earlier block is",
        "reported, and at one block the lower. A refused call leaves the state as it was.",
    ]
    widths = (5, 32, 14)
    indent = 2 + sum(widths) + 2 * len(widths)
    for oc in contract.operations:
        lines += [""] + textwrap.wrap(f"{oc.operation}({', '.join(oc.params)})", width, subsequent_indent="    ")
        if not oc.rows:
            lines.append(f"  {oc.level} level; no caller mistake: every call is valid")
            continue
        lines += textwrap.wrap(f"{oc.level} level; state: {oc.state}", width - 2, initial_indent="  ",
                               subsequent_indent="    ")
        lines += textwrap.wrap(f"valid: {oc.valid_call}", width - 2, initial_indent="  ", subsequent_indent="    ")
        header = ("order", "mistake", "error")
        lines.append("  " + "  ".join(h.ljust(w) for h, w in zip(header, widths)) + "  call, then what the spec says")
        for r in oc.rows:
            text = r.call if r.state == oc.state else f"{r.call}  (state: {r.state})"
            first = "  " + "  ".join(c.ljust(w) for c, w in zip((r.order, r.mistake, r.error), widths)) + "  "
            body = textwrap.wrap(text, width - indent) + textwrap.wrap(r.message, width - indent - 2)
            lines.append(first + body[0])
            call_lines = len(textwrap.wrap(text, width - indent))
            for i, part in enumerate(body[1:], start=1):
                lines.append(" " * (indent + (2 if i >= call_lines else 0)) + part)
    return "\n".join(lines)
