#!/usr/bin/env bash
# Run the HypoFuzz test (pytest marker `fuzz`): a short campaign on a planted mutant
# must report the failure it finds, and what it saved must replay.
#
# HypoFuzz runs in an environment of its own, .venv-fuzz ($KVSPEC_FUZZ_VENV), with the
# fuzz extra's pinned Hypothesis (older than the newest, which the test extra keeps);
# torch is pinned to the CPU build first, as in scripts/test.sh. About 15 s on a warm
# pip cache once the environment exists.
#
# Usage: scripts/test-fuzz.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${KVSPEC_FUZZ_VENV:-.venv-fuzz}"
source scripts/venv.sh
make_venv "$VENV" test,fuzz
KVSPEC_FUZZ=1 exec "$VENV/bin/python" -m pytest -m fuzz tests/conformance/test_fuzz_campaign.py "$@"
