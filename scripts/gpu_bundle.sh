#!/usr/bin/env bash
# gpu_bundle.sh: run HERE (package index reachable), before a session that has the H200.
# Prepares what scripts/gpu_check.sh needs there, in the git-ignored folder .gpu-bundle/:
#   vllm/partsN        vLLM 0.32.0 offline bundle from the shared recipe (../shared/offline-gpu/
#                      build_bundle.sh: ~135 MiB of xz, downloads cached in ~/.cache; built once)
#   vllm-trim/         that bundle slimmed further for a dense model on Hopper (gpu_pack.py trim:
#                      MoE / MLA / KDA / DeepSeek-indexer kernels, Mistral vocabularies, country-
#                      name translations; ~89 MiB of xz), repacked once (xz -9, a few minutes)
#   model/             the embedded SmolLM2 as GGUF + metadata (scripts/gpu_model.py pack) and
#                      payload.tar.xz of both (~87 MiB; the bf16 model would be 257 MiB)
#   tK/                one folder per device call, each the `carry` of that call (gpu_pack.py
#                      split): a bundle chunk and/or a model slice, the recipe's stage.sh and
#                      install.sh, TRANSFER_INFO. Each tK plus the working tree (tracked +
#                      untracked-not-ignored files) stays under the device's 64 MiB per call.
# Then prints the plan (scripts/gpu_plan.py plan): the device calls, what each sends, the time
# each step is given, all inside 12 minutes. Today: 3 calls.
# Env: OFFLINE_GPU (recipe dir, default ../shared/offline-gpu)  VLLM_PARTS (a folder that already
#      holds parts1..N: no build)  REBUILD=1 (rebuild everything)  TRIM=0 (carry the recipe's
#      bundle as it is: 4 calls)  PY (.venv/bin/python, else python3)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
OFFLINE=${OFFLINE_GPU:-$ROOT/../shared/offline-gpu}
B=.gpu-bundle
PY=${PY:-}
[ -n "$PY" ] || { [ -x .venv/bin/python ] && PY=.venv/bin/python || PY=python3; }
REBUILD=${REBUILD:-0}
TRIM=${TRIM:-1}
# the recipe's reproducible tar options (same order, owner and time stamp)
TAR=(tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=@1792195200)

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
for f in stage.sh install.sh; do
  [ -f "$OFFLINE/$f" ] || { echo "gpu_bundle: $OFFLINE/$f missing"; exit 1; }
done
# shellcheck disable=SC1091
. "$PARTS_DIR/parts1/BUNDLE_INFO"   # PREFIX NPARTS BYTES SHA256 of the recipe's archive
RECIPE_SHA=$SHA256

# 2. the archive that travels: trimmed (default) or the recipe's
if [ "$TRIM" = 1 ]; then
  ARCHIVE=$B/vllm-trim/vllm32.tar.xz
  STAMP="recipe $RECIPE_SHA trim $("$PY" scripts/gpu_pack.py trim-id)"
  if [ "$REBUILD" = 1 ] || [ ! -f "$ARCHIVE" ] || [ "$(cat "$B/vllm-trim/SOURCE" 2>/dev/null)" != "$STAMP" ]; then
    echo "gpu_bundle: trimming the bundle (unpack, gpu_pack.py trim, xz -9: a few minutes)"
    rm -rf "$B/vllm-trim" && mkdir -p "$B/vllm-trim/x"
    cat "$PARTS_DIR"/parts*/"$PREFIX".[0-9][0-9] | xz -d | tar -x -C "$B/vllm-trim/x"
    "$PY" scripts/gpu_pack.py trim "$B/vllm-trim/x/vllm32"
    "${TAR[@]}" -C "$B/vllm-trim/x" -cf - vllm32 | xz -9 -T0 > "$ARCHIVE.tmp"
    mv "$ARCHIVE.tmp" "$ARCHIVE"
    rm -rf "$B/vllm-trim/x"
    echo "$STAMP" > "$B/vllm-trim/SOURCE"
  else
    echo "gpu_bundle: reusing $ARCHIVE (made from recipe bundle ${RECIPE_SHA:0:16})"
  fi
else
  ARCHIVE=$B/vllm-full.tar.xz
  cat "$PARTS_DIR"/parts*/"$PREFIX".[0-9][0-9] > "$ARCHIVE"
fi

# 3. model payload: GGUF + metadata (gpu_model.py pack checks the rebuild here), then one xz
if [ "$REBUILD" = 1 ] || [ ! -f "$B/model/smollm2.gguf" ] || [ ! -f "$B/model/smollm2-meta.tar.xz" ]; then
  "$PY" scripts/gpu_model.py pack "$B/model"
fi
MSTAMP=$(cat "$B/model/smollm2.gguf" "$B/model/smollm2-meta.tar.xz" | sha256sum | cut -d' ' -f1)
if [ "$REBUILD" = 1 ] || [ ! -f "$B/model/payload.tar.xz" ] || [ "$(cat "$B/model/payload.src" 2>/dev/null)" != "$MSTAMP" ]; then
  echo "gpu_bundle: compressing the model payload (xz -9e: a few minutes)"
  "${TAR[@]}" -C "$B/model" -cf - smollm2.gguf smollm2-meta.tar.xz | xz -9e -T0 > "$B/model/payload.tar.xz.tmp"
  mv "$B/model/payload.tar.xz.tmp" "$B/model/payload.tar.xz"
  echo "$MSTAMP" > "$B/model/payload.src"
fi

# 4. lay the transfers out: what travels with every call is the working tree
TREE=$(git ls-files -co --exclude-standard -z | du -cb --files0-from=- | tail -1 | cut -f1)
CAP=$("$PY" -c "import sys; sys.path.insert(0, 'scripts'); import gpu_plan; print(gpu_plan.call_cap($TREE))")
echo "gpu_bundle: per call: $(( CAP / 1048576 )) MiB of payload beside the tree" \
     "($(( TREE / 1024 )) KiB); bundle $(( $(stat -c %s "$ARCHIVE") / 1048576 )) MiB," \
     "model $(( $(stat -c %s "$B/model/payload.tar.xz") / 1048576 )) MiB"
"$PY" scripts/gpu_pack.py split --bundle "$ARCHIVE" --model "$B/model/payload.tar.xz" \
  --out "$B" --cap "$CAP" --tree "$TREE" --tools "$OFFLINE/stage.sh" "$OFFLINE/install.sh"

# 5. the plan
echo
"$PY" scripts/gpu_plan.py plan --bundle-dir "$B" --tree-bytes "$TREE"
