"""Demo service for gpu_asgi: a FastAPI app serving Qwen2 behind the admission middleware."""
