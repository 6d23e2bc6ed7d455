#!/usr/bin/env bash
# Run the real-vLLM tests (pytest marker `vllm`).
#
# Pool level: every release from 0.8.0 in light mode (each release's wheel is
# downloaded once and its pool modules cached under ~/.cache/kvspec/vllm-wheels,
# or $KVSPEC_VLLM_CACHE); needs only msgspec and pyzmq next to kvspec.
# Plugin targets (vllm-mlx, kvcached, tpu-inference, vllm-ascend): each plugin's
# distribution downloaded once with pip download --no-deps and its pool files
# cached under ~/.cache/kvspec/plugins ($KVSPEC_PLUGIN_CACHE), on light-mode releases.
# Request level: a virtual environment per release, created on first use under
# ~/.cache/kvspec/vllm-venvs (vLLM without its dependencies, torch 2.13.0 CPU,
# a short dependency list); about 70 s and 2.2 GB for 0.33.0 on a warm pip cache.
#
# Usage: scripts/test-vllm.sh [pytest args]      (KVSPEC_VLLM_LEVEL=pool skips the request level)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${KVSPEC_VENV:-.venv}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q -e '.[vllm]'
# fetch every release's pool modules up front, so test timings are not download timings
"$VENV/bin/python" - <<'PY'
from kvspec.conformance.targets.vllm.lightmode import fetch_release
from kvspec.conformance.targets.vllm.releases import RELEASES
for version in RELEASES:
    fetch_release(version)
# and the plugin targets' distributions (kvspec.conformance.targets.plugins: ~/.cache/kvspec/plugins)
from kvspec.conformance.targets.plugins.dist import fetch_dist
from kvspec.conformance.targets.plugins.targets import TARGETS
for target in TARGETS.values():
    fetch_dist(target.dist)
PY
FILES=(tests/conformance/test_vllm_hashes.py tests/conformance/test_vllm_adapter.py tests/conformance/test_vllm_events.py
       tests/reference/test_vllm_bench.py
       tests/conformance/test_plugins_vllm.py tests/conformance/test_vllm_v0_releases.py)
if [ "${KVSPEC_VLLM_LEVEL:-both}" != "pool" ]; then
  FILES+=(tests/conformance/test_vllm_manager.py)
fi
KVSPEC_VLLM=1 exec "$VENV/bin/python" -m pytest -m vllm "${FILES[@]}" "$@"
