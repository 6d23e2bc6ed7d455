#!/usr/bin/env bash
# Rewrite docs/traces/: for every rule a mutant breaks, the shortest shrunk trace that breaks it (every
# mutant runs: minutes). The site renders each as a step-through page; tests/test_docs.py replays them.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${KVSPEC_VENV:-.venv}"
exec "$VENV/bin/python" scripts/docs_record.py traces
