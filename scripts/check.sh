#!/usr/bin/env bash
# Set up a virtual environment and run the main job: `kvspec check` on the built-in implementations.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${KVSPEC_VENV:-.venv}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q -e .
exec "$VENV/bin/kvspec" check "$@"
