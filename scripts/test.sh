#!/usr/bin/env bash
# Set up a virtual environment with every test dependency and run the whole test suite:
#   1. the default suite (no vLLM needed; the long campaigns are opt-in with KVSPEC_SLOW=1);
#   2. the heavy tests (marker `heavy`), the same way; KVSPEC_HEAVY=0 leaves them out;
#   3. the real-vLLM tests (scripts/test-vllm.sh): every release's BlockPool in light
#      mode and the KVCacheManager of seven releases, one per API generation; KVSPEC_VLLM=0 leaves them out;
#   4. the HypoFuzz test (scripts/test-fuzz.sh, in its own .venv-fuzz): a short campaign on a
#      planted mutant reports the failure and it replays; KVSPEC_FUZZ=0 leaves it out.
# The default suite opens the step-through pages in a headless Chromium: Debian's
# chromium and chromium-driver, installed here when missing (as root, with apt-get);
# without them those tests skip and say why.
# The default suite runs in KVSPEC_TEST_WORKERS pytest-xdist workers (default 2, CI's cores;
# 0 runs it in this process), then, the same way, the heavy tests (marker `heavy`: about 12 s or
# more each: whole campaigns, the lemmas, the CrossHair search); KVSPEC_HEAVY=0 leaves them out.
# Arguments go to both stages' pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! { command -v chromium >/dev/null && command -v chromedriver >/dev/null; } \
  && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "scripts/test.sh: installing Debian's chromium and chromium-driver for the browser tests"
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver; } \
    >/dev/null 2>&1 || echo "scripts/test.sh: could not install chromium and chromium-driver; the browser tests will skip"
fi
VENV="${KVSPEC_VENV:-.venv}"
source scripts/venv.sh
make_venv "$VENV" test
WORKERS="${KVSPEC_TEST_WORKERS:-2}"
run_pytest() {
  if [ "$WORKERS" = 0 ]; then
    "$VENV/bin/python" -m pytest "$@"
  else
    "$VENV/bin/python" -m pytest -n "$WORKERS" "$@"
  fi
}
run_pytest "$@"
if [ "${KVSPEC_HEAVY:-1}" != "0" ]; then
  KVSPEC_HEAVY=1 run_pytest -m heavy "$@"
fi
if [ "${KVSPEC_VLLM:-1}" != "0" ]; then
  bash scripts/test-vllm.sh
fi
if [ "${KVSPEC_FUZZ:-1}" != "0" ]; then
  bash scripts/test-fuzz.sh
fi
