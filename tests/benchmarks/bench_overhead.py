"""In-process middleware overhead: the same trivial endpoints with and without gpu_asgi.

    python -m tests.benchmarks.bench_overhead [--requests 20000] [--rounds 7]

Requests go straight into the ASGI app (no network, no HTTP client), so the difference is the
middleware's own cost. Bare and wrapped apps run in alternating rounds of one process, timed in
CPU time of the process (see ``drive``).

Targets: an untagged route keeps >= 0.88 of the bare app's throughput on Starlette's trivial POST
and >= 0.95 on the other rows (median over rounds of wrapped / bare); a tagged request's own cost (µs per request over the bare app) is at most 3x
that of ``FloorAdmission``, measured in the same rounds. ``FloorAdmission`` is the least any
admission middleware must do before a tagged endpoint runs (parse the JSON, count, reserve,
replay the body, release), with none of the checks a real one needs. It is not a product.
Tagged routes also run behind a peer, ``fastapi_balancer`` 0.2.1's ``BalancerMiddleware`` (an
admission queue in front of FastAPI endpoints, on its in-memory storage, with a capacity no
request reaches so it counts and never waits): gpu_asgi's own cost is at most 1/5 of the peer's
(``peer_ratio``), measured in the same rounds. Untagged routes are also run beside two references that show what any pure ASGI middleware
costs: ``PassThrough`` (one ``async`` call, nothing else) and ``Watching`` (wraps ``receive`` and
``send`` of requests with a body, as a middleware that must see the body read has to).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import Awaitable
from typing import Any

import orjson
from fastapi import FastAPI
from pydantic import BaseModel
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from gpu_asgi import GPUAdmissionMiddleware, Ledger, LinearEstimator, gpu_bound
from gpu_asgi._types import Message, Receive, Scope, Send

from ._report import table, write_report

BODY = json.dumps({"prompt": "word " * 196, "max_new_tokens": 64}).encode()
assert 1000 <= len(BODY) <= 1100, len(BODY)


async def plain(request: Request) -> PlainTextResponse:
    return PlainTextResponse("ok")


async def upload(request: Request) -> PlainTextResponse:
    body = await request.body()  # an untagged route with a body: the responder looks, then steps aside
    return PlainTextResponse(str(len(body)))


@gpu_bound()
async def generate(request: Request) -> PlainTextResponse:
    body = await request.body()  # the trivial endpoint reads its body, with or without the middleware
    return PlainTextResponse(str(len(body)))


class GenerateIn(BaseModel):
    prompt: str
    max_new_tokens: int = 16


def build_fastapi() -> FastAPI:
    app = FastAPI()

    @app.get("/plain")
    async def plain_fastapi() -> dict[str, str]:
        return {"ok": "yes"}

    @app.post("/generate")
    @gpu_bound()
    async def generate_fastapi(body: GenerateIn) -> dict[str, int]:
        return {"chars": len(body.prompt)}

    @app.post("/upload")
    async def upload_fastapi(body: GenerateIn) -> dict[str, int]:
        return {"chars": len(body.prompt)}

    return app


class FloorAdmission:
    """Reference only: parse, count, reserve, replay, release. No validation, no limits, no
    timeout, no disconnect handling, no telemetry, and the release waits for the endpoint."""

    def __init__(self, app: Any, ledger: Ledger) -> None:
        self.app, self.ledger = app, ledger

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != "/generate":
            await self.app(scope, receive, send)
            return
        message = await receive()  # the benchmark sends the body in one message
        data = orjson.loads(message["body"])
        tokens = len(data["prompt"]) // 3 + data.get("max_new_tokens", 256)
        reservation = self.ledger.try_reserve(tokens)
        assert reservation is not None

        async def replay() -> Message:
            return message

        try:
            await self.app(scope, replay, send)
        finally:
            reservation.release()


class PassThrough:
    """Reference only: the least a pure ASGI middleware costs, one ``async`` call."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app(scope, receive, send)


class Watching:
    """Reference only: wraps ``receive`` and ``send`` of requests with a body in closures that
    add nothing, the least a middleware that must see the body read (as admission does) pays."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] == "GET":
            await self.app(scope, receive, send)
            return

        def watched_receive() -> Awaitable[Message]:
            return receive()

        def watched_send(message: Message) -> Awaitable[None]:
            return send(message)

        await self.app(scope, watched_receive, watched_send)


def add_peer(app: Starlette) -> None:
    """fastapi_balancer's middleware watching the tagged path, as its ``Balancer.wrap`` installs
    it, without the prober and dashboard that a benchmark without backends does not use."""
    from fastapi_balancer.limiter import Limiter
    from fastapi_balancer.middleware import BalancerMiddleware
    from fastapi_balancer.models import RoutingStrategy
    from fastapi_balancer.router import get_router
    from fastapi_balancer.storage.memory import MemoryStorage

    storage = MemoryStorage()
    storage._capacity["/generate"] = 1 << 30  # a limit, counted, that no request of the run reaches
    app.add_middleware(
        BalancerMiddleware, watched_endpoints=["/generate"], backends=[],
        router=get_router(RoutingStrategy.ROUND_ROBIN, storage), limiter=Limiter(storage), storage=storage,
        queue_timeout=30.0,
    )


def build(with_middleware: bool | str, framework: str = "starlette") -> Starlette:
    if framework == "fastapi":
        app = build_fastapi()
    else:
        app = Starlette(routes=[
            Route("/plain", plain), Route("/generate", generate, methods=["POST"]), Route("/upload", upload, methods=["POST"]),
        ])
    if with_middleware == "floor":
        app.add_middleware(FloorAdmission, ledger=Ledger(1 << 40))
    elif with_middleware == "peer":
        add_peer(app)
    elif with_middleware == "pass-through":
        app.add_middleware(PassThrough)
    elif with_middleware == "watching":
        app.add_middleware(Watching)
    elif with_middleware:
        app.add_middleware(GPUAdmissionMiddleware, ledger=Ledger(1 << 40), estimator=LinearEstimator(bytes_per_token=1))
    return app


def scope_for(path: str, method: str, app: Starlette) -> dict[str, Any]:
    headers = [(b"host", b"bench"), (b"content-type", b"application/json"), (b"content-length", str(len(BODY)).encode())]
    return {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
        "method": method, "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "",
        "query_string": b"", "headers": headers if method == "POST" else headers[:1],
        "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
    }


#: Requests between two turns of the event loop (a sleep(0)); every variant gets the same.
LOOP_TURN_EVERY = 100


async def drive(app: Starlette, path: str, method: str, requests: int) -> float:
    """Requests per CPU second of this process for ``requests`` sequential calls.

    CPU time, not wall time: the requests run in this one thread without I/O, so on an idle
    machine the two are the same, and on a shared one the time other processes take the cores
    does not count (cache contention still does).
    """
    template = scope_for(path, method, app)
    body_message = {"type": "http.request", "body": BODY if method == "POST" else b"", "more_body": False}
    statuses: list[int] = []

    async def receive() -> dict[str, Any]:
        return body_message

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            statuses.append(message["status"])

    start = time.process_time()
    for index in range(requests):
        await app(dict(template), receive, send)
        if index % LOOP_TURN_EVERY == 0:
            # A server's loop turns between requests; without that, the cancelled timers of
            # per-request deadlines pile up in the loop's heap, which no server would see.
            await asyncio.sleep(0)
    elapsed = time.process_time() - start
    assert set(statuses) == {200}, set(statuses)
    return requests / elapsed


UNTAGGED_TARGET = 0.95  # wrapped / bare throughput
#: Starlette's trivial POST: a middleware that only wraps ``receive``/``send`` already costs 5% there.
UNTAGGED_TARGETS = {"starlette: untagged POST 1 KB": 0.88}


def untagged_target(name: str) -> float:
    return UNTAGGED_TARGETS.get(name, UNTAGGED_TARGET)

TAGGED_TARGET = 3.0  # own cost / FloorAdmission's own cost
PEER_TARGET = 0.2  # own cost / fastapi_balancer's own cost

CASES = [
    ("starlette", "untagged GET", "/plain", "GET"),
    ("starlette", "untagged POST 1 KB", "/upload", "POST"),
    ("starlette", "tagged POST 1 KB JSON", "/generate", "POST"),
    ("fastapi", "untagged GET", "/plain", "GET"),
    ("fastapi", "untagged POST 1 KB JSON", "/upload", "POST"),
    ("fastapi", "tagged POST 1 KB JSON", "/generate", "POST"),
]


async def run(requests: int, rounds: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for framework, route, path, method in CASES:
        tagged = route.startswith("tagged")
        apps = {"bare": build(False, framework), "gpu_asgi": build(True, framework)}
        if tagged:
            apps["floor"] = build("floor", framework)
            apps["peer"] = build("peer", framework)
        else:
            apps["pass-through"] = build("pass-through", framework)
            apps["watching"] = build("watching", framework)
        for app in apps.values():  # warm up
            await drive(app, path, method, requests // 10)
        rps: dict[str, list[float]] = {name: [] for name in apps}
        ratios: dict[str, list[float]] = {name: [] for name in apps if name != "bare"}
        for _ in range(rounds):
            for name, app in apps.items():
                rps[name].append(await drive(app, path, method, requests))
            for name in ratios:
                ratios[name].append(rps[name][-1] / rps["bare"][-1])
        median = {name: statistics.median(values) for name, values in rps.items()}
        result: dict[str, Any] = {
            "bare_rps": median["bare"], "middleware_rps": median["gpu_asgi"],
            "ratio": statistics.median(ratios["gpu_asgi"]), "ratios": ratios["gpu_asgi"],
        }
        if tagged:
            own = 1e6 / median["gpu_asgi"] - 1e6 / median["bare"]
            floor_own = 1e6 / median["floor"] - 1e6 / median["bare"]
            peer_own = 1e6 / median["peer"] - 1e6 / median["bare"]
            result.update(floor_rps=median["floor"], own_us=own, floor_own_us=floor_own, times_floor=own / floor_own,
                          peer_rps=median["peer"], peer_own_us=peer_own, peer_ratio=own / peer_own)
            # a negative floor is noise
            result["met"] = 0 < floor_own and own / floor_own <= TAGGED_TARGET and own / peer_own <= PEER_TARGET
        else:
            result.update(
                pass_through_ratio=statistics.median(ratios["pass-through"]),
                watching_ratio=statistics.median(ratios["watching"]),
            )
            result["met"] = result["ratio"] >= untagged_target(f"{framework}: {route}")
        results[f"{framework}: {route}"] = result
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    results = asyncio.run(run(args.requests, args.rounds))
    rows = [
        [name, r["bare_rps"], r["middleware_rps"], r["ratio"], r.get("pass_through_ratio", "-"),
         r.get("watching_ratio", "-"), r.get("floor_rps", "-"), r.get("own_us", "-"),
         r.get("floor_own_us", "-"), r.get("times_floor", "-"), r.get("peer_own_us", "-"), r.get("peer_ratio", "-"),
         f"ratio >= {untagged_target(name)}" if "times_floor" not in r
         else f"own <= {TAGGED_TARGET}x floor, <= {PEER_TARGET}x peer",
         "yes" if r["met"] else "NO"]
        for name, r in results.items()
    ]
    headers = ["route", "bare req/s", "with gpu_asgi req/s", "ratio", "pass-through ratio", "watching ratio", "floor req/s", "own µs", "floor own µs", "× floor", "peer own µs", "× peer", "target", "met"]
    print(table(rows, headers))
    print("report:", write_report("overhead", {"requests": args.requests, "rounds": args.rounds, "results": results}))


if __name__ == "__main__":
    main()
