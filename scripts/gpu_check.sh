#!/usr/bin/env bash
# The GPU check (H200 device machine: python3 with torch 2.11+cu130 and Triton 3.6, no vLLM, no
# internet, nothing of ours installed). Prepare it HERE with scripts/gpu_bundle.sh, then:
#
#   bash scripts/gpu_check.sh --plan [--budget-left B]   the whole check, here on CPU: device
#                                  calls, what each sends (<= 64 MiB with the tree), the time each
#                                  step is given, all inside 12 minutes (exit 1 when it is not)
#   bash scripts/gpu_check.sh --next K B [S]              call K's exact run() arguments, given
#                                  B = status budget_left_s now and S = the same before call 1
#   GPU_START_LEFT=S GPU_BUDGET_LEFT=B bash scripts/gpu_check.sh
#                                  ON THE DEVICE, the command of every call (carry
#                                  [".gpu-bundle/tK"]): stage tK, keep the background worker
#                                  running the steps, copy results into $OUT; the last call waits
#                                  for the worker (scripts/gpu_run.py has the details)
#   bash scripts/gpu_check.sh --dry-run --carry tK        rehearse call K here on CPU (state in
#                                  /tmp/gpu-check-dry: real staging, model rebuild, bench_kernels
#                                  --smoke, engine configs validated, no engine started)
# Steps, in value order (scripts/gpu_plan.py STEPS): kernels, install, model, kernels-fa,
# e2e-flash, e2e-rocketkv, e2e-fp8, e2e-piecewise, serve, e2e-bench, tests.
# GPU_CHECK_STEPS=a,b restricts a rerun to those steps (on a warm machine, nothing carried).
set -u -o pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [ -x "$ROOT/.venv/bin/python" ] && [ "${1:-}" != "" ] && [ "${1:-}" != "--device" ]; then
  HERE_PY=$ROOT/.venv/bin/python
else
  HERE_PY=python3
fi
case "${1:-}" in
  --plan)
    shift
    exec "$HERE_PY" "$ROOT/scripts/gpu_plan.py" plan "$@" ;;
  --next)
    [ $# -ge 3 ] || { echo "usage: gpu_check.sh --next K BUDGET_LEFT [START_LEFT]"; exit 2; }
    exec "$HERE_PY" "$ROOT/scripts/gpu_plan.py" next --call "$2" --budget-left "$3" \
      ${4:+--start-left "$4"} ;;
  --dry-run)
    shift
    if [ "${1:-}" = --carry ]; then export GPU_CHECK_CARRY=${2:?--carry tK}; shift 2; fi
    export PYTHON=${PYTHON:-$HERE_PY}
    exec "$PYTHON" "$ROOT/scripts/gpu_run.py" call --dry-run ;;
  ""|--device)
    export PYTHON=${PYTHON:-python3}
    command -v "$PYTHON" > /dev/null || { echo "gpu_check: no $PYTHON"; exit 2; }
    exec "$PYTHON" "$ROOT/scripts/gpu_run.py" call ;;
  *)
    sed -n '2,22p' "${BASH_SOURCE[0]}"; exit 2 ;;
esac
