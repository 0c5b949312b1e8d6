"""Prompts to token ids, the same way for admission and for generation.

The middleware counts the tokens it reserves bytes for; the endpoint then tokenizes what it really
runs. Both go through here, so the counts agree to the token: a chat is rendered with the model's
chat template (Qwen's ChatML, default system prompt included) *before* it is counted.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any

ROLES = ("system", "user", "assistant")
#: Prompts longer than this (characters) are tokenized in a worker thread.
INLINE_CHARS = 2048


def message_text(content: Any, where: str) -> str:
    """OpenAI message content (a string, text parts, or null) as one string."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for index, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise TypeError(f"{where}.content[{index}] must be a text part ({{'type': 'text', 'text': ...}})")
            texts.append(part["text"])
        return "".join(texts)
    raise TypeError(f"{where}.content must be a string, a list of text parts or null")


def render_chat(tokenizer: Any, messages: Any) -> str:
    """The prompt text of a chat: the model's template, ending where the assistant's answer starts."""
    if not isinstance(messages, list) or not messages:
        raise TypeError("'messages' must be a non-empty list")
    plain = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, Mapping):
            raise TypeError(f"{where} must be an object")
        role = message.get("role")
        if role == "developer":  # OpenAI's newer name for the system role
            role = "system"
        if role not in ROLES:
            raise ValueError(f"{where}.role must be one of {', '.join(ROLES)}, not {role!r}")
        plain.append({"role": role, "content": message_text(message.get("content"), where)})
    return str(tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True))


def chat_prompt(tokenizer: Any) -> Callable[[Mapping[str, Any]], str]:
    """``@gpu_bound(prompt=...)`` for chat routes: the rendered chat, so admission counts what runs."""

    def prompt(body: Mapping[str, Any]) -> str:
        if "messages" not in body:
            raise ValueError("the body has no 'messages'")
        return render_chat(tokenizer, body["messages"])

    return prompt


def encoder(tokenizer: Any) -> Callable[[str], list[int]]:
    """Text to ids exactly as ``gpu_asgi.HFTokenCounter`` counts them (special tokens in text are parsed)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return lambda text: list(backend.encode(text, add_special_tokens=False).ids)
    return lambda text: list(tokenizer.encode(text, add_special_tokens=False))


async def encode_all(encode: Callable[[str], list[int]], texts: list[str]) -> list[list[int]]:
    """Token ids of each text; long texts are tokenized off the event loop."""
    if sum(map(len, texts)) <= INLINE_CHARS:
        return [encode(text) for text in texts]
    return await asyncio.to_thread(lambda: [encode(text) for text in texts])
