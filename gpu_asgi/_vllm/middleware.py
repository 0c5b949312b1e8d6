"""``VLLMAdmission``: gpu_asgi for vLLM's OpenAI server, attached with one ``--middleware`` line.

vLLM builds a ``--middleware`` class as ``Class(app)``, with nothing else to say, before its engine
is known to the class. So the class does its work when the server starts (the ASGI lifespan, when
vLLM's ``app.state`` holds the running engine): it reads the ``GPU_ASGI_*`` settings, learns the KV
cache and the model from the engine, tags the generating routes, and from then on is a
``GPUAdmissionMiddleware`` with a ``PagedKVEstimator`` over a budget of the cache's usable blocks.
A setting or a server it cannot use stops the startup with the reason (``lifespan.startup.failed``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from .._asgi.middleware import GPUAdmissionMiddleware
from .._asgi.routes import declared_routes
from .._estimate.lengths import OutputLengths
from .._estimate.lengths_file import LengthsFile
from .._estimate.paged import PagedKVEstimator
from .._estimate.tokens import HFTokenCounter
from .._ledger.contract import BudgetLedger
from .._ledger.url import ledger_from_url
from .._observe.metrics import GPUMetrics
from .._types import ASGIApp, Message, Receive, Scope, Send
from .engine_usage import EngineUsage
from .following import Following
from .log import vllm_logger
from .routes import CHAT_COMPLETIONS, COMPLETIONS, route_specs, tag_routes
from .server import ServerNotReady, VLLMServer, learn
from .settings import VLLMSettings


def budget_for(server: VLLMServer, oversubscribe: float) -> int:
    """Bytes of the cache's usable blocks, times the over-subscription factor, in whole blocks."""
    blocks = max(1, int(server.usable_blocks * oversubscribe))
    return blocks * server.block_size * server.kv_bytes_per_token


def build_ledger(settings: VLLMSettings, budget: int) -> BudgetLedger:
    """This process's ledger, or the Redis one that every API server process of the cache shares."""
    return ledger_from_url(
        settings.ledger_url, budget, max_queue=settings.max_queue, max_wait=settings.max_wait,
        tenants=settings.tenant_policies(), namespace=settings.namespace, redis_timeout=settings.redis_timeout,
    )


def prometheus_registry() -> Any:
    """The registry vLLM's ``/metrics`` serves (prometheus-client's global one), or None without it."""
    try:
        from prometheus_client import REGISTRY
    except ImportError:  # pragma: no cover - vLLM depends on prometheus-client
        return None
    return REGISTRY


#: The routes whose requests vLLM names by ``X-Request-Id``, so that their progress can be read.
FOLLOWED_PATHS = frozenset({COMPLETIONS, CHAT_COMPLETIONS})


def build(
    app: ASGIApp, vllm_app: Any, environ: Mapping[str, str], registry: Any = None
) -> tuple[GPUAdmissionMiddleware, EngineUsage | None, Following | None, LengthsFile | None]:
    """The admission middleware around ``app``, sized from the vLLM server ``vllm_app``; its metrics
    in ``registry`` (default: the one vLLM's ``/metrics`` serves). With learned lengths, also the
    closed loop on vLLM's KV-cache usage, read from that registry, and (``GPU_ASGI_FOLLOW``) the
    reservations that follow the answers as vLLM generates them (strict needs neither: what it
    reserves is the most a request can use)."""
    settings = VLLMSettings.from_env(environ)
    server = learn(getattr(vllm_app, "state", None))
    estimator = PagedKVEstimator(
        bytes_per_token=server.kv_bytes_per_token, block_size=server.block_size, max_sequence_tokens=server.max_model_len
    )
    budget = budget_for(server, settings.oversubscribe)
    routes = declared_routes(vllm_app)
    tagged = tag_routes(routes or (), route_specs(server, estimator, patient=settings.patient))
    if not tagged:
        raise ServerNotReady("vLLM serves none of /v1/completions, /v1/chat/completions, /v1/responses: nothing to admit")
    ledger = build_ledger(settings, budget)
    registry = prometheus_registry() if registry is None else registry
    metrics = None if registry is None else GPUMetrics(
        ledger, registry=registry, shared_ledger=settings.ledger_url is not None
    )
    lengths = None if settings.quantile is None else OutputLengths(settings.quantile)
    lengths_file = None
    if lengths is not None and settings.lengths_file is not None:  # warm start: what a process before this one learnt
        lengths_file = LengthsFile(settings.lengths_file, lengths, model=f"{server.model} (max_model_len {server.max_model_len})")
        lengths_file.load()
    reserve = "strict" if lengths is None else f"learned lengths, quantile {settings.quantile:g}"
    if lengths is not None and settings.follow:
        reserve += ", following, all growth" if settings.growth is None else f", following, pooled growth {settings.growth:g}"
    vllm_logger().info(
        "gpu_asgi admits %s against %d bytes (%s, reserving %s, over-subscription %g, ledger %s)",
        ", ".join(tagged), budget, server.describe(), reserve, settings.oversubscribe,
        settings.ledger_url or "in-process",
    )
    admission = GPUAdmissionMiddleware(
        app,
        ledger=ledger,
        estimator=estimator,
        token_counter=HFTokenCounter(server.tokenizer),
        reject_status=settings.reject_status,
        metrics=metrics,
        openai_errors=True,
        tenant_key=settings.tenant_key,
        output_lengths=lengths,
    )
    usage = following = None
    if lengths is not None and registry is not None:
        cache_bytes = server.usable_blocks * estimator.bytes_per_block
        usage = EngineUsage(ledger, registry, cache_bytes=cache_bytes, block_bytes=estimator.bytes_per_block)
    engine = getattr(getattr(vllm_app, "state", None), "engine_client", None)
    if lengths is not None and settings.follow:
        if Following.available(engine):
            following = Following(
                ledger, engine, block_size=server.block_size, bytes_per_block=estimator.bytes_per_block,
                metrics=metrics, growth_quantile=settings.growth,
            )
        else:
            vllm_logger().warning(
                "gpu_asgi cannot read this vLLM's request progress (engine_client.output_processor): "
                "reservations cover each answer's predicted length from its start"
            )
    return admission, usage, following, lengths_file


class VLLMAdmission:
    """``--middleware gpu_asgi.vllm.VLLMAdmission``: admit vLLM's generating requests by KV blocks.

    ``environ`` (default ``os.environ``, read at startup) holds the ``GPU_ASGI_*`` settings;
    ``registry`` takes gpu_asgi's metrics (default: prometheus-client's, which vLLM's ``/metrics`` serves).
    """

    def __init__(self, app: ASGIApp, *, environ: Mapping[str, str] | None = None, registry: Any = None) -> None:
        self.app = app
        self._environ = environ
        self._registry = registry
        self._admission: GPUAdmissionMiddleware | None = None
        self._usage: EngineUsage | None = None
        self._following: Following | None = None
        self._lengths_file: LengthsFile | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        admission = self._admission
        if admission is None:
            if scope["type"] == "lifespan":
                await self._start(scope, receive, send)
                return
            if scope["type"] != "http":
                await self.app(scope, receive, send)
                return
            # A host that runs no lifespan: start on the first request.
            admission, self._usage, self._following, self._lengths_file = self._build(scope)
            self._admission = admission
            for loop in (self._usage, self._following, self._lengths_file):
                if loop is not None:
                    loop.start()
        following = self._following
        if following is None or scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in FOLLOWED_PATHS:
            await admission(scope, receive, send)
            return
        scope, followed = following.enter(scope)
        try:
            await admission(scope, receive, send)
        finally:
            following.leave(followed)

    def _build(
        self, scope: Scope
    ) -> tuple[GPUAdmissionMiddleware, EngineUsage | None, Following | None, LengthsFile | None]:
        environ = os.environ if self._environ is None else self._environ
        return build(self.app, scope.get("app"), environ, self._registry)

    async def _start(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            admission, usage, following, lengths_file = self._build(scope)
            self._admission, self._usage, self._following = admission, usage, following
            self._lengths_file = lengths_file
        except (ServerNotReady, ValueError, ImportError) as error:  # SettingsError is a ValueError; ImportError: the redis extra
            problem = f"gpu_asgi.vllm cannot start: {error}"
            vllm_logger().error("%s", problem)
            if (await receive())["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.failed", "message": problem})
            raise RuntimeError(problem) from None
        ledger = admission.ledger

        loops = [loop for loop in (usage, following, lengths_file) if loop is not None]

        async def send_closing(message: Message) -> None:
            if message["type"] == "lifespan.startup.complete":
                for loop in loops:
                    loop.start()
            if message["type"] in ("lifespan.shutdown.complete", "lifespan.shutdown.failed"):
                for loop in loops:
                    await loop.stop()
                await ledger.aclose()  # the Redis ledger's heartbeat and connections
            await send(message)

        await admission(scope, receive, send_closing)
