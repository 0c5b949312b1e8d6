"""Token counters: a Hugging Face tokenizer when the host has one, else a conservative heuristic."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

# str.translate table that deletes ASCII digits; the length difference counts them in C.
_DIGITS = b"0123456789"


@runtime_checkable
class TokenCounter(Protocol):
    """Counts the tokens of one text. ``inline_limit`` is the text length (characters)
    above which the middleware counts in a worker thread so the event loop keeps serving."""

    @property
    def inline_limit(self) -> int: ...

    def count(self, text: str) -> int: ...


@dataclass(frozen=True, slots=True)
class HeuristicTokenCounter:
    """Over-estimates what a byte-level BPE tokenizer (Qwen, Llama 3, GPT) produces.

    ``non_ascii_chars + digits + ceil(other_ascii_chars / 2.5) + 1``: a CJK character or an emoji
    is rarely less than one token, Qwen splits numbers into single digits, and English prose and
    code average 3.5-4 characters per token. Tested against Qwen's real tokenizer on English,
    Chinese, code, digit-heavy and emoji-heavy text: it never counted low and stayed within
    1.8x (tests/test_tokens.py). Estimating high costs some concurrency; low risks an OOM.
    """

    ascii_chars_per_token: float = 2.5
    # Pure C-level work (encode, translate): cheap even for megabyte prompts.
    inline_limit: int = 1 << 62

    def count(self, text: str) -> int:
        if not text:
            return 0
        ascii_bytes = text.encode("ascii", "ignore")  # digits are ASCII; bytes.translate is 2x str.translate
        non_ascii = len(text) - len(ascii_bytes)
        digits = len(ascii_bytes) - len(ascii_bytes.translate(None, _DIGITS))
        return non_ascii + digits + math.ceil((len(text) - non_ascii - digits) / self.ascii_chars_per_token) + 1


class HFTokenCounter:
    """Counts with a Hugging Face tokenizer (``AutoTokenizer.from_pretrained(...)``)."""

    __slots__ = ("_encode", "inline_limit")

    def __init__(self, tokenizer: Any, *, inline_limit: int = 2048) -> None:
        self._encode: Callable[[str], Sequence[int]]
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:  # a fast tokenizer: call the Rust encoder directly, skip the Python wrapper
            self._encode = lambda text: backend.encode(text, add_special_tokens=False).ids
        else:
            self._encode = lambda text: tokenizer.encode(text, add_special_tokens=False)
        self.inline_limit = inline_limit

    def count(self, text: str) -> int:
        return len(self._encode(text))

    def __repr__(self) -> str:
        return f"HFTokenCounter(inline_limit={self.inline_limit})"


async def count_tokens_in_thread(counter: TokenCounter, texts: Sequence[str]) -> list[int]:
    """Tokens of each text, counted in a worker thread so the event loop keeps serving.

    The middleware counts inline (no coroutine, no thread hop) while the texts are within
    ``counter.inline_limit`` characters and calls this for longer ones.
    """
    return await asyncio.to_thread(lambda: [counter.count(text) for text in texts])
