"""The app tests/test_sigterm.py serves in a real server process (``tests._sigterm_app:app``).

``SIGTERM_LEDGER``: ``memory`` or a Redis URL (namespace ``SIGTERM_NAMESPACE``); 40 bytes, so four
requests of 10 bytes run and the rest queue. ``/generate`` holds its bytes ``hold`` seconds.
``SIGTERM_DELAY``: seconds between the drain and the server's own signal handler.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route

from gpu_asgi import GPUAdmissionMiddleware, Lifecycle, LinearEstimator, gpu_bound, health_router, ledger_from_url
from gpu_asgi._ledger.redis.ledger import RedisLedger

from ._asgi import Words

url = os.environ.get("SIGTERM_LEDGER", "memory")
ledger = ledger_from_url(
    None if url == "memory" else url, 40,
    **({} if url == "memory" else {"namespace": os.environ["SIGTERM_NAMESPACE"], "lease_ttl": 60.0}),
)
lifecycle = Lifecycle(ready=True)


@gpu_bound()
async def generate(request: Request) -> PlainTextResponse:
    body = json.loads(await request.body())
    await asyncio.sleep(body.get("hold", 0))
    return PlainTextResponse("generated")


async def stats(request: Request) -> JSONResponse:
    return JSONResponse({"in_flight": lifecycle.in_flight, "waiting": lifecycle.waiting, "pid": os.getpid()})


@asynccontextmanager
async def lifespan(app: Starlette) -> AsyncIterator[None]:
    async with lifecycle.serving(drain_timeout=20, signal_delay=float(os.environ.get("SIGTERM_DELAY", "0"))):
        yield
    if isinstance(ledger, RedisLedger):  # anything still held goes back now; pending releases land
        ledger.give_back_all()
        await ledger.aclose()


app = Starlette(
    routes=[Route("/generate", generate, methods=["POST"]), Route("/stats", stats)],
    lifespan=lifespan,
)
app.router.routes.extend(health_router(ledger, lifecycle=lifecycle).routes)
app.add_middleware(
    GPUAdmissionMiddleware, ledger=ledger, estimator=LinearEstimator(bytes_per_token=1), token_counter=Words(),
    lifecycle=lifecycle,
)
