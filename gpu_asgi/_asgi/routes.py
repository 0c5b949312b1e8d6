"""Route tagging: ``@gpu_bound``, the per-route spec, and how a matched endpoint names its spec."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from types import FunctionType, MethodType
from typing import Any, TypeVar

from starlette.endpoints import HTTPEndpoint

from .._admission.tenant_keys import TenantKey, tenant_keys
from .._estimate.linear import Estimator, as_estimator
from .._ledger.contract import check_priority

SPEC_ATTRIBUTE = "__gpu_asgi_route__"
DEFAULT_PROMPT_FIELDS = ("prompt", "messages")
#: OpenAI reads ``max_completion_tokens`` before the deprecated ``max_tokens``.
DEFAULT_MAX_TOKENS_FIELDS = ("max_new_tokens", "max_completion_tokens", "max_tokens")
DEFAULT_MAX_NEW_TOKENS = 256
DEFAULT_MAX_NEW_TOKENS_CAP = 4096
#: Room for what a chat template adds once per conversation: a default system prompt when the
#: client sent none (Qwen2.5's is 21 tokens with its markers) and the generation prompt (3).
DEFAULT_CHAT_TEMPLATE_TOKENS = 32
#: Methods whose requests carry no body by HTTP semantics. Admission reads the body, so a tagged
#: route may not accept these, and requests with them always pass through (docs/admission.md).
BODYLESS_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE"})

#: Endpoints called as they are (a function, a bound method; None: no route matched): their own
#: tag is the whole answer. Tested first, as most endpoints are plain functions.
_CALLED_AS_IS = frozenset({FunctionType, MethodType, type(None)})
#: How many wrappers (partials, middleware) are followed to an endpoint: a bound on a cycle.
_MAX_WRAPPERS = 32

PromptGetter = Callable[[Any], "str | Sequence[str]"]
F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True, slots=True, kw_only=True)
class RouteSpec:
    """How one GPU-bound route is admitted.

    ``prompt`` is either field names tried in order (a string or list of strings, or OpenAI
    ``messages``) or a callable that takes the parsed body and returns the prompt text(s).
    """

    prompt: Sequence[str] | PromptGetter = DEFAULT_PROMPT_FIELDS
    max_tokens_fields: Sequence[str] = DEFAULT_MAX_TOKENS_FIELDS
    default_max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    max_new_tokens_cap: int = DEFAULT_MAX_NEW_TOKENS_CAP
    #: Body field holding the number of sequences generated (OpenAI ``n``); None to ignore.
    batch_field: str | None = "n"
    max_batch: int = 16
    estimator: Estimator | None = None
    #: Higher is admitted first; FIFO within a priority.
    priority: int = 0
    #: Devices this route may run on; None means any device of the ledger.
    devices: tuple[str, ...] | None = None
    #: Methods matched for paths registered explicitly (routers match methods themselves).
    methods: frozenset[str] = field(default=frozenset({"POST"}))
    #: Tokens added to OpenAI ``messages`` once per conversation, for the chat template.
    chat_template_tokens: int = DEFAULT_CHAT_TEMPLATE_TOKENS
    #: Refusals also carry OpenAI's ``error`` object; None follows the middleware's ``openai_errors``.
    openai_errors: bool | None = None
    #: Seconds a request of this route waits in the queue at most, and the cap on its
    #: ``x-request-timeout`` header; None: no deadline unless the header gives one (capped by the
    #: ledger's ``max_wait``). With a deadline, a request whose predicted wait is longer is
    #: refused at once (``deadline-unmeetable``) instead of timing out in the queue.
    max_client_wait: float | None = None
    #: Where this route's tenant is read (tried in order); None follows the middleware's ``tenant_key``.
    tenant_key: TenantKey | Sequence[TenantKey] | None = None
    #: Cancel the endpoint when its client disconnects before the response starts; False for a
    #: route that must finish. None follows the middleware's ``cancel_on_disconnect``.
    cancel_on_disconnect: bool | None = None

    def __post_init__(self) -> None:
        if self.estimator is not None:
            object.__setattr__(self, "estimator", as_estimator(self.estimator))
        if isinstance(self.prompt, str):
            object.__setattr__(self, "prompt", (self.prompt,))
        if isinstance(self.max_tokens_fields, str):
            object.__setattr__(self, "max_tokens_fields", (self.max_tokens_fields,))
        if isinstance(self.devices, str):
            object.__setattr__(self, "devices", (self.devices,))
        if not 1 <= self.default_max_new_tokens <= self.max_new_tokens_cap:
            raise ValueError("need 1 <= default_max_new_tokens <= max_new_tokens_cap")
        if self.max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        if self.chat_template_tokens < 0:
            raise ValueError("chat_template_tokens must be >= 0")
        object.__setattr__(self, "methods", frozenset(method.upper() for method in self.methods))
        if not self.methods or self.methods & BODYLESS_METHODS:
            raise ValueError(f"methods must be methods with a request body (admission reads it), not {sorted(self.methods)}")
        if self.max_client_wait is not None and not 0 < self.max_client_wait < math.inf:
            raise ValueError("max_client_wait must be a positive, finite number of seconds (or None)")
        check_priority(self.priority)  # refused when the route is declared, not on its first request
        if self.tenant_key is not None:
            object.__setattr__(self, "tenant_key", tenant_keys(self.tenant_key))


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
    max_client_wait: float | None = None,
    tenant_key: TenantKey | Sequence[TenantKey] | None = None,
    cancel_on_disconnect: bool | None = None,
) -> Callable[[F], F]:
    """Tag an endpoint as GPU-bound. Returns the function itself, so decorator order is free."""
    spec = RouteSpec(
        prompt=prompt,  # a str is normalised to a tuple in __post_init__
        max_tokens_fields=max_tokens_fields,
        default_max_new_tokens=default_max_new_tokens,
        max_new_tokens_cap=max_new_tokens_cap,
        batch_field=batch_field,
        max_batch=max_batch,
        estimator=estimator,
        priority=priority,
        devices=tuple(devices) if devices is not None and not isinstance(devices, str) else devices,  # type: ignore[arg-type]
        chat_template_tokens=chat_template_tokens,
        openai_errors=openai_errors,
        max_client_wait=max_client_wait,
        tenant_key=tenant_key,
        cancel_on_disconnect=cancel_on_disconnect,
    )

    def decorate(endpoint: F) -> F:
        # Above @staticmethod/@classmethod the tag goes on the function: the descriptor's own
        # attributes are not what the class hands out.
        target = endpoint.__func__ if isinstance(endpoint, staticmethod | classmethod) else endpoint
        setattr(target, SPEC_ATTRIBUTE, spec)
        return endpoint

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
    _walk(declared_routes(app) or (), "", found)
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


def _walk(routes: Iterable[Any], prefix: str, found: list[str]) -> None:
    for route in routes:
        included = getattr(route, "original_router", None)  # FastAPI's include_router(...)
        if included is not None:
            context = getattr(route, "include_context", None)
            _walk(included.routes, prefix + getattr(context, "prefix", ""), found)
            continue
        path = prefix + getattr(route, "path", "")
        children = getattr(route, "routes", None)  # Mount, Host, a mounted app
        if children is not None:
            _walk(children, path, found)
        # A Route's endpoint, or what a Mount/Host writes as the endpoint (the app it holds).
        endpoint = getattr(route, "endpoint", None) if children is None else getattr(route, "app", None)
        methods = getattr(route, "methods", None) or None  # None (or empty): the route takes every method
        bodyless = sorted(BODYLESS_METHODS if methods is None else methods & BODYLESS_METHODS)
        tagged = [method for method in bodyless if route_spec_of(endpoint, method) is not None]
        if tagged:
            found.append(f"{'/'.join(sorted(methods) if methods else tagged)} {path}")
