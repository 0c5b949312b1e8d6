"""``AnalyticEstimator``: a request's bytes from a decoder-only transformer's architecture.

Reads a transformers config (or its ``config.json`` dict) without importing torch or
transformers; docs/admission.md, "Choosing an estimator", derives each term.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .contract import check_counts

DEFAULT_DTYPE_BYTES = 2  # float16: what a config without a dtype is served in
DEFAULT_SAMPLING_BUFFERS = 10

_DTYPE_BYTES = {
    "float16": 2, "half": 2, "fp16": 2, "bfloat16": 2, "bf16": 2,
    "float32": 4, "float": 4, "fp32": 4, "float64": 8, "double": 8,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1, "uint8": 1,
}


#: How ``config._attn_implementation`` names map to what the attention keeps in memory.
_ATTENTION = {
    "eager": "eager", "sdpa": "sdpa", "flash_attention_2": "flash", "flash_attention_3": "flash",
    "flash": "flash", "flex_attention": "sdpa", "paged_attention": "flash",
}
ATTENTION_KINDS = ("eager", "sdpa", "flash")
LOGITS_KINDS = ("last", "all")


@dataclass(frozen=True, slots=True)
class AnalyticEstimator:
    """Bytes from the architecture of a decoder-only transformer (Llama/Qwen2 family).

    estimate = KV cache for prompt + max_new tokens
             + the larger of one prefill layer's workspace and a decode step's workspace
               with the logits and decoding buffers (all-position logits: with the stream).

    Follows how the model runs (docs/admission.md, "Choosing an estimator", derives each term):

    - ``attention``: ``"eager"`` materialises the prompt x prompt scores in prefill; ``"sdpa"``
      (transformers' default) and ``"flash"`` kernels do not. ``from_config`` reads it from
      ``config._attn_implementation``.
    - ``sampling``: True budgets the vocab-sized float32 buffers of temperature/top-k/top-p
      sampling; False is greedy decoding (argmax). ``estimate(..., sampling=...)`` overrides it
      per request.
    - ``logits``: ``"last"`` for ``generate`` (one position per sequence); ``"all"`` for a plain
      forward that keeps every prompt position (scoring, perplexity, custom endpoints).
    - ``padding``: a request of several sequences may be left-padded (prompts of different
      lengths, a dynamic batch), so SDPA gets a prompt x context mask; False for routes whose
      sequences always have one length (``n`` samples of one prompt). ``additive_mask``: the
      SDPA kernel converts that boolean mask to the dtype (CUDA's memory-efficient and cuDNN
      kernels do); False where it takes it as is (PyTorch's CPU flash kernel, measured).
    - ``dtype_bytes``: the dtype the model runs in.

    An upper bound for Hugging Face transformers: the KV part is exact (sliding-window layers
    are counted at full length). ``CalibratedEstimator`` corrects it from measured peaks.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    num_attention_heads: int
    dtype_bytes: int = DEFAULT_DTYPE_BYTES
    attention: str = "sdpa"
    sampling: bool = True
    logits: str = "last"
    padding: bool = True
    additive_mask: bool = True
    sampling_buffers: int = DEFAULT_SAMPLING_BUFFERS

    def __post_init__(self) -> None:
        sizes = (self.num_layers, self.num_kv_heads, self.head_dim, self.hidden_size,
                 self.intermediate_size, self.vocab_size, self.num_attention_heads, self.dtype_bytes)
        if min(sizes) < 1 or self.sampling_buffers < 0:
            raise ValueError(f"sizes must be positive, got {self!r}")
        if self.num_attention_heads % self.num_kv_heads:
            raise ValueError("num_attention_heads must be a multiple of num_kv_heads")
        if self.attention not in ATTENTION_KINDS:
            raise ValueError(f"attention must be one of {ATTENTION_KINDS}, got {self.attention!r}")
        if self.logits not in LOGITS_KINDS:
            raise ValueError(f"logits must be one of {LOGITS_KINDS}, got {self.logits!r}")

    @classmethod
    def from_config(cls, config: Any, *, dtype: Any = None, **knobs: Any) -> AnalyticEstimator:
        """Build from a transformers config or its `config.json` dict.

        `dtype`: a torch.dtype, a name such as "bfloat16", or None for the config's
        own `dtype`/`torch_dtype`, else float16. The attention implementation is the one the
        model was loaded with (`config._attn_implementation`), else SDPA, transformers'
        default. `knobs` set the remaining fields (`attention=`, `sampling=`, `logits=`).
        """
        # Multimodal configs nest the language model; its KV cache is what grows.
        if isinstance(config, Mapping):
            text = config.get("text_config") or config
        else:
            text = config.get_text_config() if hasattr(config, "get_text_config") else config

        def get(key: str) -> Any:
            return text.get(key) if isinstance(text, Mapping) else getattr(text, key, None)

        heads = int(get("num_attention_heads"))
        hidden = int(get("hidden_size"))
        if dtype is None:
            dtype = get("dtype") or get("torch_dtype")
        if "attention" not in knobs:
            knobs["attention"] = attention_kind(get("_attn_implementation") or get("attn_implementation"))
        return cls(
            num_layers=int(get("num_hidden_layers")),
            num_kv_heads=int(get("num_key_value_heads") or heads),
            # Some configs carry head_dim=None; others decouple it from hidden_size.
            head_dim=int(get("head_dim") or hidden // heads),
            hidden_size=hidden,
            intermediate_size=int(get("intermediate_size")),
            vocab_size=int(get("vocab_size")),
            num_attention_heads=heads,
            dtype_bytes=_dtype_bytes(dtype),
            **knobs,
        )

    def kv_cache_bytes(self, tokens: int, batch: int = 1) -> int:
        """2 (K and V) x layers x kv_heads x head_dim x dtype bytes, per token and sequence."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes * tokens * batch

    def prefill_workspace_bytes(self, prompt_tokens: int, batch: int = 1) -> int:
        """Transient activations of the one layer running the whole prompt.

        Per token: the embeddings, the layer's input, residual, normed copy and RMSNorm's
        float32 temporaries, SDPA's padding mask, then the larger of attention (q/k/v with
        rotary copies, grouped K/V expanded to all heads, and with eager attention heads x
        prompt^2 scores in the dtype plus their float32 softmax) and the MLP (gate, up and
        their product at intermediate size; eager's attention weights are still alive).
        """
        return self._layer_workspace(prompt_tokens, prompt_tokens, batch)

    def decode_workspace_bytes(self, context_tokens: int, batch: int = 1) -> int:
        """Transient activations of one decode step attending to `context_tokens`."""
        return self._layer_workspace(1, context_tokens, batch)

    def logits_bytes(self, batch: int = 1, *, sampling: bool | None = None, positions: int = 1) -> int:
        """Logits in the model dtype for `positions` per sequence, plus the decoding buffers.

        `generate` asks for the last position only (`logits_to_keep=1`) and copies it to
        float32; greedy decoding adds one more float32 copy (a logits processor's output)
        before the argmax. Temperature/top-k/top-p masks, the top-p sort and cumsum and the
        softmax keep about seven more float32 copies, int64 sort indices (two) and boolean
        masks alive: `sampling_buffers` vocab-sized float32 buffers (10, measured).
        """
        sampling = self.sampling if sampling is None else sampling
        buffers = self.sampling_buffers if sampling else 2
        return batch * self.vocab_size * (self.dtype_bytes * positions + 4 * buffers)

    def estimate(
        self, prompt_tokens: int, max_new_tokens: int, batch: int = 1, *, sampling: bool | None = None
    ) -> int:
        """Peak bytes of one request; `sampling` (None: this estimator's default) is per request.

        The KV cache (counted at full length from the start: simpler, and safe) plus the largest
        of what is alive on top of it at three moments: one prefill layer; the logits after the
        last layer; a decode step, during which the last step's decoding buffers are still held.
        """
        check_counts(prompt_tokens, max_new_tokens, batch)
        total = prompt_tokens + max_new_tokens
        if self.logits == "all":
            positions = max(prompt_tokens, 1)
            # Logits of every position next to the final norm's output, after the layers ran.
            tail = self.logits_bytes(batch, sampling=sampling, positions=positions) + self._stream(positions) * batch
        else:
            tail = self.logits_bytes(batch, sampling=sampling) + self.decode_workspace_bytes(total, batch)
        return self.kv_cache_bytes(total, batch) + max(self.prefill_workspace_bytes(prompt_tokens, batch), tail)

    def _stream(self, query: int) -> int:
        # The model's input embeddings, the layer's input, the residual and the normed copy;
        # RMSNorm upcasts to float32 (its square and product).
        return query * self.hidden_size * (4 * self.dtype_bytes + 8)

    def _layer_workspace(self, query: int, context: int, batch: int) -> int:
        # Layers run one after another, so only one layer's temporaries are alive at once.
        h, d, b = self.hidden_size, self.head_dim, self.dtype_bytes
        heads, kv = self.num_attention_heads, self.num_kv_heads
        # Rotary makes up to four copies of q and k; v; the output transposed and reshaped.
        attention = query * d * b * (4 * (heads + kv) + kv + 2 * heads)
        # DynamicCache grows by torch.cat, so the old K/V of this layer outlive the new;
        # flash kernels read grouped K/V as they are, eager and SDPA expand them to all
        # heads (repeat_kv) whenever a mask is passed.
        expanded = heads if heads != kv and self.attention != "flash" else 0
        attention += 2 * context * d * b * (kv + expanded)
        mlp = query * (3 * self.intermediate_size + h) * b  # gate, up, act*up; down output
        mask = 0
        if self.attention == "sdpa" and self.padding and batch > 1:
            # Padded rows give SDPA a boolean mask, alive through every layer; kernels that take
            # an additive mask convert it to the dtype (CUDA's memory-efficient kernel).
            mask = query * context * (1 + (b if self.additive_mask else 0))
        if self.attention == "eager":
            scores = query * context * heads
            # The masked scores, the float32 copy softmax makes of a half-precision input and
            # its float32 output, alive at once; plus the additive mask (one per sequence).
            attention += scores * (b + 4 + (4 if b != 4 else 0)) + query * context * b
            # The layer keeps the attention weights (in the dtype) until it returns: they
            # are still alive while the MLP runs.
            mlp += scores * b + query * context * b
        return batch * (self._stream(query) + mask + max(attention, mlp))


def attention_kind(implementation: Any) -> str:
    """``"eager"``, ``"sdpa"`` or ``"flash"`` for a transformers ``attn_implementation`` name.

    None (not set) is SDPA, transformers' default; an unknown name (a custom kernel) is
    treated as eager, the one that keeps the most.
    """
    if implementation is None:
        return "sdpa"
    return _ATTENTION.get(str(implementation), "eager")


def _dtype_bytes(dtype: Any) -> int:
    itemsize = getattr(dtype, "itemsize", None)  # a torch.dtype, read without importing torch
    if isinstance(itemsize, int):
        return itemsize
    name = str(dtype).removeprefix("torch.").lower()
    if dtype is None or name == "auto":
        return DEFAULT_DTYPE_BYTES
    if name not in _DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; pass e.g. 'float16', 'bfloat16' or 'float32'")
    return _DTYPE_BYTES[name]
