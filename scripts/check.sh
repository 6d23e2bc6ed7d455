#!/usr/bin/env bash
# Set up a virtual environment and run the main job: `kvspec check` on the built-in
# implementations (the spec, the reference model, and gpu_impl on CUDA or the CPU).
# Arguments go to `kvspec check`.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${KVSPEC_VENV:-.venv}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
# torch is pinned to the CPU build first, so nothing later pulls a CUDA build.
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q 'torch==2.13.0'
"$VENV/bin/python" -m pip install -q -e '.[gpu]'
exec "$VENV/bin/kvspec" check "$@"
