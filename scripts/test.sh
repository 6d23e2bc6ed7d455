#!/usr/bin/env bash
# Set up a virtual environment with every test dependency and run the whole test suite:
#   1. the default suite (no vLLM needed; slow campaigns are opt-in with KVSPEC_SLOW=1);
#   2. the real-vLLM tests (scripts/test-vllm.sh): every release's BlockPool in light
#      mode and the newest release's KVCacheManager; KVSPEC_VLLM=0 leaves them out.
# Arguments go to the default suite's pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${KVSPEC_VENV:-.venv}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
# torch is pinned to the CPU build first, so nothing later pulls a CUDA build.
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q 'torch==2.13.0'
"$VENV/bin/python" -m pip install -q -e '.[test]'
"$VENV/bin/python" -m pytest "$@"
if [ "${KVSPEC_VLLM:-1}" != "0" ]; then
  bash scripts/test-vllm.sh
fi
