"""Model loading for the demo service: one model, loaded once, on one device.

Two kinds of model go through the same `load_model`:

* **CPU (the default).** The tiny Qwen2-architecture model of `_local_model`, created on first
  start and then loaded with `from_pretrained` like any checkpoint, in float32; optionally int8
  (`torch.ao.quantization.quantize_dynamic`).
* **CUDA.** A pre-quantized checkpoint such as Qwen2-1.5B-Instruct-AWQ in float16.
  Transformers 5 loads AWQ checkpoints through **`gptqmodel`** (its AWQ kernels) and needs
  **`accelerate`** too; `autoawq` is archived and no longer used by transformers.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from .._startup import step
from .local import DEFAULT_MODEL_DIR, ensure_local_model, hf_progress, qwen_tiktoken_path

__all__ = ["DEFAULT_MODEL_DIR", "LoadedModel", "ensure_local_model", "load_model", "qwen_tiktoken_path"]


@dataclass(frozen=True)
class LoadedModel:
    """A model loaded once on its device, with what the service needs to know about it."""

    model: PreTrainedModel = field(repr=False)
    tokenizer: PreTrainedTokenizerBase = field(repr=False)
    device: str  # "cpu" or "cuda:N"
    dtype: torch.dtype
    weights_bytes: int  # fixed cost, taken off the VRAM budget once
    quantization: str | None  # "awq", "int8-dynamic" or None
    name: str


def load_model(
    model_path: str | Path | None,
    *,
    device: str = "auto",
    int8: bool = False,
    progress: bool = True,
    local_dir: str | Path | None = None,
) -> LoadedModel:
    """Load a causal LM and its tokenizer once, on one device.

    `model_path=None` loads the local tiny model, created on first use in `local_dir`
    (default `DEFAULT_MODEL_DIR`), on the CPU in float32 unless `device` names a GPU. Otherwise `model_path` is any `from_pretrained`
    location. `device="auto"` picks the current CUDA device when there is one, else the
    CPU. `int8=True` (CPU only) quantizes the Linear layers dynamically.
    """
    if model_path is None:
        with step(f"checking the tiny local model in {local_dir or DEFAULT_MODEL_DIR} (created on first start)"):
            path: str | Path = ensure_local_model(local_dir, progress=progress)
        resolved = "cpu" if device == "auto" else _resolve_device(device)
    else:
        path = model_path
        resolved = _resolve_device(device)
    if int8 and resolved != "cpu":
        raise ValueError("int8 dynamic quantization is CPU-only; use an AWQ checkpoint on CUDA")
    name = Path(str(path)).name
    with hf_progress(progress), step(f"loading {name} on {resolved}{' (int8)' if int8 else ''}"):
        if resolved == "cpu":
            return _load_cpu(path, name, int8=int8, local_only=model_path is None)
        return _load_cuda(path, name, resolved)


def _load_cpu(path: str | Path, name: str, *, int8: bool, local_only: bool) -> LoadedModel:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=local_only).eval()
    tokenizer = _load_tokenizer(path, local_only=local_only)
    quantization = _quant_method(model)
    if int8:
        if quantization is not None:
            raise ValueError(f"{name} is already quantized ({quantization})")
        # Deprecated in torch 2.13 in favour of torchao's `quantize_`, but still works and is
        # the fast path on x86 CPUs: torchao's int8 configs ran ~2x slower than float32
        # here without torch.compile, quantize_dynamic ~4x faster. Silence its warnings.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            warnings.filterwarnings("ignore", r"torch\.quantize_per_tensor", UserWarning)
            model = torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)
        quantization = "int8-dynamic"
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        device="cpu",
        dtype=model.dtype,
        weights_bytes=_weights_bytes(model),
        quantization=quantization,
        name=name,
    )


def _load_cuda(path: str | Path, name: str, device: str) -> LoadedModel:
    """Load in float16 straight onto `device` (an AWQ checkpoint needs `gptqmodel`).

    Untested on CPU-only machines: the project's CI has no GPU.
    """
    # device_map puts the weights on the GPU while loading: no CPU copy, and no
    # model.to() later (never per request).
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float16, device_map=device)
    model.eval()
    tokenizer = _load_tokenizer(path, local_only=False)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        device=device,
        dtype=model.dtype,
        weights_bytes=_weights_bytes(model),
        quantization=_quant_method(model),
        name=name,
    )


def _load_tokenizer(path: str | Path, *, local_only: bool) -> PreTrainedTokenizerBase:
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=local_only)
    # The demo batches prompts with left padding, whatever the checkpoint defaults to.
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _resolve_device(device: str) -> str:
    if device == "auto":
        return f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        return device
    if device == "cuda" or device.startswith("cuda:"):
        index = int(device.partition(":")[2] or 0)
        if not torch.cuda.is_available() or index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r} is not available")
        return f"cuda:{index}"
    raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {device!r}")


def _quant_method(model: PreTrainedModel) -> str | None:
    qc = getattr(model.config, "quantization_config", None)
    method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
    method = getattr(method, "value", method)  # transformers' QuantizationMethod enum -> "awq"
    return str(method) if method else None


def _weights_bytes(model: torch.nn.Module) -> int:
    """Bytes held by parameters and buffers (shared tensors counted once)."""
    tensors = list(model.parameters()) + list(model.buffers())
    total = sum(t.numel() * t.element_size() for t in tensors)
    # quantize_dynamic packs int8 weights into opaque objects that are neither parameters
    # nor buffers; count them too, or an int8 model would look smaller than it is.
    for module in model.modules():
        if isinstance(module, torch.ao.nn.quantized.dynamic.Linear):
            weight, bias = module.weight(), module.bias()
            total += weight.numel() * weight.element_size()
            total += 0 if bias is None else bias.numel() * bias.element_size()
    return total
