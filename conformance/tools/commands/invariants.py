"""`kvspec invariants`: every rule of the block manager, in plain words, and everything that checks it.

One row per state invariant, per hit rule and per step rule of
spec.invariants, plus the writable rule: its name, its id in docs/design.md,
the rule (the predicate's docstring, the text students read), and where it is
enforced: the spec operations whose contracts check it, whether the
conformance state machine checks it, and the z3 lemma that proves it. The
"where" is read from the code, not written down: a contract or the machine
enforces a rule when the rule's predicate (or the registry holding it) is
reachable from the contract's or the machine's code (the machine's code
includes the spec functions of the operations table, which it runs beside
the implementation and compares). The lemmas are read from the lemma
registry (spec/lemmas/__init__.py); without z3 installed, from its source,
so the column does not depend on the `proofs` extra.

A rule with no predicate of its own (`hit_salt_isolated`) is enforced
through other rules; its row names them, says why they suffice, and names
the mutants (kvspec.mutants) those checks must kill.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import inspect
import json
import textwrap
import types
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvspec.conformance.core.operations import OPERATIONS
from kvspec.spec import invariants as spec_invariants

__all__ = ["INDIRECT", "Row", "lemma_claims_from_source", "register", "rows", "run"]

CONTRACT_MODULES = ("kvspec.spec.ops", "kvspec.spec.manager", "kvspec.spec.ordering")
# The conformance machines and the lock-step core that checks each of their steps.
MACHINE_MODULES = ("kvspec.conformance.core.machine", "kvspec.conformance.core.lockstep")
LEMMA_PACKAGE = "kvspec.spec.lemmas"


@dataclass(frozen=True)
class Row:
    """One rule and where it is enforced."""

    kind: str  # "state invariant", "hit rule", "step rule", or "write rule"
    name: str  # the predicate's name in spec.invariants
    design_id: str  # its id in docs/design.md ("" when it only guards the others)
    rule: str  # the rule in plain words
    contracts: tuple[str, ...]  # spec functions whose contracts check it
    machine: bool  # the conformance state machine checks it
    lemmas: tuple[str, ...]  # "7 lemma_invariants_inductive", ...
    through: tuple[str, ...] = ()  # for a rule with no predicate of its own: the rules that enforce it
    how: str = ""  # why those rules enforce it, in plain words
    mutants: tuple[str, ...] = ()  # wrong implementations those checks must catch (kvspec mutants --only NAME)


@dataclass(frozen=True)
class _Indirect:
    """How a rule with no predicate of its own is enforced."""

    through: tuple[str, ...]  # the rules (spec.invariants names) whose checks enforce it
    how: str  # why they suffice
    mutants: tuple[str, ...]  # the mutants that break it, which those checks must catch


# The hit rules spec.invariants lists by name only, with no predicate to call.
INDIRECT: dict[str, _Indirect] = {
    "hit_salt_isolated": _Indirect(
        through=("hit_prefix_closed",),
        how=(
            "the spec's hash chain keys cache_salt on a request's first block, the LoRA name on every block and "
            "a multimodal input on the blocks it overlaps (spec.hashing.block_extra_keys), so a block cached "
            "under another key is not on the request's own chain, and a hit on it breaks hit_prefix_closed "
            "(judged on the spec's state and the request's spec chain); the lock-step comparison of hit blocks "
            "and of hashes as names catches it as well"
        ),
        mutants=("cache_salt_ignored", "lora_ignored", "multimodal_ignored"),
    ),
}


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
    # The lock-step core calls each operation's spec function through the operations table (a
    # mapping, which _reachable does not follow) and compares the implementation's result with it.
    roots.extend(op.spec for op in OPERATIONS.values())
    return roots


# --- the lemma column -----------------------------------------------------------------------


def _lemma_claims() -> list[tuple[str, tuple[str, ...]]]:
    """(lemma label, invariant names or design ids it proves), from the registry, or its source without z3."""
    try:
        # optional dependency (the proofs extra): the lemmas import z3
        from kvspec.spec.lemmas import LEMMAS
    except ImportError:
        return lemma_claims_from_source()
    return [(f"{lem.number} {lem.name}", lem.invariants) for lem in LEMMAS if lem.invariants]


class _LemmaSource:
    """Module-level values of the lemma package, evaluated from its source files: nothing is imported.

    Design choice: the claims are written once, in the registry, and read
    from its source when it cannot be imported (its modules import z3); the
    rejected alternative, a z3-free copy of the claims beside this command,
    would drift from the lemmas it describes.

    Enough Python for what the registry's `Lemma(...)` calls use: literals,
    tuples, module constants (`tail_first.NAME`), names imported from a
    module of the package, and `tuple(M)` of a dict literal M (its keys; a
    dict literal is read as the tuple of its keys, its values are never needed).
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder  # spec/lemmas/
        self._trees: dict[str, ast.Module] = {}

    def tree(self, module: str) -> ast.Module:
        """The parsed source of a module of the package ("__init__" for the package itself)."""
        if module not in self._trees:
            self._trees[module] = ast.parse((self.folder / f"{module}.py").read_text(encoding="utf-8"))
        return self._trees[module]

    def value(self, node: ast.expr, module: str) -> Any:
        """The value of an expression in `module`'s namespace.

        Raises:
            ValueError: the expression is of a kind this reader does not evaluate.
        """
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, (ast.Tuple, ast.List)):
            return tuple(self.value(e, module) for e in node.elts)
        if isinstance(node, ast.Dict):
            return tuple(self.value(k, module) for k in node.keys if k is not None)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "tuple":
            return tuple(self.value(node.args[0], module))
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            return self.name(node.attr, self._imported_module(node.value.id, module))
        if isinstance(node, ast.Name):
            return self.name(node.id, module)
        raise ValueError(f"{module}.py: cannot read {ast.unparse(node)!r} without importing it")

    def name(self, name: str, module: str) -> Any:
        """The value a module-level name of `module` is assigned, or imports from a module of the package."""
        for stmt in self.tree(module).body:
            if isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in stmt.targets):
                return self.value(stmt.value, module)
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.target.id == name:
                if stmt.value is None:
                    raise ValueError(f"{module}.py: {name!r} is declared without a value")
                return self.value(stmt.value, module)
            if isinstance(stmt, ast.ImportFrom) and (stmt.module or "").startswith(LEMMA_PACKAGE + "."):
                for alias in stmt.names:
                    if (alias.asname or alias.name) == name:
                        return self.name(alias.name, (stmt.module or "").rsplit(".", 1)[-1])
        raise ValueError(f"{module}.py: no module-level value named {name!r}")

    def _imported_module(self, alias: str, module: str) -> str:
        """The module of the package that `alias` names in `module` (`from kvspec.spec.lemmas import x`)."""
        for stmt in self.tree(module).body:
            if isinstance(stmt, ast.ImportFrom) and stmt.module == LEMMA_PACKAGE:
                for imported in stmt.names:
                    if (imported.asname or imported.name) == alias:
                        return imported.name
        raise ValueError(f"{module}.py: {alias!r} is not a module of {LEMMA_PACKAGE}")


def _lemma_calls(source: _LemmaSource) -> list[ast.Call]:
    """The `Lemma(...)` calls of the registry's `LEMMAS` tuple, in order."""
    for stmt in source.tree("__init__").body:
        if not isinstance(stmt, ast.AnnAssign) or not isinstance(stmt.target, ast.Name):
            continue
        if stmt.target.id == "LEMMAS" and isinstance(stmt.value, ast.Tuple):
            return [e for e in stmt.value.elts if isinstance(e, ast.Call)]
    raise ValueError(f"{LEMMA_PACKAGE}: no LEMMAS tuple in __init__.py")


def lemma_claims_from_source() -> list[tuple[str, tuple[str, ...]]]:
    """What `LEMMAS` claims, read from spec/lemmas/__init__.py's source (which imports z3) without importing it.

    Returns:
        (label, invariants) for each lemma that names invariants; empty if the
        package's source cannot be found or read (tests check the reading
        equals `LEMMAS` wherever z3 is installed).
    """
    found = importlib.util.find_spec(LEMMA_PACKAGE)  # imports kvspec.spec, which needs no z3
    if found is None or found.origin is None:
        return []
    source = _LemmaSource(Path(found.origin).parent)
    claims: list[tuple[str, tuple[str, ...]]] = []
    try:
        for call in _lemma_calls(source):
            given = {kw.arg: kw.value for kw in call.keywords} | dict(zip(("number", "name"), call.args))
            if "invariants" not in given:
                continue
            invariants = given["invariants"]
            number, name = source.value(given["number"], "__init__"), source.value(given["name"], "__init__")
            claims.append((f"{number} {name}", tuple(source.value(invariants, "__init__"))))
    except (OSError, SyntaxError, ValueError, IndexError, KeyError):
        return []
    return claims


# --- the table ------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Rule:
    kind: str
    name: str
    design_id: str
    text: str
    predicates: tuple[object, ...]  # what enforcing it means reaching: its predicate and its registry


def _rules() -> list[_Rule]:
    """Every rule in registry order; a rule with no predicate stands for the predicates it is enforced through."""
    inv = spec_invariants
    rules = [_Rule("state invariant", i.name, i.design_id, i.rule, (i.check, inv.INVARIANTS)) for i in inv.INVARIANTS]
    for hit in inv.HIT_RULES:
        names = INDIRECT[hit.name].through if hit.name in INDIRECT else (hit.name,)
        predicates = tuple(getattr(inv, n) for n in names if hasattr(inv, n))
        rules.append(_Rule("hit rule", hit.name, hit.design_id, hit.rule, predicates))
    rules += [_Rule("step rule", s.name, s.design_id, s.rule, (s.check, inv.STEP_RULES)) for s in inv.STEP_RULES]
    rules += [_Rule("event rule", e.name, e.design_id, e.rule, (e.check, inv.EVENT_RULES)) for e in inv.EVENT_RULES]
    writable = inv.is_block_writable
    text = (writable.__doc__ or "").strip().split("\n\n")[0]
    rules.append(_Rule("write rule", writable.__name__, "writable", text, (writable,)))
    return rules


def rows() -> list[Row]:
    """Every rule, in registry order, with where it is enforced."""
    design_of = {inv.name: inv.design_id for inv in spec_invariants.INVARIANTS}
    per_function = {
        f"{fn.__module__.rsplit('.', 1)[-1]}.{fn.__name__}": _reachable([fn]) for fn in _contract_functions()
    }
    machine_roots = _machine_roots()
    machine = _reachable(machine_roots) if machine_roots is not None else set()
    lemmas = _lemma_claims()

    def proved_by(names: tuple[str, ...], design_id: str) -> tuple[str, ...]:
        # A lemma proves a rule it names, or one sharing the design id of an invariant it names.
        return tuple(
            label
            for label, claims in lemmas
            if set(names) & set(claims) or (design_id and design_id in {design_of.get(c, c) for c in claims})
        )

    result = []
    for rule in _rules():
        marks = {id(p) for p in rule.predicates}
        indirect = INDIRECT.get(rule.name)
        result.append(
            Row(
                kind=rule.kind,
                name=rule.name,
                design_id=rule.design_id,
                rule=" ".join(rule.text.split()),
                contracts=tuple(f for f, reached in per_function.items() if marks & reached),
                machine=bool(marks & machine),
                # An indirect rule is proved only by a lemma about itself, not by one about the rules it uses.
                lemmas=proved_by((rule.name,), "" if indirect else rule.design_id),
                through=indirect.through if indirect else (),
                how=indirect.how if indirect else "",
                mutants=indirect.mutants if indirect else (),
            )
        )
    return result


def register(subparsers: Any) -> None:
    """Add the `invariants` subcommand."""
    p = subparsers.add_parser(
        "invariants",
        help="list every invariant in plain words and what enforces it",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        epilog="exit codes: 0 the table printed; 2 a bad flag",
    )
    p.add_argument("--json", action="store_true", help="print the table as JSON")
    p.set_defaults(run=run)


_MACHINE_CHECKS = {
    "state invariant": "after every step",
    "hit rule": "on every hit",
    "step rule": "on every step",
    "write rule": "on every call, against the spec",
    "event rule": "on every step's KV cache events (check --events)",
}


def _where(row: Row, every: tuple[str, ...]) -> list[str]:
    if row.contracts and row.contracts == every:
        contracts = f"all {len(every)} operations (*)"
    else:
        contracts = ", ".join(row.contracts) if row.contracts else "-"
    lines = [
        f"contract: {contracts}",
        f"state machine: {_MACHINE_CHECKS[row.kind] if row.machine else '-'}",
        f"lemma: {'; '.join(row.lemmas) if row.lemmas else '-'}",
    ]
    if row.through:
        lines.append(f"through {', '.join(row.through)}: {row.how}")
    if row.mutants:
        lines.append(f"mutants it catches: {', '.join(row.mutants)}")
    return lines


def render_text(table: list[Row]) -> str:
    """The rows as one table: rule | design id | in plain words | enforced by."""
    widths = (30, 22, 56, 44)
    header = ("rule", "design id", "in plain words", "enforced by")
    rule_line = "-+-".join("-" * w for w in widths)
    # The operations whose contracts check every state invariant (all_hold before and after).
    every = max((row.contracts for row in table if row.kind == "state invariant"), key=len, default=())
    lines = [
        "Every rule of the block manager, and what enforces it: the spec's contracts (icontract, searched by",
        "`kvspec contracts`), the conformance state machine (`kvspec check`), a z3 lemma (`kvspec prove`).",
        "Design ids are those of docs/design.md.",
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
