#!/usr/bin/env bash
# Install finetune into the current Python environment (use a venv if you like).
#   bash scripts/setup.sh        # the tool, with the backends this machine can run
#   bash scripts/setup.sh dev    # plus the test tools
# torch goes in first, from the right place: a CPU-only Linux box gets the CPU wheel (PyPI's
# default Linux wheel carries several GB of CUDA libraries); a box where nvidia-smi answers
# gets the CUDA wheel from PyPI. The package's own `torch>=...` range is then already met.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
pip_install() { "$PY" -m pip install --disable-pip-version-check -q "$@"; }

case "$(uname -s)" in
  Darwin) extras="mlx" ;;           # Apple Silicon: MLX is the backend; torch is not needed
  *)      extras="cuda,mlx" ;;      # Linux: torch/PEFT/bitsandbytes, and mlx[cpu] for development
esac
[ "${1:-}" = "dev" ] && extras="$extras,dev"

if [ "$(uname -s)" != "Darwin" ] && ! "$PY" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "setup: NVIDIA GPU found: installing the CUDA build of torch==$TORCH_VERSION" >&2
    pip_install "torch==$TORCH_VERSION"
  else
    echo "setup: no NVIDIA GPU: installing the CPU build of torch==$TORCH_VERSION" >&2
    # --retries 1: where that index is unreachable (an offline mirror) pip moves on quickly
    pip_install "torch==$TORCH_VERSION" --extra-index-url https://download.pytorch.org/whl/cpu --retries 1
  fi
fi
pip_install -e ".[$extras]"
echo "setup: installed finetune[$extras]" >&2
