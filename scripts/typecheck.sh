#!/usr/bin/env bash
# mypy --strict over kvspec.spec and kvspec.conformance, and ruff over the tree: its lint and its format.
# The folders are mapped into the `kvspec` namespace by pyproject's package-dir,
# which mypy cannot follow; a tree of links under build/ gives it the installed layout.
set -euo pipefail
cd "$(dirname "$0")/.."
root="build/typecheck"
rm -rf "$root" && mkdir -p "$root/kvspec"
for f in kvspec/*.py; do ln -s "$PWD/$f" "$root/kvspec/$(basename "$f")"; done
for pkg in spec reference conformance gpu_impl mutants benchmarks; do ln -s "$PWD/$pkg" "$root/kvspec/$pkg"; done
PY="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python )}"
MYPYPATH="$root" "$PY" -m mypy --config-file pyproject.toml -p kvspec.spec -p kvspec.conformance
"$PY" -m ruff check .
"$PY" -m ruff format --check .
