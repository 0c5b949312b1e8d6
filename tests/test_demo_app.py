"""The demo service end to end, through the real app on the tiny CPU model."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from demo_service import BucketedEstimator, DemoSettings, LoadedModel, create_app
from gpu_asgi import AnalyticEstimator

from ._asgi import client, wait_until
from ._demo import (
    batcher_of,
    bytes_back_after_the_batch,
    ledger_of,
    loaded_model,
    model_dir,
    running,
    serving,
    settings,
)

PROBLEM = "application/problem+json"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return loaded_model(model_dir(tmp_path_factory))



def estimate(model: LoadedModel, prompt_tokens: int, max_new_tokens: int) -> int:
    base = AnalyticEstimator.from_config(model.model.config, dtype=model.dtype)
    return BucketedEstimator(base).estimate(prompt_tokens, max_new_tokens)


def test_the_sizes_docs_demo_md_gives_for_the_cpu_budget(model: LoadedModel) -> None:
    # docs/demo.md ("Why the CPU budget is 256 MiB") and docs/load-testing.md quote these.
    from demo_service._settings import DEFAULT_CPU_BUDGET_BYTES

    mib = 2**20
    figures = {(30, 128): 7.5, (250, 128): 9.0, (1000, 96): 21.9}
    assert {lengths: round(estimate(model, *lengths) / mib, 1) for lengths in figures} == figures
    assert DEFAULT_CPU_BUDGET_BYTES // estimate(model, 1000, 96) == 11  # eleven long documents fill it
    assert DEFAULT_CPU_BUDGET_BYTES // estimate(model, 30, 128) == 34


async def test_generate_returns_text_usage_and_the_admission(model: LoadedModel) -> None:
    prompt = "The quick brown fox jumps over the lazy dog."
    async with running(model) as app, client(app) as http:
        response = await http.post("/v1/generate", json={"prompt": prompt, "max_new_tokens": 6})
        again = await http.post("/v1/generate", json={"prompt": prompt, "max_new_tokens": 6})
        assert ledger_of(app).statistics().reserved_bytes == 0
    assert response.status_code == 200
    body = response.json()
    prompt_tokens = len(model.tokenizer.encode(prompt, add_special_tokens=False))
    assert body["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 6, "total_tokens": prompt_tokens + 6}
    assert body["finish_reason"] == "length" and body["text"]
    assert body["model"] == "qwen2-tiny"
    # The bytes gpu_asgi reserved: the analytic estimate of the bucketed lengths.
    assert body["admission"]["estimated_bytes"] == estimate(model, prompt_tokens, 6)
    assert body["admission"]["device"] == "cpu" and body["admission"]["batch_size"] == 1
    assert again.json()["text"] == body["text"]  # temperature 0 is greedy


async def test_overload_gets_503_with_retry_after(model: LoadedModel) -> None:
    one = estimate(model, 8, 64)  # the budget holds exactly one request like these
    async with running(model, budget_bytes=one, max_queue=0, batch_window_ms=0) as app, client(app) as http:
        bodies = [{"prompt": f"Request number {i} here", "max_new_tokens": 64} for i in range(4)]
        responses = await asyncio.gather(*(http.post("/v1/generate", json=body) for body in bodies))
        assert ledger_of(app).statistics().reserved_bytes == 0
    statuses = sorted(r.status_code for r in responses)
    assert statuses == [200, 503, 503, 503]
    for rejected in (r for r in responses if r.status_code == 503):
        assert rejected.headers["content-type"] == PROBLEM
        assert int(rejected.headers["retry-after"]) >= 1
        assert rejected.headers["x-gpu-admission-reason"] == "queue-full"
        assert rejected.json()["type"] == "urn:gpu-asgi:problem:queue-full"


async def test_overload_can_answer_429_and_a_request_that_never_fits_gets_413(model: LoadedModel) -> None:
    async with running(model, budget_bytes=estimate(model, 8, 16), max_queue=0, reject_status=429) as app:
        holder = ledger_of(app).try_reserve(1)  # someone holds a byte: nothing else fits
        async with client(app) as http:
            busy = await http.post("/v1/generate", json={"prompt": "hi there", "max_new_tokens": 16})
            huge = await http.post("/v1/generate", json={"prompt": "hi there", "max_new_tokens": 1024})
        holder.release()
    assert busy.status_code == 429 and "retry-after" in busy.headers
    assert huge.status_code == 413 and huge.json()["type"] == "urn:gpu-asgi:problem:exceeds-budget"


@pytest.mark.parametrize(
    ("path", "body", "status", "says"),
    [
        ("/v1/generate", b"{not json", 400, "not valid JSON"),
        ("/v1/generate", {"max_new_tokens": 5}, 422, "no prompt"),
        ("/v1/generate", {"prompt": "hi", "max_new_tokens": 0}, 422, "at least 1"),
        ("/v1/generate", {"prompt": "hi", "max_new_tokens": 5000}, 422, "at most 1024"),
        ("/v1/generate", {"prompt": "hi", "temperature": 3}, 422, "temperature"),
        ("/v1/generate", {"prompt": "hi", "colour": "red"}, 422, "colour"),
        ("/v1/completions", {"prompt": "hi", "n": 99}, 422, "'n' must be an integer from 1 to 8"),
        ("/v1/completions", {"prompt": "hi", "echo": True}, 422, "'echo' is not supported"),
        ("/v1/completions", {"prompt": [1, 2, 10**9]}, 422, "Token ids must be in"),
        ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "not served here"),
        ("/v1/chat/completions", {"messages": []}, 422, "non-empty list"),
        ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, 422, "role must be one of"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [{}]}, 422, "'tools'"),
    ],
)
async def test_bad_requests_get_a_clear_problem(
    model: LoadedModel, path: str, body: object, status: int, says: str
) -> None:
    async with running(model) as app, client(app) as http:
        if isinstance(body, bytes):
            response = await http.post(path, content=body, headers={"content-type": "application/json"})
        else:
            response = await http.post(path, json=body)
        assert ledger_of(app).statistics().reserved_bytes == 0
    assert response.status_code == status
    assert response.headers["content-type"] == PROBLEM
    problem = response.json()
    assert problem["status"] == status and problem["instance"] == path
    assert says in problem["detail"]


async def test_wrong_media_type_gets_415(model: LoadedModel) -> None:
    async with running(model) as app, client(app) as http:
        response = await http.post("/v1/generate", content=b"prompt=hi", headers={"content-type": "text/plain"})
    assert response.status_code == 415 and response.headers["content-type"] == PROBLEM


async def test_health_and_metrics(model: LoadedModel) -> None:
    async with running(model) as app, client(app) as http:
        await http.post("/v1/generate", json={"prompt": "hello", "max_new_tokens": 3})
        health = (await http.get("/health")).json()
        metrics = (await http.get("/metrics")).text
    assert health["status"] == "ok" and health["admitted_total"] == 1
    assert health["devices"][0]["name"] == "cpu" and health["devices"][0]["reserved_bytes"] == 0
    assert 'gpu_asgi_reserved_bytes{device="cpu"} 0.0' in metrics
    assert "gpu_asgi_queue_depth 0.0" in metrics
    assert "demo_batch_size_count 1.0" in metrics and "demo_generated_tokens_total 3.0" in metrics


def sse_post(port: int, path: str, payload: dict[str, object]) -> bytes:
    body = json.dumps(payload).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


async def test_stream_holds_its_reservation_until_the_end(model: LoadedModel) -> None:
    payload = {
        "messages": [{"role": "user", "content": "Tell me a story"}],
        "max_tokens": 48,
        "stream": True,
        "temperature": 0,
    }
    async with serving(model) as (app, port):
        ledger = ledger_of(app)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
            async with http.stream("POST", "/v1/chat/completions", json=payload) as response:
                lines = response.aiter_lines()
                first = await anext(lines)
                assert first.startswith("data: ") and response.headers["content-type"].startswith("text/event-stream")
                held = ledger.statistics().reserved_bytes
                events = [first] + [line async for line in lines]
            await wait_until(lambda: ledger.statistics().reserved_bytes == 0)
    assert held > 0  # the first token is out, the rest is being generated: the bytes are held
    data = [line[6:] for line in events if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert ledger.statistics().in_flight == 0


async def test_client_that_disconnects_mid_stream_frees_its_bytes_and_stops_generating(model: LoadedModel) -> None:
    payload = {"prompt": "Once upon a time", "max_tokens": 1024, "stream": True, "temperature": 0}
    async with serving(model) as (app, port):
        ledger, batcher = ledger_of(app), batcher_of(app)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(sse_post(port, "/v1/completions", payload))
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"data: "), 30)
        assert head.startswith(b"HTTP/1.1 200")
        assert ledger.statistics().reserved_bytes > 0
        writer.close()  # the client goes away after the first token
        # The bytes came back only once the batch had left the device, and it stopped early:
        # far fewer than 1,024 tokens were generated.
        assert await bytes_back_after_the_batch(app)
        await wait_until(lambda: batcher.idle, timeout=60)
        assert batcher.tokens_generated < 200
        # And the device is free for the next request at once.
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
            after = await asyncio.wait_for(http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}), 30)
    assert after.status_code == 200
    assert ledger.statistics().in_flight == 0


async def test_each_request_is_traced_and_so_is_its_batch(model: LoadedModel) -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    # The batch forms when both are in (max_batch_size), not when a window ends: no race with a busy machine.
    app = create_app(
        settings(tracing=True, batch_window_ms=60_000, max_batch_size=2), model=model, tracer_provider=provider
    )
    async with app.router.lifespan_context(app), client(app) as http:
        await wait_until(lambda: app.state.lifecycle.ready)
        exporter.clear()  # the warm-up generation's span (ended on the device thread before ready)
        bodies = [{"prompt": f"Trace me {i}", "max_new_tokens": 3} for i in range(2)]
        await asyncio.gather(*(http.post("/v1/generate", json=body) for body in bodies))
        await wait_until(lambda: sum(s.name == "gpu_asgi.generate" for s in exporter.get_finished_spans()) == 3)
    spans = exporter.get_finished_spans()
    servers = [s for s in spans if s.name == "POST /v1/generate"]
    assert len(servers) == 2
    for server in servers:  # each request: admission, the wait for a batch, its share of the batch
        mine = {s.name: s for s in spans if s.context.trace_id == server.context.trace_id and s.parent is not None}
        for name in ("gpu_asgi.queue_wait", "gpu_asgi.batch_wait", "gpu_asgi.generate"):
            assert mine[name].parent.span_id == server.context.span_id, name
        assert mine["gpu_asgi.generate"].attributes["gpu_asgi.batch_size"] == 2
        assert mine["gpu_asgi.generate"].attributes["gen_ai.usage.output_tokens"] == 3
    (batch,) = [s for s in spans if s.name == "demo_service.batch"]
    assert {link.context.span_id for link in batch.links} == {s.context.span_id for s in servers}
    inside = {s.name for s in spans if s.parent is not None and s.parent.span_id == batch.context.span_id}
    assert inside == {"gpu_asgi.host_to_device", "gpu_asgi.generate"}


async def test_tracing_setting_alone_configures_tracing_as_under_uvicorn_factory(
    model: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `uvicorn --factory demo_service:create_app` passes no provider: DEMO_TRACING must be enough.
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    import demo_service._app as demo_app
    from gpu_asgi import configure_tracing

    exporter = InMemorySpanExporter()
    providers = []

    def configure(**options: object) -> object:  # the real one, exporting in memory and not installed globally
        providers.append(configure_tracing(**options, exporter=exporter, batch=True, set_global=False))  # type: ignore[arg-type]
        return providers[-1]

    monkeypatch.setattr(demo_app, "configure_tracing", configure)
    app = create_app(settings(tracing=True), model=model)
    async with app.router.lifespan_context(app), client(app) as http:
        answer = await http.post("/v1/generate", json={"prompt": "Trace me", "max_new_tokens": 2})
    assert answer.status_code == 200 and len(providers) == 1
    # the lifespan's end flushed the batch processor: the spans are exported without a manual shutdown
    names = {span.name for span in exporter.get_finished_spans()}
    assert {"POST /v1/generate", "gpu_asgi.queue_wait", "gpu_asgi.generate"} <= names


def test_settings_come_from_the_environment_and_the_command_line(monkeypatch: pytest.MonkeyPatch) -> None:
    from pydantic_settings import CliApp

    monkeypatch.setenv("MODEL_PATH", "/models/qwen2-awq")
    monkeypatch.setenv("DEMO_PORT", "9001")
    monkeypatch.setenv("DEMO_BATCH_WINDOW_MS", "5")
    settings = CliApp.run(DemoSettings, cli_args=["--port", "9002", "--int8", "--max-batch-size", "4"])
    assert (settings.model_path, settings.port, settings.int8) == ("/models/qwen2-awq", 9002, True)
    assert (settings.batch_window_ms, settings.max_batch_size) == (5.0, 4)
    with pytest.raises(ValueError, match="int8 is CPU-only"):
        DemoSettings(int8=True, device="cuda:0")


def test_the_command_line_help_runs(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "demo_service", "--help"], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0
    assert "--model-path" in result.stdout and "--batch-window-ms" in result.stdout
