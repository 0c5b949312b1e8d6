"""Route tagging: specs, decorator order, and the startup check of declared routes."""

from __future__ import annotations

import functools

import pytest
from fastapi import APIRouter, FastAPI
from starlette.applications import Starlette
from starlette.endpoints import HTTPEndpoint
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.middleware.gzip import GZipMiddleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Host, Mount, Route, Router

from gpu_asgi import RouteSpec, gpu_bound
from gpu_asgi._asgi.routes import bodyless_tagged_routes, route_spec_of


async def test_decorator_wraps_the_function_with_its_spec_and_calls_it_as_it_is() -> None:
    async def endpoint(x: int) -> int:
        return x + 1

    tagged = gpu_bound(prompt="text", max_new_tokens_cap=64, default_max_new_tokens=8, devices="cuda:1")(endpoint)
    assert tagged.__wrapped__ is endpoint  # type: ignore[attr-defined]
    assert await tagged(1) == 2  # called without FastAPI's request (a Starlette route): as it is
    spec = route_spec_of(endpoint)
    assert spec is not None and route_spec_of(tagged) is spec
    assert spec.prompt == ("text",) and spec.devices == ("cuda:1",) and spec.max_new_tokens_cap == 64
    assert route_spec_of(functools.partial(endpoint)) is spec


def test_methods_and_partials_of_them_carry_their_functions_spec() -> None:
    class Endpoints:
        @gpu_bound(priority=1)
        async def method(self) -> None: ...

        @classmethod
        @gpu_bound(priority=2)
        async def class_method(cls) -> None: ...

    endpoints = Endpoints()
    assert route_spec_of(endpoints.method).priority == 1  # type: ignore[union-attr]
    assert route_spec_of(functools.partial(endpoints.method)).priority == 1  # type: ignore[union-attr]
    assert route_spec_of(Endpoints.class_method).priority == 2  # type: ignore[union-attr]
    assert route_spec_of(endpoints.__init__) is None


def test_invalid_specs_are_refused() -> None:
    with pytest.raises(ValueError):
        RouteSpec(default_max_new_tokens=100, max_new_tokens_cap=10)
    with pytest.raises(ValueError):
        RouteSpec(max_batch=0)
    with pytest.raises(ValueError, match="request body"):
        RouteSpec(methods=frozenset({"GET", "POST"}))
    assert RouteSpec(methods=frozenset({"put"})).methods == {"PUT"}


def test_bodyless_tagged_routes_are_found_wherever_they_are_declared() -> None:
    app = FastAPI()
    router = APIRouter(prefix="/v1")

    @router.get("/inner")
    @gpu_bound()
    async def inner() -> None: ...

    @gpu_bound()
    @app.post("/outer/{item}")
    async def outer(item: str) -> None: ...

    @app.get("/plain")
    async def plain() -> None: ...

    app.include_router(router, prefix="/api")

    @gpu_bound()
    async def mounted_get(request: object) -> None: ...

    sub = Starlette(routes=[
        Route("/gen", mounted_get, methods=["GET"]),
        Route("/post", mounted_get, methods=["POST"]),
        Route("/both", mounted_get, methods=["GET", "POST"]),
    ])
    parent = Starlette(routes=[Mount("/fa", app=app), Mount("/st", app=sub)])
    assert bodyless_tagged_routes(parent) == ["GET /fa/api/v1/inner", "GET/HEAD /st/gen", "GET/HEAD/POST /st/both"]
    assert bodyless_tagged_routes(object()) == []  # a pure ASGI app: nothing declared to check


class Generate(HTTPEndpoint):
    @gpu_bound(priority=3)
    async def post(self, request: Request) -> PlainTextResponse: ...

    async def get(self, request: Request) -> PlainTextResponse: ...


class TaggedGet(HTTPEndpoint):
    @gpu_bound()
    async def get(self, request: Request) -> PlainTextResponse: ...


class AsgiApp:
    @gpu_bound(priority=4)
    async def __call__(self, scope: object, receive: object, send: object) -> None: ...


def test_a_spec_follows_how_the_endpoint_dispatches() -> None:
    assert route_spec_of(Generate, "POST").priority == 3  # type: ignore[union-attr]
    assert route_spec_of(Generate, "GET") is None
    assert route_spec_of(Generate, "PUT") is None  # no handler: HTTPEndpoint answers 405
    assert route_spec_of(Generate) is None  # which handler runs depends on the method
    assert route_spec_of(TaggedGet, "HEAD") is not None  # get serves HEAD when there is no head
    assert route_spec_of(AsgiApp(), "POST").priority == 4  # type: ignore[union-attr]
    assert route_spec_of(functools.partial(AsgiApp()), "POST").priority == 4  # type: ignore[union-attr]
    assert route_spec_of(Starlette(), "POST") is None
    assert route_spec_of(GZipMiddleware(Generate), "POST").priority == 3  # type: ignore[union-attr]  # through .app
    assert route_spec_of(GZipMiddleware(GZipMiddleware(AsgiApp())), "GET").priority == 4  # type: ignore[union-attr]


@gpu_bound()
async def tagged_both(request: Request) -> PlainTextResponse: ...


def test_the_startup_check_finds_tagged_bodyless_methods_behind_wrappers_and_dispatch() -> None:
    declared = [Route("/gen", tagged_both, methods=["GET", "POST"])]
    assert bodyless_tagged_routes(Router(declared)) == ["GET/HEAD/POST /gen"]  # a bare Router
    wrapped = CORSMiddleware(Starlette(routes=declared), allow_origins=["*"])  # middleware around the app
    assert bodyless_tagged_routes(wrapped) == ["GET/HEAD/POST /gen"]
    app = Starlette(routes=[
        Route("/generate", Generate),  # tagged post, untagged get: fine
        Route("/tagged-get", TaggedGet),  # no methods declared: every method reaches its get
        Route("/asgi", AsgiApp()),  # an ASGI app with no methods declared takes GET too
        Route("/asgi-post", AsgiApp(), methods=["POST"]),  # fine
        Mount("/mounted", app=AsgiApp()),  # a Mount takes every method
        Host("gpu.example", app=Router([Route("/h", tagged_both, methods=["GET"])])),
        Route("/empty", AsgiApp(), methods=[]),  # Starlette reads no methods as every method
        Mount("/wrapped", app=AsgiApp(), middleware=[Middleware(GZipMiddleware)]),  # the Mount names the middleware
        Mount("/wrapped-get", app=TaggedGet, middleware=[Middleware(GZipMiddleware)]),
        Mount("/wrapped-post", app=Generate, middleware=[Middleware(GZipMiddleware)]),  # fine
    ])
    assert bodyless_tagged_routes(app) == [
        "GET/HEAD /tagged-get", "GET/HEAD/OPTIONS/TRACE /asgi", "GET/HEAD/OPTIONS/TRACE /mounted", "GET/HEAD /h",
        "GET/HEAD/OPTIONS/TRACE /empty", "GET/HEAD/OPTIONS/TRACE /wrapped", "GET/HEAD /wrapped-get",
    ]


def test_the_tag_may_go_above_staticmethod_and_classmethod() -> None:
    class Endpoints:
        @gpu_bound(priority=5)
        @staticmethod
        async def static(request: Request) -> None: ...

        @gpu_bound(priority=6)
        @classmethod
        async def of_class(cls, request: Request) -> None: ...

    assert route_spec_of(Endpoints.static).priority == 5  # type: ignore[union-attr]
    assert route_spec_of(Endpoints.of_class).priority == 6  # type: ignore[union-attr]
