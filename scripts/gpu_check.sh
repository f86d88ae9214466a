#!/usr/bin/env bash
# The GPU check, run ON the GPU host (docs/gpu-check.md says how the files get there):
#
#   . /tmp/site/.bundle/env.sh && bash scripts/gpu_check.sh 1   # then the same with 2
#
# Needs: the vLLM bundle of ../shared/offline-gpu installed and its env sourced (the line above),
# python3 with torch, Triton, transformers, pytest (the host's own). Nothing is pip-installed: the
# checkout is put on PYTHONPATH, and the package's entry points (pyproject.toml, through which vLLM
# finds the plugin) go into a generated rocketkv_vllm dist-info beside it.
#
# Two parts, one device command each (PART = 1, 2, or all), sized from the H200's measured costs so
# that each stays under 6 minutes (docs/gpu-check.md has the plan and the seconds). Steps, in this
# order, each under `timeout` with its own limit in seconds (0 skips the step):
#   part 1 (limits add up to 360 s):
#   model          GPU_CHECK_MODEL_S=40          SmolLM2 rebuilt from the carried GGUF slices
#                  ($MODEL_STAGE/smollm2.gguf.xz.NN + smollm2-meta.tar.xz, scripts/gpu_model.py) into
#                  $MODEL_DIR, then used as ROCKETKV_GPU_MODEL; skipped when that is already set
#                  or $MODEL_DIR holds it (part 2 after part 1)
#   kernels        GPU_CHECK_KERNELS_S=100       compile check + Triton kernel tests, on CUDA
#   gpu-tests-1    GPU_CHECK_TESTS1_S=220        tests/test_gpu.py::TestOnGPU: FLASH_ATTN, ROCKETKV
#                                                (FULL graphs), PIECEWISE, fp8 KT engines
#   part 2 (limits add up to 310 s; 440 s with bench-e2e):
#   gpu-tests-host GPU_CHECK_TESTS_HOST_S=90     tests/test_gpu.py::TestOnGPUHostTier: ROCKETKV with a
#                                                host tier (vLLM's CUDA worker) vs caching off, 4 turns
#   gpu-tests-2    GPU_CHECK_TESTS2_S=150        tests/test_gpu.py::TestOnGPUFp8CacheAndServe: the
#                                                fp8 KV cache engines, `vllm serve`
#   bench-kernels  GPU_CHECK_BENCH_KERNELS_S=70  scripts/bench_kernels.py: decode attention per layer,
#                                                trtllm vs FLASH_ATTN, 4k/32k/128k x batch 1/8 (the full
#                                                grid and the before/after: scripts/gpu_speed.sh)
#   bench-e2e      GPU_CHECK_BENCH_E2E_S=0       scripts/bench_e2e.py, 16 x 7,800 tokens + 128,
#                                                FLASH_ATTN vs ROCKETKV (skipped unless given a limit,
#                                                e.g. 130: scripts/gpu_speed.sh measures end to end)
# Every pytest step runs with -v: a step cut by its limit still names what passed and failed.
# The torch.compile cache (~/.cache/vllm) is left on: a rerun on a warm machine reuses it.
# Results, written as each step ends, in $OUT (default results/gpu): summary.txt (card, versions,
# then one line a step: name, exit code (124 or 137: timed out), seconds), STEP.log each,
# gpu-tests.xml (JUnit), kernels-h200.json, e2e-h200.json. Continues after a failed step; exit
# status 1 when any step failed, 2 without CUDA (after the model step, so that it can be
# rehearsed on CPU). Env: PY (python3), MODEL_STAGE (/tmp/stage/model), MODEL_DIR (/tmp/smollm2).
set -u -o pipefail
PART=${1:-all}
case "$PART" in 1 | 2 | all) ;; *) echo "usage: gpu_check.sh [1|2|all]" >&2; exit 2 ;; esac
in_part() { [ "$PART" = all ] || [ "$PART" = "$1" ]; }
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 2
PY=${PY:-python3}
OUT=${OUT:-results/gpu}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd) || exit 2
MODEL_STAGE=${MODEL_STAGE:-/tmp/stage/model}
MODEL_DIR=${MODEL_DIR:-/tmp/smollm2}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
unset TRITON_INTERPRET # the real Triton backend: CUDA

# -- the checkout importable (rocketkv_vllm, rocketkv_eval) and its entry points visible: $EP
. scripts/gpu_host.sh || exit 2
export PYTHONPATH=$ROOT:$ROOT/eval:$EP${PYTHONPATH:+:$PYTHONPATH}

{
  echo "# gpu_check part $PART $(date -u +%Y-%m-%dT%H:%M:%SZ), commit $(git rev-parse --short HEAD 2> /dev/null || echo '?')"
  echo "# card: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -1)"
  echo "# $("$PY" -c 'import sys, torch, triton, vllm; print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__, "vllm", vllm.__version__)' 2>&1 | tail -1)"
} >> "$OUT/summary.txt"
cat "$OUT/summary.txt"


if [ -z "${ROCKETKV_GPU_MODEL:-}" ] && [ -f "$MODEL_DIR/config.json" ]; then
  export ROCKETKV_GPU_MODEL=$MODEL_DIR # rebuilt by an earlier part
fi
if [ -n "${ROCKETKV_GPU_MODEL:-}" ]; then
  step model 0
else
  # Python's lzma, not the xz tool, which the host may lack (the bundle's install.sh falls back too)
  export UNXZ='import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.stdin.buffer), sys.stdout.buffer)'
  step model "${GPU_CHECK_MODEL_S:-40}" bash -c 'set -e; cat "$1"/smollm2.gguf.xz.[0-9]* | "$3" -c "$UNXZ" > "$1/smollm2.gguf"
    "$3" scripts/gpu_model.py rebuild "$1/smollm2.gguf" "$1/smollm2-meta.tar.xz" "$2"' \
    _ "$MODEL_STAGE" "$MODEL_DIR" "$PY" && export ROCKETKV_GPU_MODEL=$MODEL_DIR
fi
"$PY" -c 'import torch; assert torch.cuda.is_available()' 2> /dev/null \
  || { echo "gpu_check: torch sees no CUDA device" | tee -a "$OUT/summary.txt"; exit 2; }
XDIST=()
"$PY" -c 'import xdist' 2> /dev/null && XDIST=(-n 8)
if in_part 1; then
  step kernels "${GPU_CHECK_KERNELS_S:-100}" "$PY" -m pytest -v -rs -p no:cacheprovider "${XDIST[@]}" \
    tests/test_kernels.py tests/test_triton_fp8.py tests/test_large_cache.py \
    tests/test_compile_kernels.py tests/test_warmup.py \
    -m "not engine"
  step gpu-tests-1 "${GPU_CHECK_TESTS1_S:-220}" "$PY" -m pytest -v -s -rs -p no:cacheprovider \
    "tests/test_gpu.py::TestOnGPU" --junitxml="$OUT/gpu-tests-1.xml"
fi
if in_part 2; then
  step gpu-tests-host "${GPU_CHECK_TESTS_HOST_S:-90}" "$PY" -m pytest -v -s -rs -p no:cacheprovider \
    "tests/test_gpu.py::TestOnGPUHostTier" --junitxml="$OUT/gpu-tests-host.xml"
  step gpu-tests-2 "${GPU_CHECK_TESTS2_S:-150}" "$PY" -m pytest -v -s -rs -p no:cacheprovider \
    "tests/test_gpu.py::TestOnGPUFp8CacheAndServe" --junitxml="$OUT/gpu-tests-2.xml"
  T=${GPU_CHECK_BENCH_KERNELS_S:-70}
  step bench-kernels "$T" "$PY" scripts/bench_kernels.py --configs preset=trtllm \
    --methods dense_flash_attn,rocketkv --contexts 4096,32768,131072 --batches 1,8 \
    --stage1-context 0 --time-budget $((T > 30 ? T - 20 : 10)) --out "$OUT/kernels-h200.json"
  step bench-e2e "${GPU_CHECK_BENCH_E2E_S:-0}" "$PY" scripts/bench_e2e.py \
    ${ROCKETKV_GPU_MODEL:+--model "$ROCKETKV_GPU_MODEL"} --prompts 16 --prompt-tokens 7800 \
    --new-tokens 128 --kv-cache-gib 6 --max-num-batched-tokens 8192 --gpu-memory-utilization 0.2 \
    --out "$OUT/e2e-h200.json"
fi

echo "gpu_check: $([ "$FAILED" = 0 ] && echo 'every step passed' || echo 'FAILED steps above'); results in $OUT"
exit "$FAILED"
