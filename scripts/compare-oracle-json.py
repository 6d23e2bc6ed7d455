"""Compare two recordings of `kvspec oracle ... --json` (the vLLM oracle and the plugin matrix).

Usage: python scripts/compare-oracle-json.py BEFORE_DIR AFTER_DIR
Each folder holds oracle.json (`kvspec oracle --vllm ... --json`) and/or plugins.json
(`kvspec oracle --plugins ... --json`), recorded with CI=1 and `--trace-dir` under it.

What is ignored: times and steps per second (``steps_per_s``), the recording folder
(replaced by <DIR>; any other folder before a trace file too, so traces are compared
by file name), and vLLM's NONE_HASH with PYTHONHASHSEED unset, which releases from
0.10.2 on draw from os.urandom(32) in every process. Everything else is compared:
verdicts, steps, examples, probes, findings, notes, messages.
Prints each difference; exits 1 when there is one.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

_IGNORED_KEYS = {"steps_per_s"}


def normalise(value: Any, root: Path) -> Any:
    """The recording with what may differ between two runs of the same code masked."""
    if isinstance(value, dict):
        return {k: normalise(v, root) for k, v in value.items() if k not in _IGNORED_KEYS}
    if isinstance(value, list):
        return [normalise(v, root) for v in value]
    if isinstance(value, str):
        value = value.replace(str(root), "<DIR>")
        value = re.sub(r"(PYTHONHASHSEED=None: vLLM )[0-9a-f]+\.\.", r"\1<os.urandom>..", value)
        return re.sub(r"(/[^\s;()]+/)([^/\s;()]+\.trace\.jsonl)", r"<DIR>/\2", value)
    return value


def differences(a: Any, b: Any, where: str, out: list[str]) -> int:
    """Append every difference between ``a`` and ``b`` to ``out``; returns how many values were compared."""
    if type(a) is not type(b):
        out.append(f"{where}: {a!r} != {b!r}")
        return 1
    if isinstance(a, dict):
        only = [f"{where}.{k}: only in {'after' if k in b else 'before'}" for k in sorted(set(a) ^ set(b))]
        out += only
        return sum(differences(a[k], b[k], f"{where}.{k}", out) for k in sorted(set(a) & set(b)))
    if isinstance(a, list):
        if len(a) != len(b):
            out.append(f"{where}: {len(a)} items != {len(b)}")
        return sum(differences(x, y, f"{where}[{i}]", out) for i, (x, y) in enumerate(zip(a, b)))
    if a != b:
        out.append(f"{where}: {a!r} != {b!r}")
    return 1


def main(argv: list[str]) -> int:
    before, after = Path(argv[0]).resolve(), Path(argv[1]).resolve()
    found = 0
    for name in ("oracle.json", "plugins.json"):
        if not (before / name).exists() and not (after / name).exists():
            continue
        a = normalise(json.loads((before / name).read_text()), before)
        b = normalise(json.loads((after / name).read_text()), after)
        out: list[str] = []
        compared = differences(a, b, name, out)
        print(f"{name}: {compared} values compared, {len(out)} differences")
        for line in out:
            print(f"  {line[:400]}")
        found += len(out)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
