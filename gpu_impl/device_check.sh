#!/usr/bin/env bash
# gpu_impl's device check: on a CUDA machine, in under 8 minutes, run
#   1. conformance on the device: gpu_impl against the reference, step by step
#      (pool and manager level, KV content read back on every hit), the seed's
#      walkthrough, and `kvspec check --impl gpu` when the harness provides it;
#   2. the corruption tests: real bit flips in device memory, caught on hit;
#   3. the CUDA-only tests (CPU and CUDA pools agree; device free memory);
#   4. the benchmark, gpu_impl against the reference;
# then print a short table. Exit 0 when every step passes, 1 otherwise, 2 when
# the device cannot be used or the script is not in a source checkout (the tests
# it runs are not shipped).
#
# Environment:
#   KVSPEC_DEVICE=cuda|cuda:N|cpu   the device (default cuda); cpu runs the same steps on the CPU
#   KVSPEC_DEVICE_CHECK_QUICK=1     small budgets (the deterministic tests and a small benchmark grid)
#   PYTHON=...                      the interpreter with kvspec installed (default python)
set -uo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
PY="${PYTHON:-python}"
export KVSPEC_DEVICE="${KVSPEC_DEVICE:-cuda}"
quick="${KVSPEC_DEVICE_CHECK_QUICK:-0}"
export HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-ci}"  # derandomized: the same examples on every run
logs="$(mktemp -d)"
trap 'rm -rf "$logs"' EXIT

if ! "$PY" -c "from kvspec.gpu_impl.device import pick_device; print(pick_device())" >"$logs/device" 2>&1; then
    echo "device_check: cannot use KVSPEC_DEVICE=$KVSPEC_DEVICE: $(tail -n 1 "$logs/device")" >&2
    exit 2
fi
device="$(tail -n 1 "$logs/device")"

# The wheel ships no tests: they come from the checkout this script sits in.
tests="$(cd "$here/.." && pwd)/tests/gpu_impl"
if [ ! -d "$tests" ]; then
    echo "device_check: no tests at $tests; run the script from a source checkout (the wheel ships none)" >&2
    exit 2
fi

rows=()
status=0
step() {  # step NAME TIMEOUT_S COMMAND...: run one step, record a row, keep its log
    local name="$1" limit="$2"
    shift 2
    local start end verdict
    start=$(date +%s)
    if timeout "$limit" "$@" >"$logs/$name.log" 2>&1; then
        verdict="pass"
    else
        local rc=$?
        verdict="FAIL"
        [ "$rc" -eq 124 ] && verdict="TIMEOUT"
        status=1
    fi
    end=$(date +%s)
    local detail
    detail="$(grep -E '^[0-9]+ (passed|failed)|passed|failed' "$logs/$name.log" | tail -n 1 | sed 's/=//g; s/^ *//')"
    rows+=("$(printf '%-26s %-8s %5ss  %s' "$name" "$verdict" "$((end - start))" "$detail")")
    if [ "$verdict" != "pass" ]; then
        echo "---- $name: last lines of its log ----" >&2
        tail -n 40 "$logs/$name.log" >&2
    fi
}

pytest_args=(-q -p no:cacheprovider --import-mode=importlib)
if [ "$quick" = "1" ]; then
    # Deterministic scenarios only: the state machines are what the full run adds.
    step conformance 120 "$PY" -m pytest "${pytest_args[@]}" "$tests/test_walkthrough_gpu.py" \
        "$tests/test_pool_lockstep.py" -k "not lockstep or large"
    step corruption 120 "$PY" -m pytest "${pytest_args[@]}" "$tests/test_corruption.py" -k "not machine"
    bench_args=(--quick --seconds 0.05 --no-hash-map)
else
    step conformance 140 "$PY" -m pytest "${pytest_args[@]}" "$tests/test_pool_lockstep.py" \
        "$tests/test_manager_lockstep.py" "$tests/test_walkthrough_gpu.py" "$tests/test_memory_mutants.py"
    if "$PY" -m kvspec.conformance.cli check --help >/dev/null 2>&1; then
        # The harness builds gpu_impl with no device named: KVSPEC_DEVICE (exported above) picks it.
        step "kvspec check --impl gpu" 100 "$PY" -m kvspec.conformance.cli check --impl gpu
    fi
    step corruption 60 "$PY" -m pytest "${pytest_args[@]}" "$tests/test_corruption.py"
    bench_args=(--seconds 0.2)
fi
if [[ "$device" == cuda* ]]; then
    step cuda-only 40 "$PY" -m pytest "${pytest_args[@]}" "$tests/test_cuda.py"
fi
step benchmark 120 "$PY" -m kvspec.benchmarks.gpu_bench --device "$device" "${bench_args[@]}"

echo
echo "gpu_impl device check on $device$([ "$quick" = "1" ] && echo ' (quick)')"
printf '%-26s %-8s %6s  %s\n' "step" "verdict" "time" "detail"
for row in "${rows[@]}"; do echo "$row"; done
echo
echo "benchmark (ratio = reference / gpu_impl; above 1x gpu_impl is faster):"
grep -E '^ +[0-9,]+ +[0-9,]+  |target' "$logs/benchmark.log" || true
exit "$status"
