"""The app every real server in tests/test_servers.py serves (``tests._server_app:app``).

One ledger of 100 bytes, one byte per word and per new token. Untagged routes let the test
look inside the process: ``GET /stats`` (ledger and endpoint counters), ``POST /open/{gate}``
(lets a gated stream go on).
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from gpu_asgi import GPUAdmissionMiddleware, Ledger, LinearEstimator, gpu_bound

from ._asgi import Words

ledger = Ledger(100)
calls: Counter[str] = Counter()
gates: dict[str, asyncio.Event] = {}


def gate(name: str) -> asyncio.Event:
    return gates.setdefault(name, asyncio.Event())


@gpu_bound()
async def stream(request: Request) -> StreamingResponse:
    """``chunks`` chunks, the later ones after ``gate`` opens; ``forever`` keeps going until the client leaves."""
    body = json.loads(await request.body())
    calls["stream"] += 1

    async def tokens() -> AsyncIterator[bytes]:
        yield b"first "
        if body.get("forever"):
            while True:
                await asyncio.sleep(0.02)
                yield b"token "
        await gate(body["gate"]).wait()
        for _ in range(body.get("chunks", 2) - 1):
            yield b"token "

    return StreamingResponse(tokens(), media_type="text/plain")


@gpu_bound()
async def count(request: Request) -> PlainTextResponse:
    await request.body()
    calls["count"] += 1
    return PlainTextResponse("counted")


async def stats(request: Request) -> JSONResponse:
    snapshot = ledger.statistics()
    return JSONResponse({
        "reserved": snapshot.reserved_bytes, "waiting": snapshot.waiting, "in_flight": snapshot.in_flight,
        "admitted": snapshot.admitted_total, "calls": dict(calls),
    })


async def open_gate(request: Request) -> PlainTextResponse:
    gate(request.path_params["name"]).set()
    return PlainTextResponse("open")


app = Starlette(routes=[
    Route("/stream", stream, methods=["POST"]),
    Route("/count", count, methods=["POST"]),
    Route("/stats", stats),
    Route("/open/{name}", open_gate, methods=["POST"]),
])
app.add_middleware(GPUAdmissionMiddleware, ledger=ledger, estimator=LinearEstimator(bytes_per_token=1), token_counter=Words())
