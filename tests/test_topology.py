"""Topology matrix: in every app shape Starlette and FastAPI offer, the app's own router decides.

Each shape has a tagged route and an untagged one. The tagged one must be admitted (bytes held
while it runs, a bad body refused with gpu_asgi's problem+json); the untagged one must get its
body untouched (a non-JSON body passes) and take nothing from the ledger.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from fastapi import APIRouter, Depends, FastAPI
from starlette.applications import Starlette
from starlette.endpoints import HTTPEndpoint
from starlette.middleware import Middleware
from starlette.middleware.gzip import GZipMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Host, Mount, Route, Router

from gpu_asgi import GPUAdmissionMiddleware, Ledger, LinearEstimator, Reservation, RouteSpec, gpu_bound, gpu_reservation

from ._asgi import Words

OPTIONS: dict[str, Any] = {"estimator": LinearEstimator(bytes_per_token=1), "token_counter": Words()}
PROMPT = {"prompt": "one two three", "max_new_tokens": 5}  # 3 + 5 = 8 bytes
RAW = b"raw bytes, {not json"


@gpu_bound()
async def tagged(request: Request) -> JSONResponse:
    await request.body()  # admission happens at the first body read
    return JSONResponse({"held": request.state.gpu_reservation.nbytes})


async def untagged(request: Request) -> PlainTextResponse:
    return PlainTextResponse(await request.body())


class TaggedEndpoint(HTTPEndpoint):
    """A class endpoint: the router names the class, which dispatches on the method."""

    @gpu_bound()
    async def post(self, request: Request) -> JSONResponse:
        return await tagged(request)

    async def get(self, request: Request) -> PlainTextResponse:
        return PlainTextResponse("untagged get")


class UntaggedEndpoint(HTTPEndpoint):
    async def post(self, request: Request) -> PlainTextResponse:
        return await untagged(request)


class AsgiEndpoint:
    """An ASGI app instance as a route's endpoint, tagged on its ``__call__`` or not."""

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        reservation = scope.get("state", {}).get("gpu_reservation")
        response = PlainTextResponse(body) if reservation is None else JSONResponse({"held": reservation.nbytes})
        await response(scope, receive, send)


class TaggedAsgiEndpoint(AsgiEndpoint):
    @gpu_bound()
    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        await super().__call__(scope, receive, send)


def fastapi_routes(router: FastAPI | APIRouter, tagged_path: str, untagged_path: str) -> None:
    @router.post(tagged_path)
    @gpu_bound()
    async def tagged_fastapi(payload: dict[str, Any], reservation: Reservation = Depends(gpu_reservation)) -> dict[str, int]:
        return {"held": reservation.nbytes}

    @router.post(untagged_path)
    async def untagged_fastapi(request: Request) -> PlainTextResponse:
        return PlainTextResponse(await request.body())


@dataclass
class Shape:
    app: Any
    ledger: Ledger
    tagged: str
    untagged: str
    headers_tagged: dict[str, str] = field(default_factory=dict)
    headers_untagged: dict[str, str] = field(default_factory=dict)
    root_path: str = ""
    #: Run before the first request (to warm whatever a cache would remember).
    before: Callable[[httpx.AsyncClient], Any] | None = None


def with_middleware(app: Starlette) -> Ledger:
    ledger = Ledger(1000)
    app.add_middleware(GPUAdmissionMiddleware, ledger=ledger, **OPTIONS)
    return ledger


def routes_on_the_app() -> Shape:
    app = FastAPI()
    fastapi_routes(app, "/generate", "/echo")
    return Shape(app, with_middleware(app), "/generate", "/echo")


def nested_router_prefixes() -> Shape:
    app, outer, inner = FastAPI(), APIRouter(prefix="/v1"), APIRouter(prefix="/models")
    fastapi_routes(inner, "/generate", "/echo")
    outer.include_router(inner)
    app.include_router(outer, prefix="/api")
    return Shape(app, with_middleware(app), "/api/v1/models/generate", "/api/v1/models/echo")


def path_parameters() -> Shape:
    app = FastAPI()
    fastapi_routes(app, "/v1/{model}/generate", "/v1/{model}/info")
    return Shape(app, with_middleware(app), "/v1/qwen/generate", "/v1/qwen/info")


def mount_with_routes() -> Shape:
    app = Starlette(routes=[Mount("/api", routes=[Route("/gen", tagged, methods=["POST"]), Route("/echo", untagged, methods=["POST"])])])
    return Shape(app, with_middleware(app), "/api/gen", "/api/echo")


def fastapi_sub_app_under_a_parent_with_the_middleware() -> Shape:
    sub = FastAPI()
    fastapi_routes(sub, "/generate", "/echo")
    parent = FastAPI()
    parent.mount("/sub", sub)
    return Shape(parent, with_middleware(parent), "/sub/generate", "/sub/echo")


def wrapped_app_mounted_under_a_parent() -> Shape:
    inner = FastAPI()
    fastapi_routes(inner, "/generate", "/echo")
    ledger = Ledger(1000)
    parent = Starlette(routes=[Mount("/api", app=GPUAdmissionMiddleware(inner, ledger=ledger, **OPTIONS))])
    return Shape(parent, ledger, "/api/generate", "/api/echo")


def host_routes_same_path(first: str) -> Callable[[], Shape]:
    def build() -> Shape:
        app = Starlette(routes=[
            Host("gpu.example", app=Router([Route("/gen", tagged, methods=["POST"])])),
            Host("cpu.example", app=Router([Route("/gen", untagged, methods=["POST"])])),
        ])
        shape = Shape(app, with_middleware(app), "/gen", "/gen",
                      headers_tagged={"host": "gpu.example"}, headers_untagged={"host": "cpu.example"})

        async def warm(http: httpx.AsyncClient) -> None:  # whichever host is asked first must not decide for the other
            if first == "cpu":
                await http.post("/gen", content=RAW, headers={"host": "cpu.example"})
            else:
                await http.post("/gen", json=PROMPT, headers={"host": "gpu.example"})

        shape.before = warm
        return shape

    build.__name__ = f"host_routes_same_path_{first}_first"
    return build


def root_path() -> Shape:
    app = Starlette(routes=[Route("/gen", tagged, methods=["POST"]), Route("/echo", untagged, methods=["POST"])])
    return Shape(app, with_middleware(app), "/prefix/gen", "/prefix/echo", root_path="/prefix")


def routes_added_late() -> Shape:
    app = FastAPI()
    ledger = with_middleware(app)
    shape = Shape(app, ledger, "/late/generate", "/late/echo")

    async def add_after_a_404(http: httpx.AsyncClient) -> None:
        assert (await http.post("/late/generate", json=PROMPT)).status_code == 404
        assert (await http.post("/late/echo", content=RAW)).status_code == 404
        router = APIRouter(prefix="/late")
        fastapi_routes(router, "/generate", "/echo")
        app.include_router(router)

    shape.before = add_after_a_404
    return shape


def http_endpoint_classes() -> Shape:
    app = Starlette(routes=[Route("/gen", TaggedEndpoint), Route("/echo", UntaggedEndpoint)])
    return Shape(app, with_middleware(app), "/gen", "/echo")


def asgi_app_instances() -> Shape:
    app = Starlette(routes=[
        Route("/gen", TaggedAsgiEndpoint(), methods=["POST"]), Route("/echo", AsgiEndpoint(), methods=["POST"]),
    ])
    return Shape(app, with_middleware(app), "/gen", "/echo")


def endpoints_mounted_with_middleware() -> Shape:
    """``Mount(app=..., middleware=[...])`` names the middleware around the endpoint as the endpoint."""
    gzip = [Middleware(GZipMiddleware)]
    app = Starlette(routes=[
        Mount("/gen", app=TaggedEndpoint, middleware=gzip), Mount("/echo", app=UntaggedEndpoint, middleware=gzip),
    ])
    return Shape(app, with_middleware(app), "/gen/qwen", "/echo/qwen")


def explicit_routes_mounted_under_a_parent() -> Shape:
    """A pure ASGI host (no router of its own) served under a parent's Mount: its ``routes=``
    name paths as the host sees them, below the mount point."""
    ledger = Ledger(1000)
    host = GPUAdmissionMiddleware(AsgiEndpoint(), ledger=ledger, routes={"/gen": RouteSpec()}, **OPTIONS)
    return Shape(Starlette(routes=[Mount("/api", app=host)]), ledger, "/api/gen", "/api/echo")


def explicit_routes_behind_a_proxy_prefix() -> Shape:
    ledger = Ledger(1000)
    host = GPUAdmissionMiddleware(AsgiEndpoint(), ledger=ledger, routes={"/gen": RouteSpec()}, **OPTIONS)
    return Shape(host, ledger, "/prefix/gen", "/prefix/echo", root_path="/prefix")


SHAPES = [
    routes_on_the_app, nested_router_prefixes, path_parameters, mount_with_routes,
    fastapi_sub_app_under_a_parent_with_the_middleware, wrapped_app_mounted_under_a_parent,
    host_routes_same_path("cpu"), host_routes_same_path("gpu"), root_path, routes_added_late,
    http_endpoint_classes, asgi_app_instances, endpoints_mounted_with_middleware, explicit_routes_mounted_under_a_parent,
    explicit_routes_behind_a_proxy_prefix,
]


@pytest.mark.parametrize("build", SHAPES, ids=[shape.__name__ for shape in SHAPES])
async def test_the_router_decides_in_every_shape(build: Callable[[], Shape]) -> None:
    shape = build()
    transport = httpx.ASGITransport(app=shape.app, root_path=shape.root_path)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        if shape.before is not None:
            await shape.before(http)
        admitted_before = shape.ledger.statistics().admitted_total

        ok = await http.post(shape.tagged, json=PROMPT, headers=shape.headers_tagged)
        assert ok.status_code == 200, ok.text
        assert ok.json() == {"held": 8}, "the tagged endpoint ran with its bytes reserved"
        assert shape.ledger.statistics().admitted_total == admitted_before + 1

        refused = await http.post(shape.tagged, json={"prompt": 42}, headers=shape.headers_tagged)
        assert refused.status_code == 422, refused.text
        assert refused.headers["content-type"] == "application/problem+json"
        assert refused.json()["type"] == "urn:gpu-asgi:problem:invalid-field"

        passed = await http.post(shape.untagged, content=RAW, headers={"content-type": "text/plain", **shape.headers_untagged})
        assert passed.status_code == 200, passed.text
        assert passed.content == RAW, "the untagged endpoint got its body untouched"

    stats = shape.ledger.statistics()
    assert stats.admitted_total == admitted_before + 1, "only the tagged request took bytes"
    assert (stats.reserved_bytes, stats.in_flight, stats.waiting) == (0, 0, 0)


async def test_a_class_endpoint_admits_only_the_methods_whose_handlers_are_tagged() -> None:
    app = Starlette(routes=[Route("/gen", TaggedEndpoint)])
    ledger = with_middleware(app)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
        get = await http.get("/gen")
        no_handler = await http.put("/gen", content=RAW)  # HTTPEndpoint answers 405, unread
        posted = await http.post("/gen", json=PROMPT)
    assert (get.status_code, get.text) == (200, "untagged get")
    assert no_handler.status_code == 405
    assert posted.json() == {"held": 8}
    assert ledger.statistics().admitted_total == 1
