"""Spans: the queue wait under the server span, its outcomes, and ``gpu_phase`` in the executor.

Spans are captured with the SDK's ``InMemorySpanExporter`` on a tracer provider passed in, so no
test touches the global provider. The server span comes from ``opentelemetry-instrumentation-fastapi``
or from FastAPI's own built-in telemetry.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from typing import Any

import pytest
from fastapi import FastAPI
from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from gpu_asgi import DeviceExecutor, GPUAdmissionMiddleware, Ledger, LinearEstimator, gpu_bound, gpu_phase
from gpu_asgi._observe import tracing as otel

from ._asgi import RawClient, Words, client, http_scope, wait_until


def tracing() -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def one(spans: tuple[ReadableSpan, ...] | list[ReadableSpan], name: str) -> ReadableSpan:
    found = [span for span in spans if span.name == name]
    assert len(found) == 1, [span.name for span in spans]
    return found[0]


def parent_of(span: ReadableSpan, spans: Any) -> ReadableSpan | None:
    if span.parent is None:
        return None
    return next(s for s in spans if s.context.span_id == span.parent.span_id)


@gpu_bound()
async def echo(request: Request) -> JSONResponse:
    await request.body()  # admission happens at the first body read
    admission = request.state.gpu_admission
    return JSONResponse({"device": admission.device})


def starlette_app(ledger: Ledger, provider: TracerProvider, **options: Any) -> Starlette:
    app = Starlette(routes=[Route("/generate", echo, methods=["POST"])])
    app.add_middleware(
        GPUAdmissionMiddleware,
        ledger=ledger,
        estimator=LinearEstimator(bytes_per_token=1),
        token_counter=Words(),
        tracer_provider=provider,
        **options,
    )
    return app



def generating_app(provider: TracerProvider, *, native: bool, executor: DeviceExecutor) -> FastAPI:
    """A FastAPI endpoint that marks its three GPU phases, each in one line, in the executor."""
    app = FastAPI(telemetry={"tracer_provider": provider}) if native else FastAPI()

    @app.post("/generate")
    @gpu_bound()
    async def generate(request: Request) -> dict[str, Any]:
        await request.body()  # admission happens at the first body read
        admission = request.state.gpu_admission

        def work() -> str:
            with gpu_phase("host_to_device", bytes=64):
                pass
            with gpu_phase("generate", batch=admission.batch, tokens_in=admission.prompt_tokens) as phase:
                phase.set(tokens_out=7)
            with gpu_phase("device_to_host", bytes=28):
                pass
            return "done"

        return {"result": await executor.run(work)}

    app.add_middleware(
        GPUAdmissionMiddleware,
        ledger=Ledger(10_000),
        estimator=LinearEstimator(bytes_per_token=1),
        token_counter=Words(),
        tracer_provider=provider,
    )
    return app


def test_semantic_convention_names_match_the_installed_package() -> None:
    from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as gen_ai
    from opentelemetry.semconv.attributes import error_attributes

    assert otel.GEN_AI_OPERATION_NAME == gen_ai.GEN_AI_OPERATION_NAME
    assert otel.GEN_AI_REQUEST_MODEL == gen_ai.GEN_AI_REQUEST_MODEL
    assert otel.GEN_AI_REQUEST_MAX_TOKENS == gen_ai.GEN_AI_REQUEST_MAX_TOKENS
    assert otel.GEN_AI_USAGE_INPUT_TOKENS == gen_ai.GEN_AI_USAGE_INPUT_TOKENS
    assert otel.GEN_AI_USAGE_OUTPUT_TOKENS == gen_ai.GEN_AI_USAGE_OUTPUT_TOKENS
    assert otel.ERROR_TYPE == error_attributes.ERROR_TYPE
    ours = [
        v
        for k, v in vars(otel).items()
        if k.isupper() and isinstance(v, str) and "." in v and not k.startswith("INSTR")
    ]
    assert len(ours) > 15
    assert all(value.startswith(("gen_ai.", "error.", "gpu_asgi.")) for value in ours)


@pytest.mark.parametrize("native", [False, True], ids=["instrumentation-fastapi", "fastapi-builtin"])
async def test_spans_nest_under_the_fastapi_server_span(native: bool) -> None:
    provider, exporter = tracing()
    with DeviceExecutor("cpu", tracer_provider=provider) as executor:
        app = generating_app(provider, native=native, executor=executor)
        if not native:
            FastAPIInstrumentor.instrument_app(app, tracer_provider=provider)
        async with client(app) as http:
            response = await http.post("/generate", json={"prompt": "one two three", "max_tokens": 9})
    assert response.status_code == 200 and response.json() == {"result": "done"}
    spans = exporter.get_finished_spans()
    server = next(span for span in spans if span.kind is SpanKind.SERVER)
    queue = one(spans, otel.QUEUE_WAIT_SPAN)
    # Admission happens where the endpoint reads its body: under the server span, and under
    # FastAPI's own endpoint span when FastAPI traces itself.
    parent = parent_of(queue, spans)
    assert parent is server or (parent is not None and parent.name == "fastapi.endpoint" and parent_of(parent, spans) is server)
    assert queue.attributes[otel.GEN_AI_USAGE_INPUT_TOKENS] == 3
    assert queue.attributes[otel.GEN_AI_REQUEST_MAX_TOKENS] == 9
    assert queue.attributes[otel.ADMISSION_ESTIMATED_BYTES] == 12
    assert queue.attributes[otel.ADMISSION_OUTCOME] == otel.ADMITTED
    assert queue.attributes[otel.ADMISSION_DEVICE] == "cuda:0"
    assert queue.attributes[otel.ADMISSION_QUEUE_DEPTH] == 0
    assert queue.status.status_code is StatusCode.UNSET
    to_device, generate, to_host = (
        one(spans, f"gpu_asgi.{name}") for name in ("host_to_device", "generate", "device_to_host")
    )
    for span in (to_device, generate, to_host):
        parent = parent_of(span, spans)
        # instrumentation-fastapi: children of the server span; FastAPI's built-in telemetry wraps
        # the endpoint in its own "fastapi.endpoint" span, itself a child of the server span.
        assert (
            parent is server
            if not native
            else (parent.name == "fastapi.endpoint" and parent_of(parent, spans) is server)
        )
        assert span.attributes[otel.DEVICE] == "cpu"
        assert span.context.trace_id == server.context.trace_id
    assert to_device.attributes[otel.COPY_DIRECTION] == "host_to_device" and to_device.attributes[otel.COPY_BYTES] == 64
    assert to_host.attributes[otel.COPY_DIRECTION] == "device_to_host"
    assert otel.COPY_DIRECTION not in generate.attributes
    assert generate.attributes[otel.GEN_AI_USAGE_OUTPUT_TOKENS] == 7
    assert generate.attributes[otel.BATCH_SIZE] == 1 and generate.attributes[otel.GEN_AI_USAGE_INPUT_TOKENS] == 3
    assert queue.end_time <= to_device.start_time  # the queue wait is over before the device work starts


async def test_queued_request_records_queue_depth_and_wait() -> None:
    provider, exporter = tracing()
    ledger = Ledger(100)
    holder = await ledger.reserve(95)
    blocked = asyncio.ensure_future(ledger.reserve(50))  # already waiting when ours arrives
    app = starlette_app(ledger, provider)
    raw = RawClient(app, http_scope(), [b'{"prompt": "a", "max_new_tokens": 10}']).start()
    await wait_until(lambda: ledger.statistics().waiting == 2)
    await asyncio.sleep(0.01)
    blocked.cancel()
    holder.release()
    await raw.finish()
    assert raw.status == 200
    queue = one(exporter.get_finished_spans(), otel.QUEUE_WAIT_SPAN)
    assert queue.attributes[otel.ADMISSION_OUTCOME] == otel.ADMITTED
    assert queue.attributes[otel.ADMISSION_QUEUE_DEPTH] == 1
    # at least the 10 ms slept (the loop may wake a clock tick early: allow 1 ms); load only adds
    assert queue.attributes[otel.ADMISSION_WAIT_SECONDS] >= 0.009


async def test_simultaneous_arrivals_see_each_other_in_the_queue() -> None:
    provider, exporter = tracing()
    ledger = Ledger(100)
    holder = await ledger.reserve(95)
    app = starlette_app(ledger, provider)
    raws = [RawClient(app, http_scope(), [b'{"prompt": "a", "max_new_tokens": 10}']).start() for _ in range(3)]
    await wait_until(lambda: ledger.statistics().waiting == 3)
    holder.release()
    for raw in raws:
        await raw.finish()
    depths = sorted(span.attributes[otel.ADMISSION_QUEUE_DEPTH] for span in exporter.get_finished_spans())
    assert depths == [0, 1, 2]


async def test_rejections_are_error_spans_with_the_reason() -> None:
    provider, exporter = tracing()
    ledger = Ledger(100, max_queue=0, max_wait=0.01)
    holder = await ledger.reserve(95)
    async with client(starlette_app(ledger, provider)) as http:
        full = await http.post("/generate", json={"prompt": "a", "max_new_tokens": 10})
        huge = await http.post("/generate", json={"prompt": "a", "max_new_tokens": 500})
        ledger.max_queue = 5
        late = await http.post("/generate", json={"prompt": "a", "max_new_tokens": 10})
    holder.release()
    assert [full.status_code, huge.status_code, late.status_code] == [503, 413, 503]
    spans = [span for span in exporter.get_finished_spans() if span.name == otel.QUEUE_WAIT_SPAN]
    outcomes = [(s.attributes[otel.ADMISSION_OUTCOME], s.attributes[otel.ADMISSION_REASON]) for s in spans]
    assert outcomes == [
        (otel.REJECTED, "queue-full"),
        (otel.REJECTED, "exceeds-budget"),
        (otel.TIMED_OUT, "queue-timeout"),
    ]
    for span in spans:
        assert span.status.status_code is StatusCode.ERROR
        assert span.status.description == span.attributes[otel.ADMISSION_REASON] == span.attributes[otel.ERROR_TYPE]
        assert otel.ADMISSION_DEVICE not in span.attributes
    assert spans[2].attributes[otel.ADMISSION_WAIT_SECONDS] >= 0.01


async def test_disconnect_while_queued_is_recorded_and_not_an_error() -> None:
    provider, exporter = tracing()
    ledger = Ledger(100)
    holder = await ledger.reserve(95)
    raw = RawClient(starlette_app(ledger, provider), http_scope(), [b'{"prompt": "a", "max_new_tokens": 10}']).start()
    await wait_until(lambda: ledger.statistics().waiting == 1)
    raw.disconnect()
    await raw.finish()
    holder.release()
    queue = one(exporter.get_finished_spans(), otel.QUEUE_WAIT_SPAN)
    assert queue.attributes[otel.ADMISSION_OUTCOME] == otel.DISCONNECTED
    assert queue.status.status_code is StatusCode.UNSET
    assert raw.status == 499 and ledger.statistics().reserved_bytes == 0  # the departed client's answer


async def test_body_errors_make_no_queue_span() -> None:
    provider, exporter = tracing()
    async with client(starlette_app(Ledger(100), provider)) as http:
        response = await http.post("/generate", content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert exporter.get_finished_spans() == ()


async def test_without_an_sdk_everything_is_a_no_op() -> None:
    """No tracer provider anywhere: the API's proxy/no-op tracer; requests and phases just work."""
    ledger = Ledger(100)
    app = Starlette(routes=[Route("/generate", echo, methods=["POST"])])
    app.add_middleware(GPUAdmissionMiddleware, ledger=ledger, estimator=LinearEstimator(bytes_per_token=1))
    async with client(app) as http:
        response = await http.post("/generate", json={"prompt": "a b", "max_new_tokens": 3})
    assert response.status_code == 200
    with gpu_phase("generate", batch=2, tokens_out=5) as phase:
        phase.set(tokens_out=6)
        assert not phase.span.is_recording()


def test_gpu_phase_outside_an_executor_and_its_keywords() -> None:
    provider, exporter = tracing()
    with gpu_phase(
        "prefill", tracer_provider=provider, model="qwen2", operation="text_completion", attributes={"custom.key": "v"}
    ) as phase:
        phase.set(tokens_in=4, tokens_out=None)
    (span,) = exporter.get_finished_spans()
    assert span.name == "gpu_asgi.prefill"
    assert dict(span.attributes) == {
        otel.GEN_AI_REQUEST_MODEL: "qwen2",
        otel.GEN_AI_OPERATION_NAME: "text_completion",
        otel.GEN_AI_USAGE_INPUT_TOKENS: 4,
        "custom.key": "v",
    }
    with (
        pytest.raises(TypeError, match="unknown phase attribute 'tokens'"),
        gpu_phase("generate", tracer_provider=provider, tokens=3),
    ):
        pass


def test_gpu_phase_records_the_exception() -> None:
    provider, exporter = tracing()
    with pytest.raises(RuntimeError), gpu_phase("generate", tracer_provider=provider):
        raise RuntimeError("CUDA out of memory")
    (span,) = exporter.get_finished_spans()
    assert span.status.status_code is StatusCode.ERROR
    assert span.events[0].name == "exception"


CORE_ONLY = """
import asyncio, importlib.abc, sys

BLOCKED = ("prometheus_client", "pynvml", "opentelemetry.sdk", "opentelemetry.exporter", "opentelemetry.instrumentation",
           "opentelemetry.semconv", "torch", "grpc")

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.startswith(BLOCKED):
            raise ImportError(f"blocked: {name}")

sys.meta_path.insert(0, Block())
import gpu_asgi
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

@gpu_asgi.gpu_bound()
async def generate(request):
    await request.body()
    with gpu_asgi.gpu_phase("generate", batch=1):
        pass
    return PlainTextResponse("ok")

app = Starlette(routes=[Route("/g", generate, methods=["POST"])])
app.add_middleware(gpu_asgi.GPUAdmissionMiddleware, ledger=gpu_asgi.Ledger(10**6),
                   estimator=gpu_asgi.LinearEstimator(bytes_per_token=1), sampler=gpu_asgi.DeviceSampler(),
                   thermal=gpu_asgi.ThermalPolicy(clamp_max_new_tokens=8), device_guard=gpu_asgi.DeviceGuard())
sent = []
async def receive():
    return {"type": "http.request", "body": b'{"prompt": "hi"}', "more_body": False}
async def send(message):
    sent.append(message)
scope = {"type": "http", "method": "POST", "path": "/g", "root_path": "", "headers": [(b"content-type", b"application/json")],
         "query_string": b"", "app": app}
asyncio.run(app(scope, receive, send))
assert sent[0]["status"] == 200, sent
asyncio.run(gpu_asgi.DeviceExecutor("cpu").run(lambda: None))
for make in (gpu_asgi.GPUMetrics, gpu_asgi.configure_tracing, lambda: gpu_asgi.NVMLProbe().read()):
    try:
        make()
    except RuntimeError as exc:
        print(exc)
    else:
        raise AssertionError(make)
print("leaked:", sorted(m for m in sys.modules if m.startswith(BLOCKED)))
"""


def test_core_works_without_the_optional_extras() -> None:
    """Only starlette + opentelemetry-api: everything imports, admits, and says which extra is missing."""
    done = subprocess.run([sys.executable, "-c", CORE_ONLY], check=False, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "pip install 'gpu_asgi[prometheus]'" in lines[0]
    assert "pip install 'gpu_asgi[otel]'" in lines[1]
    assert "pip install 'gpu_asgi[nvml]'" in lines[2]
    assert lines[3] == "leaked: []"
