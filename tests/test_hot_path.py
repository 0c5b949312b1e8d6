"""What the middleware leaves untouched on its hot path: an untagged request's reads are the
server's own calls, with nothing of gpu_asgi's in between (see docs/benchmarks.md)."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

import gpu_asgi
from gpu_asgi import DEFAULT_TENANT, GPUAdmissionMiddleware, Ledger, LinearEstimator, Reservation, gpu_bound
from gpu_asgi._asgi.cancel import WATCH_DELAY
from gpu_asgi._types import Message

from ._asgi import http_scope


class Server:
    """An ASGI server stand-in whose ``receive()`` hands out already-resolved futures it keeps."""

    def __init__(self, body: bytes) -> None:
        self.body = body
        self.issued: list[asyncio.Future[Message]] = []
        self.sent: list[Message] = []

    def receive(self) -> asyncio.Future[Message]:
        future: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        future.set_result({"type": "http.request", "body": self.body, "more_body": False})
        self.issued.append(future)
        return future

    async def send(self, message: Message) -> None:
        self.sent.append(message)


def app_with(server: Server) -> Starlette:
    async def untagged(request: Request) -> JSONResponse:
        awaitable = request.receive()  # what Starlette's own body read would await
        same = any(awaitable is issued for issued in server.issued)
        message = await awaitable
        return JSONResponse({"server_call": same, "body": len(message["body"])})

    @gpu_bound()
    async def tagged(request: Request) -> JSONResponse:
        return JSONResponse({"body": len(await request.body())})

    @gpu_bound()
    async def waits(request: Request) -> JSONResponse:
        body = await request.body()
        await asyncio.sleep(3 * WATCH_DELAY)  # the endpoint runs on, as any real generation does
        return JSONResponse({"body": len(body)})

    @gpu_bound()
    async def briefly(request: Request) -> JSONResponse:
        body = await request.body()
        await asyncio.sleep(0)  # the loop turns, but the answer comes before a watch is due
        return JSONResponse({"body": len(body)})

    app = Starlette(routes=[
        Route("/untagged", untagged, methods=["POST"]), Route("/generate", tagged, methods=["POST"]),
        Route("/waits", waits, methods=["POST"]), Route("/briefly", briefly, methods=["POST"]),
    ])
    app.add_middleware(GPUAdmissionMiddleware, ledger=Ledger(1 << 30), estimator=LinearEstimator(bytes_per_token=1))
    return app


def response_of(server: Server) -> tuple[int, Any]:
    start = next(m for m in server.sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in server.sent if m["type"] == "http.response.body")
    return start["status"], json.loads(body)


async def test_an_untagged_route_reads_through_the_servers_own_receive() -> None:
    server = Server(b"not json at all")
    await app_with(server)(http_scope("/untagged"), server.receive, server.send)
    assert response_of(server) == (200, {"server_call": True, "body": 15})


async def test_an_untagged_request_leaves_the_scope_as_it_came() -> None:
    """No key of gpu_asgi's in an untagged request's scope: on FastAPI one more key grows the
    scope dict on every request (docs/benchmarks.md, "Where an untagged POST's time goes")."""
    server = Server(b"not json at all")
    scope = http_scope("/untagged")
    await app_with(server)(scope, server.receive, server.send)
    assert response_of(server)[0] == 200
    assert not [key for key in scope if key.startswith("gpu_asgi")], sorted(scope)


async def test_a_tagged_route_still_gets_its_body_replayed_after_admission() -> None:
    body = json.dumps({"prompt": "hello there", "max_new_tokens": 4}).encode()
    server = Server(body)
    await app_with(server)(http_scope("/generate"), server.receive, server.send)
    assert response_of(server) == (200, {"body": len(body)})
    # Admission read the body once and the endpoint got the same bytes. The endpoint answered
    # without the loop turning, so no read was left pending for a disconnect.
    assert len(server.issued) == 1


@pytest.mark.parametrize(("path", "reads"), [("/waits", 2), ("/briefly", 1)])
async def test_the_disconnect_watch_reads_once_the_endpoint_has_run_for_a_moment(path: str, reads: int) -> None:
    """The watch's pending read (cancel on disconnect, gpu_asgi._asgi.cancel) starts WATCH_DELAY
    after admission, for an endpoint still running then (not for one that answered sooner, even
    if it waited), and the endpoint still gets the body replayed."""
    body = json.dumps({"prompt": "hello there", "max_new_tokens": 4}).encode()
    server = Server(body)
    await app_with(server)(http_scope(path), server.receive, server.send)
    assert response_of(server) == (200, {"body": len(body)})
    assert len(server.issued) == reads


async def test_a_tagged_read_reaches_the_ledger_through_admit_and_reserve_alone() -> None:
    """Between the endpoint's first body read and the ledger, gpu_asgi runs exactly three frames:
    the responder's read, the gate's admit and its reserve step (no delegating wrapper)."""
    package = str(Path(gpu_asgi.__file__).parent)
    chains: list[list[str]] = []

    class StackLedger(Ledger):
        async def reserve_if_free(
            self, nbytes: int, *, devices: Sequence[str] | None = None, tenant: str = DEFAULT_TENANT
        ) -> Reservation | None:
            chain, frame = [], sys._getframe(1)
            while frame is not None and frame.f_code.co_filename.startswith(package):
                chain.append(frame.f_code.co_qualname)
                frame = frame.f_back
            chains.append(chain)
            return await super().reserve_if_free(nbytes, devices=devices, tenant=tenant)

    @gpu_bound()
    async def tagged(request: Request) -> JSONResponse:
        return JSONResponse({"body": len(await request.body())})

    app = Starlette(routes=[Route("/generate", tagged, methods=["POST"])])
    app.add_middleware(GPUAdmissionMiddleware, ledger=StackLedger(1 << 30), estimator=LinearEstimator(bytes_per_token=1))
    server = Server(json.dumps({"prompt": "hello there", "max_new_tokens": 4}).encode())
    await app(http_scope("/generate"), server.receive, server.send)
    assert response_of(server)[0] == 200
    assert chains == [["Gate._reserve", "Gate.admit", "Responder._admit", "Responder._admit_and_replay"]]


async def test_the_admission_steps_benchmark_runs_on_this_code() -> None:
    """docs/benchmarks.md's step table, and the ledger's share of admit() in the app, come from
    this benchmark: its GrantingLedger must stay a ledger the middleware admits through."""
    from .benchmarks.bench_admission_steps import run

    results = await run(requests=5, rounds=1)  # raises if an admit() is not granted
    assert "the ledger's share of admit() after a bare request (Ledger - GrantingLedger)" in results
    assert all(us == us and abs(us) < 1e6 for us in results.values())  # finite, not NaN


def test_the_instruction_count_benchmark_drives_every_case(tmp_path: Path) -> None:
    """docs/benchmarks.md's instruction counts come from this benchmark's child, which valgrind
    runs: it must drive every variant of every case (``drive`` asserts each answer is a 200), and
    the totals are read from callgrind's profile format."""
    from .benchmarks import bench_overhead_instructions as bench

    for framework, route, path, method in bench.timed.CASES:
        bench.child(framework, path, method, bench.variants(route), requests=3)
    profile = tmp_path / "callgrind.out.1"
    profile.write_bytes(b"# callgrind format\nevents: Ir\nsummary: 123456\ntotals: 123456\n")
    assert bench.total(profile) == 123456
    tagged = bench.ratios({"bare": 100.0, "gpu_asgi": 400.0, "floor": 200.0}, tagged=True, name="starlette: tagged")
    assert tagged["times_floor"] == 3.0 and tagged["met"]
    counts = {"bare": 90.0, "gpu_asgi": 100.0, "pass-through": 98.0, "watching": 99.0}
    untagged = bench.ratios(counts, tagged=False, name="fastapi: untagged GET")
    assert abs(untagged["ratio"] - 0.90) < 1e-12 and not untagged["met"]  # the bar is 0.95 here
    assert bench.ratios(counts, tagged=False, name="starlette: untagged POST 1 KB")["met"]  # and 0.88 there
