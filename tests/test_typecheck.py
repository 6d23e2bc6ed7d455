"""mypy --strict over kvspec.spec and kvspec.conformance, ruff's lint and its format check (scripts/typecheck.sh)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(not (ROOT / "scripts" / "typecheck.sh").exists(), reason="runs from a source checkout only")
def test_typecheck_and_lint_pass() -> None:
    proc = subprocess.run(
        ["bash", "scripts/typecheck.sh"],
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
