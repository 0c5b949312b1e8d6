# syntax=docker/dockerfile:1
#
# The gpu_asgi demo service on one NVIDIA GPU: a CUDA build of torch, the AWQ kernels that
# transformers 5 loads AWQ checkpoints with (gptqmodel), and this project with its `demo` extra.
#
# NOT BUILT OR RUN BY US: the machine this was written on has no Docker engine and no GPU.
# Treat it as a careful starting point, not as a tested artefact (see docs/demo.md).
#
#   docker build -t gpu-asgi-demo .
#   docker run --gpus all -p 8000:8000 -v /srv/models:/models:ro \
#       -e MODEL_PATH=/models/Qwen2-1.5B-Instruct-AWQ gpu-asgi-demo
#
# The model is not in the image and nothing is downloaded at run time (HF_HUB_OFFLINE=1):
# mount a local checkpoint and name it with MODEL_PATH. Without MODEL_PATH the container
# serves the tiny CPU model (created on first start), which is only useful as a smoke test.

ARG CUDA_VERSION=12.8.1
ARG UBUNTU=ubuntu24.04

# ---- build: compile the AWQ kernels against the CUDA toolkit, into a virtual environment ----
FROM nvidia/cuda:${CUDA_VERSION}-cudnn-devel-${UBUNTU} AS build
# The PyTorch wheel index matching CUDA_VERSION (cu128 for 12.8).
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128
# Architectures to compile kernels for: A10/A10G (8.6), A100 (8.0), L4 (8.9), H100 (9.0).
ARG TORCH_CUDA_ARCH_LIST="8.0;8.6;8.9;9.0"
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST}
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential git \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch first, from the CUDA index: `torch==2.13.0` in the demo extra then matches 2.13.0+cu128.
RUN pip install --upgrade pip setuptools wheel \
 && pip install "torch==2.13.0" --index-url ${TORCH_INDEX}
WORKDIR /src
COPY pyproject.toml README.md ./
COPY gpu_asgi ./gpu_asgi
COPY demo_service ./demo_service
RUN pip install ".[demo,nvml]" \
 && pip install --no-build-isolation gptqmodel accelerate

# ---- runtime: the CUDA runtime libraries, the virtual environment, a non-root user ----
FROM nvidia/cuda:${CUDA_VERSION}-cudnn-runtime-${UBUNTU}
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --create-home --uid 10001 --shell /usr/sbin/nologin demo
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    HF_HOME=/home/demo/.cache/huggingface \
    DEMO_HOST=0.0.0.0 \
    DEMO_PORT=8000 \
    DEMO_PROGRESS=false
USER demo
WORKDIR /home/demo
EXPOSE 8000
# /health answers from the ledger and the last device sample: cheap at any rate. 503 (unavailable)
# fails the check; "degraded" (a hot GPU) still passes. The first start may load a model for a while.
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('DEMO_PORT', '8000'), timeout=4)"]
ENTRYPOINT ["python3", "-m", "demo_service"]
