"""The oracle's matrix: what it found on each release, as data and as the table `kvspec oracle` prints.

A `ReleaseRow` holds one release's cells (a verdict per profile for each
level and caching setting), probes, hash and fleet answers and notes; it
crosses the worker's process boundary as JSON (``asdict``) and is rebuilt in
the parent, so every field is plain data. `format_matrix` prints the rows as
one line per release with a footnote for every divergence and every cell
that did not run; `rows_to_json` is ``--json``. Running the releases is
kvspec.conformance.tools.oracle's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kvspec.conformance.core.results import Verdict
from kvspec.conformance.targets.vllm.probes import ProbeResult

__all__ = ["HYBRID_GROUPS", "Cell", "ReleaseRow", "events_text", "format_matrix", "rows_to_json"]

# The KV cache groups of the request level's hybrid answer: one full-attention
# group and one sliding window, vLLM's simple hybrid (one coordinator round).
HYBRID_GROUPS = "full,sliding:8"


@dataclass(slots=True)
class Cell:
    """One (level, caching) cell of the matrix: a verdict per profile."""

    status: str  # "ran", "n/a" or "could not install" / "could not run"
    why: str = ""  # for a cell that did not run
    profiles: dict[str, dict[str, Any]] = field(default_factory=dict)  # profile -> verdict, trace, story, steps
    steps_per_s: float | None = None  # harness speed against this release
    not_applicable: list[str] = field(default_factory=list)  # what the adapter declares absent, with why

    def conforms_to(self) -> list[str]:
        """The profiles whose check passed."""
        return [p for p, r in self.profiles.items() if r["verdict"] == Verdict.CONFORMS]


@dataclass(slots=True)
class ReleaseRow:
    """Everything the oracle found on one release."""

    version: str  # the release
    cells: dict[str, Cell] = field(default_factory=dict)  # "pool/on", "pool/off", "manager/on", "manager/off"
    hashes: str = ""  # the hash-compatibility summary
    # Whether two engine processes started alike compute the same chain (hashes.measure_release), and what it
    # was measured on; "" where not measured (vLLM v0, the request level alone).
    fleet: str = ""
    fleet_detail: str = ""
    probes: list[ProbeResult] = field(default_factory=list)  # the directed probes (pool level)
    notes: list[str] = field(default_factory=list)  # findings in words
    # The request level with KV cache groups HYBRID_GROUPS, caching on, under the profile the
    # release's request level conforms to: "ran" with that one profile's verdict, or "n/a" with why
    # (a release without the spec classes or a hybrid coordinator declares it). None: not run.
    hybrid: Cell | None = None
    # With --events: per level ("pool", "manager"), a campaign with the KV cache events checked (caching on,
    # the release's profile): "ran" with its verdict, or "n/a" for a release without events. Empty: not run.
    events: dict[str, Cell] = field(default_factory=dict)


def events_text(cell: Cell | None, footnotes: list[str], where: str) -> str:
    """An events cell in the matrix: ``ok``, ``no events``, ``breaks <rule>[n]`` or ``<verdict>[n]``."""
    if cell is None:
        return "not run"
    if cell.status == Verdict.NOT_APPLICABLE.value:
        return "no events" if cell.why.startswith("no events") else Verdict.NOT_APPLICABLE.value
    if cell.status != "ran":
        footnotes.append(f"{where}: {cell.status}: {cell.why}")
        return f"{cell.status}[{len(footnotes)}]"
    profile, r = next(iter(cell.profiles.items()))
    if r["verdict"] == Verdict.CONFORMS:
        return "ok"
    footnotes.append(f"{where} under {profile}: {r['verdict']} at step {r.get('step')} ({r.get('op')}): "
                     f"{str(r.get('message', ''))[:200]}  trace: {r.get('trace')}")  # fmt: skip
    return f"{'breaks ' + r['rule'] if r.get('rule') else r['verdict']}[{len(footnotes)}]"


# The fleet answers in the matrix column (the notes give them whole).
_FLEET_SHORT = {"only with PYTHONHASHSEED set": "seed set", "only with PYTHONHASHSEED unset": "seed unset"}


def _cell_text(cell: Cell | None, footnotes: list[str]) -> str:
    if cell is None:
        return "n/a"
    if cell.status != "ran":
        return f"{cell.status}"
    parts = []
    for profile, r in cell.profiles.items():
        short = profile.replace("vllm-", "")
        if r["verdict"] == Verdict.CONFORMS:
            parts.append(f"{short} ok")
        else:
            footnotes.append(f"{r['verdict']} under {profile} at step {r.get('step')} ({r.get('op')}): "
                             f"{str(r.get('message', ''))[:160]}  trace: {r.get('trace')}")  # fmt: skip
            parts.append(f"{short} {r['verdict']}[{len(footnotes)}]")
    return ", ".join(parts)


def format_matrix(rows: Sequence[ReleaseRow], levels: Sequence[str], cachings: Sequence[str]) -> str:
    """The matrix as text: one line per release, footnotes for every divergence and every cell that did not run."""
    footnotes: list[str] = []
    keys = [f"{lv}/{c}" for lv in levels for c in cachings]
    # The hybrid answer (KV cache groups HYBRID_GROUPS) gets a column where some row has one.
    hybrid = any(row.hybrid is not None for row in rows)
    fleet = any(row.fleet for row in rows)
    # The events columns (--events), one per level some row ran them at.
    event_levels = [lv for lv in levels if any(lv in row.events for row in rows)]
    header = ["version", *[k.replace("manager", "request") for k in keys], *(["request/hybrid"] if hybrid else []),
              *[f"{lv.replace('manager', 'request')}/events" for lv in event_levels], "hashes",
              *(["fleet"] if fleet else [])]  # fmt: skip
    table: list[list[str]] = []
    for row in rows:
        cells = []
        for k, cell in [*((k, row.cells.get(k)) for k in keys), *([("request/hybrid", row.hybrid)] if hybrid else [])]:
            if cell is not None and cell.status != "ran":
                footnotes.append(f"{row.version} {k}: {cell.status}: {cell.why}")
                cells.append(f"{cell.status}[{len(footnotes)}]")
            else:
                cells.append(_cell_text(cell, footnotes))
        cells += [events_text(row.events.get(lv), footnotes, f"{row.version} {lv} events") for lv in event_levels]
        table.append([row.version, *cells, row.hashes.split(":")[0] if row.hashes else "n/a",
                      *([_FLEET_SHORT.get(row.fleet, row.fleet or "n/a")] if fleet else [])])  # fmt: skip
    widths = [max(len(r[i]) for r in [header, *table]) for i in range(len(header))]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in table]
    if fleet:
        lines.append("fleet: two engine processes started alike compute the same chain (fleet-consistent hashes): "
                     "yes (PYTHONHASHSEED set or unset), seed set (only with PYTHONHASHSEED set), no; measured in "
                     "two fresh processes per setting, see the notes")  # fmt: skip
    lines.append("")
    lines.append("notes:")
    for row in rows:
        for note in row.notes:
            lines.append(f"  {row.version}: {note}")
        if row.fleet_detail:
            lines.append(f"  {row.version}: {row.fleet_detail}")
        if row.hashes and not row.hashes.startswith("compatible"):
            lines.append(f"  {row.version}: hashes {row.hashes[:300]}")
    if footnotes:
        lines.append("")
        lines += [f"[{i}] {text}" for i, text in enumerate(footnotes, 1)]
    return "\n".join(lines)


def rows_to_json(rows: Sequence[ReleaseRow]) -> list[dict[str, Any]]:
    """The rows as plain data, for ``--json``."""
    return [asdict(row) for row in rows]
