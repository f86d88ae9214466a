#!/usr/bin/env bash
# gpu_bundle.sh: run HERE (package index reachable), before a session that has the H200.
# Prepares everything scripts/gpu_check.sh needs there, in the git-ignored folder .gpu-bundle/:
#   .gpu-bundle/vllm/partsN  vLLM 0.32.0 offline bundle, built with the shared recipe
#                            (../shared/offline-gpu/build_bundle.sh: ~135 MiB of xz in parts of
#                            <= 45 MiB; ~2-4 min of CPU, downloads cached in ~/.cache)
#   .gpu-bundle/model/       the embedded SmolLM2 as GGUF + metadata (scripts/gpu_model.py pack;
#                            94 MiB; the prepared bf16 model is 257 MiB, too big to carry)
#   .gpu-bundle/tK/          one folder per device call, each the `carry` of that call:
#                            bundle part K (for K <= parts), a slice of the model payload,
#                            the recipe's stage.sh + install.sh, TRANSFER_INFO
# Each tK is sized so that it plus the working tree (tracked + untracked-not-ignored files)
# stays under the device's 64 MiB per call (LIMIT_MIB) with MARGIN_MIB to spare. With today's
# tree (~0.3 MiB) that is 4 calls: three bundle parts each topped up with model slices, then
# the rest of the model. Prints the exact device calls at the end.
# Env: OFFLINE_GPU (recipe dir, default ../shared/offline-gpu)  VLLM_PARTS (a folder that
#      already holds parts1..N: no build)  REBUILD=1 (rebuild bundle and model payload)
#      LIMIT_MIB (64)  MARGIN_MIB (2)  PY (.venv/bin/python, else python3)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
OFFLINE=${OFFLINE_GPU:-$ROOT/../shared/offline-gpu}
B=.gpu-bundle
LIMIT=$(( ${LIMIT_MIB:-64} * 1048576 ))
MARGIN=$(( ${MARGIN_MIB:-2} * 1048576 ))
PY=${PY:-}
[ -n "$PY" ] || { [ -x .venv/bin/python ] && PY=.venv/bin/python || PY=python3; }
REBUILD=${REBUILD:-0}
mib() { awk -v b="$1" 'BEGIN { printf "%.1f", b / 1048576 }'; }
bytes() { du -cb "$@" | tail -1 | cut -f1; }

# 0. the folder must never travel except as a carry, nor be committed
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qxF "/$B/" "$exclude" 2>/dev/null || echo "/$B/" >> "$exclude"
git check-ignore -q "$B/x" || { echo "gpu_bundle: $B is not ignored by git"; exit 1; }
mkdir -p "$B"

# 1. vLLM bundle (the shared recipe; reused when already built)
if [ -n "${VLLM_PARTS:-}" ]; then
  PARTS_DIR=$(cd "$VLLM_PARTS" && pwd)
  echo "gpu_bundle: using the bundle parts in $PARTS_DIR"
elif [ -f "$B/vllm/parts1/BUNDLE_INFO" ] && [ "$REBUILD" != 1 ]; then
  PARTS_DIR=$ROOT/$B/vllm
  echo "gpu_bundle: reusing $PARTS_DIR (REBUILD=1 rebuilds)"
else
  [ -f "$OFFLINE/build_bundle.sh" ] || { echo "gpu_bundle: no recipe at $OFFLINE"; exit 1; }
  echo "gpu_bundle: building the vLLM bundle with $OFFLINE/build_bundle.sh (a few minutes)"
  bash "$OFFLINE/build_bundle.sh" "$ROOT/$B/vllm"
  PARTS_DIR=$ROOT/$B/vllm
fi
mapfile -t PARTS < <(ls -d "$PARTS_DIR"/parts[0-9]* | sort -V)
NP=${#PARTS[@]}
[ "$NP" -gt 0 ] || { echo "gpu_bundle: no parts in $PARTS_DIR"; exit 1; }
for f in stage.sh install.sh; do
  [ -f "$OFFLINE/$f" ] || { echo "gpu_bundle: $OFFLINE/$f missing"; exit 1; }
done

# 2. model payload: one uncompressed tar of the GGUF and its metadata
if [ "$REBUILD" = 1 ] || [ ! -f "$B/model/smollm2.gguf" ] || [ ! -f "$B/model/smollm2-meta.tar.xz" ]; then
  "$PY" scripts/gpu_model.py pack "$B/model"
fi
WORK=$B/work
rm -rf "$WORK" && mkdir -p "$WORK"
tar -cf "$WORK/model.tar" -C "$B/model" smollm2.gguf smollm2-meta.tar.xz
MBYTES=$(stat -c %s "$WORK/model.tar")
MSHA=$(sha256sum "$WORK/model.tar" | cut -d' ' -f1)

# 3. what else travels with every call: the working tree
TREE=$(git ls-files -co --exclude-standard -z | du -cb --files0-from=- | tail -1 | cut -f1)
TOOLS=$(bytes "$OFFLINE/stage.sh" "$OFFLINE/install.sh")
CAP=$(( LIMIT - MARGIN - TREE - TOOLS - 16384 ))   # 16 KiB: info and checksum files
echo "gpu_bundle: per call $(mib $LIMIT) MiB = tree $(mib "$TREE") + margin $(mib $MARGIN)" \
     "+ tools + payload <= $(mib $CAP) MiB; model payload $(mib "$MBYTES") MiB; $NP bundle parts"

# 4. lay out the transfers: part K + model slices while model bytes remain
rm -rf "$B"/t[0-9]*
off=0; k=0; slices=()
while [ "$k" -lt "$NP" ] || [ "$off" -lt "$MBYTES" ]; do
  k=$((k + 1)); T=$B/t$k
  mkdir -p "$T/tools"
  cp "$OFFLINE/stage.sh" "$OFFLINE/install.sh" "$T/tools/"
  used=0
  if [ "$k" -le "$NP" ]; then
    cp -r "${PARTS[$((k - 1))]}" "$T/parts$k"
    used=$(bytes "$T/parts$k")
  fi
  room=$(( CAP - used ))
  [ "$room" -ge 0 ] || { echo "gpu_bundle: part $k alone is over the per-call limit"; exit 1; }
  n=$(( MBYTES - off < room ? MBYTES - off : room ))
  if [ "$n" -gt 0 ]; then
    idx=$(( ${#slices[@]} + 1 )); name=$(printf 'model.tar.%02d' "$idx")
    mkdir -p "$T/model"
    dd if="$WORK/model.tar" of="$T/model/$name" bs=1M iflag=skip_bytes,count_bytes \
       skip="$off" count="$n" status=none
    (cd "$T/model" && sha256sum "$name" > SHA256SUMS)
    slices+=("$name")
    off=$((off + n))
  fi
done
NT=$k
for i in $(seq 1 "$NT"); do
  [ -d "$B/t$i/model" ] && printf 'PREFIX=model.tar\nNPIECES=%s\nBYTES=%s\nSHA256=%s\n' \
    "${#slices[@]}" "$MBYTES" "$MSHA" > "$B/t$i/model/MODEL_INFO"
done
rm -rf "$WORK"

# 5. what each call runs (gpu_check.sh STEP reads TRANSFER_INFO): kernel tests as soon as
#    possible, vLLM install + kernel benchmark once the bundle is complete, the model-based
#    end-to-end checks in the last call
declare -A TASK_OF
add() { case " ${TASK_OF[$1]:-} " in *" $2 "*) ;; *) TASK_OF[$1]="${TASK_OF[$1]:-} $2" ;; esac; }
add 1 tests
add "$NP" install; add "$NP" kernels
for t in install model e2e serve e2e-bench; do add "$NT" "$t"; done
for i in $(seq 1 "$NT"); do
  printf 'STEP=%s\nNSTEPS=%s\nTASKS="%s"\n' "$i" "$NT" "${TASK_OF[$i]:-}" | sed 's/=" /="/' \
    > "$B/t$i/TRANSFER_INFO"
done

# 6. the plan
echo
echo "== GPU check: $NT device calls, back to back"
echo "   A machine stays warm only ~30 s after a call and /tmp/stage must survive between"
echo "   calls, so issue each call right after the previous one returns. Files come back"
echo "   under the call's files_at: copy the JSON files into results/ before the next call."
for i in $(seq 1 "$NT"); do
  size=$(bytes "$B/t$i")
  # shellcheck disable=SC1090
  . "$B/t$i/TRANSFER_INFO"
  case $i in
    1) budget=150 ;;
    "$NT") budget=540 ;;
    *) if [ -n "$TASKS" ]; then budget=330; else budget=60; fi ;;
  esac
  echo
  echo "call $i: run(command=\"GPU_CHECK_BUDGET=$budget bash scripts/gpu_check.sh $i\","
  echo "            carry=[\".gpu-bundle/t$i\"], timeout_s=$((budget + 30)))"
  echo "   sends $(mib $((size + TREE))) MiB (carry $(mib "$size") + tree $(mib "$TREE"));" \
       "stages $(ls "$B/t$i" | grep -E '^parts' || echo 'no bundle part')" \
       "+ $(ls "$B/t$i/model" 2>/dev/null | grep -c '^model.tar') model slice(s);" \
       "tasks: ${TASKS:-none (stage only)}"
done
echo
echo "Reruns on the same warm machine (nothing carried): bash scripts/gpu_check.sh run TASK..."
echo "(tasks: tests install kernels model e2e serve e2e-bench). Results: \$OUT/stepK.log,"
echo "kernels-h200.json, checks-h200.json, e2e-h200.json, serve.log."
