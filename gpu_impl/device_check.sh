#!/usr/bin/env bash
# gpu_impl's device check: one command on a CUDA machine, under 8 minutes on an H200:
#
#   KVSPEC_DEVICE=cuda bash gpu_impl/device_check.sh
#
# runs, with gpu_impl on the device:
#   1. conformance: gpu_impl's lock-step tests against the reference (pool and
#      manager level, each batch path alone, the two faces of its state kept
#      in two memories, KV content read back on every hit), the seed's
#      walkthrough and the memory mutants; then `kvspec check --impl gpu
#      --events` (its KV cache events and hit statistics checked too) with
#      the same seed on the CPU and on the device, which must give the same
#      rows (verdict, examples, steps, states, invariant checks, branches);
#   2. corruption: real bit flips in device memory, caught on hit, quarantined;
#   3. on CUDA, the CUDA-only tests (CPU and CUDA pools agree, the torch calls
#      a short call makes, the device's free memory);
#   4. the benchmark: the full grid (batches of 1 to 1e5 blocks in pools of 1e4
#      to 1e6, against the reference) and the KV content check at 1e5 blocks;
#      then batches of 1, 16 and 1e5 in a 1e6-block pool under a keyed policy
#      (lru-timestamp: its own target, take and free 10x) and with KV cache
#      events on (the cost of building the events printed as the floor);
# then prints the benchmark and one short table, and under it the largest
# batch's rows of the benchmark: each operation's times beside its torch
# calls (host/device/waits, with lists and with device ids). Exit 0 when every step
# passes, 1 when one fails, 2 when the check cannot run here (no device, or
# not run from a source checkout: the tests it runs are not shipped).
#
# Needs: bash, coreutils (timeout, date, mktemp), and Python >= 3.10 with
# kvspec installed with its test extra and a torch built for the device, e.g.
#   python3 -m venv .venv && .venv/bin/pip install 'torch==2.13.0' && .venv/bin/pip install -e '.[test]'
# (on a CUDA machine, the torch wheel for its CUDA: pip's default Linux wheel
# is built with CUDA; `import torch; torch.cuda.is_available()` must be True).
# Nothing is downloaded while it runs.
#
# Environment:
#   KVSPEC_DEVICE=cuda|cuda:N|cpu   the device (default cuda); cpu runs the same steps on the CPU
#   KVSPEC_DEVICE_CHECK_QUICK=1     small budgets: deterministic tests, a short harness run, the quick grid
#   KVSPEC_DEVICE_CHECK_LOGS=DIR    keep every step's log there (default: a temporary directory,
#                                   removed when every step passed)
#   KVSPEC_DEVICE_CHECK_SEED=N      the harness seed (default 0)
#   KVSPEC_DEVICE_CHECK_BUDGET=S    seconds for the whole check (default 480); a step is cut at the end of it
#   PYTHON=...                      the interpreter (default: the checkout's .venv/bin/python, else python3)
set -uo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
if [ -z "${PYTHON:-}" ]; then
    for candidate in "$here/../.venv/bin/python" python3 python; do
        if command -v "$candidate" >/dev/null 2>&1; then PYTHON="$candidate"; break; fi
    done
fi
PY="${PYTHON:-python3}"
export KVSPEC_DEVICE="${KVSPEC_DEVICE:-cuda}"
quick="${KVSPEC_DEVICE_CHECK_QUICK:-0}"
seed="${KVSPEC_DEVICE_CHECK_SEED:-0}"
export HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-ci}"  # derandomized: the same examples on every run
export PYTHONDONTWRITEBYTECODE=1
# The suite's opt-in campaigns (hours) and the real-vLLM tests are not part of the check, whatever the caller set.
unset KVSPEC_SLOW KVSPEC_VLLM

cannot_run() { echo "device_check: $*" >&2; exit 2; }
for tool in timeout date mktemp; do
    command -v "$tool" >/dev/null 2>&1 || cannot_run "needs '$tool' (coreutils) on PATH"
done
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null \
    || cannot_run "PYTHON=$PY is not a Python >= 3.10 (set PYTHON to the interpreter with kvspec installed)"
missing="$("$PY" -c '
import importlib.util
print(" ".join(m for m in ("kvspec", "torch", "pytest", "hypothesis") if importlib.util.find_spec(m) is None))')"
[ -z "$missing" ] || cannot_run "$PY lacks $missing: pip install 'torch==2.13.0' && pip install -e '.[test]'"

if [ -n "${KVSPEC_DEVICE_CHECK_LOGS:-}" ]; then
    logs="$KVSPEC_DEVICE_CHECK_LOGS"
    mkdir -p "$logs" || cannot_run "cannot write logs to KVSPEC_DEVICE_CHECK_LOGS=$logs"
    keep_logs=1
else
    logs="$(mktemp -d)"
    keep_logs=0
fi

# Which device, named and described: torch starts no CUDA context for this.
if ! "$PY" -c '
import sys, platform, torch
from kvspec.gpu_impl.device import pick_device
d = pick_device()
name = torch.cuda.get_device_name(d) if d.type == "cuda" else platform.processor() or platform.machine()
cuda = f", CUDA {torch.version.cuda}" if d.type == "cuda" else ""
print(d)
print(f"{name}, torch {torch.__version__}{cuda}, Python {platform.python_version()}")
' >"$logs/device" 2>"$logs/device.err"; then
    cannot_run "cannot use KVSPEC_DEVICE=$KVSPEC_DEVICE: $(tail -n 1 "$logs/device.err")"
fi
device="$(sed -n 1p "$logs/device")"
about="$(sed -n 2p "$logs/device")"

# The wheel ships no tests: they come from the checkout this script sits in.
tests="$(cd "$here/.." && pwd)/tests/gpu_impl"
if [ ! -d "$tests" ]; then
    echo "device_check: no tests at $tests; run the script from a source checkout (the wheel ships none)" >&2
    exit 2
fi

rows=()
status=0
started=$(date +%s)
deadline=$((started + ${KVSPEC_DEVICE_CHECK_BUDGET:-480}))  # every step ends by then: the check's 8 minutes
row() {  # row NAME VERDICT SECONDS DETAIL
    rows+=("$(printf '%-30s %-8s %5ss  %s' "$1" "$2" "$3" "$4")")
    [ "$2" = "pass" ] || status=1
}
step() {  # step NAME LOG TIMEOUT_S DETAIL_PATTERN COMMAND...: run one step, record a row, keep its log
    local name="$1" log="$2" limit="$3" pattern="$4"
    shift 4
    local start verdict rc
    start=$(date +%s)
    if [ $((deadline - start)) -lt "$limit" ]; then limit=$((deadline - start)); fi
    if [ "$limit" -lt 5 ]; then
        row "$name" "SKIPPED" 0 "the check's time budget is spent"
        return
    fi
    timeout "$limit" "$@" >"$logs/$log.log" 2>&1
    rc=$?
    case "$rc" in
        0) verdict="pass" ;;
        124) verdict="TIMEOUT" ;;
        *) verdict="FAIL" ;;
    esac
    local detail
    detail="$(grep -E "$pattern" "$logs/$log.log" | tail -n 1 | sed 's/=//g; s/^ *//; s/ in [0-9.]*s.*//')"
    [ "$verdict" = "TIMEOUT" ] && detail="over ${limit}s; $detail"
    row "$name" "$verdict" "$(($(date +%s) - start))" "$detail"
    if [ "$verdict" != "pass" ]; then
        echo "---- $name: last lines of $logs/$log.log ----" >&2
        tail -n 40 "$logs/$log.log" >&2
    fi
}

pytest_args=(-q -p no:cacheprovider --import-mode=importlib)
pytest_summary='[0-9]+ (passed|failed)'
check_args=(--impl gpu --events --seed "$seed")  # events: 3 s more of 40 s on a 2-core CPU
if [ "$quick" = "1" ]; then
    # Deterministic scenarios and a short harness run: the state machines are what the full run adds.
    step conformance conformance 150 "$pytest_summary" "$PY" -m pytest "${pytest_args[@]}" \
        "$tests/test_walkthrough_gpu.py" "$tests/test_pool_lockstep.py" "$tests/test_operator_calls.py" \
        -k "not lockstep or large"
    # The pool level alone, at a budget that can conform: a campaign that leaves a reachable branch
    # unreached is inconclusive, never a pass; the full run checks both levels.
    check_args+=(--level pool --max-examples 100)
    corruption_args=(-k "not machine")
    bench_args=(--quick --seconds 0.05 --no-hash-map --content-blocks 200)
    policy_args=(--pools 3000 --batches 1 1000 --seconds 0.05)
else
    step conformance conformance 170 "$pytest_summary" "$PY" -m pytest "${pytest_args[@]}" "$tests" \
        --ignore="$tests/test_corruption.py" --ignore="$tests/test_cuda.py" \
        --ignore="$tests/test_bench.py" --ignore="$tests/test_device_check.py"
    corruption_args=()
    bench_args=(--full --seconds 0.2 --content-layers auto)
    policy_args=(--pools 1e6 --batches 1 16 1e5 --seconds 0.2)
fi

# The harness with the same seed on the CPU and on the device: the same campaign, so the same rows.
step "kvspec check, cpu" check-cpu 100 'result:' "$PY" -m kvspec.conformance.tools.cli check "${check_args[@]}" --device cpu
step "kvspec check, $device" check-device 140 'result:' \
    "$PY" -m kvspec.conformance.tools.cli check "${check_args[@]}" --device "$device" --step-timeout 60
start=$(date +%s)
if same="$("$PY" - "$logs/check-cpu.log" "$logs/check-device.log" 2>&1 <<'EOF'
import sys

def rows(path):
    # implementation level caching verdict examples steps steps/s states invariants branches: all but steps/s
    table = [line.split() for line in open(path) if line.startswith("gpu ")]
    return [cells[:6] + cells[7:] for cells in table]

cpu, device = rows(sys.argv[1]), rows(sys.argv[2])
if not cpu or cpu != device:
    print(f"differ: cpu {cpu} / device {device}")
    sys.exit(1)
print(f"{len(cpu)} rows equal: " + ", ".join(f"{r[1]} {r[2]} {r[3]}" for r in cpu))
EOF
)"; then verdict="pass"; else verdict="FAIL"; fi
row "same verdict, cpu and $device" "$verdict" "$(($(date +%s) - start))" "$same"

step corruption corruption 60 "$pytest_summary" \
    "$PY" -m pytest "${pytest_args[@]}" "$tests/test_corruption.py" "${corruption_args[@]}"
if [[ "$device" == cuda* ]]; then
    step cuda-only cuda-only 60 "$pytest_summary" "$PY" -m pytest "${pytest_args[@]}" "$tests" -m gpu
fi
step benchmark benchmark 240 'every hit block read back' \
    "$PY" -m kvspec.benchmarks.gpu_bench --device "$device" "${bench_args[@]}"
step "benchmark, keyed policy" benchmark-keyed 150 'keyed policy|CPU target' \
    "$PY" -m kvspec.benchmarks.gpu_bench --device "$device" "${policy_args[@]}" --no-hash-map --no-content \
    --profile lru-timestamp
step "benchmark, events" benchmark-events 150 'the floor of events' \
    "$PY" -m kvspec.benchmarks.gpu_bench --device "$device" "${policy_args[@]}" --no-hash-map --no-content --events

echo
[ -f "$logs/benchmark.log" ] && cat "$logs/benchmark.log" || touch "$logs/benchmark.log"
echo
echo "gpu_impl device check on $device ($about), $(date -u '+%Y-%m-%d %H:%M UTC')$([ "$quick" = "1" ] && echo ', quick')"
printf '%-30s %-8s %6s  %s\n' "step" "verdict" "time" "detail"
for r in "${rows[@]}"; do echo "$r"; done
printf '%-30s %-8s %5ss\n' "all" "$([ "$status" -eq 0 ] && echo pass || echo FAIL)" "$(($(date +%s) - started))"
echo
echo "benchmark, the largest batch in the largest pool (ratio = reference / gpu_impl; above 1x gpu_impl is faster):"
for log in benchmark benchmark-keyed benchmark-events; do
    [ -f "$logs/$log.log" ] || continue
    "$PY" - "$logs/$log.log" <<'EOF' || true
import re, sys

lines = open(sys.argv[1]).readlines()
title = next((line for line in lines if line.startswith("gpu_impl on ")), "").split(":")[0]
header = next((line for line in lines if re.match(r" +pool +batch +operation ", line)), "")
rows = [line for line in lines if re.match(r" +[0-9,]+ +[0-9,]+  [a-z_]+ ", line)]
size = lambda line: tuple(int(cell.replace(",", "")) for cell in line.split()[:2])
largest = max(map(size, rows), key=lambda s: (s[1], s[0]), default=None)
print(title + "\n" + header + "".join(line for line in rows if size(line) == largest), end="")
EOF
done
grep -E '^KV content check|^  hit: |every hit block read back|target' "$logs/benchmark.log" || true
grep -hE 'keyed policy|the floor of events' "$logs/benchmark-keyed.log" "$logs/benchmark-events.log" 2>/dev/null || true
if [ "$status" -ne 0 ]; then
    echo "logs: $logs"
elif [ "$keep_logs" = "0" ]; then
    rm -rf "$logs"
fi
exit "$status"
