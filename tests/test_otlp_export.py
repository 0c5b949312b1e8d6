"""OTLP export end to end: real receivers on 127.0.0.1 decode what the exporters send.

An HTTP receiver (``http.server`` in a thread) takes ``POST /v1/traces`` and a gRPC receiver takes
``TraceService/Export``; both decode ``ExportTraceServiceRequest`` with ``opentelemetry-proto``.
That is what Jaeger's OTLP ports (4318 and 4317) accept.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent import futures
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from starlette.requests import Request

from gpu_asgi import (
    DeviceExecutor,
    GPUAdmissionMiddleware,
    Ledger,
    LinearEstimator,
    configure_tracing,
    gpu_bound,
    gpu_phase,
)
from gpu_asgi._observe import tracing as otel


class Receiver:
    """Collects (resource attributes, span) pairs from decoded export requests."""

    def __init__(self) -> None:
        self.spans: list[tuple[dict[str, Any], Any]] = []
        self.paths: list[str] = []
        self.lock = threading.Lock()

    def take(self, payload: bytes) -> None:
        request = trace_service_pb2.ExportTraceServiceRequest.FromString(payload)
        with self.lock:
            for resource_spans in request.resource_spans:
                resource = {kv.key: _value(kv.value) for kv in resource_spans.resource.attributes}
                for scope_spans in resource_spans.scope_spans:
                    self.spans.extend((resource, span) for span in scope_spans.spans)

    def named(self, name: str) -> Any:
        found = [span for _, span in self.spans if span.name == name]
        assert len(found) == 1, [span.name for _, span in self.spans]
        return found[0]


def _value(any_value: Any) -> Any:
    return getattr(any_value, any_value.WhichOneof("value"))


def attributes(span: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in span.attributes}


@pytest.fixture
def http_receiver() -> Iterator[tuple[str, Receiver]]:
    receiver = Receiver()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            payload = self.rfile.read(int(self.headers["content-length"]))
            receiver.paths.append(self.path)
            assert self.headers["content-type"] == "application/x-protobuf"
            receiver.take(payload)
            body = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("content-type", "application/x-protobuf")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}", receiver
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def grpc_receiver() -> Iterator[tuple[str, Receiver]]:
    import grpc

    receiver = Receiver()

    class TraceService(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request: Any, context: Any) -> Any:
            receiver.take(request.SerializeToString())
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(TraceService(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"http://127.0.0.1:{port}", receiver
    finally:
        server.stop(None)


def instrumented_app(provider: TracerProvider, executor: DeviceExecutor) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/generate")
    @gpu_bound()
    async def generate(request: Request) -> dict[str, str]:
        await request.body()  # admission happens at the first body read
        admission = request.state.gpu_admission

        def work() -> str:
            with gpu_phase("host_to_device", bytes=16):
                pass
            with gpu_phase("generate", batch=admission.batch) as phase:
                phase.set(tokens_out=admission.max_new_tokens)
            with gpu_phase("device_to_host"):
                pass
            return "ok"

        return {"text": await executor.run(work)}

    app.add_middleware(
        GPUAdmissionMiddleware,
        ledger=Ledger(1 << 20),
        estimator=LinearEstimator(bytes_per_token=2),
        tracer_provider=provider,
    )
    FastAPIInstrumentor.instrument_app(app, tracer_provider=provider)
    return app


async def request_once(app: FastAPI) -> None:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
        response = await http.post("/v1/generate", json={"prompt": "hello", "max_new_tokens": 5})
    assert response.status_code == 200


def assert_trace_shape(receiver: Receiver) -> None:
    server = next(span for _, span in receiver.spans if span.kind == span.SPAN_KIND_SERVER)
    queue = receiver.named(otel.QUEUE_WAIT_SPAN)
    assert queue.parent_span_id == server.span_id and queue.trace_id == server.trace_id
    queue_attributes = attributes(queue)
    assert queue_attributes[otel.ADMISSION_OUTCOME] == "admitted"
    assert queue_attributes[otel.GEN_AI_REQUEST_MAX_TOKENS] == 5
    for name in ("host_to_device", "generate", "device_to_host"):
        span = receiver.named(f"gpu_asgi.{name}")
        assert span.parent_span_id == server.span_id and span.trace_id == server.trace_id
    assert attributes(receiver.named("gpu_asgi.generate"))[otel.GEN_AI_USAGE_OUTPUT_TOKENS] == 5
    assert attributes(receiver.named("gpu_asgi.host_to_device"))[otel.COPY_DIRECTION] == "host_to_device"


async def test_otlp_http_export_reaches_a_real_receiver(http_receiver: tuple[str, Receiver]) -> None:
    url, receiver = http_receiver
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=f"{url}/v1/traces")))
    with DeviceExecutor("cpu", tracer_provider=provider) as executor:
        await request_once(instrumented_app(provider, executor))
    assert provider.force_flush(5_000)
    provider.shutdown()
    assert receiver.paths and set(receiver.paths) == {"/v1/traces"}
    assert_trace_shape(receiver)


async def test_configure_tracing_reads_otel_environment(
    http_receiver: tuple[str, Receiver], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, receiver = http_receiver
    monkeypatch.setenv("OTEL_SERVICE_NAME", "gpu-demo")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=test")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", url)  # the HTTP exporter appends /v1/traces
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_PROTOCOL", raising=False)
    monkeypatch.delenv("OTEL_TRACES_EXPORTER", raising=False)
    provider = configure_tracing(service_name="ignored-when-the-env-names-one", set_global=False)
    with DeviceExecutor("cpu", tracer_provider=provider) as executor:
        await request_once(instrumented_app(provider, executor))
    assert provider.force_flush(5_000)
    provider.shutdown()
    assert set(receiver.paths) == {"/v1/traces"}
    resource = receiver.spans[0][0]
    assert resource["service.name"] == "gpu-demo" and resource["deployment.environment"] == "test"
    assert_trace_shape(receiver)


async def test_configure_tracing_over_grpc(
    grpc_receiver: tuple[str, Receiver], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, receiver = grpc_receiver
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    monkeypatch.delenv("OTEL_RESOURCE_ATTRIBUTES", raising=False)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", url)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_INSECURE", "true")
    provider = configure_tracing(service_name="gpu-grpc", set_global=False)
    with DeviceExecutor("cpu", tracer_provider=provider) as executor:
        await request_once(instrumented_app(provider, executor))
    assert provider.force_flush(10_000)
    provider.shutdown()
    assert receiver.spans[0][0]["service.name"] == "gpu-grpc"  # the fallback name, as the env names none
    assert_trace_shape(receiver)


def test_configure_tracing_exporter_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter

    from gpu_asgi._observe.tracing_setup import _exporters_from_environment

    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    assert _exporters_from_environment() == []
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    assert [type(e) for e in _exporters_from_environment()] == [ConsoleSpanExporter]
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "zipkin")
    with pytest.raises(ValueError, match="zipkin"):
        _exporters_from_environment()
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
    with pytest.raises(ValueError, match="http/json"):
        _exporters_from_environment()
