"""Route tagging: ``@gpu_bound``, the per-route spec, and how a matched endpoint names its spec."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable, Sequence
from types import FunctionType, MethodType
from typing import Any, TypeVar

from starlette.endpoints import HTTPEndpoint

from .._admission.spec import (
    BODYLESS_METHODS,
    DEFAULT_CHAT_TEMPLATE_TOKENS,
    DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_MAX_NEW_TOKENS_CAP,
    DEFAULT_MAX_TOKENS_FIELDS,
    DEFAULT_PROMPT_FIELDS,
    PromptGetter,
    RouteSpec,
)
from .._admission.tenant_keys import TenantKey
from .._estimate.contract import Estimator
from .endpoint_call import admits_at_call, admitting

SPEC_ATTRIBUTE = "__gpu_asgi_route__"

#: Endpoints called as they are (a function, a bound method; None: no route matched): their own
#: tag is the whole answer. Tested first, as most endpoints are plain functions.
_CALLED_AS_IS = frozenset({FunctionType, MethodType, type(None)})
#: How many wrappers (partials, middleware) are followed to an endpoint: a bound on a cycle.
_MAX_WRAPPERS = 32

F = TypeVar("F", bound=Callable[..., Any])


def gpu_bound(
    *,
    prompt: Sequence[str] | str | PromptGetter = DEFAULT_PROMPT_FIELDS,
    max_tokens_fields: Sequence[str] | str = DEFAULT_MAX_TOKENS_FIELDS,
    default_max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    max_new_tokens_cap: int = DEFAULT_MAX_NEW_TOKENS_CAP,
    batch_field: str | None = "n",
    max_batch: int = 16,
    estimator: Estimator | None = None,
    priority: int = 0,
    devices: Sequence[str] | str | None = None,
    chat_template_tokens: int = DEFAULT_CHAT_TEMPLATE_TOKENS,
    openai_errors: bool | None = None,
    deadline: float | None = None,
    patient: bool = False,
    tenant_key: TenantKey | Sequence[TenantKey] | None = None,
    cancel_on_disconnect: bool | None = None,
    max_client_wait: float | None = None,
) -> Callable[[F], F]:
    """Tag an endpoint as GPU-bound.

    Put it below the route decorator (``@app.post(...)`` then ``@gpu_bound()``): FastAPI then
    admits the request when it calls the endpoint, after its dependencies (``endpoint_call``).
    A function comes back wrapped for that. What calls it without FastAPI (Starlette's router, an
    ``HTTPEndpoint``'s dispatch) calls the function as it is, and it is admitted at its body read.
    """
    spec = RouteSpec(
        prompt=prompt,  # a str is normalised to a tuple in __post_init__
        max_tokens_fields=max_tokens_fields,
        default_max_new_tokens=default_max_new_tokens,
        max_new_tokens_cap=max_new_tokens_cap,
        batch_field=batch_field,
        max_batch=max_batch,
        estimator=estimator,
        priority=priority,
        devices=devices,  # type: ignore[arg-type]  # a name or a sequence: normalised in __post_init__
        chat_template_tokens=chat_template_tokens,
        openai_errors=openai_errors,
        deadline=deadline,
        patient=patient,
        tenant_key=tenant_key,
        cancel_on_disconnect=cancel_on_disconnect,
        max_client_wait=max_client_wait,  # deprecated: RouteSpec warns and takes it as the deadline
    )

    def decorate(endpoint: F) -> F:
        # Above @staticmethod/@classmethod the tag goes on the function: the descriptor's own
        # attributes are not what the class hands out.
        if isinstance(endpoint, staticmethod | classmethod):
            setattr(endpoint.__func__, SPEC_ATTRIBUTE, spec)
            return endpoint
        setattr(endpoint, SPEC_ATTRIBUTE, spec)
        return admitting(endpoint)  # type: ignore[return-value]  # the wrapper keeps the tag (functools.wraps)

    return decorate


def route_spec_of(endpoint: Any, method: str | None = None, _depth: int = 0) -> RouteSpec | None:
    """The spec of what serves a request routed to ``endpoint`` with ``method``.

    The endpoint's own tag (also through ``functools.partial``; a bound method reads its function's
    attributes itself); else, following how the endpoint dispatches: for an ``HTTPEndpoint`` class,
    the handler of ``method`` (none: it answers 405 unread); for an ASGI app instance, its
    ``__call__``; for a middleware around the endpoint, the app it wraps (``.app``).
    ``method=None`` asks only for tags that do not depend on the method.
    """
    spec = getattr(endpoint, SPEC_ATTRIBUTE, None)
    if spec is not None or type(endpoint) in _CALLED_AS_IS or _depth == _MAX_WRAPPERS:
        return spec
    if isinstance(endpoint, functools.partial):
        return route_spec_of(endpoint.func, method, _depth + 1)
    if isinstance(endpoint, type):
        if method is None or not issubclass(endpoint, HTTPEndpoint):
            return None
        handler = getattr(endpoint, _handler_name(endpoint, method), None)
        return getattr(handler, SPEC_ATTRIBUTE, None)
    spec = getattr(type(endpoint).__call__, SPEC_ATTRIBUTE, None)
    if spec is not None:
        return spec  # type: ignore[no-any-return]
    # A middleware around the endpoint: what a Mount(app=..., middleware=[...]) names as its
    # endpoint. Such middleware keeps the app it wraps as `.app` (Starlette's all do).
    return route_spec_of(getattr(endpoint, "app", None), method, _depth + 1)


def _handler_name(endpoint: type[HTTPEndpoint], method: str) -> str:
    """The method ``HTTPEndpoint.dispatch`` calls: ``get`` serves ``HEAD`` unless there is a ``head``."""
    return "get" if method == "HEAD" and not hasattr(endpoint, "head") else method.lower()


def bodyless_tagged_routes(app: Any) -> list[str]:
    """``"GET/POST /path"`` for each tagged route of ``app`` that accepts a body-less method.

    A declaration check run once at startup, not routing: it walks the routes as declared
    (mounts, hosts and FastAPI's included routers), so a mistake shows before any request.
    ``app`` may be wrapped (middleware, a bare ``Router``): the ``.app`` chain is followed to the
    first object that declares routes.
    """
    found: list[str] = []

    def visit(route: Any, path: str, endpoint: Any) -> None:
        methods = getattr(route, "methods", None) or None  # None (or empty): the route takes every method
        bodyless = sorted(BODYLESS_METHODS if methods is None else methods & BODYLESS_METHODS)
        tagged = [method for method in bodyless if route_spec_of(endpoint, method) is not None]
        if tagged:
            found.append(f"{'/'.join(sorted(methods) if methods else tagged)} {path}")

    _walk(declared_routes(app) or (), "", visit)
    return found


def early_admitted_routes(app: Any) -> list[str]:
    """``/path`` for each tagged FastAPI route that FastAPI cannot admit at its call, because
    ``@gpu_bound`` sits above the route decorator (which registered the bare function): such a
    route is admitted at its body read, before its dependencies run."""
    found: list[str] = []

    def visit(route: Any, path: str, endpoint: Any) -> None:
        if (getattr(route, "dependant", None) is not None and inspect.isfunction(endpoint)
                and getattr(endpoint, SPEC_ATTRIBUTE, None) is not None and not admits_at_call(endpoint)):
            found.append(path)

    _walk(declared_routes(app) or (), "", visit)
    return found


def declared_routes(app: Any) -> Iterable[Any] | None:
    """The routes ``app`` declares, through wrapping middleware; None for an app without a router."""
    for _ in range(_MAX_WRAPPERS):  # the same bound as route_spec_of's on following `.app`
        if app is None:
            return None
        routes = getattr(getattr(app, "router", None), "routes", None)
        if routes is None:
            routes = getattr(app, "routes", None)
        if routes is not None:
            return routes  # type: ignore[no-any-return]
        app = getattr(app, "app", None)  # a middleware's wrapped app
    return None


def _walk(routes: Iterable[Any], prefix: str, visit: Callable[[Any, str, Any], None]) -> None:
    """``visit(route, full path, endpoint)`` for each route, through mounts, hosts and included routers."""
    for route in routes:
        included = getattr(route, "original_router", None)  # FastAPI's include_router(...)
        if included is not None:
            context = getattr(route, "include_context", None)
            _walk(included.routes, prefix + getattr(context, "prefix", ""), visit)
            continue
        path = prefix + getattr(route, "path", "")
        children = getattr(route, "routes", None)  # Mount, Host, a mounted app
        if children is not None:
            _walk(children, path, visit)
        # A Route's endpoint, or what a Mount/Host writes as the endpoint (the app it holds).
        visit(route, path, getattr(route, "endpoint", None) if children is None else getattr(route, "app", None))
