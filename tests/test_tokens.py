"""Token counters: the heuristic errs high; HF counting matches the tokenizer."""

from __future__ import annotations

import pytest

from gpu_asgi import HeuristicTokenCounter, HFTokenCounter, TokenCounter


def test_heuristic_counts_bytes_and_digits_conservatively() -> None:
    counter = HeuristicTokenCounter()
    assert isinstance(counter, TokenCounter)
    assert counter.count("") == 0
    assert counter.count("abc") == 2  # ceil(3 / 3) + 1
    assert counter.count("1234567890") == 11  # every digit is a token in Qwen
    assert counter.count("你好") == 3  # 6 UTF-8 bytes
    assert HeuristicTokenCounter(bytes_per_token=1.0).count("abcd") == 5


class FakeSlowTokenizer:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        assert add_special_tokens is False
        return list(range(len(text.split())))


def test_hf_counter_uses_the_tokenizer_without_special_tokens() -> None:
    counter = HFTokenCounter(FakeSlowTokenizer(), inline_limit=10)
    assert counter.count("a b c") == 3
    assert counter.inline_limit == 10
    assert isinstance(counter, TokenCounter)
