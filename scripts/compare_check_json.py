"""Compare two `kvspec check --json` summaries, configuration by configuration, ignoring times and paths.

A refactoring of the harness must leave every campaign as it was: run the same
`kvspec check ... --json` (with CI=1) before and after, then

    python scripts/compare_check_json.py before.json after.json

prints one line per configuration (verdict, examples, steps, states, invariant
checks, branches) and exits 0 when every field but seconds and file paths is
equal, 1 with the fields that differ otherwise.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

IGNORED = {"seconds", "trace_path", "story", "deepest_trace_path"}  # times, and where files were written


def _scrub(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _scrub(v) for k, v in value.items() if k not in IGNORED}
    if isinstance(value, list):
        return [_scrub(v) for v in value]
    if isinstance(value, str) and ("kvspec-traces" in value or value.endswith(".trace.jsonl")):
        return "<path>"
    return value


def _configurations(path: str) -> tuple[int, dict[tuple[Any, ...], Any]]:
    summary = json.loads(Path(path).read_text())
    results = {(r["impl"], r["level"], r["enable_caching"], r["profile"]): _scrub(r) for r in summary["results"]}
    return summary["exit_code"], results


def main(before_path: str, after_path: str) -> int:
    """Print the comparison; 0 when the runs are the same but for times and paths, 1 otherwise."""
    (code_before, before), (code_after, after) = _configurations(before_path), _configurations(after_path)
    same = code_before == code_after and before.keys() == after.keys()
    if not same:
        print(f"DIFFERENT exit codes {code_before}, {code_after} or configurations {before.keys() ^ after.keys()}")
    for key, b in before.items():
        a = after.get(key)
        if a is None:
            continue
        if a != b:
            same = False
            print("DIFFERENT", key, {f: (b.get(f), a.get(f)) for f in set(a) | set(b) if a.get(f) != b.get(f)})
            continue
        print(
            f"same {' '.join(map(str, key)):<40} {a['verdict']:<14} examples {a['examples']:>5} "
            f"steps {a['steps']:>6} states {a['states']:>5} invariants {a['invariants_checked']:>7} "
            f"branches {len(a['branches_reached'])}/{a['spec_branches']}"
        )
    print("IDENTICAL but for times and paths" if same else "DIFFERENT")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
