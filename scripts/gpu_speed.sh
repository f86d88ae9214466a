#!/usr/bin/env bash
# Decode speed on the GPU host, before and after, in one device command (issue 38's targets):
#
#   . /tmp/site/.bundle/env.sh && BEFORE=.gpu-bundle/before bash scripts/gpu_speed.sh
#
# BEFORE (optional): a tree of an earlier commit to measure beside this one in the same run, made
# here by `bash scripts/gpu_speed.sh --make-before REV .gpu-bundle/before` (its rocketkv_vllm,
# kernels, eval and scripts: about 1 MiB; carry it with the call). Needs what scripts/gpu_check.sh
# needs (the vLLM bundle installed, its env sourced). Steps, each under `timeout`:
#   kernels-before  GPU_SPEED_KERNELS_S=75   bench_kernels of BEFORE, trtllm, the default rows
#   kernels         GPU_SPEED_KERNELS_S=75   bench_kernels of this tree, the same rows
#   e2e             GPU_SPEED_E2E_S=190      bench_e2e, a Llama-3.1-8B-shaped model from its
#                                            config.json with random weights, FLASH_ATTN vs
#                                            preset=trtllm, workloads 32k x 1, 32k x 8
# (limits add up to 340 s). Results in $OUT (default results/gpu-speed): summary.txt, a log a step,
# kernels-before.json, kernels.json, e2e.json. 128k x 8 end to end takes longer than a command
# allows beside the rest: `GPU_SPEED_WORKLOADS=131000x8 GPU_SPEED_KERNELS_S=0 ...` runs it alone.
set -u -o pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 2
if [ "${1:-}" = --make-before ]; then
  rev=${2:?REV} dest=${3:?DEST}
  rm -rf "$dest" && mkdir -p "$dest"
  git archive "$rev" rocketkv_vllm kernels eval scripts pyproject.toml | tar -x -C "$dest"
  echo "gpu_speed: $rev in $dest ($(du -sh "$dest" | cut -f1))"
  exit 0
fi
PY=${PY:-python3}
OUT=${OUT:-results/gpu-speed}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd) || exit 2
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
. scripts/gpu_entry_points.sh || exit 2
"$PY" -c 'import torch; assert torch.cuda.is_available()' 2> /dev/null \
  || { echo "gpu_speed: torch sees no CUDA device"; exit 2; }
{
  echo "# gpu_speed $(date -u +%Y-%m-%dT%H:%M:%SZ), commit $(git rev-parse --short HEAD 2> /dev/null || echo '?')"
  echo "# card: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -1)"
} > "$OUT/summary.txt"
FAILED=0
step() { # step NAME LIMIT_S COMMAND...
  local name=$1 limit=$2 t0=$SECONDS rc
  shift 2
  [ "$limit" = 0 ] && { printf '%-15s skipped\n' "$name" | tee -a "$OUT/summary.txt"; return 0; }
  echo "\$ $(printf '%q ' "$@")  (limit ${limit}s)" > "$OUT/$name.log"
  timeout -k 15 "$limit" "$@" >> "$OUT/$name.log" 2>&1
  rc=$?
  printf '%-15s exit %-3s %4ss\n' "$name" "$rc" "$((SECONDS - t0))" | tee -a "$OUT/summary.txt"
  [ "$rc" != 0 ] && { FAILED=1; tail -n 20 "$OUT/$name.log" | sed "s/^/  $name| /"; }
  return 0
}
K=${GPU_SPEED_KERNELS_S:-75}
KARGS=(--configs preset=trtllm --contexts 4096,8192,16384,32768,131072 --batches 1,8,32
  --max-model-len 0 --time-budget $((K > 30 ? K - 25 : 10)))
if [ -n "${BEFORE:-}" ]; then
  step kernels-before "$K" env PYTHONPATH="$BEFORE:$BEFORE/eval:$EP" "$PY" "$BEFORE/scripts/bench_kernels.py" \
    "${KARGS[@]}" --out "$OUT/kernels-before.json"
fi
step kernels "$K" env PYTHONPATH="$ROOT:$ROOT/eval:$EP${PYTHONPATH:+:$PYTHONPATH}" "$PY" scripts/bench_kernels.py \
  "${KARGS[@]}" --out "$OUT/kernels.json"
step e2e "${GPU_SPEED_E2E_S:-190}" env PYTHONPATH="$ROOT:$ROOT/eval:$EP${PYTHONPATH:+:$PYTHONPATH}" \
  "$PY" scripts/bench_e2e.py --model-config llama-3.1-8b \
  --workloads "${GPU_SPEED_WORKLOADS:-32000x1,32000x8}" --new-tokens 128 \
  --max-num-batched-tokens 16384 --methods dense,preset=trtllm --out "$OUT/e2e.json"
cat "$OUT/summary.txt"
exit "$FAILED"
