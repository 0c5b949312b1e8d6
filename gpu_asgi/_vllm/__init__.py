"""gpu_asgi for vLLM's OpenAI server (``gpu_asgi.vllm`` is the public name)."""
