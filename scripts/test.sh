#!/usr/bin/env bash
# Set up a virtual environment with every test dependency and run the whole suite.
# Heavy campaigns are opt-in: KVSPEC_SLOW=1 (long conformance runs), KVSPEC_VLLM=1 (the real vLLM).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${KVSPEC_VENV:-.venv}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
# torch is pinned to the CPU build first, so nothing later pulls a CUDA build.
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q 'torch==2.13.0'
"$VENV/bin/python" -m pip install -q -e '.[test]'
exec "$VENV/bin/python" -m pytest "$@"
