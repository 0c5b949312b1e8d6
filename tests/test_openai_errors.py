"""OpenAI-shaped refusals: the official ``openai`` client shows gpu_asgi's reason in its exception.

A small FastAPI app behind a real uvicorn on 127.0.0.1 (any free port); the client is the real one.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse

from gpu_asgi import GPUAdmissionMiddleware, Ledger, LinearEstimator, gpu_bound

from ._asgi import Words, client, wait_until

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")


def make_app(*, middleware_option: bool | None, route_option: bool | None, ledger: Ledger | None = None) -> FastAPI:
    app = FastAPI()

    async def answer(request: Request) -> JSONResponse:
        await request.body()  # admission happens at the body read
        return JSONResponse({"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "m", "choices": []})

    @app.post("/v1/completions")
    @gpu_bound(max_new_tokens_cap=100, default_max_new_tokens=16, max_tokens_fields=("max_tokens",), openai_errors=route_option)
    async def completions(request: Request) -> JSONResponse:
        return await answer(request)

    @app.post("/v1/generate")
    @gpu_bound(max_new_tokens_cap=100, default_max_new_tokens=16)
    async def generate(request: Request) -> JSONResponse:
        return await answer(request)

    options: dict[str, Any] = {} if middleware_option is None else {"openai_errors": middleware_option}
    app.add_middleware(
        GPUAdmissionMiddleware,
        ledger=ledger if ledger is not None else Ledger({"cpu": 10_000}),
        estimator=LinearEstimator(bytes_per_token=1),
        token_counter=Words(),
        reject_status=429,
        **options,
    )
    return app


@asynccontextmanager
async def served(app: FastAPI) -> AsyncIterator[Any]:
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
    task = asyncio.ensure_future(server.serve())
    await wait_until(lambda: server.started or task.done(), timeout=30)
    if task.done():
        task.result()
    port = server.servers[0].sockets[0].getsockname()[1]
    api = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=30)
    try:
        yield api
    finally:
        await api.close()
        server.should_exit = True
        await asyncio.wait_for(task, 30)


async def test_the_openai_client_names_the_reason_of_a_route_tagged_for_openai() -> None:
    ledger = Ledger({"cpu": 1_000}, max_queue=0)  # overload is answered at once: nothing may queue
    async with served(make_app(middleware_option=None, route_option=True, ledger=ledger)) as api:
        with pytest.raises(openai.UnprocessableEntityError) as too_many:
            await api.completions.create(model="m", prompt="a b c", max_tokens=500)
        with pytest.raises(openai.APIStatusError) as never_fits:
            await api.completions.create(model="m", prompt="w " * 2_000, max_tokens=50)
        held = await ledger.reserve(1_000)
        with pytest.raises(openai.RateLimitError) as overloaded:
            await api.completions.create(model="m", prompt="a", max_tokens=5)
        held.release()
        fine = await api.completions.create(model="m", prompt="a", max_tokens=5)
    assert fine.id == "cmpl-1"
    error = too_many.value
    # the SDK's message is the problem's title and detail
    assert str(error).startswith("Error code: 422 - Request body has an invalid field: ")
    assert "max_tokens" in str(error) and "100" in str(error)
    assert (error.code, error.param, error.type) == ("invalid-field", "max_tokens", "invalid_request_error")
    assert error.body["code"] == "invalid-field"  # type: ignore[index]
    assert error.response.headers["content-type"] == "application/problem+json"
    assert error.response.json()["type"] == "urn:gpu-asgi:problem:invalid-field"  # still a problem
    assert never_fits.value.status_code == 413 and never_fits.value.code == "exceeds-budget"
    assert "budget" in str(never_fits.value)
    assert overloaded.value.code == "queue-full" and overloaded.value.type == "rate_limit_exceeded"
    assert "The GPU admission queue is full" in str(overloaded.value) and overloaded.value.response.headers["retry-after"].isdigit()


async def test_middleware_option_and_route_override() -> None:
    app = make_app(middleware_option=True, route_option=False)
    async with client(app) as http:
        route_off = await http.post("/v1/completions", json={"prompt": "a", "max_tokens": 500})
        middleware_on = await http.post("/v1/generate", json={"prompt": "a", "max_new_tokens": 500})
    assert "error" not in route_off.json() and route_off.json()["field"] == "max_tokens"
    assert middleware_on.json()["error"] == {
        "message": f"Request body has an invalid field: {middleware_on.json()['detail']}",
        "type": "invalid_request_error",
        "param": "max_new_tokens",
        "code": "invalid-field",
    }


async def test_problem_json_alone_is_the_default() -> None:
    async with client(make_app(middleware_option=None, route_option=None)) as http:
        answer = await http.post("/v1/completions", json={"prompt": "a", "max_tokens": 500})
    assert answer.status_code == 422 and "error" not in answer.json()
