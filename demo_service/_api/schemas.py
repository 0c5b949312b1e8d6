"""Request and response bodies: ``/v1/generate`` and the OpenAI-shaped completions and chat APIs.

Sizes (prompt, ``max_tokens``, ``n``) are checked by gpu_asgi before the endpoint runs, and the
endpoint generates exactly the ``max_new_tokens`` the middleware admitted. These models check the
rest, as strictly as the schema reads (JSON's types, no coercion: see :mod:`.fields`), and name the
OpenAI parameters this demo does not implement instead of silently ignoring them.

The schemas also *declare* every limit the server enforces (gpu_asgi's cap on ``max_tokens``, ``n``,
the sequences per request, the OpenAI parameters that only take their neutral value), so that
generated clients and schema-driven testers see them: the per-app limits (the cap, the vocabulary)
go in through :func:`request_models`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator

from .fields import INTEGRAL_FLOATS, Integer, Only, StrictBody

#: Most sequences one request may ask for (``n``, and prompts in a completions list, and their product).
MAX_SEQUENCES = 8

#: A number of tokens to generate (``Tokens | None``: the bound inside the union's member).
Tokens = Annotated[int, Field(ge=1), INTEGRAL_FLOATS]


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


class GenerateRequest(StrictBody):
    """``{"prompt": ..., "max_new_tokens": ...}``: raw text in, generated text out (no chat template)."""

    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(min_length=1)
    max_new_tokens: Tokens | None = None
    temperature: float = Field(0.0, ge=0.0, le=2.0, description="0 is greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop: Annotated[list[str], Field(max_length=4)] | None = None

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


class StreamOptions(StrictBody):
    include_usage: bool = False


class OpenAIRequest(StrictBody):
    """Parameters common to completions and chat. Unknown fields are ignored, as OpenAI's SDKs add some."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="0 is greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: Integer = Field(1, ge=1, le=MAX_SEQUENCES, description=f"Sequences per prompt (prompts x n <= {MAX_SEQUENCES}).")
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | Annotated[list[str], Field(max_length=4)] | None = None
    seed: Integer | None = None
    user: str | None = None
    presence_penalty: float = Field(0.0, json_schema_extra=Only(0), description="Not supported: 0 only.")
    frequency_penalty: float = Field(0.0, json_schema_extra=Only(0), description="Not supported: 0 only.")
    logit_bias: dict[str, float] | None = Field(
        None, json_schema_extra=Only(None, {}), description="Not supported: null or {} only."
    )

    @property
    def stops(self) -> tuple[str, ...]:
        return _stops(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


# -- /v1/completions ---------------------------------------------------------------------------


def _sequences_limit(schema: dict[str, Any]) -> None:
    # prompts x n <= MAX_SEQUENCES, in JSON Schema: one prompt (text or token ids) with any n, or a
    # list of at most k prompts with n <= MAX_SEQUENCES // k, for each k where that bound changes.
    branches: list[dict[str, Any]] = [
        {"properties": {"prompt": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "integer"}}]}}}
    ]
    k = 1
    while k <= MAX_SEQUENCES:
        most = MAX_SEQUENCES // (MAX_SEQUENCES // k)  # the largest list length with the same bound on n
        branches.append({"properties": {"prompt": {"maxItems": most}, "n": {"maximum": MAX_SEQUENCES // k}}})
        k = most + 1
    schema["anyOf"] = branches


def _prompt_schema(vocab_size: int | None) -> Any:
    """The ``prompt`` limits the endpoint enforces (with clearer messages than a union's), declared.

    Text or token ids, every prompt at least one token, at most ``MAX_SEQUENCES`` prompts, token ids
    below the vocabulary size.
    """
    token_id: dict[str, Any] = {"type": "integer", "minimum": 0}
    if vocab_size is not None:
        token_id["maximum"] = vocab_size - 1
    ids = {"type": "array", "minItems": 1, "items": token_id}
    many = {"minItems": 1, "maxItems": MAX_SEQUENCES}

    def declare(schema: dict[str, Any]) -> None:
        schema["anyOf"] = [
            {"type": "string", "minLength": 1},
            {"type": "array", **many, "items": {"type": "string", "minLength": 1}},
            ids,
            {"type": "array", **many, "items": ids},
        ]

    return declare


#: Text, texts, token ids, or lists of token ids.
Prompt = str | list[str] | list[Integer] | list[list[Integer]]


class CompletionRequest(OpenAIRequest):
    model_config = ConfigDict(json_schema_extra=_sequences_limit)

    prompt: Prompt = Field(json_schema_extra=_prompt_schema(None))
    max_tokens: Tokens | None = None
    echo: bool = Field(False, json_schema_extra=Only(False), description="Not supported: false only.")
    logprobs: Integer | None = Field(None, json_schema_extra=Only(None), description="Not supported.")
    best_of: Integer | None = Field(None, json_schema_extra=Only(1, None), description="Not supported: 1 only.")
    suffix: str | None = Field(None, json_schema_extra=Only(None), description="Not supported.")


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


class TextPart(StrictBody):
    type: Literal["text"]
    text: str


class ChatMessage(StrictBody):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatRequest(OpenAIRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Tokens | None = None
    max_completion_tokens: Tokens | None = None
    logprobs: bool | None = Field(None, json_schema_extra=Only(False, None), description="Not supported.")
    top_logprobs: Integer | None = Field(None, json_schema_extra=Only(None), description="Not supported.")
    tools: list[Any] | None = Field(None, json_schema_extra=Only(None), description="Not supported.")
    tool_choice: str | dict[str, Any] | None = Field(None, json_schema_extra=Only(None), description="Not supported.")
    response_format: dict[str, Any] | None = Field(
        None,
        json_schema_extra={"properties": {"type": {"const": "text"}}},
        description='Only {"type": "text"}.',
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


class RequestModels(NamedTuple):
    generate: type[GenerateRequest]
    completion: type[CompletionRequest]
    chat: type[ChatRequest]


def request_models(*, max_new_tokens_cap: int, vocab_size: int) -> RequestModels:
    """The request models of one app, declaring its ``max_tokens`` cap and its token-id range."""

    capped = Annotated[int, Field(ge=1, le=max_new_tokens_cap), INTEGRAL_FLOATS]

    def tokens() -> Any:
        return Field(None, description=f"At most {max_new_tokens_cap} (the server's cap).")

    prompt = Field(json_schema_extra=_prompt_schema(vocab_size))
    return RequestModels(
        generate=create_model("GenerateRequest", __base__=GenerateRequest, max_new_tokens=(capped | None, tokens())),
        completion=create_model(
            "CompletionRequest",
            __base__=CompletionRequest,
            prompt=(Prompt, prompt),
            max_tokens=(capped | None, tokens()),
        ),
        chat=create_model(
            "ChatRequest",
            __base__=ChatRequest,
            max_tokens=(capped | None, tokens()),
            max_completion_tokens=(capped | None, tokens()),
        ),
    )
