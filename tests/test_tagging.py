"""Route tagging and resolution: specs, decorator order, cache bounds."""

from __future__ import annotations

import functools

import pytest
from fastapi import APIRouter, FastAPI
from starlette.applications import Starlette
from starlette.routing import Mount, Route

from gpu_asgi import RouteSpec, gpu_bound
from gpu_asgi._tagging import MAX_METHODS_PER_PATH, RouteResolver, route_spec_of

from ._asgi import http_scope


def test_decorator_returns_the_same_function_with_its_spec() -> None:
    async def endpoint() -> None: ...

    tagged = gpu_bound(prompt="text", max_new_tokens_cap=64, default_max_new_tokens=8, devices="cuda:1")(endpoint)
    assert tagged is endpoint
    spec = route_spec_of(endpoint)
    assert spec is not None
    assert spec.prompt == ("text",) and spec.devices == ("cuda:1",) and spec.max_new_tokens_cap == 64
    assert route_spec_of(functools.partial(endpoint)) is spec


def test_invalid_specs_are_refused() -> None:
    with pytest.raises(ValueError):
        RouteSpec(default_max_new_tokens=100, max_new_tokens_cap=10)
    with pytest.raises(ValueError):
        RouteSpec(max_batch=0)


def test_fastapi_routes_resolve_whatever_the_decorator_order() -> None:
    app = FastAPI()
    router = APIRouter(prefix="/v1")

    @router.post("/inner")
    @gpu_bound(priority=3)
    async def inner() -> None: ...

    @gpu_bound(priority=4)
    @app.post("/outer/{item}")
    async def outer(item: str) -> None: ...

    @app.get("/plain")
    async def plain() -> None: ...

    app.include_router(router)
    resolver = RouteResolver()
    assert resolver.resolve(http_scope("/v1/inner", app=app)).priority == 3  # type: ignore[union-attr]
    assert resolver.resolve(http_scope("/outer/x", app=app)).priority == 4  # type: ignore[union-attr]
    assert resolver.resolve(http_scope("/plain", method="GET", app=app)) is None
    assert resolver.resolve(http_scope("/missing", app=app)) is None


def test_fastapi_app_mounted_in_another_app_resolves_its_included_routers() -> None:
    sub = FastAPI()
    router = APIRouter()

    @router.post("/gen")
    @gpu_bound(priority=7)
    async def gen() -> None: ...

    sub.include_router(router, prefix="/models")
    app = Starlette(routes=[Mount("/api", app=sub)])
    resolver = RouteResolver()
    assert resolver.resolve(http_scope("/api/models/gen", app=app)).priority == 7  # type: ignore[union-attr]
    assert resolver.resolve(http_scope("/api/models/other", app=app)) is None


def test_resolution_is_cached_and_the_cache_is_bounded() -> None:
    calls = []

    @gpu_bound()
    async def endpoint() -> None: ...

    class CountingRoute(Route):
        def matches(self, scope):  # type: ignore[no-untyped-def]
            calls.append(scope["path"])
            return super().matches(scope)

    app = Starlette(routes=[CountingRoute("/items/{n}", endpoint, methods=["POST"])])
    resolver = RouteResolver(cache_size=3)
    for _ in range(5):
        assert resolver.resolve(http_scope("/items/1", app=app)) is not None
    assert calls == ["/items/1"]
    for n in range(10):
        resolver.resolve(http_scope(f"/items/{n}", app=app))
    assert len(resolver.cache) == 3
    # Method names come from clients too: past a few per path they are answered, not cached.
    for n in range(100):
        assert resolver.resolve(http_scope("/items/1", method=f"M{n}", app=app)) is None
    assert resolver.resolve(http_scope("/items/1", app=app)) is not None
    assert len(resolver.cache["/items/1"]) == MAX_METHODS_PER_PATH
