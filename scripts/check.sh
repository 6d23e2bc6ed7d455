#!/usr/bin/env bash
# Set up a virtual environment and run the main job: `kvspec check` on the built-in
# implementations (the spec, the reference model, and gpu_impl on CUDA or the CPU).
# Arguments go to `kvspec check`.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${KVSPEC_VENV:-.venv}"
source scripts/venv.sh
make_venv "$VENV" gpu
exec "$VENV/bin/kvspec" check "$@"
