#!/usr/bin/env bash
# The GPU checks in one call (tests/gpu/check_gpu.py). The GPU machine's Python has torch,
# transformers and nvidia-ml-py; gpu_asgi's own light dependencies come as wheels carried in
# .gpu-wheels/ (made here with: pip download --no-deps -d .gpu-wheels starlette anyio sniffio idna
# opentelemetry-api importlib-metadata zipp typing-extensions).
set -euo pipefail
cd "$(dirname "$0")/../.."
if ! python3 -c "import starlette, opentelemetry.trace" 2>/dev/null; then
    python3 -m pip install -q --no-index --find-links .gpu-wheels starlette anyio opentelemetry-api
fi
PYTHONPATH=. python3 tests/gpu/check_gpu.py
