#!/usr/bin/env bash
# Rewrite docs/data/plugin-matrix.json from `kvspec oracle --plugins --json` (fetches the four plugin
# distributions once; about a minute). The site's plugin matrix is generated from it; a test marked
# vllm (KVSPEC_VLLM=1) checks that the recording is what the command prints now.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${KVSPEC_VENV:-.venv}"
exec "$VENV/bin/python" scripts/docs_record.py plugins
