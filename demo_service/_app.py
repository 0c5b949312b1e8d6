"""``create_app``: the demo's FastAPI app, with gpu_asgi in front of every GPU route.

The model is loaded once, here (admission needs its config and tokenizer before the app starts).
The lifespan starts the device sampler and the batcher, and stops them.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI

from gpu_asgi import (
    AnalyticEstimator,
    DeviceExecutor,
    DeviceSampler,
    GPUAdmissionMiddleware,
    GPUMetrics,
    HFTokenCounter,
    Lifecycle,
    NoDeviceProbe,
    OutputLengths,
    ThermalPolicy,
    auto_probe,
    budget_bytes,
    configure_tracing,
    health_router,
    ledger_from_url,
)

from ._api.generate import generate_router
from ._api.openai import openai_router
from ._api.problems import install_problem_handlers
from ._batching.batcher import Batcher
from ._batching.buckets import BucketedEstimator
from ._metrics import DemoMetrics
from ._model.load import LoadedModel, load_model
from ._service import DemoService, warm_up
from ._settings import DEFAULT_CPU_BUDGET_BYTES, DemoSettings

#: On a hot GPU (above ThermalPolicy's 75 °C) requests get at most this many new tokens.
THERMAL_CLAMP_MAX_NEW_TOKENS = 64


def create_app(
    settings: DemoSettings | None = None, *, model: LoadedModel | None = None, tracer_provider: Any = None
) -> FastAPI:
    """The demo app. ``model`` reuses an already loaded model (tests); otherwise it is loaded here.

    With ``settings.tracing`` and no ``tracer_provider``, tracing is configured from the ``OTEL_*``
    variables here (also under ``uvicorn --factory``) and flushed when the lifespan ends.
    """
    settings = settings if settings is not None else DemoSettings()
    # Here rather than in __main__, so that `uvicorn --factory demo_service:create_app` traces too.
    owned_provider = None
    if tracer_provider is None and settings.tracing:
        tracer_provider = owned_provider = configure_tracing(service_name="gpu_asgi-demo")
    loaded = (
        model
        if model is not None
        else load_model(
            settings.model_path,
            device=settings.device,
            int8=settings.int8,
            progress=settings.progress,
            local_dir=settings.local_model_dir,
        )
    )
    on_gpu = loaded.device.startswith("cuda")
    shared = settings.ledger_url is not None and not settings.ledger_url.startswith("memory://")
    redis_options = {"namespace": settings.ledger_namespace} if shared else {}
    ledger = ledger_from_url(
        settings.ledger_url,
        {loaded.device: device_budget(settings, loaded)},
        max_queue=settings.max_queue,
        max_wait=settings.max_wait,
        **redis_options,
    )
    estimator = BucketedEstimator(AnalyticEstimator.from_config(loaded.model.config, dtype=loaded.dtype))
    sampler = DeviceSampler(auto_probe() if on_gpu else NoDeviceProbe())
    thermal = ThermalPolicy(clamp_max_new_tokens=THERMAL_CLAMP_MAX_NEW_TOKENS)
    metrics = GPUMetrics(ledger, sampler=sampler, shared_ledger=shared)
    batcher = Batcher(
        loaded,
        estimator=estimator,
        ledger=ledger,
        executor=DeviceExecutor(loaded.device, tracer_provider=tracer_provider),
        window=settings.batch_window_ms / 1000,
        max_batch_size=settings.max_batch_size,
        metrics=DemoMetrics(metrics.registry),
        tracer_provider=tracer_provider,
    )
    service = DemoService(settings, loaded, ledger, batcher, settings.served_model_name or loaded.name)
    # Ready only once the model has loaded (above) and one real generation has run (the lifespan).
    lifecycle = Lifecycle()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with sampler, batcher:
            # In the background: the server listens (liveness answers) while readiness says 503.
            warming = asyncio.ensure_future(warm_up(service, lifecycle))
            try:
                async with lifecycle.serving(drain_timeout=settings.drain_timeout, signal_delay=settings.drain_delay):
                    yield
            finally:
                warming.cancel()
                await asyncio.gather(warming, return_exceptions=True)
        metrics.close()
        await ledger.aclose()  # the Redis ledger's heartbeat and connections
        if owned_provider is not None:
            owned_provider.shutdown()  # flush the last spans

    app = FastAPI(
        title="gpu_asgi demo service",
        summary=f"{service.model_name} on {loaded.device}, admitted by gpu_asgi",
        lifespan=lifespan,
    )
    app.state.service = service
    app.state.lifecycle = lifecycle
    quantile = settings.reserve_quantile
    # Learned lengths: safe here because the batcher grows a batch before it decodes past them.
    lengths = None if quantile is None else OutputLengths(quantile=quantile)
    app.include_router(generate_router(service))
    app.include_router(openai_router(service))
    app.router.routes.extend(
        health_router(
            ledger, sampler=sampler, thermal=thermal, metrics=metrics, lifecycle=lifecycle, drain_path="/health/drain",
            output_lengths=lengths,
        ).routes
    )
    install_problem_handlers(app)
    app.add_middleware(
        GPUAdmissionMiddleware,
        output_lengths=lengths,
        ledger=ledger,
        estimator=estimator,
        token_counter=HFTokenCounter(loaded.tokenizer),
        reject_status=settings.reject_status,
        metrics=metrics,
        sampler=sampler,
        thermal=thermal,
        tracer_provider=tracer_provider,
        lifecycle=lifecycle,
    )
    if settings.tracing:
        _instrument(app, tracer_provider)
    return app


def device_budget(settings: DemoSettings, loaded: LoadedModel) -> int:
    """Bytes requests may reserve: as configured, else simulated on the CPU, else derived from the GPU.

    On CUDA the weights (already on the device) and the runtime overhead come off the device's
    total once: ``total x utilization - weights - overhead``.
    """
    if settings.budget_bytes is not None:
        return settings.budget_bytes
    if not loaded.device.startswith("cuda"):
        return DEFAULT_CPU_BUDGET_BYTES
    import torch

    _, total = torch.cuda.mem_get_info(loaded.device)
    return budget_bytes(
        total,
        utilization=settings.gpu_utilization,
        weights_bytes=loaded.weights_bytes,
        runtime_overhead_bytes=settings.runtime_overhead_bytes,
    )


def _instrument(app: FastAPI, tracer_provider: Any) -> None:
    """Server spans, so gpu_asgi's spans have a parent (opentelemetry-instrumentation-fastapi)."""
    try:
        from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor
    except ImportError:  # the spans still export, each as its own trace
        return
    FastAPIInstrumentor.instrument_app(app, tracer_provider=tracer_provider, excluded_urls="health,metrics")
