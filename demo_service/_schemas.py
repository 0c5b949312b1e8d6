"""Request and response bodies: ``/v1/generate`` and the OpenAI-shaped completions and chat APIs.

Sizes (prompt, ``max_tokens``, ``n``) are checked by gpu_asgi before the endpoint runs, and the
endpoint generates exactly the ``max_new_tokens`` the middleware admitted. These models check the
rest, and name the OpenAI parameters this demo does not implement instead of silently ignoring them.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


def usage(prompt_tokens: int, completion_tokens: int) -> Usage:
    return Usage(
        prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, total_tokens=prompt_tokens + completion_tokens
    )


def _stops(stop: str | list[str] | None) -> tuple[str, ...]:
    return () if stop is None else (stop,) if isinstance(stop, str) else tuple(stop)


# -- /v1/generate ------------------------------------------------------------------------------


class GenerateRequest(BaseModel):
    """``{"prompt": ..., "max_new_tokens": ...}``: raw text in, generated text out (no chat template)."""

    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(min_length=1)
    max_new_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(0.0, ge=0.0, le=2.0, description="0 is greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop: list[str] | None = Field(None, max_length=4)

    @property
    def stops(self) -> tuple[str, ...]:
        return _stops(self.stop)


class AdmissionInfo(BaseModel):
    """What gpu_asgi decided for the request."""

    device: str
    estimated_bytes: int
    queue_wait_seconds: float
    batch_size: int


class GenerateResponse(BaseModel):
    id: str
    object: Literal["text_generation"] = "text_generation"
    created: int
    model: str
    text: str
    finish_reason: str
    usage: Usage
    admission: AdmissionInfo


# -- OpenAI: shared ----------------------------------------------------------------------------


class StreamOptions(BaseModel):
    include_usage: bool = False


class OpenAIRequest(BaseModel):
    """Parameters common to completions and chat. Unknown fields are ignored, as OpenAI's SDKs add some."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="0 is greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = Field(None, max_length=4)
    seed: int | None = None
    user: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None

    #: (field, value that is fine): anything else is refused with a clear 422.
    UNSUPPORTED: ClassVar[tuple[tuple[str, Any], ...]] = (
        ("presence_penalty", 0.0),
        ("frequency_penalty", 0.0),
        ("logit_bias", None),
    )

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> OpenAIRequest:
        for name, fine in self.UNSUPPORTED:
            value = getattr(self, name, None)
            if value not in (fine, None) and value != {}:
                raise ValueError(f"{name!r} is not supported by this server (got {value!r})")
        return self

    @property
    def stops(self) -> tuple[str, ...]:
        return _stops(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


# -- /v1/completions ---------------------------------------------------------------------------


class CompletionRequest(OpenAIRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(None, ge=1)
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    UNSUPPORTED: ClassVar[tuple[tuple[str, Any], ...]] = (
        *OpenAIRequest.UNSUPPORTED,
        ("echo", False),
        ("logprobs", None),
        ("best_of", 1),
        ("suffix", None),
    )


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: str | None = None
    logprobs: None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


# -- /v1/chat/completions -----------------------------------------------------------------------


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatRequest(OpenAIRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None

    UNSUPPORTED: ClassVar[tuple[tuple[str, Any], ...]] = (
        *OpenAIRequest.UNSUPPORTED,
        ("logprobs", False),
        ("top_logprobs", None),
        ("tools", None),
        ("tool_choice", None),
    )

    @model_validator(mode="after")
    def _text_only(self) -> ChatRequest:
        if self.response_format is not None and self.response_format.get("type", "text") != "text":
            raise ValueError(f"response_format {self.response_format.get('type')!r} is not supported (only 'text')")
        return self


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    finish_reason: str | None = None
    logprobs: None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "demo_service"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
