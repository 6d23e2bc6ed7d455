"""What a vLLM measures as, beside what kvspec's table declares for a release (`kvspec facts IMPL`).

The measuring is ``kvspec.conformance.targets.vllm.measure``'s; this module
only sets the measured facts beside one declared release's and writes them
out three ways: a table with every differing row marked, the
``ReleaseFacts(...)`` literal of the row a maintainer adds to releases.py,
and JSON. A fact not measured is said to be so everywhere: in the table, as
a comment on its line of the literal (its value taken from the release
beside it), and as ``measured: false`` in JSON. It never counts as differing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvspec.conformance.targets.vllm.measure import FACT_FIELDS, MeasuredFacts
from kvspec.conformance.targets.vllm.releases import RELEASES, facts_for, version_key

__all__ = ["FactRow", "beside_release", "compare", "entry_literal", "format_table", "rows_json"]

_MAX_WIDTH = 36  # of the table's columns


@dataclass(frozen=True, slots=True)
class FactRow:
    """One fact: what was measured (or why not) and what the release beside it declares."""

    field: str  # the ReleaseFacts field
    measured: bool  # False: not measured, ``why_not`` says why
    value: Any  # the measured value (None where not measured)
    why_not: str | None  # why it was not measured
    declared: Any  # the value the release beside it declares

    @property
    def differs(self) -> bool:
        """Measured, and not what the release beside it declares."""
        return self.measured and self.value != self.declared


def beside_release(version: str) -> str:
    """The declared release to set a measured vLLM beside: the newest at or below its version, else the oldest.

    >>> beside_release("0.34.1.dev3+g1234abc"), beside_release("0.33.0"), beside_release("99.0.0")
    ('0.34.0', '0.33.0', '0.34.0')

    Raises:
        ValueError: ``version`` does not start with a release number.
    """
    key = version_key(version)
    below = [v for v in RELEASES if version_key(v) <= key]
    return below[-1] if below else RELEASES[0]


def compare(measured: MeasuredFacts, beside: str) -> list[FactRow]:
    """One row per fact, in ``ReleaseFacts``' order, beside the declared release ``beside``."""
    declared = facts_for(beside)
    values, why_not = measured.values, measured.not_measured
    return [
        FactRow(name, name in values, values.get(name), why_not.get(name), getattr(declared, name))
        for name in FACT_FIELDS
    ]


def format_table(measured: MeasuredFacts, beside: str, rows: list[FactRow]) -> str:
    """The rows as a table, ``*`` before each measured fact that differs from ``beside``'s, then a summary."""
    shown = [(r.field, repr(r.value) if r.measured else "not measured", repr(r.declared)) for r in rows]
    # a long value (a parameter list) overflows its column rather than widening every row's
    widths = [min(_MAX_WIDTH, max(len(cells[i]) for cells in [("fact", "measured", ""), *shown])) for i in range(2)]
    lines = [f"{measured.label}, beside vllm=={beside} as kvspec's table declares it",
             f"  {'fact':<{widths[0]}}  {'measured':<{widths[1]}}  {beside} declares"]  # fmt: skip
    for row, (name, value, declared) in zip(rows, shown, strict=True):
        lines.append(f"{'*' if row.differs else ' '} {name:<{widths[0]}}  {value:<{widths[1]}}  {declared}")
    lines += ["", *(f"not measured: {r.field}: {r.why_not}" for r in rows if not r.measured), ""]
    differing = [r.field for r in rows if r.differs]
    if differing:
        lines.append(f"* {len(differing)} measured fact(s) differ from {beside}'s: {', '.join(differing)}")
    else:
        lines.append(f"every measured fact equals {beside}'s")
    return "\n".join(lines)


def entry_literal(measured: MeasuredFacts, beside: str, rows: list[FactRow]) -> str:
    """The ``ReleaseFacts(...)`` of the measured vLLM: each fact not measured taken from ``beside``, and marked."""
    lines = ["ReleaseFacts(", f"    version={measured.version!r},"]
    for row in rows:
        if row.measured:
            lines.append(f"    {row.field}={row.value!r},")
        else:
            lines.append(f"    {row.field}={row.declared!r},  # not measured: from {beside}")
    return "\n".join([*lines, ")"])


def rows_json(impl: str, measured: MeasuredFacts, beside: str, rows: list[FactRow]) -> dict[str, Any]:
    """The comparison as JSON: each fact's measured value (or why not), the declared one, whether they differ."""
    return {
        "impl": impl,
        "version": measured.version,
        "label": measured.label,
        "beside": beside,
        "facts": [
            {
                "fact": r.field,
                "measured": r.measured,
                "value": _plain(r.value),
                "why_not": r.why_not,
                "declared": _plain(r.declared),
                "differs": r.differs,
            }
            for r in rows
        ],
        "differing": [r.field for r in rows if r.differs],
        "entry": entry_literal(measured, beside, rows),
    }


def _plain(value: Any) -> Any:
    """A fact's value as JSON holds it (a tuple as a list)."""
    return list(value) if isinstance(value, tuple) else value
