"""Where gpu_asgi's lines go inside vLLM's server."""

from __future__ import annotations

import logging

logger = logging.getLogger("gpu_asgi.vllm")


def vllm_logger() -> logging.Logger:
    """Under vLLM's own logger once vLLM has set up its handler (its logging setup leaves other
    loggers' lines unseen), else ``gpu_asgi.vllm``."""
    vllm = logging.getLogger("vllm")
    return vllm.getChild("gpu_asgi") if vllm.handlers else logger
