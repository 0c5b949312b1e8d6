"""gpu_asgi inside vLLM's OpenAI-compatible server: ``--middleware gpu_asgi.vllm.VLLMAdmission``.

Everything it needs is learnt from the running server (KV-cache blocks, block size, KV dtype, model,
tokenizer, ``max_model_len``); the rest is a few ``GPU_ASGI_*`` variables. See docs/vllm.md.
"""

from ._vllm.middleware import VLLMAdmission, budget_for
from ._vllm.server import ServerNotReady, VLLMServer, learn
from ._vllm.settings import SettingsError, VLLMSettings

__all__ = ["ServerNotReady", "SettingsError", "VLLMAdmission", "VLLMServer", "VLLMSettings", "budget_for", "learn"]

for _name in __all__:
    globals()[_name].__module__ = __name__
