"""Through a real uvicorn server on 127.0.0.1: disconnects seen by a real HTTP stack."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated

import uvicorn
from fastapi import Depends, FastAPI
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, StreamingResponse
from starlette.routing import Route

from gpu_asgi import (
    GPUAdmissionMiddleware,
    HeuristicTokenCounter,
    Ledger,
    LinearEstimator,
    Reservation,
    gpu_bound,
    gpu_reservation,
)

from ._asgi import wait_until


@asynccontextmanager
async def serve(app: Starlette) -> AsyncIterator[int]:
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    task = asyncio.ensure_future(server.serve())
    await wait_until(lambda: server.started)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield port
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)


def post(port: int, payload: dict[str, object]) -> bytes:
    body = json.dumps(payload).encode()
    head = f"POST /generate HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    return head.encode() + body


async def test_client_that_disconnects_while_queued_leaves_the_queue() -> None:
    ledger = Ledger(100)
    called: list[bool] = []

    @gpu_bound()
    async def generate(request: Request) -> PlainTextResponse:
        await request.body()  # admission happens at the first body read
        called.append(True)
        return PlainTextResponse("generated")

    app = Starlette(routes=[Route("/generate", generate, methods=["POST"])])
    app.add_middleware(GPUAdmissionMiddleware, ledger=ledger, estimator=LinearEstimator(bytes_per_token=1))
    holder = await ledger.reserve(100)
    async with serve(app) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(post(port, {"prompt": "hello", "max_new_tokens": 10}))
        await writer.drain()
        await wait_until(lambda: ledger.statistics().waiting == 1)
        writer.close()  # the client gives up while queued
        await wait_until(lambda: ledger.statistics().waiting == 0)
        holder.release()
        # A later client is served normally: the departed one took nothing with it.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(post(port, {"prompt": "hello", "max_new_tokens": 10}))
        response = await asyncio.wait_for(reader.read(4096), 5)
        writer.close()
    assert response.startswith(b"HTTP/1.1 200") and response.endswith(b"generated")
    assert called == [True]
    stats = ledger.statistics()
    assert (stats.admitted_total, stats.reserved_bytes, stats.waiting) == (2, 0, 0)


async def test_client_that_disconnects_mid_stream_frees_its_bytes() -> None:
    ledger = Ledger(1000)

    @gpu_bound()
    async def stream(request: Request) -> StreamingResponse:
        await request.body()  # admission happens at the first body read
        async def tokens() -> AsyncIterator[bytes]:
            while True:
                yield b"token "
                await asyncio.sleep(0.01)

        return StreamingResponse(tokens())

    app = Starlette(routes=[Route("/generate", stream, methods=["POST"])])
    app.add_middleware(GPUAdmissionMiddleware, ledger=ledger, estimator=LinearEstimator(bytes_per_token=1))
    async with serve(app) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(post(port, {"prompt": "hello", "max_new_tokens": 10}))
        first = await asyncio.wait_for(reader.read(1024), 5)
        assert first.startswith(b"HTTP/1.1 200")
        assert ledger.statistics().reserved_bytes > 0
        writer.close()
        await wait_until(lambda: ledger.statistics().reserved_bytes == 0)
    assert ledger.statistics().in_flight == 0


async def test_uvicorn_serves_the_middleware_as_the_outermost_asgi3_app() -> None:
    # The wrapped app (no add_middleware) served directly: uvicorn must detect ASGI 3 (it would
    # otherwise call it as ASGI 2, with the scope alone, and fail every request).
    ledger = Ledger(1000)

    @gpu_bound()
    async def generate(request: Request) -> PlainTextResponse:
        await request.body()  # admission happens at the first body read
        return PlainTextResponse(f"held {request.state.gpu_reservation.nbytes}")

    async def plain(request: Request) -> PlainTextResponse:
        return PlainTextResponse("plain")

    inner = Starlette(routes=[Route("/generate", generate, methods=["POST"]), Route("/plain", plain)])
    app = GPUAdmissionMiddleware(inner, ledger=ledger, estimator=LinearEstimator(bytes_per_token=1))
    config = uvicorn.Config(app, log_level="warning")
    config.load()
    assert config.interface == "asgi3"
    async with serve(app) as port:  # type: ignore[arg-type]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(post(port, {"prompt": "hello", "max_new_tokens": 10}))
        tagged = await asyncio.wait_for(reader.read(4096), 5)
        writer.write(f"GET /plain HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n\r\n".encode())
        untagged = await asyncio.wait_for(reader.read(4096), 5)
        writer.close()
    held = HeuristicTokenCounter().count("hello") + 10  # one byte per prompt and new token
    assert tagged.startswith(b"HTTP/1.1 200") and tagged.endswith(f"held {held}".encode())
    assert untagged.startswith(b"HTTP/1.1 200") and untagged.endswith(b"plain")
    assert ledger.statistics().admitted_total == 1


async def test_a_dependency_that_admits_serves_and_lets_a_departed_client_go_over_uvicorn() -> None:
    """``request: Request`` + ``Depends(gpu_reservation)`` and no body parameter: admitted by the
    dependency (over a real server); a client that leaves while it queues takes nothing with it."""
    ledger = Ledger(100)
    app = FastAPI()
    app.add_middleware(GPUAdmissionMiddleware, ledger=ledger, estimator=LinearEstimator(bytes_per_token=1))

    @app.post("/generate")
    @gpu_bound()
    async def generate(request: Request, reservation: Annotated[Reservation, Depends(gpu_reservation)]) -> dict[str, object]:
        return {"held": reservation.nbytes, "prompt": (await request.json())["prompt"]}

    holder = await ledger.reserve(100)
    async with serve(app) as port:  # type: ignore[arg-type]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(post(port, {"prompt": "hello", "max_new_tokens": 10}))
        await writer.drain()
        await wait_until(lambda: ledger.statistics().waiting == 1)
        writer.close()  # the client gives up while its dependency queues
        await wait_until(lambda: ledger.statistics().waiting == 0)
        holder.release()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(post(port, {"prompt": "hello", "max_new_tokens": 10}))
        response = await asyncio.wait_for(reader.read(4096), 5)
        writer.close()
    assert response.startswith(b"HTTP/1.1 200"), response
    assert json.loads(response.split(b"\r\n\r\n", 1)[1]) == {"held": 13, "prompt": "hello"}
    stats = ledger.statistics()
    assert (stats.admitted_total, stats.reserved_bytes, stats.waiting) == (2, 0, 0)
