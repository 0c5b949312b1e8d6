"""OpenAI-compatible ``/v1/models``, ``/v1/completions`` and ``/v1/chat/completions`` (plain and SSE).

Both generating routes are tagged with ``@gpu_bound``: gpu_asgi counts the prompt (for chat, the
prompt *as rendered* by the chat template), checks ``max_tokens`` and ``n``, and reserves the bytes
before the endpoint runs. ``temperature`` 0 is greedy; anything else samples (OpenAI's default is 1).
"""

# No `from __future__ import annotations`: the endpoints' body types are built per app (they declare
# its max_tokens cap), and FastAPI can resolve only annotations that are objects or module globals.
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Request

from gpu_asgi import Admission, gpu_admission, gpu_bound

from .._batching.device_run import Sampling
from .._batching.jobs import Generation
from .._model.prompts import chat_prompt, encode_all, render_chat
from .._service import SSE_DONE, DemoService, EventStream, complete, hold_until_device_done, new_id, sse
from .responses import error_responses
from .schemas import (
    MAX_SEQUENCES,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatMessageOut,
    Completion,
    CompletionChoice,
    ModelCard,
    ModelList,
    OpenAIRequest,
    Usage,
    request_models,
    usage,
)

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def openai_router(service: DemoService) -> APIRouter:
    router = APIRouter(prefix="/v1", tags=["openai"])
    settings = service.settings
    tokenizer = service.loaded.tokenizer
    bodies = request_models(max_new_tokens_cap=settings.max_new_tokens_cap, vocab_size=service.vocab_size)
    errors = error_responses(openai=True)

    def check_model(model: str | None) -> None:
        if model is not None and model != service.model_name:
            raise HTTPException(
                404, f"The model {model!r} is not served here; this server serves {service.model_name!r}."
            )

    @router.get("/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=service.model_name, created=service.created)])

    @router.post("/completions", response_model=None, responses={200: _ok(Completion, stream=True), **errors})
    @gpu_bound(
        prompt="prompt",
        max_tokens_fields=("max_tokens",),
        default_max_new_tokens=min(COMPLETIONS_DEFAULT_MAX_TOKENS, settings.max_new_tokens_cap),
        max_new_tokens_cap=settings.max_new_tokens_cap,
        max_batch=MAX_SEQUENCES,
        openai_errors=True,  # refusals also carry OpenAI's error object, which OpenAI's SDKs show
    )
    async def completions(
        body: bodies.completion,  # type: ignore[name-defined]  # a class built per app
        request: Request,
        admission: Annotated[Admission, Depends(gpu_admission)],
    ) -> Completion | EventStream:
        check_model(body.model)
        prompts = await _completion_prompts(service, body.prompt)
        if len(prompts) * body.n > MAX_SEQUENCES:
            raise HTTPException(422, f"At most {MAX_SEQUENCES} sequences per request (prompts x n).")
        generation = _submit(service, admission, prompts, body)
        cid, created = new_id("cmpl"), int(time.time())
        if body.stream:

            def chunk(index: int, text: str, finish_reason: str | None) -> bytes:
                choice = CompletionChoice(index=index, text=text, finish_reason=finish_reason)
                return (
                    Completion(id=cid, created=created, model=service.model_name, choices=[choice])
                    .model_dump_json()
                    .encode()
                )

            def usage_chunk() -> bytes:
                done = Completion(
                    id=cid, created=created, model=service.model_name, choices=[], usage=_usage(generation)
                )
                return done.model_dump_json().encode()

            events = _events(admission, generation, chunk, usage_chunk if body.include_usage else None)
            return EventStream(events, generation)
        sequences = await complete(request, admission, generation)
        choices = [CompletionChoice(index=s.index, text=s.text.text, finish_reason=s.finish_reason) for s in sequences]
        return Completion(id=cid, created=created, model=service.model_name, choices=choices, usage=_usage(generation))

    @router.post("/chat/completions", response_model=None, responses={200: _ok(ChatCompletion, stream=True), **errors})
    @gpu_bound(
        prompt=chat_prompt(tokenizer),
        max_tokens_fields=("max_completion_tokens", "max_tokens"),
        default_max_new_tokens=settings.default_max_new_tokens,
        max_new_tokens_cap=settings.max_new_tokens_cap,
        max_batch=MAX_SEQUENCES,
        openai_errors=True,  # refusals also carry OpenAI's error object, which OpenAI's SDKs show
    )
    async def chat_completions(
        body: bodies.chat,  # type: ignore[name-defined]  # a class built per app
        request: Request,
        admission: Annotated[Admission, Depends(gpu_admission)],
    ) -> ChatCompletion | EventStream:
        check_model(body.model)
        text = render_chat(tokenizer, body.model_dump()["messages"])
        prompts = await encode_all(service.encode, [text])
        generation = _submit(service, admission, prompts, body)
        cid, created = new_id("chatcmpl"), int(time.time())
        if body.stream:
            started: set[int] = set()

            def chunk(index: int, text: str, finish_reason: str | None) -> bytes:
                delta = ChatDelta(content=text or None)
                if index not in started:  # the first chunk of a choice names the role
                    started.add(index)
                    delta = ChatDelta(role="assistant", content=text)
                choice = ChatChunkChoice(index=index, delta=delta, finish_reason=finish_reason)
                message = ChatCompletionChunk(id=cid, created=created, model=service.model_name, choices=[choice])
                return message.model_dump_json().encode()

            def usage_chunk() -> bytes:
                done = ChatCompletionChunk(
                    id=cid, created=created, model=service.model_name, choices=[], usage=_usage(generation)
                )
                return done.model_dump_json().encode()

            events = _events(admission, generation, chunk, usage_chunk if body.include_usage else None)
            return EventStream(events, generation)
        sequences = await complete(request, admission, generation)
        choices = [
            ChatChoice(index=s.index, message=ChatMessageOut(content=s.text.text), finish_reason=s.finish_reason)
            for s in sequences
        ]
        return ChatCompletion(
            id=cid, created=created, model=service.model_name, choices=choices, usage=_usage(generation)
        )

    return router


def _ok(model: type[Any], *, stream: bool) -> dict[str, Any]:
    """A 200 answer: the model as JSON, or (``"stream": true``) server-sent events of its chunks."""
    content: dict[str, Any] = {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}
    if stream:
        content["text/event-stream"] = {}  # data: {chunk} events, then data: [DONE]
    return {"description": "The completion (or, streamed, its chunks).", "model": model, "content": content}


def _submit(service: DemoService, admission: Admission, prompts: list[list[int]], body: OpenAIRequest) -> Generation:
    """Queue the request's sequences for batching, with its OpenAI sampling and stop settings."""
    return service.submit(
        admission,
        prompts,
        n=body.n,
        sampling=Sampling(body.temperature, body.top_p),
        stop=body.stops,
        stream=body.stream,
    )


def _usage(generation: Generation) -> Usage:
    return usage(generation.prompt_tokens, generation.completion_tokens)


async def _events(
    admission: Admission,
    generation: Generation,
    chunk: Callable[[int, str, str | None], bytes],
    usage_chunk: Callable[[], bytes] | None,
) -> AsyncIterator[bytes]:
    """``data: {...}`` per text delta, then the usage chunk if asked, then ``data: [DONE]``."""
    try:
        async for delta in generation.deltas():
            if delta.text:
                yield sse(chunk(delta.index, delta.text, None))
            if delta.finish_reason is not None:
                yield sse(chunk(delta.index, "", delta.finish_reason))
    except Exception as exc:  # the batch failed: say so in the stream, as OpenAI does
        error = {"error": {"message": f"Generation failed: {exc}", "type": "server_error"}}
        yield sse(json.dumps(error).encode())
    else:
        if usage_chunk is not None:
            yield sse(usage_chunk())
        yield SSE_DONE
    await hold_until_device_done(admission, generation)


async def _completion_prompts(
    service: DemoService, prompt: str | list[str] | list[int] | list[list[int]]
) -> list[list[int]]:
    if isinstance(prompt, str):
        prompts = await encode_all(service.encode, [prompt])
    elif prompt and isinstance(prompt[0], str):
        prompts = await encode_all(service.encode, prompt)  # type: ignore[arg-type]
    elif prompt and isinstance(prompt[0], int):
        prompts = [prompt]  # type: ignore[list-item]
    else:
        prompts = prompt  # type: ignore[assignment]
    if not prompts or any(not ids for ids in prompts):
        raise HTTPException(422, "Every prompt must have at least one token.")
    if len(prompts) > MAX_SEQUENCES:
        raise HTTPException(422, f"At most {MAX_SEQUENCES} prompts per request.")
    vocab = service.vocab_size
    if any(not 0 <= token < vocab for ids in prompts for token in ids):
        raise HTTPException(422, f"Token ids must be in [0, {vocab}).")
    return prompts
