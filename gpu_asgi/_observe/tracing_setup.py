"""``configure_tracing()``: an OpenTelemetry SDK pipeline from the standard ``OTEL_*`` variables.

The one place gpu_asgi reads tracing settings from the environment, and only when called. It
needs the ``otel`` extra (``opentelemetry-sdk`` and the OTLP exporters). Applications that already
set up OpenTelemetry (``opentelemetry-instrument``, a vendor distro, their own code) do not need it:
gpu_asgi's spans go to whatever tracer provider is global, or the one passed to the middleware.
"""

from __future__ import annotations

import os
from typing import Any

OTEL_MISSING = "configure_tracing() needs the OpenTelemetry SDK and exporters: pip install 'gpu_asgi[otel]'."
PROTOCOLS = ("http/protobuf", "grpc")


def configure_tracing(
    *,
    service_name: str | None = None,
    exporter: Any = None,
    batch: bool = True,
    set_global: bool = True,
) -> Any:
    """Build (and by default install globally) an SDK ``TracerProvider`` configured from the environment.

    - ``OTEL_SERVICE_NAME`` / ``OTEL_RESOURCE_ATTRIBUTES``: the resource; ``service_name`` is used
      only when neither names the service.
    - ``OTEL_TRACES_EXPORTER``: ``otlp`` (default), ``console`` or ``none``, comma-separated.
    - ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` / ``OTEL_EXPORTER_OTLP_PROTOCOL``: ``http/protobuf``
      (default, port 4318) or ``grpc`` (port 4317).
    - ``OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT``, ``..._HEADERS``, ``..._TIMEOUT``, ``..._COMPRESSION``,
      ``..._CERTIFICATE``: read by the exporter itself; ``OTEL_TRACES_SAMPLER[_ARG]`` by the SDK;
      ``OTEL_BSP_*`` by the batch processor; ``OTEL_SDK_DISABLED=true`` gives a provider that records nothing.

    ``exporter`` replaces the exporters named by the environment; ``batch=False`` exports each
    span as it ends (tests, debugging). Shut the provider down on exit to flush the last batch.
    """
    try:
        from opentelemetry import trace
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    except ImportError:
        raise RuntimeError(OTEL_MISSING) from None

    resource = Resource.create()
    if service_name and str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: service_name}))
    provider = TracerProvider(resource=resource)
    exporters = [exporter] if exporter is not None else _exporters_from_environment()
    for span_exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(span_exporter) if batch else SimpleSpanProcessor(span_exporter))
    if set_global:
        trace.set_tracer_provider(provider)
    return provider


def _exporters_from_environment() -> list[Any]:
    names = [name.strip().lower() for name in os.environ.get("OTEL_TRACES_EXPORTER", "otlp").split(",") if name.strip()]
    exporters = []
    for name in names:
        if name == "none":
            continue
        if name == "console":
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter

            exporters.append(ConsoleSpanExporter())
        elif name == "otlp":
            exporters.append(_otlp_exporter())
        else:
            raise ValueError(f"OTEL_TRACES_EXPORTER={name!r} is not supported here: use otlp, console or none")
    return exporters


def _otlp_exporter() -> Any:
    protocol = (
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or PROTOCOLS[0]
    ).strip()
    try:
        if protocol == "http/protobuf":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        elif protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter  # type: ignore[assignment]
        else:
            raise ValueError(f"OTLP protocol {protocol!r} is not supported here: use one of {', '.join(PROTOCOLS)}")
    except ImportError:
        raise RuntimeError(OTEL_MISSING) from None
    return OTLPSpanExporter()
