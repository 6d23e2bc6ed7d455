"""Record into docs/ what the site's generated parts read but a build cannot afford to compute.

    python scripts/docs_record.py traces    # docs/traces/: per invariant, the shortest mutant trace breaking it
    python scripts/docs_record.py plugins   # docs/data/plugin-matrix.json: `kvspec oracle --plugins --json`

(scripts/docs-traces.sh and scripts/docs-plugins.sh run them in the checkout's .venv.)

`traces` runs every mutant (`kvspec mutants --json`, the defaults a user gets:
minutes), reads each killed mutant's shrunk trace, and asks which rule it
shows broken at its last step (docs/_hooks.py `rule_broken_by`: the rule the
harness named, or else the first one the spec's `check_all` finds broken on
the mutant's state after that step). For every rule it keeps the shortest
such trace (ties: one where the harness named the rule, then the mutant's
name), as docs/traces/<rule>.trace.jsonl; only a trace whose header names a
factory `kvspec replay --impl` can load is kept. The traces of a previous recording
are replaced: a rule no mutant breaks any more loses its trace.
tests/test_docs.py replays every kept trace on its mutant and on the
reference, so a kept trace cannot go stale silently.

`plugins` runs `kvspec oracle --plugins --json` (it fetches the four plugin
distributions once into ~/.cache/kvspec/plugins), keeps each trace's file name
only, and records the rows with the date and the command. A test marked
`vllm` (tests/test_docs.py) runs the command again and compares verdicts,
findings and probes with the recording.

Both go through the `kvspec` console script of this environment, never a module path of the harness.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT / "docs" / "traces"
PLUGIN_MATRIX = ROOT / "docs" / "data" / "plugin-matrix.json"
PLUGIN_COMMAND = ["oracle", "--plugins", "--json"]


def kvspec_command() -> str:
    """The `kvspec` console script beside this interpreter, else the one on PATH."""
    beside = Path(sys.executable).parent / "kvspec"
    found = str(beside) if beside.exists() else shutil.which("kvspec")
    if found is None:
        raise SystemExit("docs_record: no kvspec console script beside this python or on PATH; install kvspec first")
    return found


def _num_steps(path: Path) -> int:
    """The number of steps of a trace file."""
    lines = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return sum(1 for line in lines[1:] if "step" in line)


def _docs_hooks() -> Any:
    """docs/_hooks.py, which knows which rule a kept trace breaks (the site and the tests read it too)."""
    spec = importlib.util.spec_from_file_location("kvspec_docs_hooks", ROOT / "docs" / "_hooks.py")
    assert spec is not None and spec.loader is not None, "docs/_hooks.py is missing"
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def record_traces(report_path: Path | None = None) -> int:
    """Run every mutant (or read the report `kvspec mutants --json` printed to `report_path`, its traces
    still where it wrote them) and keep, per broken rule, the shortest trace; returns the exit code."""
    with tempfile.TemporaryDirectory(prefix="kvspec-docs-traces-") as tmp:
        if report_path is not None:
            report = json.loads(report_path.read_text(encoding="utf-8"))
        else:
            proc = subprocess.run(
                [kvspec_command(), "mutants", "--json", "--trace-dir", tmp], capture_output=True, text=True, check=False
            )
            if proc.returncode not in (0, 1):  # 1: a mutant survived, which is no reason to keep no trace
                print(proc.stderr[-3000:], file=sys.stderr)
                return proc.returncode
            report = json.loads(proc.stdout)
        hooks = _docs_hooks()
        best: dict[str, tuple[int, int, str, Path]] = {}
        for m in report["mutants"]:
            if not m["killed"] or not m.get("trace_path"):
                continue
            path = Path(m["trace_path"])
            impl = json.loads(path.read_text(encoding="utf-8").splitlines()[0]).get("impl") or ""
            if " " in impl or ":" not in impl:
                # A mutant whose factory is not a module-level function writes a trace no `kvspec replay
                # --impl` loads; every mutant kvspec ships is named, so this guards an added one.
                print(f"{m['name']}: not kept, its trace names {impl!r}, which kvspec replay cannot load")
                continue
            broken = hooks.rule_broken_by(path)
            if broken is None:
                continue
            rule, named = broken
            # Shortest first; on a tie, a trace where the harness itself named the rule.
            key = (_num_steps(path), 0 if named else 1, m["name"], path)
            if rule not in best or key < best[rule]:
                best[rule] = key
        TRACES.mkdir(parents=True, exist_ok=True)
        for old in TRACES.glob("*.trace.jsonl"):
            old.unlink()
        for rule, (num_steps, named, name, path) in sorted(best.items()):
            shutil.copyfile(path, TRACES / f"{rule}.trace.jsonl")
            print(f"{rule}: {name}, {num_steps} steps{'' if named == 0 else ', on the state after the last step'}")
    print(f"kept {len(best)} traces in {TRACES.relative_to(ROOT)}")
    return 0


def plugin_matrix_rows(trace_dir: str) -> tuple[int, list[dict[str, Any]]]:
    """`kvspec oracle --plugins --json` run now: its exit code and its rows, each trace named by its file only."""
    proc = subprocess.run(
        [kvspec_command(), *PLUGIN_COMMAND, "--trace-dir", trace_dir], capture_output=True, text=True, check=False
    )
    if proc.returncode not in (0, 1):  # 0: all conform, 1: a divergence (with its trace); 2: no verdict
        raise RuntimeError(f"kvspec {' '.join(PLUGIN_COMMAND)} exited {proc.returncode}: {proc.stderr[-3000:]}")
    rows: list[dict[str, Any]] = json.loads(proc.stdout)
    for row in rows:
        for entry in [*row.get("cells", {}).values(), *row.get("probes", [])]:
            for key in ("trace", "trace_path"):
                if entry.get(key):
                    entry[key] = Path(entry[key]).name
    return proc.returncode, rows


def record_plugins() -> int:
    """Run the plugin matrix and record it; returns the exit code."""
    with tempfile.TemporaryDirectory(prefix="kvspec-docs-plugins-") as tmp:
        try:
            _, rows = plugin_matrix_rows(tmp)
        except RuntimeError as e:
            print(f"docs_record: {e}", file=sys.stderr)
            return 2
    PLUGIN_MATRIX.parent.mkdir(parents=True, exist_ok=True)
    recorded = {
        "command": "kvspec " + " ".join(PLUGIN_COMMAND),
        "recorded": datetime.date.today().isoformat(),
        "rows": rows,
    }
    PLUGIN_MATRIX.write_text(json.dumps(recorded, indent=1) + "\n", encoding="utf-8")
    print(f"recorded {len(rows)} rows in {PLUGIN_MATRIX.relative_to(ROOT)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """The command line: `traces` or `plugins`."""
    parser = argparse.ArgumentParser(prog="scripts/docs_record.py", description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["traces", "plugins"])
    parser.add_argument(
        "--from", dest="report", type=Path, default=None, metavar="REPORT",
        help="traces: read this saved `kvspec mutants --json` output instead of running the mutants",
    )  # fmt: skip
    args = parser.parse_args(argv)
    return record_traces(args.report) if args.what == "traces" else record_plugins()


if __name__ == "__main__":
    sys.exit(main())
