"""The error contract: every caller mistake of every operation, the error the spec raises, and the order of the checks.

For each operation of the operations table (kvspec.conformance.core.operations)
and each caller mistake its entry lists, one canonical case, the entry's own
(`Operation.cases`, kvspec.conformance.core.mistakes): a valid call (a small
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
valid call of each operation succeeds and that each case raises a type the
operations table lists; the mistakes the machine makes and the cases are one
list (`Operation.mistakes` is read from the cases), so they cannot disagree.
"""

from __future__ import annotations

import textwrap
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import combinations
from typing import Any

from kvspec.conformance.core.mistakes import Cases, Change, Fields
from kvspec.conformance.core.operations import OPERATIONS, Operation
from kvspec.spec.errors import BlockManagerError
from kvspec.spec.manager import ManagerState, Request
from kvspec.spec.state import PoolState

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


class _TableCases(Mapping[str, Cases]):
    """The cases of every operation of the table that has caller mistakes, by name, in table order (a live view:
    an operation added to the table is in it)."""

    def __getitem__(self, name: str) -> Cases:
        cases = OPERATIONS[name].cases
        if cases is None:
            raise KeyError(name)
        return cases

    def __iter__(self) -> Iterator[str]:
        return (op.name for op in OPERATIONS.values() if op.cases is not None)

    def __len__(self) -> int:
        return sum(1 for _ in self)


# The canonical cases of every operation with caller mistakes, in table order (each entry's `cases`).
CASES: Mapping[str, Cases] = _TableCases()


# --- running the spec ---------------------------------------------------------------------------------------


def call(operation: str, fields: Fields) -> tuple[Any, tuple[Any, ...], BlockManagerError | None]:
    """Build the case's state, call the spec; returns (state, arguments, the error raised or None)."""
    return _call(OPERATIONS[operation], CASES[operation], fields)


def _call(op: Operation, cases: Cases, fields: Fields) -> tuple[Any, tuple[Any, ...], BlockManagerError | None]:
    """`call` with the cases given (a test may check cases that are not the table's)."""
    state, args = cases.build(op.params, fields)
    try:
        op.spec(state, *args)
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

    >>> from kvspec.spec import ops as spec_ops
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


def _pairs(name_of: str, cases: Cases, sites: Mapping[tuple[str, int], str]) -> _Order:
    """Every two of an operation's mistakes made in one call: which check reports, and so the order."""

    def reported(fields: Fields, a: str, b: str) -> str:
        _, _, error = _call(OPERATIONS[name_of], cases, fields)
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


def _operation_contract(op: Operation, cases: Cases) -> OperationContract:
    valid_state, valid_args, valid_error = _call(op, cases, cases.valid)
    if valid_error is not None:
        raise ValueError(f"{op.name}: the valid call of its cases raised {valid_error!r}")
    singles: dict[str, tuple[Any, tuple[Any, ...], BlockManagerError]] = {}
    sites: dict[tuple[str, int], str] = {}
    for name in cases.mistakes:
        state, args, error = _call(op, cases, cases.fields(name))
        if error is None:
            raise ValueError(f"{op.name}: the case of {name!r} raised nothing")
        site = _site(error)
        if site in sites:
            raise ValueError(f"{op.name}: {sites[site]!r} and {name!r} are one check ({site[0]}, line {site[1]})")
        sites[site] = name
        singles[name] = (state, args, error)

    order = _pairs(op.name, cases, sites)
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
    """The contract, computed by running the spec on every case of every operation of the table.

    Raises:
        ValueError: a valid call is refused, a case is not, two mistakes share one check, or the
            two-mistake calls give no order.
    """
    out = []
    for op in OPERATIONS.values():
        if op.cases is None:
            out.append(OperationContract(op.name, ", ".join(op.levels), op.params, "", "", (), ()))
        else:
            out.append(_operation_contract(op, op.cases))
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
                    {
                        "mistake": r.mistake,
                        "error": r.error,
                        "order": r.order,
                        "call": r.call,
                        "state": r.state,
                        "message": r.message,
                    }
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
        lines += textwrap.wrap(
            f"{oc.level} level; state: {oc.state}", width - 2, initial_indent="  ", subsequent_indent="    "
        )
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
