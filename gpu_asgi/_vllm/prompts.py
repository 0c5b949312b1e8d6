"""What vLLM will tokenize, rebuilt from a request body, so admission counts the tokens that run.

Completions: the prompt as sent (text, or token ids counted as they are), after the special tokens
the tokenizer adds in front (a BOS; none for Qwen). Chat completions and responses: the messages
rendered with the served model's chat template, as vLLM renders them before tokenizing (text parts
of a message joined, the generation prompt added unless the body says otherwise).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

PromptGetter = Callable[[Any], "str | Sequence[str]"]


def special_prefix(tokenizer: Any) -> str:
    """The text of the special tokens the tokenizer puts before every prompt (``""`` for Qwen).

    Counting ``prefix + text`` without special tokens then counts exactly what vLLM's
    ``encode(text)`` gives, since the tokenizer reads its special tokens back out of text."""
    ids = tokenizer.encode("", add_special_tokens=True)
    return str(tokenizer.decode(ids)) if ids else ""


def completion_prompt(prefix: str) -> PromptGetter:
    """``/v1/completions``: ``prompt`` as vLLM takes it (a string, strings, token ids, lists of them)."""

    def prompt(body: Mapping[str, Any]) -> Any:
        value = body.get("prompt")
        if value is None:
            raise ValueError("the body has no 'prompt'")
        if not prefix:
            return value
        if isinstance(value, str):
            return prefix + value
        if isinstance(value, list) and value and all(isinstance(item, str) for item in value):
            return [prefix + item for item in value]
        return value  # token ids: vLLM adds nothing to them

    return prompt


def message_content(content: Any, where: str) -> str:
    """A message's ``content`` as the chat template sees it: text parts joined by newlines, as
    vLLM's chat parser joins them for a template that takes string content."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        texts = []
        for index, part in enumerate(content):
            if not isinstance(part, Mapping):
                raise ValueError(f"{where}.content[{index}] must be an object")
            text = part.get("text")
            if part.get("type") in ("text", "input_text", "output_text") and isinstance(text, str):
                texts.append(text)
            else:
                raise ValueError(f"{where}.content[{index}] is not a text part: gpu_asgi.vllm counts text only")
        return "\n".join(texts)
    raise ValueError(f"{where}.content must be a string, a list of text parts or null")


def plain_messages(messages: Any, name: str) -> list[dict[str, Any]]:
    """OpenAI messages with their content flattened to strings; the other keys kept (tool calls)."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{name!r} must be a non-empty list of messages")
    plain = []
    for index, message in enumerate(messages):
        where = f"{name}[{index}]"
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise ValueError(f"{where} must be an object with a string 'role'")
        plain.append({**message, "content": message_content(message.get("content"), where)})
    return plain


@dataclass(frozen=True, slots=True)
class ChatTemplate:
    """How the server renders a chat: its tokenizer, its ``--chat-template`` (None: the model's) and
    its ``--default-chat-template-kwargs`` (under what a request sends in ``chat_template_kwargs``)."""

    tokenizer: Any
    template: str | None = None
    defaults: Mapping[str, Any] = field(default_factory=dict)


def render(chat: ChatTemplate, messages: list[dict[str, Any]], body: Mapping[str, Any]) -> str:
    """The chat as text, as vLLM renders it before tokenizing."""
    own = body.get("chat_template_kwargs") or {}
    if not isinstance(own, Mapping):
        raise ValueError("'chat_template_kwargs' must be an object")
    kwargs = {**chat.defaults, **own}
    continue_final = body.get("continue_final_message") is True
    rendered = chat.tokenizer.apply_chat_template(
        messages,
        chat_template=chat.template,
        tools=body.get("tools") or None,
        tokenize=False,
        add_generation_prompt=body.get("add_generation_prompt", True) is not False and not continue_final,
        continue_final_message=continue_final,
        **kwargs,
    )
    return str(rendered)


def chat_prompt(chat: ChatTemplate) -> PromptGetter:
    """``/v1/chat/completions``: ``messages`` rendered with the chat template."""

    def prompt(body: Mapping[str, Any]) -> str:
        return render(chat, plain_messages(body.get("messages"), "messages"), body)

    return prompt


def responses_prompt(chat: ChatTemplate) -> PromptGetter:
    """``/v1/responses``: ``instructions`` as the system message, then ``input`` (a string: one
    user message; a list: its message items), rendered with the chat template."""

    def prompt(body: Mapping[str, Any]) -> str:
        value = body.get("input")
        if isinstance(value, str):
            messages: list[dict[str, Any]] = [{"role": "user", "content": value}]
        else:
            items = [item for item in value or () if isinstance(item, Mapping) and "role" in item]
            messages = plain_messages(items, "input")
        instructions = body.get("instructions")
        if isinstance(instructions, str) and instructions:
            messages.insert(0, {"role": "system", "content": instructions})
        return render(chat, messages, body)

    return prompt
