"""What gpu_asgi learns from the running vLLM server at startup: its KV cache, model and tokenizer.

vLLM's OpenAI server keeps its engine client and ``vllm_config`` in ``app.state`` before it starts
serving; by then the engine has sized its KV cache (``cache_config.num_gpu_blocks``, the figure
vLLM also exports as ``cache_config_info``). Everything the budget and the estimator need is read
from there; nothing is asked of the user.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .._estimate.paged import VLLM_RESERVED_BLOCKS

#: Bytes of one KV-cache element for vLLM's ``--kv-cache-dtype`` values ("auto": the model's dtype).
_CACHE_DTYPE_BYTES = {
    "float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2,
    "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "fp8_inc": 1, "fp8_ds_mla": 1,
}


class ServerNotReady(RuntimeError):
    """The app is not a vLLM OpenAI server that has finished starting its engine."""


@dataclass(frozen=True, slots=True, kw_only=True)
class VLLMServer:
    """The figures gpu_asgi sizes admission from, as the running server reports them."""

    model: str
    #: KV-cache blocks of all engines of this server (data-parallel engines: summed, as vLLM does).
    num_blocks: int
    block_size: int
    kv_dtype: str
    #: KV bytes per token: 2 (keys, values) x layers x KV heads x head size x dtype bytes.
    kv_bytes_per_token: int
    max_model_len: int
    #: Engines whose blocks ``num_blocks`` sums; each keeps one null block.
    engines: int
    tokenizer: Any
    #: The server's ``--chat-template`` (None: the model's own).
    chat_template: str | None
    #: The server's ``--default-chat-template-kwargs``.
    chat_template_kwargs: dict[str, Any]

    @property
    def usable_blocks(self) -> int:
        """Blocks sequences can hold: each engine keeps one as its null block."""
        return self.num_blocks - VLLM_RESERVED_BLOCKS * self.engines

    def describe(self) -> str:
        return (
            f"model {self.model!r}: {self.num_blocks} KV blocks of {self.block_size} tokens "
            f"({self.usable_blocks} usable), {self.kv_dtype} KV at {self.kv_bytes_per_token} B/token, "
            f"max_model_len {self.max_model_len}"
        )


def learn(state: Any) -> VLLMServer:
    """Read the server's figures from its ``app.state``; :class:`ServerNotReady` when they are not there."""
    config = getattr(state, "vllm_config", None)
    engine = getattr(state, "engine_client", None)
    if config is None or engine is None:
        raise ServerNotReady(
            "gpu_asgi.vllm.VLLMAdmission found no vLLM engine in app.state (vllm_config, engine_client): "
            "attach it to vLLM's OpenAI server with --middleware gpu_asgi.vllm.VLLMAdmission"
        )
    cache, model, parallel = config.cache_config, config.model_config, config.parallel_config
    num_blocks = cache.num_gpu_blocks
    if not isinstance(num_blocks, int) or num_blocks < 2:
        raise ServerNotReady(f"vLLM reports no usable KV cache (num_gpu_blocks={num_blocks!r})")
    kv_dtype = str(cache.cache_dtype)
    if kv_dtype == "auto":
        kv_dtype = str(model.dtype).removeprefix("torch.")
    if kv_dtype not in _CACHE_DTYPE_BYTES:
        raise ServerNotReady(f"gpu_asgi.vllm does not know the size of KV cache dtype {kv_dtype!r}")
    per_token = (
        2 * model.get_num_layers(parallel) * model.get_num_kv_heads(parallel) * model.get_head_size()
        * _CACHE_DTYPE_BYTES[kv_dtype]
    )
    try:
        tokenizer = engine.renderer.get_tokenizer()
    except (AttributeError, ValueError) as error:  # --skip-tokenizer-init: no exact counts possible
        raise ServerNotReady(f"vLLM has no tokenizer to count prompts with: {error}") from None
    renderer = getattr(state, "online_renderer", None)
    return VLLMServer(
        model=str(model.served_model_name or model.model),
        num_blocks=num_blocks,
        block_size=int(cache.block_size),
        kv_dtype=kv_dtype,
        kv_bytes_per_token=per_token,
        max_model_len=int(model.max_model_len),
        engines=max(1, int(getattr(parallel, "data_parallel_size", 1) or 1)),
        tokenizer=tokenizer,
        chat_template=getattr(renderer, "chat_template", None),
        chat_template_kwargs=dict(getattr(renderer, "default_chat_template_kwargs", None) or {}),
    )
