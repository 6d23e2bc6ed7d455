"""`kvspec invariants`: every rule of the block manager, in plain words, and everything that checks it.

One row per state invariant, per hit rule and per step rule of
spec.invariants, plus the writable rule: its name, its id in DESIGN.md, the
rule (the predicate's docstring, the text students read), and where it is
enforced: the spec operations whose contracts check it, whether the
conformance state machine checks it on every step, and the z3 lemma that
proves it. The "where" is read from the code, not written down: a contract or
the machine enforces a rule when the rule's predicate (or the registry holding
it) is reachable from the contract's or the machine's code.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import textwrap
import types
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from kvspec.spec import invariants as spec_invariants

__all__ = ["Row", "register", "rows", "run"]

CONTRACT_MODULES = ("kvspec.spec.ops", "kvspec.spec.manager", "kvspec.spec.ordering")
# The conformance machines and the lock-step core that checks each of their steps.
MACHINE_MODULES = ("kvspec.conformance.machine", "kvspec.conformance.lockstep")


@dataclass(frozen=True)
class Row:
    """One rule and where it is enforced."""

    kind: str  # "state invariant", "hit rule", "step rule", or "write rule"
    name: str  # the predicate's name in spec.invariants
    design_id: str  # its id in DESIGN.md ("" when it only guards the others)
    rule: str  # the rule in plain words
    contracts: tuple[str, ...]  # spec functions whose contracts check it
    machine: bool  # the conformance state machine checks it on every step
    lemmas: tuple[str, ...]  # "7 lemma_invariants_inductive", ...


def _code_objects(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_objects(const)


def _reachable(roots: Iterable[object]) -> set[int]:
    """ids of every object the roots' code can reach through global names and module attributes.

    An over-approximation on purpose: an attribute name, or a string constant
    that is an identifier (operations dispatched by name), counts on every
    module the code names. Only functions of kvspec are followed.
    """
    seen: set[int] = set()
    stack = list(roots)
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        fn = inspect.unwrap(obj) if callable(obj) and not isinstance(obj, type) else obj
        if isinstance(obj, type):
            stack.extend(v for v in vars(obj).values() if inspect.isfunction(v))
            continue
        if not inspect.isfunction(fn) or not fn.__module__.startswith("kvspec"):
            continue
        stack.extend(_contract_conditions(obj))
        names: set[str] = set()
        for code in _code_objects(fn.__code__):
            names.update(code.co_names)
            names.update(c for c in code.co_consts if isinstance(c, str) and c.isidentifier())
        modules = [v for v in fn.__globals__.values() if isinstance(v, types.ModuleType)]
        for name in names:
            if name in fn.__globals__:
                stack.append(fn.__globals__[name])
            for module in modules:
                if hasattr(module, name):
                    stack.append(getattr(module, name))
    return seen


def _contract_conditions(fn: object) -> list[Callable[..., object]]:
    pre = [c.condition for group in getattr(fn, "__preconditions__", []) for c in group]
    post = [c.condition for c in getattr(fn, "__postconditions__", [])]
    return pre + post


def _contract_functions() -> list[Callable[..., object]]:
    found: list[Callable[..., object]] = []
    for module_name in CONTRACT_MODULES:
        module = importlib.import_module(module_name)
        for member in vars(module).values():
            if inspect.isfunction(member) and member.__module__ == module.__name__ and _contract_conditions(member):
                found.append(member)
    return found


def _machine_roots() -> list[object] | None:
    roots: list[object] = []
    for name in MACHINE_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            return None
        roots.extend(v for v in vars(module).values() if getattr(v, "__module__", None) == module.__name__)
    return roots


def _lemma_claims() -> list[tuple[str, tuple[str, ...]]]:
    """(lemma label, invariant names or DESIGN ids it proves); empty when z3 is missing."""
    try:
        from kvspec.spec.lemmas import LEMMAS
    except ImportError:
        return []
    return [(f"{lem.number} {lem.name}", lem.invariants) for lem in LEMMAS if lem.invariants]


def rows() -> list[Row]:
    """Every rule, in registry order, with where it is enforced."""
    design_of = {inv.name: inv.design_id for inv in spec_invariants.INVARIANTS}
    rules: list[tuple[str, str, str, str, list[object]]] = []
    for inv in spec_invariants.INVARIANTS:
        rules.append(("state invariant", inv.name, inv.design_id, inv.rule, [inv.check, spec_invariants.INVARIANTS]))
    for hit in spec_invariants.HIT_RULES:
        predicate = getattr(spec_invariants, hit.name, None)
        rules.append(("hit rule", hit.name, hit.design_id, hit.rule, [predicate] if predicate else []))
    for step in spec_invariants.STEP_RULES:
        rules.append(("step rule", step.name, step.design_id, step.rule, [step.check, spec_invariants.STEP_RULES]))
    writable = spec_invariants.is_block_writable
    rule = (writable.__doc__ or "").strip().split("\n\n")[0]
    rules.append(("write rule", writable.__name__, "writable", rule, [writable]))

    per_function = {
        f"{fn.__module__.rsplit('.', 1)[-1]}.{fn.__name__}": _reachable([fn]) for fn in _contract_functions()
    }
    machine_roots = _machine_roots()
    machine = _reachable(machine_roots) if machine_roots is not None else set()
    lemmas = _lemma_claims()

    def proved_by(name: str, design_id: str) -> tuple[str, ...]:
        # A lemma proves a rule it names, or one sharing the DESIGN id of an invariant it names.
        return tuple(
            label
            for label, claims in lemmas
            if name in claims or (design_id and design_id in {design_of.get(c, c) for c in claims})
        )

    result = []
    for kind, name, design_id, text, predicates in rules:
        marks = {id(p) for p in predicates}
        result.append(
            Row(
                kind=kind,
                name=name,
                design_id=design_id,
                rule=" ".join(text.split()),
                contracts=tuple(f for f, reached in per_function.items() if marks & reached),
                machine=bool(marks & machine),
                lemmas=proved_by(name, design_id),
            )
        )
    return result


def register(subparsers: Any) -> None:
    """Add the `invariants` subcommand."""
    p = subparsers.add_parser(
        "invariants",
        help="list every invariant in plain words and what enforces it",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    p.add_argument("--json", action="store_true", help="print the table as JSON")
    p.set_defaults(run=run)


_MACHINE_CHECKS = {
    "state invariant": "after every step",
    "hit rule": "on every hit",
    "step rule": "on every step",
    "write rule": "on every call, against the spec",
}


def _where(row: Row, every: tuple[str, ...]) -> list[str]:
    if row.contracts and row.contracts == every:
        contracts = f"all {len(every)} operations (*)"
    else:
        contracts = ", ".join(row.contracts) if row.contracts else "-"
    return [
        f"contract: {contracts}",
        f"state machine: {_MACHINE_CHECKS[row.kind] if row.machine else '-'}",
        f"lemma: {'; '.join(row.lemmas) if row.lemmas else '-'}",
    ]


def render_text(table: list[Row]) -> str:
    """The rows as one table: rule | DESIGN id | in plain words | enforced by."""
    widths = (30, 22, 56, 44)
    header = ("rule", "DESIGN id", "in plain words", "enforced by")
    rule_line = "-+-".join("-" * w for w in widths)
    # The operations whose contracts check every state invariant (all_hold before and after).
    every = max((row.contracts for row in table if row.kind == "state invariant"), key=len, default=())
    lines = [
        "Every rule of the block manager, and what enforces it: the spec's contracts (icontract, searched by",
        "`kvspec contracts`), the conformance state machine (`kvspec check`), a z3 lemma (`kvspec prove`).",
        f"(*) the pre- and postconditions of {', '.join(every)}",
        "",
        " | ".join(h.ljust(w) for h, w in zip(header, widths)),
        rule_line,
    ]
    kind = None
    for row in table:
        if row.kind != kind:
            kind = row.kind
            lines.append(f"{kind}s:")
        cells = [
            textwrap.wrap(row.name, widths[0]) or [""],
            textwrap.wrap(row.design_id or "(guard)", widths[1]),
            textwrap.wrap(row.rule, widths[2]),
            [part for line in _where(row, every) for part in textwrap.wrap(line, widths[3], subsequent_indent="  ")],
        ]
        height = max(len(c) for c in cells)
        for i in range(height):
            lines.append(" | ".join((c[i] if i < len(c) else "").ljust(w) for c, w in zip(cells, widths)).rstrip())
        lines.append(rule_line)
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Print the table."""
    table = rows()
    if args.json:
        print(json.dumps([row.__dict__ for row in table], indent=2))
    else:
        print(render_text(table))
    return 0
