"""Route tagging: ``@gpu_bound``, the per-route spec, and route resolution with a cache."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ._estimate import Estimator
from ._ledger import check_priority
from ._types import Scope

SPEC_ATTRIBUTE = "__gpu_asgi_route__"
DEFAULT_PROMPT_FIELDS = ("prompt", "messages")
DEFAULT_MAX_TOKENS_FIELDS = ("max_new_tokens", "max_tokens", "max_completion_tokens")
DEFAULT_MAX_NEW_TOKENS = 256
DEFAULT_MAX_NEW_TOKENS_CAP = 4096
DEFAULT_ROUTE_CACHE_SIZE = 4096
#: Room for what a chat template adds once per conversation: a default system prompt when the
#: client sent none (Qwen2.5's is 21 tokens with its markers) and the generation prompt (3).
DEFAULT_CHAT_TEMPLATE_TOKENS = 32

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

    def __post_init__(self) -> None:
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
        check_priority(self.priority)  # refused when the route is declared, not on its first request


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
    )

    def decorate(endpoint: F) -> F:
        setattr(endpoint, SPEC_ATTRIBUTE, spec)
        return endpoint

    return decorate


def route_spec_of(endpoint: Any) -> RouteSpec | None:
    """The spec an endpoint was tagged with (also through ``functools.partial``/methods)."""
    while endpoint is not None:
        spec = getattr(endpoint, SPEC_ATTRIBUTE, None)
        if spec is not None:
            return spec  # type: ignore[no-any-return]
        endpoint = getattr(endpoint, "func", None) or getattr(endpoint, "__func__", None)
    return None


#: Methods cached per path; answers for further (invented) method names are looked up each time.
MAX_METHODS_PER_PATH = 16


class RouteResolver:
    """Finds the spec for a request before the router runs, and caches the answer.

    The middleware sits in front of the router, so it asks the app's routes itself
    (``route.matches(scope)``, recursing into mounts). Answers are cached per path, then per
    method: two lookups by strings whose hashes are cached, cheaper than hashing a (method,
    path) tuple on every untagged request. The cache is bounded by paths, because path
    parameters make paths unbounded.
    """

    def __init__(
        self,
        explicit: Mapping[str, RouteSpec] | None = None,
        cache_size: int = DEFAULT_ROUTE_CACHE_SIZE,
        *,
        wrapped: Any = None,
    ) -> None:
        self._explicit = dict(explicit or {})
        #: The app the middleware wraps: its router is asked when the scope names no app, as when
        #: the middleware wraps a Starlette/FastAPI app from outside instead of ``add_middleware``.
        self._wrapped = wrapped
        #: path -> {method -> spec or None}. ``path`` is the full path (root_path included), so it
        #: names routes of this app. Readable directly for a lookup without a call.
        self.cache: dict[str, dict[str, RouteSpec | None]] = {}
        self._cache_size = cache_size

    def resolve(self, scope: Scope) -> RouteSpec | None:
        path, method = scope["path"], scope["method"]
        by_method = self.cache.get(path)
        if by_method is None:
            if len(self.cache) >= self._cache_size:
                del self.cache[next(iter(self.cache))]  # evict the oldest path
            by_method = self.cache[path] = {}
        elif method in by_method:
            return by_method[method]
        spec = self._lookup(scope)
        if len(by_method) < MAX_METHODS_PER_PATH:  # clients choose method names: keep them bounded too
            by_method[method] = spec
        return spec

    def _lookup(self, scope: Scope) -> RouteSpec | None:
        spec = self._explicit.get(scope["path"])
        if spec is not None:
            return spec if scope["method"] in spec.methods else None
        router = getattr(scope.get("app"), "router", None) or getattr(self._wrapped, "router", None)
        routes = getattr(router, "routes", None)
        return _match_routes(routes, scope) if routes is not None else None


def _match_routes(routes: Iterable[Any], scope: Scope) -> RouteSpec | None:
    from starlette.routing import Match  # starlette is a hard dependency; import kept local to the cold path

    for route in routes:
        match, child_scope = route.matches(scope)
        if match is Match.FULL:  # NONE, or PARTIAL (wrong method): the router keeps looking too, then answers 405
            return _spec_of_matched(route, scope, child_scope)
    return None


def _spec_of_matched(route: Any, scope: Scope, child_scope: Scope) -> RouteSpec | None:
    sub_routes = getattr(route, "routes", None)
    if sub_routes is not None:  # Mount or Host: look inside, with the path it consumed
        inner_scope = {**scope, **child_scope}
        inner_scope.pop("endpoint", None)
        return _match_routes(sub_routes, inner_scope)
    if "endpoint" in child_scope:
        return route_spec_of(child_scope["endpoint"])
    # FastAPI (>= 0.16x) includes routers lazily: the included router matches without naming the
    # endpoint, and only its (private) ``_match`` selects the route. tests/test_tagging.py guards this.
    select = getattr(route, "_match", None)
    if select is not None:
        from starlette.routing import Match

        match, inner_child, inner, _ = select(scope)
        if match is Match.FULL and inner is not None:
            return _spec_of_matched(inner, scope, inner_child)
    return None
