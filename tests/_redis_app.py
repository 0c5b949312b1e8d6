"""The app test_redis_workers.py runs under ``uvicorn --workers 4``: one Redis budget for all.

``POST /work`` (GPU-bound, ``LinearEstimator(bytes_per_token=1000)``) adds its reservation's bytes
to a counter in Redis while it "works" for ``hold`` seconds and keeps the counter's maximum, so
the test can see the sum across every worker; it also records which process holds which
reservation. Configured by ``GPUASGI_TEST_*`` environment variables.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from redis.asyncio import BlockingConnectionPool, Redis
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route

from gpu_asgi import GPUAdmissionMiddleware, LinearEstimator, gpu_bound, gpu_reservation
from gpu_asgi._ledger.redis.ledger import RedisLedger

URL = os.environ["GPUASGI_TEST_REDIS_URL"]
NAMESPACE = os.environ["GPUASGI_TEST_NAMESPACE"]
BUDGET = int(os.environ["GPUASGI_TEST_BUDGET"])
LEASE_TTL = float(os.environ.get("GPUASGI_TEST_LEASE_TTL", "2.0"))
BYTES_PER_TOKEN = 1000

ledger = RedisLedger(URL, BUDGET, namespace=NAMESPACE, lease_ttl=LEASE_TTL, max_wait=60.0)
# Blocking: redis-py's default pool raises past 100 connections, and one worker may take most requests.
probe = Redis.from_pool(BlockingConnectionPool.from_url(URL, max_connections=64, decode_responses=True))
#: Add to the running sum and keep its maximum, atomically.
add_and_track = probe.register_script(
    """
    local now = redis.call('INCRBY', KEYS[1], ARGV[1])
    if now > tonumber(redis.call('GET', KEYS[2]) or '0') then redis.call('SET', KEYS[2], now) end
    return now
    """
)


def probe_keys(run: str) -> dict[str, str]:
    prefix = f"probe:{NAMESPACE}:{run}"
    return {"now": f"{prefix}:now", "max": f"{prefix}:max", "holders": f"{prefix}:holders", "pids": f"{prefix}:pids"}


@gpu_bound()
async def work(request: Request) -> JSONResponse:
    body = await request.json()
    reservation = await gpu_reservation(request)
    keys = probe_keys(body["run"])
    pid = os.getpid()
    await add_and_track(keys=[keys["now"], keys["max"]], args=[reservation.nbytes])
    await probe.hset(keys["holders"], reservation.id, f"{pid} {reservation.nbytes}")
    await probe.sadd(keys["pids"], pid)
    await asyncio.sleep(float(body.get("hold", 0.0)))
    await probe.hdel(keys["holders"], reservation.id)
    await probe.decrby(keys["now"], reservation.nbytes)  # while the bytes are still reserved
    return JSONResponse({"pid": pid, "bytes": reservation.nbytes})


async def pid(request: Request) -> PlainTextResponse:
    return PlainTextResponse(str(os.getpid()))


@asynccontextmanager
async def lifespan(app: Starlette) -> AsyncIterator[None]:
    yield
    await ledger.aclose()
    await probe.aclose()


app = Starlette(routes=[Route("/work", work, methods=["POST"]), Route("/pid", pid)], lifespan=lifespan)
app.add_middleware(GPUAdmissionMiddleware, ledger=ledger, estimator=LinearEstimator(bytes_per_token=BYTES_PER_TOKEN))
