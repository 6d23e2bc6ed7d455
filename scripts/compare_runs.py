"""Compare two recordings of the harness's behaviour, before and after a change that should not alter it.

    python scripts/compare_runs.py check BEFORE.json AFTER.json      # kvspec check --json
    python scripts/compare_runs.py mutants BEFORE.json AFTER.json    # kvspec mutants --json
    python scripts/compare_runs.py pages BEFORE_DIR AFTER_DIR        # kvspec view / demo --html pages
    python scripts/compare_runs.py traces BEFORE_DIR AFTER_DIR       # folders of .trace.jsonl files

Times and paths are left out; everything else is compared: per configuration
the verdict, examples, steps, distinct states, invariant checks, branches
reached and unreached, mistakes checked; per mutant whether it was killed,
the failure's kind and message, the shrunk length, examples and steps run,
and the controls' verdicts; per page the embedded page data field by field;
per trace file its bytes. Prints what differs and exits 1 if anything does.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

IGNORED = {"seconds", "trace_path", "html_path", "steps_per_second", "trace_dir"}
MUTANT_FIELDS = (
    "killed", "failure_kind", "shrunk_steps", "verdict", "message", "level", "impl", "examples_run", "steps_run"
)  # fmt: skip
PAGE_DATA = re.compile(r'<script type="application/json" id="kvspec-data">(.*?)</script>', re.S)


def _strip(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip(v) for k, v in value.items() if k not in IGNORED}
    if isinstance(value, list):
        return [_strip(v) for v in value]
    return value


def _walk(a: Any, b: Any, where: str, out: list[tuple[str, Any, Any]]) -> None:
    """Every leaf where two JSON values differ, by path."""
    if type(a) is not type(b):
        out.append((where, a, b))
    elif isinstance(a, dict):
        for k in sorted(set(a) | set(b)):
            _walk(a.get(k), b.get(k), f"{where}.{k}", out)
    elif isinstance(a, list) and len(a) != len(b):
        out.append((where, f"{len(a)} items", f"{len(b)} items"))
    elif isinstance(a, list):
        for i, (x, y) in enumerate(zip(a, b)):
            _walk(x, y, f"{where}[{i}]", out)
    elif a != b:
        out.append((where, a, b))


def check(before: Path, after: Path) -> int:
    a, b = json.loads(before.read_text()), json.loads(after.read_text())
    differ = [("exit_code", a["exit_code"], b["exit_code"])] if a["exit_code"] != b["exit_code"] else []
    if len(a["results"]) != len(b["results"]):
        differ.append(("results", len(a["results"]), len(b["results"])))
    for x, y in zip(a["results"], b["results"]):
        name = f"{x['impl']} {x['level']} caching {'on' if x['enable_caching'] else 'off'}"
        out: list[tuple[str, Any, Any]] = []
        _walk(_strip(x), _strip(y), name, out)
        differ += out
        print(f"{name:32} {x['verdict']:9} examples {x['examples']:5} steps {x['steps']:6} states {x['states']:5} "
              f"invariants {x['invariants_checked']:7} branches {len(x['branches_reached'])}/{x['spec_branches']}"
              f"  {'same' if not out else 'DIFFERS'}")  # fmt: skip
    return _report(differ, f"{len(a['results'])} configurations")


def mutants(before: Path, after: Path) -> int:
    a, b = json.loads(before.read_text()), json.loads(after.read_text())
    ma, mb = {m["name"]: m for m in a["mutants"]}, {m["name"]: m for m in b["mutants"]}
    differ: list[tuple[str, Any, Any]] = [("mutants", sorted(ma), sorted(mb))] if set(ma) != set(mb) else []
    for name in sorted(set(ma) & set(mb)):
        differ += [(f"{name}.{f}", ma[name].get(f), mb[name].get(f)) for f in MUTANT_FIELDS
                   if ma[name].get(f) != mb[name].get(f)]  # fmt: skip
    _walk(_strip(a["control"]), _strip(b["control"]), "control", differ)
    killed = sum(m["killed"] for m in ma.values())
    print(f"{len(ma)} mutants, {killed} killed; shrunk steps {sorted(m['shrunk_steps'] for m in ma.values())}")
    return _report(differ, f"{len(ma)} mutants and {len(a['control'])} controls")


def pages(before: Path, after: Path) -> int:
    differ: list[tuple[str, Any, Any]] = []
    names = sorted(p.name for p in before.glob("*.html"))
    for name in names:
        a, b = before / name, after / name
        if not b.exists():
            differ.append((name, "page", "missing"))
        elif a.read_bytes() != b.read_bytes():
            _walk(_page_data(a), _page_data(b), name, differ)
    return _report(differ, f"{len(names)} pages")


def _page_data(path: Path) -> Any:
    m = PAGE_DATA.search(path.read_text())
    assert m is not None, f"{path} holds no page data"
    return json.loads(m.group(1))


def traces(before: Path, after: Path) -> int:
    files = sorted(p.relative_to(before) for p in before.rglob("*.trace.jsonl"))
    differ = [(str(f), "bytes", "differ") for f in files
              if not (after / f).exists() or (before / f).read_bytes() != (after / f).read_bytes()]  # fmt: skip
    return _report(differ, f"{len(files)} trace files")


def _report(differ: list[tuple[str, Any, Any]], what: str) -> int:
    for where, a, b in differ:
        print(f"  {where}\n    before: {a!r}\n    after:  {b!r}")
    print(f"{what}: {'identical' if not differ else f'{len(differ)} differences'}")
    return 1 if differ else 0


if __name__ == "__main__":
    commands = {"check": check, "mutants": mutants, "pages": pages, "traces": traces}
    if len(sys.argv) != 4 or sys.argv[1] not in commands:
        sys.exit(__doc__)
    sys.exit(commands[sys.argv[1]](Path(sys.argv[2]), Path(sys.argv[3])))
