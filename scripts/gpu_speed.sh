#!/usr/bin/env bash
# Decode speed on the GPU host, before and after, in one device command (issue 38's targets):
#
#   . /tmp/site/.bundle/env.sh && bash scripts/gpu_speed.sh
#
# Needs what scripts/gpu_check.sh needs (the vLLM bundle installed, its env sourced). Steps, each
# under `timeout` (limits add up to 350 s):
#   kernels  GPU_SPEED_KERNELS_S=150  bench_kernels, trtllm preset, 4k/8k/16k/32k/128k x batch
#                                     1/8/32: FLASH_ATTN and ROCKETKV's 3-launch decode in one
#                                     process, beside the committed H200 numbers of the six-launch
#                                     decode before it and of FLASH_ATTN that day (--before,
#                                     results/gpu-h200-2026-12-04/)
#                                     (GPU_SPEED_METHODS: add rocketkv_reuse for a step whose
#                                     rows reuse their selection, reselect_every, and
#                                     rocketkv_nopdl for the decode with PDL off)
#   e2e      GPU_SPEED_E2E_S=200      bench_e2e, a Llama-3.1-8B-shaped model from its config.json
#                                     with random weights, FLASH_ATTN vs preset=trtllm, workloads
#                                     32k x 1, 32k x 8 on one engine per method
# Results in $OUT (default results/gpu-speed): summary.txt, a log a step, kernels.json, e2e.json.
# 128k x 8 end to end takes longer than a command allows beside the rest:
# `GPU_SPEED_WORKLOADS=131000x8 GPU_SPEED_KERNELS_S=0 ...` runs it alone.
set -u -o pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 2
PY=${PY:-python3}
OUT=${OUT:-results/gpu-speed}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd) || exit 2
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
. scripts/gpu_host.sh || exit 2
"$PY" -c 'import torch; assert torch.cuda.is_available()' 2> /dev/null \
  || { echo "gpu_speed: torch sees no CUDA device"; exit 2; }
{
  echo "# gpu_speed $(date -u +%Y-%m-%dT%H:%M:%SZ), commit $(git rev-parse --short HEAD 2> /dev/null || echo '?')"
  echo "# card: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -1)"
} > "$OUT/summary.txt"
K=${GPU_SPEED_KERNELS_S:-150}
step kernels "$K" env PYTHONPATH="$ROOT:$ROOT/eval:$EP${PYTHONPATH:+:$PYTHONPATH}" "$PY" \
  scripts/bench_kernels.py --configs preset=trtllm --methods "${GPU_SPEED_METHODS:-dense_flash_attn,rocketkv}" \
  --stage1-context 0 --time-budget $((K > 40 ? K - 25 : 15)) --out "$OUT/kernels.json"
step e2e "${GPU_SPEED_E2E_S:-200}" env PYTHONPATH="$ROOT:$ROOT/eval:$EP${PYTHONPATH:+:$PYTHONPATH}" \
  "$PY" scripts/bench_e2e.py --model-config llama-3.1-8b \
  --workloads "${GPU_SPEED_WORKLOADS:-32000x1,32000x8}" --new-tokens 128 \
  --max-num-batched-tokens 16384 --methods dense,preset=trtllm --out "$OUT/e2e.json"
cat "$OUT/summary.txt"
exit "$FAILED"
