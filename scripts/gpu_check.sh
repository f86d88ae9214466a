#!/usr/bin/env bash
# The GPU check, for the H200 device machine (python3 with torch 2.11+cu130 and triton 3.6,
# no vLLM, no internet, our package not installed). Prepare it HERE first with
# scripts/gpu_bundle.sh, which prints the exact device calls; then, back to back:
#
#   gpu_check.sh STEP [TASK...]   stage .gpu-bundle/tSTEP (the call's carry): its vLLM bundle part
#                                 into /tmp/stage (the shared recipe's stage.sh) and its model slice
#                                 into /tmp/stage-model; then run the step's tasks (TRANSFER_INFO)
#                                 or the TASKs given
#   gpu_check.sh run TASK...      only run tasks (reruns on the same warm machine)
#   gpu_check.sh --dry-run ...    CPU rehearsal here: real staging, shim, model rebuild and
#                                 bench_kernels --smoke under /tmp/gpu-check-dry; engine-starting
#                                 tasks only print their commands
# Tasks, each with a timeout and skipped when GPU_CHECK_BUDGET (seconds for this command,
# default 540) runs short:
#   tests      tests/test_kernels.py compiled on CUDA (pytest, xdist when present)   ~1-2 min
#   install    vLLM from /tmp/stage (the recipe's install.sh, into /tmp/site)        ~1-2 min
#   kernels    scripts/bench_kernels.py -> $OUT/kernels-h200.json                    ~2-4 min
#   model      SmolLM2 rebuilt from the staged GGUF (scripts/gpu_model.py)            ~20 s
#   e2e        scripts/gpu_e2e.py engines: FLASH_ATTN vs uncompressed ROCKETKV (greedy tokens),
#              needle at token_budget 256 (bf16, fp8 KT), full-graph decode == piecewise tokens
#              -> checks-h200.json                                                   ~5-6 min
#   serve      vllm serve MODEL --attention-backend ROCKETKV + one openai chat request ~1-2 min
#   e2e-bench  scripts/bench_e2e.py dense vs ROCKETKV -> $OUT/e2e-h200.json           ~2-3 min
# Our package is made importable without pip: /tmp/rkv-site holds rocketkv_vllm/ as symlinks
# into this checkout (kernels/ and configs/ mapped as in pyproject.toml) and a
# rocketkv_vllm-*.dist-info carrying pyproject's entry points, so vLLM (and every process it
# spawns) finds the plugin through PYTHONPATH; plus a `vllm` command (python3 -m
# vllm.entrypoints.cli.main, the console script the unpacked bundle lacks).
# Everything is printed and appended to $OUT/stepSTEP.log; the exit status is non-zero when a
# task fails or cannot run (missing staged data); a task skipped for lack of time is reported.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DRY=0
if [ "${1:-}" = --dry-run ]; then DRY=1; shift; fi
STEP=${1:?usage: gpu_check.sh [--dry-run] STEP|run [TASK...]}
shift
if [ "$DRY" = 1 ]; then
  BASE=${DRY_BASE:-/tmp/gpu-check-dry}
  STAGE=$BASE/stage MSTAGE=$BASE/stage-model SITE=$BASE/site MODEL=$BASE/smollm2 RKV=$BASE/rkv-site
  OUT_DIR=${OUT:-$BASE/out}
  PY=${PYTHON:-$([ -x "$ROOT/.venv/bin/python" ] && echo "$ROOT/.venv/bin/python" || echo python3)}
else
  STAGE=${STAGE:-/tmp/stage} MSTAGE=${MODEL_STAGE:-/tmp/stage-model} SITE=${SITE:-/tmp/site}
  MODEL=${MODEL_DIR:-/tmp/smollm2} RKV=${RKV_SITE:-/tmp/rkv-site}
  OUT_DIR=${OUT:-$ROOT/results/gpu-check}
  PY=${PYTHON:-python3}
fi
PY=$(command -v "$PY" || echo "$PY")
TAG=${GPU_TAG:-h200}
BUDGET=${GPU_CHECK_BUDGET:-540}
T0=$(date +%s)
mkdir -p "$OUT_DIR" "$STAGE" "$MSTAGE"
LOG=$OUT_DIR/step$STEP.log
exec > >(tee -a "$LOG") 2>&1
TEE_PID=$!
finish() { exec 1>&- 2>&-; wait "$TEE_PID" 2>/dev/null; }
trap finish EXIT

left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
say() { echo "[gpu_check $(date +%H:%M:%S) +$(( $(date +%s) - T0 ))s] $*"; }
SUMMARY=()
FAILED=0
record() { SUMMARY+=("$(printf '%-10s %-8s %s' "$1" "$2" "$3")"); [ "$2" = FAIL ] && FAILED=1; :; }

say "step $STEP$([ "$DRY" = 1 ] && echo ' (DRY RUN, CPU)'), budget ${BUDGET}s, repo $ROOT, out $OUT_DIR"

# ------------------------------------------------------------------ staging
stage_step() {  # stage what .gpu-bundle/t$1 carries
  local T=$ROOT/.gpu-bundle/t$1 rc=0 p
  if [ ! -d "$T" ]; then
    say "staging: $T not here (not carried in this call): nothing to stage"
    return 0
  fi
  mkdir -p "$STAGE/tools"
  cp -f "$T"/tools/*.sh "$STAGE/tools/" 2>/dev/null
  for p in "$T"/parts*; do
    [ -d "$p" ] || continue
    say "staging vLLM bundle $(basename "$p") into $STAGE"
    STAGE=$STAGE bash "$STAGE/tools/stage.sh" "$p" || rc=1
  done
  if [ -f "$T/model/SHA256SUMS" ]; then
    cp -f "$T"/model/model.tar.* "$T/model/MODEL_INFO" "$MSTAGE/" || rc=1
    if (cd "$MSTAGE" && sha256sum -c -) < "$T/model/SHA256SUMS"; then
      say "staged model slice(s) $(cut -d' ' -f3 "$T/model/SHA256SUMS" | tr '\n' ' ')"
    else
      say "model slice CHECKSUM MISMATCH: removed, carry t$1 again"
      while read -r _ f; do rm -f "$MSTAGE/$f"; done < "$T/model/SHA256SUMS"
      rc=1
    fi
  fi
  say "staged so far: vLLM bundle $(bundle_missing), model $(model_missing)"
  [ "$rc" = 0 ] || record staging FAIL "checksum or copy error (see above)"
  return $rc
}
bundle_missing() {  # "complete" or the missing chunks
  local PREFIX NPARTS BYTES SHA256 i miss=""
  [ -f "$STAGE/BUNDLE_INFO" ] || { echo "none staged"; return 1; }
  . "$STAGE/BUNDLE_INFO"
  for i in $(seq -f %02g 1 "$NPARTS"); do [ -f "$STAGE/$PREFIX.$i" ] || miss="$miss $i"; done
  [ -z "$miss" ] && { echo complete; return 0; }
  echo "missing chunk(s)$miss of $NPARTS"; return 1
}
model_missing() {
  local PREFIX NPIECES BYTES SHA256 i miss=""
  [ -f "$MSTAGE/MODEL_INFO" ] || { echo "none staged"; return 1; }
  . "$MSTAGE/MODEL_INFO"
  for i in $(seq -f %02g 1 "$NPIECES"); do [ -f "$MSTAGE/$PREFIX.$i" ] || miss="$miss $i"; done
  [ -z "$miss" ] && { echo complete; return 0; }
  echo "missing slice(s)$miss of $NPIECES"; return 1
}

# ------------------------------------------------------------------ environment
setup_env() {
  # vLLM bundle environment (PYTHONPATH=/tmp/site, LD_LIBRARY_PATH if install.sh needed it)
  if [ -f "$SITE/.bundle/env.sh" ]; then
    . "$SITE/.bundle/env.sh"
  fi
  # our package: symlinks + a dist-info with the entry points, first on PYTHONPATH
  rm -rf "$RKV" && mkdir -p "$RKV/rocketkv_vllm" "$RKV/bin"
  local f
  for f in "$ROOT"/rocketkv_vllm/*; do
    [ "$(basename "$f")" = __pycache__ ] || ln -s "$f" "$RKV/rocketkv_vllm/$(basename "$f")"
  done
  ln -sfn "$ROOT/kernels" "$RKV/rocketkv_vllm/kernels"
  ln -sfn "$ROOT/configs" "$RKV/rocketkv_vllm/configs"
  "$PY" - "$ROOT/pyproject.toml" "$RKV" <<'EOF' || say "WARNING: no dist-info written (vLLM will not load the plugin)"
import os, sys, tomllib
proj = tomllib.load(open(sys.argv[1], "rb"))["project"]
d = os.path.join(sys.argv[2], f"{proj['name'].replace('-', '_')}-{proj['version']}.dist-info")
os.makedirs(d)
with open(os.path.join(d, "METADATA"), "w") as f:
    f.write(f"Metadata-Version: 2.1\nName: {proj['name']}\nVersion: {proj['version']}\n")
with open(os.path.join(d, "entry_points.txt"), "w") as f:
    for group, eps in proj.get("entry-points", {}).items():
        f.write(f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) + "\n")
EOF
  printf '#!/bin/sh\nexec "%s" -m vllm.entrypoints.cli.main "$@"\n' "$PY" > "$RKV/bin/vllm"
  chmod +x "$RKV/bin/vllm"
  export PYTHONPATH="$RKV${PYTHONPATH:+:$PYTHONPATH}"
  export PATH="$RKV/bin:$PATH"
  export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
  export PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
  if [ "$DRY" = 1 ]; then export TRITON_INTERPRET=1; else unset TRITON_INTERPRET; fi
  # `python -m` puts the working directory first on sys.path and the repo root holds a
  # rocketkv_vllm/ without kernels/: run from the shim directory
  cd "$RKV" || exit 1
}

show_env() {
  nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader \
    2>/dev/null || say "nvidia-smi: not available"
  "$PY" - <<'EOF'
import importlib.metadata as md, importlib.util, sys
import torch, triton
print(f"python {sys.version.split()[0]} {sys.executable}; torch {torch.__version__} "
      f"(cuda {torch.version.cuda}, device "
      f"{torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}); "
      f"triton {triton.__version__}")
have = {m: bool(importlib.util.find_spec(m)) for m in
        ("vllm", "pytest", "xdist", "yaml", "transformers", "openai", "safetensors")}
print("modules:", " ".join(f"{k}={'yes' if v else 'no'}" for k, v in have.items()))
import rocketkv_vllm, rocketkv_vllm.kernels, rocketkv_vllm.configs  # noqa: E401
eps = [e.value for e in md.entry_points(group="vllm.general_plugins") if e.name == "rocketkv"]
print("rocketkv_vllm from", rocketkv_vllm.__path__[0], "| vllm.general_plugins:", eps)
EOF
}

# ------------------------------------------------------------------ tasks
# run_task NAME MIN_S MAX_S CMD...: skipped (reported) when less than MIN_S is left
run_task() {
  local name=$1 min=$2 max=$3; shift 3
  local l; l=$(left)
  if [ "$l" -lt "$min" ]; then
    say "== $name SKIPPED: ${l}s of the budget left, it needs ${min}s"
    record "$name" SKIPPED "${l}s left < ${min}s"
    return 0
  fi
  local t=$(( l - 15 < max ? l - 15 : max )) start rc
  start=$(date +%s)
  say "== $name (timeout ${t}s): $*"
  timeout -k 15 "$t" "$@"
  rc=$?
  local dt=$(( $(date +%s) - start ))
  if [ $rc = 0 ]; then record "$name" ok "${dt}s"
  elif [ $rc = 124 ] || [ $rc = 137 ]; then record "$name" FAIL "timed out after ${dt}s"
  else record "$name" FAIL "exit $rc after ${dt}s"; fi
  say "== $name: exit $rc after ${dt}s"
}
dry() { say "(dry run: not started) $*"; }

task_tests() {
  local args=(-q -rs -p no:cacheprovider --noconftest)
  if [ "$DRY" = 1 ]; then
    run_task tests 20 120 "$PY" -m pytest --co "${args[@]}" "$ROOT/tests/test_kernels.py"
    return
  fi
  "$PY" -c "import xdist" 2>/dev/null && args+=(-n "${TEST_WORKERS:-8}")
  if "$PY" -c "import pytest" 2>/dev/null; then
    run_task tests 60 240 "$PY" -m pytest "${args[@]}" "$ROOT/tests/test_kernels.py"
  else
    run_task tests 60 240 "$PY" "$ROOT/tests/test_kernels.py" --no-pytest
  fi
}

task_install() {
  local state
  if ! state=$(bundle_missing); then
    say "== install: vLLM bundle $state in $STAGE: carry the missing parts again"
    record install FAIL "bundle $state"; return
  fi
  if [ "$DRY" = 1 ]; then dry STAGE=$STAGE SITE=$SITE bash "$STAGE/tools/install.sh"
    record install dry ""; return; fi
  run_task install 60 240 env STAGE="$STAGE" SITE="$SITE" PY="$PY" bash "$STAGE/tools/install.sh"
  setup_env   # picks up $SITE/.bundle/env.sh
  "$PY" -c "import vllm; print('vllm', vllm.__version__, 'from', vllm.__file__)" ||
    record vllm FAIL "vllm does not import after install"
}

need_vllm() {
  if [ "$DRY" = 0 ] && ! "$PY" -c "import vllm" 2>/dev/null; then
    say "== $1: vLLM does not import (run the install task first)"
    record "$1" FAIL "no vLLM"; return 1
  fi
}

task_kernels() {
  if [ "$DRY" = 1 ]; then
    run_task kernels 30 120 "$PY" "$ROOT/scripts/bench_kernels.py" --smoke \
      --out "$OUT_DIR/kernels-dry.json"
    return
  fi
  "$PY" -c "import vllm" 2>/dev/null ||
    say "kernels: vLLM does not import: dense_flash_attn / dense_triton_attn will be skipped"
  # stop starting new sizes a minute before the budget ends (a size + Stage 1 fit in that)
  local l tb; l=$(left); tb=$(( l - 60 < 240 ? l - 60 : 240 ))
  [ "$tb" -ge 30 ] || tb=30
  run_task kernels 90 330 "$PY" "$ROOT/scripts/bench_kernels.py" --time-budget "$tb" \
    --out "$OUT_DIR/kernels-$TAG.json"
}

task_model() {
  local state
  if [ -f "$MODEL/.rocketkv-complete" ] && [ -f "$MODEL/model.safetensors" ]; then
    say "== model: $MODEL already built"; record model ok "already built"; return
  fi
  if ! state=$(model_missing); then
    say "== model: $state in $MSTAGE: carry the missing slices again"
    record model FAIL "model $state"; return
  fi
  local PREFIX NPIECES BYTES SHA256 x=$MSTAGE/x
  . "$MSTAGE/MODEL_INFO"
  local got
  got=$(cat "$MSTAGE/$PREFIX".[0-9][0-9] | sha256sum | cut -d' ' -f1)
  if [ "$got" != "$SHA256" ]; then
    say "== model: reassembled payload sha256 $got != $SHA256"; record model FAIL "checksum"
    return
  fi
  rm -rf "$x" && mkdir -p "$x" && cat "$MSTAGE/$PREFIX".[0-9][0-9] | tar -x -C "$x"
  run_task model 20 180 "$PY" "$ROOT/scripts/gpu_model.py" rebuild "$x/smollm2.gguf" \
    "$x/smollm2-meta.tar.xz" "$MODEL"
}

need_model() {
  if [ ! -f "$MODEL/model.safetensors" ]; then
    say "== $1: no model at $MODEL (run the model task first)"; record "$1" FAIL "no model"
    return 1
  fi
}

wait_gpu_idle() {  # engines of the previous task must have let go of the GPU
  local i used
  for i in $(seq 1 30); do
    used=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits 2>/dev/null | head -1)
    [ -z "$used" ] && return 0
    [ "$used" -lt 2048 ] && return 0
    sleep 1
  done
  say "WARNING: GPU still has ${used} MiB in use"
}

task_e2e() {
  need_model e2e || return; need_vllm e2e || return
  local cmd=("$PY" "$ROOT/scripts/gpu_e2e.py" engines --model "$MODEL"
             --out "$OUT_DIR/checks-$TAG.json")
  if [ "$DRY" = 1 ]; then dry "${cmd[@]}"; "${cmd[@]:0:3}" --help > /dev/null &&
    record e2e dry "--help ok"; return; fi
  wait_gpu_idle
  run_task e2e 150 420 "${cmd[@]}"
}

task_serve() {
  need_model serve || return; need_vllm serve || return
  local pidf=$OUT_DIR/.serve.pid
  local cmd=("$PY" "$ROOT/scripts/gpu_e2e.py" serve --model "$MODEL"
             --out "$OUT_DIR/checks-$TAG.json" --log "$OUT_DIR/serve.log" --pid-file "$pidf")
  if [ "$DRY" = 1 ]; then dry "${cmd[@]}"; "${cmd[@]:0:3}" --help > /dev/null &&
    record serve dry "--help ok"; return; fi
  wait_gpu_idle
  run_task serve 60 240 "${cmd[@]}"
  if [ -s "$pidf" ]; then  # the server runs in its own session: make sure it is gone
    local pid; pid=$(cat "$pidf")
    if kill -0 "$pid" 2>/dev/null; then
      say "serve: server $pid still running, killing its process group"
      kill -KILL -- "-$pid" 2>/dev/null
    fi
    rm -f "$pidf"
  fi
}

task_e2e_bench() {
  need_model e2e-bench || return; need_vllm e2e-bench || return
  # shellcheck disable=SC2206
  local extra=(${E2E_BENCH_ARGS:---prompts 8 --prompt-tokens 7000 --new-tokens 128 --methods dense,token_budget=256 --kv-cache-gib 8})
  local cmd=("$PY" "$ROOT/scripts/bench_e2e.py" --model "$MODEL" "${extra[@]}"
             --out "$OUT_DIR/e2e-$TAG.json")
  if [ "$DRY" = 1 ]; then dry "${cmd[@]}"; "${cmd[@]:0:2}" --help > /dev/null &&
    record e2e-bench dry "--help ok"; return; fi
  wait_gpu_idle
  run_task e2e-bench 120 420 "${cmd[@]}"
}

# ------------------------------------------------------------------ main
TASK_LIST=("$@")
if [ "$STEP" != run ]; then
  case $STEP in ''|*[!0-9]*) say "STEP must be a number or 'run'"; exit 2 ;; esac
  stage_step "$STEP"
  if [ ${#TASK_LIST[@]} = 0 ] && [ -f "$ROOT/.gpu-bundle/t$STEP/TRANSFER_INFO" ]; then
    TASKS="" ; . "$ROOT/.gpu-bundle/t$STEP/TRANSFER_INFO"
    read -r -a TASK_LIST <<< "$TASKS"
  fi
fi
setup_env
show_env || record environment FAIL "our package does not import (see above)"
say "tasks: ${TASK_LIST[*]:-none}"
for task in "${TASK_LIST[@]}"; do
  case $task in
    tests) task_tests ;;
    install) task_install ;;
    kernels) task_kernels ;;
    model) task_model ;;
    e2e) task_e2e ;;
    serve) task_serve ;;
    e2e-bench) task_e2e_bench ;;
    *) say "unknown task $task"; record "$task" FAIL "unknown task" ;;
  esac
done

echo
say "summary (step $STEP, $(( $(date +%s) - T0 ))s):"
for line in "${SUMMARY[@]}"; do echo "  $line"; done
[ -n "$(ls "$OUT_DIR" 2>/dev/null)" ] && say "files in $OUT_DIR: $(ls "$OUT_DIR" | tr '\n' ' ')"
exit $FAILED
