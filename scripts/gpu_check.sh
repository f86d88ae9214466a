#!/usr/bin/env bash
# The one command for the GPU machine (H200; torch + triton, no vLLM, our
# package not installed). Run from anywhere:
#     bash scripts/gpu_check.sh
# 1. makes `rocketkv_vllm` (with `rocketkv_vllm.kernels` -> kernels/ and
#    `rocketkv_vllm.configs` -> configs/) importable from a temp dir of
#    symlinks on PYTHONPATH -- nothing is installed, vLLM is never imported;
# 2. runs tests/test_kernels.py compiled on CUDA (TRITON_INTERPRET unset):
#    with pytest when it is installed, else through the file's own runner;
# 3. runs scripts/bench_kernels.py --out $OUT/kernels-h200.json
#    (OUT defaults to results/), starting no new size after 150 s (the JSON
#    is rewritten after every size, so a time-out keeps what was measured).
# Expected: tests ~1-2 min (mostly Triton compiles), benchmark <= ~3 min.
# pyyaml: only config.py's preset loader needs it; the benchmark stubs the
# module when it is missing. Everything is printed; the exit status is
# non-zero if the tests or the benchmark fail.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT_DIR="${OUT:-$ROOT/results}"
mkdir -p "$OUT_DIR"
read -r -a PY <<< "${PYTHON:-python3}"

PKG_DIR="$(mktemp -d)"
trap 'rm -rf "$PKG_DIR"' EXIT
mkdir -p "$PKG_DIR/rocketkv_vllm"
for f in "$ROOT"/rocketkv_vllm/*; do
    ln -s "$f" "$PKG_DIR/rocketkv_vllm/$(basename "$f")"
done
ln -sfn "$ROOT/kernels" "$PKG_DIR/rocketkv_vllm/kernels"
ln -sfn "$ROOT/configs" "$PKG_DIR/rocketkv_vllm/configs"
export PYTHONPATH="$PKG_DIR${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
export PYTHONDONTWRITEBYTECODE=1
# `python -m` / `python -` put the working directory first on sys.path, and
# the repo root holds a `rocketkv_vllm/` without `kernels`: run from the
# temp dir, with absolute paths to the repo's files.
cd "$PKG_DIR"

echo "== environment"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
"${PY[@]}" - <<'EOF'
import importlib.util, torch, triton
print(f"torch {torch.__version__}  triton {triton.__version__}  "
      f"cuda {torch.version.cuda}  device {torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}")
for mod in ("pytest", "yaml", "vllm"):
    print(f"{mod}: {'yes' if importlib.util.find_spec(mod) else 'no'}")
import rocketkv_vllm.kernels as k
print("rocketkv_vllm.kernels from", k.__file__)
EOF

status=0
echo "== kernel tests (CUDA)"
start=$(date +%s)
if "${PY[@]}" -c "import pytest" 2>/dev/null; then
    timeout 150 "${PY[@]}" -m pytest -q -rs -p no:cacheprovider --noconftest "$ROOT/tests/test_kernels.py" || status=1
else
    timeout 150 "${PY[@]}" "$ROOT/tests/test_kernels.py" --no-pytest || status=1
fi
echo "tests took $(( $(date +%s) - start )) s"

echo "== benchmark"
start=$(date +%s)
timeout 240 "${PY[@]}" "$ROOT/scripts/bench_kernels.py" --time-budget 150 \
    --out "$OUT_DIR/kernels-h200.json" || status=1
echo "benchmark took $(( $(date +%s) - start )) s"
exit $status
